"""Experiment trackers (``--log-to``): real TensorBoard event files and a real offline W&B run, read back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parallax.errors import NodeError
from parallax.node.peer import sinks
from parallax.node.peer.sinks import TensorBoardSink, WandbSink, open_sinks, parse_sink, scalars, wandb_run_id
from parallax.node.peer.telemetry import Telemetry


def test_a_spec_is_kind_colon_target_and_anything_else_says_what_to_write() -> None:
    assert parse_sink("tensorboard:runs/tb") == ("tensorboard", "runs/tb")
    assert parse_sink("wandb:parallax") == ("wandb", "parallax")
    for bad in ("tensorboard", "mlflow:x", "wandb:", ""):
        with pytest.raises(ValueError, match="tensorboard:DIR or wandb:PROJECT"):
            parse_sink(bad)


def test_a_missing_tracker_package_names_the_extra(monkeypatch) -> None:
    def missing(name: str):
        raise ImportError(name)

    monkeypatch.setattr(sinks.importlib, "import_module", missing)
    with pytest.raises(NodeError, match=r"pip install -e '\.\[wandb\]'"):
        open_sinks(["wandb:p"], name="n", run_id="r", config={})


def test_tensorboard_gets_the_step_lines_numbers(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    telemetry = Telemetry(None, None)
    telemetry.sinks = [TensorBoardSink(tmp_path, "node-a")]
    for step in range(1, 4):
        telemetry.status.rounds_ok = {"router": step}
        telemetry.step(step=step, loss=3.0 - step / 10, tokens=step * 256)
    telemetry.event("final_eval", step=3, val_loss=2.5)
    telemetry.close()
    events = EventAccumulator(str(tmp_path / "node-a"))
    events.Reload()
    assert [round(e.value, 4) for e in events.Scalars("loss")] == [2.9, 2.8, 2.7]
    assert [e.value for e in events.Scalars("rounds_ok/router")] == [1.0, 2.0, 3.0]
    assert [e.value for e in events.Scalars("val_loss")] == [2.5]


def test_an_offline_wandb_run_holds_the_logged_numbers(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("parallax-test", "node-a", "run-1", {"lr": 0.001})
    sink.log(1, {"loss": 3.25, "tokens_per_s": 1000.0})
    sink.log(2, {"loss": 3.125})
    sink.close()
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()
    assert b"loss" in data and b"tokens_per_s" in data and b"node-a" in data


def test_a_resumed_node_logs_into_the_same_wandb_run(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = []
    for step in (1, 2):  # the node, then the same node resumed
        sink = WandbSink("parallax-test", "node-a", "run-1", {"lr": 0.001})
        sink.log(step, {"loss": 3.0 / step})
        sink.close()
        ids.append(sink.id)
    other = wandb_run_id("run-1", "node-b")
    assert ids[0] == ids[1] != other and ids[0] != wandb_run_id("run-2", "node-a")
    runs = sorted(tmp_path.glob("wandb/offline-run-*"))
    # Each run's folder is offline-run-<when>-<run id>; wandb appends -1, -2... to a second one in the same second.
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{ids[0]}(-\d+)?", r.name)
                                  for r in runs), runs


def test_scalars_keep_the_numbers_only() -> None:
    line = {"kind": "step", "step": 3, "loss": 2.0, "peers": 2, "heir_copies": [[0, 1]], "rounds_ok": {"latent": 4},
            "tokens_per_s": None}
    assert scalars(line) == {"loss": 2.0, "peers": 2.0, "rounds_ok/latent": 4.0}
