"""Wire-layer throughput: sign + verify of envelopes against raw Ed25519, and the tensor codecs in MB/s.

Envelopes. For sizes of 256 B, 64 KiB and 4 MiB (the whole envelope), one operation is
``Sealer.seal_body`` + ``Opener.open_envelope`` (every check, the replay cache included); the reference
is ``cryptography``'s Ed25519 ``sign`` + ``verify`` of the same number of bytes with pre-loaded keys.
``ratio`` = our throughput / the reference's (target >= 0.8). Blocks of the two alternate and the best
block of each counts, so a busy shared machine disturbs both alike.

Codecs. A 1 Mi-element float32 tensor (4 MiB, Gaussian); ``lowrank`` a 1024 x 1024 matrix at rank 8.
MB/s is of the float32 input (MB = 10^6 bytes), best of several runs.

    parallax bench protocol --json results/protocol.json
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from parallax.benchmarks.report import write_report
from parallax.protocol import codec
from parallax.protocol.envelope import Opener, Sealer
from parallax.protocol.identity import Identity
from parallax.protocol.messages import ExpertSnapshot

SIZES = (256, 64 * 1024, 4 * 1024 * 1024)
RUN = "bench-run"
KIND = ExpertSnapshot.KIND


def _best_per_op(fn: Callable[[], object], ops: int) -> float:
    t = time.perf_counter()
    for _ in range(ops):
        fn()
    return (time.perf_counter() - t) / ops


def _body_for(sealer: Sealer, size: int) -> bytes:
    """A body that makes the whole envelope exactly ``size`` bytes."""
    n = size - 64 - 80
    for _ in range(4):
        got = len(sealer.seal_body(KIND, bytes(n)))
        n += size - got
    return os.urandom(n)


def bench_envelopes(seconds: float = 1.0, repeats: int = 5) -> list[dict[str, Any]]:
    identity = Identity.from_seed(bytes(range(32)))
    sealer = Sealer(identity, RUN)
    opener = Opener(RUN)
    raw_sk = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    raw_pk = raw_sk.public_key()
    rows = []
    for size in SIZES:
        body = _body_for(sealer, size)
        envelope = sealer.seal_body(KIND, body)
        if len(envelope) != size:
            raise RuntimeError(f"benchmark set-up: envelope of {len(envelope)} bytes, wanted {size}")

        def ours(body: bytes = body) -> None:
            opener.open_envelope(sealer.seal_body(KIND, body), expect=(ExpertSnapshot,))

        def raw(data: bytes = envelope) -> None:
            raw_pk.verify(raw_sk.sign(data), data)

        probe = _best_per_op(raw, 3)
        ops = max(3, int(seconds / repeats / max(probe, 1e-9)))
        ours_s, raw_s = [], []
        for _ in range(repeats):
            ours_s.append(_best_per_op(ours, ops))
            raw_s.append(_best_per_op(raw, ops))
        best_ours, best_raw = min(ours_s), min(raw_s)
        rows.append(
            {
                "size_bytes": size,
                "ops_per_block": ops,
                "ours_us": best_ours * 1e6,
                "raw_us": best_raw * 1e6,
                "ours_MBps": size / best_ours / 1e6,
                "raw_MBps": size / best_raw / 1e6,
                "ratio": best_raw / best_ours,
            }
        )
    return rows


def bench_codecs(repeats: int = 5) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    vector = rng.standard_normal(1 << 20).astype(np.float32)
    matrix = rng.standard_normal((1024, 1024)).astype(np.float32)
    limits = codec.TensorLimits(max_elements=1 << 22)
    rows = []
    for name in ("raw", "fp16", "int8", "int4", "ternary", "lowrank"):
        x = matrix if name == "lowrank" else vector
        blob = codec.encode(x, name)
        enc = min(_best_per_op(functools.partial(codec.encode, x, name), 1) for _ in range(repeats))
        dec = min(_best_per_op(functools.partial(codec.decode, blob, limits), 1) for _ in range(repeats))
        y = codec.decode(blob, limits)
        rows.append(
            {
                "codec": name,
                "shape": list(x.shape),
                "bits_per_weight": len(blob) * 8 / x.size,
                "encode_MBps": x.nbytes / enc / 1e6,
                "decode_MBps": x.nbytes / dec / 1e6,
                "rel_l2_error": float(np.linalg.norm(x - y) / np.linalg.norm(x)),
            }
        )
    return rows


def run_protocol(seconds: float = 1.0) -> dict[str, Any]:
    """Both benchmarks, as one JSON-able report."""
    return {
        "benchmark": "protocol",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "envelopes": bench_envelopes(seconds),
        "codecs": bench_codecs(),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "### Envelope sign + verify vs raw Ed25519 (target ratio >= 0.8)",
        "",
        "| envelope | ours (µs) | raw (µs) | ours MB/s | raw MB/s | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["envelopes"]:
        size = r["size_bytes"]
        label = f"{size} B" if size < 1024 else f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        lines.append(
            f"| {label} | {r['ours_us']:.1f} | {r['raw_us']:.1f} | {r['ours_MBps']:.1f} | "
            f"{r['raw_MBps']:.1f} | {r['ratio']:.3f} |"
        )
    lines += [
        "",
        "### Tensor codecs (float32 input; lowrank: 1024 x 1024 at rank 8, Gaussian, so error is high)",
        "",
        "| codec | bits/weight | encode MB/s | decode MB/s | rel. L2 error |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in report["codecs"]:
        lines.append(
            f"| {r['codec']} | {r['bits_per_weight']:.2f} | {r['encode_MBps']:.0f} | {r['decode_MBps']:.0f} | "
            f"{r['rel_l2_error']:.4f} |"
        )
    return "\n".join(lines)


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)
