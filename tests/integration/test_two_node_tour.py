"""The README's two-node tour as a newcomer walks it: one node trains alone, a second joins it, both train on, the
model is exported from the live pair and from their checkpoints, and the live export generates and is evaluated.
Real ``node join`` processes on loopback.

What a join must never cost: the first node's progress. A lone composer's anchor follows its training (it merges
among one), so the state the second node downloads is trained; neither node's loss after the join's first rounds
is worse than the first node's before it by more than the run-to-run noise; and an export holds what was trained:
the export from the checkpoints the nodes wrote at the steps of the snapshots the live export took holds the same
expert tensors, and both score as the nodes did at those steps.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import parallax
from parallax.dht.adapter import dht_time
from parallax.dht.testing import wait_until
from parallax.node.export.folder import CONFIG, WEIGHTS, read_model
from parallax.node.export.use import evaluate_on
from parallax.node.peer.local_swarm import LocalSwarm, NodeProcess, latest, read_metrics
from parallax.node.peer.timeline import events
from parallax.node.train.checkpoint import read_info
from parallax.protocol.identity import Identity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RUN = "tour"
PERIODS = '{"router": 5, "latent": 10, "backbone": 20}'
# A snapshot and a checkpoint every 10 steps, all kept: each expert's snapshot in the live export has a checkpoint
# of the same step.
NODE_ARGS = ["--preset", "tiny", "--set", f"sync.periods={PERIODS}", "--snapshot-every", "10", "--checkpoint-every",
             "10", "--set", "node.keep_checkpoints=100000", "--steps", "100000"]
ALONE_STEPS = 200
WINDOW = 30
NOISE_NATS = 0.25
"""How much worse than the first node's loss before the join a node may train after it: the steps' loss wanders by
about 0.1 nats over a window of the tiny model; a node reloaded from an untrained state lands 2-3 nats higher."""


def _losses(node: NodeProcess, after: float = 0.0) -> list[float]:
    return [r["loss"] for r in read_metrics(node.metrics) if r["kind"] == "step" and r["t"] > after]


def _loss_before(node: NodeProcess, step: int) -> float:
    """The node's mean training loss over the ``WINDOW`` steps up to ``step``."""
    losses = [r["loss"] for r in read_metrics(node.metrics)
              if r["kind"] == "step" and step - WINDOW < r["step"] <= step]
    assert losses, f"no step of node {node.index} before step {step}"
    return statistics.mean(losses)


