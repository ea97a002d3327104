"""A P2P stream message announcing more than the cap is refused before it is read, and the node keeps serving.

Two real hivemind peers on loopback; the attacker writes hivemind's stream framing by hand (a message marker, an
8-byte length of 256 MiB, then data) to a contribution server, then an honest fetch still works.
"""

from __future__ import annotations

import resource

import pytest

from parallax.benchmarks.attacker import announce_huge
from parallax.dht.testing import LocalSwarm, fixed_identity
from parallax.node.net.network import MAX_STREAM_MESSAGE_BYTES, NetworkLoop
from parallax.node.outer.transport import ContributionServicer, OuterGather, RoundEntry, body_digest

pytestmark = pytest.mark.timeout(120)


def test_an_oversized_stream_message_is_dropped_unread_and_the_server_keeps_serving() -> None:
    with LocalSwarm("cap") as swarm:
        server_dht, client_dht = swarm.add_dht(fixed_identity(0)).dht, swarm.add_dht(fixed_identity(1)).dht
        server, client = NetworkLoop(server_dht, "server"), NetworkLoop(client_dht, "client")
        gathers = []
        try:
            served = OuterGather(server.p2p, server.loop, "cap").start()
            fetcher = OuterGather(client.p2p, client.loop, "cap").start()
            gathers += [served, fetcher]
            handle = ContributionServicer._get_handle_name(served.namespace, "rpc_contribution")
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            answer = client.run(announce_huge(client.p2p, server_dht.hivemind_dht.peer_id, handle, 32 * 2**20), 60)
            grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
            assert answer == b"" or answer[:1] != b"\x00"  # closed, or an error reply: never a served message
            assert grown_mb < MAX_STREAM_MESSAGE_BYTES / 2**20 + 64, f"the server buffered {grown_mb:.0f} MB"
            # An honest request right after is still served.
            body = b"contribution bytes" * 100
            served.store.put("router", 3, body)
            entry = RoundEntry(3, body_digest(body), len(body), 10.0)
            assert fetcher.fetch(str(server_dht.peer_id), "router", entry, timeout_s=10) == body
        finally:
            for g in gathers:
                g.close()
            client.close()
            server.close()
