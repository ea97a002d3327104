"""A live composer gains and loses experts: snapshots carry weights and AdamW state, an adopted expert
trains, the result is indistinguishable from a composer built with the new ownership (checkpoints
included), and a bad snapshot changes nothing."""

from __future__ import annotations

import math

import pytest
import torch

from parallax.node.config import train as config
from parallax.node.config.train import train_config
from parallax.node.config.typed import apply_changes
from parallax.node.train.checkpoint import load_checkpoint, read_info, save_checkpoint, state_hash
from parallax.node.train.composer import BadOptimizerState, Composer, expert_group, moment_bound
from parallax.node.train.data import load_corpus, split_corpus

OWNED_A = (frozenset({0, 2}), frozenset({3}))
OWNED_B = (frozenset({1}), frozenset({0, 2}))
WEIGHTS = ("w_gate.weight", "w_up.weight", "w_down.weight")


@pytest.fixture(scope="module")
def train():
    return split_corpus(load_corpus()[:40_000])[0]


def _cfg(**changes) -> config.TrainConfig:
    cfg = train_config("tiny", steps=40, batch_size=2)
    cfg = config.replace(cfg, optim=config.OptimConfig(warmup_steps=3),
                         surrogate=config.SurrogateConfig(refresh_every=2, distill_steps=2, buffer_tokens=48,
                                                          delta_rank=2))
    return apply_changes(cfg, changes)


def _composer(train, owned, seed=3, cfg=None) -> Composer:
    return Composer(cfg or _cfg(), owned, train, sampler_seed=seed)


def _advance(c: Composer, steps: int) -> None:
    for _ in range(steps):
        c.train_step()
        if c.recorder is not None:
            c.refresh_surrogates()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _expert_weights(c: Composer, eid) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in c.model.expert_parameters(*eid).items()}


