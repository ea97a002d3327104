"""A real `parallax worker join` process on loopback: it announces itself as a worker, answers onboard and
update requests from a composer peer, and once SIGKILLed its requests fail and its heartbeat expires."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from parallax.dht.membership import read_view
from parallax.dht.testing import LocalSwarm, fixed_identity, wait_until
from parallax.node.config import train as config
from parallax.node.model.sketch import Sketch
from parallax.node.model.transformer import SwiGLU
from parallax.node.offload.exchange import OffloadClient, sketch_message
from parallax.node.offload.proxy import encode_tensors
from parallax.node.peer.local_swarm import read_metrics
from parallax.node.peer.processes import kill_group, spawn, stop

RUN = "wproc"
CFG = config.TrainConfig(model=config.preset("tiny"), offload=config.OffloadConfig(enabled=True))
EID = (1, 0)


def _workers(dht) -> dict[str, tuple[float, bytes]]:
    """Live workers: peer id -> (capacity, identity key)."""
    view = read_view(dht, RUN, timeout_s=3.0)
    return {} if view is None else {m.heartbeat.peer_id: (m.heartbeat.capacity, m.public_key)
                                    for m in view.alive().values() if m.heartbeat.role == "worker"}


def _status(url: str) -> dict:
    with urllib.request.urlopen(url + "status", timeout=10) as r:
        return json.loads(r.read())


def test_worker_process_serves_then_dies(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    metrics = tmp_path / "worker.jsonl"
    proc = None
    p2p = None
    with LocalSwarm(RUN) as swarm:
        try:
            composer = swarm.add_dht(fixed_identity(1))
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            with (tmp_path / "worker.log").open("ab") as log:
                proc = spawn([sys.executable, "-m", "parallax.cli", "worker", "join", "--cpu", "--loopback",
                              "--no-supervise", "--run-id", RUN, "--identity", str(tmp_path / "worker.key"),
                              "--capacity", "2.5", "--initial-peers", composer.dht.visible_maddrs()[0],
                              "--metrics", str(metrics)],
                             env=env, stdout=log)
            wait_until(lambda: len(_workers(composer.dht)) == 1, 90)
            # Its heartbeat is visible before start() returns (it reads the view once more), and only then is
            # "worker_started" written: wait for it here, or the SIGKILL below can come first on a loaded machine.
            wait_until(lambda: any(r.get("kind") == "worker_started" for r in read_metrics(metrics)), 30)
            (worker, (capacity, key)), = _workers(composer.dht).items()
            assert capacity == 2.5
            p2p = asyncio.run_coroutine_threadsafe(composer.dht.hivemind_dht.replicate_p2p(), loop).result(30)
            client = OffloadClient(p2p, loop, RUN, fixed_identity(1), {worker: key}.get, onboard_timeout_s=20.0,
                                   update_timeout_s=5.0)
            expert = SwiGLU(CFG.model.d_latent, CFG.model.d_expert)
            client.onboard(worker, EID, 0, encode_tensors(dict(expert.named_parameters()), "fp16")).result(30)
            L = CFG.model.d_latent
            sketch = Sketch(torch.randn(8, L), 0.01 * torch.randn(8, L), tokens=8)
            assert set(client.update(worker, sketch_message(EID, [(1, sketch)], "int8")).result(30)) == {
                n for n, _ in expert.named_parameters()}
            kill_group(proc, signal.SIGKILL)  # the machine dies: no deathrattle
            proc.wait(10)
            with pytest.raises(Exception):  # noqa: B017 - any failure: dead peer or timeout
                client.update(worker, sketch_message(EID, [(2, sketch)], "int8")).result(30)
            wait_until(lambda: not _workers(composer.dht), 30)  # its heartbeat expires
        finally:
            if proc is not None:
                stop(proc, 15.0)
                kill_group(proc, signal.SIGKILL)
            if p2p is not None:
                asyncio.run_coroutine_threadsafe(p2p.shutdown(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def test_a_worker_started_for_one_run_leaves_once_its_composers_have(tmp_path: Path) -> None:
    metrics = tmp_path / "worker.jsonl"
    proc = None
    with LocalSwarm(RUN) as swarm:
        try:
            composer = swarm.add(1)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            with (tmp_path / "worker.log").open("ab") as log:
                proc = spawn([sys.executable, "-m", "parallax.cli", "worker", "join", "--cpu", "--loopback", "--quiet",
                              "--no-supervise", "--run-id", RUN, "--identity", str(tmp_path / "worker.key"),
                              "--leave-when-idle", "3", "--initial-peers", composer.dht.visible_maddrs()[0],
                              "--metrics", str(metrics), "--status-port", "0"], env=env, stdout=log)
            wait_until(lambda: len(_workers(composer.dht)) == 1, 90)
            assert proc.poll() is None  # a composer is alive: it serves on
            # Its status page: its counters, and the composer it sees.
            url = re.search(r"http://127\.0\.0\.1:\d+/", (tmp_path / "worker.log").read_text())
            assert url is not None
            wait_until(lambda: len((_status(url.group(0))["swarm"] or {}).get("peers", [])) >= 2, 30)
            doc = _status(url.group(0))
            assert doc["node"]["counters"] == {"onboarded": 0, "updates": 0, "refused": 0}
            assert {p["role"] for p in doc["swarm"]["peers"]} == {"composer", "worker"}
            assert composer.membership is not None
            stored = composer.membership.leave("done")  # the run's last composer leaves (deathrattle)

            def explain() -> str:
                try:
                    seen = [(p["role"], p.get("fingerprint")) for p in (_status(url.group(0))["swarm"] or {})
                            .get("peers", [])]
                except Exception as e:  # the worker may be leaving
                    seen = [repr(e)]
                return (f"deathrattle stored: {stored}; peers the worker's page shows: {seen}\n"
                        + (tmp_path / "worker.log").read_text(errors="replace")[-4000:])

            wait_until(lambda: proc.poll() is not None, 60, explain=explain)
            assert proc.returncode == 0
            assert any(r.get("kind") == "idle_leave" for r in read_metrics(metrics))
            assert "Traceback" not in (tmp_path / "worker.log").read_text()
        finally:
            if proc is not None:
                stop(proc, 15.0)
                kill_group(proc, signal.SIGKILL)
