"""The message kinds of Parallax: frozen, validated dataclasses with one canonical encoding each.

Every message travels inside a signed envelope (``parallax.protocol.envelope``), which names the
sender (its Ed25519 public key), the run, a sequence number and a timestamp; so the bodies below
never repeat those. ``peer_id`` fields are the libp2p/hivemind peer id a node is reachable at; the
node's *identity* is always the envelope's signer.

    msg = Heartbeat(peer_id="Qm...", addresses=("/ip4/1.2.3.4/tcp/31337",), role="composer",
                    capacity=1.0, shards=((0, 3), (1, 5)), step=120, versions={"attn": 4})
    body = msg.encode()                      # canonical bytes
    Heartbeat.decode(body) == msg            # MalformedMessage on bad input, never anything else

Adding a kind: subclass ``Message`` as a frozen slotted dataclass, declare ``KIND`` and ``MAX_BYTES``,
give every field a ``wire(spec)``, decorate with ``@register``. Adding a field to an existing kind:
give it a default, so peers that do not send it still decode. The first four kinds (heartbeat,
deathrattle, shard_claim, shard_release) are relied on by ``dht/``: extend, never change, them.

Tensor payloads (snapshots, deltas, sketches, worker results) are carried as codec blobs
(``parallax.protocol.codec``) in ``bytes`` fields; ``decode_tensors`` checks them against the kind's
``TENSOR_LIMITS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from parallax.protocol.codec import CODECS, TensorLimits
from parallax.protocol.schema import (
    KINDS,
    Bool,
    Bytes,
    Fixed,
    Float,
    Int,
    Map,
    Message,
    Optional,
    Seq,
    Str,
    message_class,
    register,
    wire,
)

if TYPE_CHECKING:
    import numpy as np

KiB = 1024
MiB = 1024 * KiB

ROLES = frozenset({"composer", "worker", "bootstrap", "reader"})
"""A reader (``parallax export`` from a live swarm) owns nothing and takes part in no round; composers serve it
what they serve each other."""
MAX_LAYER = 2**16 - 1
MAX_EXPERT = 2**16 - 1
MAX_TENSORS = 256  # tensors in one payload message
MAX_SKETCH_PARTS = 64  # steps coalesced into one Sketch
MAX_LOOKAHEAD = 16  # momentum-only steps a worker extrapolates at a composer's request

_PEER_ID = Str(128, min_len=1)
MAX_SUSPECTS = 8
"""Suspected and banned peers a heartbeat names, each."""
_ADDRESS = Str(256, min_len=1)
_NAME = Str(64, min_len=1)  # group names, version keys
_TENSOR_NAME = Str(128, min_len=1)
_DIGEST = Bytes(length=32)  # sha256 / blake2b-256
_LAYER = Int(0, MAX_LAYER)
_EXPERT = Int(0, MAX_EXPERT)
_SHARD = Fixed(_LAYER, _EXPERT)
_COUNT = Int(0)
RUN_DIGEST_BYTES = 16  # protocol.manifest.DIGEST_BYTES
_UNIX_TIME = Float(0.0, 1e11, lo_open=True)  # seconds since the epoch
_LOSS = Optional(Float(-1e9, 1e9))

Shard = tuple[int, int]


def _tensors(max_bytes: int) -> Map:
    return Map(_TENSOR_NAME, Bytes(max_len=max_bytes), max_len=MAX_TENSORS)


class _TensorMessage(Message):
    """Mixin for kinds whose ``tensors`` field maps names to codec blobs."""

    __slots__ = ()
    TENSOR_LIMITS: ClassVar[TensorLimits]
    tensors: Mapping[str, bytes]

    def decode_tensors(
        self, limits: TensorLimits | None = None, *, peer: str | None = None
    ) -> dict[str, np.ndarray]:
        """Decode every blob in ``tensors`` (``BadTensor`` on the first one that fails its checks)."""
        from parallax.protocol.codec import decode  # codec stays importable without the registry

        lim = limits or self.TENSOR_LIMITS
        out = {}
        for name, blob in self.tensors.items():
            out[name] = decode(blob, lim, peer=peer, what=f"{self.KIND}.{name}")
        return out


# --- membership and shard ownership (relied on by dht/) ----------------------------------------------


@register
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """A live node's periodic announcement (every 2 s, expiring after 6 s).

    Fields:
        peer_id: the libp2p/hivemind peer id the node is reachable at.
        addresses: multiaddrs it listens on.
        role: ``composer``, ``worker`` or ``bootstrap``.
        capacity: relative weight for shard assignment (> 0; 1.0 = a reference node).
        shards: the ``(layer, expert)`` pairs it currently owns.
        step: its training step.
        versions: version counters of what it holds, e.g. ``{"attn": 12, "surrogates": 40}``.
        loss: its latest training loss, if any.
        run: the digest of the run manifest a composer trains by (``protocol.manifest``): composers with
            different digests ignore each other; empty for workers and bootstrap peers.
        suspects: the peers (libp2p peer ids) this node holds most evidence against, with their scores
            (``node.net.scores``), at most ``MAX_SUSPECTS``: what ``swarm status`` shows.
        banned: those of them it ignores now.
        sent: when it was sent, by the sender's clock (seconds since the epoch): a reader estimates how far the
            clocks disagree (``parallax doctor``); 0 when unknown.
        probation: a composer that joined a swarm already training and none of whose work has reached the
            others yet says so: nobody (itself included) gives it experts until it stops saying it, and a node
            holds rounds beside it for ``idle_s`` after first seeing it (``dht.membership.SwarmView.joining``).
            Saying it gets a composer no experts; not saying it gets none either until its work reached the others
            (``dht.membership.Progress``).
    """

    KIND: ClassVar[str] = "heartbeat"
    MAX_BYTES: ClassVar[int] = 64 * KiB

    peer_id: str = wire(_PEER_ID)
    addresses: tuple[str, ...] = wire(Seq(_ADDRESS, max_len=16))
    role: str = wire(Str(16, choices=ROLES))
    capacity: float = wire(Float(0.0, 1e6, lo_open=True))
    shards: tuple[Shard, ...] = wire(Seq(_SHARD, max_len=1024))
    step: int = wire(_COUNT)
    versions: Mapping[str, int] = wire(Map(_NAME, _COUNT, max_len=256), default=None)
    loss: float | None = wire(_LOSS, default=None)
    run: bytes = wire(Bytes(max_len=RUN_DIGEST_BYTES), default=b"")
    suspects: Mapping[str, float] = wire(Map(_PEER_ID, Float(0.0, 1e9), max_len=MAX_SUSPECTS), default=None)
    banned: tuple[str, ...] = wire(Seq(_PEER_ID, max_len=MAX_SUSPECTS), default=())
    sent: float = wire(Float(0.0, 1e11), default=0.0)
    probation: bool = wire(Bool(), default=False)

    def __post_init__(self) -> None:
        for name in ("versions", "suspects"):
            if getattr(self, name) is None:  # a default of {} would be shared and mutable
                object.__setattr__(self, name, {})
        Message.__post_init__(self)

    def _validate(self) -> None:
        if len(set(self.shards)) != len(self.shards):
            raise ValueError("shards lists a (layer, expert) pair twice")


@register
@dataclass(frozen=True, slots=True)
class Deathrattle(Message):
    """A node leaving on purpose says so first, so peers need not wait for its heartbeat to expire."""

    KIND: ClassVar[str] = "deathrattle"
    MAX_BYTES: ClassVar[int] = 4 * KiB

    peer_id: str = wire(_PEER_ID)
    step: int = wire(_COUNT)
    reason: str = wire(Str(256), default="")


@register
@dataclass(frozen=True, slots=True)
class ShardClaim(Message):
    """A leased claim on one expert: only the claimant with a valid lease trains it."""

    KIND: ClassVar[str] = "shard_claim"
    MAX_BYTES: ClassVar[int] = 1 * KiB

    layer: int = wire(_LAYER)
    expert: int = wire(_EXPERT)
    lease_expiry: float = wire(_UNIX_TIME)  # seconds since the epoch
    step: int = wire(_COUNT, default=0)

    @property
    def shard(self) -> Shard:
        return (self.layer, self.expert)


@register
@dataclass(frozen=True, slots=True)
class ShardRelease(Message):
    """The owner gives an expert up (leaving, or the assignment moved it), optionally naming its heir."""

    KIND: ClassVar[str] = "shard_release"
    MAX_BYTES: ClassVar[int] = 1 * KiB

    layer: int = wire(_LAYER)
    expert: int = wire(_EXPERT)
    heir: str | None = wire(Optional(_PEER_ID), default=None)  # the heir's peer id
    step: int = wire(_COUNT, default=0)

    @property
    def shard(self) -> Shard:
        return (self.layer, self.expert)


# --- surrogates, snapshots, outer rounds, joining ----------------------------------------------------


@register
@dataclass(frozen=True, slots=True)
class SurrogateDelta(Message):
    """Announcement (in the DHT) of a surrogate update; the payload is served over a P2P stream.

    ``digest`` is the sha256 of the payload message's encoded body, ``size`` its length in bytes. ``step`` is the
    owner's step when it published: receivers in lockstep (``node.lockstep``) apply the update a fixed number of
    their own steps after it, wherever gossip brought it sooner; others ignore it.
    """

    KIND: ClassVar[str] = "surrogate_delta"
    MAX_BYTES: ClassVar[int] = 2 * KiB

    layer: int = wire(_LAYER)
    expert: int = wire(_EXPERT)
    version: int = wire(Int(1))
    base_version: int = wire(_COUNT)
    rank: int = wire(Int(1, 4096))
    digest: bytes = wire(_DIGEST)
    size: int = wire(Int(0, 1024 * MiB))
    step: int = wire(_COUNT, 0)

    def _validate(self) -> None:
        if self.base_version >= self.version:
            raise ValueError(f"base_version {self.base_version} must be below version {self.version}")


@register
@dataclass(frozen=True, slots=True)
class SurrogatePayload(_TensorMessage):
    """The tensors of one surrogate delta (low-rank factors), as announced by a ``SurrogateDelta``."""

    KIND: ClassVar[str] = "surrogate_payload"
    MAX_BYTES: ClassVar[int] = 64 * MiB
    TENSOR_LIMITS: ClassVar[TensorLimits] = TensorLimits(
        max_elements=16 * 2**20, max_ndim=2, codecs=frozenset({"lowrank", "fp16", "raw", "int8"})
    )

    layer: int = wire(_LAYER)
    expert: int = wire(_EXPERT)
    version: int = wire(Int(1))
    tensors: Mapping[str, bytes] = wire(_tensors(64 * MiB))


@register
@dataclass(frozen=True, slots=True)
class ExpertSnapshot(_TensorMessage):
    """An owner's copy of one expert (weights, optionally optimizer state), sent to its heir."""

    KIND: ClassVar[str] = "expert_snapshot"
    MAX_BYTES: ClassVar[int] = 256 * MiB
    TENSOR_LIMITS: ClassVar[TensorLimits] = TensorLimits(
        max_elements=64 * 2**20, codecs=frozenset({"raw", "fp16"})
    )

    layer: int = wire(_LAYER)
    expert: int = wire(_EXPERT)
    step: int = wire(_COUNT)
    tensors: Mapping[str, bytes] = wire(_tensors(256 * MiB))
    to: str | None = wire(Optional(_PEER_ID), default=None)
    """The libp2p peer id this copy is for (a worker's onboarding): signed, so it cannot be replayed to another."""


