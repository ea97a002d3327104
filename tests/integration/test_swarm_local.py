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


def _swarm_local(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "parallax.cli", "swarm", "local", "--nodes", "2",
                           "--workdir", str(tmp_path), "--run-id", "tour", *extra], capture_output=True, text=True,
                          env=env, timeout=240)


def _run_folder(done: subprocess.CompletedProcess[str]) -> Path:
    found = re.search(r"^run folder: (\S+)$", done.stdout, re.M)
    assert found is not None, done.stdout[-3000:]
    return Path(found.group(1))


def _summary_shows_the_nodes_own_counters(done: subprocess.CompletedProcess[str], run: Path, steps: int) -> None:
    """The summary's row of each node holds the counters of its leave (its metrics file's last line), and the
    nodes evaluated every 10 steps."""
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
        assert int(step) == last["step"] == steps
        assert int(rounds) == sum(last["rounds_ok"].values()) > 0
        assert sent == f"{last['bytes_sent'] / 1e6:.2f}" and received == f"{last['bytes_received'] / 1e6:.2f}"
        assert last["outer_bytes"] > 0
        evals = [r for r in read_metrics(run / f"node-{i}" / "metrics.jsonl") if r.get("kind") == "eval"]
        assert [e["step"] for e in evals] == list(range(10, steps + 1, 10)), evals
        assert all(0 < e["val_loss"] < 6 for e in evals), evals
        finals.append(last)
    # Outer-round traffic is counted as sent: every outer byte one node fetched the other served, so the pair sent at
    # least half their outer traffic (one node alone may fetch far more than it serves: a joiner's state download).
    assert sum(f["bytes_sent"] for f in finals) >= sum(f["outer_bytes"] for f in finals) / 2


def test_two_runs_in_one_folder_keep_their_files_show_their_counters_and_each_leaves_a_model(tmp_path: Path) -> None:
    """Two runs of two nodes in one folder: the first with the default tokenizer and an evaluation every 10 steps,
    the second an open run of the BPE tokenizer, which each node trains on its corpus (the same corpus gives the
    same digest, hence one run of two nodes training together)."""
    periods = 'sync.periods={"router": 5, "latent": 10, "backbone": 10}'
    runs = [(25, ("--set", "eval_every=10")), (10, ("--set", "model.tokenizer=bpe", "--set", "model.vocab_size=1024"))]
    done = [_swarm_local(tmp_path, "--steps", str(steps), "--set", periods, *extra) for steps, extra in runs]
    for d in done:
        assert d.returncode == 0, d.stdout[-3000:] + d.stderr[-3000:]
    folders = [_run_folder(d) for d in done]
    assert folders[0] != folders[1] and {f.parent for f in folders} == {tmp_path}
    for folder, d, (steps, _) in zip(folders, done, runs, strict=True):
        for i in range(2):
            records = read_metrics(folder / f"node-{i}" / "metrics.jsonl")
            last = final_counters(records)
            assert last is not None and last["step"] == steps, last
            assert any(r.get("peers") == 2 for r in records if r.get("kind") == "step"), records[-3:]
        assert (folder / "model" / "config.json").is_file() and (folder / "model" / "README.md").is_file()
        said = " ".join(d.stdout.split())
        assert f"parallax generate {folder / 'model'} --prompt 'ROMEO:'" in said, d.stdout[-2000:]
    _summary_shows_the_nodes_own_counters(done[0], folders[0], 25)
    # The BPE run's generate line, as printed (a short continuation).
    generate = subprocess.run([sys.executable, "-m", "parallax.cli", "generate", str(folders[1] / "model"),
                               "--prompt", "ROMEO:", "--max-new-tokens", "8"], capture_output=True, text=True,
                              timeout=120)
    assert generate.returncode == 0 and generate.stdout.startswith("ROMEO:"), generate.stdout + generate.stderr


def test_a_node_that_fails_makes_the_command_fail_and_is_named(tmp_path: Path) -> None:
    done = _swarm_local(tmp_path, "--steps", "5", "--set", "optim.lr=-1")
    assert done.returncode == 1
    said = " ".join(done.stdout.split())
    assert "node 0 exited with code" in said and "node 1 exited with code" in said, said[-2000:]
