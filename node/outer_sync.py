"""Tiered outer sync over the network: one hivemind ``DecentralizedAverager`` per shared group.

DESIGN.md section 4. Every H_G inner steps the composers of a run merge the pseudo-gradients of
shared group G and each applies the same Nesterov outer step (``Composer.apply_outer``). This module
does the merge between processes, computing what ``parallax.node.rda.merge_groups`` computes in one.

One round of a group (``GroupAverager.run_round``):

1. Pack (``component_tensors``). RDA needs three weighted means, so the averaged buffers are, per
   tensor, the unit direction scaled by sqrt(numel) (entries of order 1, so fp16 keeps its digits),
   one tensor holding every tensor's norm, and per tensor the raw delta (the fallback when the
   directions cancel). "mean" averages only the raw deltas.
2. All-reduce. hivemind forms a group under the prefix ``{run_id}/outer/{group}`` (at once when
   ``target_group_size`` peers are looking, else with whoever came within ``min_matchmaking_time``)
   and replaces every buffer in place by the token-weighted mean sum_i w_i x_i / sum_i w_i.
   ``gather`` carries each peer's round number and token count, so every participant learns the
   same participant list.
3. Rebuild (``merged_from_components``): ``rda_rebuild`` per tensor.
4. Verify (HIVEMIND.md trap 3: a peer dying mid-all-reduce leaves the survivors with different
   tensors while ``step()`` reports success). Each participant stores a fingerprint of its merged
   tensors (``fingerprint``: seeded random projections and norms, about 260 bytes) in the DHT under
   ``{run_id}/outer/{group}/round/{n}``, subkey = its libp2p peer id, and keeps its result only when
   a strict majority of the round's participants (its own fingerprint included) agree with it
   within the compression's tolerance. Peers never agree bit for bit: hivemind returns to each peer
   ``local + compress(mean - local)``, so each peer's rounding differs; hence a tolerance, not a hash.

Any failure returns ``None`` (the caller skips the outer step; nothing was applied) and
``GroupAverager.last_report`` says why. A peer whose report is ``DIVERGED`` or ``UNVERIFIED`` did
not apply a round that others may have applied: its shared group now differs from theirs and it
should reload the group from peers (``load_state_from_peers``, the joiner's path) before the next
round. That reload is the node's job (not wired yet); ``serve_state`` is the serving half.

Concurrency: ``run_round`` blocks the calling thread (the node's outer-sync thread; the training
loop meets it at one seam) for at most ``OuterSyncConfig.round_budget_s``. Each averager is a
hivemind child process forked at construction; it shares the buffers with us through shared
memory, guarded by its lock. Construct in the main thread when you can: hivemind's averager sets
SIGINT to "ignore" around its fork (trap 4); we restore the previous handler at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import math
import signal
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, SizeAdaptiveCompression

from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.keys import check_run_id
from parallax.errors import NodeError
from parallax.node.rda import DIRECTION_EPS, MERGE_METHODS, rda_components, rda_rebuild

if TYPE_CHECKING:
    from parallax.node.composer import Composer

logger = logging.getLogger(__name__)

__all__ = [
    "GroupAverager",
    "OuterSyncConfig",
    "ParallaxOuterAverager",
    "RoundReport",
    "RoundStatus",
    "TieredOuterSync",
    "component_shapes",
    "component_tensors",
    "decode_fingerprint",
    "encode_fingerprint",
    "fingerprint",
    "fingerprints_agree",
    "round_tag",
    "majority_agrees",
    "merged_from_components",
    "outer_prefix",
    "payload_bytes",
    "round_key",
]

COMPRESSIONS = ("fp16", "none")
SMALL_TENSOR_NUMEL = 4096
"""Tensors (parts) smaller than this are sent uncompressed under "fp16": the norms, biases and
norm-layer weights cost nothing and keep full precision."""
MIN_WEIGHT = 1e-3
"""Averaging weight of a peer that processed no tokens: hivemind's all-zero weights give NaN (trap 12)."""
FP_SLOTS = 16
"""Fingerprint size bound: tensors share slots (index mod FP_SLOTS), each slot 4 floats."""
FP_BLOCK = 4096
"""Projections use a +-1 vector of this length, its blocks flipped by a hashed sign per block."""
_FP_FIELDS = 4  # per slot: projection 1, projection 2, norm, scale
_FP_MAGIC = b"PXF2"
_TAG_BYTES = 8
_FP_SEED = 0x5058_4F53  # "PXOS"
_BUFFER_LOCK_TIMEOUT_S = 5.0
_VERIFY_POLL_S = 0.05
_GATHER_VERSION = 1


