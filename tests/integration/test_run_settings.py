"""A composer started with other run settings is refused by its own node and ignored by the run's nodes.

Real processes: a bootstrap peer and ``parallax node join`` composers on loopback (tiny preset).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parallax.dht.testing import wait_until
from parallax.node.peer.local_swarm import LocalSwarm, latest, read_metrics

pytestmark = pytest.mark.timeout(300)

NODE_ARGS = ["--preset", "tiny", "--set", 'sync.periods={"router": 5, "latent": 10, "backbone": 10}']


def test_a_composer_with_another_learning_rate_is_refused_and_the_run_goes_on(tmp_path: Path) -> None:
    swarm = LocalSwarm(tmp_path, run_id="settings", node_args=NODE_ARGS)
    try:
        swarm.start_bootstrap()
        honest = swarm.add_node("--steps", "100000")
        wait_until(lambda: honest.step >= 2, timeout=150)
        stranger = swarm.add_node("--steps", "50", "--set", "optim.lr=0.001")
        wait_until(lambda: not stranger.alive, timeout=120)
        assert stranger.process.returncode not in (0, None)
        said = stranger.log.read_text(errors="replace")
        assert "trains with other settings than this node" in said and "optim.lr = 0.001 here" in said, said[-2000:]
        # The run's node named it, kept every expert, and keeps training.
        wait_until(lambda: "ignoring composer" in honest.log.read_text(errors="replace"), timeout=30)
        assert "optim.lr = 0.003 here, 0.001 there" in honest.log.read_text(errors="replace")
        step = latest(read_metrics(honest.metrics))["step"]
        wait_until(lambda: latest(read_metrics(honest.metrics))["step"] > step + 2, timeout=60)
        assert honest.alive
    finally:
        swarm.close()
