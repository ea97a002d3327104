"""Surrogate updates in lockstep: applied a fixed number of the receiver's steps after their owner published them."""

from __future__ import annotations

import pytest

from parallax.node.net.gossip import SurrogateUpdate
from parallax.node.peer.lockstep import AHEAD_LAGS, LockstepSurrogates


def _update(expert: int, version: int, step: int, layer: int = 0) -> SurrogateUpdate:
    return SurrogateUpdate(layer, expert, version, step=step)


def test_an_update_lands_one_lag_after_its_publication_whenever_it_arrived() -> None:
    early, late = LockstepSurrogates(10), LockstepSurrogates(10)
    early.add([_update(1, 2, step=10)], step=11)  # gossip brought it at once
    late.add([], step=11)
    for step in range(11, 20):
        assert early.due(step) == [] and late.due(step) == []
    late.add([_update(1, 2, step=10)], step=19)  # nine steps later
    assert [u.version for u in early.due(20)] == [u.version for u in late.due(20)] == [2]
    assert early.due(21) == []


def test_an_experts_later_deltas_wait_behind_one_not_due_and_others_pass() -> None:
    held = LockstepSurrogates(10)
    held.add([_update(1, 2, step=10), _update(1, 3, step=5), _update(2, 7, step=0)], step=12)
    assert [(u.expert, u.version) for u in held.due(15)] == [(2, 7)]  # v3 of expert 1 waits for v2
    assert [(u.expert, u.version) for u in held.due(20)] == [(1, 2), (1, 3)]


def test_a_refresh_step_waits_for_the_updates_of_one_refresh_before_until_they_come_or_are_late() -> None:
    held = LockstepSurrogates(10)
    followed = {(0, 1): "a", (0, 2): "a", (1, 0): "b"}
    assert held.expect(10, lambda: followed) == set()  # owners first publish at step 10
    assert held.expect(15, lambda: pytest.fail("asked between refresh steps")) == set()
    expected = held.expect(20, lambda: followed)
    assert held.missing(20, expected) == set(followed)  # nothing of step 10 yet
    held.add([_update(1, 1, step=10), _update(2, 1, step=10)], step=20)
    assert held.missing(20, expected) == {(1, 0)}
    held.late({(1, 0)}, step=20)
    assert held.missing(30, held.expect(30, lambda: followed)) == {(0, 1), (0, 2)}  # a late expert is not waited...
    held.add([_update(0, 1, step=20, layer=1)], step=30)
    assert held.missing(40, held.expect(40, lambda: followed)) == {(0, 1), (0, 2), (1, 0)}  # ...until it catches up


def test_an_owner_that_announces_old_steps_is_waited_for_once_not_at_every_refresh() -> None:
    held = LockstepSurrogates(10)
    followed = {(0, 1): "a"}
    held.expect(10, lambda: followed)
    assert held.missing(20, held.expect(20, lambda: followed)) == {(0, 1)}
    held.late({(0, 1)}, step=20)
    for step in (30, 40, 50):
        held.add([_update(1, step // 10, step=0)], step=step)  # step 0 again and again: never one refresh before
        assert held.expect(step, lambda: followed) == set()


def test_an_expert_whose_owner_changed_since_the_last_refresh_is_not_waited_for() -> None:
    held = LockstepSurrogates(10)
    held.expect(10, lambda: {(0, 1): "a", (0, 2): "a"})
    assert held.expect(20, lambda: {(0, 1): "c", (0, 2): "a"}) == {(0, 2)}  # c's first update comes when it adopted
    assert held.expect(30, lambda: {(0, 1): "c", (0, 2): "a"}) == {(0, 1), (0, 2)}


def test_updates_a_snapshot_holds_already_are_not_applied_again_and_versions_name_what_is_applied() -> None:
    held = LockstepSurrogates(10)
    held.add([_update(1, 3, step=10), _update(1, 4, step=20), _update(2, 7, step=20)], step=21)
    assert held.applied({(0, 1): 4, (0, 2): 7, (0, 3): 2}) == {(0, 3): 2}  # the held ones are not in the model yet
    assert [u.version for u in held.due(20)] == [3]
    assert held.applied({(0, 1): 4, (0, 2): 7}) == {(0, 1): 3}
    held.replaced((0, 1), 4)  # a snapshot set the surrogate at version 4
    assert [(u.expert, u.version) for u in held.due(30)] == [(2, 7)]
    assert held.applied({(0, 1): 4, (0, 2): 7}) == {(0, 1): 4, (0, 2): 7}


def test_a_step_announced_far_ahead_delays_its_update_by_a_bounded_number_of_steps() -> None:
    held = LockstepSurrogates(10)
    held.add([_update(1, 2, step=10**9)], step=3)
    due_at = 3 + (AHEAD_LAGS + 1) * 10
    assert held.due(due_at - 1) == []
    assert [u.version for u in held.due(due_at)] == [2]


def test_a_lag_below_one_step_is_refused() -> None:
    with pytest.raises(ValueError, match="lag"):
        LockstepSurrogates(0)
