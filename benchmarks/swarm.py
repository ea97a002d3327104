"""The P2P swarm benchmark: a local process swarm measured side by side with the in-process run.

One run: a bootstrap peer and N ``parallax node join`` processes on loopback train S steps each (a
joiner comes in once the others are past ``join_at`` steps and trains the rest), every node evaluates
its own view when it leaves; then the in-process simulator trains N composers for S steps on the
same preset. Reported, from the nodes' JSONL metrics:

- DHT calls from the training thread while it trained (the step path): must be 0 (``SwarmDHT`` counts
  calls from the thread the node marks as its training loop);
- bytes per composer-step, sent and received, as the nodes count them: training (outer rounds, surrogate
  gossip, offloaded work), durability (heirs' copies of experts: chains of ternary links) and hand-overs (exact
  experts: those the joiner takes over and those heirs take at the nodes' leave, a cost of joins and leaves, not of
  steps) apart, against a DDP ring all-reduce of the same model's fp32 gradients, 2 x 2 (n-1)/n x 4 x parameters
  per step (each node sends 2 (n-1)/n of them and receives as much);
- outer-round collect time (``collect_s``: from the contribution on offer to the merge; hivemind's matchmaking and
  all-reduce; median per group) against the bandwidth bound 2 (n-1)/n x S_G / B, with B the loopback bandwidth
  measured in the same run;
- start to first step of the joiner (from the node's start, imports excluded, and from the spawn);
- final validation loss of the swarm (median of the nodes' own views) against the in-process run.
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from parallax.benchmarks.report import write_report
from parallax.node.peer.local_swarm import LocalSwarm, composer_bytes, read_metrics
from parallax.node.peer.timeline import events


def loopback_bandwidth(megabytes: int = 256) -> float:
    """Bytes per second through one loopback TCP connection (the B of the all-reduce bound)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    chunk = b"\0" * (1 << 20)
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 20):
                received[0] += len(data)

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as client:
        for _ in range(megabytes):
            client.sendall(chunk)
    thread.join(60)
    elapsed = time.perf_counter() - started
    server.close()
    return received[0] / elapsed


OWN_OPTIONS = {"steps": "--steps", "sync.periods": "25/50/100, reported", "surrogate.refresh_every": "25, reported"}
"""Settings the benchmark sets itself (and reports): ``--set`` may not change them behind its back."""


def swarm_changes(changes: list[str], own: dict[str, str] | None = None) -> dict[str, object]:
    """``--set`` overrides for a process benchmark's nodes and reference, parsed.

    Args:
        own: the settings that benchmark sets itself, with how (default: this one's ``OWN_OPTIONS``).

    Raises:
        ValueError: unparsable, or one of ``own``.
    """
    from parallax.node.config.typed import parse_sets

    own = OWN_OPTIONS if own is None else own
    parsed: dict[str, object] = dict(parse_sets(changes))
    bare = {path.removeprefix("train."): path for path in own}  # a node takes a training setting with or without it
    taken = sorted(path for path in parsed if path.removeprefix("train.") in bare)
    if taken:
        raise ValueError(f"--set {taken[0]}: the benchmark sets it itself "
                         f"({own[bare[taken[0].removeprefix('train.')]]})")
    return parsed


