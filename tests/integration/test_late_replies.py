"""A reply that lands on a call its caller gave up on leaves the node's P2P handle answering later calls.

Two real hivemind peers on loopback. The caller's event loop is held while the reply reaches its daemon
connection, then the call is cancelled in the same turn of the loop that reads the reply: hivemind 1.1.12 sets
the reply on the cancelled call's future, which raises in its one reader of the connection.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import time
import typing

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from parallax.dht.testing import LocalSwarm, fixed_identity
from parallax.node.net.network import NetworkLoop

pytestmark = pytest.mark.timeout(120)

ECHO = "parallax.late-replies.echo"
ANSWER_S = 20.0
SWEEPS = 10
"""The turns of the loop between the reply and the cancellation are swept this many times at most, until a reply
lands on a call given up on: whether one does depends on when the reader's wake-up comes, which a busy machine
moves."""


async def _echo(request: runtime_pb2.ExpertRequest, context: object) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=request.uid.encode())


async def _call(p2p: object, peer: PeerID, uid: str) -> runtime_pb2.ExpertResponse:
    return await p2p.call_protobuf_handler(  # type: ignore[attr-defined]
        peer, ECHO, runtime_pb2.ExpertRequest(uid=uid), runtime_pb2.ExpertResponse)


def _hold_until_a_whole_message_waits(connection: typing.Any) -> None:
    """Block (the caller's event loop with it) until a whole length-prefixed message waits unread on ``connection``
    (asyncio's wrapper of the daemon connection's socket: peeked through a duplicate of it)."""
    deadline = time.monotonic() + ANSWER_S
    with socket.fromfd(connection.fileno(), connection.family, connection.type) as peek:
        while True:
            assert select.select([peek], [], [], max(0.0, deadline - time.monotonic()))[0], \
                "no whole reply reached the daemon connection"
            if _framed_length(peek.recv(1 << 16, socket.MSG_PEEK)) is not None:
                return
            time.sleep(0.001)


def _framed_length(waiting: bytes) -> int | None:
    """The length of the message at the head of ``waiting`` with its varint prefix, when all of it is there."""
    length = 0
    for i, byte in enumerate(waiting):
        length |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            whole = i + 1 + length
            return whole if len(waiting) >= whole else None
    return None


async def _give_up_as_the_reply_is_read(p2p: object, peer: PeerID, turns: int) -> None:
    """Cancel a call after its reply reached this process's daemon connection, ``turns`` turns of the loop later
    (two puts the reader's wake-up ahead of the cancelled call's own)."""
    control = p2p._client.control  # type: ignore[attr-defined]
    connection = control._write_task.get_coro().cr_frame.f_locals["writer"].get_extra_info("socket")
    call = asyncio.create_task(_call(p2p, peer, "late"))
    for _ in range(3):  # the request is written to the daemon
        await asyncio.sleep(0)
    _hold_until_a_whole_message_waits(connection)  # holds the loop: the reply waits unread
    for _ in range(turns):
        await asyncio.sleep(0)
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await asyncio.sleep(0.05)  # the reader's turn has come and gone
    assert not control._read_task.done(), f"the daemon connection's reader ended: {control._read_task!r}"
    answer = await asyncio.wait_for(_call(p2p, peer, f"after {turns}"), ANSWER_S)
    assert answer.metadata == f"after {turns}".encode()


def test_a_reply_to_a_call_given_up_on_leaves_later_calls_answered(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="parallax.dht.adapter"), LocalSwarm("late-replies") as swarm:
        server, client = swarm.add_dht(fixed_identity(0)), swarm.add_dht(fixed_identity(1))
        loops = [NetworkLoop(server.dht, "server"), NetworkLoop(client.dht, "client")]
        try:
            loops[0].run(loops[0].p2p.add_protobuf_handler(ECHO, _echo, runtime_pb2.ExpertRequest), ANSWER_S)
            peer = PeerID.from_base58(server.dht.peer_id)
            assert loops[1].run(_call(loops[1].p2p, peer, "first"), ANSWER_S).metadata == b"first"
            for _ in range(SWEEPS):
                for turns in range(4):
                    loops[1].run(_give_up_as_the_reply_is_read(loops[1].p2p, peer, turns), 3 * ANSWER_S)
                if _dropped(caplog):
                    break
        finally:
            for loop in loops:
                loop.close()
    assert _dropped(caplog), f"no reply landed on a call given up on in {SWEEPS} sweeps: the race was not met"


def _dropped(caplog: pytest.LogCaptureFixture) -> bool:
    return any("a reply to a call given up on is dropped" in r.getMessage() for r in caplog.records)
