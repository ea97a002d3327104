"""C composers in one process, no network: the reference every networked run is checked against.

The same components as the P2P node (``Composer``, RDA merge, Nesterov outer optimizers, surrogate
deltas with error feedback), driven in lock-step: every composer takes one inner step, then between
steps owners publish surrogate deltas (every S steps) and the due shared groups merge (tiered periods), each merge
landing at once or ``sim.merge_lag`` steps later, as a node's background rounds land (``LateMerges``).
At the end every group merges once more and owners publish final surrogates, so the composers' views
and the assembled model are consistent.

Run kinds (``RunSpec.kind``):
    baseline   one model, every expert real, batch C x B, on the union of the shards (synchronous MoE);
    diloco     C composers that each hold and train every expert; all parameters merged (experts on the
               backbone's cadence);
    parallax   C composers with disjoint expert shards; non-owned selections per cfg.surrogate.non_owned. With
               cfg.ownership.replicas = R > 1 each expert has R owners, who each train it on their own
               tokens and merge it among themselves on the backbone's cadence (one outer round per set of
               owners, over the experts they share); the first owner by rank publishes its surrogate.
               R = C is the DiLoCo reference.
    offload    parallax with every owned expert outside cfg.offload.private_layers updated by an in-process
               worker through the wire path (sketch, Taylor-proxy steps, compressed result, checked apply),
               answers cfg.sim.offload_delay steps late (``offload.LocalWorkers``).
"""

from __future__ import annotations

import functools
import statistics
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import torch

from parallax.dht.keys import ExpertId
from parallax.dht.shards import assign_experts, expert_bundles
from parallax.node.config import train as config_mod
from parallax.node.config.train import SHARED_GROUPS, LateMerge, TrainConfig
from parallax.node.model.flops import step_flops
from parallax.node.model.lowrank import payload_bytes
from parallax.node.model.sketch import Sketch
from parallax.node.model.surrogate import jacobian_error, relative_error
from parallax.node.model.transformer import MoETransformer, Ownership, own_all
from parallax.node.offload.proxy import LocalWorkers
from parallax.node.outer.blocks import decode_all, encode_blocks
from parallax.node.outer.partitioned import merge_in_blocks, round_bytes
from parallax.node.outer.transport import decode_contribution, encode_contribution, error_feedback
from parallax.node.outer.wire import OuterSyncConfig, wire_roundtrip
from parallax.node.outer.wire import payload_bytes as outer_payload_bytes
from parallax.node.sim import RUN_KINDS
from parallax.node.train.checkpoint import save_checkpoint
from parallax.node.train.composer import Composer, evaluate, expert_group
from parallax.node.train.data import CorpusInfo, shard, val_batches
from parallax.node.train.merge_rules import merge_groups
from parallax.node.train.outer import OuterBundle, OuterOptimizer, TierSchedule, to_send
from parallax.node.train.parts import robust_merge_parts

SHARDED = ("parallax", "offload")

ProgressFn = Callable[[str, int, float], None]
"""progress(run name, step, mean training loss of the step)."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run of the simulator."""

    name: str
    kind: str
    cfg: TrainConfig
    composers: int

    def __post_init__(self) -> None:
        if self.kind not in RUN_KINDS:
            raise ValueError(f"run kind must be one of {RUN_KINDS}, got {self.kind!r}")
        if self.composers < 1:
            raise ValueError("a run needs at least one composer")
        if self.kind not in SHARDED:
            return
        cfg, dense_steps = self.cfg, self.cfg.sim.dense_steps
        if dense_steps and (self.kind == "offload" or cfg.surrogate.non_owned == "frozen_copy"):
            raise ValueError("sim.dense_steps needs run kind 'parallax' with surrogates or dropped selections")
        if dense_steps >= cfg.steps:
            raise ValueError(f"sim.dense_steps ({dense_steps}) must be below the run's steps ({cfg.steps}): "
                             "a run that never splits its experts is the DiLoCo reference (--kind diloco)")
        if cfg.ownership.replicas > self.composers:
            raise ValueError(f"ownership.replicas={cfg.ownership.replicas} needs at least that many composers, the "
                             f"run has {self.composers}")
        if cfg.ownership.replicas > 1 and (self.kind == "offload" or dense_steps or cfg.sim.sketch.enabled):
            raise ValueError("ownership.replicas > 1 runs without offload, sim.dense_steps and sim.sketch (each "
                             "assumes one owner per expert)")


