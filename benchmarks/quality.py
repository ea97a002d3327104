"""Quality benchmark: Parallax against a synchronous MoE and a DiLoCo reference at equal tokens.

Runs, all with the same model preset, seed family and token count (C x B x steps):
    baseline        synchronous MoE, every expert real, batch C x B, ``steps`` steps;
    diloco          C composers each training every expert, all parameters merged (the same outer step);
    parallax        C composers with disjoint expert shards and forward-only surrogates (RDA merge);
    no_surrogates   Parallax with non-owned selections dropped;
    frozen_copies   Parallax with full frozen copies of non-owned experts (SPES-style);
    plain_mean      Parallax with a plain mean instead of RDA;
    replicas_R      Parallax with R owners per expert, averaged among them (R = C is the DiLoCo reference).
Parallax runs are evaluated two ways: each composer's own view (median over composers, as the report)
and the assembled model (every expert real from its owner, merged shared groups).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from parallax.benchmarks.report import write_report
from parallax.node.config import train as config_mod
from parallax.node.config.train import TrainConfig
from parallax.node.config.typed import apply_changes
from parallax.node.sim.simulator import ProgressFn, RunResult, RunSpec, run
from parallax.node.train.data import load_corpus, split_corpus

RUNS: dict[str, tuple[str, dict[str, object]]] = {
    "baseline": ("baseline", {}),
    "diloco": ("diloco", {}),
    "parallax": ("parallax", {}),
    "no_surrogates": ("parallax", {"surrogate.non_owned": "drop"}),
    "frozen_copies": ("parallax", {"surrogate.non_owned": "frozen_copy"}),
    "plain_mean": ("parallax", {"sync.merge": "mean"}),
    "replicas_2": ("parallax", {"ownership.replicas": 2}),
    "replicas_4": ("parallax", {"ownership.replicas": 4}),
}
"""The benchmark's runs: name -> (run kind, config changes on top of the chosen defaults)."""
DEFAULT_RUNS = tuple(RUNS)

SHARED_EXPERT: dict[str, object] = {"model.d_expert": 352, "model.d_shared": 96}
"""The small preset's shape: a shared expert of width 96, its width taken from the routed experts (384 -> 352)."""
ROUTED_ONLY: dict[str, object] = {"model.d_expert": 384, "model.d_shared": 0}
"""The small preset without its shared expert, the width given back to the routed experts: total parameters 1.050x,
active a token 0.968x the preset's."""

