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