@dataclass
class RunResult:
    name: str
    kind: str
    composer_val_losses: list[float]
    """Each composer's own view (its real experts + surrogates); one entry for the baseline."""
    assembled_val_loss: float
    """Every expert real (from its owner) with the merged shared groups: the exportable model."""
    tokens: int
    """Training tokens processed by all composers together."""
    train_flops: float
    """Training FLOPs of all composers together (inner steps + surrogate distillation)."""
    wall_s: float
    params_per_composer: int
    optimizer_state_bytes_per_composer: int
    owned_fraction: float
    """Measured share of routed selections that hit a real expert (1.0 for baseline and DiLoCo)."""
    network_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes that would cross the network over the run, all composers together, by what carries them:
    "surrogates" (deltas or frozen copies), "outer" (all-reduce of pseudo-gradients), "sketches"; with
    offload also "onboarding", "offload_sketches" (composer -> worker) and "offload_results" (back)."""
    worker_flops: float = 0.0
    """FLOPs the offload workers spent (not in train_flops, which counts the composers)."""
    offload_messages: dict[str, int] = field(default_factory=dict)
    """Payloads behind the offload entries of network_bytes (one per expert each), by the same names."""
    stand_in_error: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, output error, input-gradient error) of the surrogates right after each refresh: medians over
    experts of ``relative_error`` and ``jacobian_error`` of a receiver's copy against the owner's expert, on
    the owner's most recent inputs (``stand_in_error``)."""
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    """(step, mean training loss over composers), every 10 steps."""
    val_history: list[tuple[int, float]] = field(default_factory=list)
    """(tokens so far, median own-view validation loss), every cfg.eval_every steps and at the end."""
    steps: int = 0
    """Inner steps each composer took: ``cfg.steps``, or fewer when the run was stopped."""

    @property
    def val_loss(self) -> float:
        """The median over composers of their own view (the report's convention)."""
        return statistics.median(self.composer_val_losses)


def replica_owners(cfg: TrainConfig, composers: int, run_id: str = "sim") -> dict[ExpertId, tuple[int, ...]]:
    """The ``cfg.ownership.replicas`` owners (composer indices, best rank first) of every expert, from the
    assignment the P2P node uses (``assign_experts``)."""
    peers = {f"composer-{i}": 1.0 for i in range(composers)}
    assignment = assign_experts(run_id, cfg.model.n_layers, cfg.model.n_experts, peers, cfg.ownership.replicas)
    return {(layer, expert): tuple(int(p.removeprefix("composer-")) for p in assignment.owners_of(layer, expert))
            for layer in range(cfg.model.n_layers) for expert in range(cfg.model.n_experts)}


def ownership_for(cfg: TrainConfig, composers: int, run_id: str = "sim") -> list[Ownership]:
    """Complete expert shards for C composers (disjoint with one replica), from ``replica_owners``."""
    return shards_of(replica_owners(cfg, composers, run_id), cfg.model.n_layers, composers)


def shards_of(owners: Mapping[ExpertId, tuple[int, ...]], n_layers: int, composers: int) -> list[Ownership]:
    """Each composer's experts, per layer, from every expert's owners."""
    return [tuple(frozenset(e for (layer, e), who in owners.items() if layer == layer_ and i in who)
                  for layer_ in range(n_layers)) for i in range(composers)]


def bundle_outer(composer: Composer, experts: Sequence[ExpertId]) -> OuterBundle:
    """The outer optimizers of ``experts`` of ``composer`` (``Composer(replica_outers=True)``) stepped as one, in
    the order of the "expert" group (with every expert in it, the DiLoCo reference's expert group)."""
    return OuterBundle([composer.outer[expert_group(eid)] for eid in sorted(experts)])


