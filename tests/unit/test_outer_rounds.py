"""The pure parts of background outer rounds: late application keeps local progress; group state
round-trips to a joiner and refuses what does not fit, or what would throw this node's training away."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch

from parallax.dht.testing import wait_until
from parallax.node.outer.averager import RoundReport, RoundResult, RoundStatus
from parallax.node.outer.background import (
    OFFER_PERIODS,
    RELOAD_LOSS_BOUND,
    BackgroundRounds,
    Replayed,
    best_of,
    group_state,
    live_state,
    load_group_state,
    replay,
    take_anchor,
    take_state,
)
from parallax.node.outer.state import Candidates
from parallax.node.outer.wire import anchor_fingerprint
from parallax.node.train import own_data
from parallax.node.train.outer import OuterOptimizer

DRAWN = SimpleNamespace(step=0)  # a data stream that handed out nothing (``RoundEntry.drawn``)


def make(lr: float = 1.0, momentum: float = 0.0) -> tuple[dict[str, torch.nn.Parameter], OuterOptimizer]:
    params = {"w": torch.nn.Parameter(torch.zeros(3, 2)), "b": torch.nn.Parameter(torch.zeros(2))}
    return params, OuterOptimizer(params, lr=lr, momentum=momentum)


def test_late_merge_keeps_the_progress_made_since_the_round_began() -> None:
    params, outer = make()
    with torch.no_grad():
        params["w"].add_(1.0)  # inner steps before the round
    submitted = outer.live_copy()
    delta = outer.pseudo_gradient()
    with torch.no_grad():
        params["w"].add_(0.5)  # inner steps while the round runs
    merged = {n: 2 * d for n, d in delta.items()}  # the swarm's merge, say
    outer.step_late(merged, submitted)
    # new anchor = old anchor - merged = 0 + 2; live = anchor + progress since submission (0.5)
    assert torch.allclose(outer.anchor["w"], torch.full((3, 2), 2.0))
    assert torch.allclose(params["w"].detach(), torch.full((3, 2), 2.5))
    # the next pseudo-gradient is exactly the progress the merge did not see
    assert torch.allclose(outer.pseudo_gradient()["w"], torch.full((3, 2), -0.5))


def test_on_time_merge_equals_step() -> None:
    params_a, a = make(0.7, 0.9)
    params_b, b = make(0.7, 0.9)
    for p in (params_a, params_b):
        with torch.no_grad():
            p["w"].add_(torch.arange(6.0).reshape(3, 2))
    merged = a.pseudo_gradient()
    a.step(merged)
    b.step_late(merged, b.live_copy())
    assert torch.equal(params_a["w"], params_b["w"]) and torch.equal(a.anchor["w"], b.anchor["w"])


def test_group_state_round_trips_with_momentum_and_keeps_the_joiners_progress() -> None:
    src_params, src = make(0.7, 0.9)
    with torch.no_grad():
        src_params["w"].add_(1.0)
    src.step(src.pseudo_gradient())  # creates momentum buffers
    meta, tensors = group_state(src, group="router", round_id=7, step=70)
    assert meta["momentum"] and len(tensors) == 4

    dst_params, dst = make(0.7, 0.9)
    with torch.no_grad():
        dst_params["b"].add_(0.25)  # the joiner's own progress since its (init) anchor
    assert load_group_state(dst, "router", meta, tensors) == 7
    assert torch.equal(dst.anchor["w"], src.anchor["w"])
    assert torch.allclose(dst_params["b"].detach(), src.anchor["b"] + 0.25)
    buf = dst.optimizer.state[dst.anchor["w"]]["momentum_buffer"]
    assert torch.equal(buf, src.optimizer.state[src.anchor["w"]]["momentum_buffer"])


def test_reload_after_a_round_peers_applied_keeps_only_the_progress_since_submission() -> None:
    """A round whose all-reduce ran but did not verify here: the peers' new anchor holds our delta once;
    the reload must not add it again (only what we trained while the round ran)."""
    src_params, src = make()
    with torch.no_grad():
        src_params["w"].add_(1.0)
    src.step(src.pseudo_gradient())  # the peers applied the round: anchor 1.0, our delta included
    meta, tensors = group_state(src, group="router", round_id=3, step=30)

    params, outer = make()
    with torch.no_grad():
        params["w"].add_(1.0)  # trained before the round: what we submitted
    submitted = outer.live_copy()
    with torch.no_grad():
        params["w"].add_(0.25)  # trained while the round ran
    load_group_state(outer, "router", meta, tensors, since=submitted)
    assert torch.allclose(params["w"].detach(), torch.full((3, 2), 1.25))  # not 2.25
    assert torch.allclose(outer.pseudo_gradient()["w"], torch.full((3, 2), -0.25))


@pytest.mark.parametrize("breakage", ["group", "names", "count", "shape", "nan", "round"])
def test_group_state_that_does_not_fit_is_refused_before_any_change(breakage: str) -> None:
    _, src = make()
    meta, tensors = group_state(src, group="router", round_id=3, step=30)
    if breakage == "group":
        meta = {**meta, "group": "backbone"}
    elif breakage == "names":
        meta = {**meta, "names": ["b", "w"]}
    elif breakage == "count":
        tensors = tensors[:1]
    elif breakage == "shape":
        tensors = [torch.zeros(2, 3), tensors[1]]
    elif breakage == "nan":
        tensors = [torch.full((3, 2), float("nan")), tensors[1]]
    else:
        meta = {**meta, "round": -1}
    params, dst = make()
    before = {n: p.detach().clone() for n, p in params.items()}
    with pytest.raises(ValueError):
        load_group_state(dst, "router", meta, tensors)
    assert all(torch.equal(params[n].detach(), before[n]) for n in params)


def test_a_state_that_raises_the_held_out_loss_is_refused_and_everything_put_back() -> None:
    """The probe stands for this node's held-out loss: here the distance of ``w`` to a target the node trained
    towards. A peer's trained anchor is taken; an untrained one (the initial parameters) is refused, and the anchor,
    the momentum, the live weights and the round are as they were."""
    target = torch.full((3, 2), 2.0)
    params, outer = make(0.7, 0.9)

    def probe() -> float:
        return 1.0 + float((params["w"].detach() - target).norm())

    with torch.no_grad():
        params["w"].add_(1.0)
    outer.step(outer.pseudo_gradient())  # a lone merge: momentum and a moved anchor
    outer.round = 4
    with torch.no_grad():
        params["w"].add_(0.1)
    saved, live = outer.state_dict(), outer.live_copy()
    _, untrained = make(0.7, 0.9)
    meta, tensors = group_state(untrained, group="router", round_id=0, step=0)
    assert probe() * RELOAD_LOSS_BOUND < 1.0 + float(target.norm())  # the untrained state is clearly worse
    assert take_state(outer, "router", {**meta, "source": "QmPeer"}, tensors, probe=probe) is None
    assert outer.round == 4 and all(torch.equal(outer.anchor[n], saved["anchor"][n]) for n in outer.anchor)
    assert all(torch.equal(params[n].detach(), live[n]) for n in params)
    assert torch.equal(outer.optimizer.state[outer.anchor["w"]]["momentum_buffer"],
                       saved["optimizer"]["state"][0]["momentum_buffer"])

    trained_params, trained = make(0.7, 0.9)
    with torch.no_grad():
        trained_params["w"].add_(1.9)
    trained.step(trained.pseudo_gradient())
    meta, tensors = group_state(trained, group="router", round_id=9, step=90)
    assert take_state(outer, "router", meta, tensors, probe=probe) == 9 and outer.round == 9
    assert torch.equal(outer.anchor["w"], trained.anchor["w"])


def test_a_node_that_drops_its_lone_progress_judges_the_state_against_its_own_anchor() -> None:
    """Cut off, a node trained towards its held-out target alone; the swarm's state, without that progress, is
    worse than its live weights on its own batches but better than its own anchor: taken when judged against the
    anchor (``against_anchor``), refused against the live weights; an untrained state is refused either way."""
    target = torch.full((3, 2), 2.0)
    params, outer = make()

    def probe() -> float:
        return 1.0 + float((params["w"].detach() - target).norm())

    with torch.no_grad():
        params["w"].add_(1.9)  # alone, nearly at the target; its anchor is still at 0
    live = outer.live_copy()
    theirs_params, theirs = make()
    with torch.no_grad():
        theirs_params["w"].add_(1.0)
    theirs.step(theirs.pseudo_gradient())  # the swarm's anchor moved halfway
    meta, tensors = group_state(theirs, group="router", round_id=7, step=70)
    assert take_state(outer, "router", meta, tensors, since=live, probe=probe) is None  # against its live weights
    assert all(torch.equal(params[n].detach(), live[n]) for n in params)  # put back
    _, untrained = make()
    cold, cold_tensors = group_state(untrained, group="router", round_id=8, step=80)
    cold_tensors = [t - 5.0 for t in cold_tensors]  # far from anything trained
    assert take_state(outer, "router", cold, cold_tensors, since=live, probe=probe, against_anchor=True) is None
    assert all(torch.equal(params[n].detach(), live[n]) for n in params)
    assert take_state(outer, "router", meta, tensors, since=live, probe=probe, against_anchor=True) == 7
    assert torch.equal(outer.anchor["w"], theirs.anchor["w"]) and torch.equal(params["w"].detach(), theirs.anchor["w"])


def test_of_two_states_that_disagree_the_one_better_on_held_out_data_is_chosen_and_nothing_changes() -> None:
    """A joiner whose two sources disagree (one trained, one stale at the initial parameters or poisoned) chooses by
    its held-out loss, either order; its own state is as it was after the choice; one candidate is chosen as it
    is; without a probe, neither of two."""
    target = torch.full((3, 2), 2.0)
    params, outer = make(0.7, 0.9)
    with torch.no_grad():
        params["w"].add_(0.3)
    outer.step(outer.pseudo_gradient())  # momentum of its own
    outer.round = 3
    outer.unsent = {"w": torch.full((3, 2), 0.01)}
    with torch.no_grad():
        params["w"].add_(0.1)  # and progress since its anchor

    def probe() -> float:
        return 1.0 + float((params["w"].detach() - target).norm())

    trained_params, trained = make(0.7, 0.9)
    with torch.no_grad():
        trained_params["w"].add_(1.9)
    trained.step(trained.pseudo_gradient())
    good = group_state(trained, group="router", round_id=9, step=90)
    stale = group_state(make(0.7, 0.9)[1], group="router", round_id=0, step=0)
    good, stale = ({**good[0], "source": "QmGood"}, good[1]), ({**stale[0], "source": "QmStale"}, stale[1])
    saved, live = outer.state_dict(), outer.live_copy()
    momentum = outer.optimizer.state[outer.anchor["w"]]["momentum_buffer"].clone()
    for pair_ in ([good, stale], [stale, good]):
        assert best_of(outer, "router", pair_, probe=probe) is good
        assert outer.round == 3 and all(torch.equal(outer.anchor[n], saved["anchor"][n]) for n in outer.anchor)
        assert all(torch.equal(params[n].detach(), live[n]) for n in params)
        assert torch.equal(outer.optimizer.state[outer.anchor["w"]]["momentum_buffer"], momentum)
        assert outer.unsent.keys() == {"w"} and torch.equal(outer.unsent["w"], torch.full((3, 2), 0.01))
    assert best_of(outer, "router", [stale], probe=probe) is stale  # one: take_state judges it
    assert best_of(outer, "router", [good, stale]) is None and best_of(outer, "router", []) is None
    broken = ({**good[0], "names": ["other"]}, good[1])  # it does not fit: the other is chosen
    assert best_of(outer, "router", [broken, stale], probe=probe) is stale

    def overflowing() -> float:  # a poisoned state can make the loss NaN: it is never chosen over a finite one
        return math.nan if float(params["w"].detach().abs().max()) > 100 else probe()

    poisoned = ({**good[0], "source": "QmPoisoned"}, [t * 1e6 for t in good[1]])
    for pair_ in ([poisoned, stale], [stale, poisoned]):
        assert best_of(outer, "router", pair_, probe=overflowing) is stale


def test_live_state_is_the_current_weights_under_a_name_of_its_own() -> None:
    params, outer = make()
    with torch.no_grad():
        params["w"].add_(1.5)
    meta, tensors = live_state(outer, group="backbone", step=12)
    assert meta["group"] == "backbone/live" and meta["round"] == 0 and not meta["momentum"]
    assert torch.equal(tensors[meta["names"].index("w")], params["w"].detach())
    with pytest.raises(ValueError):  # never loaded as a group's merged state
        load_group_state(outer, "backbone", meta, tensors)


def test_a_drifted_anchor_takes_the_majoritys_and_keeps_its_weights_so_the_difference_is_sent() -> None:
    # This node applied a round the others did not: their anchor lacks it. It takes their anchor and momentum, keeps
    # its weights, and its next pseudo-gradient holds that round's step beside its own progress.
    params, outer = make(0.7, 0.9)
    with torch.no_grad():
        params["w"].add_(1.0)
    outer.step(outer.pseudo_gradient())  # the round the others missed
    with torch.no_grad():
        params["w"].add_(0.25)  # progress since
    others_params, others = make(0.7, 0.9)
    meta, tensors = group_state(others, group="router", round_id=3, step=30)
    live = outer.live_copy()
    apart = float((outer.anchor["w"] - others.anchor["w"]).norm())
    assert take_anchor(outer, "router", {**meta, "source": "QmPeer"}, tensors, bound=apart * 1.01) == 3
    assert torch.equal(outer.anchor["w"], others.anchor["w"]) and outer.round == 3
    assert all(torch.equal(params[n].detach(), live[n]) for n in params)
    assert torch.allclose(outer.pseudo_gradient()["w"], others.anchor["w"] - live["w"])
    # An anchor further off than a few rounds move one is not taken: nothing changes.
    saved = outer.state_dict()
    far = {**meta, "round": 5}
    assert take_anchor(outer, "router", far, [t + 100.0 for t in tensors], bound=apart * 1.01) is None
    assert outer.round == 3 and all(torch.equal(outer.anchor[n], saved["anchor"][n]) for n in outer.anchor)
    assert all(torch.equal(params[n].detach(), live[n]) for n in params)


class _WaitingAverager:
    """A group's rounds that never find a quorum: each waits until told to end, then reports no group."""

    shapes = {"w": (3, 2), "b": (2,)}

    def __init__(self) -> None:
        self.started: list[int] = []
        self.withdrawn: list[int] = []
        self.heard = 0

    def serve_state(self, provider: object) -> None:
        pass

    def hear_proofs(self, timeout_s: float) -> set[str]:
        self.heard += 1
        return set()

    def vouch(self, served: object) -> set[str]:
        return set()

    def round(self, delta, tokens, round_id, anchor, due, drawn=0) -> RoundResult:
        self.started.append(round_id)
        assert due.wait(timeout=30)
        if due.withdrawn:
            self.withdrawn.append(round_id)
        return RoundResult(None, RoundReport("router", RoundStatus.NO_GROUP, round_id), None)


