"""The quality-against-memory table over seeds (benchmarks/tradeoff.py): pure arithmetic on reports."""

from __future__ import annotations

import json

import pytest

from parallax.benchmarks import tradeoff


def _report(seed: int, losses: dict[str, float], steps: int = 500) -> dict:
    runs = {name: {"val_loss": loss, "assembled_val_loss": loss - 0.01, "params_per_composer": 1000 * (i + 1),
                   "optimizer_state_bytes_per_composer": 8000 * (i + 1), "train_flops": 1e15,
                   "network_bytes_per_composer_step": 2048.0}
            for i, (name, loss) in enumerate(losses.items())}
    return {"config": {"preset": "small", "composers": 4, "steps": steps, "batch_size": 8, "seed": seed},
            "runs": runs}


def test_ratios_are_taken_against_the_same_seed_then_averaged(tmp_path):
    paths = []
    for seed, losses in ((0, {"baseline": 1.6, "diloco": 1.8, "replicas_2": 1.9}),
                         (1, {"baseline": 1.7, "diloco": 1.7, "replicas_2": 2.04})):
        paths.append(tmp_path / f"s{seed}.json")
        paths[-1].write_text(json.dumps(_report(seed, losses)))
    table = tradeoff.summary(tradeoff.load(paths))
    r2 = table["runs"]["replicas_2"]
    assert r2["over_baseline"] == pytest.approx([1.9 / 1.6, 2.04 / 1.7])
    assert r2["over_diloco"] == pytest.approx([1.9 / 1.8, 1.2])
    assert r2["memory_bytes"] == 3000 * 4 + 24000
    text = tradeoff.markdown(table)
    assert "| replicas_2 | 1.9700 (1.9000, 2.0400) |" in text and "seeds 0, 1" in text


def test_a_seeds_runs_join_across_reports_and_a_run_given_twice_or_other_settings_are_refused(tmp_path):
    a, b, c, d = (tmp_path / f"{n}.json" for n in "abcd")
    a.write_text(json.dumps(_report(0, {"baseline": 1.6, "diloco": 1.8})))
    b.write_text(json.dumps(_report(0, {"baseline": 1.7})))
    c.write_text(json.dumps(_report(1, {"baseline": 1.7}, steps=250)))
    d.write_text(json.dumps(_report(0, {"replicas_2_muon": 1.95})))
    joined = tradeoff.load([a, d])
    assert len(joined) == 1 and set(joined[0]["runs"]) == {"baseline", "diloco", "replicas_2_muon"}
    assert tradeoff.summary(joined)["runs"]["replicas_2_muon"]["over_baseline"] == pytest.approx([1.95 / 1.6])
    with pytest.raises(ValueError, match="in two reports"):
        tradeoff.load([a, b])
    with pytest.raises(ValueError, match="differ in preset"):
        tradeoff.load([a, c])