def run(spec: RunSpec, train: torch.Tensor, val: torch.Tensor, *, progress: ProgressFn | None = None,
        device: torch.device | str = "cpu", checkpoint_dir: Path | None = None,
        should_stop: Callable[[], bool] | None = None, data: CorpusInfo | None = None,
        before_merge: Callable[[Sequence[Composer], str, int], None] | None = None) -> RunResult:
    """Train one run to completion and evaluate it.

    Args:
        spec: what to run.
        train: the training split (uint8 tokens); composer i trains on ``shard(train, i, C)`` (on all of it with
            ``sim.data = "stream"``).
        val: the validation split; everyone evaluates on the same fixed windows.
        progress: called after every step.
        device: where the models live.
        checkpoint_dir: when given, each composer's final checkpoint goes to ``checkpoint_dir/composer-<i>`` (what
            ``parallax export --from-checkpoints`` reads), in run ``sim``.
        data: the corpus ``train`` and ``val`` come from, named in those checkpoints.
        should_stop: polled after every step; True makes that step the last (the final merges and evaluation
            still run, so a stopped run is a complete, shorter one).
        before_merge: called with (composers, group, step) before each outer round of a shared group (what a
            benchmark measures of the pseudo-gradients, or changes in them, before they merge).
    """
    cfg, C = spec.cfg, spec.composers
    if spec.kind == "offload":
        cfg = config_mod.replace(cfg, offload=config_mod.replace(cfg.offload, enabled=True))
    dense_steps = cfg.sim.dense_steps if spec.kind in SHARDED else 0
    replicated = spec.kind in SHARDED and cfg.ownership.replicas > 1
    torch.manual_seed(cfg.seed)
    batches = val_batches(val, cfg.batch_size, cfg.model.seq_len, cfg.eval_batches)
    started = time.perf_counter()
    if spec.kind == "baseline":
        composers = [Composer(cfg, own_all(cfg.model), train, sampler_seed=cfg.seed,
                              batch_size=C * cfg.batch_size, device=device)]
    else:
        owners = replica_owners(cfg, C) if spec.kind in SHARDED else {}
        shards = shards_of(owners, cfg.model.n_layers, C) if spec.kind in SHARDED else [own_all(cfg.model)] * C
        dense = spec.kind == "diloco" or dense_steps > 0  # every composer holds and trains every expert
        merged_groups = (*SHARED_GROUPS, "expert") if dense else SHARED_GROUPS
        composers = [
            Composer(cfg, own_all(cfg.model) if dense else shards[i],
                     train if cfg.sim.data == "stream" else shard(train, i, C),
                     sampler_seed=cfg.seed + 1 + i, merged_groups=merged_groups, device=device,
                     replica_outers=replicated)
            for i in range(C)
        ]
    bundles = expert_bundles(owners) if replicated else {}
    wire = OuterSyncConfig(sync=cfg.sync)  # the bundles' rounds: the run's merge, wire format and aggregation
    merged_at = [0] * len(composers)  # tokens each composer had seen at its bundles' last merge
    dense_tokens = [0] * len(composers)  # tokens each composer trained with every expert real
    peak = (0, 0)  # (parameters, optimizer-state bytes) a composer held before the split
    workers = LocalWorkers(composers) if spec.kind == "offload" else None
    schedule = TierSchedule(cfg.sync.periods)
    history: list[tuple[int, float]] = []
    val_history: list[tuple[int, float]] = []
    extra_flops = 0.0  # surrogate distillation and sketch absorption, beyond the inner steps
    in_flight: list[dict[int, dict[ExpertId, Sketch]]] = []  # sketches on their way, oldest first
    traffic = {"surrogates": 0, "outer": 0, "sketches": 0}
    stand_in_history: list[tuple[int, float, float]] = []
    late = LateMerges(cfg.sim.merge_lag, cfg.sim.late_merge)
    steps_done = 0
    for step in range(1, cfg.steps + 1):
        steps_done = step
        losses = [c.forward_backward().loss for c in composers]
        if workers is not None:
            workers.exchange()
        if spec.kind in SHARDED and cfg.sim.sketch.enabled:
            in_flight.append({i: c.take_sketches() for i, c in enumerate(composers)})
            traffic["sketches"] += sum(s.wire_bytes for sent in in_flight[-1].values() for s in sent.values())
            arrived = in_flight.pop(0) if len(in_flight) > cfg.sim.sketch.delay else {}
            rows = deliver_sketches(composers, arrived)
            # the owner's extra work: expert forward + backward (3 x forward) on every absorbed row
            extra_flops += rows * 3 * 6 * cfg.model.d_latent * cfg.model.d_expert
        for c in composers:
            c.optimizer_step()
        late.land(step)
        mean_loss = sum(losses) / len(losses)
        last = step == cfg.steps or (should_stop is not None and should_stop())
        if step % 10 == 0 or last:
            history.append((step, mean_loss))
        if cfg.eval_every and step % cfg.eval_every == 0 and not last:
            tokens_so_far = sum(c.tokens_seen for c in composers)
            val_history.append((tokens_so_far, statistics.median(c.evaluate(batches) for c in composers)))
        if progress is not None:
            progress(spec.name, step, mean_loss)
        if spec.kind == "baseline":
            if last:
                break
            continue
        split_now = step == dense_steps
        if spec.kind in SHARDED and step > dense_steps and (step % cfg.surrogate.refresh_every == 0 or last):
            extra_flops += publish_round(composers, traffic, stand_in_history, step, owners)
        due = list(SHARED_GROUPS) if last or split_now else schedule.due(step)
        if (spec.kind == "diloco" or step <= dense_steps) and "backbone" in due:
            due.append("expert")  # the DiLoCo reference (and a dense start-up) merge experts with the backbone
        late_apply = None if last or split_now else functools.partial(late.send, step)
        if last or split_now:
            late.land()  # every merge still on its way, then the last rounds, applied at once
        for group in due:
            if before_merge is not None:
                before_merge(composers, group, step)
            traffic["outer"] += merge_round(composers, group, cfg.sync.merge, cfg.sync.compression,
                                             cfg.sync.aggregation, groups_of=cfg.sim.outer_group_size,
                                             seed=zlib.crc32(f"{cfg.seed}/{step}/{group}".encode()),
                                             parts=cfg.sim.outer_parts, apply=late_apply)
        if bundles and "backbone" in due:  # each set of owners merges the experts it shares
            for who in bundles:
                weights = [float(composers[i].tokens_seen - merged_at[i]) for i in who]
                traffic["outer"] += merge_outer([bundle_outer(composers[i], bundles[who]) for i in who], weights,
                                                wire, apply=late_apply) or 0
            merged_at = [c.tokens_seen for c in composers]
        if split_now:  # every composer holds the same experts now: split them into the shards
            dense_tokens = [c.tokens_seen for c in composers]
            peak = (max(c.parameter_count() for c in composers), max(c.optimizer_state_bytes() for c in composers))
            for c, owned in zip(composers, shards, strict=True):
                c.split_experts(owned)
            extra_flops += publish_round(composers, traffic, stand_in_history, step, owners)  # the first surrogates
        if last:
            break
    wall_s = time.perf_counter() - started

    if checkpoint_dir is not None:
        for i, c in enumerate(composers):
            save_checkpoint(checkpoint_dir / f"composer-{i}", c, run_id="sim", keep_last=1, data=data)
    composer_losses = [c.evaluate(batches) for c in composers]
    assembled = composer_losses[0] if len(composers) == 1 else evaluate(assemble(composers, cfg), batches)
    tokens = sum(c.tokens_seen for c in composers)
    train_flops = extra_flops
    for c, dense_seen in zip(composers, dense_tokens, strict=True):
        owned_fraction = c.owned_fraction if spec.kind in SHARDED else 1.0
        with_stand_ins = functools.partial(step_flops, cfg.model, non_owned=cfg.surrogate.non_owned,
                                           stand_in_input_grad=cfg.surrogate.input_grad)
        train_flops += step_flops(cfg.model, 1.0).total * dense_seen
        direct = with_stand_ins(owned_fraction)
        per_token = direct.total
        if workers is not None:  # owned experts outside the private layers run forward only
            forward_only = with_stand_ins(owned_fraction, offload=True, offload_input_grad=cfg.offload.input_grad)
            offloaded_share = 1 - cfg.offload.private_layers / cfg.model.n_layers
            per_token -= offloaded_share * (direct.experts - forward_only.experts)
        train_flops += per_token * (c.tokens_seen - dense_seen)
    if workers is not None:
        traffic.update(workers.bytes)
    return RunResult(
        name=spec.name, kind=spec.kind, composer_val_losses=composer_losses, assembled_val_loss=assembled,
        tokens=tokens, train_flops=train_flops, wall_s=wall_s,
        params_per_composer=max(peak[0], *(c.parameter_count() for c in composers)),
        optimizer_state_bytes_per_composer=max(peak[1], *(c.optimizer_state_bytes() for c in composers)),
        owned_fraction=statistics.mean(c.owned_fraction for c in composers), loss_history=history,
        val_history=[*val_history, (tokens, statistics.median(composer_losses))],
        network_bytes=traffic, stand_in_error=stand_in_history,
        worker_flops=workers.worker_flops if workers is not None else 0.0,
        offload_messages=dict(workers.messages) if workers is not None else {}, steps=steps_done,
    )


