"""The answer to "which identity are you?": valid only for its question (nonce) and the peer id it was asked at."""

from __future__ import annotations

import msgpack

from parallax.node.net.whoami import WHOAMI_DOMAIN, read_answer, whoami_payload
from parallax.protocol.identity import Identity


def test_an_answer_counts_only_for_its_nonce_and_peer_id() -> None:
    alice = Identity.from_seed(b"a" * 32)
    nonce = bytes(range(32))
    answer = msgpack.packb([alice.public_key, alice.sign(WHOAMI_DOMAIN, whoami_payload(nonce, "QmPeer"))])
    assert read_answer(answer, nonce, "QmPeer") == alice.public_key
    assert read_answer(answer, bytes(32), "QmPeer") is None  # a replayed answer to another question
    assert read_answer(answer, nonce, "QmOther") is None  # an answer given at another peer id
    for junk in (b"", b"\xc1", msgpack.packb([b"x", b"y"]), msgpack.packb("text")):
        assert read_answer(junk, nonce, "QmPeer") is None
