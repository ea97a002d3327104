"""Options shared by several commands, declared once (Typer ``Annotated`` style)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Composers = Annotated[
    int, typer.Option("--composers", "-c", min=1, help="Composers C, each with its own expert shard.")
]
Preset = Annotated[str, typer.Option("--preset", help="Model preset: tiny (tests, seconds), small (CPU benchmark).")]
Steps = Annotated[int | None, typer.Option("--steps", min=1, help="Inner steps per composer (default 500).")]
BatchSize = Annotated[
    int | None, typer.Option("--batch-size", min=1, help="Sequences per composer step (default 8).")
]
Seed = Annotated[int, typer.Option("--seed", help="Seed of initialisation and data streams.")]
Data = Annotated[
    str | None, typer.Option("--data", help="Text file, folder or glob (default: built-in tinyshakespeare).")
]
JsonPath = Annotated[
    Path | None, typer.Option("--json", help="Write the result as JSON to this path (and a .md beside it).")
]
Quiet = Annotated[bool, typer.Option("--quiet", help="No progress bars.")]
Sets = Annotated[
    list[str] | None, typer.Option(
        "--set", help="TrainConfig override PATH=VALUE (repeatable), e.g. sync.compression=fp16 or "
        'sync.periods={"router": 25, "latent": 50, "backbone": 100}.')
]


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
