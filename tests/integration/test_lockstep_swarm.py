"""Lockstep (``node.lockstep``) end to end: two runs of the same two composer processes (the same keys, so the same
data and shards) train the same losses, step for step, however their processes were scheduled."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from parallax.node.peer.local_swarm import LocalSwarm, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

COMPOSERS = 2
STEPS = 40
ARGS = ["--preset", "tiny", "--set", 'sync.periods={"router": 10, "latent": 20, "backbone": 30}',
        "--set", "surrogate.refresh_every=10", "--set", "node.lockstep=true", "--set", "net.outer.own_data_audits=true",
        "--snapshot-every", "20",
        "--steps", str(STEPS), "--min-peers", str(COMPOSERS)]


def _losses(folder: Path, keys: Path | None = None) -> list[list[float]]:
    """Each composer's loss at every step of a lockstep run in ``folder`` (with the composers' keys of ``keys``)."""
    swarm = LocalSwarm(folder, run_id="lockstep", node_args=ARGS)
    if keys is not None:
        for i in range(COMPOSERS):
            (folder / f"node-{i}").mkdir(parents=True)
            for key in (keys / f"node-{i}").glob("node.key*"):
                shutil.copy2(key, folder / f"node-{i}" / key.name)
    try:
        swarm.start_bootstrap()
        for _ in range(COMPOSERS):
            swarm.add_node()
        assert swarm.wait(400), swarm.describe()
    finally:
        swarm.close()
    assert all(n.process.returncode == 0 for n in swarm.nodes), swarm.describe()
    # Each audited the other's backbone contribution on its own model, on the batches rebuilt from the other's
    # identity and signed draw count (``train.own_data``).
    for node in swarm.nodes:
        audits = [r for r in read_metrics(node.metrics) if r.get("kind") == "own_data_audit"]
        assert audits and all(math.isfinite(r["own"]) and r["drawn"] >= 30 for r in audits), (node.metrics, audits)
    return [[r["loss"] for r in read_metrics(n.metrics) if r.get("kind") == "step"] for n in swarm.nodes]


def test_two_lockstep_runs_of_the_same_composers_train_the_same_losses(tmp_path):
    first = _losses(tmp_path / "first")
    second = _losses(tmp_path / "second", keys=tmp_path / "first")
    assert [len(steps) for steps in first] == [STEPS] * COMPOSERS
    assert first == second  # rounds merged at steps 11-41 and surrogates of three refreshes, all at the same steps
