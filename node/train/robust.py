"""A robust merge of pseudo-gradients: what one lying peer can do to a shared group is bounded.

The plain merge (``rda.merge_groups``) trusts every contribution: a peer that scales its pseudo-gradient
by 1000 moves the merged norm by 1000/K, and one NaN makes the result NaN. ``robust_merge_groups``
computes the same RDA (or mean) merge after three defences, each applied tensor by tensor:

1. **Non-finite contributions are dropped** whole (every tensor of that peer).
2. **Norms are clipped relative to the median** (as Templar clips gradients): a contribution longer
   than ``norm_clip`` x the median norm of that tensor is scaled down to it. Honest pseudo-gradients of
   one round have norms within a few tens of percent of each other, so they are left alone.
3. **CenteredClip** (Karimireddy et al. 2021, used by BTARD): start from the coordinate-wise median and
   iterate ``v <- v + sum_i w_i (x_i - v) min(1, tau / |x_i - v|)``. ``tau`` is ``tau`` x the median
   distance of the contributions to the starting median, so the radius follows the spread of honest
   contributions and no absolute scale is assumed. For RDA the unit directions are clipped this way
   and the norms by step 2; for the mean, the (norm-clipped) deltas.

Among fewer than ``min_contributions`` (3) contributions no one can be told an outlier and step 3 is skipped;
step 2 still holds each to ``norm_clip`` x the shorter of two, so a pair with a liar moves no further than
twice an honest round, and nobody is suspected for it (of two, the longer may be the honest, faster peer).
When nobody is clipped, the result is the plain merge of the same contributions, computed by the same
code (``rda.rda_rebuild`` of weighted means): robustness costs nothing while nobody attacks. Weights
are the caller's: a peer's declared tokens must be capped before they reach here (``cap_weights``).

``MergeAudit`` says, per contribution, whether it was dropped, how much its norm was scaled and how far
CenteredClip pulled it in: the evidence a node scores peers by.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from parallax.node.train.merge_rules import MergeRule, merge_rule, weighted_mean
from parallax.node.train.rda import DIRECTION_EPS

__all__ = ["ContributionAudit", "MergeAudit", "RobustConfig", "cap_weights", "centered_clip", "merge_geometry",
           "robust_merge_groups", "span_of"]


@dataclass(frozen=True)
class RobustConfig:
    """How hard the robust merge pulls outliers in. Every peer merges with these defaults: a node has no setting for
    them, so no run can loosen its own defence."""

    norm_clip: float = 2.0
    """A contribution's norm (per tensor) is at most this x the median norm of that tensor."""
    tau: float = 2.0
    """CenteredClip's radius, as a multiple of the median distance of the contributions to their median."""
    iters: int = 8
    """CenteredClip iterations at most (it stops earlier once the centre moves by under 1e-6 relative)."""
    min_contributions: int = 3
    """Clip only among at least this many contributions: of two, neither is the outlier (the weight cap and
    the non-finite check still apply)."""

    def __post_init__(self) -> None:
        if not (self.norm_clip >= 1.0 and math.isfinite(self.norm_clip)):
            raise ValueError(f"norm_clip must be finite and >= 1, got {self.norm_clip}")
        if not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"tau must be finite and > 0, got {self.tau}")
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.min_contributions < 3:
            raise ValueError(f"min_contributions must be >= 3 (a median needs a majority), "
                             f"got {self.min_contributions}")


@dataclass
class ContributionAudit:
    """What the robust merge did to one contribution."""

    dropped: str = ""
    """Why the contribution was left out ("non-finite", "zero weight"), or empty."""
    norm_scale: float = 1.0
    """The smallest factor its tensors' norms were scaled by in step 2 (1.0: none clipped)."""
    clip: float = 1.0
    """CenteredClip's factor min(1, tau / distance), averaged over its tensors weighted by their sizes (1.0: never
    pulled in). By size, because the radius follows how closely the others agree: on a small tensor where honest
    peers happen to agree almost exactly (a final norm's weight early in training), an honest contribution taken
    from an older anchor lies 20x outside it, while the rest of it lies within."""
    _clip_mass: float = field(default=0.0, repr=False)
    _clip_size: int = field(default=0, repr=False)
    judged: bool = True
    """Whether there were enough contributions to tell an outlier (``RobustConfig.min_contributions``): of two,
    the longer may be the honest one (a faster peer's), so its clipping is a bound, not evidence."""

    SUSPICIOUS_NORM_SCALE: ClassVar[float] = 0.25
    SUSPICIOUS_CLIP: ClassVar[float] = 0.1

    def note_clip(self, factor: float, size: int) -> None:
        """Count CenteredClip's ``factor`` for one of its tensors, of ``size`` entries."""
        self._clip_mass += factor * size
        self._clip_size += size
        self.clip = self._clip_mass / self._clip_size

    @property
    def suspicious(self) -> bool:
        """Non-finite, more than four times as long as the clip bound (8x the median norm), or pulled in to under a
        tenth of its distance on average over its entries: further than honest training goes (a peer that processed
        no tokens is dropped, not suspected). Honest composers at other points of the learning-rate schedule, or
        that carried tokens over from failed rounds, send pseudo-gradients 2-4x longer or shorter than the median
        and are clipped a little (measured: bans of honest peers in `bench attacks`' clean runs at 2x); that is no
        evidence against them."""
        return self.dropped == "non-finite" or (self.judged and (self.norm_scale < self.SUSPICIOUS_NORM_SCALE
                                                                  or self.clip < self.SUSPICIOUS_CLIP))


