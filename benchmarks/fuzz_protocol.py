"""Fuzzing the wire layer: random and mutated inputs to every decoder; only RemoteProtocolError may escape.

Four targets, taken in turn:

- ``envelope``: mutated valid envelopes (and random bytes) through ``Opener.open_any``; mostly refused by
  the size, structure or signature checks, and any accepted input must be byte-identical to a genuine
  envelope (a mutation can undo itself), else it counts as a failure: a forgery got through;
- ``signed``: mutated *bodies* sealed with a valid key, so they pass the signature and reach the
  message decoders through the envelope (the path a malicious but authenticated peer takes);
- ``message``: mutated bodies and structure-aware random maps straight into ``Message.decode``;
- ``tensor``: mutated blobs and structure-aware random headers into ``codec.decode``.

Mutations: bit flips, random bytes, interesting bytes (msgpack markers, 0x00/0x7f/0x80/0xff), insertions,
deletions, duplicated ranges, truncations, splices of two seeds. Deterministic for a given seed.

    parallax bench fuzz --count 100000 --seed 0
"""

from __future__ import annotations

import random
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from parallax.benchmarks.report import write_report
from parallax.protocol import codec
from parallax.protocol.envelope import Opener, Sealer
from parallax.protocol.errors import LocalProtocolError, RemoteProtocolError
from parallax.protocol.identity import Identity
from parallax.protocol.messages import (
    KINDS,
    Deathrattle,
    ExpertSnapshot,
    Heartbeat,
    Message,
    OuterRound,
    ShardClaim,
    ShardRelease,
    Sketch,
    StateOffer,
    StatePart,
    StateRequest,
    SurrogateDelta,
    SurrogatePayload,
    WorkerResult,
)

RUN = "fuzz-run"
TARGETS = ("envelope", "signed", "message", "tensor")
_INTERESTING = bytes([0x00, 0x01, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC5,
                      0xC6, 0xC7, 0xCA, 0xCB, 0xCC, 0xCF, 0xD0, 0xD3, 0xD4, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF,
                      0xE0, 0xFF])
_TENSOR_LIMITS = codec.TensorLimits(max_elements=1 << 16, dtypes=frozenset(codec.DTYPES))


@dataclass
class FuzzReport:
    """What a fuzz run did. ``unexpected`` must be 0: any other exception is a bug."""

    count: int
    seed: int
    seconds: float = 0.0
    per_target: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    unexpected: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)

    def markdown(self) -> str:
        rows = [
            "| target | inputs | accepted | refused (RemoteProtocolError) |",
            "|---|---:|---:|---:|",
        ]
        for t in TARGETS:
            n, ok = self.per_target.get(t, 0), self.accepted.get(t, 0)
            rows.append(f"| {t} | {n} | {ok} | {n - ok} |")
        rows.append(f"\n{self.count} inputs, seed {self.seed}, {self.seconds:.1f} s: "
                    f"**{self.unexpected} exceptions other than RemoteProtocolError**")
        top = ", ".join(f"{k} {v}" for k, v in sorted(self.refusals.items(), key=lambda kv: -kv[1]))
        rows.append(f"\nRefusals by class: {top}")
        return "\n".join(rows)


def _tensor_seeds() -> list[bytes]:
    r = np.random.default_rng(0)
    x = r.standard_normal((4, 6)).astype(np.float32)
    seeds = [codec.encode(x, c, chunk=8, rank=2) for c in sorted(codec.CODECS)]
    seeds += [codec.encode(np.arange(5, dtype=d)) for d in sorted(codec.DTYPES)]
    seeds.append(codec.encode(np.zeros((0, 3), np.float32), "int4"))
    return seeds


