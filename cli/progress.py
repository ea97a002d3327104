"""Rich progress for simulator runs (shared by ``parallax sim`` and ``parallax bench quality``), and log lines
that live displays survive."""

from __future__ import annotations

import logging
import time
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


LINES_PER_RUN = 20
"""Plain progress lines per run where there is no terminal to draw bars on (a log file, a pipe)."""


@contextmanager
def run_progress(total_steps: int, *, enabled: bool = True,
                 console: Console | None = None) -> Iterator[ProgressFn | None]:
    """Yield a progress callback that draws one bar per run (loss shown) on a terminal, or writes a plain line
    every ``total_steps / LINES_PER_RUN`` steps elsewhere (a log file shows the run as it goes, not only at its
    end); None when disabled."""
    if not enabled:
        yield None
        return
    console = console or Console()
    if not console.is_terminal:
        yield _plain_lines(console, total_steps)
        return
    columns = (TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False, console=console) as bar:
        tasks: dict[str, TaskID] = {}

        def update(name: str, step: int, loss: float) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total_steps, loss="-")
            bar.update(tasks[name], completed=step, loss=f"{loss:.3f}")

        yield update


def _plain_lines(console: Console, total_steps: int) -> ProgressFn:
    every = max(1, total_steps // LINES_PER_RUN)
    started: dict[str, float] = {}

    def update(name: str, step: int, loss: float) -> None:
        now = time.monotonic()
        began = started.setdefault(name, now)
        if step % every and step != total_steps:
            return
        pace = step / (now - began) if now > began else 0.0
        left = f", about {(total_steps - step) / pace / 60:.0f} min left" if pace > 0 and step < total_steps else ""
        console.print(f"{name}: step {step} of {total_steps}, loss {loss:.3f}, {now - began:.0f} s{left}",
                      highlight=False, soft_wrap=True)
        console.file.flush()

    return update


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
