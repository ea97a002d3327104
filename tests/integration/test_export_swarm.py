"""A local swarm of three tiny composers (what ``parallax swarm local --nodes 3 --checkpoint-every 10`` runs),
exported twice: from the live swarm and from the checkpoints its nodes wrote at the steps of the snapshots the
live export took. The experts are the same tensors; the exported model generates text, and ``parallax eval``
gives the loss its in-process evaluation gives."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from parallax.dht.testing import wait_until
from parallax.node.export.folder import CONFIG, WEIGHTS, read_model
from parallax.node.export.use import evaluate_on
from parallax.node.peer.local_swarm import LocalSwarm, latest, read_metrics
from parallax.protocol.identity import Identity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RUN = "export-three"
NODE_ARGS = ["--preset", "tiny", "--set", 'sync.periods={"router": 5, "latent": 10, "backbone": 10}',
             "--snapshot-every", "10", "--checkpoint-every", "10", "--set", "node.keep_checkpoints=1000",
             "--steps", "100000"]


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "parallax.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_live_and_checkpoint_exports_hold_the_same_experts_and_the_model_generates(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id=RUN, node_args=NODE_ARGS)
    try:
        swarm.start_bootstrap()
        nodes = [swarm.add_node("--checkpoint-dir", str(tmp_path / f"node-{i}" / "checkpoints")) for i in range(3)]

        def trained(steps: int) -> bool:
            last = [latest(read_metrics(n.metrics)) or {} for n in nodes]
            return all(r.get("step", 0) >= steps and r.get("peers") == 3 for r in last)

        wait_until(lambda: trained(30), timeout=240, explain=swarm.describe)
        live = tmp_path / "live"
        done = _cli("export", "--initial-peers", swarm.initial_peers, "--run-id", RUN, "--loopback", "--identity",
                    str(tmp_path / "reader.key"), "--out", str(live), "--timeout", "120")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:] + swarm.describe()
        index = {Identity.load(tmp_path / f"node-{i}" / "node.key").fingerprint: i for i in range(3)}
        experts = json.loads((live / CONFIG).read_text())["provenance"]["experts"]
        assert len(experts) == 8 and {e["holder"] for e in experts} <= set(index)
        # Each node's checkpoint at the step of the snapshot the live export took from it.
        steps = {}
        for e in experts:
            steps.setdefault(index[e["holder"]], e["step"])
        folders = [tmp_path / f"node-{i}" / "checkpoints" / f"step-{s:09d}" for i, s in sorted(steps.items())]
        wait_until(lambda: all((f / "manifest.json").exists() for f in folders), timeout=60)
        # The checkpoints are written: the nodes leave, and the export from them has the machine to itself.
        assert swarm.stop_nodes() == [0, 0, 0], swarm.describe()
        from_checkpoints = tmp_path / "from-checkpoints"
        args = [a for f in folders for a in ("--from-checkpoints", str(f))]
        done = _cli("export", *args, "--out", str(from_checkpoints), "--allow-missing")
        assert done.returncode == 0, done.stderr[-3000:]
        a = safetensors.torch.load_file(live / WEIGHTS)
        b = safetensors.torch.load_file(from_checkpoints / WEIGHTS)
        compared = 0
        for e in experts:
            if e["step"] != steps[index[e["holder"]]]:
                continue  # that owner's next snapshot: its checkpoint is another folder
            prefix = f"blocks.{e['layer']}.moe.experts.{e['expert']}."
            names = [n for n in a if n.startswith(prefix)]
            assert names and all(torch.equal(a[n], b[n]) for n in names), (e, folders)
            compared += 1
        assert compared >= len(steps)  # at least one expert of every node that served one
    finally:
        swarm.close()
    done = _cli("generate", str(live), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1")
    assert done.returncode == 0 and done.stdout.startswith("ROMEO:") and len(done.stdout.strip()) > len("ROMEO:")
    done = _cli("eval", str(live), "--json")
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout)["nats_per_token"]
    exported = read_model(live)
    windows = exported.eval_windows
    in_process = evaluate_on(exported.model, None, batch_size=windows["batch_size"],
                             eval_batches=windows["eval_batches"]).nats_per_token
    assert math.isfinite(measured) and measured == pytest.approx(in_process, rel=1e-6)
