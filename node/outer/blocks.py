"""A contribution in blocks, any of which a peer can fetch alone and check against the one digest its sender signed.

In a partitioned round (BTARD's) each of n peers merges a share of the blocks of everyone's contributions, so it
fetches only those blocks of each body: about one body a round whatever n is, where a gathered round fetches n - 1.
A sender signs one digest per contribution (``transport.RoundEntry``), before anyone knows how many peers will share
the merge, so the body is cut once, as finely as any round may need (``block_count``), and the digest is the root of
a Merkle tree over its blocks: an answer carries the blocks with the hashes that lead from them to the root (for a
contiguous range about two a level of the tree, 32 bytes each), and blocks that are not the ones signed fail at once,
their sender named.

The blocks are ``train.parts.blocks_of(shapes, block_count(shapes))``, so a receiver derives the cut from the group's
shapes alone: nothing a sender says about its layout is believed. Each block is encoded on its own with the run's
wire (``protocol.codec``; a tensor under ``wire.SMALL_TENSOR_NUMEL`` entries raw, as in a whole body), so a block
decodes without the others.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from parallax.node.outer.wire import CODEC_OF, encode_wire
from parallax.node.train.parts import Block, blocks_of
from parallax.protocol.codec import TensorLimits, decode
from parallax.protocol.errors import MalformedMessage, ProtocolError, RemoteProtocolError, malformed
from parallax.protocol.schema import MSGPACK_ERRORS

__all__ = ["Answer", "BlockedBody", "BlockMismatch", "MAX_BLOCKS", "assemble", "block_count", "block_layout",
           "blocks_cap", "check_answer", "decode_all", "decode_block", "encode_blocks", "parse_wanted", "wanted_uid"]

MIN_BLOCK_NUMEL = 4096
"""The fewest entries a block of a large group holds (2 KiB at int4): a recheck costs a block of every contribution,
so blocks must shrink as the swarm grows; their codec's framing bounds how small."""
MAX_BLOCKS = 1024
"""The most blocks a body is cut in: as many peers as this can share a round's merge with a block each."""
_DIGEST = 32
_EMPTY = hashlib.sha256(b"\x02").digest()  # the leaves past the last block, up to a power of two


class BlockMismatch(RemoteProtocolError):
    """A served block that is not the one its sender signed (it and its proof do not give the signed root), or an
    answer that is not the blocks asked for: evidence against the sender."""


