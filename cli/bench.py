"""``parallax bench ...``: the measured comparisons. Each command writes JSON and a markdown summary."""

from __future__ import annotations

from typing import Any

import typer

from parallax.cli.options import JsonPath, PresetName, RunOptions, Sets, fail, with_run_options

bench_app = typer.Typer(help="Benchmarks: each writes JSON (--json) and prints a markdown table.",
                       no_args_is_help=True, rich_markup_mode=None)


@bench_app.command("quality")
@with_run_options
def quality(
    opts: RunOptions,
    runs: str = typer.Option("", "--runs", show_default=False,
                             help="Comma-separated runs: the defaults and/or named levers (benchmarks/quality.py; "
                                  "default: its DEFAULT_RUNS, every run but the levers)."),
) -> None:
    """Parallax vs a synchronous MoE and a DiLoCo reference at equal tokens (about 25 min on 2 cores)."""
    # Imported here, like every command's work: `parallax node join` should not import the simulator to start.
    from parallax.benchmarks import quality as bench

    _run_set(bench, bench.run_quality, opts, runs)


@bench_app.command("offload")
@with_run_options
def offload(
    opts: RunOptions,
    runs: str = typer.Option("", "--runs", show_default=False,
                             help="Comma-separated runs: direct, offload and its variations (benchmarks/offload.py; "
                                  "default: its DEFAULT_RUNS)."),
) -> None:
    """Worker offload in process vs direct ownership at equal tokens; counted composer FLOPs vs the analytic
    ratio; bytes per sketch and result; onboarding bytes (small preset, 300 steps: about 4 min a run on 1 core)."""
    from parallax.benchmarks import offload as bench

    _run_set(bench, bench.run_offload, opts, runs)


def _run_set(bench: Any, run: Any, opts: RunOptions, runs: str) -> None:
    """A set of in-process runs of one benchmark module (``runs``, or its ``DEFAULT_RUNS`` when empty): ``run`` it,
    then its ``write`` and ``markdown``."""
    from parallax.cli.progress import run_progress

    cfg = opts.train_config()
    names = [r.strip() for r in runs.split(",") if r.strip()] or list(bench.DEFAULT_RUNS)
    try:
        with run_progress(cfg.steps, enabled=not opts.quiet) as progress:
            report = run(cfg, opts.composers, opts.data, runs=names, progress=progress)
    except ValueError as e:
        fail(e)
    bench.write(report, opts.json_path)
    typer.echo(bench.markdown(report))


@bench_app.command("own-data")
@with_run_options
def own_data(
    opts: RunOptions,
    runs: str = typer.Option("", "--runs", show_default=False,
                             help="Comma-separated runs: honest, copier (default: both)."),
) -> None:
    """Can a peer tell work from a copy? Each composer's pseudo-gradient against the others' merge, on the batches
    its seeded sampler drew, in the simulator with and without a copier (--preset tiny --steps 2000: 19 min on 2
    cores beside another run; a judgement needs 8 backbone rounds)."""
    from parallax.benchmarks import own_data as bench

    _run_set(bench, bench.run_own_data, opts, runs)


@bench_app.command("horizon")
def horizon(
    reports: list[str] = typer.Argument(..., help="Quality JSON files (parallax bench quality --json ...)."),
    out: str = typer.Option("docs/horizon.png", "--out", help="PNG to write."),
    runs: str = typer.Option("", "--runs", help="Comma-separated runs to draw (default: all)."),
) -> None:
    """Plot validation loss and its ratio to the synchronous baseline against tokens (needs matplotlib)."""
    from parallax.benchmarks.horizon import plot

    try:
        path = plot(reports, out, [r for r in runs.split(",") if r] or None)
    except ModuleNotFoundError as e:
        raise typer.BadParameter(f"{e}; install the plotting extra: pip install -e '.[bench]'") from e
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise typer.BadParameter(f"cannot plot {reports}: {e!r}; pass JSON written by `parallax bench quality`") from e
    typer.echo(f"wrote {path}")


