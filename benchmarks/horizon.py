"""The horizon plot: validation loss of each run over tokens, and its ratio to the synchronous baseline.

Reads the JSON files that ``parallax bench quality`` writes (each run's ``val_history``: tokens so far and
the median own-view validation loss, every ``eval_every`` steps) and draws a PNG; a run is compared with
the baseline of the same length and seed from any of the files. Optional dependency:
matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parallax.benchmarks.report import save_figure


def ratios(run: dict[str, Any], baseline: dict[str, Any]) -> list[tuple[int, float]]:
    """(tokens, run's val loss / baseline's val loss) at the token counts both runs evaluated."""
    base = {int(t): loss for t, loss in baseline["val_history"]}
    return [(int(t), loss / base[int(t)]) for t, loss in run["val_history"] if int(t) in base]


def plot(reports: Sequence[str | Path], out: str | Path, runs: Sequence[str] | None = None) -> Path:
    """Draw val loss and ratio-to-baseline against tokens for every run of every report.

    Args:
        reports: quality JSON files (e.g. the same benchmark at several --steps).
        out: the PNG to write.
        runs: which runs to draw (default: all non-baseline runs).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    loaded = [json.loads(Path(path).read_text()) for path in reports]
    seeds = {r["config"].get("seed", 0) for r in loaded}
    # A run is compared with the baseline of the same length and seed, from whichever report holds it.
    baselines = {_length(r): r["runs"]["baseline"] for r in loaded if "baseline" in r["runs"]}
    for report in loaded:
        steps, seed = _length(report)
        for name, run in report["runs"].items():
            if runs is not None and name not in runs and name != "baseline":
                continue
            label = f"{name} ({steps} steps{f', seed {seed}' if len(seeds) > 1 else ''})"
            tokens, losses = zip(*run["val_history"], strict=True)
            (line,) = ax_loss.plot([t / 1e6 for t in tokens], losses, marker=".", label=label)
            if name != "baseline" and (steps, seed) in baselines:
                points = ratios(run, baselines[steps, seed])
                if points:
                    t, r = zip(*points, strict=True)
                    ax_ratio.plot([x / 1e6 for x in t], r, marker=".", color=line.get_color(), label=label)
    if max((t for r in loaded for run in r["runs"].values() for t, _ in run["val_history"]), default=1) > 1e7:
        for ax in (ax_loss, ax_ratio):
            ax.set_xscale("log")
    ax_loss.set(xlabel="tokens (millions)", ylabel="validation loss (nats/byte)", title="validation loss")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.axhline(1.02, color="grey", linewidth=0.8, linestyle="--")
    ax_ratio.set(xlabel="tokens (millions)", ylabel="val loss / synchronous baseline", title="ratio to baseline")
    for ax in (ax_loss, ax_ratio):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, out)


def _length(report: dict[str, Any]) -> tuple[int, int]:
    """(steps, seed) of a quality report: what a run and its baseline share."""
    return int(report["config"]["steps"]), int(report["config"].get("seed", 0))
