"""``parallax node join``: run one composer peer (the thing a volunteer runs)."""

from __future__ import annotations

import logging
import shlex
import signal
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from parallax.cli.options import (
    ConfigFile,
    Data,
    ManifestFile,
    MemberCertFile,
    Preset,
    Relay,
    Sets,
    StatusHost,
    StatusPort,
    fail,
    invoked_as,
    run_manifest,
    supervise_or_continue,
)

node_app = typer.Typer(help="Run a composer peer.", no_args_is_help=True, rich_markup_mode=None)
logger = logging.getLogger(__name__)

def _invoked_as_node_join(argv: list[str]) -> bool:
    """Whether this process's command line is ``parallax [global options] node join ...`` (re-runnable)."""
    return invoked_as(argv, "node", "join")


def join_line(config: Any, initial_peers: str, *, preset: str | None = None, config_file: Path | None = None,
              sets: list[str] | None = None) -> str:
    """The command a second node joins this one's swarm with: the run id, the run's manifest when this node has
    one (else the settings it was started with, which its manifest is made of), the timing profile and this node's
    address. Quoted for a POSIX shell."""
    args = ["parallax", "node", "join", "--run-id", config.peer.run_id]
    if config.peer.manifest:
        args += ["--manifest", str(config.peer.manifest)]
    else:
        args += ["--preset", preset] if preset else []
        args += ["--config", str(config_file)] if config_file else []
        for item in sets or ():
            args += ["--set", item]
    if config.peer.loopback:
        args.append("--loopback")
    return shlex.join(args) + " " + initial_peers


def print_join_line(console: Console, status: Any, line: str) -> None:
    """Say the node is up and print ``line`` whole: one line that no console breaks (the terminal may soft-wrap
    it, and a copy of it pastes as one command)."""
    console.print(f"peer {status.peer_id} is up (run digest {status.run_digest}). Others join this swarm with:",
                  soft_wrap=True, markup=False, highlight=False)
    console.print(f"  {line}", soft_wrap=True, markup=False, highlight=False, crop=False)