@bench_app.command("tradeoff")
def tradeoff(
    reports: list[str] = typer.Argument(..., help="Quality JSON files of one setting, one per seed."),
    out: str = typer.Option("docs/bench/tradeoff.png", "--out", help="PNG to write (loss against memory)."),
    json_path: str | None = typer.Option(None, "--json", help="Also write the table as JSON (and .md beside it)."),
) -> None:
    """Quality against memory over seeds: each run's val loss, its ratio to the baseline and to DiLoCo of the
    same seed, and what a composer holds (needs matplotlib for the plot)."""
    from parallax.benchmarks import tradeoff as bench
    from parallax.benchmarks.report import write_report

    try:
        table = bench.summary(bench.load(reports))
        path = bench.plot(table, out)
    except ModuleNotFoundError as e:
        raise typer.BadParameter(f"{e}; install the plotting extra: pip install -e '.[bench]'") from e
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise typer.BadParameter(f"cannot read {reports}: {e!r}; pass JSON written by `parallax bench quality`") from e
    write_report(table, bench.markdown(table), json_path)
    typer.echo(bench.markdown(table))
    typer.echo(f"wrote {path}")


@bench_app.command("flops")
def flops(
    composers: int = typer.Option(8, "--composers", "-c", min=1, help="Composers C."),
    preset: PresetName = "report",
) -> None:
    """Per-composer compute savings: the report's analytic model beside our config-based FLOP count."""
    from parallax.node.config.train import preset as get_preset
    from parallax.node.model import flops as fl

    try:
        cfg = get_preset(preset)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    f_over_r = cfg.d_expert / cfg.d_surrogate
    grads = {"stand_in_input_grad": True, "offload_input_grad": True}  # the defaults
    # (name, analytic routed speed-up, composer_speedup's keyword arguments)
    variants: tuple[tuple[str, float, dict[str, Any]], ...] = (
        ("direct ownership (report)", fl.routed_speedup(composers, f_over_r), {}),
        ("worker offload (report)", fl.offload_routed_speedup(composers, f_over_r), {"offload": True}),
        ("direct, stand-ins pass the input gradient (default)",
         fl.routed_speedup(composers, f_over_r, stand_in_input_grad=True), {"stand_in_input_grad": True}),
        ("worker offload, both pass the input gradient (default)",
         fl.offload_routed_speedup(composers, f_over_r, **grads), {"offload": True, **grads}),
    )
    share = fl.routed_share(cfg)
    typer.echo(f"preset {preset}: C={composers}, f/r={f_over_r:g}, routed share of active compute {share:.3f}\n")
    typer.echo("| variant | routed speed-up (analytic) | routed (counted) | total (analytic, share 0.618) "
               "| total (counted, own share) |")
    typer.echo("|---|---|---|---|---|")
    rows = [(name, a, *fl.composer_speedup(cfg, composers, **kw)) for name, a, kw in variants]
    for name, a, counted, tot in rows:
        typer.echo(f"| {name} | {a:.2f}x | {counted:.2f}x | {fl.total_speedup(a):.2f}x | {tot:.2f}x |")


@bench_app.command("speed")
def speed(
    preset: PresetName = "medium",
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto (CUDA when torch sees one)."),
    composers: str = typer.Option("4,8", "--composers", "-c", help="Comma-separated composer counts C."),
    steps: int = typer.Option(3, "--steps", min=1, help="Timed steps per row (the median is reported)."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Untimed steps first (allocations, autotuning)."),
    kernels: str = typer.Option("auto,reference", "--kernels",
                                help="Comma-separated compute.kernel values; the first is held to the targets."),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1,
                                          help="Sequences per step (default: 8 on CUDA, 2 on a CPU)."),
    sets: Sets = None,
    json_path: JsonPath = None,
) -> None:
    """Step time and memory of a composer (C = 4, 8) against a process holding the whole MoE, and the sorted
    kernels against the reference mixture, side by side in one process."""
    import shlex

    from parallax.benchmarks.speed import markdown, run_speed, write
    from parallax.node.config.resolve import resolve, train_defaults
    from parallax.node.config.train import KERNELS, TrainConfig
    from parallax.node.config.typed import ConfigError
    from parallax.node.train.device import DeviceError, device_of

    try:
        counts = tuple(int(x) for x in composers.split(",") if x.strip())
        torch_device = device_of(device)
        flags = {"preset": preset, "batch_size": batch_size or (8 if torch_device.type == "cuda" else 2)}
        cfg = resolve(TrainConfig, train_defaults, file=None, flags=flags, sets=sets or (), default_preset=preset)
    except (ValueError, ConfigError, DeviceError) as e:
        fail(e)
    if not counts or min(counts) < 2:
        fail(f"--composers takes comma-separated counts >= 2, got {composers!r}")
    kernel_list = tuple(k.strip() for k in kernels.split(",") if k.strip())
    if not kernel_list or not set(kernel_list) <= set(KERNELS):
        fail(f"--kernels takes comma-separated values of {', '.join(KERNELS)}, got {kernels!r}")
    report = run_speed(cfg, device=torch_device, composers=counts, steps=steps, warmup=warmup, kernels=kernel_list,
                       progress=typer.echo)
    words = ["--preset", preset, "--device", device, "--composers", composers, "--steps", str(steps), "--warmup",
             str(warmup), "--kernels", kernels, *(["--batch-size", str(batch_size)] if batch_size else []),
             *[w for item in sets or () for w in ("--set", item)]]
    command = "parallax bench speed " + " ".join(shlex.quote(w) for w in words)
    write(report, json_path, command)
    typer.echo(markdown(report, command))


