"""Activation sketches: the (x, g) pairs that let an expert learn from tokens its owner never saw.

When a composer routes a token to an expert it does not own, the surrogate answers forward-only. The
composer can still record, for that selection, the expert input x and the gradient g = dL/dy of its
loss at the expert's output (gate x upstream gradient: autograd gives it for free once the stand-in
output is a leaf). The owner of the expert turns a batch of such pairs into a gradient of its real
expert with the Taylor-proxy objective

    P(w) = sum_n g_n . f_w(x_n)        =>   dP/dw at the current w = the expert's gradient on those tokens

(exactly the gradient the non-owner would have computed had the expert been real, up to g having been
taken where the surrogate, not the expert, answered). The same sketches feed worker offload (DESIGN.md
section 4), where a worker takes optimizer steps on P + lambda/2 ||f(x) - y0||^2.

On the way over the network a sketch is sub-sampled (each row kept with probability p and scaled by
1/p: an unbiased estimator of the sum, with variance growing as p falls) and quantised with the
protocol's int8 codec. A sketch holds no token ids and no text, only latent activations and gradients.

Shape legend: N sampled selections of one expert, L latent width.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from parallax.dht.keys import ExpertId
from parallax.protocol import codec


@dataclass
class Sketch:
    """Sampled (x, g) pairs of one expert; ``g`` already carries the 1/p sampling correction."""

    x_NL: torch.Tensor
    g_NL: torch.Tensor
    tokens: int
    """Selections the sample stands for (before sub-sampling)."""
    wire_bytes: int = 0
    """Bytes the sketch took on the wire (0 when not compressed)."""


class SketchRecorder:
    """Captures (x, g) for forward-only selections; plugs into ``MoELayer.sketcher``.

    ``attach`` is called in the forward with the detached output of a non-owned stand-in or of an
    offloaded owned expert; for the experts ``keep`` accepts it returns that output as a leaf that
    requires grad and hooks its gradient, so after ``backward`` the recorder holds g = dL/dy for every
    such selection of the step.

    Args:
        keep: keep(layer, expert) says which experts to capture (all when None).
    """

    def __init__(self, keep: Callable[[int, int], bool] | None = None) -> None:
        self._pending: dict[ExpertId, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._keep = keep

    def attach(self, layer: int, expert: int, x_NL: torch.Tensor, y_NL: torch.Tensor) -> torch.Tensor:
        if self._keep is not None and not self._keep(layer, expert):
            return y_NL
        if not y_NL.requires_grad:  # a forward-only output: a leaf of its own, so that it gets a gradient
            y_NL = y_NL.detach().requires_grad_(True)
        x_NL = x_NL.detach()

        def keep(g_NL: torch.Tensor) -> None:
            self._pending.setdefault((layer, expert), []).append((x_NL, g_NL.detach()))

        y_NL.register_hook(keep)
        return y_NL

    def take(self, experts: Collection[ExpertId] | None = None) -> dict[ExpertId, Sketch]:
        """The sketches captured since the last call, one per expert, uncompressed.

        Args:
            experts: take only these (the others stay pending); None takes every one.
        """
        out = {}
        for eid in [e for e in self._pending if experts is None or e in experts]:
            parts = self._pending.pop(eid)
            x = torch.cat([p[0] for p in parts])
            g = torch.cat([p[1] for p in parts])
            out[eid] = Sketch(x, g, tokens=x.shape[0])
        return out


def compress(sketch: Sketch, *, sample_fraction: float, generator: torch.Generator,
             wire_codec: str = "int8") -> Sketch:
    """Sub-sample rows with probability ``sample_fraction`` (scaling g by 1/p) and round-trip x and g
    through the protocol's tensor codec, as they would cross the network.

    Args:
        sketch: an uncompressed sketch.
        sample_fraction: p in (0, 1]; 1 keeps every row.
        generator: the sampling RNG (deterministic runs).
        wire_codec: a ``parallax.protocol.codec`` codec name ("raw", "fp16", "int8", ...).

    Returns:
        The sketch the receiver decodes, with ``wire_bytes`` set.
    """
    if not 0 < sample_fraction <= 1:
        raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction}")
    x, g = sketch.x_NL, sketch.g_NL
    if sample_fraction < 1:
        keep = torch.rand(x.shape[0], generator=generator) < sample_fraction
        x, g = x[keep], g[keep] / sample_fraction
    if x.shape[0] == 0:
        return Sketch(x, g, sketch.tokens, 0)  # nothing kept: nothing crosses the wire
    limits = codec.TensorLimits(max_elements=max(1, x.numel()), max_ndim=2)
    wire = 0
    decoded = []
    for t in (x, g):
        blob = codec.encode(t.cpu().float().numpy(), wire_codec)
        wire += len(blob)
        decoded.append(torch.from_numpy(np.ascontiguousarray(codec.decode(blob, limits, what="sketch"))))
    return Sketch(decoded[0].to(x.dtype), decoded[1].to(g.dtype), sketch.tokens, wire)


def concat(a: Sketch, b: Sketch) -> Sketch:
    """Both sketches' rows as one sample (an optimizer step on it follows their summed gradient)."""
    return Sketch(torch.cat([a.x_NL, b.x_NL]), torch.cat([a.g_NL, b.g_NL]), a.tokens + b.tokens,
                  a.wire_bytes + b.wire_bytes)


