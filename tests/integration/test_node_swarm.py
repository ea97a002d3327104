"""Real multi-process swarms on loopback: ``parallax node join`` processes, a bootstrap peer, real p2pd.

Tiny preset with short tier periods so that a few dozen steps cover several rounds of every tier.
Every process is started in its own session by ``LocalSwarm`` and stopped in its ``close()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parallax.dht.adapter import dht_time
from parallax.dht.testing import wait_until
from parallax.node.config.peer import NodeSettings
from parallax.node.peer.local_swarm import LocalSwarm, NodeProcess, latest, read_metrics
from parallax.node.peer.timeline import events, shard_at

pytestmark = pytest.mark.timeout(420)

PERIODS = '{"router": 5, "latent": 10, "backbone": 10}'
NODE_ARGS = ["--preset", "tiny", "--set", f"sync.periods={PERIODS}", "--set", "surrogate.refresh_every=10",
             "--snapshot-every", "10"]
ALL_EXPERTS = {(layer, e) for layer in range(2) for e in range(4)}  # tiny: 2 layers x 4 experts


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "step"]


def _is_partition(shards: list[set[tuple[int, int]]]) -> bool:
    return sum(len(s) for s in shards) == len(ALL_EXPERTS) and set().union(*shards) == ALL_EXPERTS


def assert_partition(shards: list[set[tuple[int, int]]]) -> None:
    union: set[tuple[int, int]] = set()
    for s in shards:
        assert not (union & s), f"experts owned twice: {union & s}"
        union |= s
    assert union == ALL_EXPERTS, f"experts without an owner: {ALL_EXPERTS - union}"


@pytest.mark.slow
def test_three_nodes_train_and_a_fourth_joins_mid_run(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id="swarm3", node_args=NODE_ARGS)
    try:
        swarm.start_bootstrap()
        for _ in range(3):
            swarm.add_node("--min-peers", "3")  # until stopped
        wait_until(lambda: all(n.step >= 12 for n in swarm.nodes), timeout=180)
        joiner = swarm.add_node("--min-peers", "3")  # until stopped: it refits only after a merged backbone round

        def refitted_and_handed_over() -> bool:
            # Hand-overs end at the previous owners' seams, which on loaded cores can come after the joiner's
            # refit: it leaves once it trains its fair share (8 experts / 4 nodes), not before.
            record = read_metrics(joiner.metrics)
            return (bool(events(record, "refit")) and len(steps_of(record)) >= 20
                    and len(shard_at(record, float("inf"))) == len(ALL_EXPERTS) // 4)

        wait_until(refitted_and_handed_over, timeout=180, explain=swarm.describe)
        assert swarm.stop_node(3) == 0, f"the joiner did not leave cleanly; see {joiner.log}"
        codes = swarm.stop_nodes(range(3))
        assert codes == [0] * 3, f"exit codes {codes}; see {[str(n.log) for n in swarm.nodes]}"
        records = swarm.metrics()
        first_steps = [events(r, "first_step")[0]["t"] for r in records]

        first_losses = []
        for i, r in enumerate(records):
            losses = [s["loss"] for s in steps_of(r)]
            assert len(losses) >= 20, f"node {i} trained {len(losses)} steps"
            first_losses.append(sum(losses[:5]) / 5)
            if i < 3:
                assert sum(losses[-5:]) / 5 < first_losses[i], f"node {i}: loss did not fall ({losses[:5]} ...)"
            final = steps_of(r)[-1]
            assert final["surrogates_held"] > 0 and final["surrogate_version_max"] > 0, f"node {i}: {final}"
            assert final["bytes_received"] > 0, f"node {i} received no surrogate payloads"
        # The joiner starts from the swarm's learned state, not from the init the others started from.
        assert first_losses[3] < min(first_losses[:3]) - 0.5, first_losses

        # Before the joiner: the three shards partition the experts.
        before_join = max(first_steps[:3]) + 1.0
        assert before_join < events(records[3], "dht_started")[0]["t"]
        assert_partition([shard_at(r, before_join) for r in records[:3]])
        # After the joiner took its experts over from their owners: four shards partition them.
        adopted = events(records[3], "adopted")
        assert adopted, "the joiner took no expert over"
        # Its first takeovers come from the live previous owners (later ones may follow churn, from heir copies);
        # none restarts an expert from init.
        first = [a for a in adopted if a["t"] <= adopted[0]["t"] + 1.0]
        assert all(a["source"] == "previous owner" for a in first), adopted
        # ... with the surrogate every receiver holds, so its versions continue from theirs
        assert all(a["surrogate_version"] > 0 for a in first), adopted
        assert not [a for a in adopted if a["source"] == "init"], adopted
        # Hand-overs end at different seams on different nodes: at some moment while the joiner trains, the
        # four shards partition the experts.
        left = events(records[3], "left")[0]["t"]
        moments = sorted({r["t"] + 0.001 for rs in records for r in events(rs, "shard")
                          if adopted[0]["t"] <= r["t"] < left})
        assert any(_is_partition([shard_at(r, t) for r in records]) for t in moments), "no moment with a partition"
        assert events(records[3], "loaded_state"), "the joiner did not load the shared groups from peers"
        # It fits no surrogate on its not-yet-merged backbone: it refits only once a backbone round merged (or,
        # should two fail, without one), and defers every refresh before.
        (ready,) = events(records[3], "refits_ready")
        backbone = [r for r in events(records[3], "round") if r["group"] == "backbone" and r["t"] <= ready["t"]]
        if ready["reason"] == "merged":
            assert backbone and backbone[-1]["status"] == "ok", backbone
            assert all(r["status"] != "ok" for r in backbone[:-1]), backbone
        else:
            assert ready["reason"] == "rounds_failed" and not any(r["status"] == "ok" for r in backbone), backbone
        refits, deferred = events(records[3], "refit"), events(records[3], "refit_deferred")
        assert refits and all(r["t"] >= ready["t"] for r in refits), (ready, refits[:1])
        assert all(d["t"] < ready["t"] for d in deferred), deferred
        assert steps_of(records[3])[0]["step"] > 12, "the joiner did not take the swarm's step count"

        for i, r in enumerate(records[:3]):
            rounds = steps_of(r)[-1]["rounds_ok"]
            assert all(n >= 2 for n in rounds.values()), f"node {i} completed rounds {rounds}"
    finally:
        swarm.close()
    assert not swarm.leftovers(), "processes left behind"


@pytest.mark.slow
def test_killed_node_experts_go_to_heirs_and_rounds_go_on(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id="swarmkill", node_args=NODE_ARGS)
    try:
        swarm.start_bootstrap()
        for _ in range(4):
            swarm.add_node("--min-peers", "4")  # until stopped
        wait_until(lambda: all(n.step >= 22 for n in swarm.nodes), timeout=240)
        victim = read_metrics(swarm.nodes[3].metrics)
        lost = shard_at(victim, float("inf"))
        assert lost, "the victim owned nothing"
        # ... and until the victim's heirs hold copies of its experts (heirs poll every 2 s)
        wait_until(lambda: lost <= set().union(*(_heir_copies(n) for n in swarm.nodes[:3])), timeout=60)
        killed_at = dht_time()
        swarm.kill(3)
        wait_until(lambda: _adopted_all(swarm, lost, killed_at), timeout=60)
        took_over = dht_time()
        # the survivors go on: more steps and at least one more outer round each, then they leave cleanly
        wait_until(lambda: all(_rounds_since(swarm.nodes[i], took_over) for i in range(3)), timeout=120)
        codes = swarm.stop_nodes(range(3))
        assert codes == [0, 0, 0], f"exit codes {codes}"
        records = swarm.metrics()[:3]
        adoptions = [a for r in records for a in events(r, "adopted") if a["t"] > killed_at]
        taken: dict[tuple[int, int], dict] = {}
        for a in sorted(adoptions, key=lambda a: a["t"]):  # the first takeover of each expert after the kill
            taken.setdefault((a["layer"], a["expert"]), a)
        assert set(taken) >= lost
        # Each heir takes its copy over at the seam that first shows it the death: the heartbeat's expiry (stretched
        # on a loaded host, ``MembershipConfig.slow_read_stretch``) is all it waits, never a hand-over's wait for a
        # final snapshot the dead owner cannot serve (``node.adopt_wait_s``, at least that long). A node's step line
        # follows its seam: its last one that still counted the victim came less than a step before the seam that
        # saw the death and began the takeover.
        takers = {eid: next(i for i, r in enumerate(records) if taken[eid] in r) for eid in lost}
        waited = {}
        for eid, i in takers.items():
            seen_alive = [s["t"] for s in steps_of(records[i]) if s["t"] < taken[eid]["t"] and s["peers"] >= 4]
            assert seen_alive, f"node {i} never counted the victim"
            waited[eid] = round(taken[eid]["t"] - seen_alive[-1], 2)
        delays = {eid: round(taken[eid]["t"] - killed_at, 2) for eid in lost}
        assert max(waited.values()) < NodeSettings().adopt_wait_s, \
            f"heirs took over {waited} s after their last step that counted the victim ({delays} s after the kill)"
        # From the heirs' copies; an expert the victim itself had taken over less than node.handover_window_s before
        # may come back from the final snapshot its releaser still serves (as new as the victim's copy; seen
        # when the assignment settled seconds before the kill).
        victim_took = {(a["layer"], a["expert"]) for a in events(read_metrics(swarm.nodes[3].metrics), "adopted")
                       if a["t"] > killed_at - NodeSettings().handover_window_s}
        assert all(taken[eid]["source"] == "heir copy"
                   or (eid in victim_took and taken[eid]["source"] == "previous owner") for eid in lost), adoptions
        for i, r in enumerate(records):
            after = [s for s in steps_of(r) if s["t"] > killed_at]
            assert len(after) >= 10, f"node {i} stopped training after the kill"
            later = [x for x in events(r, "round") if x["status"] == "ok" and x["t"] > took_over]
            # Contributions merged: a set formed before the kill may still name the victim's stale contribution,
            # left out of its merge (taken from another anchor: its blocks are not fetched).
            assert later and all(x["participants"] - x["left_out"] <= 3 for x in later), \
                f"node {i}: rounds after the kill {later}"
    finally:
        swarm.close()
    assert not swarm.leftovers(), "processes left behind"


def _heir_copies(node: NodeProcess) -> set[tuple[int, int]]:
    last = latest(read_metrics(node.metrics))
    return {(layer, e) for layer, e in last.get("heir_copies", [])} if last else set()


def _rounds_since(node: NodeProcess, since: float) -> bool:
    return any(r["status"] == "ok" and r["t"] > since for r in events(read_metrics(node.metrics), "round"))


def _adopted_all(swarm: LocalSwarm, lost: set[tuple[int, int]], since: float) -> bool:
    taken = {(a["layer"], a["expert"]) for n in swarm.nodes[:3] for a in events(read_metrics(n.metrics), "adopted")
             if a["t"] > since}
    return taken >= lost


def test_stop_and_resume_restores_the_state_exactly(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id="swarmresume", node_args=NODE_ARGS)
    ckpt = tmp_path / "ckpt"
    try:
        swarm.start_bootstrap()
        swarm.add_node("--steps", "12", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5")
        assert swarm.wait(180)
        assert swarm.nodes[0].process.returncode == 0
        saved = events(read_metrics(swarm.nodes[0].metrics), "checkpoint")[-1]
        assert saved["step"] == 12
        swarm.add_node("--steps", "3", "--checkpoint-dir", str(ckpt), "--resume", "latest", index=0)
        assert swarm.wait(180)
        records = read_metrics(swarm.nodes[0].metrics)
        resumed = events(records, "resumed")[-1]
        assert resumed["step"] == 12
        assert resumed["state_hash"] == saved["state_hash"]
        assert steps_of(records)[-1]["step"] == 15
        # The newest checkpoint damaged (a save cut short): --resume latest takes the previous sound one, and says so.
        newest = ckpt / "step-000000015" / "shared.safetensors"
        newest.write_bytes(newest.read_bytes()[:100])
        swarm.add_node("--steps", "1", "--checkpoint-dir", str(ckpt), "--resume", "latest", index=0)
        assert swarm.wait(180) and swarm.nodes[0].process.returncode == 0, swarm.describe()
        resumed = events(read_metrics(swarm.nodes[0].metrics), "resumed")[-1]
        assert resumed["step"] == 12 and resumed["state_hash"] == saved["state_hash"]
        assert "skipped step-000000015" in swarm.nodes[0].log.read_text() and "resuming from step-000000012" in \
            swarm.nodes[0].log.read_text()
    finally:
        swarm.close()
    assert not swarm.leftovers(), "processes left behind"


def test_a_swarm_started_again_in_the_same_folder_reads_only_its_own_files(tmp_path: Path) -> None:
    stale_join = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQMeeqkDeMWWHRcouSnN8REbEvXLVTux8BdjBfgdf7NX9"
    (tmp_path / "bootstrap.log").write_text(f"Others join with:\n\n  --initial-peers {stale_join}\n")
    (tmp_path / "node-0").mkdir()
    (tmp_path / "node-0" / "metrics.jsonl").write_text('{"t": 1.0, "kind": "step", "step": 500, "loss": 9.9}\n')
    swarm = LocalSwarm(tmp_path, run_id="swarmagain", node_args=NODE_ARGS)
    try:
        assert swarm.start_bootstrap() != stale_join
        node = swarm.add_node("--steps", "2")
        assert swarm.wait(180) and node.process.returncode == 0, f"see {node.log}"
        assert [s["step"] for s in steps_of(read_metrics(node.metrics))] == [1, 2]
    finally:
        swarm.close()
    assert not swarm.leftovers(), "processes left behind"


def test_more_composers_than_experts_all_train_and_the_one_owning_none_takes_an_expert_when_an_owner_leaves(
        tmp_path: Path) -> None:
    """Three composers and two experts: one owns none. It trains too (the shared groups, every expert through its
    surrogate), and when an owner leaves the two left own one expert each, every moved expert taken over from a
    copy (the assignment of the smaller view may also swap the survivor's expert: ``dht/shards.py``, Movement)."""
    small = ["--set", "model.n_layers=1", "--set", "model.n_experts=2", "--set", "model.top_k=1"]
    swarm = LocalSwarm(tmp_path, run_id="crowded", node_args=[*NODE_ARGS, *small])
    try:
        swarm.start_bootstrap()
        nodes = [swarm.add_node("--min-peers", "3") for _ in range(3)]
        wait_until(lambda: all(n.step >= 5 for n in nodes), timeout=150, explain=swarm.describe)
        held = [shard_at(read_metrics(n.metrics), dht_time()) for n in nodes]
        idle = [i for i, h in enumerate(held) if not h]
        assert len(idle) == 1 and sorted(e for h in held for e in h) == [(0, 0), (0, 1)], held
        leaving = next(i for i, h in enumerate(held) if h)
        left_at = dht_time()
        assert swarm.stop_node(leaving) == 0
        survivors = [n for i, n in enumerate(nodes) if i != leaving]

        def one_each() -> bool:
            shards = [shard_at(read_metrics(n.metrics), dht_time()) for n in survivors]
            return all(len(s) == 1 for s in shards) and sorted(e for s in shards for e in s) == [(0, 0), (0, 1)]

        wait_until(one_each, timeout=60, explain=swarm.describe)
        heir = nodes[idle[0]]
        step = heir.step
        wait_until(lambda: heir.step > step + 3, timeout=60, explain=swarm.describe)
        adoptions = [a for n in survivors for a in events(read_metrics(n.metrics), "adopted") if a["t"] > left_at]
        assert adoptions and all(a["source"] != "init" for a in adoptions), adoptions
    finally:
        swarm.close()
    assert not swarm.leftovers(), "processes left behind"
