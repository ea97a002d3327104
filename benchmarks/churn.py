"""A swarm that never stops changing: ``parallax bench churn``.

C composers of the tiny preset on loopback (one torch thread each) train for a set time while composers leave at
exponentially distributed times, each one's lifetime L on average (so the swarm loses one every L/C seconds), and
a new identity joins in each one's place at once, so the swarm stays near C and joins land during other peers'
hand-overs. Departures take turns in a seeded random order, a third each:

- ``interrupt``: Ctrl+C (SIGINT), the graceful leave: final snapshots to the new owners, a deathrattle;
- ``kill``: SIGKILL of the node's whole process group (its DHT process and p2pd too): a machine dying;
- ``freeze``: SIGSTOP of the whole group, then SIGKILL once its heartbeats have expired: a host cut off from
  the network that never comes back, as its peers see it (every packet to it unanswered). On loopback; the
  network lab's cut (``parallax lab``) is not used here.

At the end the swarm waits (bounded) until every expert has ``ownership.replicas`` owners among the nodes alive,
exports the whole model from the live swarm (``parallax export``), and every node leaves with its final
evaluation. Then the same swarm without churn trains to the same swarm step (the median step of the nodes alive
when the churn ended), waits, exports and is evaluated alike. Measured, from the nodes' own metrics:

- expert steps lost per departure: for each expert the departed node owned, its steps on it after the copy its
  new owner took it over from was taken (0 when another owner held it live, ``ownership.replicas`` >= 2, or when
  the departure handed it over); an expert never taken over counts in ``experts_never_adopted``;
- hand-overs: seconds from a departure until each of its experts was adopted elsewhere;
- outer rounds completed, of those begun; peak resident memory per node and per p2pd;
- final validation loss of the nodes alive at the end (median of their own views) and of the export, each over the
  run without churn;
- processes left behind in the nodes' sessions once the swarm closed (target 0).

Every node and daemon shares the machine's cores (the report names them): churn adds start-ups (tens of seconds
of CPU each) to a crowded machine, which slows every node's steps and answers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from parallax.benchmarks.report import write_report
from parallax.benchmarks.scale import RssPeaks
from parallax.dht.adapter import dht_time
from parallax.node.peer.local_swarm import LocalSwarm, NodeProcess, read_metrics
from parallax.node.peer.processes import kill_group, send
from parallax.node.peer.timeline import events, ownership, shard_at

PERIODS = {"router": 25, "latent": 50, "backbone": 100}  # the tiny preset's own
N_LAYERS, N_EXPERTS = 2, 4  # the tiny preset's MoE shape
HOW = ("interrupt", "kill", "freeze")
FROZEN_FOR_S = 10.0
"""A frozen node is killed this long after it went silent: past its heartbeats' 6 s life, so peers see it die as
they see a cut-off host, by silence."""
Progress = Callable[[str], object]


@dataclass
class Departure:
    """One node leaving the swarm, as the benchmark caused it."""

    t: float  # the DHT clock when it was signalled
    node: int
    how: str
    step: int  # its last step record before it
    owned: list[tuple[int, int]]
    replacement: int | None = None  # the node started in its place
    lost_steps: dict[str, int | None] = field(default_factory=dict)  # "layer.expert" -> steps lost (None: never)
    handover_s: dict[str, float | None] = field(default_factory=dict)


def _records(node: NodeProcess) -> list[dict[str, Any]]:
    return read_metrics(node.metrics)


def _training(node: NodeProcess) -> bool:
    return node.alive and bool(events(_records(node), "first_step"))


class Churn:
    """One swarm under churn (or none: ``lifetime_s`` None) until ``until()`` says stop."""

    def __init__(self, swarm: LocalSwarm, composers: int, lifetime_s: float | None, seed: int,
                 peaks: RssPeaks, progress: Progress) -> None:
        self.swarm, self.composers, self.lifetime_s, self.peaks = swarm, composers, lifetime_s, peaks
        self.progress = progress
        self.rng = random.Random(seed)
        self.departures: list[Departure] = []
        self._ways: list[str] = []
        self._frozen: list[tuple[float, NodeProcess]] = []  # (kill at, node)

    def start(self, timeout_s: float) -> None:
        self.swarm.start_bootstrap()
        for _ in range(self.composers):
            self.swarm.add_node("--min-peers", str(self.composers))
        self._wait(lambda: all(n.step >= 10 for n in self.swarm.nodes), timeout_s, "every node past step 10")

    def run(self, until: Callable[[], bool]) -> None:
        """Depart and replace nodes at exponential times until ``until()``; frozen nodes die on schedule."""
        next_at = time.monotonic() + self._next_departure()
        while not until():
            now = time.monotonic()
            self._kill_frozen(now)
            if now >= next_at:
                self._depart()
                next_at = now + self._next_departure()
            self.peaks.sample(self.swarm.nodes)
            self._check_failures()
            time.sleep(0.5)
        self.kill_frozen()

    def kill_frozen(self) -> None:
        """Kill every frozen node now (the churn ended, or the run failed: a stopped process heeds no Ctrl+C)."""
        self._kill_frozen(float("inf"))

    def joined(self, timeout_s: float) -> float | None:
        """Seconds until every node alive had trained a step (the last replacements are still starting when the
        churn ends); None: not within ``timeout_s``."""
        return self._poll(lambda: all(_training(n) for n in self.swarm.nodes if n.alive), timeout_s)

    def settle(self, replicas: int, timeout_s: float) -> float | None:
        """Seconds until every expert had ``replicas`` owners among the live nodes (None: not within
        ``timeout_s``)."""
        return self._poll(lambda: owners_complete([_records(n) for n in self.swarm.nodes if n.alive], dht_time(),
                                                  replicas), timeout_s, check_failures=False)

    def _next_departure(self) -> float:
        if self.lifetime_s is None:
            return float("inf")
        return self.rng.expovariate(self.composers / self.lifetime_s)

    def _depart(self) -> None:
        gone_already = {d.node for d in self.departures}  # a frozen or leaving node may still be running
        candidates = [n for n in self.swarm.nodes if n.index not in gone_already and _training(n)]
        if len(candidates) < 2:
            return  # the replacements are still starting: the swarm keeps one node training at least
        if not self._ways:
            self._ways = list(HOW)
            self.rng.shuffle(self._ways)
        how = self._ways.pop()
        node = self.rng.choice(candidates)
        records = _records(node)
        t = dht_time()
        gone = Departure(t=t, node=node.index, how=how, step=node.step, owned=sorted(shard_at(records, t)))
        if how == "interrupt":
            send(node.process, signal.SIGINT)  # it leaves on its own; its replacement starts meanwhile
        elif how == "kill":
            self.swarm.kill(node.index)
        else:
            os.killpg(node.process.pid, signal.SIGSTOP)
            self._frozen.append((time.monotonic() + FROZEN_FOR_S, node))
        gone.replacement = self.swarm.add_node().index
        self.departures.append(gone)
        self.progress(f"node {node.index} left ({how}, step {gone.step}, owning {len(gone.owned)}); node "
                      f"{gone.replacement} joins")

    def _kill_frozen(self, now: float) -> None:
        for entry in [e for e in self._frozen if e[0] <= now]:
            kill_group(entry[1].process, signal.SIGKILL)
            entry[1].process.wait(10)
            self._frozen.remove(entry)

    def _check_failures(self) -> None:
        departed = {d.node for d in self.departures}
        failed = [n.index for n in self.swarm.nodes
                  if not n.alive and n.index not in departed and n.process.returncode != 0]
        if failed:
            raise RuntimeError(f"node(s) {failed} failed on their own; see {self.swarm.workdir}")

    def _wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        if self._poll(condition, timeout_s) is None:
            raise RuntimeError(f"not {what} within {timeout_s:.0f} s; see {self.swarm.workdir}")

    def _poll(self, condition: Callable[[], bool], timeout_s: float, check_failures: bool = True) -> float | None:
        """Seconds until ``condition()`` held, checked every second while memory is sampled (and, with
        ``check_failures``, a node that failed on its own raises); None: not within ``timeout_s``."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if condition():
                return time.monotonic() - started
            self.peaks.sample(self.swarm.nodes)
            if check_failures:
                self._check_failures()
            time.sleep(1.0)
        return None


