"""Rich progress for simulator runs (shared by ``parallax sim`` and ``parallax bench quality``), and log lines
that live displays survive."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

if TYPE_CHECKING:
    from parallax.node.sim.simulator import ProgressFn


@contextmanager
def run_progress(total_steps: int, *, enabled: bool = True) -> Iterator[ProgressFn | None]:
    """Yield a progress callback that draws one bar per run (loss shown), or None when disabled."""
    if not enabled:
        yield None
        return
    columns = (TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False) as bar:
        tasks: dict[str, TaskID] = {}

        def update(name: str, step: int, loss: float) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total_steps, loss="-")
            bar.update(tasks[name], completed=step, loss=f"{loss:.3f}")

        yield update


@contextmanager
def logs_through(console: Console) -> Iterator[None]:
    """While a live display (a table, progress bars) holds ``console``'s terminal, log records go through
    ``console`` (printed above the display) instead of the root logger's stream handlers, which write to the
    terminal behind the display's back: their lines would be drawn over it and leave stale copies of it behind.
    File handlers and others stay as they are."""
    root = logging.getLogger()
    taken = [h for h in root.handlers if type(h) is logging.StreamHandler]
    handler = RichHandler(console=console, show_path=False, markup=False, log_time_format="%H:%M:%S")
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    handler.setLevel(min((h.level for h in taken), default=logging.NOTSET))
    for h in taken:
        root.removeHandler(h)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        for h in taken:
            root.addHandler(h)
