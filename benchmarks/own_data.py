"""Work on one's own data: can a peer tell a composer that trains from one that copies another's contribution?

A composer's data stream is a seeded sampler (``data.BatchSampler``), so any peer that knows the seed and how many
batches the composer drew rebuilds the batches it trained on (``BatchSampler.replay``). A pseudo-gradient trained on
those batches lowers the loss on them by more than the swarm's merged update does: it holds what the composer learnt
of its own batches, which the merge dilutes n-fold. A copy of another composer's pseudo-gradient (plus noise) holds
nothing of the copier's batches, and lowers the loss on them less than the merge, which averages the noise out.

For each backbone round of the simulator (``sim.simulator.run``'s ``before_merge``), and each composer, on the last
``batches`` batches it drew (of the round's period):

- ``own``: the loss on them at the group's anchor minus the loss with the composer's offered pseudo-gradient applied;
- ``merged``: the same with the mean of the other composers' offered pseudo-gradients applied (but any within
  ``DUPLICATE_COSINE`` of the composer's: a copy of it, or the one it copies);
- ``margin``: ``(own - merged) / |merged|`` (``train.own_data``).

Three auditors: ``self``, on the composer's own model (its experts trained, the others' surrogates); ``peer``, on the
next composer's model (with its own experts and its surrogates of the audited composer's); ``node``, a node's own
(``train.own_data.Auditor`` on the next composer's model: the same batches, against the round's robust merge of every
offered pseudo-gradient, the audited one included, each as the round's wire carries it: quantized, with what earlier
rounds left unsent, ``sim.simulator.carry``, and merged as the round merges them, ``merge_carried``; every composer in
one round: ``sim.outer_group_size`` is not followed), run only where the composers sample one stream as a run's nodes
do (``--set sim.data=stream``). A judgement counts an audit as failed below ``own_data.FAILS_BELOW``.

Two runs: ``honest`` (every composer trains) and ``copier`` (the last composer trains nothing from the first round on
and offers the first composer's pseudo-gradient of the round plus 1% noise, as ``bench attacks``' ``copied-work``
does). Reported per composer and auditor: the rounds audited, the shares of positive and of passing margins (above
``own_data.FAILS_BELOW``), the median margin, and for the node's rule (``own_data.judged_idle``: not working on its
data when fewer than half of its last ``WINDOW`` audits pass) the share of windows that judge it so, and the share of
its audits in which the contribution lowered the loss on its sender's batches more than on as many control batches
(``own_data.control_seed``).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from parallax.benchmarks.quality import _preset_name
from parallax.benchmarks.report import percent, write_report
from parallax.node.config.train import TrainConfig
from parallax.node.outer.transport import error_feedback
from parallax.node.outer.wire import OuterSyncConfig
from parallax.node.sim.simulator import ProgressFn, RunSpec, carry, merge_carried, run
from parallax.node.train.composer import Composer
from parallax.node.train.data import load_corpus, split_corpus
from parallax.node.train.outer import to_send
from parallax.node.train.own_data import (
    BATCHES,
    FAILS_BELOW,
    WINDOW,
    Auditor,
    Case,
    OwnDataAudits,
    gains,
    idle_share,
    margin,
)
from parallax.node.train.robust import merge_geometry, robust_merge_groups

DEFAULT_RUNS = ("honest", "copier")
GROUP = "backbone"
AUDITORS = ("self", "peer", "node")
"""Who audits: the audited composer's own model, the next composer's, and the next composer's against the round's
merge of every contribution (the module docstring)."""
DUPLICATE_COSINE = 0.99
"""Another composer's pseudo-gradient this close to the audited one (a copy of it, or the one it copies) is left out
of what it is compared with: a copy would otherwise pull the merge toward the composer it copied."""
NOISE = 0.01
"""The copier's noise, relative to the RMS of the pseudo-gradient it copies."""


