"""What an outer round puts on the wire and how its peers check each other: pure, no network.

``node.outer.averager`` runs a round over hivemind; this module holds what that round is made of, so it
can be tested byte for byte and shared with the in-process simulator:

- ``OuterSyncConfig``: the run's merge rule and wire format with this node's timings of the outer rounds;
- components: the buffers a group averages (RDA: scaled unit directions, norms, raw deltas) and how
  the merged group is rebuilt from their means;
- compression: hivemind's codec for each buffer ("fp16", "uint8" or none; small tensors always go
  uncompressed), ``wire_roundtrip`` to apply the same rounding in one process, ``payload_bytes``; a gathered
  round's "int4" and "topk" (``TOPK``) have no all-reduce codec;
- fingerprints: a ~260-byte summary of a merged result that peers compare within the compression's
  tolerance, the round tag that binds it to one round, the majority vote, and the record that carries a
  node's latest few (``encode_round_record``): it lives under the group's protected rounds key
  (``dht.keys.outer_rounds_key``), signed by the record validator, so a reader takes it only from the key
  the live membership names for a participant's peer id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgpack
import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
)

from parallax.node.config.net import OuterConfig
from parallax.node.config.train import GATHERED_WIRES, SyncConfig
from parallax.node.train.merge_rules import merge_rule
from parallax.node.train.rda import DIRECTION_EPS
from parallax.protocol.codec import encode
from parallax.protocol.identity import Identity

COMPRESSIONS = ("fp16", "uint8", "int4", "topk", "none")
"""Wire formats of an outer round: float16, hivemind's uniform 8-bit quantisation (256 buckets over
6 standard deviations, each decoded to its bucket's mean; about 3.5% relative error on a backbone
pseudo-gradient of the small preset, against 0.02% for float16), float32, or (gathered rounds only, the sender
keeping what the wire left out) ``protocol.codec``'s "int4" or ``TOPK``."""
TOPK = {"chunk": 4096, "keep": 64, "bits": 2}
"""The "topk" wire (``protocol.codec``), SparseLoCo's: of every 4096 entries the 64 largest (1.56%), each at 2 bits
with a scale per chunk and its position in 12 bits: 0.028 bytes an entry against uint8's 1. The sender keeps what
it did not send and adds it to its next pseudo-gradient (error feedback, ``OuterOptimizer.with_unsent``)."""
CODEC_OF = {"fp16": "fp16", "uint8": "int8", "int4": "int4", "topk": "topk", "none": "raw"}
"""A gathered round's wire -> the ``protocol.codec`` codec a contribution's large tensors go in."""
SMALL_TENSOR_NUMEL = 4096
"""Tensors (parts) smaller than this are sent uncompressed under any compression: the norms, biases
and norm-layer weights cost nothing and keep full precision."""


def encode_wire(array: np.ndarray, numel: int, compression: str) -> bytes:
    """``array`` (a tensor of ``numel`` entries, or rows of one) as a gathered round sends it: raw float32 when the
    tensor is under ``SMALL_TENSOR_NUMEL`` entries, else in ``compression``'s codec (``CODEC_OF``)."""
    codec = "raw" if numel < SMALL_TENSOR_NUMEL else CODEC_OF[compression]
    return encode(array, codec, **TOPK) if codec == "topk" else encode(array, codec)
_TOLERANCE = {"fp16": 2e-2, "uint8": 0.15, "int4": 2e-2, "topk": 2e-2, "none": 1e-5}
_RDA_EPS = {"fp16": 0.05, "uint8": 0.1, "int4": 0.1, "topk": 0.1, "none": DIRECTION_EPS}
_CODEBOOK_BYTES = 8 + 256 * 4  # uint8: codebook length + one float32 per bucket, per tensor part
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
BUFFER_LOCK_TIMEOUT_S = 5.0


