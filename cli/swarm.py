"""``parallax swarm ...``: look at a running swarm. ``status`` lists a run's live peers and who owns which expert."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from parallax.cli.options import ManifestFile, new_run_folder, run_manifest

if TYPE_CHECKING:
    from parallax.dht.status import SwarmStatus
    from parallax.node.peer.local_swarm import LocalSwarm

swarm_app = typer.Typer(help="Run a local swarm, or look at a running one (from the DHT alone).",
                        no_args_is_help=True, rich_markup_mode=None)
_NUMERIC = frozenset({"step", "loss", "owned", "age s", "layer"})
_WIDE = 110  # console columns from which the peer table lists each peer's experts


@swarm_app.command("status")
def status(
    initial_peers: list[str] = typer.Option(
        [], "--initial-peers", help="Multiaddr of a peer of the swarm, ending in /p2p/<peer id> (repeatable, or "
        "comma-separated); one live peer is enough."
    ),
    run_id: str = typer.Option(..., "--run-id", "--run", help="The training run to look at (the nodes' run id)."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON on stdout (for scripts)."),
    layers: int | None = typer.Option(
        None, "--layers", min=1, help="MoE layers in the model, so layers nobody owns show (default: up to the "
        "highest layer any peer announces)."
    ),
    experts: int | None = typer.Option(
        None, "--experts", min=1, help="Experts per MoE layer, so unowned trailing experts show (default: up to "
        "the highest expert any peer announces)."
    ),
    wait: float = typer.Option(
        6.0, "--wait", min=0, help="Seconds to keep re-reading (every 1 s) while no live peer is found."
    ),
    timeout: float = typer.Option(5.0, "--timeout", min=0.1, help="Seconds allowed for each DHT read."),
    startup_timeout: float = typer.Option(
        30.0, "--startup-timeout", min=1, help="Seconds to wait for the local p2p daemon and the join, per attempt."
    ),
    heartbeat_ttl: float = typer.Option(
        6.0, "--heartbeat-ttl", min=0.1, help="Seconds a heartbeat record lives in this run (the nodes' "
        "setting, 6 by default): turns record expiries into heartbeat ages."
    ),
    manifest_file: ManifestFile = None,
    serve: int | None = typer.Option(
        None, "--serve", min=0, max=65535, help="Keep reading, and serve the run's status page on "
        "http://127.0.0.1:PORT/ (/status JSON, /metrics) until Ctrl+C."),
    serve_host: str = typer.Option("127.0.0.1", "--serve-host", help="Address the status page listens on."),
) -> None:
    """List the live peers of a run and the owner of every expert, read once from the DHT.

    A client-mode DHT node (it serves and announces nothing) reads the run's heartbeats, then stops.

    Exit code 1 when the swarm cannot be reached or nobody in the run is alive.
    """
    from parallax.dht.adapter import DHTConfig, SwarmDHT
    from parallax.dht.keys import check_run_id, protected_keys
    from parallax.dht.membership import read_live_view, split_by_run
    from parallax.dht.records import Admission, Ed25519RecordValidator
    from parallax.dht.status import swarm_status
    from parallax.errors import DHTError
    from parallax.node.config.train import SHARED_GROUPS

    if not initial_peers:
        raise typer.BadParameter("give at least one peer of the swarm, e.g. --initial-peers "
                                 "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...", param_hint="--initial-peers")
    try:
        check_run_id(run_id)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--run-id") from e
    try:
        config = DHTConfig(initial_peers=tuple(initial_peers), client_mode=True, startup_timeout_s=startup_timeout,
                           request_timeout_s=timeout, start_attempts=2)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--initial-peers") from e
    try:
        manifest, _ = run_manifest(manifest_file, run_id)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--manifest") from e
    # An allowlist run's records count only with a member certificate, as on its nodes.
    admission = (Admission(manifest.creator, manifest.digest) if manifest is not None
                 and manifest.admission == "allowlist" else None)
    # Validate-only (no key of our own): it checks the peers' signatures and strips them from the values.
    validator = Ed25519RecordValidator(None, protected_keys=protected_keys(run_id, layers or 0, SHARED_GROUPS),
                                       admission=admission)

    dht = None
    try:
        dht = SwarmDHT.start(config, [validator])
        if serve is not None:
            _serve(dht, run_id, manifest, serve, serve_host, timeout=timeout, layers=layers, experts=experts,
                   heartbeat_ttl=heartbeat_ttl)
            return
        view = read_live_view(dht, run_id, timeout_s=timeout, wait_s=wait)
    except DHTError as e:
        typer.echo(f"error: the swarm is unreachable: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        if dht is not None:
            dht.shutdown()

    where = ", ".join(config.initial_peers)
    if view is None:
        typer.echo(f"error: joined through {where} but no DHT read of run {run_id!r} answered within {timeout:g} s "
                   f"(tried for {wait:g} s). The peers may be overloaded or going down: retry, or raise --timeout.",
                   err=True)
        raise typer.Exit(1)
    if manifest is not None:  # the run's composers only, as its nodes see them
        view, foreign = split_by_run(view, manifest.digest)
        if foreign:
            typer.echo(f"{len(foreign)} composer(s) of run {run_id} train by another manifest: not shown", err=True)
    summary = swarm_status(view, heartbeat_ttl_s=heartbeat_ttl, n_layers=layers, n_experts=experts,
                           replicas=_replicas_of(manifest))
    if as_json:
        typer.echo(json.dumps(summary.to_json(), indent=2))
    elif summary.peers:
        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console = Console(width=160)  # piped to a file or a pager: do not squeeze the tables into 80 columns
        _print_tables(console, summary)
    if not summary.peers:
        left = f" ({len(summary.departed)} left with a deathrattle)" if summary.departed else ""
        typer.echo(f"error: no live peers in run {run_id!r}{left} after reading for {wait:g} s through {where}. "
                   "Check the run id (it is case-sensitive and must match the nodes' --run-id), and that the "
                   "nodes of the run are up.", err=True)
        raise typer.Exit(1)


def _replicas_of(manifest: Any) -> int | None:
    """The run's owners per expert when its manifest is known (``ownership.replicas``), else None."""
    if manifest is None:
        return None
    try:
        ownership = manifest.settings_dict().get("ownership", {})
    except ValueError:
        return None
    replicas = ownership.get("replicas", 1) if isinstance(ownership, dict) else 1
    return replicas if isinstance(replicas, int) and replicas >= 1 else None


