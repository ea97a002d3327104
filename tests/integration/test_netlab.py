"""Swarms on a network lab: hosts in Linux network namespaces on one bridge, links capped with tbf, cut and healed.

Each test builds its own lab (``node/peer/netlab.py``) and deletes it in its fixture, processes first; without root
or network namespaces the tests are skipped with the reason.
"""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from parallax.dht.adapter import dht_time
from parallax.dht.claims import ShardConfig
from parallax.dht.testing import wait_until
from parallax.node.config.resolve import node_defaults
from parallax.node.peer.local_swarm import LocalSwarm, latest, read_metrics
from parallax.node.peer.netlab import NetLab, NetLabError, check_rate, unavailable
from parallax.node.peer.processes import kill_group, spawn
from parallax.node.peer.runner import outer_sync_config
from parallax.node.peer.timeline import events, longest_double_ownership, shard_at

pytestmark = pytest.mark.timeout(600)

PERIODS = '{"router": 5, "latent": 10, "backbone": 10}'
NODE_ARGS = ["--preset", "tiny", "--set", f"sync.periods={PERIODS}", "--set", "surrogate.refresh_every=10",
             "--snapshot-every", "10"]


GROUPS = ("router", "latent", "backbone")


def rounds_ok(records: list[dict]) -> collections.Counter[str]:
    """Verified outer rounds per group, from a node's round events (some end after its last step record)."""
    return collections.Counter(r["group"] for r in records if r.get("kind") == "round" and r["status"] == "ok")


@pytest.fixture
def lab() -> Iterator[NetLab]:
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    with NetLab() as built:
        yield built


def _connects(lab: NetLab, source: str, target: str, port: int) -> bool:
    code = ("import socket, sys\n"
            "try:\n"
            f"    socket.create_connection(({lab.hosts[target].address!r}, {port}), timeout=1).close()\n"
            "except OSError:\n"
            "    sys.exit(1)\n")
    return subprocess.run(lab.hosts[source].argv(sys.executable, "-c", code), timeout=30).returncode == 0


