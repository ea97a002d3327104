"""``parallax worker join``: run one offload worker (updates composers' experts from activation sketches)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from parallax.cli.options import (
    ConfigFile,
    ManifestFile,
    MemberCertFile,
    Preset,
    Relay,
    Sets,
    StatusHost,
    StatusPort,
    fail,
    run_manifest,
    supervise_or_continue,
)

worker_app = typer.Typer(help="Run an offload worker.", no_args_is_help=True, rich_markup_mode=None)


@worker_app.command("join")
def join(
    gpu: int | None = typer.Option(None, "--gpu", help="Run the expert updates on CUDA device N."),
    cpu: bool = typer.Option(False, "--cpu", help="Run the expert updates on the CPU."),
    initial_peers: list[str] | None = typer.Option(
        None, "--initial-peers", help="Multiaddr of a live peer of the run, ending in /p2p/<id> (repeatable)."),
    run_id: str | None = typer.Option(None, "--run-id", help="Training run id (the composers' --run-id)."),
    identity: Path | None = typer.Option(
        None, "--identity", help="Ed25519 key file, created on first run (default ~/.parallax/worker.key)."),
    preset: Preset = None,
    manifest_file: ManifestFile = None,
    member_cert: MemberCertFile = None,
    status_port: StatusPort = None,
    status_host: StatusHost = None,
    config_file: ConfigFile = None,
    set_: Sets = None,
    capacity: float | None = typer.Option(None, "--capacity", min=0.001, help="Relative capacity (1.0 = a reference "
                                          "worker): composers give this worker experts in proportion to it."),
    metrics: Path | None = typer.Option(None, "--metrics", help="JSONL events file."),
    host: list[str] | None = typer.Option(None, "--host", help="Multiaddr to listen on (repeatable; default "
                                          "every interface, or 127.0.0.1 with --loopback)."),
    announce: list[str] | None = typer.Option(None, "--announce", help="Public multiaddr others dial (repeatable)."),
    relay: Relay = None,
    loopback: bool | None = typer.Option(None, "--loopback/--internet", help="Peers on one machine (accepted for "
                                         "symmetry with `node join`; the worker has no timings to shorten)."),
    leave_when_idle: float | None = typer.Option(
        None, "--leave-when-idle", min=0.1, help="Leave once no composer of the run has been alive for this many "
        "seconds, after one was (default: serve until Ctrl+C)."),
    quiet: bool = typer.Option(False, "--quiet", help="No live table (logs only)."),
    no_supervise: bool = typer.Option(
        False, "--no-supervise", help="Run in this process (under a process manager that signals by pid)."),
    supervised_by: int | None = typer.Option(None, "--supervised-by", hidden=True),
) -> None:
    """Join a run as a worker: announce a capacity, take experts composers offload, answer their sketches.

    Settings: defaults < --config file < these flags < --set (``parallax config show --for worker``)."""
    from parallax.errors import ParallaxError
    from parallax.node.config.peer import WorkerConfig
    from parallax.node.config.resolve import resolve, worker_defaults
    from parallax.node.config.typed import ConfigError
    from parallax.node.offload.worker import Worker
    from parallax.node.peer.processes import ForcedStop, install_signal_handlers
    from parallax.node.train.device import DeviceError, device_of, device_setting

    flags = {"preset": preset, "peer.run_id": run_id, "peer.identity": identity,
             "peer.initial_peers": initial_peers or None, "peer.host": host or None,
             "peer.announce": announce or None, "peer.relay": relay, "peer.loopback": loopback, "peer.metrics": metrics,
             "peer.status_port": status_port, "peer.status_host": status_host,
             "worker.capacity": capacity, "worker.leave_when_idle_s": leave_when_idle}
    try:
        flags["worker.device"] = device_setting(gpu, cpu)
        manifest, flags["peer.run_id"] = run_manifest(manifest_file, run_id)
        flags["peer.manifest"], flags["peer.member_cert"] = manifest_file, member_cert
        config = resolve(WorkerConfig, worker_defaults, file=config_file, flags=flags, sets=set_ or (),
                         default_preset="tiny", manifest=manifest)
        device_of(config.worker.device)
    except (ConfigError, DeviceError, ValueError) as e:
        fail(e)
    supervise_or_continue("worker", supervised_by, no_supervise)  # as `node join`
    console = Console(stderr=True)
    live = None if quiet else Live(console=console, refresh_per_second=2, transient=False)
    previous: dict[int, object] = {}
    try:
        worker = Worker(config, on_status=(lambda s: live.update(_status_table(s))) if live is not None else None)
        previous = install_signal_handlers(worker)
        if live is not None:
            live.start()
        worker.run()
    except (ParallaxError, ValueError, OSError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    except ForcedStop as e:
        raise typer.Exit(130) from e
    finally:
        if live is not None:
            live.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
    console.print(f"worker left ({worker.servicer.updates} updates answered)")


def _status_table(status: dict[str, Any]) -> Table:
    table = Table(title=f"parallax worker {status['fingerprint']} on {status['device']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, label in (("composers", "live composers of the run"), ("experts", "experts held for composers"),
                       ("updates", "updates answered"), ("refused", "requests refused")):
        table.add_row(label, str(status[key]))
    return table


def register(app: typer.Typer) -> None:
    app.add_typer(worker_app, name="worker")
