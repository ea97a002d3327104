"""A private run: only peers holding a member certificate from the run's creator train in it.

Real processes: a bootstrap peer and ``parallax node join`` composers on loopback (tiny preset), started with an
``allowlist`` manifest made by ``parallax run create``; a stranger's composer refuses to start without a
certificate, and a stranger writing correctly signed heartbeats of the run's digest from a DHT peer of its own is
refused by the members' record validators: it never enters their view.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.dht.adapter import DHTConfig, SwarmDHT
from parallax.dht.claims import ShardConfig
from parallax.dht.keys import protected_keys
from parallax.dht.membership import Membership, Presence
from parallax.dht.records import Admission, Ed25519RecordValidator
from parallax.dht.testing import wait_until
from parallax.node.config.train import SHARED_GROUPS
from parallax.node.export.folder import train_config_from
from parallax.node.net.network import NetworkLoop
from parallax.node.outer.state import StateExchange
from parallax.node.peer.local_swarm import LocalSwarm, latest, read_metrics
from parallax.node.peer.runner import model_shapes
from parallax.protocol import manifest as manifests
from parallax.protocol.identity import Identity

pytestmark = pytest.mark.timeout(300)

RUN = "private"
SETS = ["--set", 'sync.periods={"router": 5, "latent": 10, "backbone": 10}']


def _cli(*args: str) -> str:
    # Bounded above the commands' own bounds: `swarm status` may start its daemon twice (30 s each) before it reads.
    done = subprocess.run([sys.executable, "-m", "parallax.cli", *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_only_certified_members_train_in_an_allowlist_run(tmp_path: Path) -> None:
    creator = tmp_path / "creator.key"
    _cli("run", "create", "--run-id", RUN, "--out", str(tmp_path / "run.json"), "--admission", "allowlist",
         "--identity", str(creator), "--preset", "tiny", *SETS)
    manifest = manifests.load_manifest(tmp_path / "run.json")
    swarm = LocalSwarm(tmp_path, run_id=RUN, node_args=["--manifest", str(tmp_path / "run.json")])
    stranger_dht = stranger = None
    try:
        swarm.start_bootstrap()
        members, member_fps = [], set()
        for i in range(2):
            key = tmp_path / f"node-{i}" / "node.key"
            key.parent.mkdir()
            Identity.generate().save(key)
            member = Identity.load(key).public_key.hex()
            _cli("run", "admit", "--manifest", str(tmp_path / "run.json"), "--member", member, "--out",
                 str(tmp_path / f"m{i}.cert"), "--identity", str(creator))
            members.append(swarm.add_node("--steps", "100000", "--member-cert", str(tmp_path / f"m{i}.cert")))
            member_fps.add(Identity.load(key).fingerprint)
        uncertified = swarm.add_node("--steps", "50")
        wait_until(lambda: not uncertified.alive, timeout=120)
        said = " ".join(uncertified.log.read_text(errors="replace").split())  # the console wraps lines
        assert uncertified.process.returncode not in (0, None)
        assert "admits only members certified by its creator" in said and "parallax run admit" in said, said[-2000:]

        def trained(node, steps: int) -> bool:
            last = latest(read_metrics(node.metrics)) or {}
            return last.get("step", 0) >= steps and last.get("peers") == 2

        wait_until(lambda: all(trained(m, 2) for m in members), timeout=150, explain=swarm.describe)
        # A stranger signs heartbeats of the run's digest, claiming a large capacity, from a DHT peer of its own.
        identity = Identity.generate()
        validator = Ed25519RecordValidator(identity, protected_keys=protected_keys(RUN, 2, SHARED_GROUPS),
                                           admission=Admission(manifest.creator, manifest.digest))
        stranger_dht = SwarmDHT.start(DHTConfig(initial_peers=(swarm.initial_peers,)), [validator])
        stranger = Membership(stranger_dht, identity, Presence(run_id=RUN, capacity=1000.0, manifest=manifest),
                              shards=ShardConfig(n_layers=2, n_experts=4))
        # Its heartbeats land on the bootstrap alone (the members refuse them): on a busy machine that takes a while.
        stranger.start(timeout_s=90)
        # Its records reach the members (the bootstrap peer stores them: it validates no run) and are refused there.
        wait_until(lambda: any("no member certificate in an allowlist run" in m.log.read_text(errors="replace")
                               for m in members), timeout=120)
        step = max(latest(read_metrics(m.metrics))["step"] for m in members)
        wait_until(lambda: all(trained(m, step + 3) for m in members), timeout=120, explain=swarm.describe)
        assert all(latest(read_metrics(m.metrics))["peers"] == 2 for m in members)
        assert all(m.alive for m in members)
        # `swarm status` with the manifest reads the run as its members do: the stranger is not listed.
        shown = json.loads(_cli("swarm", "status", "--run-id", RUN, "--initial-peers", swarm.initial_peers,
                                "--manifest", str(tmp_path / "run.json"), "--json", "--wait", "5"))
        listed = {p["fingerprint"] for p in shown["peers"]}
        assert identity.fingerprint not in listed and len(listed & member_fps) == 2, shown["peers"]
        # The members' merged shared groups are theirs: the stranger asks each of them and gets nothing.
        loop = NetworkLoop(stranger_dht, "stranger-net")
        try:
            shapes = model_shapes(train_config_from(manifest.settings_dict(), "the manifest"))
            member_peers = [m["peer_id"] for m in shown["peers"] if m["role"] == "composer"]
            states = StateExchange(loop.p2p, loop.loop, RUN, lambda: member_peers,
                                   own_peer_id=stranger_dht.peer_id).start()
            try:
                assert len(member_peers) == 2
                assert states.download("router", shapes.groups["router"], timeout_s=15) is None
            finally:
                states.close()
        finally:
            loop.close()
    finally:
        if stranger is not None:
            stranger.abandon()
        if stranger_dht is not None:
            stranger_dht.shutdown()
        swarm.close()