def _message_seeds() -> list[Message]:
    blob = codec.encode(np.ones((2, 3), np.float32))
    return [
        Heartbeat(peer_id="QmPeer", addresses=("/ip4/10.0.0.1/tcp/1",), role="composer", capacity=1.5,
                  shards=((0, 3), (1, 5)), step=120, versions={"attn": 4}, loss=2.5),
        Deathrattle(peer_id="QmPeer", step=7, reason="bye"),
        ShardClaim(layer=2, expert=7, lease_expiry=1.7e9, step=9),
        ShardRelease(layer=2, expert=7, heir="QmHeir"),
        SurrogateDelta(layer=1, expert=2, version=3, base_version=2, rank=8, digest=b"\x01" * 32, size=4096),
        SurrogatePayload(layer=1, expert=2, version=3, tensors={"left": blob}),
        ExpertSnapshot(layer=0, expert=1, step=50, tensors={"w1": blob}),
        OuterRound(group="attn", round=4, step=400, tokens=10**6, num_peers=3, fingerprint=b"\x02" * 32),
        StateRequest(groups=("attn",), experts=((0, 1),)),
        StateOffer(peer_id="QmPeer", step=400, versions={"attn": 4}, size=10**8),
        StatePart(group="attn", version=4, index=0, total=2, tensors={"wq": blob}),
        Sketch(layer=0, expert=1, step=3, tokens=2, tensors={"x": blob, "g": blob}),
        WorkerResult(layer=0, expert=1, step=3, tensors={"w1": blob}, loss=0.5),
    ]


def _random_value(rnd: random.Random, depth: int = 0) -> object:
    choice = rnd.randrange(10 if depth < 3 else 7)
    if choice == 0:
        return None
    if choice == 1:
        return rnd.random() < 0.5
    if choice == 2:
        return rnd.choice([0, 1, -1, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32, 2**63 - 1, 2**64 - 1,
                           -(2**63), rnd.randrange(-1000, 1000)])
    if choice == 3:
        return rnd.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308, 5e-324, rnd.random()])
    if choice == 4:
        return "".join(rnd.choice("ab/\x00é\U0001f600") for _ in range(rnd.randrange(8)))
    if choice == 5:
        return rnd.randbytes(rnd.choice([0, 1, 31, 32, 33, rnd.randrange(100)]))
    if choice == 6:
        return rnd.choice(["composer", "worker", "float32", "int8", "raw", "lowrank", "x", "g", "gate"])
    if choice in (7, 8):
        return [_random_value(rnd, depth + 1) for _ in range(rnd.randrange(5))]
    return {str(_random_value(rnd, depth + 1))[:10]: _random_value(rnd, depth + 1) for _ in range(rnd.randrange(5))}


def mutate(data: bytes, rnd: random.Random, other: bytes = b"") -> bytes:
    """One to four random mutations of ``data``."""
    buf = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(8)
        pos = rnd.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rnd.randrange(8)
        elif op == 1 and buf:
            buf[min(pos, len(buf) - 1)] = rnd.randrange(256)
        elif op == 2 and buf:
            buf[min(pos, len(buf) - 1)] = rnd.choice(_INTERESTING)
        elif op == 3:
            buf[pos:pos] = rnd.randbytes(rnd.randint(1, 16))
        elif op == 4:
            del buf[pos : pos + rnd.randint(1, 32)]
        elif op == 5:
            end = min(len(buf), pos + rnd.randint(1, 64))
            buf[pos:pos] = buf[pos:end]
        elif op == 6:
            del buf[pos:]
        elif other:
            cut = rnd.randrange(len(other) + 1)
            buf = buf[:pos] + bytearray(other[cut:])
    return bytes(buf)


