"""The expert hand-over state machine (``node/peer/handover.py``), driven with plain events and times."""

from __future__ import annotations

from dataclasses import dataclass

from parallax.node.peer.handover import STALL_S, Ask, Finish, Handover, Phase


@dataclass(frozen=True)
class Snap:
    step: int
    final: bool = False
    age_s: float = 0.0


def _handover(source: str | None = "owner", others: tuple[str, ...] = (), *, own_copy: bool = False,
              wait_s: float = 30.0) -> Handover:
    return Handover(source=source, others=list(others), started=100.0, online_since=50.0, wait_s=wait_s,
                    handover_window_s=30.0, has_own_copy=own_copy)


def test_a_previous_owner_that_had_nothing_yet_is_asked_again_every_other_request() -> None:
    """The previous owner's view lagged ours: it releases (and serves its final snapshot) only after the other
    live peers said they hold nothing. It is asked again every other request, not the last peer over and over."""
    h = _handover(others=("owner", "b", "c"))
    asked = [a.peer for a in h.start() if isinstance(a, Ask)]
    now = 100.0
    for _ in range(3):  # nobody holds it yet: the owner, b, the owner, c
        now += 0.1
        assert h.answered(None, now) == []  # the next request waits for the interval
        now += 0.5
        asked += [a.peer for a in h.tick(now) if isinstance(a, Ask)]
    final = Snap(step=51, final=True, age_s=0.1)
    now += 0.1
    assert h.answered(None, now) == []  # c holds nothing
    now += 0.5
    asked += [a.peer for a in h.tick(now) if isinstance(a, Ask)]
    assert h.answered(final, now + 0.1) == [Finish(final)]  # the owner's fresh final ends the wait
    assert asked == ["owner", "b", "owner", "c", "owner"]
    assert h.phase is Phase.DONE and h.tick(now + 1) == []


def test_requests_are_paced_and_the_wait_ends_with_nothing_when_nobody_served_one() -> None:
    h = _handover()
    assert h.start() == [Ask("owner")]
    assert h.answered(None, 100.2) == []
    assert [h.tick(100.2 + i * 0.05) for i in range(5)] == [[]] * 5  # within half a second: no new request
    assert h.tick(100.8) == [Ask("owner")]  # nobody else to ask: the owner again
    assert h.tick(129.0) == []  # still in flight, the wait not over
    assert h.tick(130.0) == [Finish(None)]


def test_a_stale_final_snapshot_does_not_end_the_wait_but_is_kept_as_the_best() -> None:
    h = _handover(others=("b",))
    h.start()
    stale = Snap(step=10, final=True, age_s=40.0)  # released 40 s before: outside the 30 s window
    assert h.answered(stale, 101.0) == [Ask("b")]
    newer = Snap(step=60)  # a periodic snapshot from b
    assert h.answered(newer, 101.2) == []
    assert h.best == newer
    assert h.tick(131.0) == [Finish(newer)]


def test_a_final_released_before_this_node_came_online_is_stale() -> None:
    h = Handover(source="owner", others=[], started=100.0, online_since=99.0, wait_s=30.0, handover_window_s=30.0)
    h.start()
    before_online = Snap(step=5, final=True, age_s=2.0)  # released at 98.5, we came online at 99
    assert h.answered(before_online, 100.5) == [Ask("owner")]  # not the hand-over's: ask on
    assert h.best == before_online and h.phase is Phase.ASKING


def test_a_dead_owner_with_an_own_heir_copy_asks_nobody() -> None:
    assert _handover(source=None, others=("b", "c"), own_copy=True).start() == [Finish(None)]


def test_a_dead_owner_without_a_copy_asks_every_other_peer_once() -> None:
    h = _handover(source=None, others=("b", "c"))
    assert h.start() == [Ask("b")]
    assert h.answered(None, 100.6) == [Ask("c")]
    assert h.answered(None, 101.2) == [Finish(None)]


def test_a_dead_owners_heir_copy_wins_over_the_final_it_trained_from() -> None:
    """b released the expert to the owner 20 s ago (a final inside the hand-over window), the owner trained it and
    died; c, its heir in c's view, pulled a copy 3 s ago. The final does not end the survey: c's copy wins."""
    h = _handover(source=None, others=("b", "c", "d"))
    assert h.start() == [Ask("b")]
    release = Snap(step=300, final=True, age_s=20.0)
    assert h.answered(release, 100.6) == [Ask("c")]
    heir_copy = Snap(step=120, age_s=3.0)
    assert h.answered(heir_copy, 101.2) == [Ask("d")]
    assert h.answered(None, 101.8) == [Finish(heir_copy)]


def test_peers_a_later_view_shows_are_asked_and_the_final_of_one_ends_the_wait() -> None:
    """Back from a partition on a view that shows one other composer, which holds nothing: once a later view shows
    the owner that trained the expert meanwhile, it is asked, and its fresh final ends the wait."""
    h = _handover(source="first", others=("first",))
    assert h.start() == [Ask("first")]
    assert h.answered(None, 100.1) == []
    assert h.tick(100.6) == [Ask("first")]  # nobody else to ask yet
    h.meet(["first", "trainer"])
    assert h.answered(None, 100.7) == []
    assert h.tick(101.2) == [Ask("trainer")]
    final = Snap(step=40, final=True, age_s=0.5)
    assert h.answered(final, 101.3) == [Finish(final)]


