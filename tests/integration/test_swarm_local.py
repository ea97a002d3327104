"""``parallax swarm local`` as a user runs it: real processes on loopback. Its summary shows the counters the
nodes wrote to their metrics files, the rounds and snapshots of their leave included; nodes evaluate their model
every ``eval_every`` steps; a node that fails makes
the command fail, naming it; each run keeps a folder of its own and leaves its model there, with next commands
that work as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.node.peer.local_swarm import final_counters, read_metrics

pytestmark = pytest.mark.timeout(300)


def _swarm_local(tmp_path: Path, *extra: str, nodes: int = 2) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "parallax.cli", "swarm", "local", "--nodes", str(nodes),
                           "--workdir", str(tmp_path), "--run-id", "tour", *extra], capture_output=True, text=True,
                          env=env, timeout=240)


def _run_folder(done: subprocess.CompletedProcess[str]) -> Path:
    found = re.search(r"^run folder: (\S+)$", done.stdout, re.M)
    assert found is not None, done.stdout[-3000:]
    return Path(found.group(1))


def test_the_summary_shows_the_nodes_own_counters(tmp_path: Path) -> None:
    done = _swarm_local(tmp_path, "--steps", "25", "--set", 'sync.periods={"router": 5, "latent": 10, "backbone": 10}',
                        "--set", "eval_every=10")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = _run_folder(done)
    lines = done.stdout.splitlines()
    summary = "\n".join(lines[max(i for i, line in enumerate(lines) if line.strip() == "summary"):])
    finals = []
    for i in range(2):
        last = final_counters(read_metrics(run / f"node-{i}" / "metrics.jsonl"))
        assert last is not None and last["kind"] == "left", last  # the leave's counters, not the last step's
        cells = r"\s+exit 0\s+(\d+)\s+(\S+)\s+(\d+)\s+v(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s*$"
        row = re.search(rf"^\s*{i}{cells}", summary, re.M)
        assert row is not None, summary
        step, loss, owned, _version, rounds, sent, received = row.groups()
        assert int(step) == last["step"] == 25
        assert int(rounds) == sum(last["rounds_ok"].values()) > 0
        assert sent == f"{last['bytes_sent'] / 1e6:.2f}" and received == f"{last['bytes_received'] / 1e6:.2f}"
        assert last["outer_bytes"] > 0
        evals = [r for r in read_metrics(run / f"node-{i}" / "metrics.jsonl") if r.get("kind") == "eval"]
        assert [e["step"] for e in evals] == [10, 20] and all(0 < e["val_loss"] < 6 for e in evals), evals
        finals.append(last)
    # Outer-round traffic is counted as sent: every outer byte one node fetched the other served, so the pair sent at
    # least half their outer traffic (one node alone may fetch far more than it serves: a joiner's state download).
    assert sum(f["bytes_sent"] for f in finals) >= sum(f["outer_bytes"] for f in finals) / 2


def test_a_node_that_fails_makes_the_command_fail_and_is_named(tmp_path: Path) -> None:
    done = _swarm_local(tmp_path, "--steps", "5", "--set", "optim.lr=-1")
    assert done.returncode == 1
    said = " ".join(done.stdout.split())
    assert "node 0 exited with code" in said and "node 1 exited with code" in said, said[-2000:]


def test_nodes_of_an_open_run_train_the_same_bpe_and_train_together(tmp_path: Path) -> None:
    # No manifest: each node trains the BPE on its corpus; the same corpus gives the same digest, hence one run.
    done = _swarm_local(tmp_path, "--steps", "10", "--set", "model.tokenizer=bpe", "--set", "model.vocab_size=1024")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for i in range(2):
        records = read_metrics(_run_folder(done) / f"node-{i}" / "metrics.jsonl")
        steps = [r for r in records if "step" in r and "peers" in r]
        assert steps and steps[-1]["step"] == 10 and any(r["peers"] == 2 for r in steps), steps[-3:]


def test_two_runs_in_one_folder_keep_their_files_and_each_leaves_a_model_its_next_lines_use(tmp_path: Path) -> None:
    runs = []
    periods = 'sync.periods={"router": 5, "latent": 5, "backbone": 5}'
    for _ in range(2):  # one node each: what is checked is the runs' folders, not their swarms
        done = _swarm_local(tmp_path, "--steps", "10", "--set", periods, nodes=1)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs.append((_run_folder(done), done.stdout))
    assert runs[0][0] != runs[1][0] and {r.parent for r, _ in runs} == {tmp_path}
    for run, stdout in runs:
        last = final_counters(read_metrics(run / "node-0" / "metrics.jsonl"))
        assert last is not None and last["step"] == 10, last
        assert (run / "model" / "config.json").is_file() and (run / "model" / "README.md").is_file()
        said = " ".join(stdout.split())
        assert f"parallax generate {run / 'model'} --prompt 'ROMEO:'" in said, stdout[-2000:]
    # The last run's generate line, as printed (a short continuation).
    generate = subprocess.run([sys.executable, "-m", "parallax.cli", "generate", str(runs[1][0] / "model"), "--prompt",
                               "ROMEO:", "--max-new-tokens", "8"], capture_output=True, text=True, timeout=120)
    assert generate.returncode == 0 and generate.stdout.startswith("ROMEO:"), generate.stdout + generate.stderr
