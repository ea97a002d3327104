"""Local swarms of real hivemind DHT peers on loopback, shut down whatever happens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from parallax.dht.testing import LocalSwarm


@pytest.fixture
def swarm() -> Iterator[LocalSwarm]:
    s = LocalSwarm(run_id="itest", n_layers=2)
    try:
        yield s
    finally:
        s.close()