def publish_round(composers: Sequence[Composer], traffic: dict[str, int],
                  stand_in_history: list[tuple[int, float, float]], step: int,
                  owners: Mapping[ExpertId, tuple[int, ...]]) -> float:
    """``publish``, its bytes added to ``traffic`` and, with surrogates, the stand-in error recorded (when some
    composer holds a stand-in at all).

    Returns the distillation FLOPs spent."""
    flops, wire = publish(composers, owners)
    traffic["surrogates"] += wire
    if composers[0].cfg.surrogate.non_owned == "surrogate":
        error = stand_in_error(composers, owners)
        if error is not None:
            stand_in_history.append((step, *error))
    return flops


def deliver_sketches(composers: Sequence[Composer], sent: dict[int, dict[ExpertId, Sketch]]) -> int:
    """Every owner absorbs the sketches other composers made of its experts (possibly none this step).

    Returns the number of (x, g) rows absorbed."""
    rows = 0
    for owner in composers:
        received: dict[ExpertId, list[Sketch]] = {}
        for sender, sketches in sent.items():
            if composers[sender] is owner:
                continue
            for eid, sketch in sketches.items():
                if eid[1] in owner.owned[eid[0]]:
                    received.setdefault(eid, []).append(sketch)
                    rows += sketch.x_NL.shape[0]
        owner.absorb_sketches(received, composers=len(composers))
    return rows