@bench_app.command("dht")
def dht(
    sizes: str = typer.Option("2,8,32", "--sizes", help="Comma-separated swarm sizes (peers on loopback)."),
    ops: int = typer.Option(100, "--ops", min=1, help="Store + get operations timed per swarm size."),
    detect_peers: str = typer.Option("4", "--detect-peers", help="Comma-separated sizes of the membership swarms "
                                     "(peers that heartbeat, claim and watch; on 2 cores their DHT processes "
                                     "saturate at 16)."),
    trials: int = typer.Option(5, "--trials", min=0, help="Kills (no deathrattle) timed per size; about 8 s each."),
    rattles: int = typer.Option(3, "--rattles", min=0, help="Graceful leaves (deathrattles) timed per size."),
    window: float = typer.Option(20.0, "--window", min=1.0, help="Seconds of steady load measured per size."),
    full_pace: int | None = typer.Option(None, "--full-pace", min=0,
                                         help="net.membership.full_pace_members of the membership swarms (default: "
                                         "the nodes' default): past this many live members every node stretches "
                                         "its periods (on 2 cores, 8 keeps the lookups of every swarm size at most "
                                         "at what 8 peers at full pace ask of them)."),
    json_path: JsonPath = None,
) -> None:
    """DHT store/get latency for N peers (vs hivemind's published numbers), and the membership of N peers without
    training: its steady load (hot keys, their storers, CPU, view age) and how fast a death is seen."""
    from parallax.benchmarks.dht import markdown, run_dht_bench, write

    paced = {} if full_pace is None else {"full_pace_members": full_pace}
    report = run_dht_bench(_sizes(sizes), ops, _sizes(detect_peers, 2, "--detect-peers"), trials, rattles,
                           progress=typer.echo, window_s=window, json_path=json_path, **paced)
    write(report, json_path)
    typer.echo(markdown(report))


