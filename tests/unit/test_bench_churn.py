"""``parallax bench churn``'s accounting from the composers' metrics (pure; the swarm runs in the slow test)."""

from __future__ import annotations

from parallax.benchmarks.churn import Departure, markdown, measure_departures, owners_complete

ALL = [[layer, e] for layer in range(2) for e in range(4)]


def _shard(t: float, experts: list[list[int]]) -> dict:
    return {"t": t, "kind": "shard", "experts": experts}


def _adopted(t: float, eid: tuple[int, int], source: str, age_s: float | None) -> dict:
    return {"t": t, "kind": "adopted", "layer": eid[0], "expert": eid[1], "source": source,
            "snapshot_step": None if age_s is None else 1, "snapshot_age_s": age_s}


def _steps(times: range) -> list[dict]:
    return [{"t": float(t), "kind": "step", "step": t} for t in times]


def test_steps_lost_are_the_departed_nodes_steps_after_the_copy_taken_over_and_none_with_a_live_replica():
    records = [
        [_shard(0.0, [[0, 0], [0, 1], [1, 0]]), _shard(4.5, [[0, 0], [0, 1], [1, 0], [1, 3]]), *_steps(range(1, 11))],
        [_shard(0.0, [[0, 1], [1, 1]]),  # a live replica of (0, 1): nothing to take over
         _adopted(12.5, (0, 0), "heir copy", 4.5), _adopted(20.0, (0, 0), "previous owner", 0.1)],
        [_shard(0.0, [[0, 2]]), _adopted(11.0, (1, 0), "init", None)],
    ]
    gone = Departure(t=10.0, node=0, how="kill", step=10, owned=[(0, 0), (0, 1), (1, 0), (1, 3)])
    measure_departures([gone], records)
    # (0, 0): the heir copy was taken at 12.5 - 4.5 = 8 s, so its steps at 9 and 10 s are lost (the first adoption
    # counts); (1, 0) restarted from init: all ten; (1, 3) nobody took over.
    assert gone.lost_steps == {"0.0": 2, "0.1": 0, "1.0": 10, "1.3": None}
    assert gone.handover_s == {"0.0": 2.5, "0.1": 0.0, "1.0": 1.0, "1.3": None}


def test_an_expert_restarted_from_init_loses_only_the_steps_since_the_departed_node_took_it():
    records = [[_shard(0.0, [[0, 0]]), _shard(6.5, [[0, 0], [1, 2]]), *_steps(range(1, 11))],
               [_adopted(10.5, (1, 2), "init", None), _adopted(10.6, (0, 0), "previous owner", 0.05)]]
    gone = Departure(t=10.0, node=0, how="interrupt", step=10, owned=[(0, 0), (1, 2)])
    measure_departures([gone], records)
    assert gone.lost_steps == {"0.0": 0, "1.2": 4}  # its final snapshot handed (0, 0) over; (1, 2) since 6.5 s


def test_an_adoption_before_the_departure_is_not_its_hand_over():
    records = [[_shard(0.0, [[0, 0]]), *_steps(range(1, 11))], [_adopted(5.0, (0, 0), "heir copy", 3.0)]]
    gone = Departure(t=10.0, node=0, how="interrupt", step=10, owned=[(0, 0)])
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
