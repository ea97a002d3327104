"""Options shared by several commands, declared once (Typer ``Annotated`` style).

An option that sets a setting carries its path (``Setting``): a command builds its flag map from its own
signature (``setting_flags``), so no command maps flags to settings by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

if TYPE_CHECKING:
    from parallax.node.config.train import TrainConfig

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Setting:
    """The setting an option sets (its dotted path): ``Annotated[..., typer.Option(...), Setting("peer.run_id")]``."""

    path: str


Composers = Annotated[
    int, typer.Option("--composers", "-c", min=1, help="Composers C, each with its own expert shard.")
]
Preset = Annotated[
    str | None, typer.Option("--preset", help="Model preset: tiny (tests, seconds), small (CPU benchmark), report "
                             "(FLOP accounting only). Default: the --config file's, else the command's."),
    Setting("preset"),
]
PresetName = Annotated[str, typer.Option("--preset", help="Model preset: tiny, small or report.")]
Steps = Annotated[int | None, typer.Option("--steps", min=1, help="Inner steps per composer (default 500).")]
BatchSize = Annotated[
    int | None, typer.Option("--batch-size", min=1, help="Sequences per composer step (default 8).")
]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed of initialisation and data streams (default 0).")]
ConfigFile = Annotated[
    Path | None, typer.Option("--config", help="TOML file of settings: a top-level preset, a [train] table "
                              "([train.optim], ...) and [peer], [node], [net], [worker] (`parallax config show` "
                              "writes one); flags and --set override it.")
]
JsonPath = Annotated[
    Path | None, typer.Option("--json", help="Write the result as JSON to this path (and a .md beside it).")
]
Quiet = Annotated[bool, typer.Option("--quiet", help="No progress bars.")]
Sets = Annotated[
    list[str] | None, typer.Option(
        "--set", help="Setting PATH=VALUE (repeatable), typed as the setting, e.g. sync.compression=fp16, "
        'surrogate.input_grad=false or sync.periods={"router": 25, "latent": 50, "backbone": 100}; '
        "`parallax config show` lists every PATH.")
]


def setting_flags(command: Callable[..., Any], values: Mapping[str, Any]) -> dict[str, object]:
    """setting path -> value of every option of ``command`` that carries a ``Setting``, from ``values`` (the
    command's arguments); an option not given (None, or an empty list) maps to None: ``resolve`` skips it."""
    flags: dict[str, object] = {}
    for name, hint in typing.get_type_hints(command, include_extras=True).items():
        for meta in getattr(hint, "__metadata__", ()):
            if isinstance(meta, Setting):
                value = values[name]
                flags[meta.path] = None if value == [] else value
    return flags


Data = Annotated[
    str | None, typer.Option("--data", help="Text file, folder or glob (default: built-in tinyshakespeare)."),
    Setting("node.data"),
]
ManifestFile = Annotated[
    Path | None, typer.Option(
        "--manifest", help="The run's manifest file (`parallax run create`, `parallax run fetch`): it sets the run's "
        "settings and id. Default: sign one of this peer's own settings (an open run)."),
    Setting("peer.manifest"),
]
RunDigest = Annotated[
    str | None, typer.Option("--digest", help="The run digest to take when the run has several manifests (ask the "
                             "run's host; `parallax run show` prints a manifest's)."),
]
RunCreator = Annotated[
    str | None, typer.Option("--creator", help="The fingerprint of an allowlist run's creator: only its manifests "
                             "count (ask the run's host; any key can publish a manifest under a run's id)."),
]
MemberCertFile = Annotated[
    Path | None, typer.Option("--member-cert", help="This peer's member certificate for an allowlist run "
                              "(`parallax run admit`)."),
    Setting("peer.member_cert"),
]

# A networked peer's options (``node join``, ``worker join``): who it is, where it listens, what it serves.
Gpu = Annotated[int | None, typer.Option("--gpu", help="Use CUDA device N (default: cuda:0 when present).")]
Cpu = Annotated[bool, typer.Option("--cpu", help="Use the CPU.")]
InitialPeers = Annotated[
    list[str] | None, typer.Option(
        "--initial-peers", help="Multiaddr of a live peer of the run, ending in /p2p/<id> (repeatable). None: start a "
        "new swarm and print the join line."),
    Setting("peer.initial_peers"),
]
RunId = Annotated[
    str | None, typer.Option("--run-id", help="Training run id; every peer of a run uses the same."),
    Setting("peer.run_id"),
]
IdentityFile = Annotated[
    Path | None, typer.Option(
        "--identity", help="Ed25519 key file, created on first run (default ~/.parallax/node.key for a node, "
        "~/.parallax/worker.key for a worker)."),
    Setting("peer.identity"),
]
Host = Annotated[
    list[str] | None, typer.Option(
        "--host", help="Multiaddr to listen on (repeatable; default every interface, /ip4/0.0.0.0/tcp/0, or "
        "127.0.0.1 with --loopback; a fixed port, /ip4/0.0.0.0/tcp/PORT, for a port forward)."),
    Setting("peer.host"),
]
Announce = Annotated[
    list[str] | None, typer.Option("--announce", help="Public multiaddr others dial (repeatable)."),
    Setting("peer.announce"),
]
Relay = Annotated[
    str | None, typer.Option(
        "--relay", help="Circuit relays through the initial peers, for a node behind NAT: auto (when libp2p finds "
        "this node unreachable; the default), always, off."),
    Setting("peer.relay"),
]
Loopback = Annotated[
    bool | None, typer.Option(
        "--loopback/--internet", help="Timings for peers on one machine (local swarms) or the internet's."),
    Setting("peer.loopback"),
]
Metrics = Annotated[
    Path | None, typer.Option("--metrics", help="JSONL metrics file (one line per step and event)."),
    Setting("peer.metrics"),
]
StatusPort = Annotated[
    int | None, typer.Option(
        "--status-port", min=0, max=65535, help="Serve a status page on http://127.0.0.1:PORT/ with /status (JSON) "
        "and /metrics (Prometheus)."),
    Setting("peer.status_port"),
]
StatusHost = Annotated[
    str | None, typer.Option("--status-host", help="Address the status page listens on (default 127.0.0.1; "
                             "0.0.0.0 for a scraper on another machine)."),
    Setting("peer.status_host"),
]
LogTo = Annotated[
    list[str] | None, typer.Option(
        "--log-to", help="Also log to an experiment tracker (repeatable): tensorboard:DIR or wandb:PROJECT "
        "(extras: pip install -e '.[tensorboard]' or '.[wandb]')."),
    Setting("peer.log_to"),
]
LiveQuiet = Annotated[bool, typer.Option("--quiet", help="No live table (logs only).")]
NoSupervise = Annotated[
    bool, typer.Option(
        "--no-supervise", help="Run in this process. By default the peer runs in a session of its own that Ctrl+C "
        "reaches only through this process, so its p2pd daemon lives until the graceful leave is done; use this "
        "under a process manager that signals the peer by pid."),
]
SupervisedBy = Annotated[int | None, typer.Option("--supervised-by", hidden=True)]


def run_manifest(path: Path | None, run_id: str | None) -> tuple[Any, str | None]:
    """The manifest at ``path`` (``None`` without one) and the run id to use: ``--run-id`` if given (it must be
    the manifest's), else the manifest's.

    Raises:
        ValueError: an unreadable or altered manifest, or another run's (``ManifestError``).
    """
    from parallax.protocol.manifest import ManifestError, load_manifest

    if path is None:
        return None, run_id
    manifest = load_manifest(path)
    if run_id is not None and run_id != manifest.run_id:
        raise ManifestError(f"--run-id {run_id} but manifest {path} is run {manifest.run_id}'s: leave out --run-id")
    return manifest, manifest.run_id


def new_run_folder(workdir: Path, run_id: str) -> Path:
    """A folder of its own for one local run under ``workdir``: ``RUN_ID-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... when
    two runs start in the same second), so a second run in the same folder keeps the first one's files."""
    stamp = f"{run_id}-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        folder = workdir / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"{workdir} holds a thousand runs started in this second")


def fail(message: object, code: int = 2) -> NoReturn:
    """End the command with a one-line error on stderr (exit 2: bad settings or arguments)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The options every in-process run command shares (``parallax sim``, ``parallax bench quality|offload``)."""

    composers: int
    preset: str | None
    steps: int | None
    batch_size: int | None
    seed: int | None
    data: str | None
    config: Path | None
    sets: list[str] | None
    json_path: Path | None
    quiet: bool

    def train_config(self, default_preset: str = "small") -> TrainConfig:
        """The resolved settings (defaults < --config < flags < --set); a bad one ends the command (exit 2)."""
        from parallax.node.config.resolve import resolve, train_defaults
        from parallax.node.config.train import TrainConfig
        from parallax.node.config.typed import ConfigError

        flags = {"preset": self.preset, "steps": self.steps, "batch_size": self.batch_size, "seed": self.seed}
        try:
            return resolve(TrainConfig, train_defaults, file=self.config, flags=flags, sets=self.sets or (),
                           default_preset=default_preset)
        except ConfigError as e:
            fail(e)


_RUN_PARAMETERS = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    for name, annotation, default in (
        ("composers", Composers, 4),
        ("preset", Preset, None), ("steps", Steps, None), ("batch_size", BatchSize, None), ("seed", Seed, None),
        ("data", Data, None), ("config", ConfigFile, None), ("sets", Sets, None), ("json_path", JsonPath, None),
        ("quiet", Quiet, False))
]


