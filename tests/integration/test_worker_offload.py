"""Networked worker offload end to end: a `parallax node join` composer with offload on and a `parallax worker
join` process, both real processes on loopback. The worker's results are applied, the loss falls, and after
the worker is SIGKILLed the composer takes its experts back and keeps training; a second worker started with
other offload settings is never used."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from parallax.dht.testing import wait_until
from parallax.node.peer.local_swarm import LocalSwarm, read_metrics
from parallax.node.peer.processes import kill_group

pytestmark = pytest.mark.timeout(420)

PERIODS = '{"router": 5, "latent": 10, "backbone": 10}'
NODE_ARGS = ["--preset", "tiny", "--set", f"sync.periods={PERIODS}", "--set", "surrogate.refresh_every=10",
             "--set", "offload.enabled=true", "--snapshot-every", "10"]


def _steps(path: Path) -> list[dict]:
    return [r for r in read_metrics(path) if r.get("kind") == "step"]


def _events(path: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(path) if r.get("kind") == kind]


@pytest.mark.slow
def test_a_worker_trains_the_composers_experts_and_its_death_costs_nothing(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id="offload1", node_args=NODE_ARGS)
    try:
        swarm.start_bootstrap()
        worker = swarm.add_worker()
        other = swarm.add_worker("--set", "offload.worker_lr=0.01")  # not the composers' settings: never used
        for w in (worker, other):
            wait_until(lambda w=w: bool(_events(w.metrics, "worker_started")), 90)
        worker_id, other_id = (_events(w.metrics, "worker_started")[0]["peer_id"] for w in (worker, other))
        node = swarm.add_node()
        # 40 steps of results for all 8 experts of the tiny preset (the only composer owns them all).
        wait_until(lambda: (s := _steps(node.metrics)) and s[-1].get("offload_applied", 0) >= 8 * 40, 240)
        steps = _steps(node.metrics)
        onboarded = _events(node.metrics, "offload_onboarded")
        assert {tuple(e["expert"]) for e in onboarded} == {(layer, e) for layer in range(2) for e in range(4)}
        assert {e["worker"] for e in onboarded} == {worker_id}
        assert [e["worker"] for e in _events(node.metrics, "offload_worker_mismatch")] == [other_id]
        offloaded = [r for r in steps if r["offloaded"] == 8]
        assert len(offloaded) >= 40
        first, last = (sum(r["loss"] for r in rs) / len(rs) for rs in (offloaded[:5], offloaded[-5:]))
        assert last < first, (first, last)  # the loss keeps falling while the worker trains every expert
        # offload.wait_s (default): the composer waits for each step's answers, so none is applied late.
        assert steps[-1]["offload_lateness"] < 0.5 and steps[-1]["offload_waited_s"] > 0, steps[-1]
        kill_group(worker.process, signal.SIGKILL)  # the machine dies: no deathrattle
        worker.process.wait(10)
        killed_at = steps[-1]["step"]
        # Within one sync period (10 steps) plus the request timeout the composer falls back.
        wait_until(lambda: bool(_events(node.metrics, "offload_fallback")), 60)
        fallback = _events(node.metrics, "offload_fallback")[0]
        wait_until(lambda: _steps(node.metrics)[-1]["step"] >= fallback["step"] + 10, 120)
        after = _steps(node.metrics)
        assert after[-1]["offloaded"] == 0 and node.alive  # the live worker with other settings took nothing
        assert fallback["step"] - killed_at <= 10 + 60, (killed_at, fallback)
    finally:
        swarm.close()
