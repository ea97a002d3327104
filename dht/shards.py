"""Who owns which expert: capacity-weighted rendezvous hashing with bounded loads. Pure functions.

Every node runs ``assign_experts`` on the same live view (run id, model shape, live composers and
their declared capacities) and gets the same answer, with no coordinator and no network.

Scores. Weighted highest-random-weight hashing (Schindelhauer & Schomaker, "Weighted distributed
hash tables", 2005; Resch's logarithmic method): for expert ``(layer, expert)`` and peer ``p`` with
capacity ``w``, ``u = blake2b(run, layer, expert, p)`` mapped into (0, 1) and ``score = -w / ln u``.
Plain HRW gives each expert to its top scorer, which is balanced only in expectation: with 8 experts
and 4 peers some peers get 1 expert and others 3.

Bounded loads. So each layer gets a quota per peer: its largest-remainder (Hamilton) share of the
layer's ``E`` experts by capacity, the tied remainders broken by a per-layer hash so the extra
experts rotate among peers from layer to layer. The quotas sum to exactly ``E``. Then all
(expert, peer) pairs of the layer are walked in decreasing score order and each expert goes to the
first peer that still has quota: the stable matching of experts and peers under the shared scores
(a global greedy, so no expert is favoured by its index). Loads are therefore exactly the quotas:
``floor`` or ``ceil`` of the capacity share.

Heir. The heir of an expert is the peer that would own it if its owner left: the owner of that expert
in the assignment of the same view without the owner. That is the "next rank" under the quotas (with
plain HRW it is exactly the second-highest scorer), and it is what makes the owner's snapshots to its
heir useful: when the owner dies, the heir is the new owner.

Replicas. With R owners per expert (``assign_experts(..., replicas=R)``) the same walk fills R owner slots
per expert, a peer at most once per expert, under quotas of R times the capacity share (a peer's capped at
every expert of the layer, the rest shared among the others). An expert left short when the peers with quota
left own it already is completed by exchanges that keep every load at its quota (``_complete``). The heir of
an expert is then its second owner: a live replica, not a snapshot.

Movement. When one peer joins or leaves, every expert it gains or loses must move; the quotas of the
others also shift by at most one per layer, which can push a few more experts along. The property
tests in ``tests/unit/test_shards.py`` measure it and check the bound ``max_extra_moves``.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import TypeVar

_HASH_DOMAIN = b"parallax/hrw/v1"
_TIE_EXPERT = -1  # the pseudo-expert index whose hash breaks quota ties within a layer

# Measured over 800 random equal-capacity swarms (2-16 peers, 4-64 experts per layer): when one peer
# joins or leaves, the experts that move per layer are the ones it gains or loses (unavoidable) plus
# a few more pushed along by quota shifts (worst seen: 3 of 4, 4 of 8, 5 of 16, 8 of 32, 9 of 64; and
# 5 of 6, with 8 peers on 6 experts, a case rarer than 1 in 6,000 random swarms that tests/unit/test_shards.py
# keeps); in total 1.5-1.8x the unavoidable movement on average. The bound below covers every
# case seen (exactly, for 6 experts); it is not a proof. Plain HRW moves only
# the unavoidable experts but leaves small swarms badly unbalanced; this is the price of balance.


def max_extra_moves(n_experts: int) -> int:
    """The stated bound on experts moved per layer, beyond the unavoidable, by one join or leave."""
    return n_experts // 2 + 2


def _unit_hash(run_id: str, layer: int, expert: int, peer: str) -> float:
    """A uniform number in the open interval (0, 1) from the canonical (run, layer, expert, peer)."""
    parts = (run_id.encode(), struct.pack(">q", layer), struct.pack(">q", expert), peer.encode())
    h = hashlib.blake2b(digest_size=8, person=b"parallax-hrw")
    h.update(_HASH_DOMAIN)
    for part in parts:  # length-prefixed, so no two tuples share an encoding
        h.update(struct.pack(">I", len(part)))
        h.update(part)
    n: int = struct.unpack(">Q", h.digest())[0]
    return (n + 0.5) / 2.0**64


def hrw_score(run_id: str, layer: int, expert: int, peer: str, capacity: float) -> float:
    """Weighted rendezvous score ``-w / ln(u)``: higher wins. Deterministic on every platform."""
    return -capacity / math.log(_unit_hash(run_id, layer, expert, peer))


def _check_inputs(run_id: str, n_layers: int, n_experts: int, peers: Mapping[str, float]) -> None:
    if not run_id:
        raise ValueError("run_id must be a non-empty string")
    if n_layers < 1 or n_experts < 1:
        raise ValueError(f"need at least one layer and one expert, got {n_layers} layers x {n_experts}")
    if not peers:
        raise ValueError("no live peers to assign experts to; wait until at least one composer is online")
    for peer, capacity in peers.items():
        if not isinstance(peer, str) or not peer:
            raise ValueError(f"peer ids must be non-empty strings, got {peer!r}")
        if not (isinstance(capacity, (int, float)) and math.isfinite(capacity) and capacity > 0):
            raise ValueError(f"peer {peer!r} declares capacity {capacity!r}; a capacity must be finite, > 0")


def layer_quotas(run_id: str, layer: int, n_experts: int, peers: Mapping[str, float]) -> dict[str, int]:
    """Largest-remainder share of ``n_experts`` per peer by capacity; the quotas sum to ``n_experts``.

    Exact rational arithmetic, so every node computes the same quotas whatever its float rounding;
    equal remainders are ordered by a per-layer hash of the peer, so the extra experts rotate.
    """
    ids = sorted(peers)
    caps = {p: Fraction(peers[p]) for p in ids}
    total = sum(caps.values(), Fraction(0))
    shares = {p: n_experts * caps[p] / total for p in ids}
    quotas = {p: math.floor(shares[p]) for p in ids}
    left = n_experts - sum(quotas.values())
    by_remainder = sorted(
        ids, key=lambda p: (shares[p] - quotas[p], _unit_hash(run_id, layer, _TIE_EXPERT, p), p), reverse=True
    )
    for p in by_remainder[:left]:
        quotas[p] += 1
    return quotas


def _ranked_pairs(
    run_id: str, layer: int, n_experts: int, peers: Mapping[str, float]
) -> list[tuple[str, int]]:
    """All (peer, expert) pairs of a layer, best score first (ties, never seen in practice, by id)."""
    scored = sorted(
        ((hrw_score(run_id, layer, e, p, peers[p]), p, e) for e in range(n_experts) for p in peers),
        reverse=True,
    )
    return [(p, e) for _, p, e in scored]


def replica_quotas(run_id: str, layer: int, n_experts: int, peers: Mapping[str, float],
                   replicas: int) -> dict[str, int]:
    """Each peer's share of the layer's ``replicas x n_experts`` owner slots by capacity, none above
    ``n_experts`` (a peer owns an expert once): a peer whose share would pass it is capped there and the
    others share the rest. The quotas sum to ``replicas x n_experts``; ``replicas = 1`` is ``layer_quotas``."""
    capped: dict[str, int] = {}
    live = dict(peers)
    while True:
        quotas = layer_quotas(run_id, layer, replicas * n_experts - n_experts * len(capped), live)
        over = [p for p, q in quotas.items() if q > n_experts]
        if not over:
            return {**quotas, **capped}
        for p in over:
            capped[p] = n_experts
            del live[p]


def _match_layer(
    run_id: str,
    layer: int,
    n_experts: int,
    peers: Mapping[str, float],
    ranked: list[tuple[str, int]],
    excluded: str | None = None,
    replicas: int = 1,
) -> list[tuple[str, ...]]:
    """Greedy walk of ``ranked``: each expert takes, until it has ``replicas`` owners, the best-scoring peers
    with quota left that do not own it yet. An expert still short at the end (the peers with quota left own it
    already) is completed by exchanges that keep every load at its quota. Each expert's owners are listed
    best score first."""
    live = {p: c for p, c in peers.items() if p != excluded}
    quotas = replica_quotas(run_id, layer, n_experts, live, replicas)
    owners: list[list[str]] = [[] for _ in range(n_experts)]
    short = n_experts * replicas
    for p, e in ranked:
        if p != excluded and len(owners[e]) < replicas and quotas[p] > 0 and p not in owners[e]:
            owners[e].append(p)
            quotas[p] -= 1
            short -= 1
            if short == 0:
                break
    if short:
        _complete(owners, quotas, replicas)
    rank = {pair: i for i, pair in enumerate(ranked)}
    return [tuple(sorted(row, key=partial(_rank_of, rank, e))) for e, row in enumerate(owners)]


def _rank_of(rank: Mapping[tuple[str, int], int], expert: int, peer: str) -> int:
    return rank[(peer, expert)]


def _complete(owners: list[list[str]], quotas: dict[str, int], replicas: int) -> None:
    """Fill the experts the greedy walk left short. Every peer q with quota left owns each short expert e
    already (else the walk would have placed it), so q takes a full expert e2 it does not own from one of
    e2's owners p that does not own e, and p joins e: q's load grows by one, p's stays. A complete bipartite
    graph with these quotas always has such an exchange (each quota is at most the layer's experts and they
    sum to the owner slots), so the loop ends with every expert full and every quota used."""
    for row in owners:
        while len(row) < replicas:
            q = min(p for p, left in quotas.items() if left > 0)
            e2, p = next((e2, p) for e2, other in enumerate(owners)
                         if q not in other and len(other) == replicas for p in other if p not in row)
            owners[e2].remove(p)
            owners[e2].append(q)
            row.append(p)
            quotas[q] -= 1


@dataclass(frozen=True, slots=True)
class Assignment:
    """The owners and heir of every (layer, expert) for one live view. Build it with ``assign_experts``.

    ``owners[layer][expert]`` is the expert's first owner by rank (its only one with ``replicas`` = 1): the
    one that publishes its surrogate. ``co_owners[layer][expert]`` are its other owners, by rank (empty
    tuples with one replica). ``heirs[layer][expert]`` takes the expert over when its first owner leaves:
    with one replica the peer that would own it without that owner (it keeps a snapshot), with more the
    first co-owner (a live replica); ``None`` when the view holds a single peer.
    """

    run_id: str
    n_layers: int
    n_experts: int
    peers: tuple[str, ...]  # sorted
    owners: tuple[tuple[str, ...], ...]
    heirs: tuple[tuple[str | None, ...], ...]
    co_owners: tuple[tuple[tuple[str, ...], ...], ...] = ()

    @property
    def replicas(self) -> int:
        """Owners per expert."""
        return 1 + (len(self.co_owners[0][0]) if self.co_owners else 0)

    def owner(self, layer: int, expert: int) -> str:
        return self.owners[layer][expert]

    def owners_of(self, layer: int, expert: int) -> tuple[str, ...]:
        """Every owner of the expert, best rank first."""
        return (self.owners[layer][expert], *(self.co_owners[layer][expert] if self.co_owners else ()))

    def heir(self, layer: int, expert: int) -> str | None:
        return self.heirs[layer][expert]

    def owned_by(self, peer: str) -> dict[int, frozenset[int]]:
        """The experts ``peer`` is an owner of, by layer (layers where it owns nothing are left out)."""
        out: dict[int, frozenset[int]] = {}
        for layer in range(self.n_layers):
            mine = frozenset(e for e in range(self.n_experts) if peer in self.owners_of(layer, e))
            if mine:
                out[layer] = mine
        return out

    def inherited_by(self, peer: str) -> dict[int, frozenset[int]]:
        """The experts ``peer`` is heir of and does not own (it should hold a snapshot of them), by layer: none
        with more than one replica, where the heir is a co-owner."""
        out: dict[int, frozenset[int]] = {}
        for layer, row in enumerate(self.heirs):
            mine = frozenset(e for e, h in enumerate(row) if h == peer and peer not in self.owners_of(layer, e))
            if mine:
                out[layer] = mine
        return out

    def items(self) -> Iterable[tuple[int, int, str, str | None]]:
        """Every ``(layer, expert, first owner, heir)``."""
        for layer in range(self.n_layers):
            for expert in range(self.n_experts):
                yield layer, expert, self.owners[layer][expert], self.heirs[layer][expert]

    def load(self) -> dict[str, int]:
        """How many experts each peer owns over all layers."""
        counts = dict.fromkeys(self.peers, 0)
        for layer in range(self.n_layers):
            for expert in range(self.n_experts):
                for o in self.owners_of(layer, expert):
                    counts[o] += 1
        return counts


def assign_experts(run_id: str, n_layers: int, n_experts: int, peers: Mapping[str, float],
                   replicas: int = 1) -> Assignment:
    """The owners and heir of every expert of every layer, from the live peers and their capacities.

    Args:
        run_id: the training run; different runs hash differently.
        n_layers: MoE layers in the model.
        n_experts: experts per layer.
        peers: live composer id -> declared capacity (any positive unit; only ratios matter).
        replicas: owners per expert (``ownership.replicas``): the same walk with R owner slots per expert and
            quotas of R times each peer's capacity share (``replica_quotas``). One replica: disjoint shards.

    Returns:
        An ``Assignment``: complete per layer, with R distinct owners per expert, each peer's load per layer its
        quota (with one replica the floor or ceiling of its capacity share), identical on every node given the
        same inputs.

    Raises:
        ValueError: no peers, a non-positive or non-finite capacity, an empty shape, or ``replicas`` outside
            1..len(peers).
    """
    _check_inputs(run_id, n_layers, n_experts, peers)
    if not 1 <= replicas <= len(peers):
        raise ValueError(f"{replicas} owners per expert need at least {replicas} live peers, the view has {len(peers)}")
    owners: list[tuple[str, ...]] = []
    heirs: list[tuple[str | None, ...]] = []
    co_owners: list[tuple[tuple[str, ...], ...]] = []
    for layer in range(n_layers):
        ranked = _ranked_pairs(run_id, layer, n_experts, peers)
        row = _match_layer(run_id, layer, n_experts, peers, ranked, replicas=replicas)
        owners.append(tuple(o[0] for o in row))
        if replicas > 1:
            co_owners.append(tuple(o[1:] for o in row))
            heirs.append(tuple(o[1] for o in row))
        elif len(peers) == 1:
            heirs.append((None,) * n_experts)
        else:
            # Removing a peer never changes the others' scores, so one ranking serves every "without p".
            without = {p: [o for o, in _match_layer(run_id, layer, n_experts, peers, ranked, excluded=p)]
                       for p in set(owners[-1])}
            heirs.append(tuple(without[owners[-1][e]][e] for e in range(n_experts)))
    return Assignment(
        run_id=run_id,
        n_layers=n_layers,
        n_experts=n_experts,
        peers=tuple(sorted(peers)),
        owners=tuple(owners),
        heirs=tuple(heirs),
        co_owners=tuple(co_owners),
    )


Owner = TypeVar("Owner", str, int)


def expert_bundles(owners: Mapping[tuple[int, int], Sequence[Owner]],
                   ) -> dict[tuple[Owner, ...], tuple[tuple[int, int], ...]]:
    """The experts each set of two or more owners shares (its sorted owners -> the experts, in model order): what
    one outer round among those owners merges (``ownership.replicas`` > 1)."""
    found: dict[tuple[Owner, ...], list[tuple[int, int]]] = {}
    for eid, who in sorted(owners.items()):
        if len(who) > 1:
            found.setdefault(tuple(sorted(who)), []).append(eid)
    return {who: tuple(experts) for who, experts in found.items()}


def moved_experts(before: Assignment, after: Assignment) -> set[tuple[int, int]]:
    """The (layer, expert) pairs whose owner differs between two assignments of the same shape."""
    if (before.n_layers, before.n_experts) != (after.n_layers, after.n_experts):
        raise ValueError("assignments of different model shapes cannot be compared")
    return {(layer, e) for layer, e, o, _ in before.items() if after.owners[layer][e] != o}