def publish(composers: Sequence[Composer], owners: Mapping[ExpertId, tuple[int, ...]]) -> tuple[float, int]:
    """The first owner of each expert refreshes its surrogate (or, for frozen copies, sends the full expert)
    and every composer that does not own it applies what was published; an expert every composer owns is
    published to nobody.

    Args:
        owners: each expert's owners, composer indices best rank first (``replica_owners``).

    Returns:
        (distillation FLOPs spent, bytes every receiver downloaded in all, fp32 payloads).
    """
    non_owned = composers[0].cfg.surrogate.non_owned
    if non_owned == "drop":
        return 0.0, 0
    flops, wire = 0.0, 0
    receivers = {eid: [c for i, c in enumerate(composers) if i not in who] for eid, who in owners.items()}
    for index, owner in enumerate(composers):
        published = [eid for eid, who in owners.items() if who[0] == index and receivers[eid]]
        if non_owned == "frozen_copy":
            for eid in published:
                state = owner.expert_state(eid)
                wire += len(receivers[eid]) * sum(4 * t.numel() for t in state.values())
                for other in receivers[eid]:
                    other.load_expert_state(eid, state)
            continue
        deltas = owner.refresh_surrogates(published)
        flops += distill_cost(owner, deltas.keys())
        for eid, factors in deltas.items():
            wire += len(receivers[eid]) * payload_bytes(factors)
            for other in receivers[eid]:
                other.apply_surrogate_delta(eid, factors)
    return flops, wire