def test_hosts_reach_each_other_over_the_bridge_until_cut(lab: NetLab) -> None:
    lab.add_host("a", rate="50mbit")
    lab.add_host("b", rate="50mbit")
    server = subprocess.Popen(lab.hosts["b"].argv(sys.executable, "-m", "http.server", "--bind",
                                                  lab.hosts["b"].address, "8123"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _connects(lab, "a", "b", 8123), timeout=30, interval=0.2)
        lab.cut("b")
        assert not _connects(lab, "a", "b", 8123)
        lab.heal("b")
        wait_until(lambda: _connects(lab, "a", "b", 8123), timeout=30, interval=0.2)
        # The lab's addresses are its own: this machine's loopback is not reachable from a host.
        with socket.socket() as outside:
            outside.bind(("127.0.0.1", 0))
            outside.listen()
            port = outside.getsockname()[1]
            code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
            assert subprocess.run(lab.hosts["a"].argv(sys.executable, "-c", code), capture_output=True,
                                  timeout=30).returncode != 0
    finally:
        server.terminate()
        server.wait(10)
    with pytest.raises(ValueError, match="rate"):
        check_rate("50 Mbit")


def test_a_host_behind_nat_dials_out_and_cannot_be_dialed(lab: NetLab) -> None:
    lab.add_host("a")
    try:
        lab.add_nat_host("n")
    except NetLabError as e:
        pytest.skip(str(e))
    servers = []
    try:
        for name in ("a", "n"):
            host = lab.hosts[name]
            servers.append(subprocess.Popen(host.argv(sys.executable, "-m", "http.server", "--bind", host.address,
                                                      "8123"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until(lambda: _connects(lab, "n", "a", 8123), timeout=30, interval=0.2)
        wait_until(lambda: _connects(lab, "n", "n", 8123), timeout=30, interval=0.2)  # its server is up
        assert not _connects(lab, "a", "n", 8123)
        lab.cut("n")
        assert not _connects(lab, "n", "a", 8123)
        lab.heal("n")
        wait_until(lambda: _connects(lab, "n", "a", 8123), timeout=30, interval=0.2)
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)


def _doctor(lab: NetLab, host: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = lab.hosts[host].argv(sys.executable, "-m", "parallax.cli", "doctor", "--cpu", "--host",
                                lab.hosts[host].maddr(), *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_doctor_names_a_dead_peer_and_passes_with_a_live_one(lab: NetLab, tmp_path: Path) -> None:
    lab.add_host("a")
    b = lab.add_host("b")
    dead = f"{b.maddr(4001)}/p2p/12D3KooWQMeeqkDeMWWHRcouSnN8REbEvXLVTux8BdjBfgdf7NX9"
    done = _doctor(lab, "a", "--initial-peers", dead, "--timeout", "5")
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("FAIL  peer /ip4/10.77.") and "unreachable" in line and "->" in line
               for line in lines), lines
    assert any(line.startswith("WARN  reachable: only private addresses") for line in lines), lines
    assert {line.split()[1].rstrip(":") for line in lines if line[:4] in ("OK  ", "WARN", "FAIL")} >= {
        "device", "memory", "disk", "p2pd", "reachable", "peer"}
    # A live bootstrap peer of a run: reached, and its heartbeats say the clocks agree.
    swarm = LocalSwarm(tmp_path, run_id="doc", hosts=[b])
    try:
        join = swarm.start_bootstrap("--run", "doc")
        done = _doctor(lab, "a", "--initial-peers", join, "--run-id", "doc", "--clock-s", "3")
        assert done.returncode == 0, done.stdout + done.stderr
        assert any(line.startswith("OK    peer /ip4/10.77.") for line in done.stdout.splitlines()), done.stdout
        assert any(line.startswith("OK    clock: peers' clocks are") for line in done.stdout.splitlines()), done.stdout
    finally:
        swarm.close()


def _four_composers(swarm: LocalSwarm, merged: int = 4) -> None:
    """A bootstrap peer and four composers that train together until the first ``merged`` of them have trained
    150 steps and completed three verified rounds of every group (a fixed number of tiny steps can end within a
    few rounds' time on a fast host), then leave; each must exit cleanly."""
    swarm.start_bootstrap()
    for _ in range(4):
        swarm.add_node("--min-peers", "4")

    def done() -> bool:
        records = [read_metrics(n.metrics) for n in swarm.nodes[:merged]]
        return all(sum(1 for r in rs if r.get("kind") == "step") >= 150
                   and all(rounds_ok(rs)[g] >= 3 for g in GROUPS) for rs in records)

    wait_until(done, timeout=480, explain=swarm.describe)
    codes = swarm.stop_nodes()
    assert codes == [0] * 4, f"exit codes {codes}; see {[str(n.log) for n in swarm.nodes]}"


@pytest.mark.slow
def test_four_hosts_train_and_merge_and_one_on_a_5_mbit_link_stalls_none_of_the_others_rounds(
        lab: NetLab, tmp_path: Path) -> None:
    hosts = [lab.add_host(f"h{i}", rate="5mbit" if i == 3 else "50mbit") for i in range(4)]
    swarm = LocalSwarm(tmp_path, run_id="lab4", node_args=NODE_ARGS, hosts=hosts)
    budget = outer_sync_config(node_defaults("tiny", True)).round_budget_s
    try:
        _four_composers(swarm, merged=3)
        for i, node in enumerate(swarm.nodes):
            records = read_metrics(node.metrics)
            losses = [r["loss"] for r in records if r.get("kind") == "step"]
            assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10, f"node {i}: loss did not fall"
            # It talked to its peers at their lab addresses, not over this machine's loopback.
            said = node.log.read_text(errors="replace")
            assert hosts[i].address in said, f"node {i} did not listen on {hosts[i].address}"
            if i == 3:
                continue  # the 5 Mbit host: its rounds may time out; the others' must not wait for it
            assert len(losses) >= 150, f"node {i} trained {len(losses)} steps"
            rounds = rounds_ok(records)
            assert all(rounds[g] >= 3 for g in GROUPS), f"node {i} completed rounds {rounds}"
            slowest = max(r["total_s"] for r in records if r.get("kind") == "round")
            assert slowest <= budget, f"node {i}: a round took {slowest:.1f} s, over the budget of {budget:.0f} s"
    finally:
        swarm.close()


_PING = """
import sys
from parallax.dht.adapter import DHTConfig, SwarmDHT
dht = SwarmDHT.start(DHTConfig(host_maddrs=(sys.argv[1],)))
try:
    dht.ping(sys.argv[2], timeout_s=10)
except Exception as e:
    print(e)
    sys.exit(1)
finally:
    dht.shutdown()
"""


@pytest.mark.slow
def test_a_composer_behind_nat_is_reached_through_a_relay_trains_serves_and_merges(lab: NetLab,
                                                                                       tmp_path: Path) -> None:
    hosts = [lab.add_host("h0", rate="50mbit"), lab.add_host("h1", rate="50mbit")]
    try:
        hosts.append(lab.add_nat_host("n", rate="50mbit"))
    except NetLabError as e:
        pytest.skip(str(e))
    outsider = lab.add_host("c")
    swarm = LocalSwarm(tmp_path, run_id="labnat", node_args=NODE_ARGS, hosts=hosts)
    try:
        join = swarm.start_bootstrap()
        for i in range(3):
            swarm.add_node("--min-peers", "3", *(["--relay", "always"] if i == 2 else []))  # until stopped
        behind = swarm.nodes[2]
        wait_until(lambda: any(r.get("kind") == "dht_started" for r in read_metrics(behind.metrics)), timeout=120)
        announced = next(r for r in read_metrics(behind.metrics) if r.get("kind") == "dht_started")["join"].split()
        direct = next(a for a in announced if f"/ip4/{hosts[2].address}/" in a)
        relayed = f"{join}/p2p-circuit/p2p/{direct.rsplit('/p2p/', 1)[1]}"

        def reached(address: str) -> bool:  # by a peer that never talked to it
            ping = spawn(outsider.argv(sys.executable, "-c", _PING, outsider.maddr(), address),
                         stdout=subprocess.DEVNULL)
            try:
                return ping.wait(60) == 0
            except subprocess.TimeoutExpired:  # a busy machine: not reached this time
                return False
            finally:  # its DHT's p2pd too, which outlives a killed parent
                kill_group(ping)
                ping.wait(10)

        # No host can dial it directly; through its reservation at the bootstrap peer, any can.
        assert not reached(direct)
        wait_until(lambda: reached(relayed), timeout=120, interval=2.0)

        def merged(node) -> bool:  # type: ignore[no-untyped-def]
            last = latest(read_metrics(node.metrics)) or {}
            return last.get("step", 0) >= 120 and all(n >= 3 for n in last.get("rounds_ok", {"-": 0}).values())

        wait_until(lambda: all(merged(n) for n in swarm.nodes), timeout=480)
        records = read_metrics(behind.metrics)
        assert latest(records)["bytes_sent"] > 0, "it served no surrogate payload or snapshot"
        assert latest(records)["peers"] == 3
        losses = [r["loss"] for r in records if r.get("kind") == "step"]
        assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
        assert all(n.alive for n in swarm.nodes)
        codes = swarm.stop_nodes()
        assert codes == [0] * 3, f"exit codes {codes}; see {[str(n.log) for n in swarm.nodes]}"
    finally:
        swarm.close()


TINY_EXPERTS = {(layer, e) for layer in range(2) for e in range(4)}  # tiny: 2 layers x 4 experts


def _one_owner_each(records: list[list[dict]]) -> bool:
    owned = [shard_at(r, float("inf")) for r in records]
    return sum(map(len, owned)) == len(TINY_EXPERTS) and set().union(*owned) == TINY_EXPERTS


@pytest.mark.slow
def test_a_host_cut_off_trains_no_expert_twice_and_merges_back(lab: NetLab, tmp_path: Path) -> None:
    hosts = [lab.add_host(f"h{i}", rate="50mbit") for i in range(4)]
    # Rounds every few seconds, not every second: a partition is not also a storm of interrupted rounds.
    args = [*NODE_ARGS, "--set", 'sync.periods={"router": 20, "latent": 40, "backbone": 40}']
    swarm = LocalSwarm(tmp_path, run_id="labcut", node_args=args, hosts=hosts)
    lease = ShardConfig(n_layers=1, n_experts=1).lease_s
    try:
        swarm.start_bootstrap()
        for _ in range(4):
            swarm.add_node("--min-peers", "4")  # until stopped

        def trained(node, since: float = 0.0) -> bool:  # type: ignore[no-untyped-def]
            records = read_metrics(node.metrics)
            rounds = rounds_ok([r for r in records if r["t"] > since])
            return (latest(records) or {}).get("step", 0) >= 100 and all(rounds[g] >= 1 for g in GROUPS)

        wait_until(lambda: all(trained(n) for n in swarm.nodes), timeout=400)
        before = shard_at(read_metrics(swarm.nodes[3].metrics), float("inf"))
        cut_at = dht_time()
        lab.cut("h3")

        def partitioned() -> bool:  # until the others took its experts and it knew it was cut off
            records = swarm.metrics()
            taken = {(a["layer"], a["expert"]) for r in records[:3] for a in events(r, "adopted") if a["t"] > cut_at}
            return taken >= before and any(e["t"] > cut_at for e in events(records[3], "cut_off"))

        wait_until(partitioned, timeout=120, interval=0.5)
        healed_at = dht_time()
        lab.heal("h3")
        wait_until(lambda: trained(swarm.nodes[3], since=healed_at) and _one_owner_each(swarm.metrics()),
                   timeout=300, interval=1.0)
        settled_at = dht_time()
        codes = swarm.stop_nodes()
        assert codes == [0] * 4, f"exit codes {codes}; see {[str(n.log) for n in swarm.nodes]}"
        records = swarm.metrics()
        cut = records[3]
        # The cut-off host knew it: it dropped its experts, took none of the others' while cut off, and came back.
        # (Before it knew, the others' heartbeats expired one by one in its view: the first may be taken for dead.)
        knew = [e["t"] for e in events(cut, "cut_off") if cut_at < e["t"] < healed_at]
        back_at = [e["t"] for e in events(cut, "rejoined") if e["t"] > healed_at]
        assert knew and back_at, (knew, back_at)
        assert not [a for a in events(cut, "adopted") if knew[0] <= a["t"] < back_at[0]]
        assert not shard_at(cut, min(knew[0] + 1.0, back_at[0] - 0.1))  # dropped in the step it knew
        # Never two owners of one expert for longer than a claim lease, from the cut until every expert had one
        # owner again.
        longest, expert = longest_double_ownership(records, cut_at, settled_at)
        assert longest <= lease, f"expert {expert} had two owners for {longest:.1f} s (lease {lease:.0f} s)"
        # Nothing a snapshot had was lost: the others took its experts from their heir copies, and it took them
        # back from the peers that trained them meanwhile, not from its own copy from before the cut.
        adopted = [a for r in records for a in events(r, "adopted") if cut_at < a["t"] < settled_at]
        assert all(a["source"] != "init" for a in adopted), adopted
        back = [a for a in events(cut, "adopted") if healed_at < a["t"] < settled_at]
        assert back and all(a["source"] in ("previous owner", "heir copy") for a in back), (
            back, [line for line in swarm.nodes[3].log.read_text(errors="replace").splitlines() if "served" in line])
        # The others trained on through the partition.
        for i, r in enumerate(records[:3]):
            assert len([s for s in events(r, "step") if cut_at < s["t"] < healed_at]) >= 10, f"node {i} stalled"
    finally:
        swarm.close()