@dataclass
class MergeAudit:
    """One ``ContributionAudit`` per contribution, in the order given."""

    contributions: list[ContributionAudit] = field(default_factory=list)

    @property
    def used(self) -> list[int]:
        return [i for i, c in enumerate(self.contributions) if not c.dropped]


def cap_weights(weights: Sequence[float], cap: float) -> list[float]:
    """Declared weights (tokens) bounded to [0, cap]; non-finite or negative ones become 0.

    ``cap`` is what the schedule lets one peer process in one round (batch x sequence x period): a peer
    cannot buy more influence than a peer that did its share of work.
    """
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"the weight cap must be finite and > 0, got {cap}")
    return [min(float(w), cap) if math.isfinite(float(w)) and float(w) > 0 else 0.0 for w in weights]


MAX_SPAN = 4.0
"""A contribution counts as covering at most this many periods, whatever its sender declares."""


def span_of(declared_tokens: float, cap: float) -> float:
    """How many merge periods a contribution of ``declared_tokens`` covers, in [1, MAX_SPAN] (``cap``: the tokens
    of one period). A peer declaring 1e12 tokens gets at most MAX_SPAN x the norm allowance, and its weight
    is still capped at one period's (``cap_weights``)."""
    if not (math.isfinite(declared_tokens) and cap > 0):
        return 1.0
    return min(max(declared_tokens / cap, 1.0), MAX_SPAN)


def centered_clip(points: Sequence[torch.Tensor], weights: Sequence[float], *, tau: float, iters: int,
                  ) -> tuple[torch.Tensor, list[float]]:
    """CenteredClip of equally shaped tensors (float32 or wider), from the coordinate-wise median.

    Args:
        points: K tensors of one shape.
        weights: K weights summing to 1 (already normalised).
        tau: the radius as a multiple of the median distance of the points to their coordinate-wise median.
        iters: iterations at most.

    Returns:
        (centre, clip factors): the centre; per point the smallest min(1, radius / distance) applied.
        When no point is ever clipped the centre is the plain weighted mean, accumulated as
        ``rda._weighted_mean`` does (bit for bit the plain merge).
    """
    stacked = torch.stack([p.reshape(-1) for p in points])
    centre = stacked.median(dim=0).values if len(points) > 2 else stacked.mean(dim=0)
    distances = torch.linalg.vector_norm(stacked - centre, dim=1)
    radius = tau * float(distances.median())
    factors = [1.0] * len(points)
    if radius <= 0.0:  # most points coincide: nothing to measure an outlier against, so nobody is clipped
        return weighted_mean(points, weights), factors
    for _ in range(iters):
        diffs = stacked - centre
        dist = torch.linalg.vector_norm(diffs, dim=1)
        scale = [1.0 if d <= radius else radius / d for d in dist.tolist()]
        if all(s == 1.0 for s in scale + factors):  # nobody clipped, now or before: the plain mean
            return weighted_mean(points, weights), factors
        factors = [min(f, s) for f, s in zip(factors, scale, strict=True)]
        step = torch.zeros_like(centre)
        for diff, w, s in zip(diffs, weights, scale, strict=True):
            if w:
                step.add_(diff, alpha=w * s)
        centre = centre + step
        if float(torch.linalg.vector_norm(step)) <= 1e-6 * max(float(torch.linalg.vector_norm(centre)), 1e-12):
            break
    return centre.reshape(points[0].shape), factors