def with_run_options(command: F) -> F:
    """Give a command the shared run options, handed to it as one ``opts: RunOptions`` argument."""
    signature = inspect.signature(command, eval_str=True)
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values() if p.name != "opts"]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        opts = RunOptions(**{p.name: kwargs.pop(p.name) for p in _RUN_PARAMETERS})
        return command(opts=opts, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*_RUN_PARAMETERS, *own])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {}  # Typer reads the annotations from the signature above
    return wrapper  # type: ignore[return-value]


def invoked_as(argv: list[str], group: str, command: str) -> bool:
    """Whether this process's command line is ``parallax [global options] GROUP COMMAND ...`` (re-runnable)."""
    return any(argv[i:i + 2] == [group, command] for i in range(1, len(argv) - 1))


def supervise_or_continue(group: str, supervised_by: int | None, no_supervise: bool) -> None:
    """Re-run this command in a session of its own under this process (``node/peer/processes.py`` says why) and exit
    with its code, unless told not to or not started from a command line (``CliRunner``); in the supervised
    child, arrange to die with the supervisor. Returns when this process should do the work itself.

    Raises:
        typer.Exit: always in the supervisor (the child's exit code), and in a child whose supervisor is gone.
    """
    import os
    import sys

    from parallax.node.peer.processes import die_with_parent, python_cli, supervise

    if supervised_by is None and not no_supervise and invoked_as(sys.argv, group, "join"):
        raise typer.Exit(supervise(python_cli(*sys.argv[1:], "--supervised-by", str(os.getpid()))))
    if supervised_by is not None:
        try:
            die_with_parent(supervised_by)
        except ProcessLookupError as e:
            raise typer.Exit(1) from e
