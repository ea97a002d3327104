"""The robust merge over the blocks that several peers would each merge a share of (``train.parts``)."""

from __future__ import annotations

import math

import pytest
import torch

from parallax.node.train.parts import Block, blocks_of, robust_merge_parts
from parallax.node.train.robust import robust_merge_groups

SHAPES = {"embed": (64, 8), "w": (8, 8), "norm": (8,), "gain": (1,)}  # 512 + 64 + 8 + 1 = 585 entries


def _contributions(k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return [{n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()} for _ in range(k)]


def test_blocks_cover_every_row_of_every_tensor_once_and_only_tensors_past_a_share_are_cut():
    blocks = blocks_of(SHAPES, parts=4)  # a share: 147 entries
    assert [b for b in blocks if b.name != "embed"] == [Block("w", 0, 8), Block("norm", 0, 8), Block("gain", 0, 1)]
    embed = [b for b in blocks if b.name == "embed"]
    assert len(embed) == 4 and embed[0].start == 0 and embed[-1].stop == 64
    assert all(a.stop == b.start for a, b in zip(embed, embed[1:], strict=False))
    assert all((b.stop - b.start) * 8 <= math.ceil(585 / 4) for b in embed)
    assert blocks_of(SHAPES, parts=1) == blocks_of(SHAPES, parts=0) == [
        Block("embed", 0, 64), Block("w", 0, 8), Block("norm", 0, 8), Block("gain", 0, 1)]
    assert len([b for b in blocks_of(SHAPES, parts=10_000) if b.name == "embed"]) == 64  # a row at least
    uneven = blocks_of({"a": (5, 3), "b": (1, 1)}, parts=4)  # a share of 4 entries: one row of 3 a block
    assert [(b.start, b.stop) for b in uneven if b.name == "a"] == [(i, i + 1) for i in range(5)]
    for bad in ({"empty": (0, 4)}, {"scalar": ()}):
        with pytest.raises(ValueError, match="no rows"):
            blocks_of(bad, parts=2)


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_one_part_is_the_merge_of_whole_tensors(method: str):
    deltas, w = _contributions(5), [1.0, 2.0, 1.0, 1.0, 3.0]
    whole, _ = robust_merge_groups(deltas, w, method)
    merged, _ = robust_merge_parts(deltas, w, method, parts=1)
    assert whole is not None and merged is not None
    assert all(torch.equal(whole[n], merged[n]) for n in SHAPES)


def test_in_blocks_the_mean_of_peers_nobody_clips_is_the_plain_mean_and_shapes_are_kept():
    deltas, w = _contributions(2), [1.0, 3.0]  # two: CenteredClip judges nobody, the norms are within 2x
    merged, audit = robust_merge_parts(deltas, w, "mean", parts=16)
    assert merged is not None and all(a.norm_scale == 1.0 for a in audit.contributions)
    for n, shape in SHAPES.items():
        assert merged[n].shape == shape
        assert torch.allclose(merged[n], 0.25 * deltas[0][n] + 0.75 * deltas[1][n], atol=1e-6)


def test_in_blocks_a_poisoned_contribution_is_dropped_whole_and_a_scaled_one_is_bounded():
    deltas = _contributions(5)
    deltas[1] = {n: t.clone() for n, t in deltas[1].items()}
    deltas[1]["embed"][3, 0] = float("nan")
    deltas[2] = {n: 1000.0 * t for n, t in deltas[2].items()}
    honest = [deltas[i] for i in (0, 3, 4)]
    merged, audit = robust_merge_parts(deltas, [1.0] * 5, "rda", parts=16)
    assert merged is not None and audit.contributions[1].dropped == "non-finite"
    assert audit.contributions[2].norm_scale < 0.01
    longest = {n: max(float(torch.linalg.vector_norm(d[n])) for d in honest) for n in SHAPES}
    assert all(float(torch.linalg.vector_norm(merged[n])) <= 2.0 * longest[n] for n in SHAPES)
