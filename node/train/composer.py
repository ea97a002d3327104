"""One composer: its model (owned experts real, the rest as surrogates), its inner optimizer, its data,
its outer optimizers, and the owner side of surrogate refresh.

The composer does no I/O. What would cross the network is exposed as plain methods the caller drives
between steps: ``refresh_surrogates`` (owner -> everyone), ``apply_surrogate_delta`` (receiver),
``pseudo_gradient`` / ``apply_outer`` (tiered outer sync), ``release_expert`` / ``adopt_expert`` (an
expert changes owner when a peer leaves or joins). The in-process simulator (``sim.py``) calls them
directly; the P2P node calls the same methods from its background exchange at its one seam.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from parallax.dht.keys import ExpertId
from parallax.node.config.train import SHARED_GROUPS, TrainConfig
from parallax.node.model.lowrank import ErrorFeedbackPublisher, apply_delta
from parallax.node.model.sketch import Sketch, SketchRecorder, accumulate_expert_gradient, compress
from parallax.node.model.surrogate import ActivationRecorder, distill
from parallax.node.model.transformer import Block, MoETransformer, Ownership, SwiGLU
from parallax.node.train.data import BatchSampler
from parallax.node.train.device import autocast, compute_dtype
from parallax.node.train.outer import OuterOptimizer

"""(layer, expert)"""

ADAM_PREFIX = "adam."
"""Prefix of the AdamW state in an expert snapshot (``Composer.expert_snapshot``)."""


@dataclass
class StepStats:
    loss: float
    ce_loss: float
    aux_loss: float
    tokens: int


def lr_lambda(optim_warmup: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warm-up then cosine decay to ``min_ratio`` at ``total_steps`` (a LambdaLR multiplier)."""

    def factor(step: int) -> float:
        if step < optim_warmup:
            return (step + 1) / optim_warmup
        progress = min(1.0, (step - optim_warmup) / max(1, total_steps - optim_warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def schedule_position(step: int, total_steps: int, min_ratio: float) -> str:
    """Where ``step`` stands in the run's learning-rate schedule (``lr_lambda``), for people: the live table, the
    status page and the end-of-schedule warning."""
    if step < total_steps:
        return f"step {step:,} of {total_steps:,} ({step / total_steps:.0%})"
    return (f"past its end at step {total_steps:,}: learning rate at its minimum, {min_ratio:.0%} of the peak "
            "(the run's steps setting)")


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
        replica_outers: each owned expert has its own outer optimizer, ``outer[expert_group(eid)]`` (with
            ``ownership.replicas`` > 1: the owners of an expert merge it DiLoCo-style among themselves). It moves
            with the expert: ``expert_snapshot`` carries its anchor and momentum, ``adopt_expert`` takes them.
    """

    def __init__(self, cfg: TrainConfig, owned: Ownership, train_tokens: torch.Tensor, *, sampler_seed: int,
                 merged_groups: Sequence[str] = SHARED_GROUPS, batch_size: int | None = None,
                 device: torch.device | str = "cpu", replica_outers: bool = False) -> None:
        self.cfg = cfg
        self.owned = owned
        self.device = torch.device(device)
        self.model = MoETransformer(cfg.model, owned, cfg.surrogate.non_owned, seed=cfg.seed).to(self.device)
        for moe in self.model.moe_layers():
            moe.stand_in_input_grad = cfg.surrogate.input_grad
            moe.offload_input_grad = cfg.offload.input_grad
        self.model.set_kernel(cfg.compute.kernel)
        self.model.checkpoint_blocks = cfg.compute.checkpoint
        if cfg.compute.compile:
            for block in self.model.blocks:
                cast(Block, block).attn.compile()
        self.dtype = compute_dtype(self.device, cfg.compute.precision)
        """What the step's matmuls run in (bf16 autocast on CUDA by default); weights and AdamW state stay fp32."""
        self.batch_size = batch_size or cfg.batch_size
        self.sampler = BatchSampler(train_tokens, self.batch_size, cfg.model.seq_len, seed=sampler_seed)
        o = cfg.optim
        matrices, decay, no_decay = _inner_param_groups(self.model, o.inner)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=o.betas,
        )
        schedule = lr_lambda(o.warmup_steps, cfg.steps, o.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.matrix_optimizer: torch.optim.Muon | None = None
        """With ``optim.inner="muon"``: Muon over the hidden matrices (AdamW keeps the rest), on the same
        schedule; its update is scaled to AdamW's size, so it takes AdamW's lr and weight decay."""
        self.matrix_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if o.inner == "muon":
            self.matrix_optimizer = torch.optim.Muon(matrices, lr=o.lr, weight_decay=o.weight_decay,
                                                     adjust_lr_fn="match_rms_adamw")
            self.matrix_scheduler = torch.optim.lr_scheduler.LambdaLR(self.matrix_optimizer, schedule)
        s = cfg.sync
        self.outer = {
            g: OuterOptimizer(self.model.group_parameters(g), lr=s.outer_lr, momentum=s.outer_momentum)
            for g in merged_groups
            if self.model.group_parameters(g)
        }
        self.tokens_since_merge = dict.fromkeys(self.outer, 0)
        self.replica_outers = replica_outers
        if replica_outers:
            if "expert" in self.outer:
                raise ValueError("replica_outers merges each expert among its owners; it cannot go with the 'expert' "
                                 "group merged among every composer")
            for eid in self.owned_experts():
                self._start_replica_outer(eid, {})
        self.step = 0
        self.tokens_seen = 0
        self.selections_owned = 0
        self.selections_total = 0
        self.sketcher: SketchRecorder | None = None
        self.sketch_rng = torch.Generator().manual_seed(sampler_seed + 7919)
        if cfg.sim.sketch.enabled or cfg.offload.enabled:
            self.sketcher = SketchRecorder(keep=self._sketched)
            self.model.set_sketcher(self.sketcher.attach)
        self.recorder: ActivationRecorder | None = None
        self.publishers: dict[ExpertId, ErrorFeedbackPublisher] = {}
        self.paused = False
        """The owned experts are held without training (``pause``)."""
        if cfg.surrogate.non_owned == "surrogate":
            self.recorder = ActivationRecorder(cfg.surrogate.buffer_tokens, cfg.model.d_latent)
            self.model.set_recorder(self.recorder)
            for eid in self.owned_experts():
                self.reset_publisher(eid)

    def reset_publisher(self, eid: ExpertId) -> None:
        """Publish an owned expert's surrogate deltas from its current surrogate (what receivers hold now)."""
        sc = self.cfg.surrogate
        self.publishers[eid] = ErrorFeedbackPublisher(_detached(self.model.surrogate_parameters(*eid)),
                                                      rank=sc.delta_rank, half=sc.delta_dtype == "float16")

    def owned_experts(self) -> Iterable[ExpertId]:
        for layer, experts in enumerate(self.owned):
            for expert in sorted(experts):
                yield layer, expert

    def pause(self, paused: bool) -> None:
        """Hold the owned experts without training them, or train them again. Held, ``optimizer_step`` leaves them
        and their optimizer state, no offload sketch is taken of them, and a replicated expert's tokens do not count
        toward its next outer round (its co-owners' merges still apply). Results an offload worker was already
        asked for still land. They still run in the forward pass, and their snapshots and surrogates are served."""
        self.paused = paused

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
        with autocast(self.device, self.dtype):
            out = self.model(x_BT, y_BT)
        assert out.loss is not None and out.ce_loss is not None
        for optimizer in self._optimizers():
            optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        tokens = x_BT.numel()
        self.step += 1
        self.tokens_seen += tokens
        for group in self.tokens_since_merge:
            if not (self.paused and group.startswith(EXPERT_GROUP_PREFIX)):  # a held expert learned from none
                self.tokens_since_merge[group] += tokens
        counts_LE = out.tokens_per_expert.cpu()
        self.selections_total += int(counts_LE.sum())
        self.selections_owned += sum(int(counts_LE[layer, list(experts)].sum())
                                     for layer, experts in enumerate(self.owned) if experts)
        return StepStats(out.loss.item(), out.ce_loss.item(), out.aux_loss.item(), tokens)

    @property
    def schedule_step(self) -> int:
        """Where this composer's learning rate stands in the run's schedule (``lr_lambda``): its own step count,
        unless ``follow_schedule`` moved it further."""
        return int(self.scheduler.last_epoch)

    def follow_schedule(self, step: int) -> None:
        """Take the learning rate of the run's schedule at ``step`` when that is further than this composer's own
        place in it (never back): a composer slower than the others trains at their point of the schedule, not at
        a peak they passed long ago."""
        if step <= self.schedule_step:
            return
        for scheduler in (self.scheduler, self.matrix_scheduler):
            if scheduler is None:
                continue
            scheduler.last_epoch = step
            for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                           scheduler.lr_lambdas, strict=True):
                group["lr"] = base * factor(step)

    def optimizer_step(self) -> None:
        """Clip and apply the gradients left by ``forward_backward`` (and any absorbed sketches); the owned experts'
        are left out while they are paused (``pause``)."""
        if self.paused:
            for eid in self.owned_experts():
                for p in self.model.expert_parameters(*eid).values():
                    p.grad = None  # the optimizers step only the parameters that have a gradient
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self._trained_parameters(), self.cfg.optim.grad_clip)
        for optimizer in self._optimizers():
            optimizer.step()
        self.scheduler.step()
        if self.matrix_scheduler is not None:
            self.matrix_scheduler.step()

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The inner optimizers: AdamW, and Muon with ``optim.inner="muon"``."""
        return [self.optimizer] if self.matrix_optimizer is None else [self.optimizer, self.matrix_optimizer]

    # ---- sketched expert gradients ----------------------------------------------------------------

    def _sketched(self, layer: int, expert: int) -> bool:
        """Whether the sketcher captures this expert's selections: offloaded owned experts (for their
        worker), non-owned ones when their owners absorb sketches (cfg.sim.sketch)."""
        moe = self.model.moe_layer(layer)
        return expert in moe.offloaded if expert in moe.owned else self.cfg.sim.sketch.enabled

    def take_sketches(self) -> dict[ExpertId, Sketch]:
        """The (x, g) sketches of this step's non-owned selections, compressed as for the wire."""
        assert self.sketcher is not None, "sketches need cfg.sim.sketch.enabled"
        sk = self.cfg.sim.sketch
        non_owned = [(layer, e) for layer, experts in enumerate(self.owned)
                     for e in range(self.cfg.model.n_experts) if e not in experts]
        return {eid: compress(s, sample_fraction=sk.sample_fraction, generator=self.sketch_rng,
                              wire_codec=sk.wire_codec)
                for eid, s in self.sketcher.take(non_owned).items()}

    def offload_expert(self, expert_id: ExpertId, offloaded: bool) -> None:
        """Hand an owned expert's update to a worker (it then runs forward only here and is sketched), or
        take it back (trained here again, as without offload).

        Raises:
            ValueError: the expert is not owned here, or lies in the private layers (cfg.offload.private_layers).
        """
        layer, expert = self._check_expert(expert_id, owned=True)
        if offloaded and (not self.cfg.offload.enabled or layer < self.cfg.offload.private_layers):
            raise ValueError(f"expert {expert_id} cannot be offloaded: needs offload.enabled and a layer >= "
                             f"offload.private_layers={self.cfg.offload.private_layers}")
        self.model.moe_layer(layer).set_offloaded(expert, offloaded)

    def offloaded_experts(self) -> list[ExpertId]:
        """The owned experts whose update is offloaded now."""
        return [(layer, e) for layer, moe in enumerate(self.model.moe_layers()) for e in sorted(moe.offloaded)]

    def take_offload_sketches(self) -> dict[ExpertId, Sketch]:
        """This step's raw (x, g) of the offloaded experts' selections; compress with ``sketch.compress``.

        With cfg.offload.clip_sketches, g is scaled by this step's gradient-clip coefficient
        (``clip_coefficient``), so a worker's expert gradient is clipped with the rest of the composer's step, as
        direct ownership clips it. Call after ``forward_backward``, before anything else adds gradient."""
        assert self.sketcher is not None, "offload needs cfg.offload.enabled"
        sketches = self.sketcher.take(self.offloaded_experts())
        if self.paused:
            return {}  # taken and dropped: a paused expert's worker gets no work
        coefficient = self.clip_coefficient() if self.cfg.offload.clip_sketches else 1.0
        if coefficient == 1.0:
            return sketches
        return {eid: Sketch(s.x_NL, s.g_NL * coefficient, s.tokens, s.wire_bytes) for eid, s in sketches.items()}

    def clip_coefficient(self) -> float:
        """What ``optimizer_step``'s global-norm clip will scale the gradients now held by (1.0: no clip)."""
        clip = self.cfg.optim.grad_clip
        grads = [p.grad for p in self._trained_parameters() if p.grad is not None]
        if clip <= 0 or not grads:
            return 1.0
        return min(1.0, clip / (float(torch.nn.utils.get_total_norm(grads)) + 1e-6))  # clip_grad_norm_'s coefficient

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        """Everything this composer's optimizer steps (what its gradient clip covers)."""
        return [p for optimizer in self._optimizers() for g in optimizer.param_groups for p in g["params"]]

    def absorb_sketches(self, sketches: Mapping[ExpertId, list[Sketch]], composers: int) -> None:
        """Turn other composers' sketches of our experts into expert gradient before ``optimizer_step``.

        The expert gradient becomes (own + sum of foreign Taylor-proxy gradients) / C: the gradient of
        the mean loss over every composer's tokens, as the synchronous baseline computes it.
        """
        for layer, expert in self.owned_experts():
            module = self.model.moe_layer(layer).experts[str(expert)]
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

    def refresh_surrogates(self, experts: Iterable[ExpertId] | None = None) -> dict[ExpertId, dict[str, Any]]:
        """Distil owned experts into their surrogates; return the published low-rank deltas.

        Args:
            experts: which owned experts (default: every one; with replicas, those this composer publishes).

        Returns:
            {(layer, expert): factors} as produced by ``ErrorFeedbackPublisher.delta``; experts that saw
            no tokens since the start are skipped.
        """
        assert self.recorder is not None, "surrogate refresh needs non_owned='surrogate'"
        deltas = {}
        sc = self.cfg.surrogate
        for layer, expert in self.owned_experts() if experts is None else experts:
            rows = self.recorder.rows(layer, expert)
            if rows is None:
                continue
            moe = self.model.moe_layer(layer)
            distill(moe.surrogates[expert], moe.experts[str(expert)], rows, steps=sc.distill_steps, lr=sc.distill_lr,
                    jacobian_weight=sc.jacobian_weight, seed=self.step)
            current = _detached(self.model.surrogate_parameters(layer, expert))
            deltas[(layer, expert)] = self.publishers[(layer, expert)].delta(current)
        return deltas

    def apply_surrogate_delta(self, expert_id: ExpertId, factors: Mapping[str, Any]) -> None:
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

    # ---- changing ownership (a peer left or joined) ---------------------------------------------------

    def expert_snapshot(self, expert_id: ExpertId) -> dict[str, torch.Tensor]:
        """What another composer needs to take over an owned expert: its weights and AdamW state.

        Args:
            expert_id: (layer, expert), owned here.

        Returns:
            CPU float32 copies: the weights under their ``expert_parameters`` names ("w_gate.weight", ...),
            and, once the optimizer has stepped them, "adam.exp_avg.<name>", "adam.exp_avg_sq.<name>" and
            "adam.step" (a 0-d float64 tensor); with ``replica_outers``, its outer anchor "outer.anchor.<name>"
            and, once an outer step made it, the momentum "outer.momentum.<name>".

        Raises:
            ValueError: the expert does not exist or is not owned here.
        """
        layer, expert = self._check_expert(expert_id, owned=True)
        params = self.model.expert_parameters(layer, expert)
        out = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in params.items()}
        return {**out, **adam_state(self.optimizer, params), **self._replica_outer_state((layer, expert))}

    def load_expert_adam(self, expert_id: ExpertId, step: float, moments: Mapping[str, torch.Tensor]) -> None:
        """Set an owned expert's AdamW state (checked by ``check_adam_state``): an adopted expert's, or the state
        its worker trained an offloaded expert with, so that a fall-back or the next worker carries on from it.

        Raises:
            ValueError: the expert is not owned here.
        """
        self._check_expert(expert_id, owned=True)
        load_adam_state(self.optimizer, self.model.expert_parameters(*expert_id), step, moments)

    def adopt_expert(self, expert_id: ExpertId, snapshot: Mapping[str, torch.Tensor] | None) -> None:
        """Start owning an expert: hold it for real, train it, and publish its surrogate from now on.

        Call between steps (not between ``forward_backward`` and ``optimizer_step``). Afterwards the model,
        the optimizer (its parameter order included) and the publishers are those of a composer built with
        the new ownership, so checkpoints save and load as usual (``read_info(path).owned``).

        Args:
            expert_id: (layer, expert), not owned here.
            snapshot: the previous owner's ``expert_snapshot`` / ``release_expert``; with adam.* entries its
                AdamW state carries on, without them the optimizer starts the expert afresh; with outer.* entries
                (``replica_outers``) its outer anchor and momentum do, without them the anchor is the adopted
                weights. None: the expert's seeded initial weights (an expert nobody has trained, or whose owner
                vanished).

        Raises:
            ValueError: the expert does not exist or is already owned, ownership cannot change in this
                configuration, or the snapshot has missing, extra, misshapen or non-finite entries.
                Nothing is changed.
        """
        layer, expert = self._check_expert(expert_id, owned=False)
        # Built on the meta device: no memory yet, and no draw from torch's global generator.
        with torch.device("meta"):
            module = SwiGLU(self.cfg.model.d_latent, self.cfg.model.d_expert)
        shapes = {n: p.shape for n, p in module.named_parameters()}
        outer_state: dict[str, torch.Tensor] = {}
        if snapshot is None:
            weights, adam = self.model.initial_expert_weights(layer, expert, self.cfg.seed), None
        else:
            where = f"snapshot of expert {(layer, expert)}"
            outer_state = check_outer_state(where, {k: v for k, v in snapshot.items() if k.startswith(OUTER_PREFIX)},
                                            shapes) if self.replica_outers else {}
            weights, adam = check_snapshot(where, {k: v for k, v in snapshot.items() if k not in outer_state}, shapes,
                                           self.optimizer.param_groups[0]["betas"])

        moe = self.model.moe_layer(layer)
        like = moe.router.weight
        module.to_empty(device=like.device)
        module.to(dtype=like.dtype)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(weights[name])
        moe.adopt_expert(expert, module)
        self.owned = _with_expert(self.owned, layer, expert, owned_now=True)
        self._canonical_optimizer()
        if adam is not None:
            self.load_expert_adam((layer, expert), *adam)
        if self.replica_outers:
            self._start_replica_outer((layer, expert), outer_state)
        if self.cfg.surrogate.non_owned == "surrogate":
            # Receivers hold our copy of its surrogate (every composer applied the same deltas), so the
            # next refresh publishes only what changes from here.
            self.reset_publisher((layer, expert))

    def release_expert(self, expert_id: ExpertId) -> dict[str, torch.Tensor]:
        """Stop owning an expert: hand back its snapshot and forget its weights, optimizer state, publisher
        and distillation rows. Its selections go to its surrogate (or nowhere, with non_owned="drop").

        Call between steps. Afterwards the composer is one built with the new ownership, as for
        ``adopt_expert``.

        Args:
            expert_id: (layer, expert), owned here.

        Returns:
            ``expert_snapshot(expert_id)`` taken just before, for the new owner's ``adopt_expert``.

        Raises:
            ValueError: the expert does not exist or is not owned here, or ownership cannot change in this
                configuration. Nothing is changed.
        """
        layer, expert = self._check_expert(expert_id, owned=True, changing=True)
        snapshot = self.expert_snapshot((layer, expert))
        self.model.moe_layer(layer).release_expert(expert)
        self.owned = _with_expert(self.owned, layer, expert, owned_now=False)
        self._canonical_optimizer()
        self.publishers.pop((layer, expert), None)
        self.outer.pop(expert_group((layer, expert)), None)
        self.tokens_since_merge.pop(expert_group((layer, expert)), None)
        if self.recorder is not None:
            self.recorder.drop(layer, expert)
        return snapshot

    def split_experts(self, owned: Ownership) -> None:
        """End the dense start-up phase (``sim.dense_steps``): stop merging the "expert" group and release
        every expert outside ``owned``, whose selections go to its surrogate from now on. Call between steps,
        right after the experts' last merge. The owned-selection counters restart, so ``owned_fraction``
        measures the sharded phase.

        Raises:
            ValueError: the "expert" group is not merged here, or ``owned`` is not a subset of what is held.
        """
        if "expert" not in self.outer:
            raise ValueError("split_experts needs a composer built with the 'expert' group merged (the dense phase)")
        if len(owned) != len(self.owned) or any(not set(o) <= set(h) for o, h in zip(owned, self.owned, strict=True)):
            raise ValueError("split_experts keeps a subset of the experts held now, one set per layer")
        del self.outer["expert"]
        self.tokens_since_merge.pop("expert", None)
        for layer, held in enumerate(self.owned):
            for expert in sorted(set(held) - set(owned[layer])):
                self.release_expert((layer, expert))
        self.selections_owned = self.selections_total = 0

    def _check_expert(self, expert_id: ExpertId, *, owned: bool, changing: bool = False) -> ExpertId:
        """(layer, expert) as ints, checked to exist and to be owned (or not); with ``changing`` (implied
        when adopting), checked that its ownership may change here."""
        layer, expert = (int(x) for x in expert_id)
        m = self.cfg.model
        if not (0 <= layer < m.n_layers and 0 <= expert < m.n_experts):
            raise ValueError(f"no expert {expert_id}: layers are 0..{m.n_layers - 1}, experts 0..{m.n_experts - 1}")
        if changing or not owned:
            if self.cfg.surrogate.non_owned == "frozen_copy":
                raise ValueError("experts cannot change owner with non_owned='frozen_copy' (every expert is held "
                                 "as a full copy); use non_owned='surrogate' or 'drop'")
            if "expert" in self.outer:
                raise ValueError("experts cannot change owner while the 'expert' group is merged DiLoCo-style: "
                                 "its outer anchors cover a fixed set of experts; leave it out of merged_groups")
        if (expert in self.owned[layer]) != owned:
            raise ValueError(f"expert ({layer}, {expert}) is {'not ' if owned else 'already '}owned by this composer")
        return layer, expert

    def _canonical_optimizer(self) -> None:
        """Point the inner AdamW at the model's trainable parameters after an ownership change.

        The groups list them in ``named_parameters`` order, as a fresh composer's do: checkpoints key
        optimizer state by that order. State of parameters no longer in the model is dropped; new ones
        get none (AdamW starts them at step 0) unless the caller sets it.
        """
        matrices, decay, no_decay = _inner_param_groups(self.model, self.cfg.optim.inner)
        live = {id(p) for p in matrices + decay + no_decay}
        for optimizer in self._optimizers():
            for p in [p for g in optimizer.param_groups for p in g["params"] if id(p) not in live]:
                optimizer.state.pop(p, None)
        groups = self.optimizer.param_groups
        assert len(groups) == 2, "the inner AdamW has a decay and a no-decay group"
        groups[0]["params"], groups[1]["params"] = decay, no_decay
        if self.matrix_optimizer is not None:
            self.matrix_optimizer.param_groups[0]["params"] = matrices

    # ---- replicated experts' outer state ----------------------------------------------------------

    def _start_replica_outer(self, eid: ExpertId, state: Mapping[str, torch.Tensor]) -> None:
        """The outer optimizer of an owned expert: from ``state`` (``check_outer_state``'s entries) when given,
        else anchored at its weights now. ``outer`` stays in canonical order: shared groups, then experts."""
        prefix = expert_prefix(eid)
        params = {prefix + n: p for n, p in self.model.expert_parameters(*eid).items()}
        s = self.cfg.sync
        outer = OuterOptimizer(params, lr=s.outer_lr, momentum=s.outer_momentum)
        if state:
            with torch.no_grad():
                for name, anchor in outer.anchor.items():
                    anchor.copy_(state[f"{OUTER_PREFIX}anchor.{name[len(prefix):]}"])
                    momentum = state.get(f"{OUTER_PREFIX}momentum.{name[len(prefix):]}")
                    if momentum is not None:
                        outer.optimizer.state[anchor]["momentum_buffer"] = momentum.to(torch.float32).clone()
        self.outer[expert_group(eid)] = outer
        self.tokens_since_merge[expert_group(eid)] = 0
        shared = {g: o for g, o in self.outer.items() if not g.startswith(EXPERT_GROUP_PREFIX)}
        experts = sorted((g, o) for g, o in self.outer.items() if g.startswith(EXPERT_GROUP_PREFIX))
        self.outer = {**shared, **dict(sorted(experts, key=lambda go: _expert_of_group(go[0])))}

    def _replica_outer_state(self, eid: ExpertId) -> dict[str, torch.Tensor]:
        """An owned expert's outer anchor and momentum under snapshot names (empty without ``replica_outers``)."""
        outer = self.outer.get(expert_group(eid))
        if outer is None:
            return {}
        prefix = expert_prefix(eid)
        out = {f"{OUTER_PREFIX}anchor.{name[len(prefix):]}": a.clone() for name, a in outer.anchor.items()}
        momenta = {name: outer.optimizer.state.get(a, {}).get("momentum_buffer") for name, a in outer.anchor.items()}
        if all(m is not None for m in momenta.values()):
            out.update({f"{OUTER_PREFIX}momentum.{name[len(prefix):]}": m.clone() for name, m in momenta.items()})
        return out

    def replicated_experts(self) -> list[ExpertId]:
        """The owned experts with an outer optimizer of their own (``replica_outers``)."""
        return [_expert_of_group(g) for g in self.outer if g.startswith(EXPERT_GROUP_PREFIX)]

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
        return sum(tensor_bytes(optimizer.state_dict()) for optimizer in self._optimizers()) + sum(
            tensor_bytes(outer.state_dict()) for outer in self.outer.values()
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


EMBEDDING = "tok_emb.weight"
"""The token embedding (tied to the output head): a matrix AdamW keeps under ``optim.inner="muon"``."""


def _inner_param_groups(model: MoETransformer, inner: str = "adamw") -> tuple[
        list[torch.nn.Parameter], list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's, AdamW's decayed, AdamW's not decayed) trainable parameters in ``named_parameters`` order:
    matrices are decayed, norm gains and other vectors are not; with ``inner="muon"`` the hidden matrices
    (all but the embedding) are Muon's and the first list is empty otherwise."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in trainable if p.dim() >= 2 and inner == "muon" and n != EMBEDDING]
    taken = {id(p) for p in matrices}
    return (matrices, [p for _, p in trainable if p.dim() >= 2 and id(p) not in taken],
            [p for _, p in trainable if p.dim() < 2])


def _with_expert(owned: Ownership, layer: int, expert: int, *, owned_now: bool) -> Ownership:
    """``owned`` with one expert added (owned_now) or removed."""
    return tuple((experts | {expert} if owned_now else experts - {expert}) if i == layer else experts
                 for i, experts in enumerate(owned))


OUTER_PREFIX = "outer."
"""Snapshot entries of a replicated expert's outer state: "outer.anchor.<name>", "outer.momentum.<name>"."""
EXPERT_GROUP_PREFIX = "expert/"


def expert_group(eid: ExpertId) -> str:
    """The ``Composer.outer`` key of one replicated expert's outer optimizer ("expert/<layer>.<expert>")."""
    return f"{EXPERT_GROUP_PREFIX}{int(eid[0])}.{int(eid[1])}"


def _expert_of_group(group: str) -> ExpertId:
    layer, expert = group[len(EXPERT_GROUP_PREFIX):].split(".")
    return int(layer), int(expert)


def expert_prefix(eid: ExpertId) -> str:
    """The model's name prefix of one expert's parameters (its names in the "expert" group)."""
    return f"blocks.{int(eid[0])}.moe.experts.{int(eid[1])}."


def outer_state_shapes(shapes: Mapping[str, torch.Size]) -> dict[str, torch.Size]:
    """The names and shapes of a replicated expert's outer state in a snapshot (``Composer.expert_snapshot``)."""
    return {f"{OUTER_PREFIX}{kind}.{n}": shape for kind in ("anchor", "momentum") for n, shape in shapes.items()}


def check_outer_state(where: str, state: Mapping[str, torch.Tensor],
                      shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Check the outer.* entries of a snapshot: none, the anchor alone, or the anchor and the momentum, each
    whole, of the expert's shapes, finite and bounded.

    Raises:
        ValueError: unknown names, a part of the anchor or the momentum, or a bad tensor.
    """
    if not state:
        return {}
    allowed = outer_state_shapes(shapes)
    anchor = {f"{OUTER_PREFIX}anchor.{n}" for n in shapes}
    momentum = {f"{OUTER_PREFIX}momentum.{n}" for n in shapes}
    names = set(state)
    if names - set(allowed) or not anchor <= names or names & momentum not in (set(), momentum):
        raise ValueError(f"{where}: outer state has {sorted(names)}; expected all of {sorted(anchor)} and either all "
                         f"or none of {sorted(momentum)}")
    _check_tensors(where, state, {n: allowed[n] for n in state}, ValueError)
    return dict(state)


def adam_state_shapes(shapes: Mapping[str, torch.Size]) -> dict[str, torch.Size]:
    """The names and shapes of an expert's AdamW state in a snapshot (``Composer.expert_snapshot``)."""
    out = {f"{ADAM_PREFIX}{moment}.{n}": shape for moment in ("exp_avg", "exp_avg_sq") for n, shape in shapes.items()}
    out[f"{ADAM_PREFIX}step"] = torch.Size([])
    return out


def moment_bound(betas: tuple[float, float]) -> float | None:
    """K with |exp_avg| <= K sqrt(exp_avg_sq) elementwise for any gradients AdamW ever saw (None: no such K).

    m_t = (1-b1) sum_i b1^(t-i) g_i and v_t = (1-b2) sum_i b2^(t-i) g_i^2, so by Cauchy-Schwarz
    |m_t| <= (1-b1) / sqrt((1-b2)(1-b1^2/b2)) sqrt(v_t) whenever b1^2 < b2 (1.16 for (0.9, 0.95)). A state
    that breaks it was not made by AdamW: it would turn into steps far larger than the learning rate.
    """
    b1, b2 = betas
    if not b1 * b1 < b2 < 1:
        return None
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


class BadOptimizerState(ValueError):
    """A snapshot's weights are fine but its AdamW state is not (incomplete, non-finite, too large, or not one
    AdamW can have made): adopt the weights with a fresh optimizer state rather than lose them."""


MAX_STATE_NORM = 1e6
"""Largest L2 norm of any tensor of an expert snapshot (weights or moments), as ``expert_exchange.MAX_NORM``:
a second moment of 1e30 from a peer would freeze the expert for thousands of steps and make every later
snapshot of it unusable for heirs."""
MAX_ADAM_STEP = 2.0**40


def _check_tensors(where: str, snapshot: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size],
                   error: type[ValueError]) -> None:
    for name, want in shapes.items():
        v = snapshot[name]
        if not torch.is_tensor(v) or not v.is_floating_point():
            what = f"a {v.dtype} tensor" if torch.is_tensor(v) else type(v).__name__
            raise error(f"{where}: {name} must be a floating-point tensor, got {what}")
        if v.shape != want:
            raise error(f"{where}: {name} has shape {tuple(v.shape)}, expected {tuple(want)}")
        if not torch.isfinite(v).all():
            raise error(f"{where}: {name} has NaN or infinite entries")
        if float(v.double().norm()) > MAX_STATE_NORM:
            raise error(f"{where}: {name} has an L2 norm above {MAX_STATE_NORM:g}")


def check_snapshot(where: str, snapshot: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size],
                   betas: tuple[float, float] | None = None
                   ) -> tuple[dict[str, torch.Tensor], tuple[float, dict[str, torch.Tensor]] | None]:
    """Check an expert snapshot (see ``Composer.expert_snapshot``) before anything is changed.

    Args:
        where: what is checked, for the messages ("snapshot of expert (1, 2)").
        snapshot: name -> tensor, from another composer or a worker (possibly over the network).
        shapes: the expert's parameter names and shapes.
        betas: AdamW's betas: when given, the moments must also keep ``moment_bound``.

    Returns:
        (weights by parameter name, (AdamW step, moments by "exp_avg.<name>" / "exp_avg_sq.<name>") or None).

    Raises:
        ValueError: missing or unexpected names, or a weight with a wrong shape, non-floating or non-finite
            values or a norm above ``MAX_STATE_NORM``.
        BadOptimizerState: the weights pass but the AdamW state does not: some of it missing, the same faults
            as above, a negative second moment, a first moment AdamW cannot have made, or a step that is not a
            whole number in [0, 2^40].
    """
    adam_shapes = adam_state_shapes(shapes)
    extra = sorted(map(str, set(snapshot) - set(shapes) - set(adam_shapes)))
    missing = sorted(set(shapes) - set(snapshot))
    if missing or extra:
        raise ValueError(f"{where}: missing {missing}, unexpected {extra}; expected the weights {sorted(shapes)} "
                         f"and either all or none of {sorted(adam_shapes)}")
    _check_tensors(where, snapshot, shapes, ValueError)
    weights = {n: snapshot[n] for n in shapes}
    if not set(adam_shapes) & set(snapshot):
        return weights, None
    return weights, check_adam_state(where, {k: v for k, v in snapshot.items() if k in adam_shapes}, shapes, betas)


def check_adam_state(where: str, state: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size],
                     betas: tuple[float, float] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """Check an expert's AdamW state alone (the ``adam.*`` entries of ``Composer.expert_snapshot``; a worker's
    result carries it beside a weight change, not the weights).

    Returns:
        (AdamW step, moments by "exp_avg.<name>" / "exp_avg_sq.<name>").

    Raises:
        BadOptimizerState: missing or unexpected entries, a wrong shape, non-floating or non-finite values, a
            norm above ``MAX_STATE_NORM``, a negative second moment, a first moment AdamW cannot have made
            (``moment_bound``, when ``betas`` are given), or a step that is not a whole number in [0, 2^40].
    """
    adam_shapes = adam_state_shapes(shapes)
    if set(state) != set(adam_shapes):
        raise BadOptimizerState(f"{where}: AdamW state missing {sorted(set(adam_shapes) - set(state))}, "
                                f"unexpected {sorted(map(str, set(state) - set(adam_shapes)))}")
    _check_tensors(where, state, adam_shapes, BadOptimizerState)
    step_name = f"{ADAM_PREFIX}step"
    step = float(state[step_name])
    if not (0 <= step <= MAX_ADAM_STEP and step.is_integer()):
        raise BadOptimizerState(f"{where}: {step_name} must be a whole number in [0, 2^40], got {step}")
    moments = {k[len(ADAM_PREFIX):]: state[k] for k in adam_shapes if k != step_name}
    bound = None if betas is None else moment_bound(betas)
    for name in shapes:
        m, v = moments[f"exp_avg.{name}"], moments[f"exp_avg_sq.{name}"]
        if (v < 0).any():
            raise BadOptimizerState(f"{where}: exp_avg_sq.{name} has negative entries (a second moment is >= 0)")
        # the tolerance covers float32 rounding and second moments that underflowed to zero
        if bound is not None and (m.abs() > bound * 1.001 * v.sqrt() + 1e-12).any():
            raise BadOptimizerState(f"{where}: exp_avg.{name} exceeds {bound:.3f} x sqrt(exp_avg_sq) somewhere: "
                                    "not a state AdamW makes")
    return step, moments


def adam_state(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """The AdamW state of one expert's weights (``params``: name -> parameter) as snapshots name it: CPU float32
    "adam.exp_avg.<name>", "adam.exp_avg_sq.<name>" and "adam.step" (0-d float64); empty before the first step."""
    states = [optimizer.state.get(p) for p in params.values()]
    if not any(states):
        return {}
    # An expert's weights are used (and so stepped) together; differing states would be a bug.
    assert all(states), "an expert has optimizer state for some weights only"
    steps = {float(st["step"]) for st in states}  # type: ignore[index]
    assert len(steps) == 1, f"an expert's weights were stepped {sorted(steps)} times"
    out = {}
    for name, st in zip(params, states, strict=True):
        assert st is not None
        out[f"{ADAM_PREFIX}exp_avg.{name}"] = st["exp_avg"].detach().to("cpu", torch.float32, copy=True)
        out[f"{ADAM_PREFIX}exp_avg_sq.{name}"] = st["exp_avg_sq"].detach().to("cpu", torch.float32, copy=True)
    out[f"{ADAM_PREFIX}step"] = torch.tensor(steps.pop(), dtype=torch.float64)
    return out


def load_adam_state(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.nn.Parameter], step: float,
                    moments: Mapping[str, torch.Tensor]) -> None:
    """Set one expert's AdamW state (checked by ``check_adam_state``) on ``optimizer``, which holds ``params``."""
    for name, p in params.items():
        optimizer.state[p] = {
            "step": _adam_step(step, optimizer.defaults, p.device),
            "exp_avg": moments[f"exp_avg.{name}"].to(p.device, p.dtype, copy=True),
            "exp_avg_sq": moments[f"exp_avg_sq.{name}"].to(p.device, p.dtype, copy=True),
        }


def _adam_step(step: float, group: Mapping[str, object], device: torch.device) -> torch.Tensor:
    """The step counter as torch's AdamW keeps it: float32 on the parameter's device when capturable or
    fused, else on the CPU in the default scalar dtype (float64 only when that is the default dtype)."""
    if group.get("capturable") or group.get("fused"):
        return torch.tensor(step, dtype=torch.float32, device=device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(step, dtype=dtype)


def _detached(params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """The parameters' data tensors (sharing storage), so in-place updates bypass autograd."""
    return {name: p.data for name, p in params.items()}


def tensor_bytes(obj: object) -> int:
    """Bytes of every tensor inside nested dicts/lists (optimizer state dicts)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
