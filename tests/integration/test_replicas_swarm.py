"""Replicated experts in a real swarm (``ownership.replicas = 2``): four ``parallax node join`` processes on
loopback, every expert trained by two of them and merged between its owners; one node SIGKILLed mid-run.

What a kill must not cost: any expert step. Every expert the victim trained had a live second owner at that
moment, which trains on; where the smaller swarm's assignment moves the expert on, the owner giving it up hands
over its final snapshot (never a stale copy, never the initialisation).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from parallax.dht.adapter import dht_time
from parallax.dht.testing import wait_until
from parallax.node.config.train import train_config
from parallax.node.config.typed import apply_changes
from parallax.node.peer.local_swarm import LocalSwarm, NodeProcess, read_metrics
from parallax.node.peer.timeline import events, ownership, shard_at
from parallax.node.sim.simulator import RunSpec, run
from parallax.node.train.data import load_corpus, split_corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

PERIODS = '{"router": 5, "latent": 10, "backbone": 10}'
NODE_ARGS = ["--preset", "tiny", "--set", f"sync.periods={PERIODS}", "--set", "surrogate.refresh_every=10",
             "--set", "ownership.replicas=2", "--snapshot-every", "10", "--final-eval"]
ALL_EXPERTS = {(layer, e) for layer in range(2) for e in range(4)}  # tiny: 2 layers x 4 experts


def _expert_rounds_ok(node: NodeProcess, since: float = 0.0) -> int:
    return sum(1 for r in events(read_metrics(node.metrics), "round")
               if r["group"].startswith("experts-") and r["status"] == "ok" and r["t"] > since)


def _owners(nodes: list[NodeProcess], t: float) -> dict[tuple[int, int], list[int]]:
    """expert -> the nodes that owned it at ``t`` (their shard events)."""
    held = [shard_at(read_metrics(n.metrics), t) for n in nodes]
    return {eid: [i for i, s in enumerate(held) if eid in s] for eid in ALL_EXPERTS}


def _settled(nodes: list[NodeProcess]) -> bool:
    """Every expert owned by exactly two of ``nodes``."""
    return all(len(who) == 2 for who in _owners(nodes, dht_time()).values())


def test_a_killed_owner_costs_no_expert_step_and_the_owners_merge_their_copies(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id="replicas", node_args=NODE_ARGS)
    try:
        swarm.start_bootstrap()
        for _ in range(4):
            swarm.add_node("--min-peers", "4")  # until stopped
        wait_until(lambda: all(n.step >= 22 and _expert_rounds_ok(n) >= 1 for n in swarm.nodes)
                   and _settled(swarm.nodes), timeout=300, explain=swarm.describe)
        killed_at = dht_time()
        at_kill = _owners(swarm.nodes, killed_at)
        lost = {eid for eid, who in at_kill.items() if 3 in who}
        assert lost, "the victim owned nothing"
        steps_at_kill = {i: swarm.nodes[i].step for i in range(3)}
        swarm.kill(3)
        survivors = swarm.nodes[:3]
        wait_until(lambda: _settled(survivors), timeout=90, explain=swarm.describe)
        settled_at = dht_time()
        # The survivors go on: an expert round of their own after the assignment settled, then they leave cleanly.
        wait_until(lambda: all(_expert_rounds_ok(n, settled_at) >= 1 for n in survivors), timeout=120,
                   explain=swarm.describe)
        stopping_at = dht_time()
        codes = swarm.stop_nodes(range(3))
        assert codes == [0, 0, 0], f"exit codes {codes}"
        records = swarm.metrics()[:3]
        # What the kill moved (the survivors' own stops may move experts again after this).
        adoptions = [a for r in records for a in events(r, "adopted") if killed_at < a["t"] < stopping_at]
        for eid in sorted(lost):
            co_owners = [i for i in at_kill[eid] if i != 3]
            assert co_owners, f"expert {eid} had no live second owner when the victim died"
            kept = [i for i in co_owners if any(a <= killed_at and b >= settled_at
                                                for a, b in ownership(records[i]).get(eid, []))]
            if kept:
                print(f"expert {eid}: trained on by node {kept[0]} through the kill")
                continue  # its live replica trained on through the kill
            # Moved on by the smaller swarm's assignment: taken from the final snapshot of the owner giving it up.
            taken = [a for a in adoptions if (a["layer"], a["expert"]) == eid]
            assert taken, f"expert {eid}: neither kept by {co_owners} nor taken over"
            assert all(a["source"] == "previous owner" and a["snapshot_step"] >= min(steps_at_kill[i]
                                                                                     for i in co_owners)
                       for a in taken), f"expert {eid} came back from an older copy: {taken}"
            print(f"expert {eid}: handed over from the final snapshot of node {co_owners}")
        for i, r in enumerate(records):
            late = [x for x in events(r, "round") if x["group"].startswith("experts-") and x["status"] == "ok"
                    and x["t"] > settled_at]
            assert late and all(x["participants"] == 2 for x in late), f"node {i}: expert rounds {late}"
            final = events(r, "final_eval")
            assert final and final[-1]["val_loss"] < 5.0, f"node {i}: {final}"
            print(f"node {i}: {steps_at_kill[i]} steps at the kill, final val loss {final[-1]['val_loss']:.4f}")
        # The in-process run of the same settings, four composers all along, at the survivors' mean step count.
        finals = [events(r, "final_eval")[-1] for r in records]
        steps = round(statistics.mean(f["step"] for f in finals))
        cfg = apply_changes(train_config("tiny", steps=steps), {
            "sync.periods": json.loads(PERIODS), "surrogate.refresh_every": 10, "ownership.replicas": 2})
        reference = run(RunSpec(name="replicas_2", kind="parallax", cfg=cfg, composers=4),
                        *split_corpus(load_corpus()))
        swarm_loss = statistics.median(f["val_loss"] for f in finals)
        print(f"val loss at {steps} steps: swarm {swarm_loss:.4f} (a node killed at ~{min(steps_at_kill.values())}), "
              f"in-process {reference.val_loss:.4f}, ratio {swarm_loss / reference.val_loss:.3f}")
        assert swarm_loss < 1.25 * reference.val_loss
    finally:
        swarm.close()