def _sizes(text: str, minimum: int = 1, option: str = "--sizes") -> list[int]:
    """``option`` (``--sizes``): comma-separated integers of at least ``minimum``."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise typer.BadParameter(f"{option} takes comma-separated integers, got {text!r}") from e
    if not sizes or min(sizes) < minimum:
        raise typer.BadParameter(f"{option} takes integers of at least {minimum}, got {text!r}")
    return sizes


@bench_app.command("scale")
def scale(
    sizes: str = typer.Option("4,8,16", "--sizes", help="Comma-separated numbers of composers, one swarm each."),
    steps: int = typer.Option(1000, "--steps", min=40, help="Inner steps per composer (and of each in-process run)."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Sequences per step (the tiny preset's 8 take "
                                   "a few milliseconds: too few for rounds every 25 steps to keep up)."),
    workdir: str | None = typer.Option(None, "--workdir", help="Folder for the nodes' files (default: a temp dir)."),
    sets: Sets = None,
    json_path: JsonPath = None,
) -> None:
    """Local swarms of the tiny preset at each size, a joiner and a kill in each, side by side with the in-process
    run: traffic per round and per step, DHT load, the members key's size, join and death seen by all, rounds
    completed, start-up, peak memory, final loss."""
    from pathlib import Path

    from parallax.benchmarks.scale import markdown, run_scale_bench
    from parallax.node.config.typed import ConfigError, parse_sets

    size_list = _sizes(sizes, minimum=2)
    try:
        changes = parse_sets(sets or ())
    except ConfigError as e:
        fail(e)
    report = run_scale_bench(size_list, steps, batch_size, Path(workdir) if workdir else None, progress=typer.echo,
                             json_path=json_path, changes=changes)
    typer.echo(markdown(report))


@bench_app.command("churn")
def churn(
    composers: int = typer.Option(8, "--composers", min=3, help="Composers the swarm keeps (each departure is "
                                  "replaced by a new identity)."),
    minutes: float = typer.Option(20.0, "--minutes", min=0.5, help="How long the churn lasts."),
    lifetime: float = typer.Option(180.0, "--lifetime", min=10.0, help="Mean seconds a composer stays (exponential):"
                                   " the swarm loses one every lifetime / composers seconds on average."),
    replicas: str = typer.Option("1,2", "--replicas", help="Comma-separated ownership.replicas, one pair of runs "
                                 "(churn, none) each."),
    seed: int = typer.Option(0, "--seed", help="Seed of the departure times, ways and choices."),
    workdir: str | None = typer.Option(None, "--workdir", help="Folder for the nodes' files (default: a temp dir)."),
    json_path: JsonPath = None,
) -> None:
    """A swarm of the tiny preset under constant churn (Ctrl+C, SIGKILL and frozen hosts, each replaced at once)
    against the same swarm without churn at the same step: steps lost per departure, hand-over times, rounds
    completed, final and exported loss, peak memory, processes left behind."""
    from pathlib import Path

    from parallax.benchmarks.churn import markdown, run_churn_bench

    replica_list = _sizes(replicas, minimum=1, option="--replicas")
    report = run_churn_bench(composers=composers, minutes=minutes, lifetime_s=lifetime, replicas=replica_list,
                             seed=seed, workdir=Path(workdir) if workdir else None, progress=typer.echo,
                             json_path=json_path)
    typer.echo(markdown(report))


@bench_app.command("swarm")
def swarm(
    nodes: int = typer.Option(3, "--nodes", min=2, help="Composer processes started together (a joiner comes later)."),
    steps: int = typer.Option(150, "--steps", min=10, help="Inner steps per node (and of the in-process reference)."),
    preset: PresetName = "small",
    join_at: int = typer.Option(10, "--join-at", min=1, help="The joiner starts once every node passed this step."),
    changes: Sets = None,
    workdir: str | None = typer.Option(None, "--workdir", help="Folder for the nodes' files (default: a temp dir)."),
    json_path: JsonPath = None,
) -> None:
    """A local process swarm side by side with the in-process run: step-path I/O, traffic vs DDP, outer-round
    time vs the bandwidth bound, join-to-first-step, final loss (a few minutes on 2 cores). ``--set`` applies to
    the nodes and the in-process reference alike."""
    from pathlib import Path

    from parallax.benchmarks.swarm import markdown, run_swarm_bench, write

    _check_swarm_sets(preset, changes)
    report = run_swarm_bench(nodes=nodes, steps=steps, preset=preset, join_at=join_at, changes=changes,
                             workdir=Path(workdir) if workdir else None, progress=typer.echo)
    write(report, json_path)
    typer.echo(markdown(report))


def _check_swarm_sets(preset: str, changes: list[str] | None, own: dict[str, str] | None = None, *,
                      nodes_only: bool = False) -> None:
    """Refuse a bad ``--set`` of a process benchmark here, before any process starts (``own``: the settings
    that benchmark sets itself; default: ``bench swarm``'s). ``nodes_only``: the settings go to ``node join``
    alone, which takes a node's settings (``net.``, ``node.``) beside the training ones; otherwise an in-process
    reference trains by them too, and only training settings apply."""
    from parallax.benchmarks.swarm import swarm_changes
    from parallax.node.config.peer import NodeConfig
    from parallax.node.config.resolve import node_defaults, resolve
    from parallax.node.config.train import train_config
    from parallax.node.config.typed import apply_changes

    try:
        parsed = swarm_changes(changes or [], own)
        if nodes_only:
            taken = [path for path in parsed if path.startswith("peer.")]
            if taken:
                raise ValueError(f"--set {taken[0]}: the local swarm sets each node's identity, addresses and files")
            resolve(NodeConfig, node_defaults, flags={"preset": preset, "peer.loopback": True}, sets=changes or ())
        else:
            apply_changes(train_config(preset), parsed)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


@bench_app.command("offload-swarm")
def offload_swarm(
    nodes: int = typer.Option(2, "--nodes", min=1, help="Composer processes (the same in both swarms)."),
    workers: int = typer.Option(2, "--workers", min=1, help="Worker processes in the offload swarm."),
    steps: int = typer.Option(200, "--steps", min=10, help="Inner steps per composer."),
    preset: PresetName = "small",
    kill_at: float = typer.Option(0.6, "--kill-at", min=0.0, max=0.95,
                                  help="SIGKILL the busiest worker once the composers passed this share of --steps "
                                       "(0: no kill)."),
    changes: Sets = None,
    workdir: str | None = typer.Option(None, "--workdir", help="Folder for the processes' files (default: temp)."),
    json_path: JsonPath = None,
) -> None:
    """Worker offload over the network: composers + workers vs the same composers alone, one run: val-loss
    ratio, bytes per sketch and result on the wire, onboarding bytes and seconds, fall-back after a worker's
    death (small preset, 200 steps: about 10 min on 2 cores). ``--set`` applies to every composer of both
    swarms and to the workers."""
    from pathlib import Path

    from parallax.benchmarks.offload_swarm import OWN_OPTIONS, markdown, run_offload_swarm_bench, write

    _check_swarm_sets(preset, changes, OWN_OPTIONS)
    report = run_offload_swarm_bench(nodes=nodes, workers=workers, steps=steps, preset=preset, kill_at=kill_at,
                                     changes=changes, workdir=Path(workdir) if workdir else None,
                                     progress=typer.echo)
    write(report, json_path)
    typer.echo(markdown(report))


@bench_app.command("attacks")
def attacks(
    runs: str = typer.Option("", "--attacks", help="Comma-separated attacks (default: all whose colluders fit "
                                                   "--composers; benchmarks/attacker.py; none: the clean runs only)."),
    clean_runs: int = typer.Option(3, "--clean-runs", min=0, help="Runs without an attacker: the noise a ratio is "
                                                                 "judged against, and the count of honest peers "
                                                                 "banned."),
    preset: PresetName = "tiny",
    steps: int = typer.Option(2000, "--steps", min=50,
                              help="Inner steps per composer (at 2,000 the joiner, whose start-up takes about 20 s "
                                   "beside the others on 2 cores, arrives a third into a run of the tiny preset; "
                                   "with --lockstep it comes once the others passed --steps, and they train "
                                   "max(300, steps / 4) more beside it)."),
    composers: int = typer.Option(4, "--composers", min=4, max=16,
                                  help="Composers per run: the attackers' places (as many as the attacks' most "
                                       "colluders), an honest joiner, the rest honest from the start."),
    workdir: str | None = typer.Option(None, "--workdir", help="Folder for the processes' files (default: temp)."),
    lockstep: bool = typer.Option(False, "--lockstep",
                                  help="Nodes wait for each outer round they started and apply it one step after "
                                       "it was due, and each surrogate update a refresh after it was published "
                                       "(node.lockstep): clean runs train the same steps until the joiner comes, "
                                       "which is then once the others passed --steps, where they are judged."),
    left_at: str = typer.Option("", "--left-at",
                                help="Comma-separated steps: a run without an attacker for each, in which the first "
                                     "attacker's place leaves at that step; a banned attacker's run is judged against "
                                     "them beside the clean runs (e.g. 10,20,30 with --lockstep)."),
    changes: Sets = None,
    json_path: JsonPath = None,
) -> None:
    """A local swarm of 4 composers (``--composers``) run clean, then once per attack with its colluders hostile:
    the honest composers' val loss against the clean runs', experts the attackers held, rounds, bans, crashes (tiny
    preset: a run of 2,000 steps takes about 3 min on 2 cores, every attack at 4 about 70 min). ``--set`` applies to
    every node of every run."""
    from pathlib import Path

    from parallax.benchmarks.attacks import OWN_OPTIONS, markdown, run_attacks, write

    _check_swarm_sets(preset, changes, OWN_OPTIONS, nodes_only=True)

    try:
        names = [a.strip() for a in runs.split(",") if a.strip()]
        report = run_attacks(attacks=[] if names == ["none"] else names or None, preset=preset, steps=steps,
                             workdir=Path(workdir) if workdir else None, progress=typer.echo, clean_runs=clean_runs,
                             composers=composers, lockstep=lockstep, settings=tuple(changes or ()),
                             left_at=tuple(int(step) for step in left_at.split(",") if step.strip()))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    write(report, json_path)
    typer.echo(markdown(report))


@bench_app.command("wan")
def wan(
    rates: str = typer.Option("100mbit,20mbit", "--rates",
                              help="Link rates of the lab runs (tc units), comma-separated."),
    nodes: int = typer.Option(4, "--nodes", min=2, max=6, help="Composer processes, one per lab host."),
    steps: int = typer.Option(120, "--steps", min=20, help="Inner steps per composer in each run."),
    preset: PresetName = "small",
    crowd: int = typer.Option(0, "--crowd", min=0, max=16,
                              help="Busy processes beside the nodes through every run (a desktop doing other work)."),
    partition: bool = typer.Option(True, "--partition/--no-partition",
                                   help="Also cut one host off at the lowest rate."),
    workdir: str | None = typer.Option(None, "--workdir", help="Folder for the processes' files (default: temp)."),
    sets: Sets = None,
    json_path: JsonPath = None,
) -> None:
    """The same swarm on loopback and on network-lab links capped at each rate, then one host cut off: outer rounds
    completed and their collect time against the time their bytes need, the training thread's time at the network
    seam, gossip and snapshot bytes, time to re-own a cut-off host's experts, val loss against loopback (root and
    network namespaces; small preset: about 20 min on 2 cores)."""
    from pathlib import Path

    from parallax.benchmarks.wan import markdown, run_wan_bench, write
    from parallax.node.config.typed import ConfigError, parse_sets
    from parallax.node.peer.netlab import NetLabError

    try:
        changes = parse_sets(sets or ())
    except ConfigError as e:
        fail(e)
    try:
        report = run_wan_bench(rates=tuple(r.strip() for r in rates.split(",") if r.strip()), nodes=nodes,
                               steps=steps, preset=preset, crowd=crowd, partition=partition,
                               workdir=Path(workdir) if workdir else None, progress=typer.echo, changes=changes)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    except NetLabError as e:
        fail(f"the network lab cannot be built here: {e}")
    write(report, json_path)
    typer.echo(markdown(report))


@bench_app.command("protocol")
def protocol(
    seconds: float = typer.Option(1.0, "--seconds", min=0.05, help="Timing budget per envelope size, in seconds."),
    json_path: JsonPath = None,
) -> None:
    """Envelope sign + verify vs raw Ed25519 (256 B, 64 KiB, 4 MiB) and tensor codec MB/s (about 30 s)."""
    from parallax.benchmarks.protocol import markdown, run_protocol, write

    report = run_protocol(seconds)
    write(report, json_path)
    typer.echo(markdown(report))


@bench_app.command("bytes")
def bytes_(
    peers: str = typer.Option("4,64,1000", "--peers", help="Comma-separated swarm sizes."),
    preset: PresetName = "medium",
    json_path: JsonPath = None,
) -> None:
    """Bytes each peer moves per outer round against the swarm's size: every wire (real encoded sizes of the
    preset's shared groups) under the gathered and the all-reduced schedule (seconds)."""
    from parallax.benchmarks.bytes import markdown, run_bytes, write

    report = run_bytes(preset, _sizes(peers, minimum=2, option="--peers"))
    write(report, json_path)
    typer.echo(markdown(report))


