"""Merging the composers' pseudo-gradients of a shared group: radial-directional averaging (RDA).

A plain mean of K pseudo-gradients that point in different directions is shorter than any of them
(two orthogonal deltas of norm 2 average to norm ~1.41), so the outer step shrinks as composers
disagree. RDA keeps the two parts apart: the merged length is the weighted mean of the lengths and
the merged direction is the normalised weighted mean of the unit directions:

    merged = (sum_i w_i |d_i|) * u / |u|,   u = sum_i w_i d_i / |d_i|,   w normalised to sum 1.

When the directions cancel (|u| ~ 0) no direction is meaningful, and we fall back to the plain
weighted mean of the deltas.

The network version averages with hivemind's DecentralizedAverager, which can only compute a
weighted mean of tensors. So the math is written as decompose -> weighted mean -> rebuild:
each peer contributes ``rda_components(delta)`` plus the delta itself, the averager means all three,
and ``rda_rebuild`` finishes. ``rda_merge`` is built on the same two functions, so the in-process
simulator and the network compute the same thing. ``merge_rules.RdaRule`` is the rule that uses them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DIRECTION_EPS = 1e-6
"""Below this norm the mean unit direction counts as cancelled. Unit directions have norm 1, so
this is already relative to the scale of the directions."""

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Norms of fp16/bf16 tensors overflow or lose digits; compute in at least float32.
    return torch.promote_types(dtype, torch.float32)


def rda_components(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one pseudo-gradient into its unit direction and its norm.

    Args:
        delta: a pseudo-gradient of any shape.

    Returns:
        (direction, norm): direction has delta's shape and unit norm (all zeros for a zero delta,
        so a composer that did not move adds nothing to the mean direction); norm has shape [1].
        Both in at least float32.
    """
    d = delta.detach().to(_compute_dtype(delta.dtype))
    norm_1 = torch.linalg.vector_norm(d).reshape(1)
    # A zero delta has no direction: divide by 1 instead of 0 so it gives zeros, not NaN.
    direction = d / torch.where(norm_1 > 0, norm_1, torch.ones_like(norm_1))
    return direction, norm_1


def rda_rebuild(
    mean_direction: torch.Tensor, mean_norm: torch.Tensor, mean_delta: torch.Tensor,
    *, eps: float = DIRECTION_EPS,
) -> torch.Tensor:
    """Finish an RDA merge from the weighted means of the components.

    Args:
        mean_direction: weighted mean of the peers' unit directions (delta's shape).
        mean_norm: weighted mean of the peers' norms, shape [1] (or a scalar).
        mean_delta: weighted mean of the peers' deltas (delta's shape), the fallback.
        eps: norm of mean_direction below which the directions count as cancelled.

    Returns:
        mean_norm * mean_direction / |mean_direction|, or mean_delta when the directions cancel;
        mean_delta's shape, in at least float32.

    Raises:
        ValueError: the shapes of mean_direction and mean_delta differ.
    """
    if mean_direction.shape != mean_delta.shape:
        raise ValueError(
            f"direction shape {tuple(mean_direction.shape)} != delta shape {tuple(mean_delta.shape)}")
    dtype = _compute_dtype(mean_delta.dtype)
    u = mean_direction.detach().to(dtype)
    u_norm = torch.linalg.vector_norm(u)
    if u_norm < eps:
        return mean_delta.detach().to(dtype).clone()
    return u * (mean_norm.detach().to(dtype).reshape(()) / u_norm)


def _normalised_weights(weights: Sequence[float], n: int) -> list[float]:
    if len(weights) != n:
        raise ValueError(f"got {n} deltas but {len(weights)} weights")
    if n == 0:
        raise ValueError("nothing to merge: no deltas given")
    w = [float(x) for x in weights]
    if any(not (x >= 0 and x != float("inf")) for x in w):  # also refuses NaN
        raise ValueError(f"weights are tokens processed and must be finite and >= 0, got {w}")
    total = sum(w)
    if total <= 0:
        raise ValueError("all weights are zero: no composer processed any tokens since the last merge")
    return [x / total for x in w]


def _weighted_mean(tensors: Sequence[torch.Tensor], w: Sequence[float]) -> torch.Tensor:
    # w is already normalised; accumulate one tensor at a time to avoid stacking K copies.
    out = torch.zeros_like(tensors[0], dtype=_compute_dtype(tensors[0].dtype))
    for t, wi in zip(tensors, w, strict=True):
        if wi:
            out.add_(t.detach().to(out.dtype), alpha=wi)
    return out


def _check_shapes(deltas: Sequence[torch.Tensor]) -> None:
    shapes = {tuple(d.shape) for d in deltas}
    if len(shapes) > 1:
        raise ValueError(f"deltas of one tensor must share a shape, got {sorted(shapes)}")


def mean_merge(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The weighted plain mean of the deltas of one tensor.

    Args:
        deltas: K pseudo-gradients of the same shape.
        weights: K non-negative weights (tokens processed), not all zero.

    Returns:
        sum_i w_i d_i / sum_i w_i, in at least float32.

    Raises:
        ValueError: empty input, mismatched lengths or shapes, negative/non-finite or all-zero weights.
    """
    w = _normalised_weights(weights, len(deltas))
    _check_shapes(deltas)
    return _weighted_mean(deltas, w)


def rda_merge(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], *, eps: float = DIRECTION_EPS
) -> torch.Tensor:
    """Radial-directional average of the deltas of one tensor.

    Args:
        deltas: K pseudo-gradients of the same shape.
        weights: K non-negative weights (tokens processed), not all zero.
        eps: see ``rda_rebuild``.

    Returns:
        (weighted mean of the norms) x (normalised weighted mean of the unit directions), or the
        weighted plain mean when the directions cancel; in at least float32.

    Raises:
        ValueError: as ``mean_merge``.
    """
    w = _normalised_weights(weights, len(deltas))
    _check_shapes(deltas)
    directions, norms = zip(*(rda_components(d) for d in deltas), strict=True)
    mean_direction, mean_norm = _weighted_mean(directions, w), _weighted_mean(norms, w)
    return rda_rebuild(mean_direction, mean_norm, _weighted_mean(deltas, w), eps=eps)
