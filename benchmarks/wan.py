"""The WAN benchmark: one swarm on loopback, then on the network lab's capped links, then cut.

One run, side by side: a bootstrap peer and N ``parallax node join`` processes train S steps on loopback, then
the same swarm once per rate on lab hosts (``node/peer/netlab.py``) whose links are capped at that rate both
ways, then a partition probe on the lowest rate. Reported, from the nodes' JSONL metrics:

- outer-round collect time (median per group over every node's verified rounds, ``swarm.collect_s``: from its
  contribution on offer to its merge, the sets settled and the bytes they take fetched; partitioned, the blocks, the
  shares and the rechecks included) against the time the round's own bytes need on links of B bytes/s each way:
  gathered rounds fetch n - 1 bodies and serve their own n - 1 times, (n - 1) x S_body / B, S_body a real
  contribution's encoded size; partitioned rounds (the default) move their schedule's bytes (``bench bytes``'
  ``parts_bytes``); hivemind's all-reduce moves 2 (n - 1) / n x its buffers. The settling, merging and verifying
  phases are reported apart, and of the settling the wait until the set's last contribution was read on offer
  (``round_waited_s``: the other composers reaching the round at their own steps).
  ``round_time_over_bytes_bound`` is the largest group's ratio per rate (target <= 1.5);
- outer rounds that completed: per group and node, verified rounds over rounds begun; ``backbone_rounds_ok_fraction``
  is the lowest node's, per rate (target >= 0.8), and ``failed_rounds`` counts every round not applied, all nodes
  (a rate at which no round completed reports zero and says so, it raises nothing);
- the training thread's time at the network seam (``Training.seam``, its one contact with the network:
  applying received deltas, ownership changes, collecting rounds; surrogate refits, which are training
  compute scheduled there, counted apart): total and longest single visit, median node, and its DHT calls
  (0 required). ``step_path_waited_s`` is the longest visit at any rate: the longest the loop ever stood
  still at the seam;
- surrogate gossip and expert snapshot bytes per composer-step, and the link time they take at the rate;
- the partition probe: one host cut off; seconds until every other node saw it dead, until each of its experts
  had a new owner (``partition_detect_s``), and until it knew itself cut off; the longest two owners held one
  expert at once;
- the swarm's final val loss (median of the nodes' own views) at each rate against loopback at equal tokens
  (``val_loss_over_loopback``).

``--crowd N`` runs N busy processes (``while True: pass``) beside the nodes through every run, as a volunteer's
desktop that does other work: the rounds of composers whose steps and reads are slowed unevenly.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from parallax.benchmarks.report import percent, write_report
from parallax.benchmarks.swarm import _group_bytes, _loss, _sec, collect_s
from parallax.dht.adapter import dht_time
from parallax.node.peer.local_swarm import LocalSwarm, composer_bytes, latest
from parallax.node.peer.netlab import Host, NetLab, NetLabError, check_rate, rate_bytes_per_s, unavailable
from parallax.node.peer.timeline import events, longest_double_ownership, shard_at

TARGET = 1.5
"""A round's collect time over the time its own bytes need on the link."""
ROUNDS_TARGET = 0.8
"""The fewest backbone rounds, as a fraction of those begun, that complete on every node."""


