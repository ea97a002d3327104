"""What ``parallax swarm status`` shows: a ``SwarmView`` turned into peer rows and shard ownership. Pure.

Everything comes from the peers' own heartbeats (``membership.read_view``), so it shows what each node
*says* it does: who is alive, its role, step, loss, the experts it announces as owned and its version
counters. Ownership per layer is the union of those announcements: an expert nobody announces has no
owner (a peer just died, or the run has no composer for it), one announced by more peers than it has owners
(one, or ``ownership.replicas`` as ``view.shards`` says) is contested (a handover in flight for a heartbeat
period, or two nodes disagreeing on the live view).

A heartbeat's age is not read from its send time (the sender's clock); its record expires ``heartbeat_ttl_s``
after it was stored (its sending time plus the sender's store lag, ``Membership.store_lag_s``), so its age since
it landed is ``heartbeat_ttl_s - (expiry - now)``, exact when the peers run that TTL (the default, 6 s,
stretched as the nodes stretch it in a swarm larger than ``full_pace_members``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from parallax.dht.membership import MembershipConfig, SwarmView

DEFAULT_HEARTBEAT_TTL_S: float = MembershipConfig().heartbeat_ttl_s  # what nodes run unless told otherwise
_ROLE_ORDER = {"composer": 0, "worker": 1, "reader": 2, "bootstrap": 3}

PEER_COLUMNS = ("fingerprint", "peer id", "role", "step", "loss", "owned", "experts", "versions", "age s")
SHARD_COLUMNS = ("layer", "owned", "owners (experts)", "no owner", "too many owners")
SUSPECT_COLUMNS = ("peer id", "is", "banned by", "suspected by", "highest score")


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """One live peer as its latest heartbeat describes it."""

    fingerprint: str
    peer_id: str
    role: str
    capacity: float
    step: int
    loss: float | None
    experts: Mapping[int, tuple[int, ...]]  # layer -> sorted experts it announces as owned
    versions: Mapping[str, int]
    heartbeat_age_s: float  # seconds since the heartbeat landed (assuming the TTL, see the module doc)
    expires_in_s: float  # seconds until the heartbeat record expires: dead after that without a new one
    addresses: tuple[str, ...]
    suspects: Mapping[str, float] = dataclasses.field(default_factory=dict)  # peer id -> its score here
    banned: tuple[str, ...] = ()  # peer ids this peer ignores now
    probation: bool = False  # a composer that joined a training swarm and takes no experts until it shows work

    @property
    def n_experts(self) -> int:
        return sum(len(es) for es in self.experts.values())


@dataclass(frozen=True, slots=True)
class LayerOwnership:
    """Who announces which expert of one layer."""

    layer: int
    owners: tuple[tuple[str, ...], ...]  # expert -> sorted fingerprints announcing it (empty: no owner)
    replicas: int = 1
    """Owners each expert should have (``ownership.replicas``)."""

    @property
    def unowned(self) -> tuple[int, ...]:
        return tuple(e for e, o in enumerate(self.owners) if not o)

    @property
    def contested(self) -> tuple[int, ...]:
        """Experts announced by more peers than they have owners."""
        return tuple(e for e, o in enumerate(self.owners) if len(o) > self.replicas)

    def by_owner(self) -> dict[str, tuple[int, ...]]:
        """Fingerprint -> the experts of this layer it announces (sorted by fingerprint)."""
        out: dict[str, list[int]] = {}
        for e, owners in enumerate(self.owners):
            for fp in owners:
                out.setdefault(fp, []).append(e)
        return {fp: tuple(out[fp]) for fp in sorted(out)}


@dataclass(frozen=True, slots=True)
class Suspect:
    """A peer that live composers report evidence against (scores and bans are each node's own)."""

    peer_id: str
    fingerprint: str | None  # the live member announcing this peer id, if any
    banned_by: tuple[str, ...]  # fingerprints of the peers that ignore it now
    suspected_by: tuple[str, ...]  # fingerprints of the peers that report a score for it
    highest_score: float


@dataclass(frozen=True, slots=True)
class DepartedPeer:
    """A peer whose latest members record is a deathrattle (it left on purpose)."""

    fingerprint: str
    peer_id: str
    step: int
    reason: str


@dataclass(frozen=True, slots=True)
class SwarmStatus:
    """The live peers of a run and the ownership of its experts, at ``read_at`` (DHT clock, seconds)."""

    run_id: str
    read_at: float
    peers: tuple[PeerStatus, ...]
    layers: tuple[LayerOwnership, ...]
    n_experts: int  # experts per layer in ``layers`` (0 when nobody owns anything and no shape was given)
    shape_inferred: bool  # True: the shape is the largest (layer, expert) announced, so trailing unowned
    # experts of a larger model cannot show; give the shape to see them
    departed: tuple[DepartedPeer, ...]

    def suspects(self) -> tuple[Suspect, ...]:
        """Every peer some live peer reports a score for or bans, the most banned first."""
        by_peer = {p.peer_id: p.fingerprint for p in self.peers}
        named = {s for p in self.peers for s in (*p.suspects, *p.banned)}
        out = [Suspect(peer_id=s, fingerprint=by_peer.get(s),
                       banned_by=tuple(p.fingerprint for p in self.peers if s in p.banned),
                       suspected_by=tuple(p.fingerprint for p in self.peers if s in p.suspects),
                       highest_score=max((p.suspects[s] for p in self.peers if s in p.suspects), default=0.0))
               for s in named]
        return tuple(sorted(out, key=lambda x: (-len(x.banned_by), -x.highest_score, x.peer_id)))

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able data (layer keys of ``experts`` are strings, as JSON requires)."""
        return {
            "run_id": self.run_id,
            "read_at": self.read_at,
            "peers": [
                {
                    "fingerprint": p.fingerprint,
                    "peer_id": p.peer_id,
                    "role": p.role,
                    "capacity": p.capacity,
                    "step": p.step,
                    "loss": p.loss,
                    "experts": {str(layer): list(es) for layer, es in p.experts.items()},
                    "n_experts": p.n_experts,
                    "versions": dict(p.versions),
                    "heartbeat_age_s": round(p.heartbeat_age_s, 3),
                    "expires_in_s": round(p.expires_in_s, 3),
                    "addresses": list(p.addresses),
                    "suspects": dict(p.suspects),
                    "banned": list(p.banned),
                    "probation": p.probation,
                }
                for p in self.peers
            ],
            "suspects": [
                {"peer_id": s.peer_id, "fingerprint": s.fingerprint, "banned_by": list(s.banned_by),
                 "suspected_by": list(s.suspected_by), "highest_score": s.highest_score}
                for s in self.suspects()
            ],
            "layers": [
                {
                    "layer": lo.layer,
                    "owners": [list(o) for o in lo.owners],
                    "unowned": list(lo.unowned),
                    "contested": list(lo.contested),
                }
                for lo in self.layers
            ],
            "n_experts": self.n_experts,
            "shape_inferred": self.shape_inferred,
            "departed": [
                {"fingerprint": d.fingerprint, "peer_id": d.peer_id, "step": d.step, "reason": d.reason}
                for d in self.departed
            ],
        }


def swarm_status(
    view: SwarmView,
    *,
    now: float | None = None,
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S,
    n_layers: int | None = None,
    n_experts: int | None = None,
    replicas: int | None = None,
) -> SwarmStatus:
    """Summarise ``view``: live peers (composers, workers, bootstrap; each by fingerprint) and ownership.

    Args:
        view: a view from ``membership.read_view``.
        now: the DHT clock to judge liveness and ages at (default ``view.judged_at``).
        heartbeat_ttl_s: the heartbeat TTL the peers run in a small swarm, to turn expiries into ages (seconds;
            stretched by the live peers' number as ``MembershipConfig.paced`` stretches it).
        n_layers, n_experts: the model shape; unknown parts are taken from ``view.shards``, else from
            the largest layer and expert any peer announces.
        replicas: owners per expert (more announcing one is contested); default ``view.shards``'s, else 1.

    Returns:
        A ``SwarmStatus``; ``peers`` is empty when nobody in the run is alive.
    """
    now = view.judged_at if now is None else now
    alive = view.alive(now)
    heartbeat_ttl_s *= MembershipConfig().stretch(len(alive))
    peers = []
    for fp, m in alive.items():
        hb = m.heartbeat
        experts: dict[int, list[int]] = {}
        for layer, e in sorted(hb.shards):
            experts.setdefault(layer, []).append(e)
        expires_in = m.expires_at - now
        peers.append(PeerStatus(
            fingerprint=fp, peer_id=hb.peer_id, role=hb.role, capacity=hb.capacity, step=hb.step, loss=hb.loss,
            experts={layer: tuple(es) for layer, es in experts.items()}, versions=dict(hb.versions),
            heartbeat_age_s=max(0.0, heartbeat_ttl_s - expires_in), expires_in_s=expires_in,
            addresses=tuple(hb.addresses), suspects=dict(hb.suspects), banned=tuple(hb.banned),
            probation=hb.probation,
        ))
    peers.sort(key=lambda p: (_ROLE_ORDER.get(p.role, 9), p.fingerprint))

    announced = [(layer, e, p.fingerprint) for p in peers for layer, es in p.experts.items() for e in es]
    seen_layers = 1 + max((layer for layer, _, _ in announced), default=-1)
    seen_experts = 1 + max((e for _, e, _ in announced), default=-1)
    if view.shards is not None:
        n_layers = view.shards.n_layers if n_layers is None else n_layers
        n_experts = view.shards.n_experts if n_experts is None else n_experts
    inferred = n_layers is None or n_experts is None
    layers_n = max(n_layers or 0, seen_layers)  # a peer announcing beyond the given shape still shows
    experts_n = max(n_experts or 0, seen_experts)
    owners: list[list[list[str]]] = [[[] for _ in range(experts_n)] for _ in range(layers_n)]
    for layer, e, fp in announced:
        owners[layer][e].append(fp)
    if replicas is None:
        replicas = view.shards.replicas if view.shards is not None else 1
    layers = tuple(
        LayerOwnership(layer, tuple(tuple(sorted(o)) for o in row), replicas) for layer, row in enumerate(owners)
    )
    departed = tuple(
        DepartedPeer(fp, d.peer_id, d.step, d.reason) for fp, d in sorted(view.departed.items()) if fp not in alive
    )
    return SwarmStatus(run_id=view.run_id, read_at=now, peers=tuple(peers), layers=layers,
                       n_experts=experts_n if layers else 0, shape_inferred=inferred, departed=departed)


# --- text ---------------------------------------------------------------------------------------------


def compact_ints(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 8]`` -> ``"0-3,5,7,8"``: runs of three or more become ranges."""
    xs = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{xs[i]}-{xs[j]}")
        else:
            parts.extend(str(x) for x in xs[i : j + 1])
        i = j + 1
    return ",".join(parts)


def experts_text(experts: Mapping[int, Iterable[int]]) -> str:
    """Owned experts by layer, e.g. ``"L0:1,5 L1:2"`` (``"-"`` for none)."""
    text = " ".join(f"L{layer}:{compact_ints(es)}" for layer, es in sorted(experts.items()) if es)
    return text or "-"


def versions_text(versions: Mapping[str, int]) -> str:
    """``held/max`` of the version counters a node announces (``"-"`` for none).

    Nodes announce ``{"held": <surrogate versions held>, "max": <newest version>}``; any other
    counters are shown as how many there are and the largest.
    """
    if not versions:
        return "-"
    if set(versions) == {"held", "max"}:
        return f"{versions['held']}/{versions['max']}"
    return f"{len(versions)}/{max(versions.values())}"


def short_peer_id(peer_id: str, keep: int = 6) -> str:
    """``12D3…Mz1q8f``: the kind of id, then its tail (libp2p ids all start alike; JSON has the full id)."""
    if len(peer_id) <= 4 + keep + 1:
        return peer_id
    return f"{peer_id[:4]}…{peer_id[-keep:]}"


def peer_rows(status: SwarmStatus) -> list[tuple[str, ...]]:
    """The peer table, one row per live peer, in the order of ``PEER_COLUMNS``."""
    return [
        (
            p.fingerprint,
            short_peer_id(p.peer_id),
            f"{p.role} (probation)" if p.probation else p.role,
            str(p.step),
            "-" if p.loss is None else f"{p.loss:.4f}",
            str(p.n_experts),
            experts_text(p.experts),
            versions_text(p.versions),
            f"{p.heartbeat_age_s:.1f}",
        )
        for p in status.peers
    ]


def suspect_rows(status: SwarmStatus) -> list[tuple[str, ...]]:
    """The suspects table, one row per peer reported, in the order of ``SUSPECT_COLUMNS``."""
    return [(short_peer_id(s.peer_id), s.fingerprint or "-", " ".join(s.banned_by) or "-",
             " ".join(s.suspected_by) or "-", f"{s.highest_score:.2f}") for s in status.suspects()]


def shard_rows(status: SwarmStatus) -> list[tuple[str, ...]]:
    """The ownership table, one row per layer, in the order of ``SHARD_COLUMNS``."""
    rows: list[tuple[str, ...]] = []
    for lo in status.layers:
        owned = sum(1 for o in lo.owners if o)
        by_owner = "  ".join(f"{fp}: {compact_ints(es)}" for fp, es in lo.by_owner().items())
        contested = " ".join(f"{e}({'+'.join(lo.owners[e])})" for e in lo.contested)
        rows.append((
            str(lo.layer),
            f"{owned}/{len(lo.owners)}",
            by_owner or "-",
            compact_ints(lo.unowned) or "-",
            contested or "-",
        ))
    return rows


__all__ = [
    "DEFAULT_HEARTBEAT_TTL_S",
    "PEER_COLUMNS",
    "SHARD_COLUMNS",
    "SUSPECT_COLUMNS",
    "DepartedPeer",
    "LayerOwnership",
    "PeerStatus",
    "Suspect",
    "SwarmStatus",
    "compact_ints",
    "experts_text",
    "peer_rows",
    "shard_rows",
    "short_peer_id",
    "suspect_rows",
    "swarm_status",
    "versions_text",
]