def _waiting_rounds() -> tuple[_WaitingAverager, SimpleNamespace, BackgroundRounds]:
    """Background rounds of one group whose rounds never find a quorum: (its averager, the composer, the rounds)."""
    _, outer = make()
    averager = _WaitingAverager()
    sync = SimpleNamespace(groups={"router": averager}, config=SimpleNamespace(compression="fp16"))
    composer = SimpleNamespace(outer={"router": outer}, tokens_since_merge={"router": 100}, step=0, sampler=DRAWN)
    return averager, composer, BackgroundRounds(sync, composer)  # type: ignore[arg-type]


def test_a_round_without_a_quorum_stays_on_offer_for_its_periods_then_ends_and_the_due_round_carries_both():
    averager, composer, rounds = _waiting_rounds()
    try:
        assert rounds.submit("router", 1)
        composer.tokens_since_merge["router"] = 40  # trained while round 1 waits
        skipped = [rounds.submit("router", n) for n in range(2, 2 + OFFER_PERIODS)]
        assert skipped == [False] * OFFER_PERIODS
        assert rounds.counts.skipped_busy == OFFER_PERIODS - 1 and rounds.counts.ended_waiting == 1
        assert rounds.owed() == {}  # round 1 is still ending
        rounds.wait(timeout_s=30)
        assert rounds.counts.failed == 1 and composer.tokens_since_merge["router"] == 140  # round 1's tokens back
        assert rounds.owed() == {"router": 1 + OFFER_PERIODS}
        assert rounds.submit("router", 1 + OFFER_PERIODS) and rounds.owed() == {}
        wait_until(lambda: averager.started == [1, 1 + OFFER_PERIODS], timeout=30)
        rounds.end_waiting("router", 7)  # alone for good: the waiting round ends at once, round 7 after it
        rounds.wait(timeout_s=30)
        assert rounds.owed() == {"router": 7} and rounds.counts.ended_waiting == 2
    finally:
        rounds.shutdown()


