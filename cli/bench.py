"""``parallax bench ...``: the measured comparisons. Each command writes JSON and a markdown summary."""

from __future__ import annotations

import typer

bench_app = typer.Typer(help="Benchmarks: each writes JSON (--json) and prints a markdown table.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