def stand_in_error(composers: Sequence[Composer], owners: Mapping[ExpertId, tuple[int, ...]],
                   rows: int = 512) -> tuple[float, float] | None:
    """How well receivers' surrogates stand in for their experts, forward and backward.

    For every published expert that has seen tokens: its first owner's most recent ``rows`` inputs, the copy
    of its surrogate held by the next composer that does not own it (every receiver applies the same deltas),
    ``relative_error`` (outputs) and ``jacobian_error`` (input gradients for Gaussian probes). Returns the
    medians over experts (nan when no expert has seen a token), or None when every composer owns every
    expert."""
    outputs, backwards = [], []
    n = len(composers)
    if all(len(who) == n for who in owners.values()):
        return None
    for (layer, expert), who in owners.items():
        owner = composers[who[0]]
        receiver = next((composers[(who[0] + k) % n] for k in range(1, n) if (who[0] + k) % n not in who), None)
        x_NL = owner.recorder.rows(layer, expert) if owner.recorder is not None else None
        if receiver is None or x_NL is None:
            continue
        real = owner.model.moe_layer(layer).experts[str(expert)]
        copy = receiver.model.moe_layer(layer).surrogates[expert]
        outputs.append(relative_error(copy, real, x_NL[-rows:]))
        backwards.append(jacobian_error(copy, real, x_NL[-rows:]))
    if not outputs:
        return float("nan"), float("nan")
    return statistics.median(outputs), statistics.median(backwards)


def distill_cost(owner: Composer, experts: Iterable[tuple[int, int]]) -> float:
    """FLOPs of one refresh: teacher forward once, then distill_steps x (student forward + backward).

    With the input-gradient term (``surrogate.jacobian_weight``) the teacher also passes one probe back
    (forward + input backward: 3 x forward) and each student step is forward, input backward with its
    graph, and the backward through both (counted 3 x the plain step: double backward of a small MLP)."""
    m, sc = owner.cfg.model, owner.cfg.surrogate
    teacher, student = 6 * m.d_latent * m.d_expert, 6 * m.d_latent * m.d_surrogate  # 3 matmuls x 2 FLOPs
    per_step, per_row = 3 * student, teacher
    if sc.jacobian_weight > 0:
        per_step, per_row = 3 * per_step, per_row + 3 * teacher
    total = 0.0
    for layer, expert in experts:
        rows = owner.recorder.rows(layer, expert) if owner.recorder is not None else None
        n = 0 if rows is None else rows.shape[0]
        total += n * (per_row + sc.distill_steps * per_step)
    return total


class LateMerges:
    """Merges that land ``lag`` steps after their round (``SimConfig.merge_lag``), each composer's live parameters of
    the group when the round took its pseudo-gradient kept with it. ``how`` (``SimConfig.late_merge``): "progress"
    keeps what the composer trained meanwhile on top of the new anchor (``OuterOptimizer.step_late``, as a node's
    background rounds apply it); "drop" lets the merge replace it; "freeze" holds the group at those parameters until
    the merge lands (``land``, after every step; the inner optimizer's moments still build from the gradients taken
    there)."""

    def __init__(self, lag: int, how: LateMerge = "progress") -> None:
        if how not in get_args(LateMerge):
            raise ValueError(f"a late merge lands one of {get_args(LateMerge)} ways, not {how!r}")
        self.lag, self.how = lag, how
        self._on_the_way: list[tuple[int, OuterOptimizer | OuterBundle, Mapping[str, torch.Tensor],
                                     dict[str, torch.Tensor]]] = []

    def send(self, step: int, outer: OuterOptimizer | OuterBundle, merged: Mapping[str, torch.Tensor]) -> None:
        """The merge of a round taken at ``step``, for ``outer``: applied at once without a lag, else on its way."""
        if self.lag == 0:
            outer.step(merged)
        else:
            self._on_the_way.append((step + self.lag, outer, merged, outer.live_copy()))

    def land(self, step: int | None = None) -> None:
        """After inner step ``step``: hold the frozen groups, then apply the merges due by it (every one still on its
        way when None), in the order they were sent."""
        waiting = []
        for due, outer, merged, submitted in self._on_the_way:
            if self.how == "freeze":
                outer.load_live(submitted)
            if step is not None and due > step:
                waiting.append((due, outer, merged, submitted))
            elif self.how == "drop":
                outer.step(merged)
            else:
                outer.step_late(merged, submitted)
        self._on_the_way = waiting


