"""Surrogate refresh: an owner distils each owned expert into its low-rank surrogate.

Every S steps the owner fits the surrogate s_e (SwiGLU l -> r -> l) to its real expert E_e (l -> f -> l)
on activations it already computed: the inputs the router sent to e during recent steps, kept in a
ring buffer. A few Adam steps on ||s(x) - E(x)||^2, then the change of the surrogate is published as a
low-rank delta with error feedback (``lowrank.ErrorFeedbackPublisher``). The distiller's optimizer
state is discarded after each refresh: composers keep no optimizer state for surrogates.
"""

from __future__ import annotations

import torch
from torch import nn


class ActivationBuffer:
    """The most recent ``capacity`` expert inputs x [L] routed to one expert (a ring buffer).

    Args:
        capacity: rows kept.
        width: the latent width l.
    """

    def __init__(self, capacity: int, width: int) -> None:
        self._rows_CL = torch.zeros(capacity, width)
        self._next = 0
        self._filled = 0

    def add(self, x_NL: torch.Tensor) -> None:
        """Append rows (detached, copied to CPU float32), overwriting the oldest when full."""
        x_NL = x_NL.detach().to("cpu", torch.float32)
        capacity = self._rows_CL.shape[0]
        if x_NL.shape[0] >= capacity:
            self._rows_CL.copy_(x_NL[-capacity:])
            self._next, self._filled = 0, capacity
            return
        end = self._next + x_NL.shape[0]
        if end <= capacity:
            self._rows_CL[self._next : end] = x_NL
        else:
            split = capacity - self._next
            self._rows_CL[self._next :] = x_NL[:split]
            self._rows_CL[: end - capacity] = x_NL[split:]
        self._next = end % capacity
        self._filled = min(capacity, self._filled + x_NL.shape[0])

    def __len__(self) -> int:
        return self._filled

    def rows(self) -> torch.Tensor:
        """The buffered rows [n, L] (order does not matter for distillation)."""
        return self._rows_CL[: self._filled]

    def state(self) -> tuple[torch.Tensor, int, int]:
        """(filled slots in slot order, write position, filled count): enough to restore bit-exactly."""
        return self._rows_CL[: self._filled], self._next, self._filled

    @classmethod
    def restore(cls, capacity: int, width: int, rows: torch.Tensor, next_slot: int, filled: int) -> ActivationBuffer:
        """The buffer ``state()`` described (checkpoints)."""
        if not 0 <= next_slot < capacity or not 0 <= filled <= capacity or rows.shape != (filled, width):
            raise ValueError(f"buffer state (rows {tuple(rows.shape)}, next {next_slot}, filled {filled}) "
                             f"does not fit capacity {capacity} x width {width}")
        buf = cls(capacity, width)
        buf._rows_CL[:filled] = rows
        buf._next, buf._filled = next_slot, filled
        return buf


class ActivationRecorder:
    """Owns one ``ActivationBuffer`` per owned (layer, expert); plugs into ``MoETransformer.set_recorder``."""

    def __init__(self, capacity: int, width: int) -> None:
        self.capacity, self.width = capacity, width
        self.buffers: dict[tuple[int, int], ActivationBuffer] = {}

    def __call__(self, layer: int, expert: int, x_NL: torch.Tensor) -> None:
        key = (layer, expert)
        if key not in self.buffers:
            self.buffers[key] = ActivationBuffer(self.capacity, self.width)
        self.buffers[key].add(x_NL)

    def rows(self, layer: int, expert: int) -> torch.Tensor | None:
        buffer = self.buffers.get((layer, expert))
        return buffer.rows() if buffer is not None and len(buffer) else None

    def drop(self, layer: int, expert: int) -> None:
        """Forget the rows of an expert no longer owned here (nothing happens if it has none)."""
        self.buffers.pop((layer, expert), None)


