"""The pure parts of background outer rounds: late application keeps local progress; group state
round-trips to a joiner and refuses what does not fit."""

from __future__ import annotations

import pytest
import torch

from parallax.node.net.outer_rounds import group_state, load_group_state
from parallax.node.train.outer import OuterOptimizer


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
