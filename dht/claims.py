"""Leased, signed claims on experts: what the owners say, and which of those claims are valid.

Who *should* own an expert follows from the live view (``shards.assign_experts``); a claim is an
owner saying "I train it now", so every node can check that the expert has no more trainers than owners
(one, or ``ownership.replicas``). Each
owner keeps one record per layer under ``keys.claims_key(run, layer)``, in its own signed subkey:
the ``ShardClaim`` for every expert of that layer it owns, each with a lease, and a ``ShardRelease``
(naming the heir) for every expert it just gave up. The record expires with the leases and is
renewed every heartbeat period, and at once when the assignment changes.

A claim is valid only while its lease runs, its record has not expired, its owner's heartbeat is
alive, and the owner has not released it. If more valid claims name one expert than it has owners (a
handover in flight), those by its assigned owners win, so every node resolves it the same way.

Everything here is pure: the announcer thread (``membership.Membership``) does the I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import msgpack

from parallax.dht.shards import Assignment
from parallax.protocol.errors import RemoteProtocolError
from parallax.protocol.messages import ShardClaim, ShardRelease
from parallax.protocol.schema import MSGPACK_ERRORS

logger = logging.getLogger(__name__)

_CLAIM_SET_TAG = "claims/v1"
MAX_CLAIM_SET_BYTES = 6 * 1024

Shard = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """The model shape that experts are assigned over, and the claim lease. Times in seconds."""

    n_layers: int
    """MoE layers in the model."""
    n_experts: int
    """Experts per MoE layer."""
    lease_s: float = 6.0
    """How long a claim stays valid without renewal (renewed every heartbeat period)."""
    replicas: int = 1
    """Owners per expert (``ownership.replicas``); fewer while fewer composers are alive."""

    def __post_init__(self) -> None:
        if self.n_layers < 1 or self.n_experts < 1:
            raise ValueError(f"need n_layers >= 1 and n_experts >= 1, got {self.n_layers}, {self.n_experts}")
        if self.lease_s <= 0:
            raise ValueError("lease_s must be > 0 seconds")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")


@dataclass(frozen=True, slots=True)
class ClaimSet:
    """One owner's record for one layer: what it claims and what it just released."""

    claims: tuple[ShardClaim, ...] = ()
    releases: tuple[ShardRelease, ...] = ()

    def encode(self) -> bytes:
        return msgpack.packb(  # type: ignore[no-any-return]
            [_CLAIM_SET_TAG, [c.encode() for c in self.claims], [r.encode() for r in self.releases]],
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: object, *, layer: int, peer: str | None = None) -> ClaimSet:
        """Parse a peer's record for ``layer``.

        Raises:
            RemoteProtocolError: undecodable, too big, or naming another layer or an expert twice.
        """
        if not isinstance(data, bytes) or len(data) > MAX_CLAIM_SET_BYTES:
            raise RemoteProtocolError("claim record is not a bounded byte string", peer=peer)
        try:
            obj = msgpack.unpackb(data, raw=False, max_bin_len=MAX_CLAIM_SET_BYTES, max_array_len=4096)
        except MSGPACK_ERRORS as e:
            raise RemoteProtocolError(f"undecodable claim record ({type(e).__name__})", peer=peer) from None
        if not (isinstance(obj, list) and len(obj) == 3 and obj[0] == _CLAIM_SET_TAG):
            raise RemoteProtocolError("claim record is not [tag, claims, releases]", peer=peer)
        if not (isinstance(obj[1], list) and isinstance(obj[2], list)):
            raise RemoteProtocolError("claim record lists are malformed", peer=peer)
        claims = tuple(ShardClaim.decode(b, peer=peer) for b in obj[1])
        releases = tuple(ShardRelease.decode(b, peer=peer) for b in obj[2])
        shards = [c.shard for c in claims] + [r.shard for r in releases]
        if any(s[0] != layer for s in shards):
            raise RemoteProtocolError(f"claim record for layer {layer} names another layer", peer=peer)
        if len(set(shards)) != len(shards):
            raise RemoteProtocolError("claim record names an expert twice", peer=peer)
        return cls(claims, releases)


