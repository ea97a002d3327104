"""Sketched expert gradients: (x, g) from a non-owner gives the owner the true expert gradient."""

from __future__ import annotations

import pytest
import torch

from parallax.node.config.train import preset
from parallax.node.model.sketch import Sketch, SketchRecorder, accumulate_expert_gradient, compress, concat, subsample
from parallax.node.model.transformer import MoELayer

TINY = preset("tiny")


def _pair():
    """Layer R owns every expert; layer S owns none but holds exact frozen copies of them, so the
    downstream of every selection is identical and S's g is the true dL/dy."""
    torch.manual_seed(0)
    real = MoELayer(TINY, 0, set(range(TINY.n_experts)))
    for p in real.parameters():
        torch.nn.init.normal_(p, std=0.3)
    copy = MoELayer(TINY, 0, set(), "frozen_copy")
    copy.load_state_dict(real.state_dict())
    return real, copy


def test_sketch_gradient_equals_the_true_expert_gradient():
    real, copy = _pair()
    recorder = SketchRecorder()
    copy.sketcher = recorder.attach
    x = torch.randn(2, 16, TINY.d_model)
    target = torch.randn(2, 16, TINY.d_model)
    for layer in (real, copy):
        y, _ = layer(x)
        (y - target).pow(2).mean().backward()
    sketches = recorder.take()
    assert sketches, "the non-owner recorded (x, g) for its non-owned selections"
    for (_, expert), sketch in sketches.items():
        module = copy.experts[str(expert)]
        module.zero_grad(set_to_none=True)
        for p in module.parameters():
            p.requires_grad_(True)
        accumulate_expert_gradient(module, [sketch], scale=1.0)
        for name, p in module.named_parameters():
            true = dict(real.experts[str(expert)].named_parameters())[name].grad
            torch.testing.assert_close(p.grad, true, rtol=1e-5, atol=1e-7)


def test_compression_keeps_the_gradient_close_and_counts_bytes():
    gen = torch.Generator().manual_seed(0)
    sketch = Sketch(torch.randn(300, 24, generator=gen), torch.randn(300, 24, generator=gen), tokens=300)
    raw = compress(sketch, sample_fraction=1.0, generator=gen, wire_codec="raw")
    assert torch.equal(raw.x_NL, sketch.x_NL) and torch.equal(raw.g_NL, sketch.g_NL)
    q = compress(sketch, sample_fraction=1.0, generator=gen, wire_codec="int8")
    rel = (q.g_NL - sketch.g_NL).norm() / sketch.g_NL.norm()
    assert rel < 0.02
    assert q.wire_bytes < 0.3 * raw.wire_bytes


def test_subsampling_is_unbiased():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4000, 4, generator=gen)
    g = torch.randn(4000, 4, generator=gen) + 1.0
    full = (g * x).sum()
    estimates = [
        (lambda s: (s.g_NL * s.x_NL).sum())(compress(Sketch(x, g, 4000), sample_fraction=0.25, generator=gen,
                                                     wire_codec="raw"))
        for _ in range(200)
    ]
    mean = torch.stack(estimates).mean()
    spread = torch.stack(estimates).std() / len(estimates) ** 0.5
    assert abs(mean - full) < 4 * spread
    empty = compress(Sketch(x[:3], g[:3], 3), sample_fraction=1e-9, generator=gen)
    assert empty.x_NL.shape == (0, 4) and empty.wire_bytes == 0
    with pytest.raises(ValueError, match="sample_fraction"):
        compress(Sketch(x, g, 4000), sample_fraction=0.0, generator=gen)


def test_subsample_caps_rows_and_keeps_the_gradient_sum_unbiased() -> None:
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(40, 4, generator=gen), torch.randn(40, 4, generator=gen)
    full = Sketch(x, g, tokens=40)
    assert subsample(full, 40, gen) is full and subsample(full, 100, gen) is full
    draws = [subsample(full, 10, gen) for _ in range(4000)]
    assert all(d.x_NL.shape == (10, 4) and d.tokens == 40 for d in draws)
    # the rows kept are rows of the sketch, with g scaled by 40 / 10
    row = {tuple(r.tolist()): i for i, r in enumerate(x)}
    d = draws[0]
    assert torch.allclose(d.g_NL, 4 * g[[row[tuple(r.tolist())] for r in d.x_NL]])
    # E[sum_n g_n x_n^T] over the draws equals the full sum (the Taylor proxy's gradient is linear in it)
    mean = torch.stack([dd.g_NL.T @ dd.x_NL for dd in draws]).mean(0)
    assert torch.allclose(mean, g.T @ x, atol=0.1 * float((g.T @ x).abs().max()))


def test_concat_keeps_both_samples() -> None:
    a = Sketch(torch.ones(2, 3), torch.ones(2, 3), tokens=5, wire_bytes=10)
    b = Sketch(torch.zeros(1, 3), torch.zeros(1, 3), tokens=4, wire_bytes=7)
    both = concat(a, b)
    assert both.x_NL.shape == (3, 3) and (both.tokens, both.wire_bytes) == (9, 17)
