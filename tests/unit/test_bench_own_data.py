"""``bench own-data``: the audit's arithmetic, its judgement, and a short run of it in the simulator."""

from __future__ import annotations

import pytest
import torch

from parallax.benchmarks import own_data
from parallax.node.config import train as config
from parallax.node.sim.simulator import RunSpec, run
from parallax.node.train.data import load_corpus, split_corpus


def _cfg(steps: int) -> config.TrainConfig:
    return config.TrainConfig(
        model=config.preset("tiny"), steps=steps, batch_size=4, eval_batches=2,
        sync=config.SyncConfig(periods={"router": 2, "latent": 3, "backbone": 4}),
        surrogate=config.SurrogateConfig(refresh_every=3, distill_steps=2, buffer_tokens=64),
    )


def test_a_window_judges_a_composer_idle_when_fewer_than_half_its_margins_are_positive() -> None:
    assert own_data.judged_idle([1.0] * 7) is None  # fewer audits than a window
    assert own_data.judged_idle([1.0] * 8) == 0.0
    assert own_data.judged_idle([-1.0] * 5 + [1.0] * 3) == 1.0
    assert own_data.judged_idle([-1.0] * 4 + [1.0] * 4) == 0.0  # half positive is not fewer than half
    assert own_data.judged_idle([-1.0] * 5 + [1.0] * 4) == 0.5  # the first window of two judges it idle


def test_the_gains_of_pseudo_gradients_leave_the_live_parameters_as_they_were_and_the_anchor_gains_nothing() -> None:
    train, val = split_corpus(load_corpus()[:200_000])
    seen = []

    def audit(composers, group, step):
        if group == "backbone" and not seen:
            c = composers[0]
            live = c.outer[group].live_copy()
            zero = {name: torch.zeros_like(t) for name, t in live.items()}
            batches = c.sampler.replay(0, 2)
            gains = own_data.gains(c, group, [zero, c.outer[group].pseudo_gradient()], batches)
            assert gains[0] == 0.0 and gains[1] != 0.0
            assert all(torch.equal(live[n], t) for n, t in c.outer[group].live_copy().items())
            seen.append(gains)

    run(RunSpec(name="p", kind="parallax", cfg=_cfg(8), composers=3), train, val, before_merge=audit)
    assert seen


def test_a_short_run_audits_every_composer_at_each_backbone_round_and_marks_the_copier() -> None:
    report = own_data.run_own_data(_cfg(24), 3, runs=["copier"])
    rows = report["runs"]["copier"]["composers"]
    assert [r["copier"] for r in rows] == [False, False, True]
    assert all(r["audits"] == 6 and len(r["margins"]) == 6 for r in rows)  # a backbone round every 4 of 24 steps
    assert "| copier | 2 (copier) | 6 |" in own_data.markdown(report)
    with pytest.raises(ValueError, match="at least 3 composers"):
        own_data.run_own_data(_cfg(4), 2)
    with pytest.raises(ValueError, match="unknown runs"):
        own_data.run_own_data(_cfg(4), 3, runs=["nobody"])
