"""Low-rank surrogate deltas with error feedback: convergence to the target, exact receiver mirrors."""

from __future__ import annotations

import math

import pytest
import torch

from parallax.node.model.lowrank import (
    ErrorFeedbackPublisher,
    apply_delta,
    is_half_exact,
    low_rank_factors,
    payload_bytes,
    to_half,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def test_low_rank_factors_shapes_and_best_approximation():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(20, 4, generator=g) @ torch.randn(4, 30, generator=g)  # rank 4
    u, v = low_rank_factors(a, 8)
    assert u.shape == (20, 8) and v.shape == (8, 30)
    assert _rel(u @ v, a) < 1e-5
    u, v = low_rank_factors(a, 2)
    s = torch.linalg.svdvals(a)
    # Eckart-Young: the rank-2 error is the norm of the dropped singular values.
    dropped = torch.linalg.vector_norm(s[2:]).item()
    assert torch.linalg.vector_norm(a - u @ v).item() == pytest.approx(dropped, rel=1e-4)
    u, v = low_rank_factors(torch.randn(3, 50, generator=g), 8)  # rank clipped to min(m, n)
    assert u.shape == (3, 3) and v.shape == (3, 50)
    u, v = low_rank_factors(torch.zeros(5, 4), 2)
    assert torch.equal(u @ v, torch.zeros(5, 4))
    with pytest.raises(ValueError):
        low_rank_factors(torch.zeros(3), 2)
    with pytest.raises(ValueError):
        low_rank_factors(torch.full((2, 2), float("nan")), 1)


@pytest.mark.parametrize("rank", [3, 8])
def test_error_feedback_converges_and_receivers_mirror_exactly(rank):
    g = torch.Generator().manual_seed(1)
    init = {"w_in": torch.randn(48, 8, generator=g), "w_out": torch.randn(8, 48, generator=g),
            "gain": torch.ones(8)}
    target = {n: t + torch.randn(t.shape, generator=g) for n, t in init.items()}
    pub = ErrorFeedbackPublisher(init, rank=rank)
    receivers = [{n: t.clone() for n, t in init.items()} for _ in range(2)]
    refreshes = math.ceil(8 / rank) + 1
    errors = []
    for _ in range(refreshes):
        factors = pub.delta(target)
        if rank * (48 + 8) < 48 * 8:
            assert factors["w_in"][0].shape == (48, rank) and factors["w_in"][1].shape == (rank, 8)
        else:  # factors would be larger than the change: it goes dense
            assert factors["w_in"][0].shape == (48, 8) and factors["w_in"][1].numel() == 0
        assert factors["gain"][1].numel() == 0  # 1-D tensors go dense
        for r in receivers:
            apply_delta(r, factors)
            for n in init:
                assert torch.equal(r[n], pub.published[n])  # bit-identical mirror
        errors.append(max(_rel(pub.published[n], target[n]) for n in ("w_in", "w_out")))
    if rank < 8:
        assert errors[0] > 0.1  # a rank-3 delta cannot carry a rank-8 change in one go
    assert errors[-1] < 1e-5
    assert torch.equal(pub.published["gain"], target["gain"])


def test_moving_target_receivers_track():
    """A target that keeps moving: the residual stays small, and what was cut off is not lost."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 12, generator=g)
    pub = ErrorFeedbackPublisher({"w": w}, rank=2)
    held = {"w": w.clone()}
    for _ in range(30):
        w = w + 0.01 * torch.randn(16, 12, generator=g)
        apply_delta(held, pub.delta({"w": w}))
    assert torch.equal(held["w"], pub.published["w"])
    for _ in range(8):  # once it stops moving, the backlog drains
        apply_delta(held, pub.delta({"w": w}))
    assert _rel(held["w"], w) < 1e-5


def test_apply_to_parameters_and_full_copy():
    g = torch.Generator().manual_seed(3)
    init = {"w": torch.randn(6, 5, generator=g)}
    pub = ErrorFeedbackPublisher(init, rank=8)
    module = torch.nn.Linear(5, 6, bias=False)
    with torch.no_grad():
        module.weight.copy_(init["w"])
    factors = pub.delta({"w": init["w"] * 2})
    apply_delta({"w": module.weight}, factors)  # a live parameter, no autograd error
    assert torch.equal(module.weight.data, pub.published["w"])
    joiner = pub.full()
    assert torch.equal(joiner["w"], pub.published["w"]) and joiner["w"] is not pub.published["w"]
    assert payload_bytes(factors) == 4 * 6 * 5  # dense: rank-5 factors would be 5 * (6 + 5) numbers


def test_factors_only_where_smaller_than_the_change():
    pub = ErrorFeedbackPublisher({"wide": torch.zeros(64, 64), "narrow": torch.zeros(8, 128)}, rank=8)
    g = torch.Generator().manual_seed(4)
    factors = pub.delta({"wide": torch.randn(64, 64, generator=g), "narrow": torch.randn(8, 128, generator=g)})
    assert factors["wide"][0].shape == (64, 8) and factors["wide"][1].shape == (8, 64)  # 1,024 < 4,096 numbers
    assert factors["narrow"][1].numel() == 0  # 8 x (8 + 128) = 1,088 >= 1,024: dense
    assert payload_bytes(factors) == 4 * (8 * 128 + 8 * 128)


def test_mismatches_refused():
    pub = ErrorFeedbackPublisher({"w": torch.zeros(4, 4)}, rank=2)
    with pytest.raises(ValueError):
        pub.delta({"v": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match="shape"):
        pub.delta({"w": torch.zeros(4, 5)})
    with pytest.raises(ValueError):
        apply_delta({"w": torch.zeros(4, 4)}, {"x": (torch.zeros(4, 1), torch.zeros(1, 4))})
    with pytest.raises(ValueError, match="shape"):
        apply_delta({"w": torch.zeros(4, 4)}, {"w": (torch.zeros(3, 1), torch.zeros(1, 4))})
    with pytest.raises(ValueError):
        ErrorFeedbackPublisher({}, rank=0)


def test_half_deltas_cost_half_the_bytes_and_still_converge():
    g = torch.Generator().manual_seed(5)
    init = {"w": torch.randn(48, 32, generator=g), "narrow": torch.randn(8, 48, generator=g)}
    target = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in init.items()}
    pub = ErrorFeedbackPublisher(init, rank=4, half=True)
    held = {n: t.clone() for n, t in init.items()}
    for i in range(40):
        factors = pub.delta(target)
        assert all(is_half_exact(t) for f in factors.values() for t in f)
        if i == 0:
            numbers = sum(t.numel() for f in factors.values() for t in f)
            assert payload_bytes(factors) == 2 * numbers
        apply_delta(held, factors)
        assert all(torch.equal(held[n], pub.published[n]) for n in init)  # receivers mirror exactly
    # The float16 rounding of each delta is not lost: it goes out with the next refresh.
    assert max(_rel(pub.published[n], target[n]) for n in init) < 1e-4


def test_to_half_keeps_values_beyond_float16_range():
    big = torch.tensor([1e5, 1.0 / 3])
    assert torch.equal(to_half(big), big) and not is_half_exact(big)
    small = torch.tensor([1.0 / 3, -2.5])
    assert is_half_exact(to_half(small)) and not torch.equal(to_half(small), small)
