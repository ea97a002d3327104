"""``parallax bench attacks`` end to end, one attack: real composer processes, one of them sending NaN outer
contributions; the honest ones refuse them, name and ban the attacker, and train on."""

from __future__ import annotations

import pytest

from parallax.benchmarks.attacks import markdown, run_attacks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_nan_attacker_is_named_and_banned_and_no_honest_composer_crashes(tmp_path):
    # Tiny steps take about 20 ms: 400 of them outlast start-up, so the joiner comes mid-run and merged outer rounds
    # are trained on before the final evaluation. A run of 100 ends within a round's time: most rounds are skipped
    # and the last ones, spanning 40-70 steps each, land after the final step, untrained on.
    # No clean run: the attack's own run is what is checked here (the benchmark judges ratios against clean runs).
    report = run_attacks(attacks=["nan"], steps=400, join_at=10, workdir=tmp_path, progress=lambda _: None,
                         clean_runs=0)
    assert report["clean"] == []
    (row,) = report["attacks"]
    assert not row["crashed"], row
    assert row["attacker_named"] and row["attacker_banned"], row
    assert row["val_losses"] and all(v < 4.0 for v in row["val_losses"]), row  # trained: 5.5 at the start
    assert "| nan |" in markdown(report)  # the table renders without clean runs
