"""The rules that merge K composers' pseudo-gradients of one tensor, one object each, looked up once by name.

A rule says four things, so that every place that merges computes the same thing:

- ``merge``: the plain merge in one process (the simulator, a round of fewer peers than the robust merge judges);
- ``robust``: the merge of norm-clipped contributions with CenteredClip (``train.robust``), which hands the rule
  a ``clip`` function so that the rule says *what* is clipped;
- ``buffers`` / ``buffer_shapes`` / ``rebuild``: what one peer puts into hivemind's all-reduce, which can only
  average, and how the merge is finished from the averages (``outer.wire``).

Adding a rule is one class here and one entry in ``MERGE_RULES`` (and its name in ``config.train.MergeName``, the
setting's choices, which a unit test holds equal to this registry's keys).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import torch

from parallax.node.train.rda import DIRECTION_EPS, mean_merge, rda_components, rda_merge, rda_rebuild

Clip = Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, list[float]]]
"""CenteredClip of K tensors with the round's weights: (the clipped mean, each contribution's pull-in factor)."""


def _direction_scale(numel: int) -> float:
    # A unit vector of n entries has entries ~1/sqrt(n); times sqrt(n) they are O(1), where fp16 is exact
    # to 3 digits instead of sinking into subnormals. The same constant on every peer: the mean scales too.
    return math.sqrt(max(numel, 1))


def weighted_mean(tensors: Sequence[torch.Tensor], w: Sequence[float]) -> torch.Tensor:
    """sum_i w_i t_i of tensors of one shape (float32 or wider) with weights ``w`` that already sum to 1,
    accumulated one tensor at a time (zero weights skipped), as ``rda.rda_merge`` does."""
    out = torch.zeros_like(tensors[0])
    for t, wi in zip(tensors, w, strict=True):
        if wi:
            out.add_(t, alpha=wi)
    return out


class MergeRule(ABC):
    """How K pseudo-gradients of one tensor become one (module docstring)."""

    name: ClassVar[str]

    @abstractmethod
    def merge(self, deltas: Sequence[torch.Tensor], weights: Sequence[float], *, eps: float) -> torch.Tensor:
        """The plain weighted merge of K deltas of one tensor (weights need not sum to 1)."""

    @abstractmethod
    def robust(self, clipped: Sequence[torch.Tensor], w: Sequence[float], clip: Clip, *,
               eps: float) -> tuple[torch.Tensor, list[float]]:
        """The merge of K norm-clipped deltas (weights ``w`` sum to 1) with ``clip``: (merged, per contribution the
        factor CenteredClip pulled it in by, where the rule judges it)."""

    @abstractmethod
    def buffer_shapes(self, sizes: Sequence[torch.Size]) -> list[torch.Size]:
        """The shapes of the buffers a group of tensors of ``sizes`` averages in an all-reduce."""

    @abstractmethod
    def buffers(self, deltas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What one peer puts into the all-reduce for a group's deltas (CPU float32), in ``buffer_shapes`` order."""

    @abstractmethod
    def rebuild(self, means: Sequence[torch.Tensor], count: int, *, eps: float) -> list[torch.Tensor]:
        """The merged tensors of a group of ``count`` from the weighted means of ``buffers``."""


