"""``parallax sim``: C composers in one process, no network (filled in by the core issue)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    del app
