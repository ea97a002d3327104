"""The Nesterov outer optimizer (checked against a hand computation) and the tier schedule."""

from __future__ import annotations

import pytest
import torch

from parallax.node.train.outer import OuterBundle, OuterOptimizer, TierSchedule, to_send


def _param(values, dtype=torch.float32):
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype))


def test_nesterov_two_steps_by_hand():
    p = _param([1.0, -2.0])
    opt = OuterOptimizer({"w": p}, lr=0.7, momentum=0.9)
    # Step 1, merged g1 = (0.5, -1.0): buf = g1; update = g1 + 0.9 buf = (0.95, -1.9);
    # anchor = (1, -2) - 0.7 (0.95, -1.9) = (0.335, -0.67).
    opt.step({"w": torch.tensor([0.5, -1.0])})
    assert torch.allclose(p.data, torch.tensor([0.335, -0.67]))
    # Step 2, g2 = (0.2, 0.4): buf = 0.9 (0.5, -1.0) + g2 = (0.65, -0.5);
    # update = g2 + 0.9 buf = (0.785, -0.05); anchor = (0.335, -0.67) - 0.7 update = (-0.2145, -0.635).
    opt.step({"w": torch.tensor([0.2, 0.4])})
    assert torch.allclose(p.data, torch.tensor([-0.2145, -0.635]))
    assert torch.equal(opt.anchor["w"], p.data)


def test_pseudo_gradient_is_anchor_minus_params():
    p = _param([1.0, 2.0])
    opt = OuterOptimizer({"w": p})
    with torch.no_grad():
        p.add_(torch.tensor([0.25, -0.5]))  # an inner step moved the parameter
    pg = opt.pseudo_gradient()
    assert torch.equal(pg["w"], torch.tensor([-0.25, 0.5]))
    assert torch.equal(opt.anchor["w"], torch.tensor([1.0, 2.0]))  # the anchor stays at the last merge


def test_lone_learner_with_lr1_no_momentum_ends_at_own_params():
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.nn.Parameter(torch.randn(4, 3, generator=g)), "b": _param([0.5, 1.5])}
    opt = OuterOptimizer(params, lr=1.0, momentum=0.0)
    for _ in range(3):
        with torch.no_grad():
            params["a"].add_(torch.randn(4, 3, generator=g))
            params["b"].add_(torch.tensor([0.25, -0.125]))  # dyadic: the round trip is exact
        trained = {n: p.detach().clone() for n, p in params.items()}
        opt.step(opt.pseudo_gradient())
        assert torch.equal(params["b"].data, trained["b"])
        assert torch.allclose(params["a"].data, trained["a"], atol=1e-6)
        assert torch.equal(opt.anchor["a"], params["a"].data)


def test_step_writes_back_in_param_dtype():
    p = _param([1.0, 2.0], dtype=torch.bfloat16)
    opt = OuterOptimizer({"w": p}, lr=1.0, momentum=0.0)
    assert opt.anchor["w"].dtype == torch.float32
    opt.step({"w": torch.tensor([0.5, 0.5])})
    assert p.dtype == torch.bfloat16 and torch.equal(p.data, torch.tensor([0.5, 1.5], dtype=torch.bfloat16))