def block_count(shapes: Mapping[str, Sequence[int]]) -> int:
    """How many shares a group's body is cut in: one per ``MIN_BLOCK_NUMEL`` entries, at least 1 and at most
    ``MAX_BLOCKS`` (``blocks_of`` may make a few more, where a tensor's rows do not divide evenly)."""
    total = sum(math.prod(s) for s in shapes.values())
    return max(1, min(MAX_BLOCKS, total // MIN_BLOCK_NUMEL))


def block_layout(shapes: Mapping[str, Sequence[int]]) -> list[Block]:
    """The blocks a group's body is cut in, from its shapes alone (the same on every peer): ``block_count`` shares,
    fewer where rows wider than a share would make more than ``MAX_BLOCKS`` blocks (``blocks_of`` cuts such a tensor
    row by row), and never more than ``MAX_BLOCKS`` unless the group has more tensors."""
    parts = block_count(shapes)
    layout = blocks_of(shapes, parts)
    while len(layout) > MAX_BLOCKS and parts > 1:
        parts = max(1, parts * MAX_BLOCKS // len(layout) - 1)
        layout = blocks_of(shapes, parts)
    return layout


# ---- the Merkle tree over the blocks ---------------------------------------------------------------------------


def _leaf(blob: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + blob).digest()


def _parent(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """The tree's levels, leaves first (padded with ``_EMPTY`` to a power of two), the root last."""
    width = 1 << max(0, (len(leaves) - 1).bit_length())
    level = list(leaves) + [_EMPTY] * (width - len(leaves))
    levels = [level]
    while len(level) > 1:
        level = [_parent(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        levels.append(level)
    return levels


def _depth(count: int) -> int:
    return max(0, (count - 1).bit_length())


def _proof(levels: Sequence[Sequence[bytes]], wanted: Sequence[int]) -> list[bytes]:
    """The hashes that, with the leaves ``wanted`` (increasing), give the root: level by level, the sibling of each
    known node that is not known itself, in increasing order (a contiguous range of leaves needs about two a level)."""
    proof: list[bytes] = []
    known = list(wanted)
    for level in levels[:-1]:
        have = set(known)
        proof.extend(level[i ^ 1] for i in known if i ^ 1 not in have)
        known = sorted({i >> 1 for i in known})
    return proof


def _nodes(leaves: Mapping[int, bytes], proof: Sequence[bytes], depth: int) -> list[dict[int, bytes]] | None:
    """Every node of the tree that ``leaves`` (index -> leaf hash) and ``proof`` (``_proof``'s order) make known in a
    tree of ``depth`` levels above its leaves, level by level, leaves first: at each level the nodes on the way up
    and their siblings, the root alone last; None when the proof has too few or too many hashes."""
    known = dict(leaves)
    hashes = iter(proof)
    levels = []
    for _ in range(depth):
        up: dict[int, bytes] = {}
        for i in sorted(known):
            if i ^ 1 not in known:
                sibling = next(hashes, None)
                if sibling is None:
                    return None
                known[i ^ 1] = sibling
        for i in sorted(known):
            if i % 2 == 0:
                up[i >> 1] = _parent(known[i], known[i + 1])
        levels.append(known)
        known = up
    levels.append(known)
    return levels if next(hashes, None) is None else None


# ---- encoding, serving and checking -------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockedBody:
    """A contribution's blocks (encoded each on its own, in ``block_layout`` order) and the tree over them."""

    blobs: tuple[bytes, ...]
    _levels: list[list[bytes]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.blobs:
            raise ValueError("a contribution has at least one block")
        object.__setattr__(self, "_levels", _levels([_leaf(b) for b in self.blobs]))

    @property
    def digest(self) -> bytes:
        """What the sender signs (``RoundEntry.digest``): the root over its blocks."""
        return self._levels[-1][0]

    @property
    def size(self) -> int:
        """The blocks' bytes together (``RoundEntry.size``)."""
        return sum(len(b) for b in self.blobs)

    def answer(self, wanted: Sequence[int]) -> bytes:
        """The answer to a fetch of blocks ``wanted`` (``parse_wanted``'s): the blocks, and the hashes that lead from
        them to the root (``_proof``)."""
        return msgpack.packb([[[i, self.blobs[i]] for i in wanted], _proof(self._levels, wanted)], use_bin_type=True)


def answer_cap(size: int, wanted: int, count: int) -> int:
    """The most bytes an honest answer for ``wanted`` of ``count`` blocks of a body of ``size`` bytes holds."""
    return size + wanted * (_DIGEST * _depth(count) + 16) + 16


def encode_blocks(delta: Mapping[str, torch.Tensor], compression: str) -> BlockedBody:
    """One peer's pseudo-gradient of a group cut in ``block_layout``'s blocks, each encoded on its own in the run's
    wire (a tensor under ``SMALL_TENSOR_NUMEL`` entries raw, as ``transport.encode_contribution`` does)."""
    arrays = {name: t.detach().to(device="cpu", dtype=torch.float32).numpy() for name, t in delta.items()}
    blobs = []
    for b in block_layout({name: a.shape for name, a in arrays.items()}):
        rows = np.ascontiguousarray(arrays[b.name][b.start:b.stop])
        blobs.append(encode_wire(rows, arrays[b.name].size, compression))
    return BlockedBody(tuple(blobs))


def wanted_uid(group: str, round_id: int, wanted: Sequence[int]) -> str:
    """The request naming blocks ``wanted`` of a group's round: ``{group}/{round}/{i,j,...}``."""
    return f"{group}/{round_id}/{','.join(str(i) for i in wanted)}"


def parse_wanted(uid: str) -> tuple[str, int, list[int]] | None:
    """(group, round, blocks) of a request (``wanted_uid``): blocks strictly increasing, at most ``MAX_BLOCKS`` of
    them, each below twice that; None for anything else (the server then checks them against what it holds)."""
    head, _, indices = uid.rpartition("/")
    group, _, n = head.rpartition("/")
    if not (group and n.isascii() and n.isdigit() and len(n) <= 18 and indices and len(indices) <= 8 * MAX_BLOCKS):
        return None
    try:
        wanted = [int(i) for i in indices.split(",")]
    except ValueError:
        return None
    increasing = all(a < b for a, b in zip(wanted, wanted[1:], strict=False))
    if len(wanted) > MAX_BLOCKS or wanted[0] < 0 or wanted[-1] >= 2 * MAX_BLOCKS or not increasing:
        return None
    return group, int(n), wanted


@dataclass(frozen=True)
class Answer:
    """A checked answer: the blocks asked for (index -> encoded block) and the tree's nodes that lead from them to
    the root they were checked against."""

    blobs: dict[int, bytes]
    nodes: list[dict[int, bytes]]

    def alone(self, i: int) -> bytes:
        """The answer its sender would give to a fetch of block ``i`` alone (``BlockedBody.answer([i])``): with the
        signed root, something anyone can check the block's content against."""
        path = [level[(i >> d) ^ 1] for d, level in enumerate(self.nodes[:-1])]
        return msgpack.packb([[[i, self.blobs[i]]], path], use_bin_type=True)


def check_answer(answer: bytes, digest: bytes, wanted: Sequence[int], count: int, *, peer: str) -> Answer:
    """The blocks of a peer's ``answer``, each checked against the root it signed (``digest``).

    Args:
        answer: what the peer sent (``BlockedBody.answer``).
        digest: the root in the peer's signed entry.
        wanted: the blocks asked for, increasing.
        count: how many blocks the group's body has (``len(block_layout(shapes))``).

    Raises:
        BlockMismatch: not the blocks asked for, or blocks and proof that do not give ``digest``.
        MalformedMessage: undecodable.
    """
    depth = _depth(count)
    try:
        raw = msgpack.unpackb(answer, raw=False, max_bin_len=len(answer), max_str_len=0,
                              max_array_len=max(2, depth * len(wanted)), max_map_len=0)
    except MSGPACK_ERRORS:
        raise MalformedMessage("undecodable answer of contribution blocks", peer=peer) from None
    items = raw[0] if isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], list) else None
    proof = raw[1] if items is not None and isinstance(raw[1], list) else None
    if items is None or proof is None or len(items) != len(wanted):
        raise BlockMismatch(f"an answer that is not the {len(wanted)} blocks asked for", peer=peer)
    out = {}
    for item, i in zip(items, wanted, strict=True):
        if not (isinstance(item, list) and len(item) == 2 and item[0] == i and isinstance(item[1], bytes)):
            raise BlockMismatch(f"block {i} of the answer is malformed or not the one asked for", peer=peer)
        out[i] = item[1]
    nodes = _nodes({i: _leaf(blob) for i, blob in out.items()}, proof, depth) if all(
        isinstance(h, bytes) and len(h) == _DIGEST for h in proof) else None
    if nodes is None or nodes[-1].get(0) != digest:
        raise BlockMismatch(f"blocks {_span(wanted)} are not the blocks the sender signed", peer=peer)
    return Answer(out, nodes)


def _span(wanted: Sequence[int]) -> str:
    return f"{wanted[0]}" if len(wanted) == 1 else f"{wanted[0]}..{wanted[-1]} ({len(wanted)})"


def _limits(block: Block, shape: Sequence[int]) -> TensorLimits:
    rows = (block.stop - block.start, *shape[1:])
    return TensorLimits(max_elements=math.prod(rows), max_ndim=max(len(rows), 1),
                        codecs=frozenset(CODEC_OF.values()), dtypes=frozenset({"float16", "float32"}))


def blocks_cap(blocks: Sequence[Block], shapes: Mapping[str, Sequence[int]]) -> int:
    """The most bytes ``blocks`` of a group of ``shapes`` may hold together (raw float64 would be the worst case)."""
    return sum(_limits(b, shapes[b.name]).max_blob_bytes for b in blocks)


def decode_block(blob: bytes, block: Block, shape: Sequence[int], *, peer: str) -> torch.Tensor:
    """One checked block back to float32 rows ``block.start:block.stop`` of a tensor of ``shape``.

    Raises:
        MalformedMessage: undecodable, another shape or codec, or non-finite values.
    """
    rows = (block.stop - block.start, *shape[1:])
    limits = _limits(block, shape)
    try:
        array = decode(blob, limits, peer=peer, what=f"outer contribution block {block.key}")
    except ProtocolError as e:
        raise malformed(e, peer) from None
    if tuple(array.shape) != rows:
        raise MalformedMessage(f"outer contribution block {block.key} has shape {array.shape}, not {rows}", peer=peer)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def decode_all(body: BlockedBody, shapes: Mapping[str, Sequence[int]], *, peer: str) -> dict[str, torch.Tensor]:
    """A whole contribution in blocks back to its tensors (its sender's own, or one held whole: the simulator).

    Raises:
        MalformedMessage: as ``decode_block``; ValueError: another number of blocks than ``shapes`` make.
    """
    layout = block_layout(shapes)
    if len(body.blobs) != len(layout):
        raise ValueError(f"{len(body.blobs)} blocks where the group's shapes make {len(layout)}")
    return assemble({i: decode_block(blob, layout[i], shapes[layout[i].name], peer=peer)
                     for i, blob in enumerate(body.blobs)}, shapes)


def assemble(blocks: Mapping[int, torch.Tensor], shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """The group's tensors from every one of its blocks (index in ``block_layout`` -> rows).

    Raises:
        ValueError: a block missing.
    """
    layout = block_layout(shapes)
    missing = [i for i in range(len(layout)) if i not in blocks]
    if missing:
        raise ValueError(f"{len(missing)} of {len(layout)} blocks missing, the first {missing[0]}")
    out: dict[str, list[torch.Tensor]] = {}
    for i, b in enumerate(layout):
        out.setdefault(b.name, []).append(blocks[i])
    return {name: torch.cat(out[name]).reshape(tuple(shape)) for name, shape in shapes.items()}
