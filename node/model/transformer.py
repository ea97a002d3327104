"""The Parallax model: a decoder-only transformer whose feed-forward layers are Mixture-of-Experts layers
with owned experts and forward-only surrogates (DESIGN.md sections 2-3).

Each MoE layer routes every token over all E experts of the layer (the global namespace). On a composer
only the experts it *owns* are real and trainable; every other selection calls that expert's low-rank
surrogate, detached: no gradient reaches the surrogate's weights or its input, but the gate weight that
multiplies the surrogate output does get its gradient, so the router keeps learning about every expert.
With every expert owned (the synchronous baseline) the layer is an ordinary top-k MoE.

Shape legend (torchtitan style):
    B batch, T sequence, D d_model, L latent width (= D when the latent interface is off),
    E routed experts, K top-k, N tokens routed to one expert, V vocabulary, H heads, Dh head width.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from parallax.node.config.train import GROUPS, KERNELS, ModelConfig
from parallax.node.model.grouped import Weights, grouped_swiglu_parts

Ownership = tuple[frozenset[int], ...]
"""Per layer, the expert ids that are real and trained on this composer."""

NON_OWNED_MODES = ("surrogate", "drop", "frozen_copy")

_TRAINED, _OFFLOADED, _COPY, _SURROGATE, _DROPPED = range(5)
_RUN_ORDER = (_TRAINED, _OFFLOADED, _COPY, _SURROGATE)

Recorder = Callable[[int, int, torch.Tensor], None]
"""Called as recorder(layer, expert, x_NL) with the detached inputs routed to an owned expert."""

Sketcher = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
"""Called as sketcher(layer, expert, x_NL, y_NL) with a forward-only selection's input and output (a
non-owned stand-in, or an offloaded owned expert);
returns the output to use (a leaf whose gradient it hooks: see ``sketch.SketchRecorder``)."""


INIT_STD = 0.02
"""GPT-2's initialisation: weights ~ N(0, 0.02), residual projections scaled by 1 / sqrt(2 n_layers)."""

InitPlan = tuple[tuple[str, tuple[int, ...], float], ...]
"""``MoETransformer.init_plan``: (name, shape, standard deviation) of each draw, in order."""


