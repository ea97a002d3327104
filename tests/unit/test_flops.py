"""FLOP accounting: the report's analytic figures, and the config-based count that reproduces them."""

from __future__ import annotations

import pytest

from parallax.node.config.train import preset, replace
from parallax.node.model.flops import (
    composer_speedup,
    offload_routed_speedup,
    routed_share,
    routed_speedup,
    step_flops,
    total_speedup,
)


def test_analytic_report_figures():
    assert routed_speedup(8, 48) == pytest.approx(7.63, rel=0.01)
    assert offload_routed_speedup(8, 48) == pytest.approx(20.95, rel=0.01)
    assert total_speedup(routed_speedup(8, 48), 0.618) == pytest.approx(2.16, rel=0.01)
    assert total_speedup(offload_routed_speedup(8, 48), 0.618) == pytest.approx(2.43, rel=0.01)
    assert routed_speedup(1, 48) == 1.0  # a lone composer owns everything
    with pytest.raises(ValueError):
        routed_speedup(0, 48)
    with pytest.raises(ValueError):
        total_speedup(2.0, 1.5)


@pytest.mark.parametrize("name", ["report", "small"])
@pytest.mark.parametrize("offload", [False, True])
def test_config_accounting_reproduces_analytic_routed_speedup(name, offload):
    cfg = preset(name)
    ratio = cfg.d_expert / cfg.d_surrogate  # f/r: 48 as the report's at "report", 44 at "small"
    assert ratio == {"report": 48, "small": 44}[name]
    base, mine = step_flops(cfg, 1.0), step_flops(cfg, 1 / 8, offload=offload)
    analytic = (offload_routed_speedup if offload else routed_speedup)(8, ratio)
    assert base.routed / mine.routed == pytest.approx(analytic, rel=0.01)
    routed, total = composer_speedup(cfg, 8, offload=offload)
    assert routed == pytest.approx(analytic, rel=0.01)
    # The total follows Amdahl's law with this config's own routed share.
    assert total == pytest.approx(total_speedup(routed, routed_share(cfg)), rel=1e-9)


@pytest.mark.parametrize("stand_in_grad", [False, True])
@pytest.mark.parametrize("offload_grad", [False, True])
def test_input_gradients_cost_one_more_forward_in_the_formula_and_the_accounting(stand_in_grad, offload_grad):
    cfg = preset("small")
    base = step_flops(cfg, 1.0)
    mine = step_flops(cfg, 1 / 8, offload=True, stand_in_input_grad=stand_in_grad, offload_input_grad=offload_grad)
    ratio = cfg.d_expert / cfg.d_surrogate
    analytic = offload_routed_speedup(8, ratio, stand_in_input_grad=stand_in_grad, offload_input_grad=offload_grad)
    assert base.routed / mine.routed == pytest.approx(analytic, rel=0.01)
    direct = step_flops(cfg, 1 / 8, stand_in_input_grad=stand_in_grad)
    assert base.routed / direct.routed == pytest.approx(
        routed_speedup(8, ratio, stand_in_input_grad=stand_in_grad), rel=0.01)
    plain = step_flops(cfg, 1 / 8, offload=True)
    assert mine.experts == pytest.approx(plain.experts * (2 if offload_grad else 1))
    assert mine.surrogates == pytest.approx(plain.surrogates * (2 if stand_in_grad else 1))


def test_breakdown_parts():
    cfg = preset("small")
    base = step_flops(cfg, 1.0)
    assert base.surrogates == 0 and base.latent == 0  # small has l == d: no latent interface
    assert base.total == pytest.approx(
        base.backbone + base.router + base.latent + base.experts + base.surrogates + base.head)
    # Hand count for one layer of "small": experts k * 3 (train) * 2 * 3 * l * f.
    assert base.experts == pytest.approx(cfg.n_layers * 2 * 3 * 2 * 3 * 128 * 352)
    # Attention: 4 d^2 projections plus 2 * (T/2) * d for QK and for AV, and the shared expert's three d x 96
    # projections, trained (x3).
    assert base.backbone == pytest.approx(cfg.n_layers * 3 * (2 * 4 * 128**2 + 2 * 2 * 64 * 128 + 2 * 3 * 128 * 96))
    assert base.head == pytest.approx(3 * 2 * 128 * 256)
    assert step_flops(preset("tiny"), 1.0).latent > 0
    assert 0 < routed_share(cfg) < 1
    assert 0.5 < routed_share(preset("report")) < 0.75


def test_non_owned_variants():
    cfg = preset("small")
    surrogate = step_flops(cfg, 0.25)
    frozen = step_flops(cfg, 0.25, non_owned="frozen_copy")
    dropped = step_flops(cfg, 0.25, non_owned="drop")
    assert dropped.surrogates == 0
    assert frozen.surrogates == pytest.approx(44 * surrogate.surrogates)  # full expert (f/r = 44), still forward only
    assert frozen.experts == surrogate.experts == dropped.experts
    # Frozen copies: routed compute = owned x3 + non-owned x1 of the baseline's x3.
    assert frozen.routed / step_flops(cfg, 1.0).routed == pytest.approx(0.25 + 0.75 / 3)
    with pytest.raises(ValueError):
        step_flops(cfg, 0.25, non_owned="skip")
    with pytest.raises(ValueError):
        step_flops(cfg, 1.5)


def test_shared_expert_counts_as_backbone():
    cfg = replace(preset("small"), d_shared=0)
    with_shared = replace(cfg, d_shared=64)
    extra = step_flops(with_shared, 1.0).backbone - step_flops(cfg, 1.0).backbone
    assert extra == pytest.approx(cfg.n_layers * 3 * 2 * 3 * 128 * 64)
