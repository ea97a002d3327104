"""Swarms on a network lab: hosts in Linux network namespaces on one bridge, links capped with tbf, cut and healed.

Each test builds its own lab (``node/peer/netlab.py``) and deletes it in its fixture, processes first; without root
or network namespaces the tests are skipped with the reason.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from parallax.dht.testing import wait_until
from parallax.node.peer.local_swarm import LocalSwarm, latest, read_metrics
from parallax.node.peer.netlab import NetLab, NetLabError, check_rate, unavailable

pytestmark = pytest.mark.timeout(600)

PERIODS = '{"router": 5, "latent": 10, "backbone": 10}'
NODE_ARGS = ["--preset", "tiny", "--set", f"sync.periods={PERIODS}", "--set", "surrogate.refresh_every=5",
             "--snapshot-every", "10"]


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


@pytest.mark.slow
def test_four_hosts_on_50_mbit_links_train_and_merge(lab: NetLab, tmp_path: Path) -> None:
    hosts = [lab.add_host(f"h{i}", rate="50mbit") for i in range(4)]
    swarm = LocalSwarm(tmp_path, run_id="lab4", node_args=NODE_ARGS, hosts=hosts)
    try:
        swarm.start_bootstrap()
        for _ in range(4):
            swarm.add_node("--min-peers", "4", "--steps", "120")
        wait_until(lambda: all(not n.alive for n in swarm.nodes), timeout=480)
        for i, node in enumerate(swarm.nodes):
            assert node.process.returncode == 0, f"node {i} failed; see {node.log}"
            records = read_metrics(node.metrics)
            losses = [r["loss"] for r in records if r.get("kind") == "step"]
            assert len(losses) >= 100, f"node {i} trained {len(losses)} steps"
            assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10, f"node {i}: loss did not fall"
            rounds = latest(records)["rounds_ok"]
            assert all(n >= 3 for n in rounds.values()), f"node {i} completed rounds {rounds}"
            # It talked to its peers at their lab addresses, not over this machine's loopback.
            said = node.log.read_text(errors="replace")
            assert hosts[i].address in said, f"node {i} did not listen on {hosts[i].address}"
    finally:
        swarm.close()
