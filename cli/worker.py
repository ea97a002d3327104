"""``parallax worker join``: run one offload worker (updates composers' experts from activation sketches)."""

from __future__ import annotations

import signal
from pathlib import Path

import typer
from rich.console import Console

from parallax.cli.options import Preset, Sets, supervise_or_continue

worker_app = typer.Typer(help="Run an offload worker.", no_args_is_help=True)


@worker_app.command("join")
def join(
    gpu: int | None = typer.Option(None, "--gpu", help="Run the expert updates on CUDA device N."),
    cpu: bool = typer.Option(False, "--cpu", help="Run the expert updates on the CPU."),
    initial_peers: list[str] = typer.Option(
        [], "--initial-peers", help="Multiaddr of a live peer of the run, ending in /p2p/<id> (repeatable)."),
    run_id: str = typer.Option("parallax", "--run-id", help="Training run id (the composers' --run-id)."),
    identity: Path = typer.Option(
        Path.home() / ".parallax" / "worker.key", "--identity", help="Ed25519 key file, created on first run."),
    preset: Preset = "tiny",
    set_: Sets = None,
    capacity: float = typer.Option(1.0, "--capacity", min=0.001, help="Relative capacity (1.0 = a reference "
                                   "worker): composers give this worker experts in proportion to it."),
    metrics: Path | None = typer.Option(None, "--metrics", help="JSONL events file."),
    host: list[str] = typer.Option([], "--host", help="Multiaddr to listen on (repeatable; default loopback)."),
    announce: list[str] = typer.Option([], "--announce", help="Public multiaddr others dial (repeatable)."),
    loopback: bool = typer.Option(False, "--loopback", help="Peers on one machine (accepted for symmetry with "
                                  "`node join`; the worker has no timings to shorten)."),
    no_supervise: bool = typer.Option(
        False, "--no-supervise", help="Run in this process (under a process manager that signals by pid)."),
    supervised_by: int | None = typer.Option(None, "--supervised-by", hidden=True),
) -> None:
    """Join a run as a worker: announce a capacity, take experts composers offload, answer their sketches."""
    from parallax.dht.adapter import parse_initial_peers
    from parallax.errors import ParallaxError
    from parallax.node.config.train import override, parse_changes, train_config
    from parallax.node.offload.worker import Worker, WorkerConfig
    from parallax.node.peer.processes import ForcedStop, install_signal_handlers
    from parallax.node.train.device import DeviceError, resolve_device

    try:
        device = resolve_device(gpu, cpu)
        cfg = override(train_config(preset), parse_changes(set_ or []))
        config = WorkerConfig(train=cfg, run_id=run_id, identity_path=identity.expanduser(),
                              initial_peers=tuple(parse_initial_peers(initial_peers)),
                              host_maddrs=tuple(host or ["/ip4/127.0.0.1/tcp/0"]), announce_maddrs=tuple(announce),
                              capacity=capacity, device=str(device), metrics_path=metrics)
    except (ValueError, DeviceError) as e:
        raise typer.BadParameter(str(e)) from e
    supervise_or_continue("worker", supervised_by, no_supervise)  # as `node join`
    console = Console(stderr=True)
    previous: dict[int, object] = {}
    try:
        worker = Worker(config)
        previous = install_signal_handlers(worker)
        worker.run()
    except (ParallaxError, ValueError, OSError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    except ForcedStop as e:
        raise typer.Exit(130) from e
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
    console.print(f"worker left ({worker.servicer.updates} updates answered)")


def register(app: typer.Typer) -> None:
    app.add_typer(worker_app, name="worker")
