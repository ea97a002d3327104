"""Eight composers under churn (``parallax bench churn``'s swarm, shorter): composers leave by Ctrl+C, SIGKILL and
freezing, each replaced at once by a new identity; the swarm keeps training and settles."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallax.benchmarks.churn import run_once

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_eight_composers_under_churn_keep_training_and_every_expert_ends_with_one_owner(tmp_path: Path) -> None:
    # A departure every 7 s on average (lifetime 56 s over 8 composers): joins land during others' hand-overs.
    result = run_once(composers=8, lifetime_s=56.0, replicas=1, seed=1, workdir=tmp_path, progress=lambda _: None,
                      departures=6, quality=False)
    assert result["departures"] >= 6 and result["joins"] >= 6, result["log"]
    assert all(n >= 2 for n in result["departures_by_way"].values()), result["departures_by_way"]
    assert result["joined_s"] is not None, f"a replacement never began training; see {tmp_path}"
    assert result["survivors_trained"], f"a node alive at the end had stopped training; see {tmp_path}"
    assert result["settled_s"] is not None, f"an expert kept no owner or two within 120 s; see {tmp_path}"
    assert result["leftover_processes"] == 0
