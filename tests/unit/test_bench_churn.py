"""``parallax bench churn``'s accounting from the composers' metrics (pure; the swarm runs in the slow test)."""

from __future__ import annotations

from parallax.benchmarks.churn import Departure, markdown, measure_departures, owners_complete

ALL = [[layer, e] for layer in range(2) for e in range(4)]


def _shard(t: float, experts: list[list[int]]) -> dict:
    return {"t": t, "kind": "shard", "experts": experts}


def _adopted(t: float, eid: tuple[int, int], source: str, snapshot_step: int | None) -> dict:
    return {"t": t, "kind": "adopted", "layer": eid[0], "expert": eid[1], "source": source,
            "snapshot_step": snapshot_step}


def test_steps_lost_count_from_the_snapshot_taken_over_and_nothing_is_lost_to_a_live_replica():
    records = [
        [_shard(0.0, [[0, 0], [0, 1], [1, 0]])],  # departs at 10 s, at its step 100
        [_shard(0.0, [[0, 1], [1, 1]]),  # a live replica of (0, 1): nothing to take over
         _adopted(12.5, (0, 0), "heir copy", 80), _adopted(20.0, (0, 0), "previous owner", 100)],
        [_shard(0.0, [[0, 2]]), _adopted(11.0, (1, 0), "init", None)],
    ]
    gone = Departure(t=10.0, node=0, how="kill", step=100, owned=[(0, 0), (0, 1), (1, 0), (1, 3)])
    measure_departures([gone], records)
    assert gone.lost_steps == {"0.0": 20, "0.1": 0, "1.0": 100, "1.3": None}  # its first adoption counts
    assert gone.handover_s == {"0.0": 2.5, "0.1": 0.0, "1.0": 1.0, "1.3": None}


def test_an_adoption_before_the_departure_is_not_its_hand_over():
    records = [[_shard(0.0, [[0, 0]])], [_adopted(5.0, (0, 0), "heir copy", 3)]]
    gone = Departure(t=10.0, node=0, how="interrupt", step=50, owned=[(0, 0)])
    measure_departures([gone], records)
    assert gone.lost_steps == {"0.0": None}


def test_owners_are_complete_when_every_expert_has_exactly_r_live_owners():
    half, other = ALL[:4], ALL[4:]
    assert owners_complete([[_shard(0.0, half)], [_shard(0.0, other)]], 1.0, replicas=1)
    assert not owners_complete([[_shard(0.0, half)], [_shard(0.0, ALL)]], 1.0, replicas=1)  # four owned twice
    assert not owners_complete([[_shard(0.0, half)], [_shard(0.0, other[1:])]], 1.0, replicas=1)  # one unowned
    assert owners_complete([[_shard(0.0, ALL)], [_shard(0.0, ALL)], [_shard(0.0, [])]], 1.0, replicas=2)
    assert owners_complete([[_shard(0.0, ALL)]], 1.0, replicas=2)  # one node alive: it owns everything
    assert not owners_complete([[_shard(0.0, half)], [_shard(2.0, other)]], 1.0, replicas=1)  # not yet at t


def test_the_table_has_a_column_per_replica_count_with_the_ratio_against_no_churn():
    churn = {"departures": 6, "departures_by_way": {"interrupt": 2, "kill": 2, "freeze": 2},
             "expert_steps_lost_per_departure": 12.5, "experts_never_adopted": 0, "handover_s_median": 3.2,
             "rounds_ok_fraction": 0.5, "val_loss": 2.2, "export_val_loss": None, "final_step_median": 800.0,
             "settled_s": 4.0, "peak_rss_mb": 640.0, "p2pd_peak_rss_mb": 90.0, "leftover_processes": 0,
             "wall_s": 100.0}
    steady = {**churn, "val_loss": 2.0, "rounds_ok_fraction": 0.9}
    report = {"composers": 8, "preset": "tiny", "minutes": 20.0, "lifetime_s": 180.0, "cores": 2, "memory_gb": 23.5,
              "replicas": {"1": {"churn": churn, "steady": steady, "val_loss_over_no_churn": 1.1,
                                 "export_val_loss_over_no_churn": None}}}
    text = markdown(report)
    assert "| | R = 1 |" in text
    assert "| departures (interrupt / kill / freeze), each replaced | 6 (2 / 2 / 2) |" in text
    assert "2.2000 / 2.0000: **1.100x**" in text
    assert "| exported model val loss (churn / none) | - / -: -x |" in text