def _peer_at(value: float) -> tuple[OuterOptimizer, dict[str, torch.Tensor]]:
    """Another peer's outer optimizer of the group (the state it serves), its anchor ``value`` everywhere, and a copy
    of that anchor."""
    _, other = make()
    with torch.no_grad():
        for a in other.anchor.values():
            a.fill_(value)
    return other, {n: a.clone() for n, a in other.anchor.items()}


def _applying_rounds(averager: _WaitingAverager, outer: OuterOptimizer, candidates,  # type: ignore[no-untyped-def]
                     compression: str = "fp16") -> tuple[SimpleNamespace, BackgroundRounds]:
    """(the composer, its background rounds) of the group "router" of ``outer``, whose rounds ``averager`` runs and
    whose downloads of the group's state ``candidates`` answers (with an outer learning rate of 1, no momentum)."""
    states = SimpleNamespace(serve=lambda group, provider: None, candidates=candidates)
    sync = SimpleNamespace(groups={"router": averager}, config=SimpleNamespace(compression=compression))
    composer = SimpleNamespace(outer={"router": outer}, tokens_since_merge={"router": 100}, step=0, sampler=DRAWN,
                               cfg=SimpleNamespace(sync=SimpleNamespace(outer_lr=1.0, outer_momentum=0.0)))
    return composer, BackgroundRounds(sync, composer, states=states)  # type: ignore[arg-type]


