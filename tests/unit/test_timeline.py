"""What metrics records say happened: ownership intervals, double ownership, bytes per step (pure)."""

from __future__ import annotations

import pytest

from parallax.node.peer.local_swarm import composer_bytes
from parallax.node.peer.netlab import rate_bytes_per_s
from parallax.node.peer.timeline import events, longest_double_ownership, owned_fraction, ownership, shard_at


def _shard(t: float, *experts: tuple[int, int]) -> dict:
    return {"t": t, "kind": "shard", "experts": [list(e) for e in experts]}


A = [_shard(0.0, (0, 0), (0, 1)), {"t": 5.0, "kind": "step"}, _shard(10.0, (0, 1)), {"t": 30.0, "kind": "step"}]
B = [_shard(0.0, (0, 2)), _shard(8.0, (0, 2), (0, 0)), _shard(14.0, (0, 2))]


def test_ownership_runs_from_shard_event_to_shard_event_or_the_last_record():
    assert shard_at(A, 9.9) == {(0, 0), (0, 1)} and shard_at(A, 10.0) == {(0, 1)} and shard_at(A, -1.0) == set()
    assert ownership(A) == {(0, 0): [(0.0, 10.0)], (0, 1): [(0.0, 30.0)]}
    assert ownership(B)[(0, 0)] == [(8.0, 14.0)]
    assert len(events(A, "step")) == 2


def test_longest_double_ownership_is_clipped_to_the_window():
    assert longest_double_ownership([A, B], 0.0, 100.0) == (2.0, (0, 0))  # both held (0, 0) from 8 to 10
    assert longest_double_ownership([A, B], 9.0, 100.0) == (1.0, (0, 0))
    assert longest_double_ownership([A, B], 10.0, 100.0) == (0.0, None)


def test_experts_held_paused_are_owned_and_trained_by_nobody():
    c = [_shard(0.0, (0, 0)), {**_shard(8.0, (0, 0)), "paused": True}, _shard(12.0), {"t": 30.0, "kind": "step"}]
    assert shard_at(c, 8.0) == {(0, 0)} and shard_at(c, 12.0) == set()
    assert ownership(c) == {(0, 0): [(0.0, 12.0)]} and ownership(c, trained=True) == {(0, 0): [(0.0, 8.0)]}
    assert longest_double_ownership([A, c], 0.0, 100.0) == (8.0, (0, 0))  # A held it from 0 to 10, c trained it to 8


def test_tc_rates_in_bytes_per_second():
    assert rate_bytes_per_s("20mbit") == 2.5e6 and rate_bytes_per_s("800kbit") == 1e5
    with pytest.raises(ValueError, match="rate"):
        rate_bytes_per_s("20 Mbit")


def test_owned_fraction_counts_each_experts_time_once_however_many_own_it():
    a = [{"t": 0.0, "kind": "shard", "experts": [[0, 0]]}, {"t": 10.0, "kind": "shard", "experts": []}]
    b = [{"t": 5.0, "kind": "shard", "experts": [[0, 0], [0, 1]]}, {"t": 20.0, "kind": "step"}]
    # Expert 0.0: 0-10 and 5-20 overlap, 20 s once; expert 0.1: 5-20, 15 s; window 0-20 of 2 experts.
    assert owned_fraction([a, b], total=2, start=0.0, end=20.0) == (20 + 15) / 40
    assert owned_fraction([a, b], total=2, start=8.0, end=12.0) == (4 + 4) / 8  # clipped to the window
    assert owned_fraction([a, b], total=2, start=5.0, end=5.0) is None


def test_a_nodes_bytes_per_step_keep_training_durability_and_hand_overs_apart():
    records = [{"kind": "step", "step": 1, "outer_bytes": 0, "gossip_bytes": 0, "snapshot_bytes": 0},
               {"kind": "round", "status": "ok", "bytes_est": 10**9},  # an estimate: the counters are what moved
               {"kind": "step", "step": 2, "outer_bytes": 600, "gossip_bytes": 200, "offload_bytes": 200,
                "snapshot_bytes": 3000, "handover_bytes": 100}]
    assert composer_bytes(records) == {"train_bytes_per_step": 500.0, "durability_bytes_per_step": 1500.0,
                                       "handover_bytes_per_step": 50.0}
    # A node that left: its last counters are those of its ``left`` event (the leave's snapshots included).
    left = [*records, {"kind": "left", "rounds_ok": 1, "outer_bytes": 600, "gossip_bytes": 200, "snapshot_bytes": 5000,
                       "handover_bytes": 7000}]
    assert composer_bytes(left) == {"train_bytes_per_step": 400.0, "durability_bytes_per_step": 2500.0,
                                    "handover_bytes_per_step": 3500.0}
    assert composer_bytes([]) == {"train_bytes_per_step": None, "durability_bytes_per_step": None,
                                  "handover_bytes_per_step": None}