class _Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.clock = 1_700_000_000.0
        self.identity = Identity.from_seed(bytes(range(32)))
        self.sealer = Sealer(self.identity, RUN, now=lambda: self.clock, first_seq=1)
        self.opener = Opener(RUN, window_s=1e9, now=lambda: self.clock)
        self.messages = _message_seeds()
        self.bodies = [m.encode() for m in self.messages]
        self.envelopes = [self.sealer.seal(m) for m in self.messages]
        self.genuine = frozenset(self.envelopes)
        self.tensors = _tensor_seeds()

    def envelope(self) -> bool:
        rnd = self.rnd
        if rnd.random() < 0.05:
            data = rnd.randbytes(rnd.randrange(400))
        else:
            data = mutate(rnd.choice(self.envelopes), rnd, rnd.choice(self.envelopes))
        self.opener.open_any(data, check_replay=rnd.random() < 0.5)
        if data not in self.genuine:  # a mutation may undo itself; anything else accepted is a forgery
            raise AssertionError(f"accepted a forged envelope: {data[:80]!r}")
        return True

    def signed(self) -> bool:
        rnd = self.rnd
        i = rnd.randrange(len(self.messages))
        kind = self.messages[i].KIND
        body = mutate(self.bodies[i], rnd, rnd.choice(self.bodies))
        try:
            data = self.sealer.seal_body(kind, body)
        except LocalProtocolError:
            return False  # our own sealer refused it (too large): not an input to the decoder
        KINDS[kind].decode(self.opener.open_any(data).envelope.body)
        return True

    def message(self) -> bool:
        rnd = self.rnd
        i = rnd.randrange(len(self.messages))
        cls = type(self.messages[i])
        if rnd.random() < 0.5:
            body = mutate(self.bodies[i], rnd, rnd.choice(self.bodies))
        else:
            good = msgpack.unpackb(self.bodies[i])
            obj = {k: (_random_value(rnd) if rnd.random() < 0.3 else v) for k, v in good.items()}
            if rnd.random() < 0.2:
                obj[str(_random_value(rnd))[:10]] = _random_value(rnd)
            body = msgpack.packb(obj, use_bin_type=True)
        back = cls.decode(body)
        if back.encode() != cls.decode(back.encode()).encode():  # accepted input must re-encode stably
            raise AssertionError(f"{cls.KIND}: re-encoding is not stable")
        return True

    def tensor(self) -> bool:
        rnd = self.rnd
        if rnd.random() < 0.3:
            header = [
                rnd.choice(sorted(codec.CODECS) + ["", "zip"]),
                rnd.choice(sorted(codec.DTYPES) + ["bool", "complex64"]),
                [rnd.choice([0, 1, 2, 3, 7, 8, 255, 2**20, -1]) for _ in range(rnd.randrange(4))],
                [rnd.choice([0, 1, 2, 3, 8, 1024, 2**20, 2**21, -1]) for _ in range(rnd.randrange(3))],
                rnd.randbytes(rnd.randrange(300)),
            ]
            blob = msgpack.packb(header, use_bin_type=True)
        else:
            blob = mutate(rnd.choice(self.tensors), rnd, rnd.choice(self.tensors))
        codec.decode(blob, _TENSOR_LIMITS)
        return True


def run_fuzz(count: int = 100_000, seed: int = 0, *, max_examples: int = 10) -> FuzzReport:
    """Feed ``count`` inputs to the decoders; count refusals and any other exception (a bug)."""
    fuzzer = _Fuzzer(seed)
    report = FuzzReport(count=count, seed=seed)
    per_target: Counter[str] = Counter()
    accepted: Counter[str] = Counter()
    refusals: Counter[str] = Counter()
    start = time.perf_counter()
    for i in range(count):
        target = TARGETS[i % len(TARGETS)]
        per_target[target] += 1
        fuzzer.clock += 0.001
        try:
            if getattr(fuzzer, target)():
                accepted[target] += 1
        except RemoteProtocolError as e:
            refusals[type(e).__name__] += 1
        except Exception as e:  # the point of the exercise: anything else is a bug
            report.unexpected += 1
            if len(report.examples) < max_examples:
                report.examples.append(
                    {"target": target, "error": repr(e)[:300], "traceback": traceback.format_exc()[-1500:]}
                )
    report.seconds = time.perf_counter() - start
    report.per_target, report.accepted, report.refusals = dict(per_target), dict(accepted), dict(refusals)
    return report


def write(report: FuzzReport, json_path: str | Path | None) -> None:
    """Write the report as JSON to ``json_path`` and as markdown beside it (``.md``)."""
    write_report(asdict(report), report.markdown(), json_path)
