"""``parallax swarm status`` against real hivemind peers on loopback, through Typer's CliRunner.

The command starts its own client-mode DHT node in this process and shuts it down before it returns;
the swarm fixture shuts the peers down whatever happens.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from parallax.cli.main import app
from parallax.dht.adapter import DHTConfig, SwarmDHT
from parallax.dht.claims import ShardConfig
from parallax.dht.membership import read_view
from parallax.dht.testing import LocalSwarm, wait_until

SHARDS = ShardConfig(n_layers=2, n_experts=6)
runner = CliRunner(env={"COLUMNS": "400"})


def _settled(swarm: LocalSwarm, n_peers: int) -> bool:
    """Every live heartbeat read from the DHT announces its final share: disjoint and complete."""
    view = read_view(swarm.peers[0].dht, swarm.run_id, timeout_s=3.0)
    if view is None or len(view.alive()) != n_peers:
        return False
    announced = [s for m in view.alive().values() for s in m.heartbeat.shards]
    return sorted(announced) == [(layer, e) for layer in range(SHARDS.n_layers) for e in range(SHARDS.n_experts)]


def _status(swarm: LocalSwarm, *args: str):
    peers = swarm.peers[0].dht.visible_maddrs()
    argv = ["swarm", "status", "--run-id", swarm.run_id, "--initial-peers", ",".join(peers), *args]
    return runner.invoke(app, argv)


def test_status_lists_live_peers_and_a_complete_disjoint_ownership(swarm: LocalSwarm):
    composers = [swarm.add(i, shards=SHARDS) for i in range(2)]
    worker = swarm.add(2, shards=SHARDS, role="worker")
    composers[0].membership.update(step=42, loss=2.5, versions={"held": 3, "max": 9})
    wait_until(lambda: _settled(swarm, 3), timeout=15)
    wait_until(lambda: (m := composers[0].membership.view().alive().get(composers[0].fp)) is not None
               and m.heartbeat.step == 42, timeout=10)

    result = _status(swarm, "--json", "--layers", "2", "--experts", "6")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    peers = {p["fingerprint"]: p for p in data["peers"]}
    assert set(peers) == {p.fp for p in swarm.peers}
    assert {fp: p["role"] for fp, p in peers.items()} == {
        composers[0].fp: "composer", composers[1].fp: "composer", worker.fp: "worker"}
    assert peers[worker.fp]["experts"] == {}
    me = peers[composers[0].fp]
    assert me["step"] == 42 and me["loss"] == 2.5 and me["versions"] == {"held": 3, "max": 9}
    assert me["peer_id"] == composers[0].dht.peer_id and 0 <= me["heartbeat_age_s"] <= 6.5
    for c in composers:  # what each composer owns, as the DHT says, is what its announcer owns
        owned = {str(layer): sorted(es) for layer, es in c.membership.owned().items()}
        assert peers[c.fp]["experts"] == owned and peers[c.fp]["n_experts"] > 0
    assert data["n_experts"] == 6 and not data["shape_inferred"]
    assert [lo["layer"] for lo in data["layers"]] == [0, 1]
    for lo in data["layers"]:
        assert lo["unowned"] == [] and lo["contested"] == []
        assert all(len(o) == 1 and o[0] in {c.fp for c in composers} for o in lo["owners"])

    table = _status(swarm)
    assert table.exit_code == 0, table.output
    for p in swarm.peers:
        assert p.fp in table.stdout
    assert "3 live peer(s)" in table.stdout and "expert ownership" in table.stdout

    # A graceful leave: gone from the peers, listed as departed, its experts unowned until reassigned.
    assert composers[1].membership.leave("test over")
    after = json.loads(_status(swarm, "--json").stdout)
    assert composers[1].fp not in {p["fingerprint"] for p in after["peers"]}
    assert [d["fingerprint"] for d in after["departed"]] == [composers[1].fp]
    assert after["departed"][0]["reason"] == "test over"


def test_status_of_a_run_nobody_is_in(swarm: LocalSwarm):
    swarm.add(0, shards=SHARDS)
    result = _status_of(swarm, "nobody-here")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["peers"] == []
    assert "no live peers in run 'nobody-here'" in result.stderr and "Check the run id" in result.stderr


def _status_of(swarm: LocalSwarm, run_id: str):
    peers = swarm.peers[0].dht.visible_maddrs()
    return runner.invoke(app, ["swarm", "status", "--run-id", run_id, "--initial-peers", peers[0], "--json",
                               "--wait", "1"])


def test_status_of_an_unreachable_swarm_says_so():
    gone = SwarmDHT.start(DHTConfig())
    try:
        address = gone.visible_maddrs()[0]
    finally:
        gone.shutdown()
    result = runner.invoke(app, ["swarm", "status", "--run-id", "r1", "--initial-peers", address,
                                 "--startup-timeout", "5"])
    assert result.exit_code == 1
    assert "the swarm is unreachable" in result.stderr and "reachable from here" in result.stderr
    assert result.stdout == ""