def run_swarm_bench(*, nodes: int = 3, steps: int = 200, preset: str = "small", join_at: int = 10,
                    periods: str = '{"router": 25, "latent": 50, "backbone": 100}', refresh_every: int = 25,
                    snapshot_every: int = 50, changes: list[str] | None = None, workdir: Path | None = None,
                    progress: Any = print) -> dict[str, Any]:
    """Run the benchmark (module docstring); returns the report (JSON-able).

    ``changes``: ``PATH=VALUE`` config overrides given to every node and to the in-process reference alike.
    """
    from parallax.node.config.train import train_config
    from parallax.node.config.typed import apply_changes
    from parallax.node.model.transformer import MoETransformer
    from parallax.node.sim.simulator import RunSpec, run
    from parallax.node.train.data import load_corpus, split_corpus

    workdir = Path(workdir or tempfile.mkdtemp(prefix="parallax-bench-swarm-"))
    args = ["--preset", preset, "--set", f"sync.periods={periods}", "--set", f"surrogate.refresh_every={refresh_every}",
            "--set", f"steps={steps}", "--final-eval", "--snapshot-every", str(snapshot_every)]
    changes = list(changes or [])
    extra = swarm_changes(changes)
    for change in changes:
        args += ["--set", change]
    bandwidth = loopback_bandwidth()
    progress(f"loopback bandwidth {bandwidth / 1e9:.2f} GB/s; starting {nodes} nodes + 1 joiner in {workdir}")
    swarm = LocalSwarm(workdir, run_id="bench", node_args=args)
    started = time.monotonic()
    try:
        swarm.start_bootstrap()
        for _ in range(nodes):
            swarm.add_node("--steps", str(steps), "--min-peers", str(nodes))
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            last = [events(read_metrics(n.metrics), "step") for n in swarm.nodes]
            if all(s and s[-1]["step"] >= join_at for s in last):
                break
            time.sleep(0.5)
        spawned = time.time()
        joiner = swarm.add_node("--steps", str(max(1, steps - join_at)))
        if not swarm.wait(3600):
            raise RuntimeError(f"the swarm did not finish within an hour; see {workdir}")
    finally:
        swarm.close()
    wall_s = time.monotonic() - started
    records = swarm.metrics()
    codes = [n.process.returncode for n in swarm.nodes]

    cfg = apply_changes(train_config(preset), {"steps": steps, "sync.periods": json.loads(periods),
                                          "surrogate.refresh_every": refresh_every, **extra})
    full = MoETransformer(cfg.model, None, "drop")  # DDP trains the plain MoE: every expert, no surrogates
    params = sum(p.numel() for p in full.parameters())
    # A ring all-reduce of fp32 gradients: each node sends 2(n-1)/n of them and receives as much. Sent and received
    # both count, as they do in every Parallax figure here (the nodes' counters add the two).
    ddp_per_step = 2 * 2 * (nodes - 1) / nodes * 4 * params

    per_node: list[dict[str, Any]] = []
    for i, r in enumerate(records):
        steps_done = events(r, "step")
        rounds = events(r, "round")
        ok = [x for x in rounds if x["status"] == "ok"]
        n_steps = len(steps_done)
        path = events(r, "step_path")
        evals = events(r, "final_eval")
        per_node.append({
            "node": i, "joiner": swarm.nodes[i] is joiner, "exit_code": codes[i], "steps": n_steps,
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "step_path_dht_calls": path[-1]["dht_calls"] if path else None,
            **composer_bytes(r),
            "rounds_ok": {g: sum(1 for x in ok if x["group"] == g) for g in ("router", "latent", "backbone")},
            "rounds_failed": len(rounds) - len(ok),
            "collect_s": {g: [collect_s(x) for x in ok if x["group"] == g] for g in ("router", "latent",
                                                                                "backbone")},
            "first_step_s": events(r, "first_step")[0]["seconds"] if events(r, "first_step") else None,
        })
    joiner_index = swarm.nodes.index(joiner)
    joiner_first = events(records[joiner_index], "first_step")
    spawn_to_first = joiner_first[0]["t"] - spawned if joiner_first else None

    sizes = _group_bytes(cfg)
    round_times = {}
    for group, size in sizes.items():
        times = [t for n in per_node for t in n["collect_s"][group]]
        bound = 2 * (nodes - 1) / nodes * size / bandwidth
        round_times[group] = {"median_s": statistics.median(times) if times else None, "rounds": len(times),
                              "payload_bytes": size, "bound_s": bound}

    progress("join probe: one node training, a second joining")
    probe = join_probe(preset, workdir / "probe")
    # Equal tokens: the joiner's steps count too, so the in-process composers train as many tokens in all.
    swarm_tokens = sum(e[-1]["tokens"] for r in records if (e := events(r, "final_eval")))
    per_step = nodes * cfg.batch_size * cfg.model.seq_len
    ref_steps = max(1, round(swarm_tokens / per_step)) if swarm_tokens else steps
    progress(f"swarm done in {wall_s:.0f} s; running the in-process reference ({nodes} composers, {ref_steps} steps)")
    train, val = split_corpus(load_corpus(None), seq_len=cfg.model.seq_len)
    ref_cfg = apply_changes(cfg, {"steps": ref_steps})
    sim = run(RunSpec(name="parallax", kind="parallax", cfg=ref_cfg, composers=nodes), train, val)

    losses = [n["val_loss"] for n in per_node if n["val_loss"] is not None and not n["joiner"]]
    training = [n["train_bytes_per_step"] for n in per_node if n["train_bytes_per_step"]]
    durability = [n["durability_bytes_per_step"] for n in per_node if n["durability_bytes_per_step"] is not None]
    handover = [n["handover_bytes_per_step"] for n in per_node if n["handover_bytes_per_step"] is not None]
    counted = [n for n in per_node
               if n["train_bytes_per_step"] is not None and n["durability_bytes_per_step"] is not None]
    totals = [n["train_bytes_per_step"] + n["durability_bytes_per_step"] for n in counted]
    alls = [n["train_bytes_per_step"] + n["durability_bytes_per_step"] + n["handover_bytes_per_step"] for n in counted]
    train_median = statistics.median(training) if training else None
    total_median = statistics.median(totals) if totals else None
    all_median = statistics.median(alls) if alls else None
    return {
        "nodes": nodes, "steps": steps, "preset": preset, "changes": changes, "join_at": join_at,
        "periods": json.loads(periods),
        "refresh_every": refresh_every, "wall_s": wall_s, "exit_codes": codes, "per_node": per_node,
        "loopback_bytes_per_s": bandwidth,
        "train_bytes_per_step": train_median,
        "durability_bytes_per_step": statistics.median(durability) if durability else None,
        "handover_bytes_per_step": statistics.median(handover) if handover else None,
        "total_bytes_per_step": total_median,
        "all_bytes_per_step": all_median,
        "ddp_over_train": ddp_per_step / train_median if train_median else None,
        "ddp_over_total": ddp_per_step / total_median if total_median else None,
        "ddp_over_all": ddp_per_step / all_median if all_median else None,
        "step_path_dht_calls": sum(n["step_path_dht_calls"] or 0 for n in per_node),
        "traffic": {"ddp_allreduce_bytes_per_step": ddp_per_step, "model_parameters": params,
                    "snapshot_every": snapshot_every},
        "outer_round_time": round_times,
        "join": {"node_start_to_first_step_s": per_node[joiner_index]["first_step_s"],
                 "spawn_to_first_step_s": spawn_to_first, "probe": probe},
        "tokens": {"swarm": swarm_tokens, "in_process": sim.tokens, "in_process_steps": ref_steps},
        "val_loss": {"swarm_median": statistics.median(losses) if losses else None,
                     "in_process_median": sim.val_loss, "in_process_assembled": sim.assembled_val_loss,
                     "in_process_wall_s": sim.wall_s},
        "workdir": str(workdir),
    }