LEVERS: dict[str, tuple[str, dict[str, object]]] = {
    # Levers, each a variation of the Parallax run (or of the DiLoCo reference); docs/benchmarks.md has their results.
    "nesterov": ("parallax", {"sync.outer_lr": 0.7, "sync.outer_momentum": 0.9}),
    "diloco_nesterov": ("diloco", {"sync.outer_lr": 0.7, "sync.outer_momentum": 0.9}),
    "sketch": ("parallax", {"sim.sketch.enabled": True}),
    "sketch_nesterov": ("parallax", {"sim.sketch.enabled": True, "sync.outer_lr": 0.7, "sync.outer_momentum": 0.9}),
    "sketch_p25": ("parallax", {"sim.sketch.enabled": True, "sim.sketch.sample_fraction": 0.25}),
    "sketch_delay0": ("parallax", {"sim.sketch.enabled": True, "sim.sketch.delay": 0}),
    "refresh_10": ("parallax", {"surrogate.refresh_every": 10}),
    "tiers_25": ("parallax", {"sync.periods": {"router": 25, "latent": 25, "backbone": 25}}),
    "tiers_10_25_50": ("parallax", {"sync.periods": {"router": 10, "latent": 25, "backbone": 50}}),
    "mean_merge": ("parallax", {"sync.merge": "mean"}),
    # Decomposing the expert split's cost: gradient into the input through non-owned stand-ins, and
    # stand-ins as accurate as full copies refreshed every 5 steps (a diagnostic: it costs DiLoCo's bytes).
    "input_grad": ("parallax", {"surrogate.input_grad": True}),
    "detached": ("parallax", {"surrogate.input_grad": False}),
    "input_grad_sketch": ("parallax", {"surrogate.input_grad": True, "sim.sketch.enabled": True,
                                       "sim.sketch.delay": 0}),
    "frozen5": ("parallax", {"surrogate.non_owned": "frozen_copy", "surrogate.refresh_every": 5}),
    "frozen5_sketch": ("parallax", {"surrogate.non_owned": "frozen_copy", "surrogate.refresh_every": 5,
                                    "sim.sketch.enabled": True, "sim.sketch.delay": 0}),
    "frozen5_input_grad": ("parallax", {"surrogate.non_owned": "frozen_copy", "surrogate.refresh_every": 5,
                                        "surrogate.input_grad": True}),
    "frozen5_input_grad_sketch": ("parallax", {"surrogate.non_owned": "frozen_copy", "surrogate.refresh_every": 5,
                                               "surrogate.input_grad": True, "sim.sketch.enabled": True,
                                               "sim.sketch.delay": 0}),
    # Surrogate fidelity: a shorter fit (the default is 64 steps) and its input-gradient term.
    "distill_8": ("parallax", {"surrogate.distill_steps": 8}),
    "jacobian": ("parallax", {"surrogate.jacobian_weight": 1.0}),
    "jacobian_refresh_10": ("parallax", {"surrogate.jacobian_weight": 1.0, "surrogate.refresh_every": 10}),
    "jacobian_sketch": ("parallax", {"surrogate.jacobian_weight": 1.0, "sim.sketch.enabled": True,
                                     "sim.sketch.delay": 0}),
    # start-up phase: every composer trains every expert (DiLoCo) for the first K steps, then the split
    "dense_50": ("parallax", {"sim.dense_steps": 50}),
    "dense_100": ("parallax", {"sim.dense_steps": 100}),
    # the inner optimizer: Muon for the hidden matrices (AdamW for the rest)
    "muon": ("parallax", {"optim.inner": "muon"}),
    "replicas_2_muon": ("parallax", {"ownership.replicas": 2, "optim.inner": "muon"}),
    "diloco_muon": ("diloco", {"optim.inner": "muon"}),
    "baseline_muon": ("baseline", {"optim.inner": "muon"}),
    # the outer rounds' wire: the sparse one with error feedback, and uint8 named (whatever the default)
    "parallax_topk": ("parallax", {"sync.compression": "topk", "sync.aggregation": "gather"}),
    "parallax_uint8": ("parallax", {"sync.compression": "uint8", "sync.aggregation": "gather"}),
    "parallax_int4": ("parallax", {"sync.compression": "int4", "sync.aggregation": "gather"}),
    # outer rounds among groups of at most 4 or 8 composers, drawn anew each round (bytes bounded by the group)
    "groups_of_4": ("parallax", {"sim.outer_group_size": 4}),
    "groups_of_8": ("parallax", {"sim.outer_group_size": 8}),
    # the gathered merge as 16, 64 or 256 peers would share it (each merging its blocks of everyone's contributions)
    "parts_16": ("parallax", {"sync.aggregation": "gather", "sim.outer_parts": 16}),
    "parts_64": ("parallax", {"sync.aggregation": "gather", "sim.outer_parts": 64}),
    "parts_256": ("parallax", {"sync.aggregation": "gather", "sim.outer_parts": 256}),
    # with and without a shared expert every token passes through, merged with the backbone (the small preset's
    # shapes: the preset has one, so at this preset the *_shared runs are the defaults)
    "baseline_shared": ("baseline", SHARED_EXPERT),
    "diloco_shared": ("diloco", SHARED_EXPERT),
    "parallax_shared": ("parallax", SHARED_EXPERT),
    "baseline_routed": ("baseline", ROUTED_ONLY),
    "diloco_routed": ("diloco", ROUTED_ONLY),
    "parallax_routed": ("parallax", ROUTED_ONLY),
}
"""Named variations of the runs (``--runs`` accepts these names too)."""


def specs(cfg: TrainConfig, composers: int, runs: Sequence[str] = DEFAULT_RUNS) -> list[RunSpec]:
    """The benchmark's runs, each a variation of ``cfg``."""
    table = RUNS | LEVERS
    unknown = [name for name in runs if name not in table]
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {', '.join(table)}")
    out = []
    for name in runs:
        kind, changes = table[name]
        out.append(RunSpec(name=name, kind=kind, cfg=apply_changes(cfg, changes), composers=composers))
    return out