@register
@dataclass(frozen=True, slots=True)
class ExpertSnapshotLinks(_TensorMessage):
    """An owner's copy of one expert for its heir, as a chain (``node.net.snapshot_chain``): either the links that
    take the heir's copy from version ``base`` to ``version`` (ternary weight changes "link.<i>.<name>"), or a
    keyframe (``base == version``: the weights as the chain holds them, raw), with the second moments factored
    ("v.rows.<name>", "v.cols.<name>") and "adam.step". ``digest``: sha256 of the rebuilt weights."""

    KIND: ClassVar[str] = "expert_snapshot_links"
    MAX_BYTES: ClassVar[int] = 256 * MiB
    TENSOR_LIMITS: ClassVar[TensorLimits] = TensorLimits(
        max_elements=64 * 2**20, codecs=frozenset({"raw", "ternary"})
    )

    layer: int = wire(_LAYER)
    expert: int = wire(_EXPERT)
    step: int = wire(_COUNT)
    chain: int = wire(Int(1))
    base: int = wire(_COUNT)
    version: int = wire(_COUNT)
    digest: bytes = wire(_DIGEST)
    tensors: Mapping[str, bytes] = wire(_tensors(256 * MiB))


@register
@dataclass(frozen=True, slots=True)
class OuterRound(Message):
    """What a peer merged in one outer round of a shared group; peers compare ``fingerprint`` to verify."""

    KIND: ClassVar[str] = "outer_round"
    MAX_BYTES: ClassVar[int] = 4 * KiB

    group: str = wire(_NAME)
    round: int = wire(_COUNT)
    step: int = wire(_COUNT)
    tokens: int = wire(_COUNT)
    num_peers: int = wire(Int(1, 1 << 20))
    fingerprint: bytes = wire(_DIGEST)