def _serve(dht: Any, run_id: str, manifest: Any, port: int, host: str, *, timeout: float, layers: int | None,
           experts: int | None, heartbeat_ttl: float) -> None:
    """Serve the run's status page until Ctrl+C, re-reading the DHT every two seconds."""
    from parallax.cli.entry import Interrupted
    from parallax.dht.membership import read_view, split_by_run
    from parallax.node.net.observe import Observer, StatusServer

    def view() -> Any:
        found = read_view(dht, run_id, timeout_s=timeout)
        if found is not None and manifest is not None:  # the run's composers only, as its nodes see them
            found, _foreign = split_by_run(found, manifest.digest)
        return found

    observer = Observer(view, run_id, n_layers=layers, n_experts=experts, heartbeat_ttl_s=heartbeat_ttl,
                        replicas=_replicas_of(manifest))
    try:
        server = StatusServer(observer, port, host, role="observer").start()
    except OSError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    observer.start()
    typer.echo(f"serving the status of run {run_id} on {server.url} (JSON at /status, Prometheus at /metrics); "
               "Ctrl+C stops", err=True)
    try:
        threading.Event().wait()
    except (KeyboardInterrupt, Interrupted):  # Ctrl+C is how this ends: exit 0
        typer.echo("stopped serving", err=True)
    finally:
        observer.close()
        server.close()