def robust_merge_groups(
    deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], method: str = "rda",
    config: RobustConfig | None = None, *, eps: float = DIRECTION_EPS, spans: Sequence[float] | None = None,
) -> tuple[dict[str, torch.Tensor] | None, MergeAudit]:
    """Merge K peers' pseudo-gradients of one group, robust to the outliers described in the module docstring.

    Args:
        deltas: K mappings name -> tensor, all with the same names and shapes (checked by the caller's
            decoder: a peer's contribution of another shape never reaches here).
        weights: K declared weights, already capped (``cap_weights``).
        method: a merge rule's name (``merge_rules.MERGE_RULES``).
        config: the clipping settings (defaults when None).
        spans: per contribution, how many merge periods it covers (``span_of``): a peer whose last rounds
            failed sends the pseudo-gradient of several periods, longer by right, and its norm is compared
            per period. None: one period each.

    Returns:
        (name -> merged tensor in float32, audit); the merged mapping is None when no contribution is left
        (all non-finite or zero weight).

    Raises:
        ValueError: unknown method, or mappings with different names or shapes.
    """
    rule = merge_rule(method)
    cfg = config or RobustConfig()
    if len(weights) != len(deltas) or (spans is not None and len(spans) != len(deltas)):
        raise ValueError(f"got {len(deltas)} deltas but {len(weights)} weights or spans")
    audit = MergeAudit([ContributionAudit() for _ in deltas])
    names = list(deltas[0]) if deltas else []
    for i, d in enumerate(deltas):
        if set(d) != set(names) or any(d[n].shape != deltas[0][n].shape for n in names):
            raise ValueError(f"contribution {i} has other tensors or shapes than contribution 0")
        if not (weights[i] > 0 and math.isfinite(weights[i])):
            audit.contributions[i].dropped = "zero weight"
        elif not all(bool(torch.isfinite(d[n]).all()) for n in names):
            audit.contributions[i].dropped = "non-finite"
    used = audit.used
    if not used:
        return None, audit
    if len(used) < cfg.min_contributions:  # no majority to tell an outlier by: bounded, nobody suspected
        for i in used:
            audit.contributions[i].judged = False
    total = sum(float(weights[i]) for i in used)
    w = [float(weights[i]) / total for i in used]
    merged = {}
    for name in names:
        tensors = [deltas[i][name].detach().to(torch.promote_types(deltas[i][name].dtype, torch.float32))
                   for i in used]
        merged[name] = _merge_tensor(tensors, w, [spans[i] if spans is not None else 1.0 for i in used], rule,
                                     cfg, eps, [audit.contributions[i] for i in used])
    return merged, audit


def _merge_tensor(tensors: list[torch.Tensor], w: list[float], spans: list[float], rule: MergeRule, cfg: RobustConfig,
                  eps: float, audits: list[ContributionAudit]) -> torch.Tensor:
    norms = [float(torch.linalg.vector_norm(t)) for t in tensors]
    per_period = sorted(n / s for n, s in zip(norms, spans, strict=True))
    bound = cfg.norm_clip * per_period[(len(norms) - 1) // 2]  # the lower median: an attacker cannot raise it
    clipped = []
    for t, n, span, a in zip(tensors, norms, spans, audits, strict=True):
        if bound > 0.0 and n > bound * span:  # a zero median (peers that did not move) bounds nothing
            scale = bound * span / n
            a.norm_scale = min(a.norm_scale, scale)
            clipped.append(t * scale)
        else:
            clipped.append(t)
    if len(tensors) < cfg.min_contributions:
        return rule.merge(clipped, w, eps=eps)
    merged, factors = rule.robust(clipped, w, functools.partial(centered_clip, weights=w, tau=cfg.tau,
                                                                 iters=cfg.iters), eps=eps)
    _note_clips(audits, factors, tensors[0].numel())
    return merged


def _note_clips(audits: list[ContributionAudit], factors: list[float], size: int) -> None:
    for a, f in zip(audits, factors, strict=True):
        a.note_clip(f, size)


def merge_geometry(deltas: Sequence[Mapping[str, torch.Tensor]], merged: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Where a merge put a group against each contribution, as inner products over the whole group (every tensor of
    ``merged``'s names, in float64): ``gram`` (K x K, contribution i . contribution j), ``dots`` (contribution i . the
    result) and ``square`` (the result . itself). From these alone, whoever knows which contributions were honest
    computes how far the result lies from any weighting of them (``benchmarks.attacks``: what an attack took from a
    round). The products of a non-finite contribution are None (it was dropped)."""
    k = len(deltas)
    gram = torch.zeros(k, k, dtype=torch.float64)
    dots = torch.zeros(k, dtype=torch.float64)
    square = 0.0
    finite = [all(bool(torch.isfinite(d[n]).all()) for n in merged) for d in deltas]
    for name, result in merged.items():
        m = result.detach().reshape(-1).to(torch.float64)
        rows = torch.stack([d[name].detach().reshape(-1).to(torch.float64) if ok else torch.zeros_like(m)
                            for d, ok in zip(deltas, finite, strict=True)])
        gram += rows @ rows.T
        dots += rows @ m
        square += float(m @ m)
    return {"gram": [[float(gram[i, j]) if finite[i] and finite[j] else None for j in range(k)] for i in range(k)],
            "dots": [float(dots[i]) if finite[i] else None for i in range(k)], "square": square}