def merge_round(composers: Sequence[Composer], group: str, method: str, compression: str = "none",
                aggregation: str = "allreduce", *, groups_of: int = 0, seed: int = 0, parts: int = 0,
                apply: Callable[[OuterOptimizer | OuterBundle, Mapping[str, torch.Tensor]], None] | None = None,
                ) -> int:
    """One outer round of ``group``: pseudo-gradients merged with token weights, Nesterov step everywhere
    (``merge_outer``); with ``groups_of``, within each of ``round_groups``' groups (drawn from ``seed``); a gathered
    merge over the blocks of ``parts`` peers (``train.parts``); ``apply`` (outer, merged) in place of the outer step
    (``LateMerges.send``). Returns the bytes all composers together send."""
    if group not in composers[0].outer:
        return 0
    wire = OuterSyncConfig.of(merge=method, compression=compression, aggregation=aggregation)
    total = 0
    for members in round_groups(len(composers), groups_of, seed):
        merging = [composers[i] for i in members]
        sent = merge_outer([c.outer[group] for c in merging], [float(c.tokens_since_merge[group]) for c in merging],
                           wire, parts=parts, apply=apply)
        if sent is None:
            continue
        for c in merging:
            c.tokens_since_merge[group] = 0
        total += sent
    return total


def round_groups(n: int, groups_of: int, seed: int) -> list[list[int]]:
    """``n`` composers in a random order cut into the fewest groups of at most ``groups_of`` (sizes within one of
    each other); one group of all when ``groups_of`` is 0 or at least ``n``."""
    if groups_of == 0 or groups_of >= n:
        return [list(range(n))]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    count = -(-n // groups_of)
    return [order[i::count] for i in range(count)]


def carry(pending: Sequence[Mapping[str, torch.Tensor]], wire: OuterSyncConfig,
          ) -> tuple[list[dict[str, torch.Tensor]], list[list[int]]]:
    """Each of ``pending`` (what a round of the gathered or partitioned wire sends: ``train.outer.to_send``'s) as its
    peers decode it, and the sizes of what goes over the wire for it: its blocks' (``outer.blocks``), or its body's."""
    shapes = {k: tuple(t.shape) for k, t in pending[0].items()}
    if wire.aggregation == "parts":
        blocked = [encode_blocks(d, wire.compression) for d in pending]
        return ([decode_all(b, shapes, peer=f"composer {i}") for i, b in enumerate(blocked)],
                [[len(blob) for blob in b.blobs] for b in blocked])
    bodies = [encode_contribution(d, wire.compression) for d in pending]
    return ([decode_contribution(b, shapes, peer=f"composer {i}") for i, b in enumerate(bodies)],
            [[len(b)] for b in bodies])


def merge_carried(received: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], wire: OuterSyncConfig, *,
                  parts: int = 0) -> tuple[dict[str, torch.Tensor] | None, list[int]]:
    """The merge every participant of a gathered or partitioned round applies, of contributions as they arrived
    (``carry``'s): the partitioned round's mergers' block by block (with the merged blocks' sizes), or the gathered
    round's robust merge (over ``parts`` blocks when given; no sizes). None when nothing was kept."""
    if wire.aggregation == "parts":
        return merge_in_blocks(received, list(weights), wire)
    merged, _ = robust_merge_parts(received, list(weights), wire.method, parts=parts, eps=wire.rda_eps)
    return merged, []


