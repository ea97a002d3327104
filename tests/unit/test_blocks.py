"""A contribution in blocks: cut from the shapes alone, any block checkable alone against the signed root."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from parallax.node.outer.blocks import (
    MAX_BLOCKS,
    BlockedBody,
    BlockMismatch,
    assemble,
    block_count,
    block_layout,
    check_answer,
    decode_block,
    encode_blocks,
    parse_wanted,
    wanted_uid,
)
from parallax.node.outer.transport import decode_contribution, encode_contribution
from parallax.protocol.errors import MalformedMessage

SHAPES = {"emb": (300, 128), "w": (96, 512), "norm": (128,)}  # 38,400 + 49,152 + 128 entries


def _delta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _decoded(body: BlockedBody, wanted: list[int]) -> dict[int, torch.Tensor]:
    layout = block_layout(SHAPES)
    blobs = check_answer(body.answer(wanted), body.digest, wanted, len(layout), peer="p")
    return {i: decode_block(blob, layout[i], SHAPES[layout[i].name], peer="p") for i, blob in blobs.items()}


def test_every_block_checks_alone_and_the_blocks_reassemble_the_whole_bodys_tensors() -> None:
    delta = _delta()
    body = encode_blocks(delta, "int4")
    count = len(block_layout(SHAPES))
    assert block_count(SHAPES) == 5 and count >= 5
    parts = {}
    for i in range(count):  # one block at a time, as the peer merging it fetches it
        parts |= _decoded(body, [i])
    whole = decode_contribution(encode_contribution(delta, "int4"), SHAPES, peer="p")
    for name, t in assemble(parts, SHAPES).items():
        assert t.shape == delta[name].shape
        # each block is quantized in chunks of its own: within the wire's error of the whole body's decoding
        assert torch.linalg.vector_norm(t - delta[name]) <= 1.1 * torch.linalg.vector_norm(whole[name] - delta[name])
    assert torch.equal(assemble(_decoded(body, list(range(count))), SHAPES)["norm"], delta["norm"])  # small: raw


def test_a_block_that_is_not_the_signed_one_is_refused_with_its_sender_named() -> None:
    body, other = encode_blocks(_delta(0), "int4"), encode_blocks(_delta(1), "int4")
    count = len(block_layout(SHAPES))
    items = msgpack.unpackb(body.answer([0, 2]))
    items[0][1] = other.blobs[0]  # the signed body's paths, another body's block 0
    with pytest.raises(BlockMismatch) as e:
        check_answer(msgpack.packb(items), body.digest, [0, 2], count, peer="liar")
    assert e.value.peer == "liar"
    with pytest.raises(BlockMismatch):  # a body of its own, paths and all, under the signed root
        check_answer(other.answer([2]), body.digest, [2], count, peer="liar")
    with pytest.raises(BlockMismatch):  # the right block, answered for another index
        check_answer(msgpack.packb([[1, body.blobs[0], []]]), body.digest, [1], count, peer="liar")
    with pytest.raises(BlockMismatch):  # fewer blocks than asked for
        check_answer(body.answer([1]), body.digest, [1, 2], count, peer="liar")
    with pytest.raises(MalformedMessage):
        check_answer(b"\xc1 not msgpack", body.digest, [1], count, peer="liar")


def test_a_block_of_another_shape_or_with_nans_is_malformed() -> None:
    layout = block_layout(SHAPES)
    first_w = next(i for i, b in enumerate(layout) if b.name == "w")
    rows = (layout[first_w].stop - layout[first_w].start, SHAPES["w"][1])
    nan = np.zeros(rows, "<f4")
    nan[3, 4] = np.nan  # written by hand, as a hostile peer would: the encoder refuses NaN
    with pytest.raises(MalformedMessage):
        decode_block(msgpack.packb(["raw", "float32", list(rows), [], nan.tobytes()], use_bin_type=True),
                     layout[first_w], SHAPES["w"], peer="p")
    with pytest.raises(MalformedMessage):  # block 0's rows decoded as a block of another tensor
        decode_block(encode_blocks(_delta(), "int4").blobs[0], layout[first_w], SHAPES["w"], peer="p")


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 33])
def test_paths_lead_to_the_root_for_any_block_count(count: int) -> None:
    body = BlockedBody(tuple(bytes([i]) * (i + 1) for i in range(count)))
    assert check_answer(body.answer(list(range(count))), body.digest, list(range(count)), count, peer="p") == {
        i: body.blobs[i] for i in range(count)}


def test_requests_name_increasing_blocks_within_the_cap() -> None:
    assert parse_wanted(wanted_uid("backbone", 7, [0, 3, 9])) == ("backbone", 7, [0, 3, 9])
    for bad in ["backbone/7/3,1", "backbone/7/1,1", "backbone/7/", "backbone/x/1", "/7/1", "backbone/7/-1",
                "backbone/7/" + ",".join(str(i) for i in range(MAX_BLOCKS + 1)), "7/1"]:
        assert parse_wanted(bad) is None, bad
