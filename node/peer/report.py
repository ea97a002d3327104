"""``parallax report``: a run's metrics files (one JSONL per node, ``--metrics``) turned into plots and a summary.

Everything shown is read from the files: each node's step lines (loss, tokens, tokens/s, the byte counters) and
events (outer rounds, hand-overs, the final evaluation). A benchmark JSON (``parallax bench quality --json``) adds
its synchronous baseline's validation curve, per composer: its tokens divided by that run's composers.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallax.node.outer.records import RoundStatus
from parallax.node.peer.local_swarm import read_metrics


@dataclass
class NodeReport:
    """One node's run, from its metrics file."""

    name: str
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    traffic: list[int] = field(default_factory=list)
    """Bytes sent + received so far, per step line."""
    rounds: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(group, status) -> outer rounds."""
    adoptions: int = 0
    releases: int = 0
    evals: list[tuple[int, int, float]] = field(default_factory=list)
    """(step, tokens, validation loss) of each evaluation of the node's own view (periodic and final)."""

    @property
    def val_loss(self) -> float | None:
        """The last evaluation's validation loss."""
        return self.evals[-1][2] if self.evals else None

    @property
    def final_loss(self) -> float | None:
        """Mean training loss of the last ten steps (one step is noisy)."""
        return statistics.fmean(self.losses[-10:]) if self.losses else None

    @property
    def bytes_per_step(self) -> float:
        if len(self.steps) < 2 or self.steps[-1] == self.steps[0]:
            return 0.0
        return (self.traffic[-1] - self.traffic[0]) / (self.steps[-1] - self.steps[0])


def read_node(path: Path) -> NodeReport:
    """A node's report from its metrics file.

    Raises:
        ValueError: the file does not exist or holds no step line (not a node's metrics file).
    """
    if not path.is_file():
        raise ValueError(f"no metrics file at {path}; pass the files nodes wrote with --metrics")
    report = NodeReport(name=path.parent.name if path.name == "metrics.jsonl" else path.stem)
    for r in read_metrics(path):
        kind = r.get("kind")
        if kind == "step" and isinstance(r.get("step"), int) and isinstance(r.get("loss"), int | float):
            report.steps.append(r["step"])
            report.losses.append(float(r["loss"]))
            report.tokens.append(_number(r, "tokens"))
            report.tokens_per_s.append(float(_number(r, "tokens_per_s")))
            report.traffic.append(_number(r, "bytes_sent") + _number(r, "bytes_received"))
        elif kind == "round":
            report.rounds[(str(r.get("group")), str(r.get("status")))] += 1
        elif kind == "adopted":
            report.adoptions += 1
        elif kind == "released":
            report.releases += 1
        elif kind in ("eval", "final_eval") and isinstance(r.get("val_loss"), int | float):
            report.evals.append((int(_number(r, "step")), int(_number(r, "tokens")), float(r["val_loss"])))
    if not report.steps:
        raise ValueError(f"{path} holds no step line: is it a node's --metrics file?")
    return report


def _number(record: dict[str, Any], key: str) -> int:
    """A counter of a metrics line, 0 when absent or not a number."""
    value = record.get(key)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def baseline_curve(path: Path) -> tuple[list[tuple[int, float]], int]:
    """(tokens, val loss) of the synchronous baseline in a ``bench quality`` JSON, and the composers its tokens
    were counted over (the run's ``config.composers``, 1 when absent).

    Raises:
        ValueError: not such a file.
    """
    try:
        doc = json.loads(path.read_text())
        curve = [(int(t), float(v)) for t, v in doc["runs"]["baseline"]["val_history"]]
        composers = doc.get("config", {}).get("composers", 1)
        return curve, composers if type(composers) is int and composers > 0 else 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a `parallax bench quality --json` file with a baseline run ({e!r})") from None


