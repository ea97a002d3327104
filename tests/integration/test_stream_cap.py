"""A P2P stream message announcing more than the cap is refused before it is read, and the node keeps serving.

Two real hivemind peers on loopback; the attacker writes hivemind's stream framing by hand (a message marker, an
8-byte length of 256 MiB, then data) to a contribution server, then an honest fetch still works.
"""

from __future__ import annotations

import asyncio
import resource

import pytest

from parallax.benchmarks.attacker import announce_huge
from parallax.node.net.network import MAX_STREAM_MESSAGE_BYTES
from parallax.node.outer.transport import ContributionServicer, OuterGather, RoundEntry, body_digest

pytestmark = pytest.mark.timeout(120)


def test_an_oversized_stream_message_is_dropped_unread_and_the_server_keeps_serving(
        gathers: tuple[OuterGather, OuterGather]) -> None:
    served, fetcher = gathers
    handle = ContributionServicer._get_handle_name(served.namespace, "rpc_contribution")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    answer = asyncio.run_coroutine_threadsafe(
        announce_huge(fetcher.p2p, served.p2p.peer_id, handle, 32 * 2**20), fetcher.loop).result(60)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert answer == b"" or answer[:1] != b"\x00"  # closed, or an error reply: never a served message
    assert grown_mb < MAX_STREAM_MESSAGE_BYTES / 2**20 + 64, f"the server buffered {grown_mb:.0f} MB"
    # An honest request right after is still served.
    body = b"contribution bytes" * 100
    served.store.put("router", 3, body)
    entry = RoundEntry(3, body_digest(body), len(body), 10.0)
    assert fetcher.fetch(str(served.p2p.peer_id), "router", entry, timeout_s=10) == body