def merge_outer(outers: Sequence[OuterOptimizer | OuterBundle], weights: Sequence[float],
                wire: OuterSyncConfig, *, parts: int = 0,
                apply: Callable[[OuterOptimizer | OuterBundle, Mapping[str, torch.Tensor]], None] | None = None,
                ) -> int | None:
    """One outer round among the participants holding ``outers`` (the same tensors each), token-weighted; each
    participant's merge goes to ``apply`` (outer, merged) when given, else through its outer step at once.

    "allreduce": ``wire.compression`` rounds what crosses the wire as hivemind's all-reduce does
    (``wire.wire_roundtrip``): each participant's pseudo-gradient on the way in, and on the way back
    each gets its own ``local + round(merged - local)``, so the copies differ by the rounding as on the
    network (hivemind averages the RDA components rather than the deltas; the rounding is of the same size).
    "gather": each pseudo-gradient goes through the gathered round's codec (``transport.encode_contribution``)
    and every participant applies the one robust merge of them all (``train.robust``), as every peer of a
    gathered round computes it; with ``parts``, that merge computed over the blocks ``parts`` peers would each
    merge (``train.parts``; the bytes counted are still the gathered round's). "parts": each pseudo-gradient in
    blocks (``outer.blocks``) and the merge as a partitioned round's mergers compute it, block by block, through the
    merged blocks' wire (``outer.partitioned``); bytes by its schedule (``partitioned.round_bytes``).

    Returns:
        Bytes all participants together send: the ring all-reduce of the node's wire buffers
        (``wire.payload_bytes``: 2 (n - 1) / n of them per participant), or each body to n - 1 peers;
        None when nothing was merged (no tokens since the last round, or no contribution kept).
    """
    if sum(weights) == 0:
        return None
    apply_merge = apply or (lambda outer, merged: outer.step(merged))
    method, compression = wire.method, wire.compression
    n = len(outers)
    if wire.aggregation in ("gather", "parts"):
        pending = [to_send(o, error_feedback(compression)) for o in outers]
        received, sizes = carry(pending, wire)
        merged, merged_sizes = merge_carried(received, weights, wire, parts=parts)
        if wire.aggregation == "parts":
            moved = round_bytes(sizes, merged_sizes, wire.net.parts_rechecks)
        else:
            moved = sum(sum(s) for s in sizes) * (n - 1)
        if merged is None:
            return None
        for o, p, r in zip(outers, pending, received, strict=True):
            if error_feedback(compression):
                o.keep_unsent(p, r)
            apply_merge(o, merged)
        return moved
    deltas = [o.pseudo_gradient() for o in outers]
    sent = deltas if compression == "none" else [
        {k: wire_roundtrip(t, compression) for k, t in d.items()} for d in deltas]
    merged = merge_groups(sent, list(weights), method=method)
    for o, local in zip(outers, deltas, strict=True):
        apply_merge(o, merged if compression == "none" else {
            k: local[k] + wire_roundtrip(t - local[k], compression) for k, t in merged.items()})
    size = outer_payload_bytes({k: t.shape for k, t in merged.items()}, wire)
    return int(2 * (n - 1) * size)


def assemble(composers: Sequence[Composer], cfg: TrainConfig) -> MoETransformer:
    """The exportable model: every expert real, taken from its owner, with composer 0's shared groups
    (identical on every composer right after the final merge)."""
    device = next(composers[0].model.parameters()).device
    model = MoETransformer(cfg.model, own_all(cfg.model), seed=cfg.seed).to(device)
    params = dict(model.named_parameters())
    taken: set[ExpertId] = set()
    with torch.no_grad():
        for name, p in composers[0].model.named_parameters():
            if ".moe.experts." not in name:
                params[name].copy_(p)
        for c in composers:
            for layer, expert in c.owned_experts():
                if (layer, expert) in taken:  # a replica: its owners hold the same weights after the final merge
                    continue
                taken.add((layer, expert))
                for name, p in c.model.expert_parameters(layer, expert).items():
                    params[f"blocks.{layer}.moe.experts.{expert}.{name}"].copy_(p)
    return model
