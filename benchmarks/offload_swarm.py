"""Worker offload over the network: a local swarm of composers + workers beside the same swarm
without workers, one run.

1. ``direct``: a bootstrap peer and N ``parallax node join`` processes train S steps each, every node
   evaluates its own view when it leaves (``--final-eval``).
2. ``offload``: the same N composers (the same identity files, so the same data streams and the same
   expert assignment) with ``offload.enabled=true``, and W ``parallax worker join`` processes started
   first. Once the median composer passed ``kill_at`` x S steps, the worker most experts were onboarded to
   is SIGKILLed (no deathrattle: a machine that dies); its experts must be trained locally again.

Reported, from the JSONL metrics of both swarms:

- final val loss, offload / direct (median of the composers' own views; equal tokens: same steps, same
  batch), target <= 1.02;
- bytes on the wire per sketch and per worker result (request and answer bodies as handed to hivemind's
  P2P layer), per composer-step, and per onboarding (one expert's weights) with the seconds from sending
  them to the answer and to the first applied result;
- after the kill: seconds and composer steps from the kill to each of the dead worker's experts falling
  back to local training, against the shortest outer-sync period.
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from parallax.benchmarks.report import write_report
from parallax.benchmarks.swarm import OWN_OPTIONS as SWARM_OWN_OPTIONS
from parallax.benchmarks.swarm import _loss, _num, _sec, swarm_changes
from parallax.dht.adapter import dht_time
from parallax.node.peer.local_swarm import LocalSwarm, NodeProcess, latest, read_metrics
from parallax.node.peer.processes import kill_group
from parallax.node.peer.timeline import events

OWN_OPTIONS = {**SWARM_OWN_OPTIONS, "offload.enabled": "off in the direct swarm, on in the offload swarm"}
"""Settings the benchmark sets itself: ``--set`` may not change them behind its back."""


def _busiest(crew: list[NodeProcess], composers: list[NodeProcess]) -> tuple[str, NodeProcess]:
    """The worker most experts were onboarded to (its peer id and process): the death that costs most."""
    peers = {events(read_metrics(w.metrics), "worker_started")[0]["peer_id"]: w for w in crew}
    load = {peer: 0 for peer in peers}
    for node in composers:
        for e in events(read_metrics(node.metrics), "offload_onboarded"):
            if e["worker"] in load:
                load[e["worker"]] += 1
    peer = max(sorted(load), key=lambda p: load[p])
    return peer, peers[peer]


def _run_swarm(workdir: Path, name: str, args: list[str], preset: str, nodes: int, workers: int, steps: int,
               kill_at: float, keys_from: Path | None, progress: Any, worker_args: tuple[str, ...] = ()
               ) -> dict[str, Any]:
    """One swarm to the end; returns its records and, with workers, when and whom it killed. Both swarms use
    one run id: it salts the expert assignment, which must be the same in both."""
    swarm = LocalSwarm(workdir, run_id="offload-bench", node_args=args)
    killed: dict[str, Any] = {}
    started = time.monotonic()
    try:
        swarm.start_bootstrap()
        crew = [swarm.add_worker("--preset", preset, *worker_args) for _ in range(workers)]
        deadline = time.monotonic() + 300
        while crew and time.monotonic() < deadline and not all(
                events(read_metrics(w.metrics), "worker_started") for w in crew):
            time.sleep(0.5)
        for i in range(nodes):
            if keys_from is not None:  # the same identities: the same data streams and expert assignment
                (workdir / f"node-{i}").mkdir(parents=True, exist_ok=True)
                shutil.copy(keys_from / f"node-{i}" / "node.key", workdir / f"node-{i}" / "node.key")
            swarm.add_node("--steps", str(steps), "--min-peers", str(nodes))
        deadline = time.monotonic() + 3600
        while crew and kill_at > 0 and time.monotonic() < deadline:
            if statistics.median(n.step for n in swarm.nodes) >= kill_at * steps:
                peer, victim = _busiest(crew, swarm.nodes)
                killed = {"t": dht_time(), "worker": peer, "steps": [n.step for n in swarm.nodes]}
                kill_group(victim.process, signal.SIGKILL)
                progress(f"{name}: killed worker {peer} at composer steps {killed['steps']}")
                break
            if not any(n.alive for n in swarm.nodes):
                break
            time.sleep(0.2)
        if not swarm.wait(3600):
            raise RuntimeError(f"the {name} swarm did not finish within an hour; see {workdir}")
    finally:
        swarm.close()
    return {"records": swarm.metrics(), "codes": [n.process.returncode for n in swarm.nodes],
            "wall_s": time.monotonic() - started, "killed": killed}


def run_offload_swarm_bench(*, nodes: int = 2, workers: int = 2, steps: int = 200, preset: str = "small",
                            periods: str = '{"router": 25, "latent": 50, "backbone": 100}', refresh_every: int = 25,
                            snapshot_every: int = 50, kill_at: float = 0.6, changes: list[str] | None = None,
                            workdir: Path | None = None, progress: Any = print) -> dict[str, Any]:
    """Run the benchmark (module docstring); returns the report (JSON-able).

    ``changes``: ``PATH=VALUE`` config overrides given to every composer of both swarms and to the workers.
    """
    workdir = Path(workdir or tempfile.mkdtemp(prefix="parallax-bench-offload-swarm-"))
    changes = list(changes or [])
    swarm_changes(changes, own=OWN_OPTIONS)  # refuses what the benchmark sets itself
    sets = [arg for change in changes for arg in ("--set", change)]
    args = ["--preset", preset, "--set", f"sync.periods={periods}", "--set", f"surrogate.refresh_every={refresh_every}",
            "--final-eval", "--snapshot-every", str(snapshot_every), *sets]
    progress(f"direct: {nodes} composers x {steps} steps in {workdir / 'direct'}")
    direct = _run_swarm(workdir / "direct", "direct", args, preset, nodes, 0, steps, 0.0, None, progress)
    progress(f"offload: the same {nodes} composers + {workers} workers in {workdir / 'offload'}")
    offload = _run_swarm(workdir / "offload", "offload", [*args, "--set", "offload.enabled=true"], preset, nodes,
                         workers, steps, kill_at, workdir / "direct", progress, worker_args=tuple(sets))

    def val(run: dict[str, Any]) -> tuple[float | None, int]:
        evals = [e[-1] for r in run["records"] if (e := events(r, "final_eval"))]
        losses = [e["val_loss"] for e in evals]
        return (statistics.median(losses) if losses else None), sum(e["tokens"] for e in evals)

    direct_val, direct_tokens = val(direct)
    offload_val, offload_tokens = val(offload)
    per_node = []
    fallbacks = []
    killed = offload["killed"]
    for i, r in enumerate(offload["records"]):
        last = latest(r) or {}
        n_steps = len(events(r, "step"))
        onboarded = events(r, "offload_onboarded")
        first = events(r, "offload_first_update")
        per_node.append({
            "node": i, "steps": n_steps, "offloaded_last": last.get("offloaded"),
            "sketches": last.get("offload_sketches", 0), "sketch_bytes": last.get("offload_sketch_bytes", 0),
            "results": last.get("offload_results", 0), "result_bytes": last.get("offload_result_bytes", 0),
            "results_applied": last.get("offload_applied", 0), "sketches_coalesced": last.get("offload_coalesced", 0),
            "sketches_merged": last.get("offload_merged", 0), "lateness_steps": last.get("offload_lateness"),
            "waited_s": last.get("offload_waited_s", 0.0),
            "onboards": last.get("offload_onboards", 0), "onboard_bytes": last.get("offload_onboard_bytes", 0),
            "onboard_s": [e["seconds"] for e in onboarded], "first_update_s": [e["seconds"] for e in first],
        })
        if killed:
            for f in events(r, "offload_fallback"):
                if f["worker"] == killed["worker"] and f["t"] >= killed["t"]:
                    fallbacks.append({"node": i, "expert": f["expert"], "reason": f["reason"],
                                      "seconds": round(f["t"] - killed["t"], 3),
                                      "steps": f["step"] - killed["steps"][i], "unanswered": f["unanswered"]})

    def total(key: str) -> int:
        return sum(n[key] for n in per_node)

    onboard_s = [s for n in per_node for s in n["onboard_s"]]
    first_s = [s for n in per_node for s in n["first_update_s"]]
    composer_steps = total("steps")
    period = min(json.loads(periods).values())
    return {
        "nodes": nodes, "workers": workers, "steps": steps, "preset": preset, "periods": json.loads(periods),
        "changes": changes,
        "refresh_every": refresh_every, "kill_at": kill_at,
        "exit_codes": {"direct": direct["codes"], "offload": offload["codes"]},
        "wall_s": {"direct": direct["wall_s"], "offload": offload["wall_s"]},
        "val_loss": {"direct_median": direct_val, "offload_median": offload_val,
                     "ratio": offload_val / direct_val if direct_val and offload_val else None,
                     "tokens": {"direct": direct_tokens, "offload": offload_tokens}},
        "wire": {
            "bytes_per_sketch": total("sketch_bytes") / total("sketches") if total("sketches") else None,
            "bytes_per_result": total("result_bytes") / total("results") if total("results") else None,
            "sketch_bytes_per_composer_step": total("sketch_bytes") / composer_steps if composer_steps else None,
            "result_bytes_per_composer_step": total("result_bytes") / composer_steps if composer_steps else None,
            "bytes_per_onboarding": total("onboard_bytes") / total("onboards") if total("onboards") else None,
            "results_applied": total("results_applied"), "sketches_coalesced": total("sketches_coalesced"),
            "sketches_merged": total("sketches_merged"),
            "lateness_steps_per_node": [n["lateness_steps"] for n in per_node],
            "waited_s_per_node": [n["waited_s"] for n in per_node],
        },
        "onboarding": {"answer_s_median": statistics.median(onboard_s) if onboard_s else None,
                       "first_update_s_median": statistics.median(first_s) if first_s else None,
                       "first_update_s_max": max(first_s, default=None), "experts": len(onboard_s)},
        "kill": {**killed, "fallbacks": fallbacks, "sync_period_steps": period,
                 "max_steps": max((f["steps"] for f in fallbacks), default=None),
                 "max_seconds": max((f["seconds"] for f in fallbacks), default=None)},
        "per_node": per_node,
        "workdir": str(workdir),
    }


def markdown(report: dict[str, Any]) -> str:
    v, w, o, k = report["val_loss"], report["wire"], report["onboarding"], report["kill"]
    ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}x"
    lines = [
        f"Worker offload over the network: {report['nodes']} composers (+ {report['workers']} workers in the offload "
        f"run), preset {report['preset']}, {report['steps']} steps, periods {report['periods']}"
        + "".join(f", --set {c}" for c in report.get("changes", [])) + f" (exit codes {report['exit_codes']})",
        "",
        "| measure | value | reference |",
        "|---|---|---|",
        f"| final val loss, offload swarm (median of the composers' own views) | {_loss(v['offload_median'])} | "
        f"direct swarm {_loss(v['direct_median'])}: {ratio} (target <= 1.02x); tokens {v['tokens']} |",
        f"| bytes per sketch (request body) | {_num(w['bytes_per_sketch'])} | {w['sketches_coalesced']:,} steps sent "
        f"with an older one while their worker was behind, {w['sketches_merged']:,} merged into one |",
        f"| bytes per worker result (answer body) | {_num(w['bytes_per_result'])} | "
        f"{w['results_applied']:,} results applied, mean lateness per composer "
        f"{', '.join('-' if x is None else f'{x:.2f}' for x in w['lateness_steps_per_node'])} steps |",
        f"| wall time of the run, offload swarm | {_sec(report['wall_s']['offload'])} | direct swarm "
        f"{_sec(report['wall_s']['direct'])}; composers waited for answers "
        f"{', '.join(_sec(x) for x in w.get('waited_s_per_node', []))} (offload.wait_s) |",
        f"| sketch + result bytes per composer-step | "
        f"{_num((w['sketch_bytes_per_composer_step'] or 0) + (w['result_bytes_per_composer_step'] or 0))} | |",
        f"| onboarding: bytes per expert | {_num(w['bytes_per_onboarding'])} | |",
        f"| onboarding: weights sent to answer (median of {o['experts']}) | {_sec(o['answer_s_median'])} | |",
        f"| onboarding: weights sent to first applied result (median; max) | {_sec(o['first_update_s_median'])}; "
        f"{_sec(o['first_update_s_max'])} | |",
    ]
    if k.get("worker"):
        lines.append(
            f"| worker SIGKILLed at composer steps {k['steps']}: its {len(k['fallbacks'])} experts trained locally "
            f"again after (max) | {_sec(k['max_seconds'])}, {k['max_steps']} steps | one sync period = "
            f"{k['sync_period_steps']} steps |")
    return "\n".join(lines)


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)