SMOOTHING = 20
"""Step lines in the throughput plot's moving average."""


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def report_run(paths: Sequence[Path], out: Path, baseline: Path | None = None) -> Path:
    """Plots (``loss.png``, ``throughput.png``, ``rounds.png``) and ``report.md`` in ``out``; returns the markdown.

    Raises:
        ValueError: a file that is not a node's metrics or a benchmark JSON.
        ModuleNotFoundError: matplotlib is missing (the ``bench`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [read_node(Path(p)) for p in paths]
    base, composers = baseline_curve(baseline) if baseline is not None else ([], 1)
    out.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n in nodes:
        x = n.tokens if any(n.tokens) else n.steps
        line, = ax.plot(x, n.losses, linewidth=0.8, label=f"{n.name} (training)")
        if n.evals:
            ax.plot([e[1] if any(n.tokens) else e[0] for e in n.evals], [e[2] for e in n.evals], marker="o",
                    markersize=3, color=line.get_color(), linestyle=":", label=f"{n.name} (validation)")
    if base:
        ax.plot([t / composers for t, _ in base], [v for _, v in base], color="black", linestyle="--",
                label=f"synchronous baseline, validation (tokens per composer of {composers})")
    ax.set(xlabel="tokens per node" if any(n.tokens for n in nodes) else "step", ylabel="loss (nats per token)",
           title="loss per node")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4))
    for n in nodes:
        raw = ax_t.plot(n.steps, n.tokens_per_s, linewidth=0.5, alpha=0.3)[0]
        ax_t.plot(n.steps, moving_average(n.tokens_per_s, SMOOTHING), linewidth=1.2, color=raw.get_color(),
                  label=n.name)
        ax_b.plot(n.steps, [b / 1e6 for b in n.traffic], linewidth=1.0, label=n.name)
    ax_t.set(xlabel="step", ylabel=f"tokens/s (faint: as logged; line: mean of {SMOOTHING} step lines)",
             title="throughput")
    ax_b.set(xlabel="step", ylabel="MB sent + received, cumulative", title="traffic")
    for a in (ax_t, ax_b):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)

    outcomes = sorted({key for n in nodes for key in n.rounds})
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{g}\n{s}" for g, s in outcomes]
    width = 0.8 / max(1, len(nodes))
    for i, n in enumerate(nodes):
        ax.bar([j + i * width for j in range(len(outcomes))], [n.rounds[k] for k in outcomes], width, label=n.name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(outcomes))], labels, fontsize=7)
    ax.set(ylabel="outer rounds", title="outer-round outcomes per group")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "rounds.png", dpi=120)
    plt.close(fig)

    markdown = summary(nodes, base)
    (out / "report.md").write_text(markdown)
    return out / "report.md"


def summary(nodes: Sequence[NodeReport], base: Sequence[tuple[int, float]] = ()) -> str:
    """The markdown beside the plots."""
    lines = ["# Run report", "", "![loss](loss.png)", "", "![throughput and traffic](throughput.png)", "",
             "![outer rounds](rounds.png)", "",
             "| node | steps | final loss (last 10 steps) | val loss | tokens/s (median) | bytes per step "
             "| rounds ok | rounds not ok | experts taken / handed over |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in nodes:
        ok = sum(c for (_g, s), c in n.rounds.items() if s == "ok")
        not_ok = sum(c for (_g, s), c in n.rounds.items() if s != "ok")
        val = f"{n.val_loss:.4f}" if n.val_loss is not None else "-"
        final = f"{n.final_loss:.4f}" if n.final_loss is not None else "-"
        lines.append(f"| {n.name} | {n.steps[-1]:,} | {final} | {val} | {statistics.median(n.tokens_per_s):,.0f} "
                     f"| {n.bytes_per_step:,.0f} | {ok} | {not_ok} | {n.adoptions} / {n.releases} |")
    if base:
        lines += ["", f"Synchronous baseline (benchmark file): validation loss {base[-1][1]:.4f} after "
                      f"{base[-1][0]:,} tokens in all."]
    rounds: dict[str, Counter[str]] = {}
    for n in nodes:
        for (group, status), c in n.rounds.items():
            rounds.setdefault(group, Counter())[status] += c
    if any(n.val_loss is None for n in nodes):
        lines += ["", "val loss `-`: the node never evaluated its model on the validation split (it does every "
                      "`eval_every` steps, 100 unless `--set eval_every=N` says otherwise, and when it leaves with "
                      "`--final-eval`; `parallax export` then `parallax eval` measure the whole model)."]
    if rounds:
        lines += ["", "Outer rounds, all nodes: " + "; ".join(
            f"{g}: " + ", ".join(f"{s} {c}" for s, c in sorted(st.items())) for g, st in sorted(rounds.items()))]
        seen = sorted({s for st in rounds.values() for s in st})
        lines += ["", "| outcome | what it means |", "|---|---|"]
        lines += [f"| {s} | {RoundStatus(s).meaning if s in _STATUSES else 'not an outcome this Parallax writes'} |"
                  for s in seen]
    return "\n".join(lines) + "\n"


_STATUSES = {s.value for s in RoundStatus}