def _backbone_rounds(node: NodeProcess, after: float) -> list[dict]:
    return [r for r in events(read_metrics(node.metrics), "round")
            if r["group"] == "backbone" and r["status"] == "ok" and r["t"] > after and r["participants"] == 2]


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "parallax.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _export(args: list[str], out: Path) -> tuple[float, dict]:
    done = _cli("export", *args, "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    card = json.loads((out / CONFIG).read_text())["provenance"]
    return card["val_loss"]["nats_per_token"], card


def test_a_join_keeps_the_first_nodes_progress_and_two_nodes_export(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id=RUN, node_args=NODE_ARGS)
    try:
        swarm.start_bootstrap()
        first = swarm.add_node("--checkpoint-dir", str(tmp_path / "ckpt-0"))
        wait_until(lambda: first.step >= ALONE_STEPS, timeout=180, explain=swarm.describe)
        before = _losses(first)[-WINDOW:]
        joined_at = dht_time()
        second = swarm.add_node("--checkpoint-dir", str(tmp_path / "ckpt-1"))
        wait_until(lambda: all(len(_backbone_rounds(n, joined_at)) >= 2 for n in (first, second)), timeout=180,
                   explain=swarm.describe)
        (loaded,) = events(read_metrics(second.metrics), "loaded_state")
        assert all(r > 0 for r in loaded["groups"].values()), f"the joiner loaded an untrained state: {loaded}"
        bound = statistics.mean(before) + NOISE_NATS
        settled = max(_backbone_rounds(n, joined_at)[1]["t"] for n in (first, second))
        wait_until(lambda: all(len(_losses(n, settled)) >= WINDOW for n in (first, second)), timeout=120,
                   explain=swarm.describe)
        for name, node in (("first", first), ("joiner", second)):
            since_join = _losses(node, joined_at)
            after = _losses(node, settled)[:WINDOW]
            print(f"{name}: mean loss {statistics.mean(before):.4f} before the join, first after it "
                  f"{since_join[0]:.4f}, {statistics.mean(after):.4f} after two backbone rounds")
            assert statistics.mean(since_join[:5]) < bound and statistics.mean(after) < bound, (name, before, after)

        # A live export of the pair, by a reader peer: every group merged by both, every expert from its owner's
        # signed snapshot, the model as good as the nodes.
        live, card = _export(["--initial-peers", swarm.initial_peers, "--run-id", RUN, "--loopback", "--identity",
                              str(tmp_path / "reader.key"), "--timeout", "120"], tmp_path / "live-model")
        assert all(g["round"] > 0 and g["origin"] == "merged" for g in card["shared_from"]["groups"].values()), card
        assert "state of 2 composer(s)" in card["shared_from"]["holder"]
        fingerprints = {Identity.load(tmp_path / f"node-{i}" / "node.key").fingerprint for i in range(2)}
        assert {n["holder"] for n in card["nodes"]} == fingerprints
        assert len(card["experts"]) == 8 and not card["missing"]
        assert {e["holder"] for e in card["experts"]} == fingerprints  # each from one of the two owners
        assert all(e["origin"] == "owner" and e["step"] >= 10 for e in card["experts"])
        # The reader owned nothing and was never counted: both composers still see two peers and keep training.
        step = max(n.step for n in (first, second))
        wait_until(lambda: all(n.step >= step + 3 and latest(read_metrics(n.metrics))["peers"] == 2
                               for n in (first, second)), timeout=120, explain=swarm.describe)
        # Each node's checkpoint at the step of the first snapshot the live export took from it.
        keys = [Identity.load(tmp_path / f"node-{i}" / "node.key").fingerprint for i in range(2)]
        index = {key: i for i, key in enumerate(keys)}
        ckpt_steps: dict[int, int] = {}
        for e in card["experts"]:
            ckpt_steps.setdefault(index[e["holder"]], e["step"])
        folders = [tmp_path / f"ckpt-{i}" / f"step-{s:09d}" for i, s in sorted(ckpt_steps.items())]
        wait_until(lambda: all((f / "manifest.json").exists() for f in folders), timeout=60)
        # The checkpoints are written: the nodes leave, and the export from them has the machine to itself.
        codes = swarm.stop_nodes()
        assert codes == [0, 0], swarm.describe()
        # Resumed, each would count the other from its first read (``Membership.remember``).
        assert [read_info(tmp_path / f"ckpt-{i}").workers for i in range(2)] == [{keys[1]}, {keys[0]}]
        from_checkpoints, checkpoint_card = _export([a for f in folders for a in ("--from-checkpoints", str(f))],
                                                    tmp_path / "checkpoint-model")
        assert not checkpoint_card["missing"], checkpoint_card
        a = safetensors.torch.load_file(tmp_path / "live-model" / WEIGHTS)
        b = safetensors.torch.load_file(tmp_path / "checkpoint-model" / WEIGHTS)
        compared = 0
        for e in card["experts"]:
            if e["step"] != ckpt_steps[index[e["holder"]]]:
                continue  # that owner's next snapshot: its checkpoint is another folder
            prefix = f"blocks.{e['layer']}.moe.experts.{e['expert']}."
            names = [n for n in a if n.startswith(prefix)]
            assert names and all(torch.equal(a[n], b[n]) for n in names), (e, folders)
            compared += 1
        assert compared >= 2  # at least one expert of each node
        # The nodes train on while the live export runs (thousands of tiny steps on an idle machine): each export
        # is the nodes' model as of the steps its card names, so it is held to their own loss there, the mean
        # training loss of the window before (the tiny model's training and validation losses agree within 1% at
        # these steps).
        steps_at = {n["holder"]: n["step"] for n in card["nodes"]}
        then = statistics.mean(_loss_before(node, steps_at[key])
                               for node, key in zip((first, second), keys, strict=True))
        then_checkpoints = statistics.mean(_loss_before(node, ckpt_steps[i]) for i, node in enumerate((first, second)))
        print(f"val loss: the live export {live:.4f} against the nodes' {then:.4f} at its steps; the export from "
              f"checkpoints {from_checkpoints:.4f} against the nodes' {then_checkpoints:.4f} at theirs")
        assert abs(live / then - 1) < 0.05 and abs(from_checkpoints / then_checkpoints - 1) < 0.05
        # The model in the live export generates text, and ``parallax eval`` gives its in-process evaluation.
        done = _cli("generate", str(tmp_path / "live-model"), "--prompt", "ROMEO:", "--max-new-tokens", "40",
                    "--seed", "1")
        assert done.returncode == 0 and done.stdout.startswith("ROMEO:") and len(done.stdout.strip()) > len("ROMEO:")
        done = _cli("eval", str(tmp_path / "live-model"), "--json")
        assert done.returncode == 0, done.stderr
        measured = json.loads(done.stdout)["nats_per_token"]
        assert parallax.load(tmp_path / "live-model").model is not None
        exported = read_model(tmp_path / "live-model")
        windows = exported.eval_windows
        in_process = evaluate_on(exported.model, None, batch_size=windows["batch_size"],
                                 eval_batches=windows["eval_batches"]).nats_per_token
        assert math.isfinite(measured) and measured == pytest.approx(in_process, rel=1e-6)
    finally:
        swarm.close()


def test_an_export_before_the_first_backbone_round_holds_the_trained_weights(tmp_path: Path) -> None:
    """A node stops at step 60, before the backbone's first round (at 100; the router and latent interface merged
    alone at 25 and 50): the export takes the never-merged backbone from the node's own weights, and scores near
    its own loss, not a uniform guess (5.55 nats)."""
    swarm = LocalSwarm(tmp_path, run_id="early", node_args=["--preset", "tiny", "--steps", "60", "--final-eval"])
    try:
        swarm.start_bootstrap()
        node = swarm.add_node("--checkpoint-dir", str(tmp_path / "ckpt"))
        assert swarm.wait(timeout_s=240) and node.process.returncode == 0, swarm.describe()
        own = events(read_metrics(node.metrics), "final_eval")[-1]["val_loss"]
        loss, card = _export(["--from-checkpoints", str(tmp_path / "ckpt")], tmp_path / "model")
        groups = card["shared_from"]["groups"]
        assert groups["backbone"]["round"] == 0 and "never merged" in groups["backbone"]["origin"], groups
        assert groups["router"]["round"] == 2 and groups["router"]["origin"] == "merged", groups
        print(f"val loss at step 60: the node's own {own:.4f}, the export {loss:.4f}")
        assert abs(loss / own - 1) < 0.05, (loss, own)
    finally:
        swarm.close()