def subsample(sketch: Sketch, rows: int, generator: torch.Generator) -> Sketch:
    """At most ``rows`` rows of ``sketch``: n > rows rows are thinned to a uniform sample of ``rows`` without
    replacement, g scaled by n / rows, so the sum of g . f(x) (the Taylor proxy's gradient) stays unbiased."""
    n = sketch.x_NL.shape[0]
    if n <= rows:
        return sketch
    keep = torch.randperm(n, generator=generator)[:rows]
    return Sketch(sketch.x_NL[keep], sketch.g_NL[keep] * (n / rows), sketch.tokens, sketch.wire_bytes)


def taylor_proxy(expert: nn.Module, x_NL: torch.Tensor, g_NL: torch.Tensor, y0_NL: torch.Tensor | None = None,
                 lam: float = 0.0) -> torch.Tensor:
    """The Taylor-proxy objective sum_n g_n . (f(x_n) - y0_n) + lam/2 sum_n ||f(x_n) - y0_n||^2.

    Its gradient where f(x) = y0 (the weights the sketch was taken at) is sum_n J_n^T g_n: exactly the
    expert's gradient on those tokens. y0 shifts the value, not the gradient of the linear term; it anchors
    the trust term (None: the linear proxy alone, which needs no y0).

    Args:
        expert: the module f, its weights trainable.
        x_NL: expert inputs.
        g_NL: dL/dy at the expert output (with any 1/p sampling correction).
        y0_NL: f(x) at the anchor weights, detached; required when lam > 0.
        lam: weight of the trust term, >= 0.

    Returns:
        A 0-d tensor with a graph to the expert's weights.
    """
    y_NL = expert(x_NL)
    proxy = (g_NL * y_NL).sum()
    if lam > 0:
        if y0_NL is None:
            raise ValueError("the trust term (lam > 0) needs y0, the output at the anchor weights")
        proxy = proxy + 0.5 * lam * (y_NL - y0_NL).square().sum()
    return proxy


def accumulate_expert_gradient(expert: nn.Module, sketches: list[Sketch], scale: float) -> None:
    """Add ``scale`` x the Taylor-proxy gradient of ``sketches`` to ``expert``'s ``.grad``.

    Args:
        expert: the real (owned, trainable) expert.
        sketches: sketches of this expert from other composers (or its own, when a worker fell away).
        scale: weight of these tokens relative to the owner's own loss (1/C for a token-weighted mean).
    """
    device = next(expert.parameters()).device
    for s in sketches:  # one backward each: no graph over all of them at once
        if s.x_NL.numel():
            (taylor_proxy(expert, s.x_NL.to(device), s.g_NL.to(device)) * scale).backward()


def sketch_bytes(sketches: Mapping[ExpertId, Sketch]) -> int:
    return sum(s.wire_bytes for s in sketches.values())