def _status_table(status: Any) -> Table:
    table = Table(title=f"parallax node {status.fingerprint} — {status.phase}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    loss = f"{status.loss:.4f}" if status.loss is not None else "-"
    rounds = " ".join(f"{g}:{n}" for g, n in status.rounds_ok.items()) or "-"
    upcoming = " ".join(f"{g} in {n}" for g, n in status.next_round.items()) or "-"
    for key, value in (
        ("step", f"{status.step} ({status.trained} this session)"), ("schedule", status.schedule or "-"),
        ("loss", loss),
        ("tokens/s", f"{status.tokens_per_s:,.0f}"), ("live composers", str(status.live_peers)),
        ("owned experts", str(status.owned)),
        ("surrogates", f"{status.surrogates_held} followed, newest v{status.surrogate_version_max}"),
        ("sent / received", f"{status.bytes_sent / 1e6:.2f} MB / {status.bytes_received / 1e6:.2f} MB"),
        ("outer rounds done", rounds), ("next outer round", upcoming),
        ("experts taken over / handed over", f"{status.adoptions} / {status.releases}"),
    ):
        table.add_row(key, value)
    return table


@node_app.command("join")
def join(
    gpu: int | None = typer.Option(None, "--gpu", help="Train on CUDA device N (default: cuda:0 when present)."),
    cpu: bool = typer.Option(False, "--cpu", help="Train on the CPU."),
    initial_peers: list[str] | None = typer.Option(
        None, "--initial-peers", help="Multiaddr of a live peer, ending in /p2p/<id> (repeatable). None: start a new "
        "swarm and print the join line."),
    identity: Path | None = typer.Option(
        None, "--identity", help="Ed25519 key file, created on first run (default ~/.parallax/node.key)."),
    run_id: str | None = typer.Option(None, "--run-id", help="Training run id; every peer of a run uses the same."),
    data: Data = None,
    preset: Preset = None,
    manifest_file: ManifestFile = None,
    member_cert: MemberCertFile = None,
    status_port: StatusPort = None,
    status_host: StatusHost = None,
    log_to: list[str] | None = typer.Option(
        None, "--log-to", help="Also log to an experiment tracker (repeatable): tensorboard:DIR or wandb:PROJECT "
        "(extras: pip install -e '.[tensorboard]' or '.[wandb]')."),
    config_file: ConfigFile = None,
    set_: Sets = None,
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Folder for checkpoints of this node."),
    checkpoint_every: int | None = typer.Option(None, "--checkpoint-every", min=1, help="Checkpoint every N steps."),
    resume: str | None = typer.Option(
        None, "--resume", help="Resume from a checkpoint: latest (the newest in --checkpoint-dir) or the path of a "
        "step-N folder (`parallax checkpoints list DIR` lists them, each checked)."),
    steps: int | None = typer.Option(
        None, "--steps", min=1, help="Train N steps, then leave gracefully (default: until Ctrl+C)."),
    metrics: Path | None = typer.Option(None, "--metrics", help="JSONL metrics file (one line per step and event)."),
    host: list[str] | None = typer.Option(
        None, "--host", help="Multiaddr to listen on (repeatable; default every interface, /ip4/0.0.0.0/tcp/0, "
        "or 127.0.0.1 with --loopback; a fixed port, /ip4/0.0.0.0/tcp/PORT, for a port forward)."),
    announce: list[str] | None = typer.Option(None, "--announce", help="Public multiaddr others dial (repeatable)."),
    relay: Relay = None,
    min_peers: int | None = typer.Option(
        None, "--min-peers", min=1, help="Wait until this many composers are alive before the first step."),
    loopback: bool | None = typer.Option(
        None, "--loopback/--internet", help="Timings for peers on one machine (local swarms) or the internet's."),
    quiet: bool = typer.Option(False, "--quiet", help="No live table (logs only)."),
    snapshot_every: int | None = typer.Option(
        None, "--snapshot-every", min=1, help="Steps between expert snapshots for heirs (default 50): the most "
        "steps of its experts a crash loses; shorter costs traffic."),
    final_eval: bool | None = typer.Option(
        None, "--final-eval/--no-final-eval", help="Evaluate on the validation split when leaving."),
    no_supervise: bool = typer.Option(
        False, "--no-supervise", help="Run the node in this process. By default it runs in a session of its own "
        "that Ctrl+C reaches only through this process, so its p2pd daemon lives until the graceful leave is "
        "done; use this under a process manager that signals the node by pid."),
    supervised_by: int | None = typer.Option(None, "--supervised-by", hidden=True),
) -> None:
    """Join (or start) a swarm as a composer: claim an expert shard, train it, exchange in the background.

    Settings: defaults < --config file < these flags < --set (``parallax config show`` prints the result)."""
    from parallax.errors import ParallaxError
    from parallax.node.config.peer import NodeConfig
    from parallax.node.config.resolve import node_defaults, resolve
    from parallax.node.config.typed import ConfigError
    from parallax.node.peer.processes import ForcedStop, install_signal_handlers
    from parallax.node.peer.runner import Node
    from parallax.node.train.device import DeviceError, device_of, device_setting

    flags = {"preset": preset, "peer.run_id": run_id, "peer.identity": identity,
             "peer.initial_peers": initial_peers or None, "peer.host": host or None,
             "peer.announce": announce or None, "peer.relay": relay, "peer.loopback": loopback, "peer.metrics": metrics,
             "peer.status_port": status_port, "peer.status_host": status_host, "peer.log_to": log_to or None,
             "node.data": data, "node.steps": steps, "node.checkpoint_dir": checkpoint_dir,
             "node.checkpoint_every": checkpoint_every, "node.resume": resume, "node.min_peers": min_peers,
             "node.snapshot_every": snapshot_every, "node.final_eval": final_eval}
    try:
        flags["node.device"] = device_setting(gpu, cpu)
        manifest, flags["peer.run_id"] = run_manifest(manifest_file, run_id)
        flags["peer.manifest"], flags["peer.member_cert"] = manifest_file, member_cert
        config = resolve(NodeConfig, node_defaults, file=config_file, flags=flags, sets=set_ or (),
                         default_preset="tiny", manifest=manifest)
        device_of(config.node.device)  # a device that cannot be used fails here, before anything starts
    except (ConfigError, DeviceError, ValueError) as e:
        fail(e)

    # Checked above, run below: in a session of its own under this process (processes.py says why), unless
    # told otherwise or not started from a command line (CliRunner).
    supervise_or_continue("node", supervised_by, no_supervise)

    console = Console(stderr=True)
    live = None if quiet else Live(console=console, refresh_per_second=4, transient=False)

    printed: list[bool] = []

    def show(status: Any) -> None:
        if status.join_command and not printed:
            printed.append(True)
            print_join_line(console, status, join_line(config, status.join_command, preset=preset,
                                                       config_file=config_file, sets=set_))
        if live is not None:
            live.update(_status_table(status))

    previous: dict[int, Any] = {}
    node = None
    try:
        node = Node(config, on_status=show)
        previous = install_signal_handlers(node)
        if live is not None:
            live.start()
        status = node.run()
    except (ParallaxError, ValueError, OSError) as e:  # bad key file, data, checkpoint, unreachable swarm
        _clear(live)
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    except ForcedStop as e:  # the node closed everything it started before this propagated
        _clear(live)
        console.print(f"[yellow]{e}[/yellow]; {_what_is_kept(config, node)}")
        raise typer.Exit(130) from e
    finally:
        if live is not None:
            live.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    console.print(f"left the swarm at step {status.step} after {status.trained} steps "
                  f"(loss {status.loss if status.loss is not None else float('nan'):.4f})")


def _clear(live: Live | None) -> None:
    """Take the live table off the screen: after an error it would show a node that never ran."""
    if live is not None:
        live.transient = True
        live.stop()


def _what_is_kept(config: Any, node: Any) -> str:
    """What a forced stop leaves behind, said truly."""
    if node is None or node.starting:
        return "it stopped before training began" + (" (the checkpoint it was resuming from is untouched)"
                                                     if config.node.resume else "")
    if config.node.checkpoint_dir is not None:
        return f"no final checkpoint was written: {config.node.checkpoint_dir} holds those written before"
    return "this node kept no checkpoint (no --checkpoint-dir): its experts go on in their heirs' snapshots"


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")
