"""What a swarm's metrics files say happened: events of one kind, who owned which expert when, and for how long
two nodes owned one expert at once. Read by the swarm tests and ``parallax bench wan``.

Times are the DHT clock the nodes stamp on every record (``t``); a node's ownership changes are its ``shard``
events (the whole owned set after each change). A ``shard`` event with ``paused`` set holds its experts without
training them (``Composer.pause``): owned, trained by nobody (``ownership(trained=True)``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from parallax.dht.keys import ExpertId

Interval = tuple[float, float]


def events(records: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The records of ``kind`` (``step``, ``round``, ``adopted``, ...), in file order."""
    return [r for r in records if r.get("kind") == kind]


def _experts(shard: dict[str, Any], trained: bool = False) -> set[ExpertId]:
    """The experts a ``shard`` event says the node owns from then on (with ``trained``: none while paused)."""
    return set() if trained and shard.get("paused") else {(int(layer), int(e)) for layer, e in shard["experts"]}


def shard_at(records: Sequence[dict[str, Any]], t: float) -> set[ExpertId]:
    """The experts a node owned at time ``t`` (its last ``shard`` event at or before ``t``)."""
    owned: set[ExpertId] = set()
    for r in events(records, "shard"):
        if r["t"] <= t:
            owned = _experts(r)
    return owned


def ownership(records: Sequence[dict[str, Any]], trained: bool = False) -> dict[ExpertId, list[Interval]]:
    """When the node owned each expert (with ``trained``: owned and not paused): intervals from its ``shard``
    events; one still open at its last record ends there (the node left or was stopped)."""
    end = max((r["t"] for r in records if "t" in r), default=0.0)
    held: dict[ExpertId, float] = {}
    out: dict[ExpertId, list[Interval]] = {}
    for r in events(records, "shard"):
        now = _experts(r, trained)
        for eid in held.keys() - now:
            out.setdefault(eid, []).append((held.pop(eid), r["t"]))
        for eid in now - held.keys():
            held[eid] = r["t"]
    for eid, since in held.items():
        out.setdefault(eid, []).append((since, end))
    return out


def longest_double_ownership(nodes: Sequence[Sequence[dict[str, Any]]], start: float, end: float,
                             ) -> tuple[float, ExpertId | None]:
    """The longest stretch within [``start``, ``end``] during which two of ``nodes`` (their metrics records)
    trained one expert at once (owned it, not paused), and that expert (None: never)."""
    longest: tuple[float, ExpertId | None] = (0.0, None)
    held = [ownership(records, trained=True) for records in nodes]
    for a, b in itertools.combinations(held, 2):
        for eid in a.keys() & b.keys():
            for (a0, a1), (b0, b1) in itertools.product(a[eid], b[eid]):
                both = min(a1, b1, end) - max(a0, b0, start)
                if both > longest[0]:
                    longest = (both, eid)
    return longest


def owned_fraction(nodes: Sequence[Sequence[dict[str, Any]]], total: int, start: float, end: float) -> float | None:
    """The share of expert-time within [``start``, ``end``] during which at least one of ``nodes`` (their metrics
    records) owned the expert, over ``total`` experts (None for an empty window)."""
    if end <= start or total <= 0:
        return None
    covered: dict[ExpertId, list[Interval]] = {}
    for records in nodes:
        for eid, spans in ownership(records).items():
            covered.setdefault(eid, []).extend((max(a, start), min(b, end)) for a, b in spans if b > start and a < end)
    held = 0.0
    for spans in covered.values():
        reach = start
        for a, b in sorted(spans):  # the union of the intervals, measured once
            if b > reach:
                held += b - max(a, reach)
                reach = b
    return held / (total * (end - start))
