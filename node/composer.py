"""One composer: its model (owned experts real, the rest as surrogates), its inner optimizer, its data,
its outer optimizers, and the owner side of surrogate refresh.

The composer does no I/O. What would cross the network is exposed as plain methods the caller drives
between steps: ``refresh_surrogates`` (owner -> everyone), ``apply_surrogate_delta`` (receiver),
``pseudo_gradient`` / ``apply_outer`` (tiered outer sync). The in-process simulator (``sim.py``) calls
them directly; the P2P node calls the same methods from its background exchange at its one seam.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from parallax.node.config import SHARED_GROUPS, TrainConfig
from parallax.node.data import BatchSampler
from parallax.node.lowrank import ErrorFeedbackPublisher, apply_delta
from parallax.node.model import MoETransformer, Ownership
from parallax.node.outer import OuterOptimizer
from parallax.node.sketch import Sketch, SketchRecorder, accumulate_expert_gradient, compress
from parallax.node.surrogate import ActivationRecorder, distill

ExpertId = tuple[int, int]
"""(layer, expert)"""


@dataclass
class StepStats:
    loss: float
    ce_loss: float
    aux_loss: float
    tokens: int


def lr_lambda(optim_warmup: int, total_steps: int, min_ratio: float):  # type: ignore[no-untyped-def]
    """Linear warm-up then cosine decay to ``min_ratio`` at ``total_steps`` (a LambdaLR multiplier)."""

    def factor(step: int) -> float:
        if step < optim_warmup:
            return (step + 1) / optim_warmup
        progress = min(1.0, (step - optim_warmup) / max(1, total_steps - optim_warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Composer:
    """A composer of a run.

    Args:
        cfg: the training config (model, optimizers, sync, surrogates).
        owned: per layer, the experts this composer owns and trains.
        train_tokens: this composer's training shard (uint8 byte tokens).
        sampler_seed: seed of its data stream.
        merged_groups: the parameter groups merged DiLoCo-style (the shared groups; the DiLoCo reference
            adds "expert").
        batch_size: sequences per step (defaults to cfg.batch_size; the baseline uses C x that).
        device: where the model lives.
    """

    def __init__(self, cfg: TrainConfig, owned: Ownership, train_tokens: torch.Tensor, *, sampler_seed: int,
                 merged_groups: Sequence[str] = SHARED_GROUPS, batch_size: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.owned = owned
        self.device = torch.device(device)
        self.model = MoETransformer(cfg.model, owned, cfg.surrogate.non_owned, seed=cfg.seed).to(self.device)
        self.batch_size = batch_size or cfg.batch_size
        self.sampler = BatchSampler(train_tokens, self.batch_size, cfg.model.seq_len, seed=sampler_seed)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=o.betas,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.warmup_steps, cfg.steps, o.min_lr_ratio)
        )
        s = cfg.sync
        self.outer = {
            g: OuterOptimizer(self.model.group_parameters(g), lr=s.outer_lr, momentum=s.outer_momentum)
            for g in merged_groups
            if self.model.group_parameters(g)
        }
        self.tokens_since_merge = dict.fromkeys(self.outer, 0)
        self.step = 0
        self.tokens_seen = 0
        self.selections_owned = 0
        self.selections_total = 0
        self.sketcher: SketchRecorder | None = None
        self.sketch_rng = torch.Generator().manual_seed(sampler_seed + 7919)
        if cfg.sketch.enabled:
            self.sketcher = SketchRecorder()
            self.model.set_sketcher(self.sketcher.attach)
        self.recorder: ActivationRecorder | None = None
        self.publishers: dict[ExpertId, ErrorFeedbackPublisher] = {}
        if cfg.surrogate.non_owned == "surrogate":
            self.recorder = ActivationRecorder(cfg.surrogate.buffer_tokens, cfg.model.d_latent)
            self.model.set_recorder(self.recorder)
            for layer, expert in self.owned_experts():
                self.publishers[(layer, expert)] = ErrorFeedbackPublisher(
                    _detached(self.model.surrogate_parameters(layer, expert)), rank=cfg.surrogate.delta_rank
                )

    def owned_experts(self) -> Iterable[ExpertId]:
        for layer, experts in enumerate(self.owned):
            for expert in sorted(experts):
                yield layer, expert

    # ---- the step (no I/O) ------------------------------------------------------------------------

    def train_step(self) -> StepStats:
        """One inner AdamW step on the next batch of this composer's shard."""
        stats = self.forward_backward()
        self.optimizer_step()
        return stats

    def forward_backward(self) -> StepStats:
        """Forward and backward on the next batch; gradients are left in ``.grad`` for ``optimizer_step``.

        Split from the optimizer step so that other composers' sketched expert gradients can be
        added in between (``absorb_sketches``)."""
        self.model.train()
        x_BT, y_BT = (t.to(self.device) for t in self.sampler.next_batch())
        out = self.model(x_BT, y_BT)
        assert out.loss is not None and out.ce_loss is not None
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        tokens = x_BT.numel()
        self.step += 1
        self.tokens_seen += tokens
        for group in self.tokens_since_merge:
            self.tokens_since_merge[group] += tokens
        counts_LE = out.tokens_per_expert.cpu()
        self.selections_total += int(counts_LE.sum())
        self.selections_owned += sum(int(counts_LE[layer, list(experts)].sum())
                                     for layer, experts in enumerate(self.owned) if experts)
        return StepStats(out.loss.item(), out.ce_loss.item(), out.aux_loss.item(), tokens)

    def optimizer_step(self) -> None:
        """Clip and apply the gradients left by ``forward_backward`` (and any absorbed sketches)."""
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for g in self.optimizer.param_groups for p in g["params"]], self.cfg.optim.grad_clip
            )
        self.optimizer.step()
        self.scheduler.step()

    # ---- sketched expert gradients ----------------------------------------------------------------

    def take_sketches(self) -> dict[ExpertId, Sketch]:
        """The (x, g) sketches of this step's non-owned selections, compressed as for the wire."""
        assert self.sketcher is not None, "sketches need cfg.sketch.enabled"
        sk = self.cfg.sketch
        return {eid: compress(s, sample_fraction=sk.sample_fraction, generator=self.sketch_rng,
                              wire_codec=sk.wire_codec)
                for eid, s in self.sketcher.take().items()}

    def absorb_sketches(self, sketches: Mapping[ExpertId, list[Sketch]], composers: int) -> None:
        """Turn other composers' sketches of our experts into expert gradient before ``optimizer_step``.

        The expert gradient becomes (own + sum of foreign Taylor-proxy gradients) / C: the gradient of
        the mean loss over every composer's tokens, as the synchronous baseline computes it.
        """
        for layer, expert in self.owned_experts():
            module = self.model.blocks[layer].moe.experts[str(expert)]
            with torch.no_grad():
                for p in module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.0 / composers)
            received = sketches.get((layer, expert))
            if received:
                accumulate_expert_gradient(module, received, scale=1.0 / composers)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean validation cross-entropy (nats per byte) of this composer's own view."""
        return evaluate(self.model, batches)

    # ---- surrogate refresh (owner side and receiver side) -----------------------------------------

    def refresh_surrogates(self) -> dict[ExpertId, dict]:
        """Distil every owned expert into its surrogate; return the published low-rank deltas.

        Returns:
            {(layer, expert): factors} as produced by ``ErrorFeedbackPublisher.delta``; experts that saw
            no tokens since the start are skipped.
        """
        assert self.recorder is not None, "surrogate refresh needs non_owned='surrogate'"
        deltas = {}
        sc = self.cfg.surrogate
        for layer, expert in self.owned_experts():
            rows = self.recorder.rows(layer, expert)
            if rows is None:
                continue
            moe = self.model.blocks[layer].moe
            distill(moe.surrogates[expert], moe.experts[str(expert)], rows, steps=sc.distill_steps, lr=sc.distill_lr)
            current = _detached(self.model.surrogate_parameters(layer, expert))
            deltas[(layer, expert)] = self.publishers[(layer, expert)].delta(current)
        return deltas

    def apply_surrogate_delta(self, expert_id: ExpertId, factors: Mapping) -> None:
        """Apply an owner's published surrogate delta to our copy of that surrogate."""
        layer, expert = expert_id
        apply_delta(_detached(self.model.surrogate_parameters(layer, expert)), factors)

    def expert_state(self, expert_id: ExpertId) -> dict[str, torch.Tensor]:
        """A copy of an owned expert's weights (frozen-copy publication, the assembled model, snapshots)."""
        layer, expert = expert_id
        return {k: v.detach().cpu().clone() for k, v in self.model.expert_parameters(layer, expert).items()}

    @torch.no_grad()
    def load_expert_state(self, expert_id: ExpertId, state: Mapping[str, torch.Tensor]) -> None:
        layer, expert = expert_id
        for name, p in self.model.expert_parameters(layer, expert).items():
            p.copy_(state[name].to(p.device, p.dtype))

    # ---- tiered outer sync ------------------------------------------------------------------------

    def pseudo_gradient(self, group: str) -> dict[str, torch.Tensor]:
        """theta_G(last merge) - theta_G(now), on CPU."""
        return self.outer[group].pseudo_gradient()

    def apply_outer(self, group: str, merged: Mapping[str, torch.Tensor]) -> None:
        """Nesterov outer step with the merged pseudo-gradient; the live parameters jump to the result."""
        self.outer[group].step(merged)
        self.tokens_since_merge[group] = 0

    # ---- accounting -------------------------------------------------------------------------------

    def parameter_count(self) -> int:
        """Parameters held by this composer (real experts it holds, surrogates, shared groups)."""
        return sum(p.numel() for p in self.model.parameters())

    def optimizer_state_bytes(self) -> int:
        """Bytes of inner optimizer state plus the outer optimizers' anchors and momenta."""
        return _tensor_bytes(self.optimizer.state_dict()) + sum(
            _tensor_bytes(outer.state_dict()) for outer in self.outer.values()
        )

    @property
    def owned_fraction(self) -> float:
        """Measured share of routed selections that went to real (owned) experts."""
        return self.selections_owned / self.selections_total if self.selections_total else 0.0


@torch.no_grad()
def evaluate(model: MoETransformer, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy of ``model`` over fixed validation batches (nats per token)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = []
    recorder = [layer.recorder for layer in model.moe_layers()]
    model.set_recorder(None)  # evaluation must not feed the distillation buffers
    try:
        for x_BT, y_BT in batches:
            out = model(x_BT.to(device), y_BT.to(device))
            losses.append(float(out.ce_loss))
    finally:
        for layer, rec in zip(model.moe_layers(), recorder, strict=True):
            layer.recorder = rec
        model.train(was_training)
    return sum(losses) / len(losses)


def _detached(params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """The parameters' data tensors (sharing storage), so in-place updates bypass autograd."""
    return {name: p.data for name, p in params.items()}


def _tensor_bytes(obj: object) -> int:
    """Bytes of every tensor inside nested dicts/lists (optimizer state dicts)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
