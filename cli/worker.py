"""``parallax worker join``: run one offload worker (updates composers' experts from activation sketches)."""

from __future__ import annotations

import contextlib
import signal
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from parallax.cli.options import (
    Announce,
    ConfigFile,
    Cpu,
    Gpu,
    Host,
    IdentityFile,
    InitialPeers,
    LiveQuiet,
    Loopback,
    ManifestFile,
    MemberCertFile,
    Metrics,
    NoSupervise,
    Preset,
    Relay,
    RunId,
    Sets,
    Setting,
    StatusHost,
    StatusPort,
    SupervisedBy,
    fail,
    run_manifest,
    setting_flags,
    supervise_or_continue,
)
from parallax.cli.progress import logs_through

worker_app = typer.Typer(help="Run an offload worker.", no_args_is_help=True, rich_markup_mode=None)

Capacity = Annotated[float | None, typer.Option(
    "--capacity", min=0.001, help="Relative capacity (1.0 = a reference worker): composers give this worker experts "
    "in proportion to it."), Setting("worker.capacity")]
LeaveWhenIdle = Annotated[float | None, typer.Option(
    "--leave-when-idle", min=0.1, help="Leave once no composer of the run has been alive for this many seconds, after "
    "one was (default: serve until Ctrl+C)."), Setting("worker.leave_when_idle_s")]


@worker_app.command("join")
def join(
    gpu: Gpu = None,
    cpu: Cpu = False,
    initial_peers: InitialPeers = None,
    run_id: RunId = None,
    identity: IdentityFile = None,
    preset: Preset = None,
    manifest_file: ManifestFile = None,
    member_cert: MemberCertFile = None,
    status_port: StatusPort = None,
    status_host: StatusHost = None,
    config_file: ConfigFile = None,
    set_: Sets = None,
    capacity: Capacity = None,
    metrics: Metrics = None,
    host: Host = None,
    announce: Announce = None,
    relay: Relay = None,
    loopback: Loopback = None,
    leave_when_idle: LeaveWhenIdle = None,
    quiet: LiveQuiet = False,
    no_supervise: NoSupervise = False,
    supervised_by: SupervisedBy = None,
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

    flags = setting_flags(join, locals())
    try:
        flags["worker.device"] = device_setting(gpu, cpu)
        manifest, flags["peer.run_id"] = run_manifest(manifest_file, run_id)
        config = resolve(WorkerConfig, worker_defaults, file=config_file, flags=flags, sets=set_ or (),
                         default_preset="tiny", manifest=manifest)
        device_of(config.worker.device)
    except (ConfigError, DeviceError, ValueError) as e:
        fail(e)
    supervise_or_continue("worker", supervised_by, no_supervise)  # as `node join`
    console = Console(stderr=True)
    live = None if quiet else Live(console=console, refresh_per_second=2, transient=False)
    previous: dict[int, object] = {}
    logs = contextlib.ExitStack()
    try:
        worker = Worker(config, on_status=(lambda s: live.update(_status_table(s))) if live is not None else None)
        previous = install_signal_handlers(worker)
        if live is not None:
            logs.enter_context(logs_through(console))
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
        logs.close()
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