# ---- config ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterSyncConfig:
    """How a node merges its shared groups over the network: the run's merge rule, wire format and aggregation
    (``train.sync``, the same on every peer) with this node's timings (``net.outer``)."""

    sync: SyncConfig = field(default_factory=SyncConfig)
    net: OuterConfig = field(default_factory=OuterConfig)

    @classmethod
    def of(cls, *, loopback: bool = False, **changes: Any) -> OuterSyncConfig:
        """The run's defaults and a timing profile (``loopback``: peers on one machine), with ``changes`` to
        either section by field name (tests)."""
        net = OuterConfig.loopback() if loopback else OuterConfig()
        sync_names = {f.name for f in dataclasses.fields(SyncConfig)}
        return cls(sync=SyncConfig(**{k: v for k, v in changes.items() if k in sync_names}),
                   net=dataclasses.replace(net, **{k: v for k, v in changes.items() if k not in sync_names}))

    @classmethod
    def loopback(cls, **changes: Any) -> OuterSyncConfig:
        """``of`` with the loopback timings."""
        return cls.of(loopback=True, **changes)

    @property
    def method(self) -> str:
        """The merge rule (``sync.merge``)."""
        return self.sync.merge

    @property
    def compression(self) -> str:
        """The wire format (``sync.compression``)."""
        return self.sync.compression

    @property
    def aggregation(self) -> str:
        """Gathered or all-reduced (``sync.aggregation``)."""
        return self.sync.aggregation

    @property
    def tolerance(self) -> float:
        if self.net.fingerprint_tolerance is not None:
            return self.net.fingerprint_tolerance
        return _TOLERANCE[self.compression]

    @property
    def rda_eps(self) -> float:
        if self.net.direction_eps is not None:
            return self.net.direction_eps
        return _RDA_EPS[self.compression]

    @property
    def round_budget_s(self) -> float:
        """The longest ``run_round`` blocks: matchmaking, all-reduce, verification (twice its bound when reads fail:
        ``RoundRecords.await_majority``), and slack."""
        net = self.net
        return (net.matchmaking_timeout_s + net.allreduce_timeout_s + 2 * net.verify_timeout_s
                + 2 * net.dht_timeout_s + BUFFER_LOCK_TIMEOUT_S)

    def hivemind_compression(self) -> CompressionBase:
        return wire_compression(self.compression)


def wire_compression(name: str) -> CompressionBase:
    """hivemind's codec for an outer all-reduce under compression ``name`` (one of ``COMPRESSIONS``)."""
    if name not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {name!r}")
    if name in GATHERED_WIRES:
        raise ValueError(f"the {name} wire is for gathered rounds: hivemind's all-reduce has no such codec")
    if name == "none":
        return NoCompression()
    big = Float16Compression() if name == "fp16" else Uniform8BitQuantization()
    return SizeAdaptiveCompression(SMALL_TENSOR_NUMEL, less=NoCompression(), greater_equal=big)


