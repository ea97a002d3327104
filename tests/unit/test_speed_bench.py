"""``parallax bench speed`` writes the figures its targets are stated in, from rows measured in one process."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from parallax.benchmarks.speed import memory_share
from parallax.cli.main import app
from parallax.node.config.train import train_config


def test_bench_speed_writes_the_promised_numbers(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    result = CliRunner().invoke(app, ["bench", "speed", "--preset", "tiny", "--device", "cpu", "--steps", "1",
                                      "--warmup", "0", "--composers", "2,4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    for key in ("grouped_over_loop", "composer_over_full", "analytic_speedup", "memory_over_analytic"):
        assert report[key] > 0, key
    assert {(r["composers"], r["kernel"]) for r in report["rows"]} == {
        (c, k) for c in (1, 2, 4) for k in ("auto", "reference")}
    full = next(r for r in report["rows"] if r["composers"] == 1 and r["kernel"] == "auto")
    four = report["per_composers"]["4"]
    assert four["analytic_memory_bytes"] < full["memory_bytes"] and four["memory_bytes"] < full["memory_bytes"]
    assert "bench speed --preset tiny" in out.with_suffix(".md").read_text()


def test_a_composer_holds_a_share_of_the_parameters_and_a_quarter_for_surrogates() -> None:
    cfg = train_config("small")
    two, four = memory_share(cfg, 2), memory_share(cfg, 4)
    assert 0 < four < two < 1


def test_bad_options_are_named() -> None:
    said = CliRunner().invoke(app, ["bench", "speed", "--preset", "tiny", "--device", "cpu", "--kernels", "fast"])
    assert said.exit_code == 2 and "--kernels" in said.output
    said = CliRunner().invoke(app, ["bench", "speed", "--preset", "tiny", "--device", "cuda:7"])
    assert said.exit_code == 2 and "no CUDA device" in said.output, said.output
