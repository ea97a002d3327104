"""A node answers a request for blocks it cannot serve with an empty stream ("not held") and logs why, naming the
peer that asked (``ContributionServicer.rpc_blocks``)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from hivemind.proto import runtime_pb2

from parallax.node.outer.blocks import BlockedBody, wanted_uid
from parallax.node.outer.transport import ContributionServicer, ContributionStore


async def _answer(servicer: ContributionServicer, uid: str) -> list[bytes]:
    context = SimpleNamespace(remote_id="QmAsker")
    return [m.serialized_info async for m in servicer.rpc_blocks(runtime_pb2.ExpertRequest(uid=uid),
                                                                 context)]  # type: ignore[arg-type]


def test_blocks_not_served_are_answered_empty_with_the_reason_and_the_asker_in_the_log(caplog) -> None:
    store = ContributionStore(keep=2)
    for n in (1, 2, 3):  # round 1 is past ``keep``
        store.put("backbone", n, BlockedBody((b"a", b"b")))
    store.put("router", 4, b"whole")
    assert store.rounds("backbone") == [2, 3] and store.rounds("latent") == []
    servicer = ContributionServicer(store)
    caplog.set_level(logging.INFO, logger="parallax.node.outer.transport")
    cases = [(wanted_uid("backbone", 1, [0]), "backbone round 1: not held (rounds held: [2, 3])"),
             (wanted_uid("router", 4, [0]), "router round 4: held whole, not in blocks"),
             (wanted_uid("backbone", 3, [2]), "backbone round 3: past its 2 blocks")]
    for uid, why in cases:
        caplog.clear()
        assert asyncio.run(_answer(servicer, uid)) == []
        assert "peer QmAsker asked for blocks" in caplog.text and why in caplog.text, caplog.text
    caplog.clear()
    assert asyncio.run(_answer(servicer, "backbone/x/0")) == []  # malformed: no log line past debug
    assert caplog.text == ""
    assert b"".join(asyncio.run(_answer(servicer, wanted_uid("backbone", 3, [1]))))  # a held block is served