def join_probe(preset: str, workdir: Path) -> dict[str, Any]:
    """One node trains; a second joins once it is past step 5 and trains 3 steps: the joiner's start-up
    phases (seconds since its node started, imports excluded) on a machine not crowded by other nodes."""
    swarm = LocalSwarm(workdir, run_id="probe", node_args=["--preset", preset])
    try:
        swarm.start_bootstrap()
        first = swarm.add_node()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            steps = events(read_metrics(first.metrics), "step")
            if steps and steps[-1]["step"] >= 5:
                break
            time.sleep(0.2)
        joiner = swarm.add_node("--steps", "3")
        while joiner.alive and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        swarm.close()
    records = read_metrics(joiner.metrics)
    t0 = events(records, "first_step")[0]
    start = t0["t"] - t0["seconds"]
    phases = {kind: round(events(records, kind)[0]["t"] - start, 3)
              for kind in ("dht_started", "network_started", "shard_offered", "composer_built", "loaded_state",
                           "first_step")
              if events(records, kind)}
    return {"phases_s": phases, "node_start_to_first_step_s": t0["seconds"]}


def _group_bytes(cfg: Any) -> dict[str, int]:
    """Bytes of one outer round's averaged buffers per group, as the node sends them (fp16 when large)."""
    from parallax.node.outer.wire import OuterSyncConfig, payload_bytes
    from parallax.node.peer.runner import model_shapes

    config = OuterSyncConfig(sync=cfg.sync)
    return {g: payload_bytes(shapes, config) for g, shapes in model_shapes(cfg).groups.items()}