def test_snapshot_carries_weights_and_adam_state_and_both_copies_step_alike(train):
    a, b = _composer(train, OWNED_A, seed=3), _composer(train, OWNED_B, seed=4)
    _advance(a, 2)
    _advance(b, 2)  # same scheduler position, so the same learning rate
    eid = (0, 2)
    snap = a.expert_snapshot(eid)
    assert set(snap) == {*WEIGHTS, *(f"adam.{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in WEIGHTS), "adam.step"}
    assert snap["adam.step"].dim() == 0 and snap["adam.step"].dtype == torch.float64 and float(snap["adam.step"]) == 2
    assert all(v.device.type == "cpu" and v.dtype in (torch.float32, torch.float64) for v in snap.values())

    b.adopt_expert(eid, snap)
    assert b.owned == (frozenset({1, 2}), frozenset({0, 2})) and b.model.blocks[0].moe.owned == b.owned[0]
    assert eid in b.publishers
    _assert_same(b.expert_snapshot(eid), snap)

    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in a.model.expert_parameters(*eid).items()}
    for c in (a, b):
        c.optimizer.zero_grad(set_to_none=True)
        for n, p in c.model.expert_parameters(*eid).items():
            p.grad = grads[n].clone()
        c.optimizer_step()
    _assert_same(a.expert_snapshot(eid), b.expert_snapshot(eid))
    assert not torch.equal(a.expert_snapshot(eid)["w_gate.weight"], snap["w_gate.weight"])

    before = a.expert_snapshot(eid)
    n_params = sum(len(g["params"]) for g in a.optimizer.param_groups)
    released = a.release_expert(eid)
    _assert_same(released, before)
    assert a.owned == (frozenset({0}), frozenset({3})) and "2" not in a.model.blocks[0].moe.experts
    assert eid not in a.publishers and eid not in a.recorder.buffers
    assert sum(len(g["params"]) for g in a.optimizer.param_groups) == n_params - len(WEIGHTS)
    live = {id(p) for p in a.model.parameters()}
    assert all(id(p) in live for p in a.optimizer.state)
    a.train_step()  # the composer trains on without it


def test_an_adopted_expert_trains(train):
    c = _composer(train, OWNED_B)
    c.adopt_expert((0, 3), None)
    before = _expert_weights(c, (0, 3))
    c.forward_backward()
    grads = [p.grad for p in c.model.expert_parameters(0, 3).values()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    c.optimizer_step()
    after = _expert_weights(c, (0, 3))
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert float(c.expert_snapshot((0, 3))["adam.step"]) == 1


def test_a_paused_composer_holds_its_experts_as_they_are_and_trains_the_rest(train):
    c = _composer(train, OWNED_B)
    eid = (1, 2)
    _advance(c, 1)
    experts, adam = _expert_weights(c, eid), float(c.expert_snapshot(eid)["adam.step"])
    backbone = {n: p.detach().clone() for n, p in c.model.named_parameters() if "blocks.0.attn" in n}
    assert backbone
    c.pause(True)
    _advance(c, 2)
    _assert_same(_expert_weights(c, eid), experts)
    assert float(c.expert_snapshot(eid)["adam.step"]) == adam  # its optimizer state waits too
    assert all(not torch.equal(p, backbone[n]) for n, p in c.model.named_parameters() if n in backbone)
    c.pause(False)
    _advance(c, 1)
    assert all(not torch.equal(p, experts[n]) for n, p in _expert_weights(c, eid).items())


def test_a_paused_replicated_expert_counts_no_tokens_toward_its_outer_round(train):
    c = _replicated(train, OWNED_B, 4)
    group = expert_group((1, 2))
    c.pause(True)
    _advance(c, 2)
    assert c.tokens_since_merge[group] == 0 and c.tokens_since_merge["backbone"] > 0
    c.pause(False)
    _advance(c, 1)
    assert c.tokens_since_merge[group] == c.tokens_since_merge["backbone"] // 3


@pytest.mark.parametrize("non_owned", ["surrogate", "drop"])
def test_ownership_changes_give_the_composer_built_with_the_new_ownership(train, non_owned):
    cfg = _cfg(**{"surrogate.non_owned": non_owned})
    c = _composer(train, OWNED_A, cfg=cfg)
    c.adopt_expert((0, 1), None)  # between two held experts
    c.adopt_expert((1, 0), None)  # before the one held expert, in the second layer
    c.release_expert((0, 2))
    owned = (frozenset({0, 1}), frozenset({0, 3}))
    fresh = _composer(train, owned, cfg=cfg)
    assert c.owned == owned
    for eid in ((0, 1), (1, 0)):  # the seeded init, exactly
        _assert_same(_expert_weights(c, eid), _expert_weights(fresh, eid))
    assert list(c.model.blocks[0].moe.experts) == ["0", "1"]
    assert state_hash(c) == state_hash(fresh)  # weights, optimizer order, publishers, buffers, counters
    _advance(c, 1)
    _advance(fresh, 1)
    assert state_hash(c) == state_hash(fresh)


def test_checkpoint_after_ownership_change_loads_into_a_fresh_composer(train, tmp_path):
    a, b = _composer(train, OWNED_A, seed=3), _composer(train, OWNED_B, seed=4)
    _advance(a, 2)
    _advance(b, 2)
    a.adopt_expert((1, 0), b.release_expert((1, 0)))
    a.release_expert((0, 2))
    path = save_checkpoint(tmp_path, a, run_id="run-test")
    info = read_info(path)
    assert info.owned == (frozenset({0}), frozenset({0, 3}))
    fresh = _composer(train, info.owned, seed=3)
    load_checkpoint(path, fresh, run_id="run-test")
    assert state_hash(fresh) == state_hash(a)
    _advance(a, 1)
    _advance(fresh, 1)
    assert state_hash(fresh) == state_hash(a)


def _nan(snap):
    snap["w_up.weight"][0, 0] = float("nan")


def _shape(snap):
    snap["w_down.weight"] = snap["w_down.weight"][:, :-1]


def _missing(snap):
    del snap["w_gate.weight"]


def _extra(snap):
    snap["bias"] = torch.zeros(3)


def _partial_adam(snap):
    del snap["adam.step"]


def _adam_inf(snap):
    snap["adam.exp_avg.w_up.weight"][1, 1] = float("inf")


def _negative_second_moment(snap):
    snap["adam.exp_avg_sq.w_gate.weight"][0, 0] = -1.0


def _impossible_first_moment(snap):  # finite and signed right, but no gradient history makes it
    v = snap["adam.exp_avg_sq.w_up.weight"]
    snap["adam.exp_avg.w_up.weight"] = 10 * v.sqrt() + 1e-3


def _huge_second_moment(snap):  # would freeze the expert for thousands of steps
    snap["adam.exp_avg_sq.w_down.weight"] = torch.full_like(snap["adam.exp_avg_sq.w_down.weight"], 1e30)


def _fractional_step(snap):
    snap["adam.step"] = torch.tensor(1.5, dtype=torch.float64)


def _integer_weights(snap):
    snap["w_gate.weight"] = snap["w_gate.weight"].long()


@pytest.mark.parametrize("corrupt, message, state_only", [
    (_nan, "NaN or infinite", False), (_shape, "shape", False), (_missing, "missing", False),
    (_extra, "unexpected", False), (_integer_weights, "floating-point", False),
    (_partial_adam, "missing", True), (_adam_inf, "NaN or infinite", True), (_negative_second_moment, "negative", True),
    (_fractional_step, "whole number", True), (_impossible_first_moment, "not a state AdamW makes", True),
    (_huge_second_moment, "L2 norm", True),
])
def test_a_bad_snapshot_is_refused_and_nothing_changes(train, corrupt, message, state_only):
    a, b = _composer(train, OWNED_A), _composer(train, OWNED_B)
    _advance(a, 1)
    snap = a.expert_snapshot((0, 2))
    corrupt(snap)
    before, owned = state_hash(b), b.owned
    with pytest.raises(ValueError, match=message) as info:
        b.adopt_expert((0, 2), snap)
    # Only a fault in the AdamW state says the weights are still usable (the node then adopts them alone).
    assert isinstance(info.value, BadOptimizerState) == state_only
    assert state_hash(b) == before and b.owned == owned and list(b.model.blocks[0].moe.experts) == ["1"]
    assert (0, 2) not in b.publishers


def test_ownership_changes_that_make_no_sense_are_refused(train):
    c = _composer(train, OWNED_A)
    with pytest.raises(ValueError, match="already owned"):
        c.adopt_expert((0, 2), None)
    with pytest.raises(ValueError, match="not owned"):
        c.release_expert((0, 1))
    with pytest.raises(ValueError, match="not owned"):
        c.expert_snapshot((0, 1))
    with pytest.raises(ValueError, match="no expert"):
        c.adopt_expert((2, 0), None)
    frozen = _composer(train, OWNED_A, cfg=_cfg(**{"surrogate.non_owned": "frozen_copy"}))
    with pytest.raises(ValueError, match="frozen_copy"):
        frozen.adopt_expert((0, 1), None)
    with pytest.raises(ValueError, match="frozen_copy"):
        frozen.release_expert((0, 2))
    merged = Composer(_cfg(), OWNED_A, train, sampler_seed=3, merged_groups=("router", "expert"))
    with pytest.raises(ValueError, match="DiLoCo"):
        merged.release_expert((0, 2))


@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_forward_uses_the_real_expert_after_adopt_and_the_surrogate_after_release(train, kernel):
    c = _composer(train, OWNED_B)
    c.model.set_kernel(kernel)
    moe = c.model.blocks[0].moe
    x_BT, y_BT = c.sampler.next_batch()

    def used() -> dict[str, bool]:
        """Which of expert (0, 3)'s stand-in and real expert the forward runs: the output moves when one is zeroed."""
        with torch.no_grad():
            out = c.model(x_BT, y_BT)
            assert out.tokens_per_expert[0, 3] > 0, "the batch must route to expert (0, 3)"
            found = {}
            for what, module in (("surrogate", moe.surrogates[3]), ("expert", dict(moe.experts).get("3"))):
                if module is None:
                    found[what] = False
                    continue
                saved = [p.clone() for p in module.parameters()]
                for p in module.parameters():
                    p.zero_()
                found[what] = not torch.equal(c.model(x_BT, y_BT).logits, out.logits)
                for p, v in zip(module.parameters(), saved, strict=True):
                    p.copy_(v)
        return found

    def step() -> None:
        c.optimizer.zero_grad(set_to_none=True)
        c.model(x_BT, y_BT).loss.backward()

    assert used() == {"surrogate": True, "expert": False}
    c.adopt_expert((0, 3), None)
    assert used() == {"surrogate": False, "expert": True}
    step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.experts["3"].parameters())
    c.release_expert((0, 3))
    assert used() == {"surrogate": True, "expert": False}


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.5, 0.3)])
def test_adamw_states_keep_the_moment_bound_and_the_bound_is_tight(betas):
    """Real AdamW steps on random and on adversarial (growing) gradients stay within moment_bound; the
    growing sequence g_i ~ (b1/b2)^-i comes within 1% of it, so the bound is neither loose nor wrong."""
    b1, b2 = betas
    bound = moment_bound(betas)
    assert bound is not None
    gen = torch.Generator().manual_seed(0)
    # Cauchy-Schwarz is tight when the gradient at lag k is proportional to (b1/b2)^k: the newest gradient 1,
    # as many steps as keep the oldest within float32's range when squared.
    r = b2 / b1
    n = min(300, int(15 / abs(math.log10(r))))
    extremal = (r ** (torch.arange(n, dtype=torch.float64) - (n - 1))).unsqueeze(1).repeat(1, 50)
    for grads in (torch.randn(300, 50, generator=gen) * torch.rand(300, 1, generator=gen) * 10, extremal):
        p = torch.nn.Parameter(torch.zeros(50))
        opt = torch.optim.AdamW([p], lr=1e-3, betas=betas)
        ratios = []
        for g in grads:
            p.grad = g.float().clone()
            opt.step()
            st = opt.state[p]
            ratios.append(float((st["exp_avg"].abs() / st["exp_avg_sq"].sqrt().clamp_min(1e-30)).max()))
        assert max(ratios) <= bound * 1.001
    assert ratios[-1] >= 0.99 * bound
    assert moment_bound((0.99, 0.9)) is None  # b1^2 >= b2: AdamW's moments admit no such bound