@register
@dataclass(frozen=True, slots=True)
class StateRequest(Message):
    """A joiner asks a live peer for the shared groups, the surrogates and the snapshots it inherits."""

    KIND: ClassVar[str] = "state_request"
    MAX_BYTES: ClassVar[int] = 16 * KiB

    groups: tuple[str, ...] = wire(Seq(_NAME, max_len=256))
    surrogates: bool = wire(Bool(), default=True)
    experts: tuple[Shard, ...] = wire(Seq(_SHARD, max_len=1024), default=())


@register
@dataclass(frozen=True, slots=True)
class StateOffer(Message):
    """A peer's answer to a ``StateRequest``: what it can serve, at which versions, and how big."""

    KIND: ClassVar[str] = "state_offer"
    MAX_BYTES: ClassVar[int] = 64 * KiB

    peer_id: str = wire(_PEER_ID)
    step: int = wire(_COUNT)
    versions: Mapping[str, int] = wire(Map(_NAME, _COUNT, max_len=1024))
    size: int = wire(_COUNT)


@register
@dataclass(frozen=True, slots=True)
class StatePart(_TensorMessage):
    """One part of a state download: some tensors of one group at one version."""

    KIND: ClassVar[str] = "state_part"
    MAX_BYTES: ClassVar[int] = 256 * MiB
    TENSOR_LIMITS: ClassVar[TensorLimits] = TensorLimits(max_elements=64 * 2**20, codecs=CODECS)

    group: str = wire(_NAME)
    version: int = wire(_COUNT)
    index: int = wire(_COUNT)
    total: int = wire(Int(1, 1 << 20))
    tensors: Mapping[str, bytes] = wire(_tensors(256 * MiB))

    def _validate(self) -> None:
        if self.index >= self.total:
            raise ValueError(f"part index {self.index} is not below total {self.total}")


