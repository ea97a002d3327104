"""Rich progress for simulator runs (shared by ``parallax sim`` and ``parallax bench quality``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

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