def _replicated(train, owned, seed) -> Composer:  # with outer momentum, so that there is some to carry
    return Composer(_cfg(**{"sync.outer_momentum": 0.9}), owned, train, sampler_seed=seed, replica_outers=True)


def test_a_replicated_experts_outer_state_moves_with_it_and_resumes_exactly(train, tmp_path):
    a, b = _replicated(train, OWNED_A, 3), _replicated(train, OWNED_B, 4)
    assert a.replicated_experts() == [(0, 0), (0, 2), (1, 3)]
    expert_names = set(a.model.group_parameters("expert"))
    assert {n for eid in a.replicated_experts() for n in a.outer[expert_group(eid)].anchor} == expert_names
    _advance(b, 3)
    b.apply_outer(expert_group((1, 0)), b.pseudo_gradient(expert_group((1, 0))))  # an outer step: momentum now
    _advance(b, 2)
    given = b.outer[expert_group((1, 0))].state_dict()
    snapshot = b.release_expert((1, 0))
    assert {k for k in snapshot if k.startswith("outer.")} == {f"outer.{kind}.{n}" for kind in ("anchor", "momentum")
                                                                for n in WEIGHTS}
    assert expert_group((1, 0)) not in b.outer and expert_group((1, 0)) not in b.tokens_since_merge
    a.adopt_expert((1, 0), snapshot)
    taken = a.outer[expert_group((1, 0))].state_dict()
    for name, anchor in given["anchor"].items():
        assert torch.equal(taken["anchor"][name], anchor)
    momenta = [s["momentum_buffer"] for s in taken["optimizer"]["state"].values()]
    assert momenta and all(torch.equal(m, g["momentum_buffer"])
                           for m, g in zip(momenta, given["optimizer"]["state"].values(), strict=True))
    assert a.replicated_experts() == [(0, 0), (0, 2), (1, 0), (1, 3)]  # canonical order, as a fresh composer's
    a.release_expert((0, 0))
    _advance(a, 2)
    path = save_checkpoint(tmp_path, a, run_id="run-test")
    fresh = _replicated(train, read_info(path).owned, 3)
    load_checkpoint(path, fresh, run_id="run-test")
    assert state_hash(fresh) == state_hash(a)
    for eid in a.replicated_experts():
        group = expert_group(eid)
        _assert_same(fresh.outer[group].state_dict()["anchor"], a.outer[group].state_dict()["anchor"])


