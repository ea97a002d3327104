"""A node answers a request for blocks it cannot serve with an empty stream ("not held"), counts it as no serving,
and logs why where it names a fault, naming the peer that asked (``ContributionServicer.rpc_blocks``)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from hivemind.proto import runtime_pb2

import parallax.node.outer.transport as transport
from parallax.node.outer.blocks import BlockedBody, wanted_uid
from parallax.node.outer.transport import ContributionServicer, ContributionStore


async def _answer(servicer: ContributionServicer, uid: str) -> list[bytes]:
    context = SimpleNamespace(remote_id="QmAsker")
    return [m.serialized_info async for m in servicer.rpc_blocks(runtime_pb2.ExpertRequest(uid=uid),
                                                                 context)]  # type: ignore[arg-type]


def _store() -> ContributionStore:
    store = ContributionStore(keep=2)
    for n in (1, 2, 3):  # round 1 is past ``keep``
        store.put("backbone", n, BlockedBody((b"a", b"b")))
    store.put("router", 4, b"whole")
    return store


def test_blocks_not_served_are_answered_empty_and_a_fault_is_logged_with_the_reason_and_the_asker(
        caplog, monkeypatch) -> None:
    monkeypatch.setattr(transport, "_UNSERVED_LOG_S", 0.0)
    store = _store()
    assert store.rounds("backbone") == [2, 3] and store.rounds("latent") == []
    servicer = ContributionServicer(store)
    caplog.set_level(logging.INFO, logger="parallax.node.outer.transport")
    cases = [(wanted_uid("backbone", 7, [0]), "of 'backbone' round 7: not held (rounds held: [2, 3])"),
             (wanted_uid("router", 4, [0]), "of 'router' round 4: held whole, not in blocks"),
             (wanted_uid("backbone", 3, [1, 2]), "2 blocks (1-2) of 'backbone' round 3: past its 2 blocks"),
             (wanted_uid("back\nbone", 1, [0]), "of 'back\\nbone' round 1: not held")]  # shown escaped
    for uid, why in cases:
        caplog.clear()
        assert asyncio.run(_answer(servicer, uid)) == []
        assert "peer QmAsker asked for" in caplog.text and why in caplog.text, caplog.text
    for uid in (wanted_uid("backbone", 1, [0]), "backbone/x/0"):  # withdrawn or past ``keep``; malformed
        caplog.clear()
        assert asyncio.run(_answer(servicer, uid)) == []
        assert caplog.text == ""
    assert not any(store.served("backbone", n) for n in (2, 3)) and not store.served("router", 4)
    assert b"".join(asyncio.run(_answer(servicer, wanted_uid("backbone", 3, [1]))))  # a held block is served
    assert store.served("backbone", 3)


def test_requests_answered_empty_are_logged_at_most_once_a_period_and_the_others_counted(caplog) -> None:
    servicer = ContributionServicer(_store())
    caplog.set_level(logging.INFO, logger="parallax.node.outer.transport")
    for _ in range(5):
        asyncio.run(_answer(servicer, wanted_uid("router", 4, [0])))
    assert caplog.text.count("asked for") == 1
    servicer._unserved_quiet_until = 0.0  # the period is over
    caplog.clear()
    asyncio.run(_answer(servicer, wanted_uid("router", 4, [0])))
    assert "; 4 such requests not logged before it" in caplog.text, caplog.text
