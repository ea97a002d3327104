"""``parallax bench dht`` end to end on a small swarm: latency with two peers, then one kill and one deathrattle
among three, each seen by every survivor and its experts re-claimed in every view (``dht.testing.agreed``)."""

from __future__ import annotations

import pytest

from parallax.benchmarks.dht import markdown, run_dht_bench

pytestmark = pytest.mark.timeout(180)


def test_one_kill_trial_and_one_deathrattle_finish() -> None:
    report = run_dht_bench(sizes=(2,), ops=5, detect_peers=3, trials=1, rattles=1, progress=lambda _line: None)
    assert report["latency"][0]["peers"] == 2
    detection = report["detection"]
    for event in ("kill_detected_by_all", "reassigned_and_claimed_in_all_views", "deathrattle_seen_by_all"):
        assert detection[event]["n"] == 1, (event, detection)
    # A kill is seen once the victim's heartbeat expires (TTL 6 s); a deathrattle within a few reads.
    assert detection["deathrattle_seen_by_all"]["max_ms"] < detection["kill_detected_by_all"]["max_ms"]
    assert "deathrattle seen by all" in markdown(report)
