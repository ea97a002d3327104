"""The ownership planner (``node/peer/ownership.py``) as tables: which experts a node releases, takes over and
publishes, and whose copy a new owner waits for, from the view alone."""

from __future__ import annotations

import pytest

from parallax.dht.membership import QuorumState
from parallax.dht.shards import assign_experts
from parallax.node.peer.ownership import Side, leads, plan_ownership, previous_owner

PEERS = {"a": 1.0, "b": 1.0, "c": 1.0}
ONE = assign_experts("plan", 2, 4, PEERS)
TWO = assign_experts("plan", 2, 4, PEERS, replicas=2)
ALL = {(layer, e) for layer in range(2) for e in range(4)}


def _mine(assignment, me: str) -> set:
    return {(layer, e) for layer, es in assignment.owned_by(me).items() for e in es}


@pytest.mark.parametrize(("held", "taking", "release", "take", "forget"), [
    ("mine", set(), set(), set(), set()),  # settled: nothing to do
    (set(), set(), set(), "mine", set()),  # a joiner: takes every expert assigned to it
    (set(), "mine", set(), set(), set()),  # taking them over already: starts none twice
    ("all", set(), "others", set(), set()),  # alone before, now one of three: gives the others' back
    ("mine", "others", set(), set(), "others"),  # hand-overs of experts that moved on are forgotten
])
def test_a_node_with_a_majority_follows_the_assignment(held, taking, release, take, forget) -> None:
    mine = _mine(ONE, "a")
    sets = {"mine": mine, "all": ALL, "others": ALL - mine}
    held, taking, release, take, forget = (sets.get(x, x) if isinstance(x, str) else x
                                           for x in (held, taking, release, take, forget))
    plan = plan_ownership(ONE, "a", QuorumState.HELD, held, taking)
    assert plan.side is Side.HELD
    assert (set(plan.release), set(plan.take), set(plan.forget)) == (release, take, forget)
    assert list(plan.release) == sorted(plan.release) and list(plan.take) == sorted(plan.take)


def test_cut_off_drops_everything_and_in_doubt_changes_nothing() -> None:
    mine = _mine(ONE, "a")
    cut = plan_ownership(ONE, "a", QuorumState.LOST, mine, {(1, 3)})
    assert cut.side is Side.CUT_OFF and set(cut.release) == mine and cut.forget == ((1, 3),) and not cut.take
    doubt = plan_ownership(ONE, "a", QuorumState.DOUBT, set(), set())
    assert doubt.side is Side.DOUBT and not (doubt.release or doubt.take or doubt.forget)


def test_the_first_owner_publishes_and_a_co_owner_follows() -> None:
    held = _mine(TWO, "a")
    first = {eid for eid in held if TWO.owner(*eid) == "a"}
    assert leads(TWO, "a", held) == first and first < held  # with two owners each, "a" leads some of its experts
    assert leads(ONE, "a", _mine(ONE, "a")) == _mine(ONE, "a")


@pytest.mark.parametrize(("before", "alive", "stalled", "expected"), [
    (("b",), {"a", "b", "c"}, set(), ("b", False)),  # the previous owner, alive: its final snapshot
    (("b",), {"a", "c"}, set(), (None, False)),  # gone: the heir's copy or the initialisation
    (("b",), {"a", "b", "c"}, {"b"}, (None, False)),  # banned or idle: not waited for
    (("a",), {"a", "b", "c"}, set(), (None, False)),  # this node's own earlier copy is no source
    ((), {"a", "b", "c"}, set(), (None, False)),  # nobody owned it (a new run)
])
def test_whose_copy_a_new_owner_waits_for(before, alive, stalled, expected) -> None:
    eid = next(iter(_mine(ONE, "a")))
    assert previous_owner(eid, ONE, before, "a", alive, stalled) == expected


def test_a_co_owner_that_keeps_the_expert_is_the_live_source() -> None:
    eid = next(e for e in ALL if "a" in TWO.owners_of(*e) and TWO.owners_of(*e)[0] != "a")
    keeper = next(fp for fp in TWO.owners_of(*eid) if fp != "a")
    other = next(fp for fp in PEERS if fp not in TWO.owners_of(*eid))
    assert previous_owner(eid, TWO, (other, keeper), "a", set(PEERS), set()) == (keeper, True)
    assert previous_owner(eid, TWO, (other, keeper), "a", set(PEERS), {keeper}) == (other, False)