# ---- config ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterSyncConfig:
    """How a node merges its shared groups over the network. Defaults suit peers on the internet;
    ``OuterSyncConfig.loopback()`` suits tests on one machine. Times in seconds."""

    method: str = "rda"
    """"rda" (radial-directional) or "mean"; every peer of a run must use the same."""
    compression: str = "fp16"
    """Wire format of the all-reduce: "fp16" (half the traffic) or "none" (fp32)."""
    target_group_size: int = 16
    """A round starts at once when this many peers are looking: set it to the live composer count."""
    min_group_size: int = 2
    """Fewer peers than this is no round (returns None)."""
    min_matchmaking_time_s: float = 15.0
    """With fewer than target_group_size peers, wait this long for more before averaging with those present
    (internet: 15, covering peers whose inner steps run a few seconds apart; loopback: 1)."""
    request_timeout_s: float = 5.0
    """A matchmaking request to one peer is lost after this long; must be < min_matchmaking_time_s."""
    matchmaking_timeout_s: float = 60.0
    """Give up the round when no group formed within this long (> min_matchmaking_time_s)."""
    allreduce_timeout_s: float = 300.0
    """Give up an all-reduce that has not finished this long after the group formed (internet: 300 s is
    ~1 GB of fp16 pseudo-gradient over a 30 Mbit/s uplink; loopback: 20)."""
    next_chunk_timeout_s: float = 30.0
    """A groupmate that sends no chunk for this long is dropped from the all-reduce (the round is then
    inconsistent and verification discards it)."""
    verify_timeout_s: float = 15.0
    """Wait at most this long for the participants' fingerprints in the DHT (loopback: 3)."""
    dht_timeout_s: float = 5.0
    """Each DHT store/get of a fingerprint."""
    fingerprint_ttl_s: float = 600.0
    """Fingerprint records expire after this long (only the round just run is read)."""
    fingerprint_tolerance: float | None = None
    """Two merged results agree when every projection and norm differs by at most this times their scale;
    None: by compression (fp16 2e-2, none 1e-5), far above rounding noise, far below a broken round."""
    direction_eps: float | None = None
    """RDA falls back to the plain mean below this length of the mean unit direction; None: by compression.
    fp16 gives the mean direction ~3e-4 of noise per peer and the rebuilt direction amplifies it by
    1/length, so under fp16 we fall back below 0.05 (rda.DIRECTION_EPS, 1e-6, when uncompressed)."""
    startup_timeout_s: float = 60.0
    """Starting an averager process (busy hosts need 30-120 s)."""
    shutdown_timeout_s: float = 5.0
    """Grace period of an averager process at shutdown before it is terminated."""

    def __post_init__(self) -> None:
        if self.method not in MERGE_METHODS:
            raise ValueError(f"OuterSyncConfig.method must be one of {MERGE_METHODS}, got {self.method!r}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"OuterSyncConfig.compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if self.min_group_size < 2 or self.target_group_size < self.min_group_size:
            raise ValueError("OuterSyncConfig needs 2 <= min_group_size <= target_group_size")
        for name in ("min_matchmaking_time_s", "request_timeout_s", "matchmaking_timeout_s", "allreduce_timeout_s",
                     "next_chunk_timeout_s", "verify_timeout_s", "dht_timeout_s", "fingerprint_ttl_s",
                     "startup_timeout_s", "shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"OuterSyncConfig.{name} must be > 0 seconds")
        if self.request_timeout_s >= self.min_matchmaking_time_s:
            raise ValueError("OuterSyncConfig: request_timeout_s must be < min_matchmaking_time_s (hivemind can "
                             "deadlock otherwise); lower request_timeout_s or raise min_matchmaking_time_s")
        if self.matchmaking_timeout_s <= self.min_matchmaking_time_s:
            raise ValueError("OuterSyncConfig: matchmaking_timeout_s must exceed min_matchmaking_time_s, or no group "
                             "smaller than target_group_size can ever form")
        for name in ("fingerprint_tolerance", "direction_eps"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"OuterSyncConfig.{name} must be in (0, 1) or None, got {value}")

    @classmethod
    def loopback(cls, **overrides: Any) -> OuterSyncConfig:
        """Timings for peers on one machine (tests, ``parallax swarm local``)."""
        base: dict[str, Any] = dict(min_matchmaking_time_s=1.0, request_timeout_s=0.5, matchmaking_timeout_s=4.0,
                                    allreduce_timeout_s=20.0, next_chunk_timeout_s=5.0, verify_timeout_s=3.0,
                                    dht_timeout_s=2.0, startup_timeout_s=30.0, shutdown_timeout_s=3.0)
        return cls(**{**base, **overrides})

    @property
    def tolerance(self) -> float:
        if self.fingerprint_tolerance is not None:
            return self.fingerprint_tolerance
        return 2e-2 if self.compression == "fp16" else 1e-5

    @property
    def rda_eps(self) -> float:
        if self.direction_eps is not None:
            return self.direction_eps
        return 0.05 if self.compression == "fp16" else DIRECTION_EPS

    @property
    def round_budget_s(self) -> float:
        """The longest ``run_round`` blocks: matchmaking, all-reduce, verification, and slack."""
        return (self.matchmaking_timeout_s + self.allreduce_timeout_s + self.verify_timeout_s
                + 2 * self.dht_timeout_s + _BUFFER_LOCK_TIMEOUT_S)

    def hivemind_compression(self) -> CompressionBase:
        if self.compression == "none":
            return NoCompression()
        return SizeAdaptiveCompression(SMALL_TENSOR_NUMEL, less=NoCompression(), greater_equal=Float16Compression())


# ---- names ----------------------------------------------------------------------------------------
# Candidates for dht/keys.py (the one file that names DHT keys); kept here until that file takes them.


def payload_bytes(shapes: Mapping[str, Sequence[int]], config: OuterSyncConfig) -> int:
    """Bytes of one peer's averaged buffers of a group on the wire (hivemind does not count them): the RDA
    components at 2 bytes per entry under fp16 for tensors of SMALL_TENSOR_NUMEL entries or more, else 4."""
    fp16 = config.compression == "fp16"
    total = 0
    for shape in component_shapes(shapes, config.method):
        numel = torch.Size(shape).numel()
        total += numel * (2 if fp16 and numel >= SMALL_TENSOR_NUMEL else 4)
    return total


def outer_prefix(run_id: str, group: str) -> str:
    """The averager prefix (and P2P namespace) of one shared group: ``{run_id}/outer/{group}``.

    Raises:
        ValueError: an invalid run id or group name; hivemind refuses '.' in prefixes.
    """
    check_run_id(run_id)
    if "." in run_id or not group or "." in group or "/" in group:
        raise ValueError(f"run id {run_id!r} and group {group!r} must not contain '.' (hivemind's averager "
                         "uses it as a separator); the group must be non-empty and contain no '/'")
    return f"{run_id}/outer/{group}"


def round_key(run_id: str, group: str, round_id: int) -> str:
    """The DHT key of round ``round_id``'s fingerprints (subkey: participant's peer id)."""
    return f"{outer_prefix(run_id, group)}/round/{int(round_id)}"


# ---- pure parts: pack, rebuild, fingerprint --------------------------------------------------------


def _direction_scale(numel: int) -> float:
    # A unit vector of n entries has entries ~1/sqrt(n); times sqrt(n) they are O(1), where fp16 is exact
    # to 3 digits instead of sinking into subnormals. The same constant on every peer: the mean scales too.
    return math.sqrt(max(numel, 1))


def component_shapes(shapes: Mapping[str, Sequence[int]], method: str) -> list[torch.Size]:
    """Shapes of the averaged buffers for a group with tensors ``shapes`` (see ``component_tensors``)."""
    if method not in MERGE_METHODS:
        raise ValueError(f"merge method must be one of {MERGE_METHODS}, got {method!r}")
    sizes = [torch.Size(s) for s in shapes.values()]
    if method == "mean":
        return sizes
    return sizes + [torch.Size([len(sizes)])] + sizes


def component_tensors(delta: Mapping[str, torch.Tensor], method: str) -> list[torch.Tensor]:
    """What one peer puts into the all-reduce for its pseudo-gradient ``delta`` (CPU float32).

    Args:
        delta: name -> pseudo-gradient of one group.
        method: "rda": [direction_t * sqrt(numel_t) for each t] + [norms, shape [T]] + [delta_t for each t];
            "mean": [delta_t for each t].

    Returns:
        The buffers in that order. Their token-weighted means give ``merged_from_components`` what
        ``rda.merge_groups`` computes from all peers' deltas.
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"merge method must be one of {MERGE_METHODS}, got {method!r}")
    deltas = [d.detach().to(device="cpu", dtype=torch.float32) for d in delta.values()]
    if method == "mean":
        return deltas
    directions, norms = [], []
    for d in deltas:
        direction, norm_1 = rda_components(d)
        directions.append(direction.mul_(_direction_scale(d.numel())))
        norms.append(norm_1)
    norms_T = torch.cat(norms) if norms else torch.zeros(0)
    return directions + [norms_T] + deltas


def merged_from_components(
    means: Sequence[torch.Tensor], shapes: Mapping[str, Sequence[int]], method: str, *, eps: float = DIRECTION_EPS
) -> dict[str, torch.Tensor]:
    """Finish the merge from the weighted means of ``component_tensors``.

    Args:
        means: the averaged buffers, in ``component_shapes`` order.
        shapes: name -> shape of the group's tensors, in the same order as when packing.
        method: "rda" or "mean".
        eps: RDA falls back to the mean delta when the mean direction is shorter than this.

    Returns:
        name -> merged pseudo-gradient (CPU float32, new tensors not sharing the inputs' memory).

    Raises:
        ValueError: the buffers do not match ``component_shapes(shapes, method)``.
    """
    expected = component_shapes(shapes, method)
    got = [m.shape for m in means]
    if got != expected:
        raise ValueError(f"averaged buffers have shapes {got}, expected {expected}")
    names = list(shapes)
    if method == "mean":
        return {n: m.detach().to(torch.float32).clone() for n, m in zip(names, means, strict=True)}
    k = len(names)
    directions, norms_T, deltas = means[:k], means[k], means[k + 1:]
    return {
        name: rda_rebuild(directions[i] / _direction_scale(directions[i].numel()), norms_T[i:i + 1], deltas[i],
                          eps=eps)
        for i, name in enumerate(names)
    }


def _hash_signs(n: int, seed: int) -> np.ndarray:
    """n pseudo-random +-1.0 (float64) from splitmix64 of (seed, index): the same on every machine and
    numpy/torch version, unlike library RNG streams."""
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.where((z >> np.uint64(63)) == 1, -1.0, 1.0)


@lru_cache(maxsize=256)
def _block_vector(seed: int) -> torch.Tensor:
    return torch.from_numpy(_hash_signs(FP_BLOCK, seed))


def _project(flat: torch.Tensor, seed: int, chunk_rows: int = 256) -> float:
    """<flat, r> in float64 for a seeded +-1 vector r (a fixed block, each block's sign hashed)."""
    r = _block_vector(seed)
    rows = flat.numel() // FP_BLOCK
    total = 0.0
    if rows:
        block_signs = torch.from_numpy(_hash_signs(rows, seed ^ 0x5A5A5A5A))
        for start in range(0, rows, chunk_rows):
            stop = min(rows, start + chunk_rows)
            chunk = flat[start * FP_BLOCK:stop * FP_BLOCK].reshape(-1, FP_BLOCK).to(torch.float64)
            total += float(torch.mv(chunk, r) @ block_signs[start:stop])
    tail = flat[rows * FP_BLOCK:]
    if tail.numel():
        total += float(tail.to(torch.float64) @ r[:tail.numel()])
    return total


def fingerprint(merged: Sequence[torch.Tensor], local_norms: Sequence[float]) -> tuple[float, ...]:
    """A small summary of a round's merged tensors that two peers can compare with a tolerance.

    Tensor i goes to slot i mod FP_SLOTS; each slot sums, over its tensors, two float64 projections on
    seeded +-1 vectors, the norm, and a scale = norm + the norm of this peer's own input. Rounding in a
    compressed all-reduce moves a peer's result by a small multiple of that scale; a broken round (a
    mix of partial means, or a corrupted tensor) moves it by a sizeable fraction of the norm.

    Args:
        merged: the merged tensors, in the group's order.
        local_norms: the norm of this peer's pseudo-gradient of each tensor (before averaging).

    Returns:
        4 x min(FP_SLOTS, len(merged)) floats.
    """
    if len(merged) != len(local_norms):
        raise ValueError(f"{len(merged)} tensors but {len(local_norms)} local norms")
    n_slots = min(FP_SLOTS, len(merged))
    out = [0.0] * (_FP_FIELDS * n_slots)
    for i, (t, local) in enumerate(zip(merged, local_norms, strict=True)):
        base = _FP_FIELDS * (i % n_slots)
        flat = t.detach().reshape(-1)
        norm = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
        out[base] += _project(flat, _FP_SEED + 2 * i)
        out[base + 1] += _project(flat, _FP_SEED + 2 * i + 1)
        out[base + 2] += norm
        out[base + 3] += norm + abs(float(local))
    return tuple(out)


def round_tag(round_id: int, participants: Sequence[str]) -> bytes:
    """8 bytes naming one round: its number and its participants.

    Round numbers alone repeat: peers at different steps meet under the largest of their numbers, so two
    different rounds can share a number (and a DHT key). A fingerprint counts only for the round whose tag
    it carries, so a stale record of an earlier round is never compared with this one's.
    """
    h = hashlib.sha256(f"{round_id}|".encode() + "|".join(sorted(participants)).encode())
    return h.digest()[:_TAG_BYTES]


def encode_fingerprint(fp: Sequence[float], tag: bytes = bytes(8)) -> bytes:
    """DHT value of a fingerprint: magic, round tag, count, float32s (<= 4 + 8 + 2 + 256 bytes)."""
    if len(tag) != _TAG_BYTES:
        raise ValueError(f"a round tag has {_TAG_BYTES} bytes")
    return _FP_MAGIC + tag + struct.pack(f"<H{len(fp)}f", len(fp), *fp)


def decode_fingerprint(value: object, tag: bytes = bytes(8)) -> tuple[float, ...] | None:
    """Inverse of ``encode_fingerprint``; None for anything malformed or of another round (a peer's record is
    data, not trusted)."""
    head = len(_FP_MAGIC) + _TAG_BYTES
    if not isinstance(value, bytes) or len(value) < head + 2 or not value.startswith(_FP_MAGIC):
        return None
    if value[len(_FP_MAGIC):head] != tag:
        return None
    (n,) = struct.unpack_from("<H", value, head)
    if n % _FP_FIELDS or n > _FP_FIELDS * FP_SLOTS or len(value) != head + 2 + 4 * n:
        return None
    return tuple(struct.unpack_from(f"<{n}f", value, head + 2))


def fingerprints_agree(a: Sequence[float], b: Sequence[float], tolerance: float) -> bool:
    """True when every projection and norm of a and b differ by at most ``tolerance`` x their mean scale.

    Non-finite values never agree (a NaN round is no round)."""
    if len(a) != len(b) or len(a) % _FP_FIELDS:
        return False
    for base in range(0, len(a), _FP_FIELDS):
        slot_a, slot_b = a[base:base + _FP_FIELDS], b[base:base + _FP_FIELDS]
        if not all(math.isfinite(x) for x in (*slot_a, *slot_b)):
            return False
        allowed = tolerance * 0.5 * (abs(slot_a[3]) + abs(slot_b[3]))
        if any(abs(x - y) > allowed for x, y in zip(slot_a[:3], slot_b[:3], strict=True)):
            return False
    return True


def majority_agrees(
    mine: Sequence[float], others: Mapping[str, Sequence[float]], n_participants: int, tolerance: float
) -> tuple[bool, int]:
    """Does a strict majority of the round's participants (me included) hold a result agreeing with mine?

    Args:
        mine: my fingerprint.
        others: the fingerprints found of the other participants (absent ones count against me).
        n_participants: how many peers took part in the round, me included.
        tolerance: see ``fingerprints_agree``.

    Returns:
        (verdict, how many participants agree with me, me included).
    """
    if not all(math.isfinite(x) for x in mine) or not fingerprints_agree(mine, mine, tolerance):
        return False, 0
    agreeing = 1 + sum(fingerprints_agree(mine, fp, tolerance) for fp in others.values())
    return 2 * agreeing > n_participants, agreeing


# ---- the averager --------------------------------------------------------------------------------


class RoundStatus(StrEnum):
    OK = "ok"
    BAD_INPUT = "bad_input"  # our own pseudo-gradient was not finite: we did not join
    BUSY = "busy"  # the buffers are still held by an earlier, abandoned round
    NO_GROUP = "no_group"  # nobody else came within matchmaking_timeout_s
    FAILED = "failed"  # the all-reduce raised (a groupmate vanished, a timeout inside hivemind)
    TIMEOUT = "timeout"  # the round outlived round_budget_s and was cancelled
    NO_TOKENS = "no_tokens"  # no participant processed any token: nothing to merge
    DIVERGED = "diverged"  # our result disagrees with the majority: reload the group from peers
    UNVERIFIED = "unverified"  # too few fingerprints arrived to form a majority: reload the group from peers


@dataclass(frozen=True)
class RoundReport:
    """What happened in one ``run_round`` (logs, metrics, the node's decision to reload)."""

    group: str
    status: RoundStatus
    round_id: int | None = None
    participants: tuple[str, ...] = ()
    tokens: dict[str, float] = field(default_factory=dict)
    agreeing: int = 0
    pack_s: float = 0.0
    """Packing the components into the averaged buffers."""
    allreduce_s: float = 0.0
    """Matchmaking and all-reduce (hivemind's step)."""
    verify_s: float = 0.0
    """Publishing our fingerprint and waiting for a majority."""
    total_s: float = 0.0
    began_allreduce: bool = False
    """A group formed and exchanged tensors: the other members may have completed the round."""
    detail: str = ""

    @property
    def needs_reload(self) -> bool:
        """True when others may have applied a round this peer did not: reload the group from peers."""
        if self.status in (RoundStatus.DIVERGED, RoundStatus.UNVERIFIED):
            return True
        return self.began_allreduce and self.status in (RoundStatus.FAILED, RoundStatus.TIMEOUT, RoundStatus.BUSY)


StateProvider = Callable[[], tuple[Any, Sequence[torch.Tensor]]]


class ParallaxOuterAverager(DecentralizedAverager):
    """hivemind's averager under a stable class name: the name is part of the RPC protocol id (trap 9),
    so renaming this class splits the swarm. Serves joiners what ``state_provider`` returns."""

    state_provider: StateProvider | None = None

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], None]:  # type: ignore[override]
        # Runs in a background thread of the host process when a peer calls load_state_from_peers.
        provider = self.state_provider
        if provider is None:
            raise RuntimeError("this peer serves no outer state")  # hivemind logs it; the joiner tries another
        metadata, tensors = provider()
        return metadata, list(tensors), None


def _start_keeping_sigint(averager: DecentralizedAverager, timeout_s: float) -> None:
    """Fork the averager with SIGINT ignored (so Ctrl+C reaches us, not the child), then restore our handler.

    hivemind's ``run_in_background`` sets SIGINT to ignore and never restores it (trap 4). ``signal``
    works only in the main thread; elsewhere the child simply inherits our handler.
    """
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if in_main else None
    if in_main:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        averager.start()
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    averager.wait_until_ready(timeout_s)


class GroupAverager:
    """The network merge of one shared group of one node.

    Args:
        dht: this node's DHT (the averager runs on its P2P daemon; fingerprints go through it).
        run_id: the run; the averager prefix is ``{run_id}/outer/{group}``.
        group: the shared group's name.
        shapes: name -> shape of the group's tensors, in a fixed order (every peer the same).
        config: timings, compression, merge method.

    Raises:
        ValueError: bad names or an empty group.
        NodeError: the averager process did not start.
    """

    def __init__(self, dht: SwarmDHT, run_id: str, group: str, shapes: Mapping[str, Sequence[int]],
                 config: OuterSyncConfig) -> None:
        self.prefix = outer_prefix(run_id, group)
        if not shapes:
            raise ValueError(f"group {group!r} has no tensors")
        self.run_id, self.group, self.config = run_id, group, config
        self.shapes = {name: torch.Size(s) for name, s in shapes.items()}
        self.peer_id = dht.peer_id
        self.last_report: RoundReport | None = None
        self._dht = dht
        self._rounds = 0
        self._round_lock = threading.Lock()  # one round at a time per group
        self._closed = False
        self._buffers = [torch.zeros(s, dtype=torch.float32) for s in component_shapes(self.shapes, config.method)]
        self._averager = ParallaxOuterAverager(
            self._buffers, dht.hivemind_dht, start=False, prefix=self.prefix,
            target_group_size=config.target_group_size, min_group_size=config.min_group_size,
            min_matchmaking_time=config.min_matchmaking_time_s, request_timeout=config.request_timeout_s,
            allreduce_timeout=config.allreduce_timeout_s, next_chunk_timeout=config.next_chunk_timeout_s,
            compression=config.hivemind_compression(), allow_state_sharing=False,
            shutdown_timeout=config.shutdown_timeout_s,
        )
        try:
            _start_keeping_sigint(self._averager, config.startup_timeout_s)
        except Exception as e:
            self.shutdown()
            raise NodeError(f"the outer-sync averager of group {group!r} did not start within "
                            f"{config.startup_timeout_s} s: {e!r}") from e

    # ---- one round ----

    def run_round(
        self, delta: Mapping[str, torch.Tensor], tokens: float, *, round_id: int | None = None,
        fault: Callable[[dict[str, torch.Tensor]], None] | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """Merge ``delta`` with the pseudo-gradients of the peers present; block for at most ``round_budget_s``.

        Args:
            delta: this peer's pseudo-gradient, name -> tensor (``Composer.pseudo_gradient(group)``).
            tokens: tokens this peer processed since the last merge (its averaging weight; floored at
                MIN_WEIGHT so a peer that processed none may still join).
            round_id: the round's number, the same on every peer (e.g. step // H_G); None counts rounds
                locally. The DHT key uses the largest number among the participants.
            fault: test hook, applied in place to the merged tensors before fingerprinting (a broken round).

        Returns:
            name -> merged pseudo-gradient (CPU float32), the same (within the tolerance) on every peer
            that returns one; None when the round did not complete or did not verify: then skip the outer
            step. ``last_report`` says why.

        Raises:
            ValueError: names or shapes differ from the group's, or tokens is negative or not finite.
        """
        started = time.monotonic()
        self._check(delta, tokens)
        if not self._round_lock.acquire(blocking=False):
            self._report(RoundStatus.BUSY, started, round_id=round_id, detail="another round of this group is running")
            return None
        try:
            return self._run_round(delta, tokens, round_id, fault, started)
        finally:
            self._round_lock.release()

    def _run_round(self, delta: Mapping[str, torch.Tensor], tokens: float, round_id: int | None,
                   fault: Callable[[dict[str, torch.Tensor]], None] | None, started: float,
                   ) -> dict[str, torch.Tensor] | None:
        n = self._rounds if round_id is None else int(round_id)
        if not all(bool(torch.isfinite(d).all()) for d in delta.values()):
            self._report(RoundStatus.BAD_INPUT, started, round_id=n, detail="non-finite pseudo-gradient")
            return None
        local_norms = [float(torch.linalg.vector_norm(delta[name].detach(), dtype=torch.float64))
                       for name in self.shapes]
        if not self._fill(component_tensors({name: delta[name] for name in self.shapes}, self.config.method)):
            self._report(RoundStatus.BUSY, started, round_id=n, detail="averaged buffers still locked")
            return None

        pack_s = time.monotonic() - started
        gathered, failure, began, detail = self._all_reduce(max(float(tokens), MIN_WEIGHT), float(tokens), n)
        allreduce_s = time.monotonic() - started - pack_s
        if gathered is None:
            self._report(failure, started, round_id=n, pack_s=pack_s, allreduce_s=allreduce_s, began_allreduce=began,
                         detail=detail)
            return None
        rounds, token_counts = _parse_gathered(gathered, n)
        n = max(rounds)
        self._rounds = n + 1
        participants = tuple(sorted(token_counts))
        common: dict[str, Any] = dict(round_id=n, participants=participants, tokens=token_counts, pack_s=pack_s,
                                      allreduce_s=allreduce_s, began_allreduce=True)
        if sum(token_counts.values()) <= 0:
            self._report(RoundStatus.NO_TOKENS, started, **common)
            return None

        means = self._read()
        if means is None:
            self._report(RoundStatus.BUSY, started, detail="could not read the averaged buffers", **common)
            return None
        merged = merged_from_components(means, self.shapes, self.config.method, eps=self.config.rda_eps)
        del means
        if fault is not None:
            fault(merged)
        fp = fingerprint([merged[name] for name in self.shapes], local_norms)
        verify_started = time.monotonic()
        status, agreeing, answered = self._verify(n, fp, participants)
        common.update(agreeing=agreeing, verify_s=time.monotonic() - verify_started)
        if status is not RoundStatus.OK:
            detail = f"{agreeing} of {len(participants)} participants agree, {answered} fingerprints found"
            self._report(status, started, detail=detail, **common)
            return None
        self._report(RoundStatus.OK, started, **common)
        return merged

    def _check(self, delta: Mapping[str, torch.Tensor], tokens: float) -> None:
        if set(delta) != set(self.shapes):
            raise ValueError(f"group {self.group!r} has tensors {sorted(self.shapes)}, got {sorted(delta)}")
        for name, shape in self.shapes.items():
            if delta[name].shape != shape:
                raise ValueError(f"{self.group}/{name} has shape {tuple(shape)}, got {tuple(delta[name].shape)}")
        if not (math.isfinite(float(tokens)) and float(tokens) >= 0):
            raise ValueError(f"tokens is the averaging weight and must be finite and >= 0, got {tokens}")

    def _fill(self, components: Sequence[torch.Tensor]) -> bool:
        lock = self._averager.lock_averaged_tensors
        if not lock.acquire(timeout=_BUFFER_LOCK_TIMEOUT_S):
            return False
        try:
            for buffer, value in zip(self._buffers, components, strict=True):
                buffer.copy_(value)
        finally:
            lock.release()
        return True

    def _read(self) -> list[torch.Tensor] | None:
        # Copies: the averager may write these buffers again in the next round.
        lock = self._averager.lock_averaged_tensors
        if not lock.acquire(timeout=_BUFFER_LOCK_TIMEOUT_S):
            return None
        try:
            return [b.clone() for b in self._buffers]
        finally:
            lock.release()

    def _all_reduce(self, weight: float, tokens: float, n: int) -> tuple[dict[Any, Any] | None, RoundStatus, bool, str]:
        """One hivemind step. Returns (gathered metadata or None, failure status, whether the all-reduce began,
        detail)."""
        cfg = self.config
        if not self._averager.is_alive():
            return None, RoundStatus.FAILED, False, "the averager process is not running"
        # hivemind's step() blocks, with no timeout, until the averager process acknowledges the request
        # (even with wait=False): if that process dies in between, the call never returns. So it runs
        # in a daemon thread that we stop waiting for once the process is gone or the deadline passes.
        started: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def start_step() -> None:
            try:
                started.set_result(self._averager.step(
                    gather={"v": _GATHER_VERSION, "round": n, "tokens": tokens}, weight=weight,
                    timeout=cfg.matchmaking_timeout_s, allow_retries=False, wait=False,
                ))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread below
                started.set_exception(e)

        threading.Thread(target=start_step, name=f"outer-step-{self.group}", daemon=True).start()
        start_deadline = time.monotonic() + cfg.matchmaking_timeout_s + 2.0
        while True:
            try:
                control = started.result(timeout=0.5)
                break
            except concurrent.futures.TimeoutError:
                if not self._averager.is_alive():
                    return None, RoundStatus.FAILED, False, "the averager process died"
                if time.monotonic() >= start_deadline:
                    return None, RoundStatus.TIMEOUT, False, "the averager did not accept the round"
            except Exception as e:  # hivemind refused the request outright
                return None, RoundStatus.FAILED, False, repr(e)
        # One attempt (allow_retries=False): a retry after a half-finished all-reduce would average
        # half-averaged buffers. Wait in slices so that a crashed averager process is noticed at once.
        deadline = time.monotonic() + cfg.matchmaking_timeout_s + cfg.allreduce_timeout_s + 2.0
        while True:
            try:
                gathered = control.result(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                break
            except TimeoutError:
                if not self._averager.is_alive():
                    return None, RoundStatus.FAILED, control.began_allreduce, "the averager process died"
                if time.monotonic() >= deadline:
                    control.cancel()
                    return (None, RoundStatus.TIMEOUT, control.began_allreduce,
                            "no result within matchmaking_timeout_s + allreduce_timeout_s")
            except Exception as e:  # hivemind raises AllreduceException, MatchmakingException, CancelledError, ...
                status = RoundStatus.NO_GROUP if "could not find a group" in str(e) else RoundStatus.FAILED
                return None, status, control.began_allreduce, repr(e)
        if not isinstance(gathered, dict) or not gathered:
            return None, RoundStatus.FAILED, True, f"averager returned {gathered!r}"
        return gathered, RoundStatus.OK, True, ""

    def _verify(self, n: int, fp: tuple[float, ...], participants: Sequence[str]) -> tuple[RoundStatus, int, int]:
        """Publish our fingerprint, then wait for a majority verdict (at most verify_timeout_s).

        Returns:
            (OK, DIVERGED when those who answered outvoted us, or UNVERIFIED when too few answered;
            how many participants agree with us, us included; how many fingerprints we had, ours included).
        """
        cfg = self.config
        key = round_key(self.run_id, self.group, n)
        tag = round_tag(n, participants)
        if not self._dht.store(key, self.peer_id.encode(), encode_fingerprint(fp, tag),
                               dht_time() + cfg.fingerprint_ttl_s, timeout_s=cfg.dht_timeout_s):
            logger.debug("could not store the fingerprint of %s round %d", self.group, n)
        deadline = time.monotonic() + cfg.verify_timeout_s
        others: dict[str, tuple[float, ...]] = {}
        wanted = set(participants) - {self.peer_id}
        while True:
            remaining = deadline - time.monotonic()
            found = self._dht.get_dicts([key], latest=True, timeout_s=max(0.1, min(cfg.dht_timeout_s, remaining)))
            for subkey, (value, _expiration) in (found or {}).get(key, {}).items():
                peer = subkey.decode(errors="replace") if isinstance(subkey, bytes) else str(subkey)
                if peer in wanted and peer not in others:
                    decoded = decode_fingerprint(value, tag)
                    if decoded is None:
                        logger.debug("malformed or stale fingerprint from %s for %s round %d", peer, self.group, n)
                        continue
                    others[peer] = decoded
            verdict, agreeing = majority_agrees(fp, others, len(participants), cfg.tolerance)
            if verdict:
                return RoundStatus.OK, agreeing, len(others) + 1
            disagreeing = len(others) + 1 - agreeing
            if 2 * disagreeing >= len(participants) or len(others) == len(wanted):
                # A majority is out of reach whoever answers later.
                return RoundStatus.DIVERGED, agreeing, len(others) + 1
            if time.monotonic() >= deadline:
                return RoundStatus.UNVERIFIED, agreeing, len(others) + 1
            time.sleep(_VERIFY_POLL_S)

    def _report(self, status: RoundStatus, started: float, **fields: Any) -> None:
        report = RoundReport(group=self.group, status=status, total_s=time.monotonic() - started, **fields)
        self.last_report = report
        if status is RoundStatus.OK:
            logger.debug("outer round %s/%s: %d peers, %.2f s", self.group, report.round_id,
                         len(report.participants), report.total_s)
        elif report.needs_reload:
            logger.warning("outer round %s/%s %s (%s): skipped; this peer should reload the group from peers",
                           self.group, report.round_id, status.value, report.detail)
        else:
            logger.info("outer round %s/%s skipped: %s %s", self.group, report.round_id, status.value, report.detail)

    # ---- state for joiners (hook; the reload itself is a later step) ----

    def serve_state(self, provider: StateProvider | None) -> None:
        """Serve ``provider()`` -> (small metadata, tensors) to peers calling ``load_state_from_peers``.

        For a composer: the group's anchor and outer-optimizer momenta (``OuterOptimizer.state_dict``),
        flattened to a tensor list, with the round number in the metadata. ``provider`` runs in a
        background thread of this process and must not race with ``apply_outer``. None stops serving.
        """
        self._averager.state_provider = provider
        self._averager.allow_state_sharing = provider is not None

    def load_state_from_peers(self, timeout_s: float = 60.0) -> tuple[Any, list[torch.Tensor]] | None:
        """Download the state another peer serves (``serve_state``); None when nobody answered in time."""
        try:
            found = self._averager.load_state_from_peers(wait=True, timeout=timeout_s)
        except Exception as e:  # TimeoutError, or a peer that failed mid-stream
            logger.info("loading outer state of %s from peers failed: %r", self.group, e)
            return None
        if found is None:
            return None
        metadata, tensors = found
        return metadata, list(tensors)

    # ---- lifecycle ----

    def shutdown(self) -> None:
        """Stop the averager process. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        averager = getattr(self, "_averager", None)
        if averager is not None and averager.is_alive():
            try:
                averager.shutdown()
            except Exception as e:  # already dying: nothing left to stop
                logger.debug("averager shutdown of %s: %r", self.group, e)

    def __enter__(self) -> GroupAverager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _parse_gathered(gathered: Mapping[Any, Any], n: int) -> tuple[list[int], dict[str, float]]:
    """Participants' round numbers and token counts from the all-gather; bad entries are logged and zeroed."""
    rounds, tokens = [n], {}
    for peer, meta in gathered.items():
        peer_id = str(peer)
        if not isinstance(meta, dict) or meta.get("v") != _GATHER_VERSION:
            logger.debug("participant %s sent unreadable round metadata %r", peer_id, meta)
            tokens[peer_id] = 0.0
            continue
        r, t = meta.get("round"), meta.get("tokens")
        if isinstance(r, int) and 0 <= r < 2**62:
            rounds.append(r)
        tokens[peer_id] = float(t) if isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 else 0.0
    return rounds, tokens


class TieredOuterSync:
    """The outer sync of every shared group of one node: one ``GroupAverager`` per group.

    Args:
        dht: this node's DHT.
        run_id: the run.
        groups: group -> (name -> shape), in the composer's anchors' order (``node.runner.model_shapes(cfg).groups``).
        config: shared by every group.

    Raises:
        NodeError: an averager did not start (those already started are shut down).
    """

    def __init__(self, dht: SwarmDHT, run_id: str, groups: Mapping[str, Mapping[str, Sequence[int]]],
                 config: OuterSyncConfig | None = None) -> None:
        self.config = config or OuterSyncConfig()
        self.groups: dict[str, GroupAverager] = {}
        try:
            for group, shapes in groups.items():
                self.groups[group] = GroupAverager(dht, run_id, group, shapes, self.config)
        except BaseException:
            self.shutdown()
            raise

    def run_round(self, group: str, delta: Mapping[str, torch.Tensor], tokens: float, *,
                  round_id: int | None = None) -> dict[str, torch.Tensor] | None:
        """``GroupAverager.run_round`` of ``group``."""
        return self.groups[group].run_round(delta, tokens, round_id=round_id)

    def sync(self, composer: Composer, group: str, *, round_id: int | None = None) -> RoundReport:
        """One outer round of ``group`` for ``composer``: merge its pseudo-gradient, apply the Nesterov step
        only when the round completed and verified (never half an update)."""
        merged = self.run_round(group, composer.pseudo_gradient(group), composer.tokens_since_merge[group],
                                round_id=round_id)
        if merged is not None:
            composer.apply_outer(group, merged)
        report = self.groups[group].last_report
        assert report is not None
        return report

    def shutdown(self) -> None:
        for averager in self.groups.values():
            with contextlib.suppress(Exception):
                averager.shutdown()

    def __enter__(self) -> TieredOuterSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

