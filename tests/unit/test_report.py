"""``parallax report``: metrics files in, PNG plots and a markdown summary out; every figure from the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from parallax.cli.main import app
from parallax.node.peer.report import read_node

runner = CliRunner(env={"COLUMNS": "200"})


def _metrics(path: Path, *, steps: int, loss0: float, bytes_per_step: int, rounds: list[tuple[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(1, steps + 1):
        lines.append({"t": 100.0 + s, "kind": "step", "step": s, "loss": loss0 - s / 100, "tokens": s * 256,
                      "tokens_per_s": 1000.0 + s, "bytes_sent": s * bytes_per_step, "bytes_received": 0})
    lines += [{"t": 200.0, "kind": "round", "group": g, "status": st} for g, st in rounds]
    lines += [{"t": 201.0, "kind": "adopted", "layer": 0, "expert": 1},
              {"t": 201.5, "kind": "eval", "step": steps // 2, "tokens": steps * 128, "val_loss": 3.0},
              {"t": 202.0, "kind": "final_eval", "step": steps, "tokens": steps * 256, "val_loss": 2.5}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"half a line")  # a line being written
    return path


def test_a_report_reads_every_figure_from_the_files(tmp_path: Path) -> None:
    a = _metrics(tmp_path / "node-0" / "metrics.jsonl", steps=50, loss0=4.0, bytes_per_step=1000,
                 rounds=[("router", "ok"), ("router", "ok"), ("backbone", "timeout")])
    b = _metrics(tmp_path / "node-1" / "metrics.jsonl", steps=40, loss0=4.2, bytes_per_step=500,
                 rounds=[("router", "ok")])
    bench = tmp_path / "quality.json"
    bench.write_text(json.dumps({"runs": {"baseline": {"val_history": [[1000, 3.9], [20000, 3.1]]}}}))
    node = read_node(a)
    assert node.name == "node-0" and node.steps[-1] == 50 and node.bytes_per_step == pytest.approx(1000)
    assert node.final_loss == pytest.approx(statistics_mean([4.0 - s / 100 for s in range(41, 51)]))
    assert node.rounds[("backbone", "timeout")] == 1 and node.adoptions == 1 and node.val_loss == 2.5
    assert node.evals == [(25, 50 * 128, 3.0), (50, 50 * 256, 2.5)]  # the periodic evaluation and the final one

    done = runner.invoke(app, ["report", str(a), str(b), "--out", str(tmp_path / "report"), "--baseline", str(bench)])
    assert done.exit_code == 0, done.output
    for png in ("loss.png", "throughput.png", "rounds.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| node-0 | 50 | 3.5450 | 2.5000 | 1,026 | 1,000 | 2 | 1 | 1 / 0 |" in md, md
    assert "| node-1 | 40 |" in md and "3.1000 after 20,000 tokens" in md
    assert "backbone: timeout 1; router: ok 3" in md
    assert "| timeout | the round outlived its time budget and was cancelled |" in md  # each outcome explained
    assert "| ok | merged, and a majority" in md and "| no_group |" not in md  # only those that happened
    assert "val loss `-`" not in md  # both nodes evaluated


def test_moving_averages_and_why_a_val_loss_is_missing(tmp_path: Path) -> None:
    from parallax.node.peer.report import moving_average, summary

    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 10) == [2.0, 3.0]
    path = _metrics(tmp_path / "node-0" / "metrics.jsonl", steps=5, loss0=4.0, bytes_per_step=10,
                    rounds=[("router", "no_group")])
    node = read_node(path)
    node.evals = []  # a node that evaluated neither every eval_every steps nor when it left
    md = summary([node])
    assert "val loss `-`: the node never evaluated" in md and "eval_every" in md and "--final-eval" in md
    assert "| no_group | too few other composers" in md


def test_a_file_that_is_not_a_nodes_metrics_is_named(tmp_path: Path) -> None:
    stray = tmp_path / "notes.jsonl"
    stray.write_text('{"kind": "event"}\n')
    done = runner.invoke(app, ["report", str(stray), "--out", str(tmp_path / "r")])
    assert done.exit_code == 1 and "holds no step line" in done.output
    done = runner.invoke(app, ["report", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "r")])
    assert done.exit_code == 1 and "no metrics file" in done.output


def statistics_mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_lines_of_the_wrong_shape_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('[1, 2]\n"text"\n{"kind": "step", "step": 1, "loss": 3.0, "bytes_sent": [1], "tokens": "many"}\n')
    node = read_node(path)
    assert node.steps == [1] and node.traffic == [0] and node.tokens == [0]
