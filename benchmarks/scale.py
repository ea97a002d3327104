"""Swarms of growing size on one machine, measured the same way: ``parallax bench scale``.

For each size C: a bootstrap peer and C ``parallax node join`` composers of the tiny preset on loopback (one
torch thread each) train the same steps with the same settings; once every node has trained ten steps, a new
composer joins (its start-up on cores the others keep busy takes tens of seconds), and once every node sees it,
node 0 is SIGKILLed. The joiner leaves when the others are
done. Steps are of 32 sequences by default: the preset's 8 take a few milliseconds on a shared core, too
few for outer rounds every 25 steps to keep up. Then the in-process simulator trains C composers for the same
steps. Reported per size, from the nodes' own metrics:

- traffic: outer-round bytes (contributions and states fetched and served) per round a node took part in, and
  bytes per composer-step for training (surrogate gossip + outer rounds) and for durability (expert snapshots);
- the DHT: records stored and keys read per peer per second, with their bytes (``SwarmDHT.calls``: the records
  alone; hivemind replicates each store to several peers and walks the neighbourhood of each read on top), and
  the size of one read of the run's members key, which holds every live heartbeat;
- membership: seconds until every node's view shows the joiner (from its first heartbeat) and drops the killed
  node (from the kill), read from the step lines, so at the resolution of a step;
- outer rounds that completed, of those begun; start to first step (node start, imports excluded);
- peak resident memory of each node (its training process and DHT process together, so pages the two share
  count twice) and of its p2pd, sampled every second;
- final validation loss: the median of the first nodes' own views (the killed one left out) against the
  in-process run of C composers at the same steps.

Every node and p2pd shares two cores here: the larger the swarm, the slower each node's steps and the later
its answers, so times and the rounds that completed at 16 say as much about the crowded CPU as about the
protocol (the report names the machine's cores).
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from parallax.benchmarks.report import write_report
from parallax.dht.adapter import DHTConfig, SwarmDHT, dht_time
from parallax.dht.keys import members_key, protected_keys
from parallax.dht.records import Ed25519RecordValidator
from parallax.node.config.train import SHARED_GROUPS
from parallax.node.config.typed import set_args
from parallax.node.peer.local_swarm import (
    LocalSwarm,
    NodeProcess,
    composer_bytes,
    final_counters,
    latest,
    read_metrics,
)
from parallax.node.peer.timeline import events

PERIODS = {"router": 25, "latent": 50, "backbone": 100}  # the tiny preset's own
Progress = Callable[[str], object]


class RssPeaks:
    """The largest resident memory seen of each node's processes: its Python processes (the node and its DHT
    process) together, and its p2pd."""

    def __init__(self) -> None:
        self.node_mb: dict[int, float] = {}
        self.p2pd_mb: dict[int, float] = {}

    def sample(self, nodes: list[NodeProcess]) -> None:
        for n in nodes:
            if not n.alive:
                continue
            try:
                root = psutil.Process(n.process.pid)
                procs = [root, *root.children(recursive=True)]
                python = p2pd = 0
                for p in procs:
                    rss = p.memory_info().rss
                    if p.name() == "p2pd":
                        p2pd += rss
                    elif p.name().startswith("python") or p is root:
                        python += rss
            except psutil.Error:  # it exited while we looked
                continue
            self.node_mb[n.index] = max(self.node_mb.get(n.index, 0.0), python / 2**20)
            self.p2pd_mb[n.index] = max(self.p2pd_mb.get(n.index, 0.0), p2pd / 2**20)


def _wait(condition: Callable[[], bool], peaks: RssPeaks, swarm: LocalSwarm, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        peaks.sample(swarm.nodes)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:.0f} s; see {swarm.workdir}")
        dead = [n.index for n in swarm.nodes if not n.alive and n.process.returncode not in (0, -9)]
        if dead:
            raise RuntimeError(f"node(s) {dead} failed; see {swarm.workdir}")
        time.sleep(1.0)


def _members_read(initial_peers: str, run_id: str, layers: int) -> tuple[int, int] | None:
    """One read of the run's members key as a newcomer's first view gets it: (bytes of the heartbeats, signatures
    checked and stripped; how many)."""
    validator = Ed25519RecordValidator(None, protected_keys=protected_keys(run_id, layers, SHARED_GROUPS))
    dht = SwarmDHT.start(DHTConfig(initial_peers=(initial_peers,), client_mode=True), [validator])
    try:
        found = dht.get_dicts([members_key(run_id)], latest=True, timeout_s=10)
        if found is None:
            return None
        heartbeats = found[members_key(run_id)]
        return sum(len(value) for value, _ in heartbeats.values() if isinstance(value, bytes)), len(heartbeats)
    finally:
        dht.shutdown()


def _online(node: NodeProcess) -> bool:
    return bool(events(read_metrics(node.metrics), "network_started"))


def _first_seen(records: list[dict[str, Any]], since: float, ok: Callable[[int], bool]) -> float | None:
    """When a node's step lines first showed a number of live composers that ``ok`` accepts, after ``since``."""
    for r in events(records, "step"):
        if r["t"] >= since and ok(int(r.get("peers", 0))):
            return float(r["t"])
    return None


