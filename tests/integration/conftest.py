"""Local swarms of real hivemind DHT peers on loopback, and pairs of contribution servers on them, shut down whatever
happens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from parallax.dht.testing import LocalSwarm, fixed_identity
from parallax.node.net.network import NetworkLoop
from parallax.node.outer.transport import OuterGather


@pytest.fixture
def swarm() -> Iterator[LocalSwarm]:
    s = LocalSwarm(run_id="itest", n_layers=2)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def gathers(swarm: LocalSwarm) -> Iterator[tuple[OuterGather, OuterGather]]:
    """(server, fetcher): the outer contribution services of two real peers, each on its own network loop."""
    loops: list[NetworkLoop] = []
    started: list[OuterGather] = []
    try:
        for seed, name in enumerate(("server", "fetcher")):
            loops.append(NetworkLoop(swarm.add_dht(fixed_identity(seed)).dht, name))
            started.append(OuterGather(loops[-1].p2p, loops[-1].loop, "pair").start())
        yield started[0], started[1]
    finally:
        for g in started:
            g.close()
        for loop in reversed(loops):
            loop.close()