def _print_tables(console: Console, summary: SwarmStatus) -> None:
    from parallax.dht.status import PEER_COLUMNS, SHARD_COLUMNS, SUSPECT_COLUMNS, peer_rows, shard_rows, suspect_rows

    peers = Table(title=f"run {summary.run_id}: {len(summary.peers)} live peer(s)", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    # Below ~110 columns the expert lists do not fit beside the rest: the ownership table has them.
    keep = [i for i, name in enumerate(PEER_COLUMNS) if name != "experts" or console.width >= _WIDE]
    for i in keep:
        name = PEER_COLUMNS[i]
        if name == "experts":  # the one long cell: it wraps, the others stay whole
            peers.add_column(name, overflow="fold", ratio=1)
        else:
            peers.add_column(name, no_wrap=True, min_width=len(name), justify="right" if name in _NUMERIC else "left")
    for row in peer_rows(summary):
        peers.add_row(*(row[i] for i in keep))
    console.print(peers)
    if summary.departed:
        console.print("left: " + ", ".join(f"{d.fingerprint} at step {d.step}" + (f" ({d.reason})" if d.reason else "")
                                           for d in summary.departed))
    suspects = suspect_rows(summary)
    if suspects:
        table = Table(title="peers the composers hold evidence against (each judges for itself)", box=box.SIMPLE_HEAD,
                      pad_edge=False, collapse_padding=True)
        for name in SUSPECT_COLUMNS:
            table.add_column(name, overflow="fold", justify="right" if name == "highest score" else "left")
        for row in suspects:
            table.add_row(*row)
        console.print(table)
    if not summary.layers:
        console.print("no peer announces any expert (no composer owns one yet)")
        return
    title = f"expert ownership: {len(summary.layers)} layer(s) x {summary.n_experts} experts"
    if summary.shape_inferred:
        title += " (shape from the announcements; set it with --layers and --experts)"
    shards = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in SHARD_COLUMNS:
        if name == "owners (experts)":
            shards.add_column(name, overflow="fold", min_width=16)
        else:
            shards.add_column(name, justify="right" if name in _NUMERIC else "left")
    for row in shard_rows(summary):
        shards.add_row(*row)
    console.print(shards)


@swarm_app.command("local")
def local(
    nodes: int = typer.Option(3, "--nodes", "-n", min=1, help="Composer processes to start."),
    steps: int | None = typer.Option(
        None, "--steps", min=1, help="Inner steps per node, then all leave (default: until Ctrl+C)."),
    preset: str = typer.Option("tiny", "--preset", help="Model preset: tiny (seconds) or small (CPU benchmark)."),
    workdir: Path = typer.Option(Path("parallax-local"), "--workdir",
                                 help="Folder for the swarm's runs: each run gets a sub-folder of its own (keys, "
                                 "logs, metrics, checkpoints and the trained model)."),
    run_id: str = typer.Option("local", "--run-id", help="Run id of the local swarm."),
    set_: list[str] = typer.Option([], "--set", help="TrainConfig override PATH=VALUE for every node."),
    timeout: float = typer.Option(3600.0, "--timeout", min=1, help="Stop everything after this many seconds."),
    checkpoint_every: int | None = typer.Option(
        None, "--checkpoint-every", min=1, help="Each node checkpoints every N steps (default: the run's "
        "node.checkpoint_every) and when it leaves, into RUN/node-<i>/checkpoints."),
) -> None:
    """Start a bootstrap peer and N composer processes on loopback; one live table; stop all cleanly; export the
    model the nodes leave into RUN/model."""
    import signal
    import threading
    import time

    from rich.live import Live

    from parallax.cli.progress import logs_through
    from parallax.errors import ParallaxError
    from parallax.node.peer.local_swarm import LocalSwarm, final_counters, read_metrics

    args = ["--preset", preset, "--min-peers", str(nodes)]
    for change in set_:
        args += ["--set", change]
    if steps is not None:
        args += ["--steps", str(steps)]
    stop = threading.Event()
    previous = {sg: signal.signal(sg, lambda *_: stop.set()) for sg in (signal.SIGINT, signal.SIGTERM)}
    console = Console()
    folder = new_run_folder(workdir, run_id)
    checkpoints = [folder / f"node-{i}" / "checkpoints" for i in range(nodes)]
    swarm = LocalSwarm(folder, run_id=run_id, node_args=args)
    try:
        console.print(f"run folder: {folder}")
        console.print(f"bootstrap peer: {swarm.start_bootstrap()}")
        for i in range(nodes):
            swarm.add_node("--checkpoint-dir", str(checkpoints[i]),
                           *(["--checkpoint-every", str(checkpoint_every)] if checkpoint_every else []))
        deadline = time.monotonic() + timeout
        with logs_through(console), Live(_local_table(swarm, final_counters, read_metrics), console=console,
                                         refresh_per_second=2) as live:
            while not stop.is_set() and time.monotonic() < deadline and any(n.alive for n in swarm.nodes):
                live.update(_local_table(swarm, final_counters, read_metrics))
                stop.wait(0.5)
            console.print("stopping the swarm..." if stop.is_set() else "all nodes finished")
            # Nodes that ended on their own with an error (not those the stop below ends).
            failed = [n for n in swarm.nodes if not n.alive and n.process.returncode != 0]
    except ParallaxError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    finally:
        swarm.close()
        for sg, handler in previous.items():
            signal.signal(sg, handler)
    console.print(_local_table(swarm, final_counters, read_metrics, title="summary"))
    console.print(f"logs and metrics: {folder}")
    model = _export_local(console, checkpoints, folder / "model", preset, set_)
    console.print("next:")
    if model is not None:
        console.print(f"  parallax generate {model} --prompt 'ROMEO:'", soft_wrap=True)
        console.print(f"  parallax eval {model}", soft_wrap=True)
    metrics = " ".join(str(n.metrics) for n in swarm.nodes)
    console.print(f"  parallax report {metrics} --out {folder / 'report'}", soft_wrap=True)
    for n in failed:
        console.print(f"[red]node {n.index} exited with code {n.process.returncode}[/red]: see {n.log}")
    if failed:
        raise typer.Exit(1)


def _export_local(console: Console, checkpoints: Sequence[Path], out: Path, preset: str,
                  sets: Sequence[str]) -> Path | None:
    """The model the local swarm's nodes left in their checkpoints (each expert from its newest holder), or None
    (said why) when they left none or not all of it."""
    from parallax.errors import NodeError
    from parallax.node.config.peer import NodeConfig
    from parallax.node.config.resolve import node_defaults, resolve
    from parallax.node.export.offline import export_checkpoints
    from parallax.node.train.data import load_corpus
    from parallax.node.train.tokenizer import make_tokenizer

    written = [c for c in checkpoints if c.is_dir() and any(c.iterdir())]
    if not written:
        console.print("[yellow]model not exported: no node wrote a checkpoint (none trained a step)[/yellow]")
        return None
    try:
        model_cfg = resolve(NodeConfig, node_defaults, flags={"preset": preset}, sets=sets,
                            default_preset="tiny").train.model
        # Nodes without a manifest train the run's BPE on the corpus alike; the export trains the same one.
        tokenizer = make_tokenizer(model_cfg, load_corpus(None)) if model_cfg.tokenizer == "bpe" else None
        model = export_checkpoints(written, out, tokenizer=tokenizer)
    except (NodeError, ValueError, OSError) as e:
        console.print(f"[yellow]model not exported: {e}[/yellow]")
        return None
    console.print(f"model: {model} (weights, config, a model card)")
    return model


def _local_table(
    swarm: LocalSwarm,
    counters: Callable[[Sequence[dict[str, Any]]], dict[str, Any] | None],
    read_metrics: Callable[[Path], list[dict[str, Any]]],
    title: str = "local swarm",
) -> Table:
    table = Table(title=title, box=box.SIMPLE)
    for col in ("node", "state", "step", "loss", "owned", "surrogates", "rounds ok", "sent MB", "received MB"):
        table.add_column(col, justify="right" if col not in ("node", "state") else "left")
    for n in swarm.nodes:
        last = counters(read_metrics(n.metrics)) or {}
        state = "running" if n.alive else f"exit {n.process.returncode}"
        rounds = sum((last.get("rounds_ok") or {}).values())
        table.add_row(str(n.index), state, str(last.get("step", "-")), f"{last['loss']:.4f}" if "loss" in last else "-",
                      str(last.get("owned", "-")), f"v{last.get('surrogate_version_max', 0)}", str(rounds),
                      f"{last.get('bytes_sent', 0) / 1e6:.2f}", f"{last.get('bytes_received', 0) / 1e6:.2f}")
    return table


def register(app: typer.Typer) -> None:
    app.add_typer(swarm_app, name="swarm")