def _until_all(times: list[float | None], since: float | None) -> float | None:
    """Seconds from ``since`` until the last of ``times``; None unless every one came."""
    if since is None or not times or any(t is None for t in times):
        return None
    return max(t for t in times if t is not None) - since


def run_size(size: int, steps: int, batch_size: int, workdir: Path, progress: Progress = print,
             changes: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One swarm of ``size`` composers plus a joiner, one of them killed (module docstring); ``changes``: settings
    (``--set``) of every node and of the in-process run."""
    join_at = 10  # the joiner's start-up and the death's detection both happen while all train
    args = ["--preset", "tiny", "--set", f"sync.periods={json.dumps(PERIODS)}", "--set", f"steps={steps}",
            "--set", f"batch_size={batch_size}", "--final-eval", "--snapshot-every", "20",  # tiny: 2 layers
            *set_args(changes)]
    swarm = LocalSwarm(workdir, run_id=f"scale{size}", node_args=args)
    peaks = RssPeaks()
    started = time.monotonic()
    try:
        swarm.start_bootstrap()
        for _ in range(size):
            swarm.add_node("--min-peers", str(size), "--steps", str(steps))
        originals = list(swarm.nodes)
        _wait(lambda: all(n.step >= join_at for n in originals), peaks, swarm, 1800,
              f"not every node reached step {join_at}")
        joiner = swarm.add_node("--steps", str(steps - join_at))
        progress(f"{size} composers past step {join_at} after {time.monotonic() - started:.0f} s; one joins")
        _wait(lambda: _online(joiner), peaks, swarm, 300, "the joiner did not come online")
        # Every node's view showing all of them at once, or, where views lag or flap (a crowded machine), a
        # minute: the kill comes then, and the report says who never saw the joiner.
        seen_by = time.monotonic() + 60
        _wait(lambda: time.monotonic() > seen_by or not all(n.alive for n in originals) or all(
            (latest(read_metrics(n.metrics)) or {}).get("peers", 0) >= size + 1 for n in originals),
              peaks, swarm, 120, "the joiner was not seen")
        if not all(n.alive for n in originals):
            raise RuntimeError(f"a node finished before the joiner was up a minute: raise --steps; see {workdir}")
        members = _members_read(swarm.initial_peers, swarm.run_id, layers=2)
        killed_at = dht_time()
        swarm.kill(0)
        progress("the joiner is up; node 0 killed")
        _wait(lambda: all(not n.alive for n in originals), peaks, swarm, 1800, "the swarm did not finish")
        swarm.stop_node(joiner.index)  # it joined later: it leaves with the others
    finally:
        swarm.close()
    wall_s = time.monotonic() - started
    records = swarm.metrics()
    codes = [n.process.returncode for n in swarm.nodes]
    survivors = [i for i in range(len(swarm.nodes)) if i != 0]
    joiner_records = records[joiner.index]
    online = events(joiner_records, "network_started")
    joined_at = float(online[0]["t"]) if online else None
    seen_join = [_first_seen(records[i], joined_at, lambda p: p >= size + 1) if joined_at else None
                 for i in range(size)]
    seen_death = [_first_seen(records[i], killed_at, lambda p: p <= size) for i in survivors]

    periods = json.loads(changes["sync.periods"]) if changes and "sync.periods" in changes else PERIODS
    landings: dict[str, list[tuple[int, float]]] = {}
    per_node: list[dict[str, Any]] = []
    for i in survivors:
        r = records[i]
        for group, seen in merge_landings(r, periods).items():
            landings.setdefault(group, []).extend(seen)
        final = final_counters(r) or {}
        rounds = events(r, "round")
        ok = [x for x in rounds if x["status"] == "ok"]
        n_steps = len(events(r, "step"))
        first = events(r, "first_step")
        alive_s = (r[-1]["t"] - first[0]["t"]) if first and r else None
        outer = final.get("outer_bytes", 0)
        per_node.append({
            "node": i, "joiner": i == joiner.index, "exit_code": codes[i], "steps": n_steps,
            "val_loss": (e[-1]["val_loss"] if (e := events(r, "final_eval")) else None),
            "rounds": len(rounds), "rounds_ok": len(ok),
            "round_statuses": dict(Counter(x["status"] for x in rounds)),
            "round_s_median": {k: statistics.median(v) if (v := [x[k] for x in rounds if k in x]) else None
                               for k in ("waited_s", "allreduce_s", "merge_s", "verify_s", "total_s")},
            "outer_bytes_per_round": outer / len(ok) if ok else None,
            **composer_bytes(r),
            "dht_requests_per_s": final.get("dht_requests", 0) / alive_s if alive_s else None,
            "dht_bytes_per_s": final.get("dht_bytes", 0) / alive_s if alive_s else None,
            "dht_requests_by_kind_per_s": {k: v / alive_s for k, v in final.get("dht_by_kind", {}).items()}
            if alive_s else {},
            "view_age_s_median": statistics.median(a) if (a := [x["view_age_s"] for x in events(r, "step")
                                                                  if "view_age_s" in x]) else None,
            "first_step_s": first[0]["seconds"] if first else None,
            "held_steps_fraction": held_steps(r) / n_steps if n_steps else None,
            "peak_rss_mb": peaks.node_mb.get(i), "p2pd_peak_rss_mb": peaks.p2pd_mb.get(i),
        })

    def med(key: str, nodes: list[dict[str, Any]] = per_node) -> float | None:
        values = [n[key] for n in nodes if n[key] is not None]
        return statistics.median(values) if values else None

    firsts = [n for n in per_node if not n["joiner"]]
    joiner_first = events(joiner_records, "first_step")
    losses = [n["val_loss"] for n in firsts if n["val_loss"] is not None]
    progress(f"{size} composers done in {wall_s:.0f} s; the in-process run of {size} composers, {steps} steps")
    reference = _in_process(size, steps, batch_size, changes or {})
    swarm_loss = statistics.median(losses) if losses else None
    all_rounds = sum(n["rounds"] for n in per_node)
    return {
        "composers": size, "steps": steps, "wall_s": round(wall_s, 1), "exit_codes": codes,
        "bytes_per_round_per_peer": med("outer_bytes_per_round"),
        "train_bytes_per_step": med("train_bytes_per_step"),
        "durability_bytes_per_step": med("durability_bytes_per_step"),
        "dht_requests_per_peer_s": med("dht_requests_per_s"),
        "dht_bytes_per_peer_s": med("dht_bytes_per_s"),
        "dht_requests_by_kind_per_peer_s": {k: statistics.median(n["dht_requests_by_kind_per_s"].get(k, 0.0)
                                                                 for n in per_node)
                                            for k in sorted({k for n in per_node
                                                             for k in n["dht_requests_by_kind_per_s"]})},
        "view_age_s_median": med("view_age_s_median"),
        "held_steps_fraction": med("held_steps_fraction"),
        "held_steps_fraction_max": max((n["held_steps_fraction"] or 0.0) for n in per_node),
        "members_read_bytes": members[0] if members else None, "members_read_entries": members[1] if members else None,
        "join_seen_by_all_s": _until_all(seen_join, joined_at),
        "join_seen_by": sum(1 for t in seen_join if t is not None),
        "death_seen_by_all_s": _until_all(seen_death, killed_at),
        "death_seen_by": sum(1 for t in seen_death if t is not None), "survivors": len(survivors),
        "rounds_ok_fraction": sum(n["rounds_ok"] for n in per_node) / all_rounds if all_rounds else None,
        "round_statuses": dict(sum((Counter(n["round_statuses"]) for n in per_node), Counter())),
        "join_to_first_step_s": joiner_first[0]["seconds"] if joiner_first else None,
        "start_to_first_step_s": med("first_step_s", firsts),
        "peak_rss_mb": med("peak_rss_mb"), "peak_rss_mb_max": max((n["peak_rss_mb"] or 0) for n in per_node),
        "p2pd_peak_rss_mb": med("p2pd_peak_rss_mb"),
        "merge_lag_steps": {g: round(statistics.median(lag for lag, _ in v)) for g, v in sorted(landings.items())},
        "merge_jump": {g: statistics.median(j for _, j in v) for g, v in sorted(landings.items())},
        "backbone_merge_jump_p90": (statistics.quantiles([j for _, j in landings["backbone"]], n=10)[-1]
                                    if len(landings.get("backbone", [])) >= 2 else None),
        "val_loss": swarm_loss, "in_process_val_loss": reference,
        "val_loss_over_in_process": swarm_loss / reference if swarm_loss and reference else None,
        "per_node": per_node, "workdir": str(workdir),
    }


JUMP_BEFORE, JUMP_AFTER = 20, 5
"""Steps of training loss averaged before and after a merge lands (``merge_landings``)."""


def merge_landings(records: list[dict[str, Any]], periods: Mapping[str, int]) -> dict[str, list[tuple[int, float]]]:
    """group -> (lag, jump) of each merge a node applied with ``JUMP_BEFORE`` steps before and ``JUMP_AFTER`` after
    it: lag, the steps it trained between the round's due step (its number times the group's period; a round started
    later, once a waiting one ended, counts from there too) and the merge landing; jump, its training loss over the
    ``JUMP_AFTER`` steps after the landing over that of the ``JUMP_BEFORE`` steps before (1: the merge cost nothing the
    node's next steps see). A step logged at the landing's time came before it (the seam follows the step)."""
    steps = events(records, "step")
    times = [float(s["t"]) for s in steps]
    out: dict[str, list[tuple[int, float]]] = {}
    for r in events(records, "round"):
        if r["status"] != "ok" or r.get("group") not in periods or r.get("round_id") is None:
            continue
        landed = bisect.bisect_right(times, float(r["t"]))  # the steps before it trained without the merge
        before, after = steps[max(0, landed - JUMP_BEFORE):landed], steps[landed:landed + JUMP_AFTER]
        if len(before) < JUMP_BEFORE or len(after) < JUMP_AFTER:
            continue
        was = statistics.fmean(s["loss"] for s in before)
        if was <= 0:
            continue
        lag = int(before[-1]["step"]) - int(r["round_id"]) * periods[r["group"]]
        out.setdefault(r["group"], []).append((lag, statistics.fmean(s["loss"] for s in after) / was))
    return out


def held_steps(records: list[dict[str, Any]]) -> int:
    """The steps a node trained while it held its experts without training them (``shard`` events' ``paused``:
    nothing confirmed its side holding half of the swarm), to its last step if it still held them then."""
    held, since = 0, None
    for e in events(records, "shard"):
        if e.get("paused") and since is None:
            since = e["step"]
        elif not e.get("paused") and since is not None:
            held, since = held + e["step"] - since, None
    if since is not None:
        last = max((e["step"] for e in events(records, "step")), default=since)
        held += last - since
    return held


def _in_process(composers: int, steps: int, batch_size: int, changes: Mapping[str, str]) -> float:
    from parallax.node.config.train import TrainConfig, train_config
    from parallax.node.config.typed import apply_changes, field_types
    from parallax.node.sim.simulator import RunSpec, run
    from parallax.node.train.data import load_corpus, split_corpus

    # the training settings of ``changes``; a node's own (``net.``, ``node.``, ``peer.``) have no in-process twin
    trained = {path: value for path, value in changes.items() if path.split(".")[0] in field_types(TrainConfig)}
    cfg = apply_changes(train_config("tiny", steps=steps), {"sync.periods": PERIODS, "batch_size": batch_size,
                                                            **trained})
    result = run(RunSpec(name="scale", kind="parallax", cfg=cfg, composers=composers),
                 *split_corpus(load_corpus(None), seq_len=cfg.model.seq_len))
    return float(result.val_loss)


def run_scale_bench(sizes: list[int], steps: int = 1000, batch_size: int = 32, workdir: Path | None = None,
                    progress: Progress = print, json_path: str | Path | None = None,
                    changes: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every size in turn (module docstring), with the settings ``changes`` (``--set``); returns the report
    (JSON-able), written to ``json_path`` after each size (a size that fails leaves the others' figures)."""
    root = Path(workdir or tempfile.mkdtemp(prefix="parallax-bench-scale-"))
    out: dict[str, Any] = {"cores": len(os.sched_getaffinity(0)), "memory_gb": round(psutil.virtual_memory().total
                                                                                      / 2**30, 1),
                           "preset": "tiny", "steps": steps, "batch_size": batch_size, "periods": PERIODS,
                           "settings": dict(changes or {}),
                           "sizes": {}}
    for size in sizes:
        out["sizes"][str(size)] = run_size(size, steps, batch_size, root / f"c{size}", progress, changes)
        write(out, json_path)
    return out


ROWS = [
    ("outer bytes per round per peer", "bytes_per_round_per_peer", "{:,.0f}"),
    ("training bytes per composer-step", "train_bytes_per_step", "{:,.0f}"),
    ("durability bytes per composer-step", "durability_bytes_per_step", "{:,.0f}"),
    ("DHT requests per peer per s", "dht_requests_per_peer_s", "{:.1f}"),
    ("DHT record bytes per peer per s", "dht_bytes_per_peer_s", "{:,.0f}"),
    ("one read of the members key, bytes (signatures stripped)", "members_read_bytes", "{:,.0f}"),
    ("heartbeats in that read", "members_read_entries", "{:.0f}"),
    ("view age (median over steps and nodes), s", "view_age_s_median", "{:.2f}"),
    ("steps with the experts held, nothing confirming (median node)", "held_steps_fraction", "{:.1%}"),
    ("steps with the experts held (most of any node)", "held_steps_fraction_max", "{:.1%}"),
    ("join seen by every node, s", "join_seen_by_all_s", "{:.2f}"),
    ("nodes that saw the joiner", "join_seen_by", "{:.0f}"),
    ("death seen by every survivor, s", "death_seen_by_all_s", "{:.2f}"),
    ("survivors that saw the death", "death_seen_by", "{:.0f}"),
    ("outer rounds completed", "rounds_ok_fraction", "{:.1%}"),
    ("outer rounds by status, all survivors", "round_statuses", "{}"),
    ("node start to first step (median), s", "start_to_first_step_s", "{:.2f}"),
    ("joiner: node start to first step, s", "join_to_first_step_s", "{:.2f}"),
    ("peak RSS per node (median), MB", "peak_rss_mb", "{:,.0f}"),
    ("peak RSS per node (max), MB", "peak_rss_mb_max", "{:,.0f}"),
    ("peak RSS per p2pd (median), MB", "p2pd_peak_rss_mb", "{:,.0f}"),
    ("steps a merge lands after its round was due (median over merges)", "merge_lag_steps", "{}"),
    ("training loss after a merge lands / before it (median over merges)", "merge_jump", "{}"),
    ("the same, backbone merges, 90th percentile", "backbone_merge_jump_p90", "{:.3f}"),
    ("final val loss (median own view)", "val_loss", "{:.4f}"),
    ("in-process, same composers and steps", "in_process_val_loss", "{:.4f}"),
    ("swarm / in-process", "val_loss_over_in_process", "{:.3f}"),
    ("wall time of the swarm, s", "wall_s", "{:.0f}"),
]


def _text(value: Any) -> Any:
    """A table cell: numbers by name as "name n, ..." (largest first; fractions to three places), anything else as
    it is."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in sorted(value.items(), key=lambda kv: -kv[1]))
    return value


def markdown(report: dict[str, Any]) -> str:
    sizes = report["sizes"]
    lines = [f"Swarms of the {report['preset']} preset, {report['steps']} steps of {report['batch_size']} sequences, "
             f"periods {report['periods']}, "
             f"on {report['cores']} cores and {report['memory_gb']} GB: one joiner, one node killed",
             "", "| composers | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for label, key, fmt in ROWS:
        cells = ["-" if s.get(key) in (None, {}) else fmt.format(_text(s[key])) for s in sizes.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)
