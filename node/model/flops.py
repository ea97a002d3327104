"""FLOP accounting of one composer's training step, analytic and from a ModelConfig.

The report's compute model (DESIGN.md section 3): a composer of C runs the real experts it owns
(1/C of the routed tokens) with a full training step (forward + backward = 3x forward), and the
surrogates of the experts it does not own forward only (1x, with r/f of an expert's FLOPs):

    routed speed-up          1 / (1/C + (1 - 1/C) (r/f) / 3)            7.63x at C=8, f/r=48
    with worker offload      1 / ((1/C) / 3 + (1 - 1/C) (r/f) / 3)      20.95x (owned experts forward only)
    total active speed-up    1 / (s / routed + (1 - s)),  s = routed share of compute (0.618)

``step_flops`` counts the same thing from a config, matmul by matmul, so the two can be checked
against each other and the routed share of a real config can be measured instead of assumed.
Counting rules: a matmul of an n -> m projection costs 2*m*n FLOPs per token forward; backward
costs 2x forward; elementwise ops, softmax, norms and embeddings lookups are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from parallax.node.config.train import ModelConfig

REPORT_ROUTED_SHARE = 0.618
"""Routed experts' share of active training compute in the report's baseline."""

NON_OWNED = ("surrogate", "frozen_copy", "drop")


def routed_speedup(composers: int, f_over_r: float, *, stand_in_input_grad: bool = False) -> float:
    """Routed-expert compute of the synchronous baseline / of one composer of C (no offload).

    Args:
        composers: C >= 1.
        f_over_r: expert hidden width over surrogate hidden width, f/r > 0.
        stand_in_input_grad: surrogates also backpropagate into their input (2x forward instead of 1x).

    Returns:
        1 / (1/C + (1 - 1/C) * (r/f) * k / 3), k = 2 with the input gradient, else 1 (the report's).
    """
    _check_analytic(composers, f_over_r)
    c = 1.0 / composers
    k = 2.0 if stand_in_input_grad else 1.0
    return 1.0 / (c + (1.0 - c) * k / f_over_r / 3.0)


def offload_routed_speedup(composers: int, f_over_r: float, *, stand_in_input_grad: bool = False,
                           offload_input_grad: bool = False) -> float:
    """Like ``routed_speedup`` with the owned experts' update offloaded (forward only on the composer).

    Args:
        composers: C >= 1.
        f_over_r: expert hidden width over surrogate hidden width, f/r > 0.
        stand_in_input_grad: surrogates also backpropagate into their input (2x forward instead of 1x).
        offload_input_grad: offloaded experts also backpropagate into their input (2x forward).

    Returns:
        1 / ((1/C) * j / 3 + (1 - 1/C) * (r/f) * k / 3), k (j) = 2 with the surrogates' (offloaded
        experts') input gradient, else 1 (the report's formula has j = k = 1).
    """
    _check_analytic(composers, f_over_r)
    return offload_routed_speedup_at(1.0 / composers, f_over_r, stand_in_input_grad=stand_in_input_grad,
                                     offload_input_grad=offload_input_grad)


def offload_routed_speedup_at(owned_fraction: float, f_over_r: float, *, stand_in_input_grad: bool = False,
                              offload_input_grad: bool = False) -> float:
    """``offload_routed_speedup`` with a composer's own share c of the routed selections in place of 1/C
    (a measured share under unbalanced routing): 1 / (c * j / 3 + (1 - c) * (r/f) * k / 3)."""
    c = owned_fraction
    k = 2.0 if stand_in_input_grad else 1.0
    j = 2.0 if offload_input_grad else 1.0
    return 1.0 / (c * j / 3.0 + (1.0 - c) * k / f_over_r / 3.0)


def total_speedup(routed: float, routed_share: float = REPORT_ROUTED_SHARE) -> float:
    """Total active-compute speed-up when only the routed part gets ``routed`` times cheaper (Amdahl).

    Args:
        routed: routed-expert speed-up (> 0).
        routed_share: routed experts' share of the baseline's active compute, in [0, 1].

    Returns:
        1 / (routed_share / routed + (1 - routed_share)).

    Raises:
        ValueError: routed <= 0 or routed_share outside [0, 1].
    """
    if routed <= 0 or not 0 <= routed_share <= 1:
        raise ValueError(f"need routed > 0 and 0 <= routed_share <= 1, got {routed}, {routed_share}")
    return 1.0 / (routed_share / routed + (1.0 - routed_share))


def _check_analytic(composers: int, f_over_r: float) -> None:
    if composers < 1 or f_over_r <= 0:
        raise ValueError(f"need composers >= 1 and f_over_r > 0, got {composers}, {f_over_r}")


@dataclass(frozen=True, slots=True)
class FlopBreakdown:
    """FLOPs per token of one training step (forward + backward where trained), by part."""

    backbone: float
    """Attention (projections and scores), the shared expert if any: every layer."""
    router: float
    """Router scores over all E experts: every layer."""
    latent: float
    """Latent interface down- and up-projection (0 when l == d)."""
    experts: float
    """Real routed experts run on this composer (owned ones; all of them in the baseline)."""
    surrogates: float
    """Stand-ins for non-owned experts: surrogates, or frozen full copies; forward only."""
    head: float
    """Output projection to the vocabulary."""

    @property
    def routed(self) -> float:
        """Routed-expert compute: real experts plus their stand-ins."""
        return self.experts + self.surrogates

    @property
    def total(self) -> float:
        """All active compute per token."""
        return sum(getattr(self, f.name) for f in fields(self))


def step_flops(
    cfg: ModelConfig, owned_fraction: float, *, non_owned: str = "surrogate", offload: bool = False,
    stand_in_input_grad: bool = False, offload_input_grad: bool = False,
) -> FlopBreakdown:
    """FLOPs per token of one composer's training step.

    Args:
        cfg: the model.
        owned_fraction: share of the routed (token, expert) pairs that go to owned experts, in [0, 1];
            1/C for a composer of C with balanced routing, 1 for the synchronous baseline.
        non_owned: what a non-owned selection runs: "surrogate" (d_surrogate hidden units, forward
            only), "frozen_copy" (the full expert, forward only) or "drop" (nothing).
        offload: owned experts run forward only on the composer; their update runs on a worker.
        stand_in_input_grad: non-owned stand-ins also backpropagate into their input (2x forward:
            forward + the input gradient, no weight gradient).
        offload_input_grad: with ``offload``, the owned experts also backpropagate into their input (2x forward).

    Returns:
        The breakdown, FLOPs per token.

    Raises:
        ValueError: owned_fraction outside [0, 1] or an unknown non_owned.
    """
    if not 0 <= owned_fraction <= 1:
        raise ValueError(f"owned_fraction must be in [0, 1], got {owned_fraction}")
    if non_owned not in NON_OWNED:
        raise ValueError(f"non_owned must be one of {NON_OWNED}, got {non_owned!r}")
    train = 3.0  # forward + backward (input and weight gradients, each as costly as the forward)
    d, l, L = cfg.d_model, cfg.d_latent, cfg.n_layers

    def swiglu(width_in: int, hidden: int) -> float:  # gate, up and down projections, forward
        return 2.0 * 3 * width_in * hidden

    # Causal attention: a token attends to T/2 earlier tokens on average, 2*(T/2)*d for QK^T and
    # the same for AV.
    attention = 2.0 * 4 * d * d + 2 * (2.0 * (cfg.seq_len / 2) * d)
    shared = swiglu(d, cfg.d_shared) if cfg.d_shared else 0.0
    latent = 2.0 * 2 * d * l if cfg.has_latent else 0.0
    real = cfg.top_k * owned_fraction * swiglu(l, cfg.d_expert)
    other = cfg.top_k * (1.0 - owned_fraction)
    stand_in = {"surrogate": other * swiglu(l, cfg.d_surrogate),
                "frozen_copy": other * swiglu(l, cfg.d_expert), "drop": 0.0}[non_owned]
    return FlopBreakdown(
        backbone=L * train * (attention + shared),
        router=L * train * 2.0 * d * cfg.n_experts,
        latent=L * train * latent,
        experts=L * ((2.0 if offload_input_grad else 1.0) if offload else train) * real,
        # forward only (detached), or forward + input gradient: never a weight gradient
        surrogates=L * (2.0 if stand_in_input_grad else 1.0) * stand_in,
        head=train * 2.0 * d * cfg.vocab_size,
    )


def routed_share(cfg: ModelConfig) -> float:
    """Routed experts' share of the baseline's (owned_fraction = 1) active training compute.

    Returns:
        experts / total, in [0, 1].
    """
    base = step_flops(cfg, 1.0)
    return base.experts / base.total


def composer_speedup(
    cfg: ModelConfig, composers: int, *, non_owned: str = "surrogate", offload: bool = False,
    stand_in_input_grad: bool = False, offload_input_grad: bool = False,
) -> tuple[float, float]:
    """Baseline compute per token / one composer's, with balanced routing (owned_fraction = 1/C).

    Returns:
        (routed speed-up, total speed-up) from ``step_flops``.

    Raises:
        ValueError: composers < 1, or as ``step_flops``.
    """
    if composers < 1:
        raise ValueError(f"composers must be >= 1, got {composers}")
    base = step_flops(cfg, 1.0)
    mine = step_flops(cfg, 1.0 / composers, non_owned=non_owned, offload=offload,
                      stand_in_input_grad=stand_in_input_grad, offload_input_grad=offload_input_grad)
    routed = base.routed / mine.routed if mine.routed else float("inf")
    return routed, base.total / mine.total
