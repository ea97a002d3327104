"""A peer id claimed by two signed heartbeats belongs to the identity that proves it at that peer id.

Two real hivemind peers on loopback, each with its ``IdentityProver``; a squatter identity that has no peer of
its own claims the first peer's id.
"""

from __future__ import annotations

import pytest

from parallax.dht.testing import LocalSwarm, fixed_identity, wait_until
from parallax.node.net.network import NetworkLoop
from parallax.node.net.whoami import IdentityProver
from parallax.protocol.identity import Identity

pytestmark = pytest.mark.timeout(120)


def test_the_identity_at_the_peer_id_proves_it_and_a_squatter_cannot() -> None:
    squatter = Identity.from_seed(b"s" * 32)
    with LocalSwarm("whoami") as swarm:
        a, b = swarm.add_dht(fixed_identity(0)), swarm.add_dht(fixed_identity(1))
        loops = [NetworkLoop(a.dht, "a"), NetworkLoop(b.dht, "b")]
        provers = []
        try:
            for peer, loop in zip((a, b), loops, strict=True):
                provers.append(IdentityProver(loop.p2p, loop.loop, "whoami", peer.identity, peer.dht.peer_id).start())
            victim_id = a.dht.peer_id
            claimants = [squatter.public_key, a.identity.public_key]
            assert provers[1].proven(victim_id, claimants) is None  # asked in the background, never blocks
            wait_until(lambda: provers[1].proven(victim_id, claimants) == a.identity.public_key, timeout=20)
            assert provers[1].proven(victim_id, [squatter.public_key]) is None  # the proof names the victim only
        finally:
            for p in provers:
                p.close()
            for loop in loops:
                loop.close()