def wire_roundtrip(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` as a peer receives it under compression ``name``: the in-process simulator applies this
    rounding to what it merges, so its runs see the wire's error."""
    codec = wire_compression(name)
    return codec.extract(codec.compress(tensor.detach(), CompressionInfo.from_tensor(tensor)))


# ---- names ----------------------------------------------------------------------------------------
# Candidates for dht/keys.py (the one file that names DHT keys); kept here until that file takes them.


def payload_bytes(shapes: Mapping[str, Sequence[int]], config: OuterSyncConfig) -> int:
    """Bytes of one peer's averaged buffers of a group on the wire (hivemind does not count them): the RDA
    components of SMALL_TENSOR_NUMEL entries or more at 2 bytes per entry under fp16, 1 (+ a 1 KiB
    codebook) under uint8, the others at 4."""
    total = 0
    for shape in component_shapes(shapes, config.method):
        numel = torch.Size(shape).numel()
        if numel < SMALL_TENSOR_NUMEL or config.compression == "none":
            total += 4 * numel
        else:
            total += 2 * numel if config.compression == "fp16" else numel + _CODEBOOK_BYTES
    return total


# ---- pure parts: pack, rebuild, fingerprint --------------------------------------------------------


def component_shapes(shapes: Mapping[str, Sequence[int]], method: str) -> list[torch.Size]:
    """Shapes of the averaged buffers for a group with tensors ``shapes`` (see ``component_tensors``)."""
    return merge_rule(method).buffer_shapes([torch.Size(s) for s in shapes.values()])


def component_tensors(delta: Mapping[str, torch.Tensor], method: str) -> list[torch.Tensor]:
    """What one peer puts into the all-reduce for its pseudo-gradient ``delta`` (CPU float32): the merge rule's
    buffers (``MergeRule.buffers``; RDA: scaled unit directions, the norms, the raw deltas). Their token-weighted
    means give ``merged_from_components`` what ``merge_rules.merge_groups`` computes from all peers' deltas."""
    return merge_rule(method).buffers([d.detach().to(device="cpu", dtype=torch.float32) for d in delta.values()])


def merged_from_components(
    means: Sequence[torch.Tensor], shapes: Mapping[str, Sequence[int]], method: str, *, eps: float = DIRECTION_EPS
) -> dict[str, torch.Tensor]:
    """Finish the merge from the weighted means of ``component_tensors``.

    Args:
        means: the averaged buffers, in ``component_shapes`` order.
        shapes: name -> shape of the group's tensors, in the same order as when packing.
        method: the merge rule's name.
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
    return dict(zip(shapes, merge_rule(method).rebuild(means, len(shapes), eps=eps), strict=True))


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


def fingerprint(merged: Sequence[torch.Tensor], local_norms: Sequence[float], slots: int = FP_SLOTS,
                ) -> tuple[float, ...]:
    """A small summary of a round's merged tensors that two peers can compare with a tolerance.

    Tensor i goes to slot i mod the slots (``FP_SLOTS``, or ``slots``); each slot sums, over its tensors, two
    float64 projections on seeded +-1 vectors, the norm, and a scale = norm + the norm of this peer's own input.
    Rounding in a compressed all-reduce moves a peer's result by a small multiple of that scale; a broken round (a
    mix of partial means, or a corrupted tensor) moves it by a sizeable fraction of the norm.

    Args:
        merged: the merged tensors, in the group's order.
        local_norms: the norm of this peer's pseudo-gradient of each tensor (before averaging).
        slots: at most this many slots (``FP_SLOTS`` at most).

    Returns:
        4 x min(slots, len(merged)) floats.
    """
    if len(merged) != len(local_norms):
        raise ValueError(f"{len(merged)} tensors but {len(local_norms)} local norms")
    n_slots = min(slots, FP_SLOTS, len(merged))
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


ANCHOR_TOLERANCE = 1e-4
"""Two peers hold one anchor when its fingerprints agree within this fraction of its norm: peers that applied the same
rounds hold it bit for bit on one kind of hardware and within float rounding across kinds, while one round applied by
one and not the other moves it by a few percent."""
ANCHOR_SLOTS = 4
"""An anchor's fingerprint has at most this many slots (64 bytes): it travels in every round entry."""


ANCHOR_FP_BYTES = len(_FP_MAGIC) + _TAG_BYTES + 2 + 4 * _FP_FIELDS * ANCHOR_SLOTS
"""The most bytes an encoded anchor fingerprint takes (``encode_fingerprint``): all a claim's ``base`` may hold."""


def anchor_fingerprint(anchor: Sequence[torch.Tensor]) -> tuple[float, ...]:
    """``fingerprint`` of a group's anchor, the weights a round's merged pseudo-gradient is applied to (its scale is
    its own norm: compare with ``ANCHOR_TOLERANCE``), in ``ANCHOR_SLOTS`` slots: it travels in every round entry."""
    return fingerprint(anchor, [0.0] * len(anchor), slots=ANCHOR_SLOTS)


def anchor_majority(mine: Sequence[float], others: Mapping[str, Sequence[float]], n_participants: int,
                    ) -> tuple[str, ...]:
    """The participants of a round whose anchors agree with one another and make a strict majority of its
    ``n_participants`` (this node included) while ``mine`` is not among them: this node's anchor is apart from the
    swarm's. Empty when mine is the majority's, or when no majority holds one anchor.

    Args:
        mine: this node's ``anchor_fingerprint`` before the round.
        others: the anchor fingerprints found of the other participants, by participant.
        n_participants: how many took part in the round, this node included.
    """
    held = _held_by_majority(others, n_participants)
    if held is None or fingerprints_agree(mine, held[0], ANCHOR_TOLERANCE):
        return ()
    return tuple(sorted(held[1]))


def set_anchor(bases: Mapping[str, Sequence[float] | None]) -> tuple[Sequence[float] | None, set[str]]:
    """(the anchor a strict majority of a set's contributions were taken from, ``RoundEntry.base``: the one its merge
    is a step from, which every peer that applies it held before, or was meant to; the contributions the merge leaves
    out: those not taken from it). ``bases``: by contribution, None where none is named or it is malformed.

    A pseudo-gradient is a step from the anchor it was taken from; merged into a step from another (its sender missed
    rounds the others applied, or offers its contributions rounds late), it moves every peer's anchor by a stale step
    at full weight. (None, nothing left out) when no anchor holds a strict majority: the set is merged whole. The same
    on every peer that holds the set's signed claims."""
    held = _held_by_majority({name: fp for name, fp in bases.items() if fp is not None}, len(bases))
    return (None, set()) if held is None else (held[0], set(bases) - set(held[1]))


def _held_by_majority(fingerprints: Mapping[str, Sequence[float]], n: int,
                      ) -> tuple[Sequence[float], list[str]] | None:
    """(an anchor fingerprint, the names of ``fingerprints`` that agree with it) when they make a strict majority of
    ``n``; None when no anchor does."""
    for fp in fingerprints.values():
        agreeing = [name for name, other in fingerprints.items() if fingerprints_agree(fp, other, ANCHOR_TOLERANCE)]
        if 2 * len(agreeing) > n:
            return fp, agreeing
    return None


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


ROUNDS_KEPT = 4
"""Fingerprints of this many latest rounds per record: a slow peer still finds the round it verifies after the
fast ones have moved on."""
_ROUND_RECORD_MAX_BYTES = 2048


@dataclass(frozen=True)
class FingerprintSigner:
    """What a node needs to check its peers' fingerprints: its identity (its records are signed under its
    subkey), and the Ed25519 key the live membership names for a libp2p peer id (its signed heartbeat
    carries the peer id)."""

    identity: Identity
    public_key_of: Callable[[str], bytes | None]


def encode_round_record(fingerprints: Sequence[bytes]) -> bytes:
    """One node's DHT value for a group: its latest ``ROUNDS_KEPT`` encoded fingerprints, newest last."""
    return msgpack.packb(list(fingerprints)[-ROUNDS_KEPT:], use_bin_type=True)


def round_fingerprint(record: object, tag: bytes) -> tuple[float, ...] | None:
    """The fingerprint of the round ``tag`` in a node's record; None when absent or malformed (a peer's
    record is data, not trusted)."""
    if not isinstance(record, bytes) or len(record) > _ROUND_RECORD_MAX_BYTES:
        return None
    try:
        entries = msgpack.unpackb(record, raw=False, max_bin_len=_ROUND_RECORD_MAX_BYTES,
                                  max_array_len=ROUNDS_KEPT)
    except Exception:  # msgpack raises several types on hostile input
        return None
    if not isinstance(entries, list):
        return None
    for entry in reversed(entries):
        fp = decode_fingerprint(entry, tag)
        if fp is not None:
            return fp
    return None


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