class _Audit:
    """The ``before_merge`` of one run: the copier's offer, then each composer's margin at each ``GROUP`` round (and,
    for the node's audits, whether the contribution beat its control batches: ``specific``)."""

    def __init__(self, copier: bool, period: int, seed: int, wire: OuterSyncConfig, parts: int = 0) -> None:
        self.copier, self.period, self.wire, self.parts = copier, period, wire, parts
        self.noise = torch.Generator().manual_seed(seed)
        self.margins: dict[str, dict[int, list[float]]] = {auditor: {} for auditor in AUDITORS}
        self._nodes: dict[int, Auditor] = {}  # per audited composer: the node's auditor on the next one's model
        self._idle = False
        self.specific: dict[int, list[bool]] = {}  # per composer: its node audits' own gain above the control's

    def _specific(self, composer: int, name: str, **fields: Any) -> None:
        if fields.get("own") is not None:
            self.specific.setdefault(composer, []).append(fields["own"] > fields["own_control"])

    def __call__(self, composers: Sequence[Composer], group: str, step: int) -> None:
        if group not in composers[0].outer:
            return
        offered = [c.outer[group].pseudo_gradient() for c in composers]
        if self.copier:
            if not self._idle:  # trains nothing from here on: no parameter of it moves again
                composers[-1].optimizer_step = lambda: None  # type: ignore[method-assign]
                self._idle = True
            offered[-1] = {name: t + NOISE * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=self.noise)
                           for name, t in offered[0].items()}
            anchor = composers[-1].outer[group].anchor
            composers[-1].outer[group].load_live({name: anchor[name] - offered[-1][name] for name in anchor})
        if group != GROUP:
            return
        gram = merge_geometry(offered, offered[0])["gram"]
        tokens = [float(c.tokens_since_merge[group]) for c in composers]
        if self.wire.aggregation in ("gather", "parts"):  # what a node receives of each composer, and merges
            carried, _ = carry([to_send(c.outer[group], error_feedback(self.wire.compression)) for c in composers],
                               self.wire)
            whole_merge, _ = merge_carried(carried, tokens, self.wire, parts=self.parts)
        else:
            carried = offered
            whole_merge, _ = robust_merge_groups(offered, tokens, self.wire.method, eps=self.wire.rda_eps)
        if whole_merge is None:
            return
        for i, composer in enumerate(composers):
            drawn = composer.sampler.step
            # The batches since the group's last merge (a round off its schedule, the run's last, comes early).
            since = composer.tokens_since_merge[group] // (composer.batch_size * composer.cfg.model.seq_len)
            count = min(BATCHES, self.period, since)
            others = [d for j, d in enumerate(offered)
                      if j != i and gram[i][j] < DUPLICATE_COSINE * max((gram[i][i] * gram[j][j]) ** 0.5, 1e-30)]
            if count < 1 or drawn < count or not others:
                continue
            merged = {name: torch.stack([d[name] for d in others]).mean(0) for name in offered[i]}
            batches = composer.sampler.replay(drawn - count, count)
            own, whole = gains(composer, group, [offered[i], merged], batches)
            auditor = composers[(i + 1) % len(composers)]
            seen = gains(auditor, group, [offered[i], merged], batches)
            values: dict[str, float | None] = {"self": margin(own, whole), "peer": margin(seen[0], seen[1])}
            if composer.cfg.sim.data == "stream":  # the node's rebuilds the sender's batches from the run's stream
                seeds = {str(i): composer.sampler.seed}
                node = self._nodes.setdefault(i, Auditor(auditor, seeds.get, self.period, OwnDataAudits(),
                                                         functools.partial(self._specific, i)))
                values["node"] = node(group, Case(str(i), drawn, carried[i], whole_merge))
            for name, value in values.items():
                if value is not None:
                    self.margins[name].setdefault(i, []).append(value)


def run_own_data(cfg: TrainConfig, composers: int, data: str | None = None, *, runs: Sequence[str] = DEFAULT_RUNS,
                 progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run the benchmark and return its JSON-able report."""
    if composers < 3:
        raise ValueError(f"the benchmark needs at least 3 composers (two honest beside the copier), got {composers}")
    unknown = sorted(set(runs) - set(DEFAULT_RUNS))
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose among {', '.join(DEFAULT_RUNS)}")
    if GROUP not in cfg.sync.periods:
        raise ValueError(f"the run merges no {GROUP} group (sync.periods {dict(cfg.sync.periods)})")
    train, val = split_corpus(load_corpus(data))
    report: dict[str, Any] = {"preset": _preset_name(cfg), "composers": composers, "steps": cfg.steps,
                              "periods": dict(cfg.sync.periods), "group": GROUP,
                              "batches": min(BATCHES, cfg.sync.periods[GROUP]), "window": WINDOW, "noise": NOISE,
                              "runs": {}}
    started = time.perf_counter()
    for name in runs:
        audit = _Audit(name == "copier", cfg.sync.periods[GROUP], cfg.seed, OuterSyncConfig(sync=cfg.sync),
                       cfg.sim.outer_parts)
        result = run(RunSpec(name=name, kind="parallax", cfg=cfg, composers=composers), train, val,
                     progress=progress, before_merge=audit)
        rows = []
        for i in range(composers):
            for auditor in AUDITORS:
                margins = audit.margins[auditor].get(i, [])
                rows.append({"composer": i, "copier": name == "copier" and i == composers - 1, "auditor": auditor,
                             "audits": len(margins),
                             "positive": sum(m > 0 for m in margins) / len(margins) if margins else None,
                             "passed": sum(m > FAILS_BELOW for m in margins) / len(margins) if margins else None,
                             "median_margin": statistics.median(margins) if margins else None,
                             "judged_idle": idle_share(margins), "margins": margins,
                             "specific": _share(audit.specific.get(i, [])) if auditor == "node" else None})
        report["runs"][name] = {"val_loss": result.val_loss, "composers": rows}
    report["wall_s"] = time.perf_counter() - started
    return report


def _share(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Work on one's own data: {report['composers']} composers, preset {report['preset']}, "
             f"{report['steps']} steps, periods {report['periods']}; each {report['group']} round, every composer's "
             f"offered pseudo-gradient against the merged one on its own last {report['batches']} batches, evaluated "
             f"on its own model (self), on the next composer's (peer), and there against the round's robust merge "
             f"(node); an audit passes above {FAILS_BELOW}; judged on its last {report['window']} audits.", "",
             "| run | composer | auditor | audits | margins > 0 | passed | median margin | windows judging it idle "
             "| own batches above control |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        for row in r["composers"]:
            who = f"{row['composer']} (copier)" if row["copier"] else str(row["composer"])
            positive = percent(row["positive"])
            passed = percent(row["passed"])
            median = "-" if row["median_margin"] is None else f"{row['median_margin']:+.3f}"
            idle = percent(row["judged_idle"])
            specific = percent(row["specific"])
            lines.append(f"| {name} | {who} | {row['auditor']} | {row['audits']} | {positive} | {passed} | {median} "
                         f"| {idle} | {specific} |")
    return "\n".join(lines)


def write(report: dict[str, Any], json_path: Any) -> None:
    write_report(report, markdown(report), json_path)