def test_a_leave_waits_for_the_state_its_last_round_found_apart_before_it_ends():
    _, outer = make()
    other, theirs = _peer_at(2.0)

    class Apart(_WaitingAverager):
        def round(self, delta, tokens, round_id, anchor, due, drawn=0) -> RoundResult:
            merged = {n: torch.zeros_like(t) for n, t in delta.items()}
            return RoundResult(merged, RoundReport("router", RoundStatus.OK, round_id, apart_from=("QmPeer",)), None)

    def candidates(group, shapes, timeout_s, sources=None, first=()):  # type: ignore[no-untyped-def]
        assert sources == ("QmPeer",)  # the peers that hold the anchor the round found apart from this node's
        return Candidates([group_state(other, group="router", round_id=9, step=0)], frozenset())

    _, rounds = _applying_rounds(Apart(), outer, candidates)
    try:
        assert rounds.submit("router", 1)
        assert [r.status for r in rounds.wait(timeout_s=30)] == [RoundStatus.OK]
        assert rounds.counts.reloads == 1 and outer.round == 9
        assert all(torch.equal(outer.anchor[n], theirs[n]) for n in theirs)
    finally:
        rounds.shutdown()


@pytest.mark.parametrize("outcome", ["applied", "ours left out", "apart", "audit raised"])
def test_a_rounds_audit_runs_at_the_seam_before_the_anchor_moves_and_only_from_the_sets_anchor(outcome):
    """The contribution a round hands over to audit (``RoundResult.case``) was taken from the set's anchor: it is
    audited at the seam that applies the round, before the anchor takes the merge, and not when this node's anchor is
    not the set's (its own contribution left out, or its anchor apart from the majority's). An audit that fails costs
    the round nothing."""
    _, outer = make()
    case = own_data.Case("QmA", 40, {"w": torch.ones(3, 2), "b": torch.ones(2)}, {"w": -torch.ones(3, 2),
                                                                                   "b": -torch.ones(2)})
    seen: list[tuple[str, float]] = []

    class Audited(_WaitingAverager):
        def round(self, delta, tokens, round_id, anchor, due, drawn=0) -> RoundResult:
            merged = {n: torch.full_like(t, -1.0) for n, t in delta.items()}
            report = RoundReport("router", RoundStatus.OK, round_id, participants=("QmMe", "QmA"),
                                 left_out=("QmMe",) if outcome == "ours left out" else (),
                                 ours_left_out=outcome == "ours left out",
                                 apart_from=("QmA",) if outcome == "apart" else ())
            return RoundResult(merged, report, None, case)

    def audit(group: str, got: own_data.Case) -> None:
        assert got is case
        seen.append((group, float(outer.anchor["w"].sum())))
        if outcome == "audit raised":
            raise RuntimeError("an evaluation failed")

    def candidates(group, shapes, timeout_s, sources=None, first=()):  # type: ignore[no-untyped-def]
        return Candidates([], frozenset())

    composer, rounds = _applying_rounds(Audited(), outer, candidates)
    rounds.audit = audit
    try:
        assert rounds.submit("router", 1)
        assert [r.status for r in rounds.wait(timeout_s=30)] == [RoundStatus.OK]
        assert seen == ([] if outcome in ("ours left out", "apart") else [("router", 0.0)])  # the anchor not moved yet
        assert torch.allclose(outer.anchor["w"], torch.ones(3, 2)) and rounds.counts.applied == 1  # then it did
    finally:
        rounds.shutdown()