def run_wan_bench(*, rates: tuple[str, ...] = ("100mbit", "20mbit"), nodes: int = 4, steps: int = 120,
                  preset: str = "small", periods: str = '{"router": 10, "latent": 20, "backbone": 20}',
                  refresh_every: int = 25, snapshot_every: int = 50, crowd: int = 0, partition: bool = True,
                  workdir: Path | None = None, progress: Any = print,
                  changes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmark (module docstring); returns the report (JSON-able). ``crowd``: busy processes beside the
    nodes; ``partition``: also cut one host off at the lowest rate; ``changes``: settings of every node (``--set``),
    the round's bytes bound computed with them.

    Raises:
        NetLabError: this machine cannot build the lab (no root or no network namespaces).
    """
    import json

    from parallax.node.config.train import train_config
    from parallax.node.config.typed import apply_changes, set_args

    for rate in rates:
        check_rate(rate)
    why = unavailable()
    if why is not None:
        raise NetLabError(why)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="parallax-bench-wan-"))
    args = ["--preset", preset, "--set", f"sync.periods={periods}", "--set", f"surrogate.refresh_every={refresh_every}",
            "--snapshot-every", str(snapshot_every),
            *set_args(changes)]
    cfg = apply_changes(train_config(preset), {"sync.periods": json.loads(periods), **(changes or {})})
    sizes = _round_bytes(cfg, nodes)  # the groups the model has (small has no latent)

    runs: dict[str, dict[str, Any]] = {}
    part: dict[str, Any] | None = None
    with _crowded(crowd):
        progress(f"loopback: {nodes} composers x {steps} steps of {preset} in {workdir / 'loopback'}"
                 + (f", {crowd} busy processes beside them" if crowd else ""))
        runs["loopback"] = _train(workdir / "loopback", args, nodes, steps, hosts=None)
        for rate in rates:
            progress(f"{rate}: the same swarm on {nodes} lab hosts capped at {rate} both ways")
            with NetLab() as lab:
                hosts = [lab.add_host(f"h{i}", rate=rate) for i in range(nodes)]
                runs[rate] = _train(workdir / rate, args, nodes, steps, hosts=hosts)
        if partition:
            progress(f"partition: one of {nodes} hosts at {rates[-1]} cut off")
            with NetLab() as lab:
                hosts = [lab.add_host(f"h{i}", rate=rates[-1]) for i in range(nodes)]
                part = _partition(workdir / "partition", lab, args, hosts, after=2 * snapshot_every)

    return summary(runs, part, sizes=sizes, rates=rates, nodes=nodes, steps=steps, preset=preset,
                   periods=json.loads(periods), refresh_every=refresh_every, snapshot_every=snapshot_every,
                   crowd=crowd, aggregation=cfg.sync.aggregation, compression=cfg.sync.compression,
                   workdir=str(workdir))


def summary(runs: dict[str, dict[str, Any]], part: dict[str, Any] | None, *, sizes: dict[str, int],
            rates: tuple[str, ...], nodes: int, **settings: Any) -> dict[str, Any]:
    """The report from each run's ``figures`` (and the partition probe's, if run): the headline figures per rate.
    ``sizes``: group -> the bytes a peer moves each way in one of its rounds (``_round_bytes``)."""
    base = runs["loopback"]["val_loss"]
    for rate in rates:
        run = runs[rate]
        bandwidth = rate_bytes_per_s(rate)
        run["rounds"] = {g: _round_time(run["collect_s"].get(g, []), size, bandwidth) for g, size in sizes.items()}
        run["gossip_link_s_per_step"] = run["gossip_bytes_per_step"] / bandwidth
        run["train_link_s_per_step"] = (run["train_bytes_per_step"] or 0.0) / bandwidth
        run["durability_link_s_per_step"] = (run["durability_bytes_per_step"] or 0.0) / bandwidth
    largest = max(sizes, key=sizes.__getitem__)
    return {
        **settings, "nodes": nodes, "group_bytes": sizes, "largest_group": largest, "runs": runs, "partition": part,
        "round_time_over_bytes_bound": {rate: runs[rate]["rounds"][largest]["over_bound"] for rate in rates},
        "backbone_rounds_ok_fraction": {r: runs[r]["rounds_ok_fraction"].get("backbone", 0.0)
                                       for r in ["loopback", *rates]},
        "failed_rounds": {r: runs[r]["rounds_failed"] for r in ["loopback", *rates]},
        "step_path_waited_s": max(runs[r]["seam_max_s"] or 0.0 for r in runs),
        "step_path_dht_calls": sum(runs[r]["step_path_dht_calls"] for r in runs),
        "partition_detect_s": part["reowned_s"] if part is not None else None,
        "val_loss_over_loopback": {rate: runs[rate]["val_loss"] / base if base and runs[rate]["val_loss"] else None
                                   for rate in rates},
    }


def _train(workdir: Path, args: list[str], nodes: int, steps: int, hosts: list[Host] | None) -> dict[str, Any]:
    """N composers train ``steps`` each and leave; their figures (``hosts`` None: on loopback)."""
    swarm = LocalSwarm(workdir, run_id="wan", node_args=[*args, "--final-eval"], hosts=hosts or ())
    started = time.monotonic()
    try:
        swarm.start_bootstrap()
        for _ in range(nodes):
            swarm.add_node("--steps", str(steps), "--min-peers", str(nodes))
        if not swarm.wait(3600):
            raise RuntimeError(f"the swarm did not finish within an hour; see {workdir}")
    finally:
        swarm.close()
    wall_s = time.monotonic() - started
    codes = [n.process.returncode for n in swarm.nodes]
    if any(codes):
        raise RuntimeError(f"nodes exited with {codes}; see {workdir}")
    return figures(swarm.metrics(), codes, wall_s)


def figures(records: list[list[dict[str, Any]]], codes: list[int | None], wall_s: float) -> dict[str, Any]:
    """One run's figures from its nodes' metrics (``_train``)."""
    collect: dict[str, list[float]] = {}
    phases: dict[str, dict[str, list[float]]] = {}  # phase -> group -> its times in the verified rounds
    total: dict[str, list[float]] = {}
    begun: dict[str, list[list[bool]]] = {}  # group -> per node, whether each round it began was applied
    for i, r in enumerate(records):
        for x in events(r, "round"):
            begun.setdefault(x["group"], [[] for _ in records])[i].append(x["status"] == "ok")
            if x["status"] == "ok":
                collect.setdefault(x["group"], []).append(collect_s(x))
                for phase in ("allreduce_s", "waited_s", "merge_s", "verify_s"):
                    phases.setdefault(phase, {}).setdefault(x["group"], []).append(x.get(phase, 0.0))
                total.setdefault(x["group"], []).append(x["total_s"])
    why_not = {group: sorted({x["status"] for r in records for x in events(r, "round")
                              if x["group"] == group and x["status"] != "ok"}) for group in begun}
    paths = [events(r, "step_path")[-1] for r in records]
    finals = [latest(r) or {} for r in records]
    trained = [max(p["steps"], 1) for p in paths]
    losses = [e[-1]["val_loss"] for r in records if (e := events(r, "final_eval"))]
    bytes_of = [composer_bytes(r) for r in records]
    return {
        "wall_s": wall_s, "exit_codes": codes,
        "val_loss": statistics.median(losses) if losses else None,
        "tokens": sum(e[-1]["tokens"] for r in records if (e := events(r, "final_eval"))),
        "collect_s": collect,
        **{f"round_{phase}": {g: statistics.median(t) for g, t in by_group.items()}
           for phase, by_group in phases.items()},
        "round_total_s": {g: statistics.median(t) for g, t in total.items()},
        "rounds_ok_per_node": {g: [sum(n) / len(n) if n else None for n in per] for g, per in begun.items()},
        "rounds_ok_fraction": {g: min((sum(n) / len(n) for n in per if n), default=0.0) for g, per in begun.items()},
        "rounds_not_ok_statuses": why_not,
        "rounds_failed": sum(1 for r in records for x in events(r, "round") if x["status"] != "ok"),
        "seam_s": statistics.median(p["seam_s"] for p in paths),
        "seam_max_s": max(p["seam_max_s"] for p in paths),
        "seam_share": statistics.median(p["seam_s"] / max(wall_s, 1e-9) for p in paths),
        "refit_s": statistics.median(p["refit_s"] for p in paths),
        "step_path_dht_calls": sum(p["dht_calls"] for p in paths),
        "gossip_bytes_per_step": statistics.median(f.get("gossip_bytes", 0) / n
                                                   for f, n in zip(finals, trained, strict=True)),
        **{key: statistics.median(values) if (values := [v for b in bytes_of if (v := b[key]) is not None]) else None
           for key in ("train_bytes_per_step", "durability_bytes_per_step")},
    }


def _bytes(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} B"


def _round_bytes(cfg: Any, nodes: int) -> dict[str, int]:
    """group -> the bytes one peer moves each way in one round of ``nodes`` peers under the run's transport and wire
    (``bench bytes``' measure): n - 1 gathered bodies, a partitioned round's schedule, or 2 (n - 1) / n of the
    all-reduce's buffers."""
    from parallax.benchmarks.bytes import block_bytes, body_bytes, parts_bytes
    from parallax.node.config.net import OuterConfig
    from parallax.node.outer.partitioned import MERGED_WIRE
    from parallax.node.peer.runner import model_shapes

    groups = {g: {n: tuple(s) for n, s in shapes.items()} for g, shapes in model_shapes(cfg).groups.items()}
    wire = cfg.sync.compression
    if cfg.sync.aggregation == "gather":
        return {g: (nodes - 1) * body_bytes(shapes, wire) for g, shapes in groups.items()}
    if cfg.sync.aggregation == "parts":
        rechecks = OuterConfig().parts_rechecks
        return {g: parts_bytes(block_bytes(shapes, wire), block_bytes(shapes, MERGED_WIRE), nodes, rechecks)
                for g, shapes in groups.items()}
    return {g: round(2 * (nodes - 1) / nodes * size) for g, size in _group_bytes(cfg).items()}


def _round_time(times: list[float], each_way: int, bandwidth: float) -> dict[str, Any]:
    """The median collect time of a group's verified rounds against the time its bytes need (``each_way``: a peer's
    bytes each way in one round, ``_round_bytes``). No verified round: no median, and ``why`` says so."""
    bound = each_way / bandwidth
    median = statistics.median(times) if times else None
    return {"median_s": median, "rounds": len(times), "payload_bytes": each_way, "bound_s": bound,
            "over_bound": median / bound if median is not None else None,
            **({} if times else {"why": "no round of this group verified at this rate"})}


@contextlib.contextmanager
def _crowded(processes: int) -> Iterator[None]:
    """``processes`` busy Python processes for the duration, stopped by PID on leaving."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _partition(workdir: Path, lab: NetLab, args: list[str], hosts: list[Host], after: int) -> dict[str, Any]:
    """Train until every node is past step ``after`` (the heirs have had snapshots) and the last one owns
    experts; cut its host off; measure."""
    from parallax.dht.testing import wait_until

    nodes = len(hosts)
    swarm = LocalSwarm(workdir, run_id="wancut", node_args=args, hosts=hosts)
    try:
        swarm.start_bootstrap()
        for _ in range(nodes):
            swarm.add_node("--min-peers", str(nodes))  # until stopped

        def ready() -> bool:
            records = swarm.metrics()
            return (all((latest(r) or {}).get("step", 0) >= after for r in records)
                    and bool(shard_at(records[-1], float("inf"))))

        wait_until(ready, timeout=900, interval=1.0)
        victim = shard_at(swarm.metrics()[-1], float("inf"))
        cut_at = dht_time()
        lab.cut(hosts[-1].name)

        def acted() -> bool:
            records = swarm.metrics()
            taken = {(a["layer"], a["expert"]) for r in records[:-1] for a in events(r, "adopted") if a["t"] > cut_at}
            seen = all(any(s["t"] > cut_at and s["peers"] < nodes for s in events(r, "step")) for r in records[:-1])
            return taken >= victim and seen and any(e["t"] > cut_at for e in events(records[-1], "cut_off"))

        wait_until(acted, timeout=120, interval=0.5)
        records = swarm.metrics()
    finally:
        swarm.close()
    others = records[:-1]
    dead = [min(s["t"] for s in events(r, "step") if s["t"] > cut_at and s["peers"] < nodes) - cut_at
            for r in others]
    first: dict[tuple[int, int], dict[str, Any]] = {}
    for a in sorted((a for r in others for a in events(r, "adopted") if a["t"] > cut_at), key=lambda a: a["t"]):
        first.setdefault((a["layer"], a["expert"]), a)
    reowned = max(first[eid]["t"] for eid in victim) - cut_at
    knew = min(e["t"] for e in events(records[-1], "cut_off") if e["t"] > cut_at) - cut_at
    longest, _ = longest_double_ownership(records, cut_at, cut_at + max(reowned, knew) + 1.0)
    return {"experts_of_the_cut_host": len(victim), "seen_dead_s": max(dead), "reowned_s": reowned,
            "knew_cut_off_s": knew, "longest_double_owner_s": longest,
            "sources": sorted({first[eid]["source"] for eid in victim})}


def markdown(report: dict[str, Any]) -> str:
    rates = list(report["round_time_over_bytes_bound"])
    runs, p = report["runs"], report["partition"]
    every = ["loopback", *rates]
    lines = [
        f"WAN: {report['nodes']} composers of {report['preset']}, {report['steps']} steps, periods "
        f"{report['periods']}, refresh every {report['refresh_every']}, snapshots every {report['snapshot_every']}, "
        f"{report['aggregation']} rounds on the {report['compression']} wire; on loopback and on lab links capped at "
        f"{', '.join(rates)} both ways" + (f"; {report['crowd']} busy processes beside the nodes" if report['crowd']
                                           else ""),
        "",
        "| measure | " + " | ".join(["loopback", *rates]) + " |",
        "|---|" + "---|" * (1 + len(rates)),
    ]
    for group, size in report["group_bytes"].items():
        cells = [_sec(statistics.median(runs["loopback"]["collect_s"][group]))
                 if runs["loopback"]["collect_s"].get(group) else "-"]
        for rate in rates:
            r = runs[rate]["rounds"][group]
            cells.append(f"{_sec(r['median_s'])} = {_x(r['over_bound'])} the bound {_sec(r['bound_s'])}")
        lines.append(f"| outer round {group} ({size:,} B each way): collect (offer to merged), median | "
                     + " | ".join(cells) + " |")
        lines.append(f"| outer rounds {group} completed, lowest node | " + " | ".join(
            _rounds(runs[r], group) for r in every) + " |")
    largest = report["largest_group"]
    lines.append("| whole outer round incl. matchmaking, largest group (median) | " + " | ".join(
        _sec(runs[r]["round_total_s"].get(largest)) for r in every) + " |")
    for phase, what in (("allreduce_s", "settling the set, fetching what it takes (partitioned: the claims)"),
                        ("waited_s", "... of which until the set's last contribution was read on offer"),
                        ("merge_s", "merging it (partitioned: the blocks, the others' shares, the rechecks)"),
                        ("verify_s", "verifying the result with the majority")):
        lines.append(f"| ... {what}, median | " + " | ".join(
            _sec(runs[r].get(f"round_{phase}", {}).get(largest)) for r in every) + " |")
    lines += [
        "| training thread at the network seam: total (median node) | "
        + " | ".join(f"{_sec(runs[r]['seam_s'])} ({runs[r]['seam_share']:.1%})" for r in ["loopback", *rates]) + " |",
        "| ... its longest single visit | " + " | ".join(_sec(runs[r]["seam_max_s"]) for r in ["loopback", *rates])
        + " |",
        "| DHT calls from the training thread | " + " | ".join(str(runs[r]["step_path_dht_calls"])
                                                             for r in ["loopback", *rates]) + " |",
        "| surrogate gossip per composer-step | " + " | ".join(
            [f"{runs['loopback']['gossip_bytes_per_step']:,.0f} B"]
            + [f"{runs[r]['gossip_bytes_per_step']:,.0f} B ({_sec(runs[r]['gossip_link_s_per_step'])} of link)"
               for r in rates]) + " |",
        "| training bytes per composer-step (outer rounds, gossip, offload) | " + " | ".join(
            [_bytes(runs["loopback"]["train_bytes_per_step"])]
            + [f"{_bytes(runs[r]['train_bytes_per_step'])} ({_sec(runs[r]['train_link_s_per_step'])} of link)"
               for r in rates]) + " |",
        "| durability bytes per composer-step (expert snapshots to heirs) | " + " | ".join(
            [_bytes(runs["loopback"]["durability_bytes_per_step"])]
            + [f"{_bytes(runs[r]['durability_bytes_per_step'])} ({_sec(runs[r]['durability_link_s_per_step'])} of "
               "link)" for r in rates]) + " |",
        "| outer rounds not applied (all nodes) | " + " | ".join(str(runs[r]["rounds_failed"]) for r in every) + " |",
        "| final val loss (median node; ratio to loopback) | " + " | ".join(
            [_loss(runs["loopback"]["val_loss"])]
            + [f"{_loss(runs[r]['val_loss'])} ({_x(report['val_loss_over_loopback'][r])})" for r in rates]) + " |",
        "| wall time | " + " | ".join(f"{runs[r]['wall_s']:.0f} s" for r in ["loopback", *rates]) + " |",
        "",
        f"Collect time over the time its bytes need, largest group ({report['largest_group']}): "
        + ", ".join(f"{r} {_x(report['round_time_over_bytes_bound'][r])}" for r in rates) + f" (target <= {TARGET}x);"
        " backbone rounds completed on the lowest node: " + ", ".join(
            f"{r} {percent(report['backbone_rounds_ok_fraction'][r])}" for r in every)
        + f" (target >= {ROUNDS_TARGET:.0%}).",
    ]
    if p is not None:
        lines.append(
            f"Partition at {rates[-1]}: a host owning {p['experts_of_the_cut_host']} experts cut off; every other node "
            f"saw it dead after {p['seen_dead_s']:.1f} s, each of its experts had a new owner after "
            f"{p['reowned_s']:.1f} s (from {', '.join(p['sources'])}), it knew itself cut off after "
            f"{p['knew_cut_off_s']:.1f} s; two owners held one expert for at most {p['longest_double_owner_s']:.1f} s.")
    return "\n".join(lines)


def _rounds(run: dict[str, Any], group: str) -> str:
    """The lowest node's share of the group's rounds that completed, and why the others did not."""
    if group not in run["rounds_ok_fraction"]:
        return "none begun"
    why = run["rounds_not_ok_statuses"].get(group)
    return percent(run["rounds_ok_fraction"][group]) + (f" (others: {', '.join(why)})" if why else "")


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)
