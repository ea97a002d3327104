"""``parallax export`` from a live swarm: real ``node join`` processes on loopback and the export command as a
process of its own, joining the run as a reader.

Every expert comes from its owner's signed snapshot, the shared groups from the composers' merged state; the
reader owns nothing (the composers keep counting two peers and splitting the experts between them), and the folder
loads and evaluates.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import parallax
from parallax.dht.testing import wait_until
from parallax.node.export.folder import CONFIG, read_model
from parallax.node.export.use import evaluate_on
from parallax.node.peer.local_swarm import LocalSwarm, latest, read_metrics
from parallax.protocol.identity import Identity

pytestmark = pytest.mark.timeout(300)

RUN = "export-live"
NODE_ARGS = ["--preset", "tiny", "--set", 'sync.periods={"router": 5, "latent": 10, "backbone": 10}',
             "--snapshot-every", "10", "--steps", "100000"]


def test_a_live_swarm_exports_every_expert_from_its_owner(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id=RUN, node_args=NODE_ARGS)
    try:
        swarm.start_bootstrap()
        nodes = [swarm.add_node() for _ in range(2)]

        def trained(steps: int) -> bool:
            last = [latest(read_metrics(n.metrics)) or {} for n in nodes]
            return all(r.get("step", 0) >= steps and r.get("peers") == 2 for r in last)

        wait_until(lambda: trained(25), timeout=150, explain=swarm.describe)
        out = tmp_path / "model"
        done = subprocess.run(
            [sys.executable, "-m", "parallax.cli", "export", "--initial-peers", swarm.initial_peers, "--run-id", RUN,
             "--loopback", "--identity", str(tmp_path / "reader.key"), "--out", str(out), "--timeout", "90"],
            capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + swarm.describe()
        assert "exported 8 experts from 2 node(s)" in done.stdout
        fingerprints = {Identity.load(tmp_path / f"node-{i}" / "node.key").fingerprint for i in range(2)}
        provenance = json.loads((out / CONFIG).read_text())["provenance"]
        assert {n["holder"] for n in provenance["nodes"]} == fingerprints
        assert len(provenance["experts"]) == 8 and not provenance["missing"]
        assert {e["holder"] for e in provenance["experts"]} == fingerprints  # each from one of the two owners
        assert all(e["origin"] == "owner" and e["step"] >= 10 for e in provenance["experts"])
        assert "state of 2 composer(s)" in provenance["shared_from"]["holder"]
        assert all(g["round"] > 0 and g["origin"] == "merged" for g in provenance["shared_from"]["groups"].values())
        exported = read_model(out)
        loss = evaluate_on(exported.model, None, batch_size=8, eval_batches=4).nats_per_token
        assert 0 < loss < 5.6  # below a uniform guess over bytes (ln 256 = 5.55) once trained a little
        assert parallax.load(out) is not None
        # The reader owned nothing and was never counted: both composers still see two peers and keep training.
        step = max(latest(read_metrics(n.metrics))["step"] for n in nodes)
        wait_until(lambda: trained(step + 3), timeout=120, explain=swarm.describe)
        assert all(n.alive for n in nodes)
    finally:
        swarm.close()