def run_quality(cfg: TrainConfig, composers: int, data: str | None = None, *, runs: Sequence[str] = DEFAULT_RUNS,
                progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run the benchmark and return its JSON-able report."""
    train, val = split_corpus(load_corpus(data))
    results: dict[str, RunResult] = {}
    started = time.perf_counter()
    for spec in specs(cfg, composers, runs):
        results[spec.name] = run(spec, train, val, progress=progress)
    return quality_report(cfg, composers, data, results, time.perf_counter() - started)


def quality_report(cfg: TrainConfig, composers: int, data: str | None, results: dict[str, RunResult],
                   total_wall_s: float) -> dict[str, Any]:
    """The JSON-able report of finished runs of one setting."""
    report: dict[str, Any] = {
        "config": {"preset": _preset_name(cfg), "composers": composers, "steps": cfg.steps,
                   "batch_size": cfg.batch_size, "seq_len": cfg.model.seq_len, "seed": cfg.seed,
                   "data": data or "built-in tinyshakespeare", "sync_periods": dict(cfg.sync.periods),
                   "refresh_every": cfg.surrogate.refresh_every, "model": _asdict(cfg.model)},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "platform": platform.platform()},
        "total_wall_s": total_wall_s,
        "runs": {},
    }
    for name, r in results.items():
        report[f"{name}_val_loss"] = r.val_loss
        report["runs"][name] = {
            "kind": r.kind, "val_loss": r.val_loss, "composer_val_losses": r.composer_val_losses,
            "assembled_val_loss": r.assembled_val_loss, "tokens": r.tokens, "train_flops": r.train_flops,
            "wall_s": r.wall_s, "params_per_composer": r.params_per_composer,
            "optimizer_state_bytes_per_composer": r.optimizer_state_bytes_per_composer,
            "owned_fraction": r.owned_fraction, "network_bytes": r.network_bytes,
            "network_bytes_per_composer_step": sum(r.network_bytes.values()) / (composers * cfg.steps),
            "loss_history": r.loss_history, "val_history": r.val_history, "stand_in_error": r.stand_in_error,
        }
    if "parallax" in results:
        report["assembled_val_loss"] = results["parallax"].assembled_val_loss
    return report


def markdown(report: dict[str, Any]) -> str:
    """A short table of the report, ratios against the baseline."""
    base = report["runs"].get("baseline", {}).get("val_loss")
    lines = [
        "| run | val loss (own view, median) | assembled | / baseline | tokens | train PFLOP | wall s "
        "| params/composer | opt. state MB/composer | network KB/composer-step "
        "| stand-in error (output / input grad) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["runs"].items():
        ratio = f"{r['val_loss'] / base:.3f}" if base else "-"
        lines.append(
            f"| {name} | {r['val_loss']:.4f} | {r['assembled_val_loss']:.4f} | {ratio} | {r['tokens']:,} "
            f"| {r['train_flops'] / 1e15:.4g} | {r['wall_s']:.0f} | {r['params_per_composer']:,} "
            f"| {r['optimizer_state_bytes_per_composer'] / 2**20:.1f} "
            f"| {r.get('network_bytes_per_composer_step', 0) / 1024:.1f} | {_stand_in(r)} |"
        )
    c = report["config"]
    if "baseline" in report["runs"]:
        n, params = c["composers"], report["runs"]["baseline"]["params_per_composer"]
        lines.append("")
        ddp_kb = 2 * (n - 1) / n * 4 * params / 1024
        lines.append(f"For scale: a DDP all-reduce of this model's fp32 gradients moves {ddp_kb:,.0f} "
                     "KB per composer-step.")
    lines.append("")
    lines.append(f"preset {c['preset']}, {c['composers']} composers, {c['steps']} steps x batch "
                 f"{c['batch_size']} x {c['seq_len']} bytes per composer, seed {c['seed']}, data {c['data']}, "
                 f"sync periods {c['sync_periods']}, surrogate refresh every {c['refresh_every']} steps.")
    return "\n".join(lines)


def _stand_in(run: dict[str, Any]) -> str:
    """The surrogates' median errors over the run's refreshes, "-" where there are none."""
    errors = [(out, back) for _, out, back in run.get("stand_in_error", [])]
    if not errors:
        return "-"
    return f"{statistics.median(e[0] for e in errors):.3f} / {statistics.median(e[1] for e in errors):.3f}"


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)


def _asdict(cfg: object) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}  # type: ignore[attr-defined]


def _preset_name(cfg: TrainConfig) -> str:
    for name, model in config_mod.PRESETS.items():
        if model == cfg.model:
            return name
    return "custom"