# --- worker offload ----------------------------------------------------------------------------------


@register
@dataclass(frozen=True, slots=True)
class Sketch(_TensorMessage):
    """A composer's compressed sample of (x, g) for one owned expert, sent to a worker.

    ``tensors`` holds exactly ``x`` (rows × d_latent: the expert's input at the latent width) and ``g``
    (rows × d_latent: dL/dy at the expert's output, the gate already folded in and the 1/p sub-sampling
    correction applied). ``tokens`` is how many selections the sample stands for. No token ids, no text.
    """

    KIND: ClassVar[str] = "sketch"
    MAX_BYTES: ClassVar[int] = 64 * MiB
    TENSOR_LIMITS: ClassVar[TensorLimits] = TensorLimits(
        max_elements=16 * 2**20, max_ndim=2, codecs=frozenset({"raw", "fp16", "int8", "int4"})
    )
    NAMES: ClassVar[frozenset[str]] = frozenset({"x", "g"})

    layer: int = wire(_LAYER)
    expert: int = wire(_EXPERT)
    step: int = wire(_COUNT)
    tokens: int = wire(Int(1, 1 << 24))
    tensors: Mapping[str, bytes] = wire(_tensors(64 * MiB))
    to: str | None = wire(Optional(_PEER_ID), default=None)
    """The worker's libp2p peer id: signed, so one worker cannot replay a composer's sketch to another."""
    parts: tuple[tuple[int, int, int], ...] = wire(
        Seq(Fixed(_COUNT, Int(1, 1 << 24), Int(1, 1 << 24)), max_len=MAX_SKETCH_PARTS), default=())
    """Several steps' samples in one request (a composer whose worker is behind coalesces them), oldest first:
    ``(step, rows, tokens)`` of each, its rows in that order in ``x`` and ``g``; the worker trains on each in
    turn as on a request of its own. Empty: one step, ``step``."""
    lookahead: int | None = wire(Optional(Int(0, MAX_LOOKAHEAD)), default=None)
    """Steps late the composer expects to apply the answer (it measures that): the worker extrapolates its
    weights by that many momentum-only steps. None: the worker's own ``offload.lookahead``."""

    def _validate(self) -> None:
        # Exactly x and g: an extra name is a channel for whatever else a buggy composer might leak.
        if set(self.tensors) != self.NAMES:
            raise ValueError(f"tensors are {sorted(self.tensors)}, expected exactly ['g', 'x']")
        if self.parts:
            steps = [part[0] for part in self.parts]
            if any(a >= b for a, b in zip(steps, steps[1:], strict=False)) or steps[-1] != self.step:
                raise ValueError(f"part steps {steps} must increase and end at step {self.step}")
            tokens = sum(part[2] for part in self.parts)
            if tokens != self.tokens:
                raise ValueError(f"parts stand for {tokens} tokens, the sketch for {self.tokens}")


@register
@dataclass(frozen=True, slots=True)
class WorkerResult(_TensorMessage):
    """A worker's weight change for one expert (ternary or low-rank compressed), answering a ``Sketch``."""

    KIND: ClassVar[str] = "worker_result"
    MAX_BYTES: ClassVar[int] = 64 * MiB
    TENSOR_LIMITS: ClassVar[TensorLimits] = TensorLimits(max_elements=64 * 2**20, codecs=CODECS)

    layer: int = wire(_LAYER)
    expert: int = wire(_EXPERT)
    step: int = wire(_COUNT)
    tensors: Mapping[str, bytes] = wire(_tensors(64 * MiB))
    loss: float | None = wire(_LOSS, default=None)


__all__ = [
    "KINDS",
    "ROLES",
    "Deathrattle",
    "ExpertSnapshot",
    "Heartbeat",
    "Message",
    "OuterRound",
    "ShardClaim",
    "ShardRelease",
    "Sketch",
    "StateOffer",
    "StatePart",
    "StateRequest",
    "SurrogateDelta",
    "SurrogatePayload",
    "WorkerResult",
    "message_class",
]
