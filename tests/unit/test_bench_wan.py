"""``parallax bench wan``'s figures from the composers' metrics (pure; the lab runs are the benchmark itself)."""

from __future__ import annotations

from typing import Any

import pytest

from parallax.benchmarks.bytes import body_bytes
from parallax.benchmarks.swarm import _group_bytes
from parallax.benchmarks.wan import _round_bytes, _round_time, figures, markdown, summary
from parallax.node.config.train import replace, train_config
from parallax.node.peer.runner import model_shapes

SIZES = {"router": 4_000, "backbone": 100_000}


def _node(statuses: dict[str, list[str]]) -> list[dict[str, Any]]:
    """One node's metrics: its rounds' statuses per group, two steps, a final evaluation."""
    rounds = [{"kind": "round", "group": g, "status": s, "allreduce_s": 2.0, "waited_s": 1.5, "merge_s": 0.5,
               "verify_s": 0.25, "total_s": 3.0} for g, each in statuses.items() for s in each]
    return [*rounds,
            {"kind": "step", "step": 1, "gossip_bytes": 10, "outer_bytes": 100},
            {"kind": "step", "step": 2, "gossip_bytes": 20, "outer_bytes": 200},
            {"kind": "step_path", "steps": 2, "seam_s": 0.1, "seam_max_s": 0.05, "refit_s": 0.0, "dht_calls": 0},
            {"kind": "final_eval", "val_loss": 2.5, "tokens": 1000}]


def _run(per_node: list[dict[str, list[str]]]) -> dict[str, Any]:
    return figures([_node(s) for s in per_node], [0] * len(per_node), wall_s=60.0)


def test_a_rounds_bound_is_the_bytes_its_transport_moves_each_way():
    cfg = train_config("tiny")
    body = body_bytes({n: tuple(s) for n, s in model_shapes(cfg).groups["backbone"].items()}, "int4")
    gathered = _round_bytes(replace(cfg, sync=replace(cfg.sync, aggregation="gather")), 4)["backbone"]
    assert gathered == 3 * body  # n - 1 bodies
    parts = _round_bytes(cfg, 4)["backbone"]  # the default
    assert 0 < parts < gathered  # a share of three bodies, three merged shares, the rechecks
    reduced = replace(cfg, sync=replace(cfg.sync, aggregation="allreduce", compression="uint8"))
    assert _round_bytes(reduced, 4)["backbone"] == round(1.5 * _group_bytes(reduced)["backbone"])  # 2 (n - 1) / n
    timed = _round_time([8.0], each_way=3_000_000, bandwidth=1_000_000.0)
    assert timed["bound_s"] == pytest.approx(3.0) and timed["over_bound"] == pytest.approx(8.0 / 3.0)


def test_rounds_completed_are_the_lowest_nodes_share_and_a_rate_without_one_reports_zero_and_why():
    loopback = _run([{"router": ["ok", "ok"], "backbone": ["ok", "ok"]},
                     {"router": ["ok", "no_group"], "backbone": ["ok", "unverified", "ok", "ok"]}])
    capped = _run([{"router": ["ok"], "backbone": ["no_group", "unverified"]},
                   {"router": ["ok"], "backbone": ["no_group"]}])
    assert loopback["rounds_ok_fraction"] == {"router": 0.5, "backbone": 0.75}
    assert loopback["collect_s"]["backbone"] == [2.5] * 5  # offer to merged: the set, its fetches, the merge
    assert (loopback["round_allreduce_s"]["backbone"], loopback["round_waited_s"]["backbone"],
            loopback["round_merge_s"]["backbone"], loopback["round_verify_s"]["backbone"]) == (2.0, 1.5, 0.5, 0.25)
    assert loopback["rounds_failed"] == 2 and capped["rounds_failed"] == 3
    report = summary({"loopback": loopback, "20mbit": capped}, None, sizes=SIZES,
                     rates=("20mbit",), nodes=2, preset="tiny", steps=2, periods={}, refresh_every=25,
                     snapshot_every=50, crowd=2, aggregation="gather", compression="int4")
    assert report["backbone_rounds_ok_fraction"] == {"loopback": 0.75, "20mbit": 0.0}
    assert report["round_time_over_bytes_bound"] == {"20mbit": None}
    assert report["failed_rounds"] == {"loopback": 2, "20mbit": 3}
    assert report["runs"]["20mbit"]["rounds"]["backbone"]["why"].startswith("no round of this group verified")
    table = markdown(report)
    assert "backbone rounds completed on the lowest node: loopback 75%, 20mbit 0%" in table
    assert "0% (others: no_group, unverified)" in table and "2 busy processes" in table
    assert "| ... merging it (partitioned: the blocks, the others' shares, the rechecks), median | 0.500 s | - |" \
        in table