class MeanRule(MergeRule):
    """The weighted plain mean."""

    name = "mean"

    def merge(self, deltas: Sequence[torch.Tensor], weights: Sequence[float], *, eps: float) -> torch.Tensor:
        return mean_merge(deltas, weights)

    def robust(self, clipped: Sequence[torch.Tensor], w: Sequence[float], clip: Clip, *,
               eps: float) -> tuple[torch.Tensor, list[float]]:
        return clip(clipped)

    def buffer_shapes(self, sizes: Sequence[torch.Size]) -> list[torch.Size]:
        return list(sizes)

    def buffers(self, deltas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(deltas)

    def rebuild(self, means: Sequence[torch.Tensor], count: int, *, eps: float) -> list[torch.Tensor]:
        return [m.detach().to(torch.float32).clone() for m in means]


class RdaRule(MergeRule):
    """Radial-directional averaging (``train.rda``): the mean length along the mean direction. Robustly, the
    directions are what CenteredClip judges (a peer's direction is where it can lie without a long norm), the plain
    mean of the clipped deltas is the fallback, and the norms (already bounded) are averaged."""

    name = "rda"

    def merge(self, deltas: Sequence[torch.Tensor], weights: Sequence[float], *, eps: float) -> torch.Tensor:
        return rda_merge(deltas, weights, eps=eps)

    def robust(self, clipped: Sequence[torch.Tensor], w: Sequence[float], clip: Clip, *,
               eps: float) -> tuple[torch.Tensor, list[float]]:
        mean_delta, _ = clip(clipped)
        directions, norms = zip(*(rda_components(t) for t in clipped), strict=True)
        mean_direction, factors = clip(directions)
        return rda_rebuild(mean_direction, weighted_mean(norms, w), mean_delta, eps=eps), factors

    def buffer_shapes(self, sizes: Sequence[torch.Size]) -> list[torch.Size]:
        return [*sizes, torch.Size([len(sizes)]), *sizes]

    def buffers(self, deltas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # [direction_t * sqrt(numel_t) for each t] + [norms, shape [T]] + [delta_t for each t]
        directions, norms = [], []
        for d in deltas:
            direction, norm_1 = rda_components(d)
            directions.append(direction.mul_(_direction_scale(d.numel())))
            norms.append(norm_1)
        return [*directions, torch.cat(norms) if norms else torch.zeros(0), *deltas]

    def rebuild(self, means: Sequence[torch.Tensor], count: int, *, eps: float) -> list[torch.Tensor]:
        directions, norms_T, deltas = means[:count], means[count], means[count + 1:]
        return [rda_rebuild(directions[i] / _direction_scale(directions[i].numel()), norms_T[i:i + 1], deltas[i],
                            eps=eps) for i in range(count)]


MERGE_RULES: dict[str, MergeRule] = {rule.name: rule for rule in (RdaRule(), MeanRule())}
"""Every merge rule by name: ``sync.merge`` names one."""


def merge_groups(deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], method: str = "rda", *,
                 eps: float = DIRECTION_EPS) -> dict[str, torch.Tensor]:
    """Merge the pseudo-gradients of a parameter group tensor by tensor, with the rule ``method``.

    The rule is applied per tensor (not to the group flattened into one vector), so a large tensor cannot dominate
    the direction of a small one.

    Args:
        deltas: K mappings name -> pseudo-gradient, all with the same names and shapes.
        weights: K non-negative weights (tokens processed), not all zero.
        method: a name of ``MERGE_RULES``.

    Returns:
        name -> merged tensor, in the order of the first mapping.

    Raises:
        ValueError: unknown rule, mappings with different names, or as ``rda.mean_merge``.
    """
    rule = merge_rule(method)
    if not deltas:
        raise ValueError("nothing to merge: no deltas given")
    names = list(deltas[0])
    for i, d in enumerate(deltas[1:], start=1):
        if set(d) != set(names):
            raise ValueError(f"delta {i} has tensors {sorted(d)} but delta 0 has {sorted(names)}")
    return {name: rule.merge([d[name] for d in deltas], weights, eps=eps) for name in names}


def merge_rule(name: str) -> MergeRule:
    """The rule called ``name``.

    Raises:
        ValueError: no such rule, naming those there are.
    """
    try:
        return MERGE_RULES[name]
    except KeyError:
        raise ValueError(f"merge rule must be one of {', '.join(MERGE_RULES)}, got {name!r}") from None


__all__ = ["DIRECTION_EPS", "MERGE_RULES", "Clip", "MeanRule", "MergeRule", "RdaRule", "merge_groups", "merge_rule",
           "weighted_mean"]
