"""The CLI: help, the simulator, the quality benchmark's short variant, clear errors for bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from parallax.cli.main import app

runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("sim", "bench"):
        assert command in result.output


def test_sim_runs_and_writes_json(tmp_path):
    out = tmp_path / "sim.json"
    result = runner.invoke(app, ["sim", "--preset", "tiny", "--composers", "2", "--steps", "3", "--quiet",
                                 "--json", str(out), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert len(report["composer_val_losses"]) == 2
    assert report["tokens"] == 2 * 3 * 8 * 32
    assert report["reference"]["tokens"] == report["tokens"]  # the baseline beside it, at equal tokens


def test_quality_benchmark_short_variant_has_the_promised_keys(tmp_path):
    out = tmp_path / "quality.json"
    result = runner.invoke(app, ["bench", "quality", "--preset", "tiny", "--composers", "2", "--steps", "4",
                                 "--runs", "baseline,diloco,parallax,no_surrogates,frozen_copies,plain_mean",
                                 "--quiet", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    for key in ("baseline_val_loss", "diloco_val_loss", "parallax_val_loss", "assembled_val_loss",
                "no_surrogates_val_loss", "frozen_copies_val_loss", "plain_mean_val_loss"):
        assert isinstance(report[key], float), key
    parallax = report["runs"]["parallax"]
    for key in ("tokens", "train_flops", "wall_s", "params_per_composer", "optimizer_state_bytes_per_composer"):
        assert parallax[key] > 0, key
    assert report["runs"]["baseline"]["tokens"] == parallax["tokens"], "equal token counts"
    assert parallax["params_per_composer"] < report["runs"]["baseline"]["params_per_composer"]
    assert [step for step, _, _ in parallax["stand_in_error"]] == [4]  # the final publication
    assert report["runs"]["frozen_copies"]["stand_in_error"] == []
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| run |") and "stand-in error" in table
    png = tmp_path / "horizon.png"
    result = runner.invoke(app, ["bench", "horizon", str(out), "--out", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_four_replicas_of_every_expert_among_four_composers_are_the_diloco_reference(tmp_path):
    out = tmp_path / "quality.json"
    result = runner.invoke(app, ["bench", "quality", "--preset", "tiny", "--steps", "20", "--composers", "4",
                                 "--runs", "diloco,replicas_4,replicas_2", "--quiet", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["replicas_4_val_loss"] == report["diloco_val_loss"]
    diloco, r4, r2 = (report["runs"][name] for name in ("diloco", "replicas_4", "replicas_2"))
    assert r4["composer_val_losses"] == diloco["composer_val_losses"]
    assert r4["assembled_val_loss"] == diloco["assembled_val_loss"]
    assert r4["optimizer_state_bytes_per_composer"] == diloco["optimizer_state_bytes_per_composer"]
    assert r4["network_bytes"]["outer"] == diloco["network_bytes"]["outer"]
    assert r4["network_bytes"]["surrogates"] == 0 and r4["stand_in_error"] == []  # nobody holds a stand-in
    # two of four: half the experts, so fewer parameters and less state than DiLoCo, more than one owner's
    assert r2["params_per_composer"] < diloco["params_per_composer"]
    assert r2["optimizer_state_bytes_per_composer"] < diloco["optimizer_state_bytes_per_composer"]
    assert r2["network_bytes"]["surrogates"] > 0 and r2["stand_in_error"]


def test_a_run_the_simulator_cannot_build_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["sim", "--preset", "tiny", "--steps", "2", "--composers", "2", "--no-reference",
                                 "--set", "ownership.replicas=3", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "ownership.replicas=3 needs at least that many composers" in result.output
    assert "Traceback" not in result.output


def test_missing_data_path_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["sim", "--preset", "tiny", "--steps", "1", "--data", str(tmp_path / "nope.txt")])
    assert result.exit_code == 2
    assert "--data" in result.output


def test_unknown_preset_is_a_clear_error():
    result = runner.invoke(app, ["bench", "flops", "--preset", "huge"])
    assert result.exit_code == 2
    assert "unknown preset" in result.output


def test_flops_table_reproduces_the_report():
    result = runner.invoke(app, ["bench", "flops", "--preset", "report", "--composers", "8"])
    assert result.exit_code == 0
    assert "7.63x" in result.output and "20.95x" in result.output
    # with the default input gradients: 1 / ((1/8)(2/3) + (7/8)(2/48)/3) = 10.47x, and 7.29x direct
    assert "10.47x" in result.output and "7.29x" in result.output


@pytest.mark.parametrize("change, says", [("nonsense.key=1", "unknown setting"),
                                          ("steps=5", "sets it itself"), ("sync.periods={}", "sets it itself")])
@pytest.mark.parametrize("bench", ["swarm", "offload-swarm"])
def test_process_benches_refuse_a_bad_set_before_starting_anything(bench, change, says):
    result = runner.invoke(app, ["bench", bench, "--set", change])
    assert result.exit_code == 2 and says in result.output


@pytest.mark.parametrize("change, says", [("nonsense.key=1", "unknown setting"),
                                          ("net.outer.nonsense=1", "unknown setting"),
                                          ("sync.periods={}", "sets it itself"),
                                          ("train.sync.periods={}", "sets it itself"),
                                          ("net.membership.idle_s=5", "sets it itself"),
                                          ("node.steps=5", "sets it itself"),
                                          ("node.final_eval=false", "sets it itself"),
                                          ("peer.run_id=other", "sets each node's identity"),
                                          ("net.outer.own_data_audits=true", "unknown attack")])
def test_bench_attacks_takes_a_nodes_settings_and_refuses_its_own_however_spelt(change, says):
    # Its --set goes to every ``node join``: a node's settings pass the check (and the run stops at the attack).
    result = runner.invoke(app, ["bench", "attacks", "--attacks", "no-such-attack", "--set", change])
    assert result.exit_code == 2 and says in result.output, result.output


def test_bench_offload_swarm_refuses_to_switch_offload_itself():
    result = runner.invoke(app, ["bench", "offload-swarm", "--set", "offload.enabled=true"])
    assert result.exit_code == 2 and "sets it itself" in result.output


@pytest.mark.parametrize("sizes", ["1,4", "four", ""])
def test_bench_scale_refuses_sizes_it_cannot_run_before_starting_anything(sizes):
    result = runner.invoke(app, ["bench", "scale", "--sizes", sizes])
    assert result.exit_code == 2 and "--sizes" in result.output


def test_the_scale_report_has_a_column_per_size_and_a_dash_where_nothing_was_measured():
    from parallax.benchmarks.scale import ROWS, _until_all, markdown

    assert _until_all([3.0, 5.5], since=1.0) == 4.5
    assert _until_all([3.0, None], since=1.0) is None  # one node never showed it: not "seen by all"
    measured = {key: 1.0 for _, key, _ in ROWS}
    report = {"preset": "tiny", "steps": 10, "batch_size": 32, "periods": {}, "cores": 2, "memory_gb": 24,
              "sizes": {"4": measured, "8": {**measured, "death_seen_by_all_s": None}}}
    table = markdown(report).splitlines()
    assert table[2] == "| composers | 4 | 8 |"
    death = next(line for line in table if line.startswith("| death seen"))
    assert death.endswith("| 1.00 | - |")
    assert len(table) == 4 + len(ROWS)


def test_the_scale_report_counts_the_steps_a_node_trained_with_its_experts_held():
    from parallax.benchmarks.scale import held_steps

    def shard(step: int, paused: bool) -> dict:
        return {"kind": "shard", "t": float(step), "step": step, "paused": paused}

    steps = [{"kind": "step", "t": float(s), "step": s} for s in range(1, 101)]
    records = [shard(0, False), shard(10, True), shard(15, True), shard(30, False), shard(90, True), *steps]
    assert held_steps(sorted(records, key=lambda e: e["t"])) == 20 + 10  # 10-30, and 90 to its last step
    assert held_steps(steps) == 0


def test_the_scale_report_times_each_merge_landing_and_the_loss_around_it():
    from parallax.benchmarks.scale import merge_landings

    steps = [{"kind": "step", "t": float(s), "step": s, "loss": 2.0 if s <= 130 else 3.0} for s in range(1, 201)]

    def landed(t: float, group: str, round_id: int, status: str = "ok") -> dict:
        return {"kind": "round", "t": t, "group": group, "round_id": round_id, "status": status}

    records = sorted([*steps, landed(130.5, "backbone", 1), landed(60.5, "router", 2), landed(70.5, "router", 2,
                                                                                                  "failed"),
                      landed(10.5, "router", 0), landed(198.5, "latent", 3)], key=lambda e: e["t"])
    found = merge_landings(records, {"router": 25, "latent": 50, "backbone": 100})
    assert found == {"backbone": [(30, 1.5)], "router": [(10, 1.0)]}  # too early, failed or too late: left out
    # a round logged in the millisecond of a step's line landed after that step (its seam follows the step)
    assert merge_landings([*steps[:130], landed(130.0, "backbone", 1), *steps[130:]],
                          {"backbone": 100}) == {"backbone": [(30, 1.5)]}