def markdown(report: dict[str, Any]) -> str:
    r, t, j, v = report, report["traffic"], report["join"], report["val_loss"]
    lines = [
        f"P2P swarm: {report['nodes']} nodes + 1 joiner, preset {report['preset']}, {report['steps']} steps, "
        f"periods {report['periods']}, refresh every {report['refresh_every']}"
        + "".join(f", --set {c}" for c in report.get("changes", [])) + f" (exit codes {report['exit_codes']})",
        "",
        "| measure | value | reference |",
        "|---|---|---|",
        f"| DHT calls from the training thread while training | {report['step_path_dht_calls']} | 0 required |",
        f"| bytes per composer-step for training (outer rounds + surrogate gossip + offload, median node) | "
        f"{_num(r['train_bytes_per_step'])} | DDP all-reduce, sent and received, "
        f"{_num(t['ddp_allreduce_bytes_per_step'])}: "
        f"{_ratio(r['ddp_over_train'])} less |",
        f"| bytes per composer-step for durability (heirs' copies, a link every {t['snapshot_every']} steps) | "
        f"{_num(r['durability_bytes_per_step'])} | |",
        f"| bytes per composer-step, training + durability (median node) | "
        f"{_num(r['total_bytes_per_step'])} | {_ratio(r['ddp_over_total'])} less than DDP (target >= 1000x) |",
        f"| bytes per composer-step for hand-overs (exact: the joiner's experts, the heirs' at the leave) | "
        f"{_num(r['handover_bytes_per_step'])} | |",
        f"| bytes per composer-step, all of the above (median node) | "
        f"{_num(r['all_bytes_per_step'])} | {_ratio(r['ddp_over_all'])} less than DDP |",
    ]
    for group, r in report["outer_round_time"].items():
        lines.append(f"| outer round {group} (median of {r['rounds']}) | {_sec(r['median_s'])} | bound "
                     f"2(n-1)/n S/B = {_sec(r['bound_s'])} for {r['payload_bytes']:,} B |")
    lines += [
        f"| joiner: node start to first step | {_sec(j['node_start_to_first_step_s'])} | target <= 5 s |",
        f"| joiner: process spawn to first step (imports included) | {_sec(j['spawn_to_first_step_s'])} | |",
        f"| join probe (1 node training + 1 joining): node start to first step | "
        f"{_sec(j['probe']['node_start_to_first_step_s'])} | target <= 5 s; phases {j['probe']['phases_s']} |",
        f"| final val loss, swarm (median of the first nodes' own views; {report['tokens']['swarm']:,} tokens) | "
        f"{_loss(v['swarm_median'])} | in-process at equal tokens {_loss(v['in_process_median'])} (assembled "
        f"{_loss(v['in_process_assembled'])}; {report['tokens']['in_process']:,} tokens: {report['nodes']} "
        f"composers x {report['tokens']['in_process_steps']} steps) |",
    ]
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} B"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}x"


def collect_s(round_event: dict[str, Any]) -> float:
    """A round's collect time from its ``round`` metrics event: from its contribution on offer to its merge (the sets
    settled and the bytes they take fetched; partitioned rounds fetch their blocks as they merge). Events without
    ``merge_s`` (hivemind's all-reduce) are their all-reduce."""
    return float(round_event["allreduce_s"]) + float(round_event.get("merge_s", 0.0))


def _sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)
