"""``parallax node join``: run one composer peer (the thing a volunteer runs)."""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from parallax.cli.options import (
    Announce,
    ConfigFile,
    Cpu,
    Data,
    Gpu,
    Host,
    IdentityFile,
    InitialPeers,
    LiveQuiet,
    LogTo,
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
    invoked_as,
    run_manifest,
    setting_flags,
    supervise_or_continue,
)
from parallax.cli.progress import logs_through

node_app = typer.Typer(help="Run a composer peer.", no_args_is_help=True, rich_markup_mode=None)
logger = logging.getLogger(__name__)

CheckpointDir = Annotated[Path | None, typer.Option("--checkpoint-dir", help="Folder for checkpoints of this node."),
                          Setting("node.checkpoint_dir")]
CheckpointEvery = Annotated[int | None, typer.Option("--checkpoint-every", min=1, help="Checkpoint every N steps."),
                            Setting("node.checkpoint_every")]
Resume = Annotated[str | None, typer.Option(
    "--resume", help="Resume from a checkpoint: latest (the newest in --checkpoint-dir) or the path of a step-N folder "
    "(`parallax checkpoints list DIR` lists them, each checked)."), Setting("node.resume")]
NodeSteps = Annotated[int | None, typer.Option(
    "--steps", min=1, help="Train N steps, then leave gracefully (default: until Ctrl+C)."), Setting("node.steps")]
MinPeers = Annotated[int | None, typer.Option(
    "--min-peers", min=1, help="Wait until this many composers are alive before the first step."),
    Setting("node.min_peers")]
SnapshotEvery = Annotated[int | None, typer.Option(
    "--snapshot-every", min=1, help="Steps between expert snapshots for heirs (default 50): the most steps of its "
    "experts a crash loses; shorter costs traffic."), Setting("node.snapshot_every")]
FinalEval = Annotated[bool | None, typer.Option(
    "--final-eval/--no-final-eval", help="Evaluate on the validation split when leaving."), Setting("node.final_eval")]

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
        ("time left", _duration(status.time_left_s)),
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
    gpu: Gpu = None,
    cpu: Cpu = False,
    initial_peers: InitialPeers = None,
    identity: IdentityFile = None,
    run_id: RunId = None,
    data: Data = None,
    preset: Preset = None,
    manifest_file: ManifestFile = None,
    member_cert: MemberCertFile = None,
    status_port: StatusPort = None,
    status_host: StatusHost = None,
    log_to: LogTo = None,
    config_file: ConfigFile = None,
    set_: Sets = None,
    checkpoint_dir: CheckpointDir = None,
    checkpoint_every: CheckpointEvery = None,
    resume: Resume = None,
    steps: NodeSteps = None,
    metrics: Metrics = None,
    host: Host = None,
    announce: Announce = None,
    relay: Relay = None,
    min_peers: MinPeers = None,
    loopback: Loopback = None,
    quiet: LiveQuiet = False,
    snapshot_every: SnapshotEvery = None,
    final_eval: FinalEval = None,
    no_supervise: NoSupervise = False,
    supervised_by: SupervisedBy = None,
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

    flags = setting_flags(join, locals())
    try:
        flags["node.device"] = device_setting(gpu, cpu)
        manifest, flags["peer.run_id"] = run_manifest(manifest_file, run_id)
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
    logs = contextlib.ExitStack()
    try:
        node = Node(config, on_status=show)
        previous = install_signal_handlers(node)
        if live is not None:
            logs.enter_context(logs_through(console))
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
        logs.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    console.print(f"left the swarm at step {status.step} after {status.trained} steps "
                  f"(loss {status.loss if status.loss is not None else float('nan'):.4f})")


def _duration(seconds: float | None) -> str:
    """``seconds`` for people: "about 2 h 05 min", "about 3 min", "under a minute"; "-" when unknown."""
    if seconds is None:
        return "-"
    minutes = round(seconds / 60)
    if minutes < 1:
        return "under a minute"
    return f"about {minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"about {minutes} min"


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