@bench_app.command("generate")
def generate_(
    preset: PresetName = "small",
    new_tokens: int = typer.Option(256, "--new-tokens", min=1, help="Tokens sampled per timed run."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto (CUDA when torch sees one)."),
    json_path: JsonPath = None,
) -> None:
    """Tokens per second of generation with the key-value cache and without it, side by side."""
    from parallax.benchmarks.generate import markdown, run_generate, write
    from parallax.node.train.device import DeviceError, device_of

    try:
        torch_device = device_of(device)
        report = run_generate(preset, new_tokens, torch_device)
    except (ValueError, DeviceError) as e:
        fail(e)
    write(report, json_path)
    typer.echo(markdown(report))


@bench_app.command("fuzz")
def fuzz(
    count: int = typer.Option(100_000, "--count", min=1, help="Random and mutated inputs to feed the decoders."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs."),
    json_path: JsonPath = None,
) -> None:
    """Fuzz the wire decoders; exits 1 if any exception other than RemoteProtocolError escaped."""
    from parallax.benchmarks.fuzz_protocol import run_fuzz, write

    report = run_fuzz(count, seed)
    write(report, json_path)
    typer.echo(report.markdown())
    for example in report.examples:
        typer.echo(f"\n{example['target']}: {example['error']}\n{example['traceback']}", err=True)
    if report.unexpected:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
