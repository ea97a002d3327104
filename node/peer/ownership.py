"""Which experts a node should hold, and from whom it takes those it gains: pure functions of the view.

``Experts.reconcile`` asks ``plan_ownership`` at every seam and carries the plan out (releases, hand-overs, the
lead of replicated experts); ``previous_owner`` picks whose copy a new owner waits for. No network, no clock: the
tests are tables of views.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

from parallax.dht.keys import ExpertId
from parallax.dht.membership import QuorumState
from parallax.dht.shards import Assignment


class Side(Enum):
    """Where this node stands in the swarm, as its view's quorum says."""

    HELD = "held"
    """On the side holding a majority: it follows the assignment."""
    DOUBT = "doubt"
    """The quorum may be lost: it takes nothing and drops nothing until that is settled."""
    CUT_OFF = "cut_off"
    """Its side of a partition holds no majority: it drops every expert (the other side trains them)."""


@dataclass(frozen=True)
class OwnershipPlan:
    """What a node does with its experts at one seam."""

    side: Side
    release: tuple[ExpertId, ...] = ()
    """Held, no longer assigned to this node (all of them when cut off), in order."""
    take: tuple[ExpertId, ...] = ()
    """Assigned to this node, not held and not already being taken over: hand-overs to start, in order."""
    forget: tuple[ExpertId, ...] = ()
    """Hand-overs in progress of experts no longer assigned to this node (they moved on before it took them)."""


def plan_ownership(assignment: Assignment, me: str, quorum: QuorumState, held: Collection[ExpertId],
                   taking: Collection[ExpertId]) -> OwnershipPlan:
    """The plan for a node ``me`` that holds ``held`` and is taking ``taking`` over, in a fresh view whose
    assignment (with ``me`` in it) is ``assignment`` and whose quorum is ``quorum``."""
    if quorum is QuorumState.LOST:
        return OwnershipPlan(Side.CUT_OFF, release=tuple(sorted(held)), forget=tuple(sorted(taking)))
    if quorum is QuorumState.DOUBT:
        return OwnershipPlan(Side.DOUBT)
    target = {(layer, e) for layer, es in assignment.owned_by(me).items() for e in es}
    return OwnershipPlan(Side.HELD, release=tuple(sorted(set(held) - target)),
                         take=tuple(sorted(target - set(held) - set(taking))),
                         forget=tuple(sorted(set(taking) - target)))


def leads(assignment: Assignment, me: str, held: Collection[ExpertId]) -> frozenset[ExpertId]:
    """The experts of ``held`` whose surrogate ``me`` publishes: those it is the first owner of (with replicas the
    other owners follow the first's surrogate)."""
    return frozenset(eid for eid in held if assignment.owner(*eid) == me)


def previous_owner(eid: ExpertId, assignment: Assignment, before: tuple[str, ...], me: str,
                   alive: Collection[str], stalled: Collection[str]) -> tuple[str | None, bool]:
    """Whose copy a new owner of ``eid`` waits for: (fingerprint or None, whether it is a live replica).

    With replicas, an owner that keeps the expert (in ``before`` and in the new ``assignment``, alive, showing work)
    trains a live copy: that one. Else the first previous owner, unless it is this node, gone, or shows no work
    (a banned or idle owner's copy is not waited for: the heir's is, or the initialisation).
    """
    keepers = [fp for fp in assignment.owners_of(*eid) if fp in before and fp != me and fp in alive
               and fp not in stalled]
    if keepers:
        return keepers[0], True
    previous = before[0] if before else None
    if previous is None or previous == me or previous not in alive or previous in stalled:
        return None, False
    return previous, False


def owners_of(assignment: Assignment | None) -> dict[ExpertId, tuple[str, ...]]:
    """expert -> its owners' fingerprints in ``assignment``, best rank first (empty without one)."""
    if assignment is None:
        return {}
    return {(layer, e): assignment.owners_of(layer, e) for layer, e, _, _ in assignment.items()}