def initial_draws(plan: InitPlan, seed: int) -> Iterator[torch.Tensor]:
    """The initial value of each entry of ``plan``, in order, from one generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    for _, shape, std in plan:
        yield torch.randn(shape, generator=gen) * std


def expert_prefix(layer: int, expert: int) -> str:
    """The parameter name prefix of expert (layer, expert) in ``MoETransformer``."""
    return f"blocks.{layer}.moe.experts.{expert}."


class InitialWeights:
    """The initial values of any weights of ``plan`` drawn with ``seed``, as ``initial_draws`` draws them, without
    replaying the draws more than once: the generator's state where each entry of ``plan`` starts is kept (about
    5 KB an entry), so a later call draws only its own tensors. Touches no model; thread-safe."""

    def __init__(self, plan: InitPlan, seed: int) -> None:
        self.plan, self.seed = plan, seed
        self._starts: list[torch.Tensor] = []  # the generator's state before entry i
        self._lock = threading.Lock()

    def __call__(self, prefix: str) -> dict[str, torch.Tensor]:
        """The weights named ``prefix``... (one expert's: ``expert_prefix``), by the rest of their names."""
        wanted = [i for i, (name, _, _) in enumerate(self.plan) if name.startswith(prefix)]
        out: dict[str, torch.Tensor] = {}
        if not wanted:
            return out
        with self._lock:
            gen = torch.Generator()
            if not self._starts:
                self._starts.append(gen.manual_seed(self.seed).get_state())
            i = min(wanted[0], len(self._starts) - 1)
            gen.set_state(self._starts[i])
            while i <= wanted[-1]:
                name, shape, std = self.plan[i]
                value = torch.randn(shape, generator=gen)
                if name.startswith(prefix):
                    out[name[len(prefix):]] = value * std
                i += 1
                if i == len(self._starts):
                    self._starts.append(gen.get_state())
        return out


def own_all(cfg: ModelConfig) -> Ownership:
    """Every expert real: the synchronous baseline and the DiLoCo reference."""
    return tuple(frozenset(range(cfg.n_experts)) for _ in range(cfg.n_layers))


class SwiGLU(nn.Module):
    """SwiGLU MLP d_in -> d_hidden -> d_in (Shazeer 2020); routed experts, surrogates, shared expert."""

    def __init__(self, d_in: int, d_hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_in, d_hidden, bias=False)
        self.w_up = nn.Linear(d_in, d_hidden, bias=False)
        self.w_down = nn.Linear(d_hidden, d_in, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        # The weights straight to a product, not through the Linear modules' calls: a token generated with the cache
        # calls K experts a layer, and each module call costs more than a one-row product.
        gate_NH = torch.mm(x_ND, self.w_gate.weight.t())
        return torch.mm(F.silu(gate_NH) * torch.mm(x_ND, self.w_up.weight.t()), self.w_down.weight.t())


def _rotary(x_BHTDh: torch.Tensor, base: float, start: int = 0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), half-split layout; the first position is ``start``.

    With x = (x1, x2) and the angles' (cos, sin): (x1 cos - x2 sin, x1 sin + x2 cos) = x (cos, cos) + (x2, x1)
    (-sin, sin), each product and sum as in the first form: three operations instead of ten (generation pays
    each of them per token and layer)."""
    T, Dh = x_BHTDh.shape[-2], x_BHTDh.shape[-1]
    # A compiled graph computes the table itself (it holds no Python cache; torch.compile warns of one).
    table = _rotary_table.__wrapped__ if torch.compiler.is_compiling() else _rotary_table
    cos_PD, signed_sin_PD = table(base, Dh, 1 << max(start + T - 1, 1).bit_length(), x_BHTDh.device, x_BHTDh.dtype)
    swapped = x_BHTDh.roll(Dh // 2, dims=-1)
    return torch.addcmul(x_BHTDh * cos_PD[start:start + T], swapped, signed_sin_PD[start:start + T])


@functools.lru_cache(maxsize=32)
def _rotary_table(base: float, Dh: int, positions: int, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, cos) and (-sin, sin) [positions, Dh] of the rotary angles of positions 0..positions - 1, computed once
    per shape (a token generated with the cache would otherwise pay a table's worth of work for its one position).
    Plain tensors even when first asked for under ``torch.inference_mode`` (generation): training uses them too."""
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = 1.0 / (base ** (torch.arange(0, Dh, 2, device=device, dtype=torch.float32) / Dh))
        angles_PF = torch.outer(torch.arange(positions, device=device, dtype=torch.float32), inv_freq)
        cos_PF, sin_PF = angles_PF.cos().to(dtype), angles_PF.sin().to(dtype)
        return torch.cat([cos_PF, cos_PF], dim=-1), torch.cat([-sin_PF, sin_PF], dim=-1)


class KVCache:
    """One attention layer's keys and values of the positions seen so far (generation: each new token then costs
    one position, not the whole context). Held in buffers of ``capacity`` positions, written in place (a new token
    copies no earlier one); a longer sequence doubles them."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self.length = 0
        self._k_BHCDh: torch.Tensor | None = None
        self._v_BHCDh: torch.Tensor | None = None

    def extend(self, k_BHTDh: torch.Tensor, v_BHTDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' keys and values; returns all of them."""
        end = self.length + k_BHTDh.shape[-2]
        if self._k_BHCDh is None or self._v_BHCDh is None or end > self._k_BHCDh.shape[-2]:
            size = max(end, self.capacity, 2 * (0 if self._k_BHCDh is None else self._k_BHCDh.shape[-2]))
            shape = (*k_BHTDh.shape[:-2], size, k_BHTDh.shape[-1])
            k_BHCDh, v_BHCDh = k_BHTDh.new_empty(shape), v_BHTDh.new_empty(shape)
            if self._k_BHCDh is not None and self._v_BHCDh is not None:
                k_BHCDh[..., :self.length, :] = self._k_BHCDh[..., :self.length, :]
                v_BHCDh[..., :self.length, :] = self._v_BHCDh[..., :self.length, :]
            self._k_BHCDh, self._v_BHCDh = k_BHCDh, v_BHCDh
        self._k_BHCDh[..., self.length:end, :] = k_BHTDh
        self._v_BHCDh[..., self.length:end, :] = v_BHTDh
        self.length = end
        return self._k_BHCDh[..., :end, :], self._v_BHCDh[..., :end, :]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.rope_base = cfg.n_heads, cfg.rope_base
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, D = x_BTD.shape
        # F.linear, not the module's call: see SwiGLU.
        qkv_BT3HDh = F.linear(x_BTD, self.qkv.weight).view(B, T, 3, self.n_heads, D // self.n_heads)
        qkv_3BHTDh = qkv_BT3HDh.permute(2, 0, 3, 1, 4)
        start = 0 if cache is None else cache.length
        q, k = _rotary(qkv_3BHTDh[:2], self.rope_base, start)  # queries and keys rotated together
        v = qkv_3BHTDh[2]
        if cache is None or start == 0:
            if cache is not None:
                cache.extend(k, v)
            y_BHTDh = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new positions after cached ones: each sees every cached position and the new ones up to itself
            k, v = cache.extend(k, v)
            mask_TS = None if T == 1 else torch.ones(T, start + T, dtype=torch.bool,
                                                     device=x_BTD.device).tril(diagonal=start)
            y_BHTDh = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_TS)  # one new position sees them all
        return F.linear(y_BHTDh.transpose(1, 2).reshape(B, T, D), self.proj.weight)

    def decode(self, x_1D: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new position after those in ``cache`` (generation), in as few operations as attention allows: its
        query, key and value from one product, rotated at its position, against every cached key."""
        D = x_1D.shape[-1]
        Dh = D // self.n_heads
        qkv_3H1Dh = torch.mm(x_1D, self.qkv.weight.t()).view(3, self.n_heads, 1, Dh)
        qk_2H1Dh = _rotary(qkv_3H1Dh[:2], self.rope_base, cache.length)
        k_1HSDh, v_1HSDh = cache.extend(qk_2H1Dh[1:], qkv_3H1Dh[2:])
        y_1H1Dh = F.scaled_dot_product_attention(qk_2H1Dh[:1], k_1HSDh, v_1HSDh)
        return torch.mm(y_1H1Dh.view(1, D), self.proj.weight.t())


@dataclass
class MoEStats:
    """What one MoE layer reports besides its output."""

    aux_loss: torch.Tensor | None
    """Load-balancing loss E * sum_e f_e * P_e over all E experts (Switch Transformer); None for one token in
    evaluation (generation), where nothing trains on it."""
    tokens_per_expert: torch.Tensor
    """int64 [E]: selections per expert in this forward."""


class MoELayer(nn.Module):
    """Router over all E experts, optional latent interface, owned experts, detached surrogates.

    Args:
        cfg: the model config.
        layer: index of this layer (for the recorder and for naming).
        owned: expert ids that are real and trained here.
        non_owned: what a non-owned selection calls — "surrogate" (forward-only low-rank stand-in),
            "drop" (contributes nothing) or "frozen_copy" (a full copy of the expert, forward-only).
    """

    def __init__(self, cfg: ModelConfig, layer: int, owned: Collection[int], non_owned: str = "surrogate") -> None:
        super().__init__()
        if non_owned not in NON_OWNED_MODES:
            raise ValueError(f"non_owned must be one of {NON_OWNED_MODES}, got {non_owned!r}")
        self.layer, self.n_experts, self.top_k = layer, cfg.n_experts, cfg.top_k
        self.renormalize = cfg.renormalize_gates
        self.non_owned = non_owned
        self.owned = frozenset(owned)
        if not self.owned <= set(range(cfg.n_experts)):
            raise ValueError(f"owned experts {sorted(self.owned)} outside 0..{cfg.n_experts - 1}")
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.latent_down = nn.Linear(cfg.d_model, cfg.d_latent, bias=False) if cfg.has_latent else None
        self.latent_up = nn.Linear(cfg.d_latent, cfg.d_model, bias=False) if cfg.has_latent else None
        # Only the experts this composer holds are materialised: owned ones, or all of them as frozen copies.
        held = range(cfg.n_experts) if non_owned == "frozen_copy" else sorted(self.owned)
        self.experts = nn.ModuleDict({str(e): SwiGLU(cfg.d_latent, cfg.d_expert) for e in held})
        self.surrogates = nn.ModuleList(SwiGLU(cfg.d_latent, cfg.d_surrogate) for _ in range(cfg.n_experts))
        self.shared = SwiGLU(cfg.d_model, cfg.d_shared) if cfg.d_shared else None
        self.recorder: Recorder | None = None
        self.sketcher: Sketcher | None = None
        self.stand_in_input_grad = False
        """Let the loss's gradient flow through a non-owned stand-in into its input (never its weights)."""
        self.offloaded: frozenset[int] = frozenset()
        """Owned experts updated by a worker (worker offload): no weight gradient here; they still get sketched."""
        self.offload_input_grad = False
        """Let the loss's gradient flow through an offloaded expert into its input (never its weights)."""
        self.kernel = "auto"
        """One of ``KERNELS``: how the experts run (the same outputs and gradients up to rounding)."""
        self._freeze_non_trainable()

    def adopt_expert(self, e: int, module: SwiGLU) -> None:
        """Make expert e owned here, with ``module`` (its weights set by the caller) as its real expert.

        The experts stay in ascending id order, the order a layer built with this ownership has, so
        ``named_parameters`` (and optimizer state keyed by it) is the same as a fresh composer's.

        Raises:
            ValueError: e is out of range, already owned, or this layer holds frozen copies.
        """
        self._check_ownership_change(e, owned=False)
        experts = {int(k): m for k, m in self.experts.items()}
        experts[e] = module
        self.experts = nn.ModuleDict({str(k): experts[k] for k in sorted(experts)})
        self.owned = self.owned | {e}
        self._freeze_non_trainable()

    def release_expert(self, e: int) -> SwiGLU:
        """Stop owning expert e: drop its real expert (selections then go to its surrogate, or nowhere).

        Returns:
            The removed module.

        Raises:
            ValueError: e is out of range, not owned, or this layer holds frozen copies.
        """
        self._check_ownership_change(e, owned=True)
        module = self.experts[str(e)]
        assert isinstance(module, SwiGLU)
        del self.experts[str(e)]
        self.owned = self.owned - {e}
        self.offloaded = self.offloaded - {e}
        return module

    def set_offloaded(self, e: int, offloaded: bool) -> None:
        """Run owned expert e forward only, its update offloaded to a worker (True), or train it here (False).

        Raises:
            ValueError: e is not owned here.
        """
        if e not in self.owned:
            raise ValueError(f"expert ({self.layer}, {e}) is not owned here: only owned experts are offloaded")
        self.offloaded = self.offloaded | {e} if offloaded else self.offloaded - {e}

    def _check_ownership_change(self, e: int, *, owned: bool) -> None:
        if self.non_owned == "frozen_copy":
            raise ValueError("experts cannot change owner with non_owned='frozen_copy' (every expert is held as "
                             "a copy); use 'surrogate' or 'drop'")
        if not 0 <= e < self.n_experts:
            raise ValueError(f"expert {e} is outside 0..{self.n_experts - 1} in layer {self.layer}")
        if (e in self.owned) != owned:
            raise ValueError(f"expert ({self.layer}, {e}) is {'not ' if owned else 'already '}owned here")

    def _freeze_non_trainable(self) -> None:
        for p in self.surrogates.parameters():
            p.requires_grad_(False)  # composers keep no optimizer state for surrogates
        for key, expert in self.experts.items():
            for p in expert.parameters():
                p.requires_grad_(int(key) in self.owned)

    def _expert_output(self, e: int, h_NL: torch.Tensor) -> torch.Tensor | None:
        if e in self.owned and e not in self.offloaded:
            return self.experts[str(e)](h_NL)
        if e in self.offloaded:
            stand_in = self.experts[str(e)]  # the real expert, no weight gradient: a worker updates it from sketches
        elif self.non_owned == "drop":
            return None
        else:
            stand_in = self.experts[str(e)] if self.non_owned == "frozen_copy" else self.surrogates[e]
        if e in self.offloaded and self.offload_input_grad and self.training:
            # Its weights are trainable here but updated by a worker: run them detached, so only the input
            # gets a gradient and the composer's optimizer never steps them.
            weights = {name: p.detach() for name, p in stand_in.named_parameters()}
            y_NL = torch.func.functional_call(stand_in, weights, (h_NL,))
        elif self.stand_in_input_grad and e not in self.offloaded and self.training:
            y_NL = stand_in(h_NL)  # its weights are frozen (requires_grad False): only the input gets a gradient
        else:
            with torch.no_grad():  # forward only: no gradient into its weights or its input
                y_NL = stand_in(h_NL.detach())
        if self.sketcher is not None and self.training:
            y_NL = self.sketcher(self.layer, e, h_NL, y_NL)
        return y_NL

    def _mix_per_expert(self, h_TL: torch.Tensor, topk_ids_TK: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
        """The reference mixture: a mask and a gather per expert (``kernel = "reference"``)."""
        out_TL = torch.zeros_like(h_TL)
        for e in range(self.n_experts):
            token_idx_N, slot_N = torch.where(topk_ids_TK == e)
            if token_idx_N.numel() == 0:
                continue
            h_NL = h_TL[token_idx_N]
            if e in self.owned and self.recorder is not None:
                self.recorder(self.layer, e, h_NL.detach())
            y_NL = self._expert_output(e, h_NL)
            if y_NL is None:
                continue
            gate_N1 = gates_TK[token_idx_N, slot_N].unsqueeze(-1).to(y_NL.dtype)
            out_TL = out_TL.index_add(0, token_idx_N, y_NL * gate_N1)
        return out_TL

    def decode(self, x_1D: torch.Tensor) -> torch.Tensor:
        """The layer's output for one token in evaluation (generation with a key-value cache)."""
        return self._route_one(x_1D)[0]

    def _route_one(self, x_1D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token in evaluation, in as few operations as the layer allows (each costs microseconds whatever its
        size): the gates from the top K logits (a softmax over them is the renormalised top K of the softmax over
        all), the K experts called one after another (no sort, no grouping), and no load-balancing loss, which
        nothing trains on here. Returns the output and the experts chosen [K]."""
        if self.training:
            raise RuntimeError("the one-token path is for evaluation: call .eval() first")
        logits_1E = torch.mm(x_1D, self.router.weight.t()).float()
        if self.renormalize:
            top_1K, ids_1K = logits_1E.topk(self.top_k, dim=-1)
            gates_1K = top_1K.softmax(dim=-1)
        else:
            gates_1K, ids_1K = logits_1E.softmax(dim=-1).topk(self.top_k, dim=-1)
        h_1L = self.latent_down(x_1D) if self.latent_down is not None else x_1D
        out_1L: torch.Tensor | None = None
        for e, gate in zip(ids_1K[0].tolist(), gates_1K[0].tolist(), strict=True):
            y_1L = self._expert_output(e, h_1L)
            if y_1L is not None:
                out_1L = y_1L * gate if out_1L is None else out_1L.add_(y_1L, alpha=gate)
        if out_1L is None:  # every selection dropped
            out_1L = torch.zeros_like(h_1L)
        return self._output(out_1L, x_1D), ids_1K[0]

    def _output(self, mixed_TL: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """The layer's output from the experts' gated mixture: back from the latent width, plus the shared expert."""
        y_TD = self.latent_up(mixed_TL) if self.latent_up is not None else mixed_TL
        return y_TD if self.shared is None else y_TD + self.shared(x_TD)

    def _kind(self, e: int) -> int:
        if e in self.owned:
            return _OFFLOADED if e in self.offloaded else _TRAINED
        return {"drop": _DROPPED, "frozen_copy": _COPY}.get(self.non_owned, _SURROGATE)

    def _mix_sorted(self, h_TL: torch.Tensor, topk_ids_TK: torch.Tensor, gates_TK: torch.Tensor,
                    tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """The selections sorted once by (kind, expert), each kind's experts run together (``node.model.grouped``).

        Kinds, in order: trained (owned), offloaded (owned, forward only), full stand-ins (frozen copies),
        surrogates, dropped (not run). Each selection's output is what ``_expert_output`` gives it.
        """
        K, E = self.top_k, self.n_experts
        kinds = [self._kind(e) for e in range(E)]
        ids_S = topk_ids_TK.reshape(-1)
        kind_E = torch.tensor(kinds, device=ids_S.device)
        order_S = torch.argsort(kind_E[ids_S] * E + ids_S, stable=True)  # stable: each expert's rows in token order
        counts = tokens_per_expert_E.tolist()
        run = [(k, [e for e in range(E) if kinds[e] == k and counts[e]]) for k in _RUN_ORDER]
        used = sum(counts[e] for _, experts in run for e in experts)
        order_S = order_S[:used]
        token_S = order_S // K
        h_SL = h_TL[token_S]
        run = [(kind, experts) for kind, experts in run if experts]
        if not run:
            return torch.zeros_like(h_TL)
        sizes = [[counts[e] for e in experts] for _, experts in run]
        parts = [y for (kind, experts), n, rows in zip(run, sizes, h_SL.split([sum(n) for n in sizes]), strict=True)
                 for y in self._run_kind(kind, experts, n, rows)]
        # Each part added in place where its rows came from: no joined copy of the outputs, no copy of the sum.
        lengths = [y.shape[0] for y in parts]
        gate_S1 = gates_TK.reshape(-1)[order_S].unsqueeze(-1)
        out_TL = torch.zeros_like(h_TL, dtype=parts[0].dtype)
        for y, tokens, gate in zip(parts, token_S.split(lengths), gate_S1.split(lengths), strict=True):
            out_TL.index_add_(0, tokens, y * gate.to(y.dtype))
        return out_TL

    def _run_kind(self, kind: int, experts: list[int], counts: list[int], rows: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of one kind's experts over their rows, in consecutive parts (``grouped_swiglu_parts``)."""
        owned = kind in (_TRAINED, _OFFLOADED)
        if owned and self.recorder is not None:
            for e, part in zip(experts, rows.detach().split(counts), strict=True):
                self.recorder(self.layer, e, part)
        modules = [cast(SwiGLU, self.surrogates[e] if kind == _SURROGATE else self.experts[str(e)]) for e in experts]
        weights: Weights = ([m.w_gate.weight for m in modules], [m.w_up.weight for m in modules],
                            [m.w_down.weight for m in modules])
        method = self.kernel
        if method == "auto":
            # On CUDA one kernel per projection for all experts, and the surrogates (many, narrow) as one padded bmm;
            # on a CPU a matmul per slice is as fast (docs/benchmarks.md) and stacks no copy of the weights.
            method = ("padded" if kind == _SURROGATE else "grouped_mm") if rows.is_cuda else "slices"
        if kind == _TRAINED:
            return grouped_swiglu_parts(rows, counts, weights, method)
        input_grad = self.training and (self.offload_input_grad if kind == _OFFLOADED else self.stand_in_input_grad)
        if input_grad:  # the weights get no gradient (frozen, or updated by a worker); the input does
            detached: Weights = ([w.detach() for w in weights[0]], [w.detach() for w in weights[1]],
                                 [w.detach() for w in weights[2]])
            ys = grouped_swiglu_parts(rows, counts, detached, method)
        else:
            with torch.no_grad():
                ys = grouped_swiglu_parts(rows.detach(), counts, weights, method)
        if self.sketcher is None or not self.training:
            return ys
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return [self.sketcher(self.layer, e, x, out) for e, x, out
                in zip(experts, rows.split(counts), y.split(counts), strict=True)]

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        if B * T == 1 and not self.training and self.recorder is None and self.kernel != "reference":
            y_1D, chosen_K = self._route_one(x_TD)
            return y_1D.view(B, T, D), MoEStats(None, torch.bincount(chosen_K, minlength=self.n_experts))
        probs_TE = F.softmax(self.router(x_TD).float(), dim=-1)
        topk_probs_TK, topk_ids_TK = probs_TE.topk(self.top_k, dim=-1)
        gates_TK = topk_probs_TK / topk_probs_TK.sum(-1, keepdim=True) if self.renormalize else topk_probs_TK
        tokens_per_expert_E = torch.bincount(topk_ids_TK.flatten(), minlength=self.n_experts)
        # Switch-style balance over the global namespace: fraction routed x mean router probability.
        frac_E = tokens_per_expert_E.float() / (B * T * self.top_k)
        aux_loss = self.n_experts * (frac_E * probs_TE.mean(0)).sum()

        h_TL = self.latent_down(x_TD) if self.latent_down is not None else x_TD
        if self.kernel == "reference":
            out_TL = self._mix_per_expert(h_TL, topk_ids_TK, gates_TK)
        else:
            out_TL = self._mix_sorted(h_TL, topk_ids_TK, gates_TK, tokens_per_expert_E)
        return self._output(out_TL, x_TD).view(B, T, D), MoEStats(aux_loss, tokens_per_expert_E)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, owned: Collection[int], non_owned: str) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.moe_norm = nn.RMSNorm(cfg.d_model)
        self.moe = MoELayer(cfg, layer, owned, non_owned)

    def forward(self, x_BTD: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, MoEStats]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cache)
        y_BTD, stats = self.moe(self.moe_norm(x_BTD))
        return x_BTD + y_BTD, stats

    def decode(self, x_1D: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``forward`` of one token after those in ``cache``, in evaluation (``MoETransformer.decode``)."""
        x_1D = x_1D + self.attn.decode(self.attn_norm(x_1D), cache)
        return x_1D + self.moe.decode(self.moe_norm(x_1D))


@dataclass
class ModelOutput:
    logits: torch.Tensor
    """[B, T, V]"""
    loss: torch.Tensor | None
    """Cross-entropy + aux_loss_weight x mean load-balancing loss (the cross-entropy alone where ``aux_loss`` is
    None); None without targets."""
    ce_loss: torch.Tensor | None
    """Cross-entropy alone, nats per token (per byte with the byte vocabulary)."""
    aux_loss: torch.Tensor | None
    """Mean load-balancing loss over the MoE layers; None for one token in evaluation (generation)."""
    tokens_per_expert: torch.Tensor
    """int64 [n_layers, E]"""


class MoETransformer(nn.Module):
    """Decoder-only MoE transformer (pre-norm, rotary, tied embeddings).

    Args:
        cfg: the model config.
        owned: per layer, the experts that are real on this composer; None = all (the baseline).
        non_owned: see ``MoELayer``.
        seed: initialisation seed. Every composer of a run uses the same seed, so all start from the same
            shared weights and the same surrogates, and an owner's expert equals the baseline's.
    """

    def __init__(self, cfg: ModelConfig, owned: Ownership | None = None, non_owned: str = "surrogate",
                 seed: int = 0) -> None:
        super().__init__()
        owned = own_all(cfg) if owned is None else owned
        if len(owned) != cfg.n_layers:
            raise ValueError(f"ownership covers {len(owned)} layers, the model has {cfg.n_layers}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i, owned[i], non_owned) for i in range(cfg.n_layers))
        self.norm_f = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.checkpoint_blocks = False
        """Activation checkpointing: each block keeps its input only and runs again in the backward pass (the
        recomputation records no rows: see ``_recorder_paused``). Not with a sketcher, whose hooks would run
        twice (``TrainConfig`` refuses the combination)."""
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        """GPT-2 initialisation, drawn in a fixed order over *all* experts so that the weights of expert
        (l, e) do not depend on which experts this composer holds."""
        with torch.no_grad():
            for _, p, value in self._init_draws(seed):
                p.copy_(value)

    def _init_draws(self, seed: int) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, parameter or throwaway, initial value) in canonical order; 1-D weights (RMSNorm gains,
        which stay 1) draw nothing and are skipped. The values come from ``initial_draws`` over ``init_plan``,
        the one source of them, so that ``initial_expert_weights`` replays exactly what ``_init_weights`` drew."""
        drawn = [(name, p) for name, p in self._canonical_parameters() if p.dim() > 1]
        for (name, p), value in zip(drawn, initial_draws(self.init_plan(), seed), strict=True):
            yield name, p, value

    def init_plan(self) -> InitPlan:
        """What the initialisation draws, in canonical order: (name, shape, standard deviation) of every weight
        with more than one dimension. Plain data: ``InitialWeights(plan, seed)`` replays it on any
        thread without touching the model."""
        resid_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        return tuple((name, tuple(p.shape),
                      resid_std if name.endswith(("proj.weight", "w_down.weight", "latent_up.weight")) else INIT_STD)
                     for name, p in self._canonical_parameters() if p.dim() > 1)

    def initial_expert_weights(self, layer: int, expert: int, seed: int) -> dict[str, torch.Tensor]:
        """The weights expert (layer, expert) had at initialisation with ``seed``, held here or not.

        Every composer of a run draws the same values for it (see ``_init_weights``), so a composer that
        adopts an expert with no snapshot starts it where its first owner did. The generator is replayed
        up to that expert: this costs a share of a model initialisation, one tensor of memory at a time.

        Args:
            layer: the expert's layer.
            expert: the expert's index in that layer.
            seed: the initialisation seed the model was built with (``TrainConfig.seed``).

        Returns:
            Name as in ``expert_parameters`` (e.g. "w_gate.weight") -> CPU float32 tensor.

        Raises:
            ValueError: no such expert.
        """
        if not (0 <= layer < self.cfg.n_layers and 0 <= expert < self.cfg.n_experts):
            raise ValueError(f"no expert ({layer}, {expert}): layers 0..{self.cfg.n_layers - 1}, "
                             f"experts 0..{self.cfg.n_experts - 1}")
        return InitialWeights(self.init_plan(), seed)(expert_prefix(layer, expert))

    def _canonical_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters in a fixed order that includes every expert of the model, held or not.

        An expert not held here yields a throwaway tensor of its shape, which consumes the same draws
        from the generator, so initialisation is identical across composers.
        """
        cfg = self.cfg
        yield "tok_emb.weight", self.tok_emb.weight
        for i, block in enumerate(self.blocks):
            for name, p in block.named_parameters():
                if ".experts." in f".{name}":
                    continue
                yield f"blocks.{i}.{name}", p
            moe = self.moe_layer(i)
            for e in range(cfg.n_experts):
                held = moe.experts[str(e)] if str(e) in moe.experts else None  # noqa: SIM401
                shapes = {"w_gate": (cfg.d_expert, cfg.d_latent), "w_up": (cfg.d_expert, cfg.d_latent),
                          "w_down": (cfg.d_latent, cfg.d_expert)}
                for part, shape in shapes.items():
                    name = f"{expert_prefix(i, e)}{part}.weight"
                    if held is not None:
                        yield name, getattr(held, part).weight
                    else:
                        yield name, torch.empty(shape)

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None, *,
                cache: list[KVCache] | None = None) -> ModelOutput:
        """Logits of ``idx_BT`` (and the loss against ``targets_BT``); with ``cache`` (``new_cache``), ``idx_BT``
        continues the positions cached there, whose keys and values it extends."""
        x_BTD = self.tok_emb(idx_BT)
        aux: list[torch.Tensor | None] = []
        counts: list[torch.Tensor] = []
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if cache is not None:
                x_BTD, stats = block(x_BTD, cache[i])
            elif recompute:
                x_BTD, stats = torch.utils.checkpoint.checkpoint(
                    block, x_BTD, use_reentrant=False, context_fn=partial(_contexts, cast(Block, block).moe))
            else:
                x_BTD, stats = block(x_BTD)
            aux.append(stats.aux_loss)
            counts.append(stats.tokens_per_expert)
        logits_BTV = self.head(self.norm_f(x_BTD))
        known = [a for a in aux if a is not None]
        aux_loss = torch.stack(known).mean() if len(known) == len(aux) else None
        loss = ce = None
        if targets_BT is not None:
            ce = F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.size(-1)).float(), targets_BT.reshape(-1))
            loss = ce if aux_loss is None else ce + self.cfg.aux_loss_weight * aux_loss
        return ModelOutput(logits_BTV, loss, ce, aux_loss, torch.stack(counts))

    def decode(self, token: int, cache: list[KVCache]) -> torch.Tensor:
        """The next-token logits [V] after ``token``, which continues the positions in ``cache`` (``new_cache``),
        in evaluation: what ``forward`` gives for one position with that cache (``logits[0, -1]``), without the
        module calls, batch shapes and statistics that cost a one-row forward more than its products (generation
        pays them each token)."""
        x_1D = self.tok_emb.weight[token].unsqueeze(0)
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            x_1D = cast(Block, block).decode(x_1D, layer_cache)
        return torch.mm(self.norm_f(x_1D), self.head.weight.t())[0]

    def new_cache(self) -> list[KVCache]:
        """An empty key-value cache for ``forward(..., cache=)``, one per block, sized to the model's window."""
        return [KVCache(self.cfg.seq_len) for _ in self.blocks]

    # ---- parameter groups -------------------------------------------------------------------------

    def moe_layer(self, layer: int) -> MoELayer:
        """The MoE layer of block ``layer``."""
        # nn.ModuleList is not generic: mypy types its items as nn.Module; every item here is a Block.
        return cast(Block, self.blocks[layer]).moe

    def moe_layers(self) -> list[MoELayer]:
        return [self.moe_layer(i) for i in range(len(self.blocks))]

    def group_parameters(self, group: str) -> dict[str, nn.Parameter]:
        """The named parameters of one group (see config.GROUPS)."""
        if group not in GROUPS:
            raise ValueError(f"unknown parameter group {group!r}; groups are {GROUPS}")
        return {name: p for name, p in self.named_parameters() if group_of(name) == group}

    def expert_parameters(self, layer: int, expert: int) -> dict[str, nn.Parameter]:
        return dict(self.moe_layer(layer).experts[str(expert)].named_parameters())

    def surrogate_parameters(self, layer: int, expert: int) -> dict[str, nn.Parameter]:
        return dict(self.moe_layer(layer).surrogates[expert].named_parameters())

    def drop_surrogates(self) -> None:
        """Make this a model with every expert real and nothing else, as an export holds it: the surrogates (the
        composers' stand-ins, never selected once every expert is real) are removed.

        Raises:
            ValueError: a layer lacks some of its real experts (they would have no stand-in).
        """
        for layer in self.moe_layers():
            if len(layer.experts) != layer.n_experts:
                raise ValueError(f"layer {layer.layer} holds {len(layer.experts)} of its {layer.n_experts} experts: "
                                 "its surrogates stand in for the others")
            layer.surrogates = nn.ModuleList()
            layer.non_owned = "drop"

    def set_kernel(self, kernel: str) -> None:
        """Run every MoE layer's experts with ``kernel`` (one of ``KERNELS``)."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        for layer in self.moe_layers():
            layer.kernel = kernel

    def set_recorder(self, recorder: Recorder | None) -> None:
        for layer in self.moe_layers():
            layer.recorder = recorder

    def set_sketcher(self, sketcher: Sketcher | None) -> None:
        for layer in self.moe_layers():
            layer.sketcher = sketcher


def _contexts(moe: MoELayer) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """A checkpointed block's (forward, recomputation) contexts: ``torch.utils.checkpoint``'s ``context_fn``."""
    return contextlib.nullcontext(), _recorder_paused(moe)


@contextlib.contextmanager
def _recorder_paused(moe: MoELayer) -> Iterator[None]:
    """A checkpointed block's recomputation: its owned experts' inputs were recorded in the forward pass."""
    recorder, moe.recorder = moe.recorder, None
    try:
        yield
    finally:
        moe.recorder = recorder


def group_of(name: str) -> str:
    """The parameter group of a parameter name of ``MoETransformer``."""
    if ".moe.router." in name:
        return "router"
    if ".moe.latent_" in name:
        return "latent"
    if ".moe.experts." in name:
        return "expert"
    if ".moe.surrogates." in name:
        return "surrogate"
    return "backbone"  # embeddings (tied head), attention, norms, shared expert