def test_a_merge_that_left_this_nodes_contribution_out_keeps_all_it_trained_and_takes_the_majoritys_anchor():
    params, outer = make()
    with torch.no_grad():
        params["w"].add_(1.0)  # trained from its own anchor, which the others left behind
    asked: list[object] = []

    class LeftOut(_WaitingAverager):
        def round(self, delta, tokens, round_id, anchor, due, drawn=0) -> RoundResult:
            with torch.no_grad():
                params["w"].add_(0.5)  # trained while the round ran
            merged = {n: torch.full_like(t, -3.0) for n, t in delta.items()}  # the others' step, none of ours
            report = RoundReport("router", RoundStatus.OK, round_id, participants=("QmMe", "QmA", "QmB"),
                                 left_out=("QmMe",), ours_left_out=True)
            return RoundResult(merged, report, {n: torch.ones_like(t) for n, t in delta.items()})

    def candidates(group, shapes, timeout_s, sources=None, first=()):  # type: ignore[no-untyped-def]
        asked.append(sources)
        return Candidates([], frozenset())  # no state arrives: the node keeps what it has

    composer, rounds = _applying_rounds(LeftOut(), outer, candidates, compression="int4")
    try:
        assert rounds.submit("router", 1)
        assert [r.status for r in rounds.wait(timeout_s=30)] == [RoundStatus.OK]
        wait_until(lambda: asked and not rounds._reloads, timeout=30)
        assert asked == [("QmA", "QmB")]  # the senders the merge kept hold the anchor
        assert torch.allclose(outer.anchor["w"], torch.full((3, 2), 3.0))  # the others' step applied
        assert torch.allclose(params["w"].detach(), torch.full((3, 2), 4.5))  # and all this node trained kept
        assert outer.unsent == {}  # nothing of its pending pseudo-gradient was sent: it is still in its weights
        assert composer.tokens_since_merge["router"] == 100  # its tokens count in its next round
    finally:
        rounds.shutdown()


