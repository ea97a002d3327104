"""A group's tensors in the blocks that ``parts`` peers would each merge one share of.

The robust merge (``robust``) runs tensor by tensor: the norm clip, CenteredClip and the RDA direction of a tensor
need nothing of another. So ``parts`` peers can share a round's merge, each merging its blocks of everyone's
contributions, and the others fetch the merged blocks: a peer then moves about two bodies a round whatever the
number of peers, where a gathered round moves n - 1. Where a block is a whole tensor the result is the same; a
tensor larger than a share (``total / parts`` entries) is cut along its first dimension into row blocks, each merged
as a tensor of its own (its own norm clip, CenteredClip and direction), which changes the merge. The simulator
measures what that costs (``sim.outer_parts``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from parallax.node.train.rda import DIRECTION_EPS
from parallax.node.train.robust import MergeAudit, RobustConfig, robust_merge_groups

__all__ = ["Block", "blocks_of", "robust_merge_parts"]


@dataclass(frozen=True)
class Block:
    """Rows ``start`` to ``stop`` (first dimension) of tensor ``name``."""

    name: str
    start: int
    stop: int

    @property
    def key(self) -> str:
        return f"{self.name}[{self.start}:{self.stop}]"


def blocks_of(shapes: Mapping[str, Sequence[int]], parts: int) -> list[Block]:
    """The blocks ``parts`` peers would merge the tensors of ``shapes`` in: a tensor of at most ``total / parts``
    entries whole, a larger one in the fewest row blocks of about equal rows that hold at most that many entries each
    (one row where a row alone holds more). ``parts`` <= 1: every tensor whole.

    Raises:
        ValueError: a 0-d shape, or one with a zero dimension (nothing to merge).
    """
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    if any(size == 0 or not shapes[name] for name, size in sizes.items()):
        raise ValueError("a 0-d tensor, or one with no entries, has no rows to make blocks of")
    share = math.ceil(sum(sizes.values()) / parts) if parts > 1 else math.inf
    out = []
    for name, shape in shapes.items():
        rows = shape[0]
        if sizes[name] <= share:
            out.append(Block(name, 0, rows))
            continue
        per_block = max(1, int(share // (sizes[name] // rows)))  # rows a block holds within the share
        count = math.ceil(rows / per_block)
        edges = [rows * i // count for i in range(count + 1)]  # about equal blocks, none past per_block rows
        out.extend(Block(name, a, b) for a, b in zip(edges, edges[1:], strict=False))
    return out


def _split(tensors: Mapping[str, torch.Tensor], blocks: Sequence[Block]) -> dict[str, torch.Tensor]:
    return {b.key: tensors[b.name][b.start:b.stop] for b in blocks}


def robust_merge_parts(
    deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], method: str = "rda", *, parts: int,
    config: RobustConfig | None = None, eps: float = DIRECTION_EPS, spans: Sequence[float] | None = None,
) -> tuple[dict[str, torch.Tensor] | None, MergeAudit]:
    """``robust.robust_merge_groups`` computed over the blocks ``parts`` peers would merge (``blocks_of``): each
    block merged as a tensor of its own, the blocks put back together. Arguments and result as there; ``parts``
    <= 1 is the merge of whole tensors."""
    if not deltas or parts <= 1:
        return robust_merge_groups(deltas, weights, method, config, eps=eps, spans=spans)
    shapes = {name: tuple(t.shape) for name, t in deltas[0].items()}
    blocks = blocks_of(shapes, parts)
    if all(b.start == 0 and b.stop == shapes[b.name][0] for b in blocks):
        return robust_merge_groups(deltas, weights, method, config, eps=eps, spans=spans)
    merged, audit = robust_merge_groups([_split(d, blocks) for d in deltas], weights, method, config, eps=eps,
                                        spans=spans)
    if merged is None:
        return None, audit
    out = {}
    for name, shape in shapes.items():
        pieces = [merged[b.key] for b in blocks if b.name == name]
        out[name] = torch.cat(pieces).reshape(shape)
    return out, audit