@dataclass(frozen=True, slots=True)
class Claim:
    """A valid claim, as the view resolved it."""

    layer: int
    expert: int
    holder: str  # the claimant's fingerprint
    lease_expiry: float
    step: int


def build_claim_set(
    assignment: Assignment,
    layer: int,
    owned: Collection[int],
    previously_claimed: Collection[int],
    *,
    now: float,
    lease_s: float,
    step: int = 0,
    peer_ids: Mapping[str, str] | None = None,
) -> ClaimSet:
    """My record for ``layer``: claims for what I own now, releases for what I owned and lost.

    Args:
        assignment: the current assignment from the live view (it names the heirs of released experts).
        owned: experts of this layer I own now (none while cut off from the swarm's majority).
        previously_claimed: experts of this layer I claimed in my last record.
        peer_ids: fingerprint -> libp2p peer id, to name heirs in releases (fingerprint if unknown).
    """
    owned = frozenset(owned)
    claims = tuple(ShardClaim(layer=layer, expert=e, lease_expiry=now + lease_s, step=step) for e in sorted(owned))
    releases = []
    for e in sorted(set(previously_claimed) - owned):
        heir = assignment.owner(layer, e)
        releases.append(ShardRelease(layer=layer, expert=e, heir=(peer_ids or {}).get(heir, heir), step=step))
    return ClaimSet(claims, tuple(releases))


def release_all(
    claimed: Mapping[int, Collection[int]], assignment: Assignment | None, me: str, *, step: int = 0
) -> dict[int, ClaimSet]:
    """My records on a graceful leave: every claimed expert released, naming its heir when known."""
    out: dict[int, ClaimSet] = {}
    for layer, experts in claimed.items():
        releases = []
        for e in sorted(experts):
            heir = assignment.heir(layer, e) if assignment is not None else None
            if heir == me:
                heir = None
            releases.append(ShardRelease(layer=layer, expert=e, heir=heir, step=step))
        out[layer] = ClaimSet((), tuple(releases))
    return out


def valid_claims(
    records: Mapping[int, Mapping[str, tuple[ClaimSet, float]]],
    alive: Collection[str],
    now: float,
    assignment: Assignment | None = None,
) -> dict[Shard, tuple[Claim, ...]]:
    """The valid claims of every claimed expert: at most as many as it has owners.

    Args:
        records: layer -> claimant fingerprint -> (its ClaimSet, record expiration).
        alive: fingerprints whose heartbeat is alive now.
        now: the DHT clock.
        assignment: the current assignment: its owners of an expert win over other claimants (a handover in
            flight), best rank first. Without one, a single claim per expert counts.

    Returns:
        (layer, expert) -> its valid claims, the assigned owners' first by rank, then the others' by claimant id;
        only for experts with at least one valid claim.
    """
    found: dict[Shard, list[Claim]] = {}
    for layer, by_holder in records.items():
        for holder in sorted(by_holder):
            claim_set, record_expiry = by_holder[holder]
            if holder not in alive or record_expiry <= now:
                continue
            for c in claim_set.claims:
                if c.lease_expiry > now:
                    found.setdefault(c.shard, []).append(Claim(layer, c.expert, holder, c.lease_expiry, c.step))
    out: dict[Shard, tuple[Claim, ...]] = {}
    for (layer, expert), claims in found.items():
        owners = assignment.owners_of(layer, expert) if assignment is not None else ()
        rank = {o: i for i, o in enumerate(owners)}
        claims.sort(key=lambda c: (rank.get(c.holder, len(owners)), c.holder))
        out[(layer, expert)] = tuple(claims[:max(1, len(owners))])
    return out