def test_a_failed_round_that_left_this_nodes_contribution_out_reloads_keeping_all_it_trained():
    """Whatever set the others may have applied left ours out: the state downloaded keeps all this node trained since
    its own anchor (no ``since``), and its tokens count in its next round."""
    params, outer = make()
    with torch.no_grad():
        params["w"].add_(1.0)
    other, theirs = _peer_at(2.0)

    class Diverged(_WaitingAverager):
        def round(self, delta, tokens, round_id, anchor, due, drawn=0) -> RoundResult:
            report = RoundReport("router", RoundStatus.DIVERGED, round_id, participants=("QmMe", "QmA", "QmB"),
                                 left_out=("QmMe",), ours_left_out=True, began_allreduce=True)
            return RoundResult(None, report, None)

    def candidates(group, shapes, timeout_s, sources=None, first=()):  # type: ignore[no-untyped-def]
        return Candidates([group_state(other, group="router", round_id=9, step=0)], frozenset())

    composer, rounds = _applying_rounds(Diverged(), outer, candidates)
    try:
        assert rounds.submit("router", 1)
        assert [r.status for r in rounds.wait(timeout_s=30)] == [RoundStatus.DIVERGED]
        assert rounds.counts.reloads == 1 and composer.tokens_since_merge["router"] == 100
        assert torch.allclose(outer.anchor["w"], theirs["w"])
        assert torch.allclose(params["w"].detach(), theirs["w"] + 1.0)  # all it trained, on their anchor
    finally:
        rounds.shutdown()


def _the_others_rounds(k_last: int) -> tuple[OuterOptimizer, dict[int, dict[str, torch.Tensor]],
                                             dict[int, tuple[float, ...]], dict[int, tuple[dict, list]]]:
    """The majority's rounds 1..``k_last`` of the group "router" (momentum 0.5): (their outer optimizer after them, each
    round's merge, the anchor each was a step from, the state they served before each)."""
    others = make(momentum=0.5)[1]
    with torch.no_grad():
        for a in others.anchor.values():
            a.fill_(2.0)
    order = list(_WaitingAverager.shapes)
    merges, bases, states = {}, {}, {}
    for k in range(1, k_last + 1):
        merges[k] = {n: torch.full_like(a, -float(k)) for n, a in others.anchor.items()}
        states[k - 1] = group_state(others, group="router", round_id=k - 1, step=0)
        bases[k] = anchor_fingerprint([others.anchor[n] for n in order])
        others.step(merges[k])
    return others, merges, bases, states