def distill(surrogate: nn.Module, expert: nn.Module, x_NL: torch.Tensor, *, steps: int, lr: float,
            jacobian_weight: float = 0.0, seed: int = 0) -> float:
    """Fit ``surrogate`` to ``expert`` on inputs ``x_NL`` with ``steps`` full-batch Adam steps.

    The objective is the relative output error ||s(x) - E(x)||^2 / ||E(x)||^2, plus, with
    ``jacobian_weight`` w > 0, w times the relative error of the input gradients the two pass back,
    ||J_s(x)^T u - J_E(x)^T u||^2 / ||J_E(x)^T u||^2, for one fixed Gaussian probe u per row (in
    expectation over u: the Frobenius error of the input Jacobian). A stand-in whose input gradient feeds
    the backbone (``surrogate.input_grad``) is judged by its backward pass as much as by its forward.

    The expert is only read (its targets are computed once). The surrogate's parameters may have
    ``requires_grad=False`` (as on a composer); they are enabled for the fit only.

    Args:
        surrogate: the low-rank SwiGLU to update in place.
        expert: the real expert, the teacher.
        x_NL: inputs routed to the expert.
        steps: optimizer steps.
        lr: Adam learning rate.
        jacobian_weight: weight of the input-gradient term (0: outputs only).
        seed: seed of the probes (the fit is deterministic given it).

    Returns:
        The relative squared output error after the fit (``relative_error``).
    """
    device = next(surrogate.parameters()).device
    x_NL = x_NL.to(device)
    probe_NL = target_jac_NL = None
    if jacobian_weight > 0:
        generator = torch.Generator(device="cpu").manual_seed(seed)
        probe_NL = torch.randn(x_NL.shape, generator=generator).to(device)
        x_NL = x_NL.detach().requires_grad_(True)
        (target_jac_NL,) = torch.autograd.grad(expert(x_NL), x_NL, probe_NL)
        jac_scale = target_jac_NL.pow(2).sum().clamp_min(1e-12)
    with torch.no_grad():
        target_NL = expert(x_NL)
        out_scale = target_NL.pow(2).sum().clamp_min(1e-12)
    params = list(surrogate.parameters())
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    try:
        opt = torch.optim.Adam(params, lr=lr)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            y_NL = surrogate(x_NL)
            loss = (y_NL - target_NL).pow(2).sum() / out_scale
            if probe_NL is not None and target_jac_NL is not None:
                (jac_NL,) = torch.autograd.grad(y_NL, x_NL, probe_NL, create_graph=True)
                loss = loss + jacobian_weight * (jac_NL - target_jac_NL).pow(2).sum() / jac_scale
            loss.backward()
            opt.step()
    finally:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
            p.grad = None
    return relative_error(surrogate, expert, x_NL.detach())


@torch.no_grad()
def jacobian_error(surrogate: nn.Module, expert: nn.Module, x_NL: torch.Tensor, seed: int = 1) -> float:
    """||J_s^T u - J_E^T u||^2 / ||J_E^T u||^2 for Gaussian probes u (one per row) on ``x_NL``: how well the
    surrogate's backward pass stands in for its expert's (an estimate of the relative Frobenius error)."""
    probe_NL = torch.randn(x_NL.shape, generator=torch.Generator(device="cpu").manual_seed(seed)).to(x_NL.device)
    with torch.enable_grad():
        x_NL = x_NL.detach().requires_grad_(True)
        (target_NL,) = torch.autograd.grad(expert(x_NL), x_NL, probe_NL)
        (got_NL,) = torch.autograd.grad(surrogate(x_NL), x_NL, probe_NL)
    return float((got_NL - target_NL).pow(2).sum() / target_NL.pow(2).sum().clamp_min(1e-12))


@torch.no_grad()
def relative_error(surrogate: nn.Module, expert: nn.Module, x_NL: torch.Tensor) -> float:
    """||s(x) - E(x)||^2 / ||E(x)||^2 on ``x_NL``: how well the surrogate stands in for its expert."""
    target_NL = expert(x_NL)
    return float((surrogate(x_NL) - target_NL).pow(2).sum() / target_NL.pow(2).sum().clamp_min(1e-12))
