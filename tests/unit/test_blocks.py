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
from parallax.protocol.errors import MalformedMessage, RemoteProtocolError

SHAPES = {"emb": (300, 128), "w": (96, 512), "norm": (128,)}  # 38,400 + 49,152 + 128 entries


def _delta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _decoded(body: BlockedBody, wanted: list[int]) -> dict[int, torch.Tensor]:
    layout = block_layout(SHAPES)
    blobs = check_answer(body.answer(wanted), body.digest, wanted, len(layout), peer="p").blobs
    return {i: decode_block(blob, layout[i], SHAPES[layout[i].name], peer="p") for i, blob in blobs.items()}


def test_every_block_checks_alone_and_the_blocks_reassemble_the_whole_bodys_tensors() -> None:
    delta = _delta()
    body = encode_blocks(delta, "int4")
    count = len(block_layout(SHAPES))
    assert block_count(SHAPES) == 21 and count >= 21
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
    items, proof = msgpack.unpackb(body.answer([0, 2]))
    items[0][1] = other.blobs[0]  # the signed body's proof, another body's block 0
    with pytest.raises(BlockMismatch) as e:
        check_answer(msgpack.packb([items, proof]), body.digest, [0, 2], count, peer="liar")
    assert e.value.peer == "liar"
    with pytest.raises(BlockMismatch):  # a body of its own, proof and all, under the signed root
        check_answer(other.answer([2]), body.digest, [2], count, peer="liar")
    items, proof = msgpack.unpackb(body.answer([1]))
    with pytest.raises(BlockMismatch):  # the right block, answered for another index
        check_answer(msgpack.packb([[[2, items[0][1]]], proof]), body.digest, [2], count, peer="liar")
    with pytest.raises(RemoteProtocolError):  # a hash more than the proof needs (past the decoder's bound: malformed)
        check_answer(msgpack.packb([items, [*proof, proof[0]]]), body.digest, [1], count, peer="liar")
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
def test_any_set_of_blocks_and_its_proof_give_the_root_and_a_contiguous_range_needs_few_hashes(count: int) -> None:
    body = BlockedBody(tuple(bytes([i]) * (i + 1) for i in range(count)))
    g = torch.Generator().manual_seed(count)
    for wanted in [list(range(count)), [count - 1], sorted(set(torch.randint(count, (3,), generator=g).tolist()))]:
        answer = check_answer(body.answer(wanted), body.digest, wanted, count, peer="p")
        assert answer.blobs == {i: body.blobs[i] for i in wanted}
        for i in wanted:  # any block of a checked answer, alone: the answer its sender gives for that block
            assert answer.alone(i) == body.answer([i])
    depth = (count - 1).bit_length()
    _, proof = msgpack.unpackb(body.answer(list(range(count // 3, 2 * count // 3 + 1))))
    assert len(proof) <= 2 * depth


def test_requests_name_increasing_blocks_within_the_cap() -> None:
    assert parse_wanted(wanted_uid("backbone", 7, [0, 3, 9])) == ("backbone", 7, [0, 3, 9])
    for bad in ["backbone/7/3,1", "backbone/7/1,1", "backbone/7/", "backbone/x/1", "/7/1", "backbone/7/-1",
                "backbone/7/" + ",".join(str(i) for i in range(MAX_BLOCKS + 1)), "7/1"]:
        assert parse_wanted(bad) is None, bad
