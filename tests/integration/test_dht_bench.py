"""``parallax bench dht`` end to end on a small swarm: latency with two peers, then one kill and one deathrattle
among three, each seen by every survivor and its experts re-claimed in every view (``dht.testing.agreed``)."""

from __future__ import annotations

import pytest

from parallax.benchmarks.dht import markdown, run_dht_bench

pytestmark = pytest.mark.timeout(180)


def test_one_kill_trial_and_one_deathrattle_finish() -> None:
    report = run_dht_bench(sizes=(2,), ops=5, detect_peers=(3,), trials=1, rattles=1, progress=lambda _line: None,
                           window_s=2.0)
    assert report["latency"][0]["peers"] == 2
    (detection,) = report["detection"]
    for event in ("kill_detected_by_all", "reassigned_and_claimed_in_all_views", "deathrattle_seen_by_all"):
        assert detection[event]["n"] == 1, (event, detection)
    assert detection["timeouts"] == 0
    # A kill is seen once the victim's heartbeat expires (TTL 6 s); a deathrattle within a few reads.
    assert detection["deathrattle_seen_by_all"]["max_ms"] < detection["kill_detected_by_all"]["max_ms"]
    # The hot keys: three heartbeats in one read of the members key, held by some of the three peers, each of which
    # ran its DHT process and p2pd.
    steady = detection["steady"]
    assert steady["members_read_bytes"] > 3 * 200 and 1 <= steady["members_storers"] <= 3
    assert steady["dht_cores_per_peer_median"] > 0 and steady["view_age_s"]["median"] < 6.0
    assert "deathrattle seen by all" in markdown(report)