@pytest.mark.parametrize(("served_after", "second"), [(0, "applied"), (1, "applied"), (0, "failed"), (0, "held")])
def test_a_node_left_out_contributes_while_it_downloads_and_applies_again_the_merges_the_state_lacks(served_after,
                                                                                                    second):
    """Left out for its drifted anchor, a node downloads the majority's state while the group's rounds go on (the
    next one is not skipped); the state, served before one or both of the rounds the node applied meanwhile, lands
    with their merges applied again on it (``replay``): the node ends on the others' anchor and momentum, with all it
    trained on top, instead of a round behind them. A round that fails meanwhile was taken from the drifted anchor:
    its tokens come back and nothing it trained is dropped. A state that lands while a round runs waits for it: the
    round was taken from the anchor the state replaces."""
    params, outer = make(momentum=0.5)
    with torch.no_grad():
        params["w"].add_(1.0)  # trained from its own anchor, which the others left behind
    others, merges, bases, states = _the_others_rounds(2)
    order = list(_WaitingAverager.shapes)
    release, hold = threading.Event(), threading.Event()

    class LeftOut(_WaitingAverager):
        def round(self, delta, tokens, round_id, anchor, due, drawn=0) -> RoundResult:
            self.started.append(round_id)
            if round_id == 2 and second == "held":
                assert hold.wait(timeout=30)
            with torch.no_grad():
                params["w"].add_(0.5)  # trained while the round ran
            if round_id == 2 and second == "failed":  # others may have applied a set that fetched ours
                return RoundResult(None, RoundReport("router", RoundStatus.DIVERGED, round_id, began_allreduce=True,
                                                     participants=("QmMe", "QmA", "QmB")), None)
            report = RoundReport("router", RoundStatus.OK, round_id, participants=("QmMe", "QmA", "QmB"),
                                 left_out=("QmMe",), ours_left_out=True, base=bases[round_id])
            return RoundResult({n: t.clone() for n, t in merges[round_id].items()}, report, None)

    def candidates(group, shapes, timeout_s, sources=None, first=()):  # type: ignore[no-untyped-def]
        assert sources == ("QmA", "QmB") and release.wait(timeout=30)  # lands after the second round
        return Candidates([states[served_after]], frozenset())

    averager = LeftOut()
    composer, rounds = _applying_rounds(averager, outer, candidates)
    try:
        for k in (1, 2):
            assert rounds.submit("router", k)  # round 2 runs while the download does
            if k == 2 and second == "held":  # the state lands while round 2 runs: it is not taken yet
                release.set()
                wait_until(lambda: rounds._reloads["router"].done(), timeout=30)
                before = {n: a.clone() for n, a in outer.anchor.items()}
                assert rounds.collect() == [] and rounds.counts.reloads == 0
                assert all(torch.equal(outer.anchor[n], before[n]) for n in order)
                hold.set()
            wait_until(lambda: rounds._in_flight["router"].future.done(), timeout=30)
            assert [r.round_id for r in rounds.collect()] == [k]
        assert averager.started == [1, 2] and rounds.counts.skipped_busy == 0
        release.set()
        wait_until(lambda: "router" not in rounds._reloads or rounds._reloads["router"].done(), timeout=30)
        rounds.collect()
        if second == "failed":  # the majority's round 2 is not here to apply again: one round behind, nothing lost
            others = _the_others_rounds(1)[0]
        assert rounds.counts.reloads == 1 and outer.round == (1 if second == "failed" else 2)
        assert all(torch.allclose(outer.anchor[n], others.anchor[n]) for n in order)  # where the others are
        momentum = {n: outer.optimizer.state[outer.anchor[n]]["momentum_buffer"] for n in order}
        assert all(torch.allclose(momentum[n], others.optimizer.state[others.anchor[n]]["momentum_buffer"])
                   for n in order)
        assert torch.allclose(params["w"].detach(), others.anchor["w"] + 2.0)  # all it trained on top
        assert composer.tokens_since_merge["router"] == 100  # its tokens count in its next round
    finally:
        release.set()
        hold.set()
        rounds.shutdown()