def test_a_survey_asks_each_peer_once_whatever_the_views_show() -> None:
    h = _handover(source=None, others=("b", "c"))
    assert h.start() == [Ask("b")]
    h.meet(["b", "c", "d"])
    assert h.answered(None, 100.6) == [Ask("c")]
    h.meet(["b", "c", "d"])
    assert h.answered(None, 101.2) == [Ask("d")]
    assert h.answered(None, 101.8) == [Finish(None)]
    h.meet(["e"])  # finished: nothing more is asked
    assert h.tick(102.5) == []


def test_nobody_to_ask_finishes_at_once() -> None:
    assert _handover(source=None).start() == [Finish(None)]


def test_an_answer_after_the_wait_finishes_with_the_best_seen() -> None:
    h = _handover()
    h.start()
    late = Snap(step=7)
    assert h.answered(late, 131.0) == [Finish(late)]
    assert h.answered(Snap(step=9), 132.0) == []  # done: later answers change nothing


def test_a_live_co_owners_first_snapshot_ends_the_wait_and_one_from_another_peer_does_not() -> None:
    h = Handover(source="co", others=["b"], started=100.0, online_since=50.0, wait_s=30.0, handover_window_s=30.0,
                 live_source=True)
    assert h.start() == [Ask("co")]
    assert h.answered(None, 100.1) == []  # it has served none yet: ask b, then it again
    assert h.tick(100.7) == [Ask("b")]
    assert h.answered(Snap(step=40), 100.8) == []  # b's periodic copy is not the live one
    assert h.tick(101.4) == [Ask("co")]
    live = Snap(step=44)  # periodic, not final: from the co-owner that keeps training it, enough
    assert h.answered(live, 101.5) == [Finish(live)]


def test_the_best_snapshot_is_the_one_taken_last_whatever_its_step() -> None:
    """Each node counts its own steps: a fast node's copy at step 500 taken 20 s ago is older than a slower
    node's at step 40 taken a fifth of a second ago."""
    h = _handover()
    h.start()
    old = Snap(step=500, age_s=20.0)  # taken at 81
    assert h.answered(old, 101.0) == [Ask("owner")]
    fresh = Snap(step=40, age_s=0.2)  # taken at 101
    assert h.answered(fresh, 101.2) == []
    assert h.best == fresh
    assert h.tick(102.0) == [Ask("owner")]
    assert h.answered(Snap(step=900, age_s=30.0), 102.1) == []  # taken at 72
    assert h.tick(131.0) == [Finish(fresh)]


def test_a_copy_another_peer_holds_is_kept_and_the_previous_owner_asked_next() -> None:
    """b holds a copy it pulled as an heir and will never release: asking it again would end nothing."""
    h = _handover(others=("b", "c"))
    assert h.start() == [Ask("owner")]
    assert h.answered(None, 100.1) == []
    assert h.tick(100.7) == [Ask("b")]
    copy = Snap(step=40, age_s=1.0)
    assert h.answered(copy, 100.8) == []
    assert h.tick(101.4) == [Ask("owner")]
    assert h.best == copy


def test_a_stalled_request_holds_nothing_up_and_its_answer_still_counts() -> None:
    """The previous owner's stream stalls (a link that just came back): after STALL_S the others are asked beside
    it, it is not asked again while stalled, and its final, arriving late, ends the wait."""
    h = _handover(others=("b", "c"))
    assert h.start() == [Ask("owner")]
    assert h.tick(100.0 + STALL_S - 0.1) == []  # not stalled yet
    assert h.tick(100.0 + STALL_S) == [Ask("b")]
    assert h.stalled == {"owner"}
    assert h.answered(None, 102.1) == []  # b holds none
    assert h.tick(102.6) == [Ask("c")]  # the owner's turn, but it is stalled: the next other
    assert h.answered(None, 102.7) == []
    assert h.tick(103.2) == [Ask("b")]
    final = Snap(step=80, final=True, age_s=1.0)
    assert h.answered(final, 103.3, peer="owner") == [Finish(final)]  # the stalled request's answer, late


def test_a_survey_asks_past_a_stalled_peer_and_waits_for_it_within_the_wait() -> None:
    h = _handover(source=None, others=("b", "c"))
    assert h.start() == [Ask("b")]
    assert h.tick(100.0 + STALL_S) == [Ask("c")]  # b stalled: c is asked beside it
    copy = Snap(step=30, age_s=5.0)
    assert h.answered(copy, 102.2) == []  # every peer asked, b not answered yet: the survey waits for it
    assert h.tick(110.0) == []
    newer = Snap(step=12, age_s=0.5)
    assert h.answered(newer, 110.1, peer="b") == [Finish(newer)]  # b's copy was taken last
    assert h.answered(Snap(step=99), 110.2, peer="c") == []  # done: nothing changes


def test_a_survey_whose_stalled_peer_never_answers_ends_with_the_wait() -> None:
    h = _handover(source=None, others=("b", "c"), wait_s=10.0)
    h.start()
    assert h.tick(100.0 + STALL_S) == [Ask("c")]
    copy = Snap(step=30, age_s=1.0)
    assert h.answered(copy, 102.5) == []
    assert h.answered(None, 103.0, peer="c") == []  # not stalled, answered already: ignored
    assert h.tick(110.0) == [Finish(copy)]
