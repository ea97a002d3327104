"""Blocks of a contribution fetched alone over real hivemind peers, each checked against the root its sender signed."""

from __future__ import annotations

import pytest
import torch

from parallax.node.outer.blocks import BlockMismatch, block_layout, encode_blocks
from parallax.node.outer.transport import OuterGather, RoundEntry
from parallax.protocol.errors import RemoteProtocolError

pytestmark = pytest.mark.timeout(120)

SHAPES = {"emb": (512, 64), "w": (64, 512)}  # 65,536 entries: 4 blocks


def _body(seed: int):
    g = torch.Generator().manual_seed(seed)
    return encode_blocks({name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}, "int4")


def test_a_range_of_blocks_is_fetched_alone_and_a_block_not_signed_is_refused(
        gathers: tuple[OuterGather, OuterGather]) -> None:
    served, fetcher = gathers
    count = len(block_layout(SHAPES))
    peer = str(served.p2p.peer_id)
    body = _body(0)
    served.store.put("backbone", 5, body)
    entry = RoundEntry(5, body.digest, body.size, 10.0)
    got = fetcher.fetch_blocks(peer, "backbone", 5, body.digest, body.size, [1, 3], count, timeout_s=20)
    assert got.blobs == {1: body.blobs[1], 3: body.blobs[3]}
    assert fetcher.bytes_fetched < body.size  # a range, not the body
    assert served.store.served("backbone", 5)

    with pytest.raises(RemoteProtocolError):  # past the body's blocks: not held
        fetcher.fetch_blocks(peer, "backbone", 5, body.digest, body.size, [count], count + 1, timeout_s=20)
    with pytest.raises(RemoteProtocolError):  # a whole-body fetch of a body held in blocks: not held
        fetcher.fetch(peer, "backbone", entry, timeout_s=20)

    served.store.put("backbone", 6, _body(1))  # serves another body than the one its entry signs
    with pytest.raises(BlockMismatch) as e:
        fetcher.fetch_blocks(peer, "backbone", 6, body.digest, body.size, [2], count, timeout_s=20)
    assert e.value.peer == peer