def test_merges_are_applied_again_only_while_each_is_a_step_from_where_the_last_left_the_anchor():
    others, merges, bases, states = _the_others_rounds(3)
    order = list(_WaitingAverager.shapes)
    _, outer = make(momentum=0.5)
    load_group_state(outer, "router", *states[0])
    kept = [Replayed(bases[1], 1, merges[1]), Replayed(bases[3], 3, merges[3])]  # round 2's merge missed here
    assert replay(outer, "router", order, kept) == 1 and outer.round == 1
    assert all(torch.allclose(outer.anchor[n], states[1][1][i]) for i, n in enumerate(order))
    assert replay(outer, "router", order, [Replayed(bases[3], 3, merges[3])]) == 0  # a state none of them is from


def test_back_from_a_partition_a_node_withdraws_its_waiting_round_and_takes_the_others_state_for_its_lone_progress():
    params, outer = make()
    with torch.no_grad():
        for p in params.values():
            p.add_(5.0)  # what it trained alone, cut off from the others
    other, theirs = _peer_at(2.0)
    served = [group_state(other, group="router", round_id=9, step=0), None]
    averager = _WaitingAverager()

    def candidates(group, shapes, timeout_s, sources=None, first=()):  # type: ignore[no-untyped-def]
        assert averager.heard == 3 - len(served)  # the proofs the others show, heard before each download
        assert first == set()  # the peers the records vouch for (none here) asked first
        found = served.pop(0)
        return Candidates([] if found is None else [found], frozenset())

    states = SimpleNamespace(serve=lambda group, provider: None, candidates=candidates)
    sync = SimpleNamespace(groups={"router": averager}, config=SimpleNamespace(compression="fp16"))
    composer = SimpleNamespace(outer={"router": outer}, tokens_since_merge={"router": 100}, step=0, sampler=DRAWN)
    rounds = BackgroundRounds(sync, composer, states=states)  # type: ignore[arg-type]

    def collected(predicate) -> bool:  # type: ignore[no-untyped-def]
        rounds.collect()
        return bool(predicate())

    try:
        assert rounds.submit("router", 1)
        composer.tokens_since_merge["router"] = 40
        rounds.rebase()  # the waiting round is withdrawn; the group waits for the others' state
        assert not rounds.submit("router", 2)
        wait_until(lambda: averager.withdrawn == [1], timeout=30)
        # round 1 ends (its tokens back), then the download runs and replaces what it trained alone
        wait_until(lambda: collected(lambda: outer.round == 9), timeout=30)
        assert composer.tokens_since_merge["router"] == 0
        assert all(torch.equal(outer.anchor[n], theirs[n]) and torch.equal(params[n].detach(), theirs[n])
                   for n in params)
        assert rounds.owed() == {} and rounds.submit("router", 3)
        composer.tokens_since_merge["router"] = 30
        rounds.rebase()  # nobody serves the state this time: what it trained stays, with its tokens
        wait_until(lambda: collected(lambda: not served and rounds.counts.failed == 2 and not rounds.busy("router")),
                   timeout=30)
        wait_until(lambda: collected(lambda: composer.tokens_since_merge["router"] == 30), timeout=30)
        assert rounds.counts.reloads == 1
        rounds.wait(timeout_s=30)  # leaving: a rebase asked for now starts no download
        rounds.rebase()
        assert not rounds._reloads
    finally:
        rounds.shutdown()


def test_lockstep_settles_every_round_before_the_next_step_and_ends_one_still_waiting_for_a_quorum():
    import threading

    averager, _, rounds = _waiting_rounds()
    stop = threading.Event()
    try:
        assert rounds.submit("router", 1)
        rounds.settle(stop, quorum_wait_s=0.2)  # no step passes while it waits: its wait for a quorum is ended
        assert averager.started == [1]
        assert [r.status for r in rounds.collect()] == [RoundStatus.NO_GROUP] and not rounds.busy("router")
        assert rounds.submit("router", 2)
        waiting = threading.Thread(target=rounds.settle, args=(stop, 60.0))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive()  # its round waits for a quorum, and the wait for it with it
        stop.set()  # Ctrl+C ends the wait
        waiting.join(timeout=30)
        assert not waiting.is_alive() and rounds.busy("router")
    finally:
        rounds.shutdown()
