"""The status page of a real node (``node join --status-port``) and of a whole run (``swarm status --serve``):
real ``node join`` processes on loopback, real HTTP, the page rendered by a real headless Chromium."""

from __future__ import annotations

import json
import re
import signal
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from parallax.dht.testing import wait_until
from parallax.node.peer.local_swarm import LocalSwarm, latest, read_metrics
from parallax.node.peer.processes import kill_group, spawn, stop
from parallax.protocol.identity import Identity

pytestmark = pytest.mark.timeout(300)

RUN = "watched"
NODE_ARGS = ["--preset", "tiny", "--set", 'sync.periods={"router": 5, "latent": 10, "backbone": 10}',
             "--steps", "100000"]
URL = re.compile(r"(http://127\.0\.0\.1:\d+/)")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _peers(url: str) -> set[str]:
    """The fingerprints a status page lists (none before its first read of the swarm)."""
    swarm = json.loads(_get(url + "status"))["swarm"] or {}
    return {p["fingerprint"] for p in swarm.get("peers", [])}


def _url_in(path: Path) -> str | None:
    found = URL.search(path.read_text(errors="replace")) if path.exists() else None
    return found.group(1) if found else None


def test_a_nodes_status_page_and_the_runs_page_show_the_swarm(tmp_path: Path, render_page) -> None:
    swarm = LocalSwarm(tmp_path, run_id=RUN, node_args=NODE_ARGS)
    watcher = None
    try:
        swarm.start_bootstrap()
        # The whole run's page, from the DHT alone: its reader starts beside the nodes.
        log = tmp_path / "watcher.log"
        with log.open("wb") as out:
            watcher = spawn([sys.executable, "-m", "parallax.cli", "swarm", "status", "--run-id", RUN,
                             "--initial-peers", swarm.initial_peers, "--serve", "0", "--layers", "2", "--experts", "4"],
                            env=None, stdout=out)
        watched = swarm.add_node("--status-port", "0", "--log-to", f"tensorboard:{tmp_path / 'tb'}")
        other = swarm.add_node()
        # Both train together and hold their experts: a node that came up after the other's first steps joins
        # owning nothing and takes its experts over during its first steps.
        def settled() -> bool:
            last = [latest(read_metrics(n.metrics)) or {} for n in (watched, other)]
            return (all(s.get("peers") == 2 and s.get("step", 0) >= 5 and s.get("owned", 0) > 0 for s in last)
                    and sum(s["owned"] for s in last) == 8)  # tiny: 2 layers x 4 experts

        wait_until(settled, timeout=150, explain=swarm.describe)
        url = _url_in(watched.log)
        assert url is not None, swarm.describe()
        fingerprints = {Identity.load(tmp_path / f"node-{i}" / "node.key").fingerprint for i in range(2)}

        doc = json.loads(_get(url + "status"))
        assert doc["node"]["fingerprint"] in fingerprints and doc["node"]["step"] >= 5
        assert len(doc["node"]["owned_experts"]) == doc["node"]["owned"] > 0
        assert doc["history"]["own"] and doc["history"]["own"][-1][0] >= 5
        wait_until(lambda: _peers(url) == fingerprints, timeout=30)
        # /metrics reads the same counters as the metrics file: the step it shows is one the file has passed.
        families = {f.name: f for f in text_string_to_metric_families(_get(url + "metrics").decode())}
        assert families["parallax_live_composers"].samples[0].value == 2
        assert families["parallax_composers_without_work"].samples[0].value == 0  # both nodes' work arrived
        step = families["parallax_step"].samples[0].value
        assert 5 <= step <= latest(read_metrics(watched.metrics))["step"]
        assert families["parallax_owned_experts"].samples[0].value == doc["node"]["owned"]

        dom = render_page(url, screenshot=tmp_path / "page.png")  # a picture of what the DOM says, for people
        assert all(f'data-fingerprint="{fp}"' in dom for fp in fingerprints), dom[-3000:]
        owners = re.findall(r'data-owner="([^"]*)"', dom)
        assert len(owners) == 8 and set(owners) == fingerprints  # tiny: 2 layers x 4 experts, each owned once
        assert "this node" in re.findall(r'<polyline[^>]*data-series="([^"]*)"', dom)

        # The whole run's page.
        wait_until(lambda: _url_in(log) is not None or watcher.poll() is not None, timeout=60)
        run_url = _url_in(log)
        assert run_url is not None, log.read_text()
        wait_until(lambda: _peers(run_url) == fingerprints, timeout=60)
        doc = json.loads(_get(run_url + "status"))
        assert doc["node"] is None and {p["fingerprint"] for p in doc["swarm"]["peers"]} == fingerprints
        dom = render_page(run_url)
        assert "the whole swarm" in dom and all(f'data-fingerprint="{fp}"' in dom for fp in fingerprints)
        assert stop(watcher, 30) == 0  # Ctrl+C ends it cleanly
        assert "Traceback" not in log.read_text()
        watcher = None
        # Ctrl+C (SIGINT) is a graceful leave for a node: it prints no traceback, its DHT process's neither.
        assert swarm.stop_nodes() == [0, 0]
        for node in (watched, other):
            assert "Traceback" not in node.log.read_text(), node.log.read_text()[-4000:]
        # --log-to: TensorBoard got every step line of the watched node, in a folder named by its fingerprint. Its
        # first step is 1, or past 1 when the other node trained first and the watched one joined it (fast-forwarded
        # to the swarm's step).
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (folder,) = (tmp_path / "tb").iterdir()
        events = EventAccumulator(str(folder))
        events.Reload()
        steps = [e.step for e in events.Scalars("loss")]
        lines = [r["step"] for r in read_metrics(watched.metrics) if r["kind"] == "step"]
        assert folder.name in fingerprints and steps == lines and len(steps) >= 5
    finally:
        if watcher is not None:
            kill_group(watcher, signal.SIGKILL)
            watcher.wait(10)
        swarm.close()
