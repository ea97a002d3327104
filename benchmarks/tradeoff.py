"""Quality against memory: the runs of several ``parallax bench quality`` reports (one per seed), each run's
validation loss and its ratios to the synchronous baseline and to the DiLoCo reference of the same seed,
beside what a composer holds (parameters and optimizer state), its training FLOPs and its bytes per step.

The replicas dial (``ownership.replicas``) trades memory and expert compute for quality; this puts the
runs of that dial on one table and one plot. Optional dependency for the plot: matplotlib
(``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parallax.benchmarks.report import save_figure

FP32 = 4
"""Bytes a parameter takes (the composers keep fp32 master weights)."""


def load(reports: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The reports, checked to be runs of one setting, joined into one report per seed (a seed's runs may come
    from several commands: a run added later goes in its own file).

    Raises:
        ValueError: no report, a report without runs, one run of one seed in two reports, or different presets,
            composers or steps.
    """
    loaded = [json.loads(Path(path).read_text()) for path in reports]
    if not loaded or any(not r.get("runs") for r in loaded):
        raise ValueError("pass one or more JSON files written by `parallax bench quality --json`")
    settings = {(r["config"]["preset"], r["config"]["composers"], r["config"]["steps"]) for r in loaded}
    if len(settings) != 1:
        raise ValueError(f"the reports differ in preset, composers or steps: {sorted(settings)}")
    by_seed: dict[int, dict[str, Any]] = {}
    for r in loaded:
        seed = r["config"]["seed"]
        held = by_seed.get(seed)
        if held is None:
            by_seed[seed] = {**r, "runs": dict(r["runs"])}
            continue
        twice = sorted(set(held["runs"]) & set(r["runs"]))
        if twice:
            raise ValueError(f"seed {seed}: runs {twice} are in two reports; pass each run of a seed once")
        held["runs"].update(r["runs"])
    return list(by_seed.values())


def memory_bytes(run: dict[str, Any]) -> int:
    """What one composer holds: its parameters (fp32, real experts, stand-ins and shared groups) and its
    inner and outer optimizer state."""
    return int(run["params_per_composer"]) * FP32 + int(run["optimizer_state_bytes_per_composer"])


def summary(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per run (those in every report): each seed's val loss (own view and assembled), its ratios to that
    seed's baseline and DiLoCo runs, and the means; memory, FLOPs and bytes per composer-step."""
    names = [n for n in reports[0]["runs"] if all(n in r["runs"] for r in reports)]
    out: dict[str, Any] = {"seeds": [r["config"]["seed"] for r in reports], "config": reports[0]["config"], "runs": {}}
    for name in names:
        runs = [r["runs"][name] for r in reports]
        row: dict[str, Any] = {
            "val_loss": [run["val_loss"] for run in runs],
            "assembled_val_loss": [run["assembled_val_loss"] for run in runs],
            "memory_bytes": memory_bytes(runs[0]),
            "params_per_composer": runs[0]["params_per_composer"],
            "optimizer_state_bytes_per_composer": runs[0]["optimizer_state_bytes_per_composer"],
            "train_flops": statistics.mean(run["train_flops"] for run in runs),
            "network_bytes_per_composer_step": statistics.mean(run["network_bytes_per_composer_step"]
                                                               for run in runs),
        }
        for reference in ("baseline", "diloco"):
            if all(reference in r["runs"] for r in reports):
                row[f"over_{reference}"] = [run["val_loss"] / r["runs"][reference]["val_loss"]
                                            for run, r in zip(runs, reports, strict=True)]
        out["runs"][name] = row
    return out


def markdown(table: dict[str, Any]) -> str:
    """The summary as a table: means over the seeds, each seed's value in brackets where there are several."""
    several = len(table["seeds"]) > 1

    def cell(values: list[float], digits: int) -> str:
        mean = f"{statistics.mean(values):.{digits}f}"
        return f"{mean} ({', '.join(f'{v:.{digits}f}' for v in values)})" if several else mean

    lines = [
        "| run | val loss (own view) | assembled | / baseline | / DiLoCo | memory MB/composer | params/composer "
        "| opt. state MB/composer | train PFLOP | network KB/composer-step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in table["runs"].items():
        lines.append(
            f"| {name} | {cell(r['val_loss'], 4)} | {cell(r['assembled_val_loss'], 4)} "
            f"| {cell(r['over_baseline'], 3) if 'over_baseline' in r else '-'} "
            f"| {cell(r['over_diloco'], 3) if 'over_diloco' in r else '-'} | {r['memory_bytes'] / 2**20:.2f} "
            f"| {r['params_per_composer']:,} | {r['optimizer_state_bytes_per_composer'] / 2**20:.2f} "
            f"| {r['train_flops'] / 1e15:.4g} | {r['network_bytes_per_composer_step'] / 1024:.1f} |")
    c = table["config"]
    lines += ["", f"preset {c['preset']}, {c['composers']} composers, {c['steps']} steps x batch {c['batch_size']}, "
              f"seeds {', '.join(str(s) for s in table['seeds'])}; memory is fp32 parameters plus inner and outer "
              "optimizer state."]
    return "\n".join(lines)


def plot(table: dict[str, Any], out: str | Path) -> Path:
    """Val loss (mean over seeds, the seeds' range as the bar) against memory per composer, one point a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    names_at: dict[tuple[float, float], list[str]] = {}  # runs that land on one point share a label
    for name, r in table["runs"].items():
        x = r["memory_bytes"] / 2**20
        mean = statistics.mean(r["val_loss"])
        low, high = mean - min(r["val_loss"]), max(r["val_loss"]) - mean
        ax.errorbar([x], [mean], yerr=[[low], [high]], marker="o", capsize=3, label=name)
        names_at.setdefault((round(x, 3), round(mean, 6)), []).append(name)
    for (x, mean), names in names_at.items():
        ax.annotate(" = ".join(names), (x, mean), textcoords="offset points", xytext=(5, 4), fontsize=7)
    c = table["config"]
    ax.set(xlabel="memory per composer (MB: fp32 parameters + optimizer state)",
           ylabel="validation loss (nats/byte, own view)",
           title=f"{c['preset']}, C = {c['composers']}, {c['steps']} steps, seeds {table['seeds']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out)
