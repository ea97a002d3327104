"""Publishing the change of a surrogate as a low-rank factorisation with error feedback.

After a refresh the owner sends, for every 2-D surrogate weight W, the best rank-r approximation
U @ V of (W - P), where P is what the receivers currently hold. The owner keeps P itself (the
explicit mirror ``published``) and adds the same U @ V to it, so whatever the rank cut off stays in
W - P and goes out with the next refresh: error feedback with no separate residual buffer. A fixed
target is reached in about min(m, n) / r refreshes; a [m, n] weight costs r * (m + n) numbers a
refresh instead of m * n.

Tensors that are not 2-D (biases, norm gains: small) are sent dense: their entry is
(dense change, empty tensor), and they are mirrored exactly at once.

Shape legend: m, n the weight's shape, r the rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

Factors = tuple[torch.Tensor, torch.Tensor]
"""(U [m, r], V [r, n]) for a 2-D tensor; (dense change, empty tensor) for any other tensor."""


def low_rank_factors(matrix: torch.Tensor, rank: int) -> Factors:
    """The best rank-r approximation U @ V of a matrix (truncated SVD, Eckart-Young).

    Args:
        matrix: [m, n], any floating dtype (computed in at least float32).
        rank: requested rank r >= 1; clipped to min(m, n).

    Returns:
        (U [m, r] with the singular values folded in, V [r, n]), in at least float32 on matrix's device.

    Raises:
        ValueError: not a 2-D matrix, rank < 1, or non-finite entries.
    """
    if matrix.dim() != 2:
        raise ValueError(f"low_rank_factors needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    a = matrix.detach().to(torch.promote_types(matrix.dtype, torch.float32))
    if not torch.isfinite(a).all():
        raise ValueError("cannot factor a matrix with NaN or infinite entries")
    r = min(rank, *a.shape)
    u_mr, s_r, vh_rn = torch.linalg.svd(a, full_matrices=False)
    return u_mr[:, :r] * s_r[:r], vh_rn[:r].clone()


def _is_dense(factors: Factors) -> bool:
    return factors[1].numel() == 0


@torch.no_grad()
def change_of(factors: Factors) -> torch.Tensor:
    """The dense change a delta's factors stand for, on the CPU (their product in float32)."""
    u, v = factors
    return u.detach().cpu() if _is_dense(factors) else u.detach().cpu().float() @ v.detach().cpu().float()


@torch.no_grad()
def _add(target: torch.Tensor, factors: Factors) -> None:
    # The one place a delta is added, used by the owner's mirror and by every receiver, so both do
    # bit-identical arithmetic: product on the CPU in float32, then cast to the target's dtype.
    change = change_of(factors)
    if change.shape != target.shape:
        raise ValueError(
            f"delta of shape {tuple(change.shape)} does not fit a tensor of shape {tuple(target.shape)}")
    target.add_(change.to(device=target.device, dtype=target.dtype))


def apply_delta(target: Mapping[str, torch.Tensor], factors: Mapping[str, Factors]) -> None:
    """Receiver side: add each published change to the held surrogate, in place.

    Args:
        target: name -> tensor held by the receiver (parameters allowed; updated under no_grad).
        factors: name -> factors from ``ErrorFeedbackPublisher.delta``; names not in it are unchanged.

    Raises:
        ValueError: a name the target lacks, or a change of the wrong shape.
    """
    missing = set(factors) - set(target)
    if missing:
        raise ValueError(f"delta has tensors {sorted(missing)} that the receiver does not hold")
    for name, f in factors.items():
        _add(target[name], f)


class ErrorFeedbackPublisher:
    """Owner side: turns the current surrogate into rank-r deltas against what receivers hold."""

    def __init__(self, initial: Mapping[str, torch.Tensor], rank: int = 8, *, half: bool = False) -> None:
        """Args:
            initial: name -> tensor that every receiver holds now (e.g. the surrogate at init or
                at the last full copy). Copied to the CPU, keeping its dtype, so the mirror
                rounds exactly like a receiver that holds that dtype.
            rank: rank r of the published deltas.
            half: round every sent tensor to float16 values (half the bytes on the wire; see
                ``to_half``); error feedback carries the rounding error to the next refresh.

        Raises:
            ValueError: rank < 1.
        """
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank = rank
        self.half = half
        self.published: dict[str, torch.Tensor] = {n: t.detach().cpu().clone() for n, t in initial.items()}

    def _check(self, current: Mapping[str, torch.Tensor]) -> None:
        if set(current) != set(self.published):
            raise ValueError(
                f"current tensors {sorted(current)} != published tensors {sorted(self.published)}")
        for name, p in self.published.items():
            if current[name].shape != p.shape:
                raise ValueError(f"{name} has shape {tuple(current[name].shape)}, published {tuple(p.shape)}")

    def residual(self, current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Returns: name -> current - published (float32, CPU): what receivers are still missing."""
        self._check(current)
        return {n: current[n].detach().cpu().float() - p.float() for n, p in self.published.items()}

    def delta(self, current: Mapping[str, torch.Tensor]) -> dict[str, Factors]:
        """Factor the change receivers are missing and record it as sent.

        Args:
            current: name -> the owner's surrogate now, same names and shapes as ``initial``.

        Returns:
            name -> (U [m, r], V [r, n]) for 2-D tensors where r (m + n) < m n, (dense change, empty)
            for the others;
            CPU float32. Send all of it: the mirror already counts it as received.

        Raises:
            ValueError: names or shapes differ from ``initial``, or non-finite values.
        """
        out: dict[str, Factors] = {}
        for name, diff in self.residual(current).items():
            # Factors only where they are smaller than the change itself: r (m + n) < m n. A narrow
            # matrix (a small surrogate's 8 x 128 projection) goes dense, exactly and in fewer bytes.
            if diff.dim() == 2 and self.rank * sum(diff.shape) < diff.numel():
                f = low_rank_factors(diff, self.rank)
            else:
                if not torch.isfinite(diff).all():
                    raise ValueError(f"{name} has NaN or infinite entries")
                f = (diff, torch.empty(0))
            if self.half:
                f = (to_half(f[0]), to_half(f[1]))
            _add(self.published[name], f)
            out[name] = f
        return out

    def full(self) -> dict[str, torch.Tensor]:
        """Returns: a copy of what receivers hold, for a joiner to catch up before applying deltas."""
        return {n: p.clone() for n, p in self.published.items()}


def to_half(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float16 values, kept as float32; unchanged where a value lies beyond float16's
    range (a diverging surrogate still publishes, at full width).

    The owner adds exactly these values to its mirror and the wire carries them losslessly as float16
    (``is_half_exact``), so receivers stay bit-identical to the mirror.
    """
    rounded = t.to(torch.float16)
    return rounded.float() if torch.isfinite(rounded).all() else t


def is_half_exact(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is a float16 value: it then crosses the wire in 2 bytes, losslessly."""
    return bool(torch.equal(t.to(torch.float16).float(), t.float()))


def payload_bytes(factors: Mapping[str, Factors]) -> int:
    """Bytes of a published delta's numbers on the wire (2 per float16-exact tensor's value, else 4), for
    bandwidth accounting; framing excluded."""
    return sum((2 if is_half_exact(t) else 4) * t.numel() for f in factors.values() for t in f)
