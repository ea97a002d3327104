"""Many SwiGLU experts over one sorted batch of rows: the expert compute of an MoE layer in a few kernels.

The layer sorts its routed selections by expert once; the rows of each expert are then one contiguous
slice, and ``grouped_swiglu_parts`` runs every expert of a kind (owned, surrogates, ...) over its slice:

    grouped_mm  torch's grouped GEMM (``F.grouped_mm``): one kernel per projection for all experts. CUDA
                needs bf16 and compute capability 8.0+; the CPU build runs it in float32.
    slices      one matmul per expert on its contiguous slice (no gather, no mask).
    padded      every expert's rows padded to the longest and run as one ``bmm``: for many small experts
                (surrogates, r << f), where a kernel per expert costs more than the padding.

Shape legend: N rows (routed selections), I input width, H hidden width, G experts in the call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

METHODS = ("grouped_mm", "slices", "padded")

Weights = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]
"""Per expert: gate [H, I], up [H, I], down [I, H] (``nn.Linear`` layouts)."""


def grouped_swiglu_parts(x_NI: torch.Tensor, counts: Sequence[int], weights: Weights,
                         method: str) -> list[torch.Tensor]:
    """down(silu(gate(x)) * up(x)) for each expert g over its rows, rows sorted by expert.

    Args:
        x_NI: the rows, expert 0's first ``counts[0]``, then expert 1's, and so on.
        counts: rows per expert, each > 0, summing to N.
        weights: (gates, ups, downs), one tensor per expert, as ``Weights``.
        method: one of ``METHODS``; "grouped_mm" falls back to "slices" where ``grouped_mm_works`` says no or a
            width is not a multiple of 16 bytes.

    Returns:
        The outputs in the rows' order, in consecutive parts: one [N, I] tensor ("grouped_mm", "padded"), or one per
        expert ("slices": joining them would copy every row once more).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if sum(counts) != x_NI.shape[0] or any(c <= 0 for c in counts) or not counts:
        raise ValueError(f"counts {list(counts)} must be positive and sum to the {x_NI.shape[0]} rows")
    gates, ups, downs = weights
    dtype = _dtype(x_NI)
    # grouped GEMM wants every row stride a multiple of 16 bytes (a surrogate of width 6 is not)
    aligned = all(w * dtype.itemsize % 16 == 0 for w in (x_NI.shape[1], gates[0].shape[0]))
    if method == "grouped_mm" and aligned and grouped_mm_works(x_NI.device, dtype):
        return [_grouped_mm(x_NI, counts, gates, ups, downs, dtype)]
    if method == "padded" and len(counts) > 1:
        return [_padded(x_NI, counts, gates, ups, downs)]
    # split, not slicing: the backward of one split is one cat, of G slices G zero-filled copies of all N rows.
    return [F.linear(F.silu(F.linear(x, gates[g])) * F.linear(x, ups[g]), downs[g])
            for g, x in enumerate(x_NI.split(list(counts)))]


def _dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of ``x`` runs in here: autocast's, where it is on for x's device."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # grouped_mm's backward refuses a gradient with zero strides (an expanded one, as sum() gives).
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def _grouped_mm(x_NI: torch.Tensor, counts: Sequence[int], gates: Sequence[torch.Tensor],
                ups: Sequence[torch.Tensor], downs: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    offs = torch.tensor(counts, device=x_NI.device).cumsum(0).to(torch.int32)
    with torch.autocast(x_NI.device.type, enabled=False):
        x = x_NI.to(dtype)

        def project(inp: torch.Tensor, ws: Sequence[torch.Tensor]) -> torch.Tensor:
            w_GIO = torch.stack([w.to(dtype) for w in ws]).transpose(1, 2)
            return _contiguous_grad(F.grouped_mm(inp, w_GIO, offs=offs))

        hidden = F.silu(project(x, gates)) * project(x, ups)
        return project(hidden, downs)


def _padded(x_NI: torch.Tensor, counts: Sequence[int], gates: Sequence[torch.Tensor], ups: Sequence[torch.Tensor],
            downs: Sequence[torch.Tensor]) -> torch.Tensor:
    G, longest = len(counts), max(counts)
    counts_G = torch.tensor(counts, device=x_NI.device)
    group_N = torch.repeat_interleave(torch.arange(G, device=x_NI.device), counts_G)
    starts_G = counts_G.cumsum(0) - counts_G
    slot_N = torch.arange(x_NI.shape[0], device=x_NI.device) - starts_G[group_N]
    x_GPI = x_NI.new_zeros(G, longest, x_NI.shape[1]).index_put((group_N, slot_N), x_NI)
    gate_GIH, up_GIH = (torch.stack(list(ws)).transpose(1, 2) for ws in (gates, ups))
    down_GHI = torch.stack(list(downs)).transpose(1, 2)
    hidden_GPH = F.silu(torch.bmm(x_GPI, gate_GIH)) * torch.bmm(x_GPI, up_GIH)
    return torch.bmm(hidden_GPH, down_GHI)[group_N, slot_N]


@functools.cache
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build runs ``F.grouped_mm`` forward and backward on ``device`` in ``dtype`` (tried
    once on a small problem; CUDA needs bf16 and compute capability 8.0+)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0)):
        return False
    try:
        x = torch.randn(16, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
        with torch.autocast(device.type, enabled=False):
            y = _contiguous_grad(F.grouped_mm(x, w, offs=offs))
            y.float().sum().backward()
        expected = torch.cat([x[:8] @ w[0], x[8:] @ w[1]])
        return bool(torch.allclose(y.float(), expected.float(), rtol=2e-2, atol=2e-2)) and w.grad is not None
    except (RuntimeError, NotImplementedError):
        return False
