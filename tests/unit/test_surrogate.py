"""Surrogate refresh: the ring buffer of routed activations and the distillation."""

from __future__ import annotations

import torch

from parallax.node.model.surrogate import ActivationBuffer, ActivationRecorder, distill, jacobian_error, relative_error
from parallax.node.model.transformer import SwiGLU


def test_buffer_keeps_the_most_recent_rows():
    buf = ActivationBuffer(capacity=5, width=2)
    buf.add(torch.arange(6.0).view(3, 2))  # rows 0..2
    assert len(buf) == 3
    buf.add(torch.arange(6.0, 14.0).view(4, 2))  # rows 3..6, wraps
    assert len(buf) == 5
    kept = {tuple(r.tolist()) for r in buf.rows()}
    assert kept == {(2.0 * i, 2.0 * i + 1) for i in range(2, 7)}
    buf.add(torch.arange(100.0, 120.0).view(10, 2))  # more than capacity at once
    assert {tuple(r.tolist()) for r in buf.rows()} == {(100.0 + 2 * i, 101.0 + 2 * i) for i in range(5, 10)}


def test_recorder_has_one_buffer_per_expert():
    rec = ActivationRecorder(capacity=8, width=3)
    rec(0, 1, torch.ones(2, 3))
    rec(1, 1, torch.zeros(4, 3))
    assert rec.rows(0, 1).shape == (2, 3)
    assert rec.rows(1, 1).shape == (4, 3)
    assert rec.rows(0, 0) is None


def test_distillation_brings_the_surrogate_closer_to_its_expert():
    torch.manual_seed(0)
    expert, surrogate = SwiGLU(16, 96), SwiGLU(16, 8)
    for p in surrogate.parameters():
        p.requires_grad_(False)  # as on a composer
    x = torch.randn(512, 16)
    before = relative_error(surrogate, expert, x)
    expert_before = [p.clone() for p in expert.parameters()]
    after = distill(surrogate, expert, x, steps=200, lr=1e-2)
    assert after < 0.5 * before
    assert all(torch.equal(a, b) for a, b in zip(expert_before, expert.parameters(), strict=True))
    assert not any(p.requires_grad for p in surrogate.parameters()), "flags restored"
    assert all(p.grad is None for p in surrogate.parameters())


def test_the_input_gradient_term_teaches_the_surrogate_its_experts_backward_pass():
    torch.manual_seed(0)
    expert = SwiGLU(16, 96)
    x = torch.randn(512, 16)
    plain, sobolev = SwiGLU(16, 8), SwiGLU(16, 8)
    sobolev.load_state_dict(plain.state_dict())
    for p in sobolev.parameters():
        p.requires_grad_(False)
    distill(plain, expert, x, steps=300, lr=1e-2)
    distill(sobolev, expert, x, steps=300, lr=1e-2, jacobian_weight=1.0)
    # measured on probes the fit never saw (a rank-8 stand-in of a width-96 expert: 0.70 vs 0.76)
    assert jacobian_error(sobolev, expert, x, seed=5) < 0.95 * jacobian_error(plain, expert, x, seed=5)
    assert relative_error(sobolev, expert, x) < 1.1 * relative_error(plain, expert, x)  # still answers alike
    assert not any(p.requires_grad for p in sobolev.parameters()) and all(p.grad is None for p in sobolev.parameters())
    assert jacobian_error(expert, expert, x) == 0.0