def test_a_snapshot_without_outer_state_anchors_at_its_weights_and_a_partial_one_is_refused(train):
    a, b = _replicated(train, OWNED_A, 3), _replicated(train, OWNED_B, 4)
    _advance(b, 2)
    snapshot = b.release_expert((1, 0))
    partial = {k: v for k, v in snapshot.items() if k != "outer.anchor.w_up.weight"}
    with pytest.raises(ValueError, match="outer state"):
        a.adopt_expert((1, 0), partial)
    assert (1, 0) not in a.replicated_experts()
    a.adopt_expert((1, 0), {k: v for k, v in snapshot.items() if not k.startswith("outer.")})
    for name, anchor in a.outer[expert_group((1, 0))].anchor.items():
        assert torch.equal(anchor, snapshot[name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]])


def test_the_schedule_position_says_where_the_run_stands_and_when_it_ended() -> None:
    from parallax.node.train.composer import lr_lambda, schedule_position

    factor = lr_lambda(20, 500, 0.1)
    assert schedule_position(120, 500, 0.1) == "step 120 of 500 (24%)"
    assert factor(499) > 0.1 and factor(500) == pytest.approx(0.1) and factor(9_276) == pytest.approx(0.1)
    past = schedule_position(9_276, 500, 0.1)
    assert past.startswith("past its end at step 500") and "10% of the peak" in past


def test_a_slower_composer_follows_the_runs_place_in_the_schedule_only_forwards(train) -> None:
    """The run is at step 35 of 40 while this composer has trained 2: it takes the learning rate of step 35 (near
    the schedule's end), never goes back when told an earlier step, and counts on from there."""
    from parallax.node.train.composer import lr_lambda

    cfg = _cfg()
    c = _composer(train, OWNED_B, cfg=cfg)
    factor = lr_lambda(cfg.optim.warmup_steps, cfg.steps, cfg.optim.min_lr_ratio)
    for _ in range(2):
        c.train_step()
    assert c.schedule_step == c.step == 2
    c.follow_schedule(35)
    assert c.schedule_step == 35 and c.step == 2
    assert all(g["lr"] == pytest.approx(cfg.optim.lr * factor(35)) for g in c.optimizer.param_groups)
    c.follow_schedule(10)
    assert c.schedule_step == 35
    c.train_step()
    assert c.schedule_step == 36 and c.step == 3
    assert all(g["lr"] == pytest.approx(cfg.optim.lr * factor(36)) for g in c.optimizer.param_groups)
