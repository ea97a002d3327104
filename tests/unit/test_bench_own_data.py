"""``bench own-data``: a short run of it in the simulator."""

from __future__ import annotations

import pytest

from parallax.benchmarks import own_data
from parallax.node.config import train as config


def _cfg(steps: int) -> config.TrainConfig:
    return config.TrainConfig(
        model=config.preset("tiny"), steps=steps, batch_size=4, eval_batches=2,
        sync=config.SyncConfig(periods={"router": 2, "latent": 3, "backbone": 4}),
        surrogate=config.SurrogateConfig(refresh_every=3, distill_steps=2, buffer_tokens=64),
        sim=config.SimConfig(data="stream"),  # one stream, as nodes sample it: the node's auditor runs
    )


def test_a_short_run_audits_every_composer_at_each_backbone_round_and_marks_the_copier() -> None:
    report = own_data.run_own_data(_cfg(24), 3, runs=["copier"])
    rows = report["runs"]["copier"]["composers"]
    assert [(r["copier"], r["auditor"]) for r in rows] == [
        (copier, auditor) for copier in (False, False, True) for auditor in ("self", "peer", "node")]
    assert all(r["audits"] == 6 and len(r["margins"]) == 6 for r in rows)  # a backbone round every 4 of 24 steps
    # The node's audits also say how often a contribution beat its control batches; the others measure no control.
    assert all((r["specific"] is not None) == (r["auditor"] == "node") for r in rows)
    assert "| copier | 2 (copier) | peer | 6 |" in own_data.markdown(report)
    with pytest.raises(ValueError, match="at least 3 composers"):
        own_data.run_own_data(_cfg(4), 2)
    with pytest.raises(ValueError, match="unknown runs"):
        own_data.run_own_data(_cfg(4), 3, runs=["nobody"])