def owners_complete(live: list[list[dict[str, Any]]], t: float, replicas: int) -> bool:
    """Every expert of the tiny preset owned by exactly ``replicas`` of the ``live`` nodes (their metrics) at
    ``t`` (with fewer live nodes than that, by every one of them)."""
    want = min(replicas, len(live))
    counts: dict[tuple[int, int], int] = {}
    for records in live:
        for eid in shard_at(records, t):
            counts[eid] = counts.get(eid, 0) + 1
    return all(counts.get((layer, e), 0) == want for layer in range(N_LAYERS) for e in range(N_EXPERTS))


def measure_departures(departures: list[Departure], records: list[list[dict[str, Any]]]) -> None:
    """Fill each departure's steps lost and hand-over time per expert it owned, from every node's metrics.

    Steps lost: the departed node's steps on the expert after the copy its new owner took over was taken (the
    adoption's time less the copy's age), counted from its own step records: every step since it took the
    expert when the new owner started it from init, none when another owner held it live (replicas)."""
    for d in departures:
        mine = records[d.node]
        held = ownership(mine)
        for eid in d.owned:
            name = f"{eid[0]}.{eid[1]}"
            others = [r for i, r in enumerate(records) if i != d.node]
            if any(eid in shard_at(r, d.t) for r in others):  # a live replica held it: nothing to take over
                d.lost_steps[name], d.handover_s[name] = 0, 0.0
                continue
            taken = sorted((a for r in others for a in events(r, "adopted")
                            if a["t"] > d.t and (a["layer"], a["expert"]) == eid), key=lambda a: a["t"])
            if not taken:
                d.lost_steps[name], d.handover_s[name] = None, None
                continue
            first = taken[0]
            d.handover_s[name] = round(first["t"] - d.t, 2)
            since = max((start for start, end in held.get(eid, []) if start <= d.t), default=d.t)
            age = first.get("snapshot_age_s")
            if first["source"] != "init" and age is not None:
                since = max(since, first["t"] - float(age))
            elif first["source"] != "init":
                since = d.t  # a copy whose age is unknown: counted as current
            d.lost_steps[name] = sum(1 for r in events(mine, "step") if since < r["t"] <= d.t)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _export(swarm: LocalSwarm, out: Path) -> float | None:
    """The whole model exported from the live swarm; its validation loss (nats per byte), or None."""
    argv = [sys.executable, "-m", "parallax.cli", "--log-level", "WARNING", "export", "--out", str(out),
            "--initial-peers", swarm.initial_peers, "--run-id", swarm.run_id, "--loopback", "--allow-missing",
            "--identity", str(out.parent / f"{out.name}.key"), "--timeout", "120"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
        return None
    provenance = json.loads((out / "config.json").read_text())["provenance"]
    loss = (provenance.get("val_loss") or {}).get("nats_per_byte")
    return float(loss) if loss is not None else None


def run_once(*, composers: int, lifetime_s: float | None, replicas: int, seed: int, workdir: Path,
             progress: Progress, minutes: float | None = None, departures: int | None = None,
             until_step: int | None = None, quality: bool = True) -> dict[str, Any]:
    """One swarm: under churn (``lifetime_s``) for ``minutes`` or until ``departures`` left, or without churn
    until its median live step reaches ``until_step``; ``quality``: the nodes evaluate the model as they leave,
    and the model is exported from the live swarm and evaluated."""
    args = ["--preset", "tiny", "--set", f"sync.periods={json.dumps(PERIODS)}", "--set", "batch_size=32",
            "--set", f"ownership.replicas={replicas}", "--snapshot-every", "20", *(["--final-eval"] if quality else [])]
    name = "churn" if lifetime_s is not None else "steady"
    swarm = LocalSwarm(workdir, run_id=f"{name}{replicas}", node_args=args)
    peaks = RssPeaks()
    churn = Churn(swarm, composers, lifetime_s, seed, peaks, progress)
    started = time.monotonic()
    settled_s = export_loss = joined_s = phase_end_step = None
    try:
        churn.start(timeout_s=900)
        progress(f"{name}, R={replicas}: {composers} composers past step 10 after {time.monotonic() - started:.0f} s")
        if minutes is not None:
            ends = time.monotonic() + 60 * minutes
            churn.run(lambda: time.monotonic() >= ends)
        elif departures is not None:
            churn.run(lambda: len(churn.departures) >= departures)
        else:
            target = until_step or 0
            churn.run(lambda: (_median([n.step for n in swarm.nodes if n.alive]) or 0) >= target)
        phase_end_step = _median([float(n.step) for n in swarm.nodes if n.alive])
        joined_s = churn.joined(timeout_s=300)
        settled_s = churn.settle(replicas, timeout_s=120)
        export_loss = _export(swarm, workdir / "export") if quality else None
        end_t = dht_time()
        live = [n.index for n in swarm.nodes if n.alive]
        live_steps = [swarm.nodes[i].step for i in live]
    finally:
        churn.kill_frozen()
        swarm.close()
    leftovers = swarm.leftovers()
    records = swarm.metrics()
    measure_departures(churn.departures, records)
    rounds = [r for rs in records for r in events(rs, "round")]
    finals = [e[-1]["val_loss"] for i in live if (e := events(records[i], "final_eval"))]
    lost = [v for d in churn.departures for v in d.lost_steps.values() if v is not None]
    handovers = [v for d in churn.departures for v in d.handover_s.values() if v]
    survivors_trained = all(any(s["t"] >= end_t - 30 for s in events(records[i], "step")) for i in live)
    return {
        "replicas": replicas, "composers": composers, "wall_s": round(time.monotonic() - started, 1),
        "departures": len(churn.departures),
        "departures_by_way": {h: sum(1 for d in churn.departures if d.how == h) for h in HOW},
        "joins": sum(1 for d in churn.departures if d.replacement is not None),
        "expert_steps_lost_per_departure": (sum(lost) / len(churn.departures)) if churn.departures else None,
        "experts_never_adopted": sum(1 for d in churn.departures for v in d.lost_steps.values() if v is None),
        "handover_s_median": _median(handovers),
        "rounds_ok_fraction": (sum(1 for r in rounds if r["status"] == "ok") / len(rounds)) if rounds else None,
        "joined_s": None if joined_s is None else round(joined_s, 1),
        "settled_s": None if settled_s is None else round(settled_s, 1),
        "survivors": len(live), "survivors_trained": survivors_trained,
        "phase_end_step_median": phase_end_step, "final_step_median": _median([float(s) for s in live_steps]),
        "val_loss": _median(finals), "export_val_loss": export_loss,
        "peak_rss_mb": _median(list(peaks.node_mb.values())),
        "p2pd_peak_rss_mb": _median(list(peaks.p2pd_mb.values())),
        "leftover_processes": len(leftovers),
        "log": [asdict(d) for d in churn.departures], "workdir": str(workdir),
    }


def run_churn_bench(*, composers: int = 8, minutes: float = 20.0, lifetime_s: float = 180.0,
                    replicas: list[int] | None = None, seed: int = 0, workdir: Path | None = None,
                    progress: Progress = print, json_path: str | Path | None = None) -> dict[str, Any]:
    """For each R: the swarm under churn, then without churn to the same step (module docstring); the report
    (JSON-able) is written to ``json_path`` after each run."""
    root = Path(workdir or tempfile.mkdtemp(prefix="parallax-bench-churn-"))
    out: dict[str, Any] = {"cores": len(os.sched_getaffinity(0)),
                           "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
                           "preset": "tiny", "composers": composers, "minutes": minutes, "lifetime_s": lifetime_s,
                           "periods": PERIODS, "seed": seed, "replicas": {}}
    for r in replicas or [1, 2]:
        churned = run_once(composers=composers, lifetime_s=lifetime_s, minutes=minutes, until_step=None,
                           replicas=r, seed=seed, workdir=root / f"churn-r{r}", progress=progress)
        out["replicas"][str(r)] = {"churn": churned}
        write(out, json_path)
        steady = run_once(composers=composers, lifetime_s=None, minutes=None,
                          until_step=int(churned["phase_end_step_median"] or 0), replicas=r, seed=seed,
                          workdir=root / f"steady-r{r}", progress=progress)
        row = out["replicas"][str(r)]
        row["steady"] = steady
        for key, base in (("val_loss_over_no_churn", "val_loss"), ("export_val_loss_over_no_churn",
                                                                  "export_val_loss")):
            a, b = churned.get(base), steady.get(base)
            row[key] = a / b if a and b else None
        write(out, json_path)
    return out


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _rows(row: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's lines for one R: (label, cell)."""
    c, s = row["churn"], row.get("steady", {})
    ways = " / ".join(str(c["departures_by_way"][h]) for h in HOW)

    def both(key: str, fmt: str) -> str:
        return f"{_fmt(c.get(key), fmt)} / {_fmt(s.get(key), fmt)}"

    return [
        ("departures (interrupt / kill / freeze), each replaced", f"{c['departures']} ({ways})"),
        ("expert steps lost per departure", _fmt(c["expert_steps_lost_per_departure"], "{:.1f}")),
        ("experts never taken over", str(c["experts_never_adopted"])),
        ("hand-over, median s", _fmt(c["handover_s_median"], "{:.1f}")),
        ("outer rounds completed (churn / none)", both("rounds_ok_fraction", "{:.1%}")),
        ("final val loss, nodes' own views (churn / none)",
         f"{both('val_loss', '{:.4f}')}: **{_fmt(row.get('val_loss_over_no_churn'), '{:.3f}')}x**"),
        ("exported model val loss (churn / none)",
         f"{both('export_val_loss', '{:.4f}')}: {_fmt(row.get('export_val_loss_over_no_churn'), '{:.3f}')}x"),
        ("swarm step at the end, median", _fmt(c["final_step_median"], "{:.0f}")),
        ("every replacement training, s after the churn", _fmt(c.get("joined_s"), "{:.1f}")),
        ("then every expert with its owners, s", _fmt(c["settled_s"], "{:.1f}")),
        ("peak RSS per node / per p2pd, MB", f"{_fmt(c['peak_rss_mb'], '{:.0f}')} / "
                                            f"{_fmt(c['p2pd_peak_rss_mb'], '{:.0f}')}"),
        ("processes left behind (churn / none)", both("leftover_processes", "{:.0f}")),
        ("wall time, s (churn / none)", both("wall_s", "{:.0f}")),
    ]


def markdown(report: dict[str, Any]) -> str:
    runs = report["replicas"]
    lines = [f"{report['composers']} composers of the {report['preset']} preset under churn for "
             f"{report['minutes']} min (mean lifetime {report['lifetime_s']:.0f} s, every departure replaced), "
             f"against the same swarm without churn to the same step; {report['cores']} cores, "
             f"{report['memory_gb']} GB", "",
             "| | " + " | ".join(f"R = {r}" for r in runs) + " |", "|---|" + "---|" * len(runs)]
    table = [_rows(row) for row in runs.values()]
    for i, (label, _) in enumerate(table[0] if table else []):
        lines.append(f"| {label} | " + " | ".join(rows[i][1] for rows in table) + " |")
    return "\n".join(lines)


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)