def test_step_refuses_wrong_names_or_shapes():
    opt = OuterOptimizer({"w": _param([1.0, 2.0])})
    with pytest.raises(ValueError):
        opt.step({"v": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        opt.step({"w": torch.zeros(3)})


def test_state_dict_resumes_momentum():
    grads = [torch.tensor([0.5, -1.0]), torch.tensor([0.2, 0.4]), torch.tensor([-0.3, 0.1])]
    p1 = _param([1.0, -2.0])
    ref = OuterOptimizer({"w": p1})
    for grad in grads:
        ref.step({"w": grad})

    p2 = _param([1.0, -2.0])
    first = OuterOptimizer({"w": p2})
    first.step({"w": grads[0]})
    state = first.state_dict()
    p3 = torch.nn.Parameter(p2.detach().clone())
    resumed = OuterOptimizer({"w": p3})
    resumed.load_state_dict(state)
    for grad in grads[1:]:
        resumed.step({"w": grad})
    assert torch.allclose(p3.data, p1.data)


def test_reset_anchor():
    p = _param([1.0, 2.0])
    opt = OuterOptimizer({"w": p})
    opt.step({"w": torch.tensor([1.0, 1.0])})
    with torch.no_grad():
        p.copy_(torch.tensor([5.0, 6.0]))  # a joiner loaded the group from peers
    opt.reset_anchor(reset_momentum=True)
    assert torch.equal(opt.pseudo_gradient()["w"], torch.zeros(2))
    assert not opt.optimizer.state


def test_schedule_due_and_next_round():
    sched = TierSchedule({"backbone": 100, "router": 25, "latent": 50})
    assert sched.due(1) == []
    assert sched.due(25) == ["router"]
    assert sched.due(50) == ["router", "latent"]
    assert sched.due(100) == ["router", "latent", "backbone"]  # SHARED_GROUPS order, not dict order
    assert sched.due(75) == ["router"]
    assert [s for s in range(1, 201) if "latent" in sched.due(s)] == [50, 100, 150, 200]
    assert sched.next_round("router", 0) == 25
    assert sched.next_round("router", 25) == 50
    assert sched.next_round("backbone", 99) == 100
    with pytest.raises(ValueError):
        sched.due(0)
    with pytest.raises(ValueError):
        sched.next_round("expert", 3)


def test_schedule_validation():
    assert TierSchedule({"router": 2, "backbone": 4}).due(4) == ["router", "backbone"]  # no latent group
    with pytest.raises(ValueError, match="unknown"):
        TierSchedule({"router": 1, "experts": 2})
    with pytest.raises(ValueError):
        TierSchedule({"router": 0})


def test_a_bundle_steps_as_one_optimizer_over_all_its_parts():
    g = torch.Generator().manual_seed(1)
    values = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    whole_params = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
    split_params = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
    whole = OuterOptimizer(whole_params, lr=0.7, momentum=0.9)
    bundle = OuterBundle([OuterOptimizer({n: p}, lr=0.7, momentum=0.9) for n, p in split_params.items()])
    for _ in range(3):
        for params in (whole_params, split_params):
            with torch.no_grad():
                for p in params.values():
                    p.mul_(0.9)  # the same inner progress on both
        assert all(torch.equal(whole.pseudo_gradient()[n], d) for n, d in bundle.pseudo_gradient().items())
        merged = {n: d * 0.5 for n, d in whole.pseudo_gradient().items()}
        whole.step(merged)
        bundle.step(merged)
    assert all(torch.equal(whole_params[n], split_params[n]) for n in values)
    with pytest.raises(ValueError, match="bundle tensors"):
        bundle.step({"a": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="distinct"):
        OuterBundle([OuterOptimizer({"a": split_params["a"]}), OuterOptimizer({"a": split_params["a"]})])


@pytest.mark.parametrize("compression", ["topk", "int4"])
def test_error_feedback_sends_everything_in_the_end_and_a_failed_round_counts_once(compression):
    """Under the sparse and the 4-bit wires the sender keeps what a merged round did not send: over the merged
    rounds, what was sent plus what is kept is exactly the sum of the pseudo-gradients; a round that merged nothing
    changes nothing (its pseudo-gradient is still in the next one); a merge among one applies all that is kept."""
    from parallax.node.outer.transport import decode_contribution, encode_contribution, keep_unsent

    g = torch.Generator().manual_seed(0)
    w = _param(torch.zeros(8192).tolist())
    outer = OuterOptimizer({"w": w}, lr=1.0, momentum=0.0)
    trained, total_delta, total_sent = torch.zeros(8192), torch.zeros(8192), torch.zeros(8192)
    for merged in (True, False, True, True):
        step = torch.randn(8192, generator=g)
        with torch.no_grad():
            w.add_(step)
        trained += step
        pending = to_send(outer, error_feedback=True)
        if not merged:
            continue
        total_delta += outer.pseudo_gradient()["w"]
        sent = decode_contribution(encode_contribution(pending, compression), {"w": (8192,)}, peer="this node")
        if compression == "topk":
            assert 0 < int((sent["w"] != 0).sum()) <= 2 * 64  # two chunks of 4096, 64 kept of each
        else:  # every entry, rounded to within half of one of 7 steps up to its chunk's (1024) largest
            error, largest = (sent["w"] - pending["w"]).abs().view(-1, 1024), pending["w"].abs().view(-1, 1024)
            assert (error > 0).any() and (error <= largest.amax(1, keepdim=True) / 14 * 1.001).all()
        keep_unsent(outer, pending, sent, compression)
        total_sent += sent["w"]
        outer.step(sent)  # the only participant: the merge is what it sent
    torch.testing.assert_close(total_sent + outer.unsent["w"], total_delta, rtol=0, atol=1e-4)
    outer.step_alone()
    assert outer.unsent == {}
    torch.testing.assert_close(outer.anchor["w"], trained, rtol=0, atol=1e-4)  # all the training, in the end
