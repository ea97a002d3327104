"""Log lines while a live display holds the terminal: rendered on an emulated terminal (pyte), the display is
drawn once, below the log lines, however many lines came while it was up."""

from __future__ import annotations

import contextlib
import io
import logging

import pyte
from rich.console import Console
from rich.live import Live
from rich.table import Table

from parallax.cli.progress import logs_through

COLUMNS, LINES = 100, 40


def _screen_after(route: bool) -> list[str]:
    """The emulated terminal's lines after 60 log lines and 60 redraws of a live table."""
    terminal = io.StringIO()
    console = Console(file=terminal, width=COLUMNS, height=LINES, force_terminal=True, color_system=None)
    root, plain = logging.getLogger(), logging.StreamHandler(terminal)  # as basicConfig's, on the same terminal
    level = root.level
    root.addHandler(plain)
    root.setLevel(logging.INFO)
    try:
        routed = logs_through(console) if route else contextlib.nullcontext()
        with routed, Live(console=console, auto_refresh=False) as live:
            for i in range(60):
                logging.getLogger("parallax.test").info("line %d", i)
                table = Table(title="the node")
                table.add_column("step")
                table.add_row(str(i))
                live.update(table, refresh=True)
        assert plain in root.handlers  # given back
    finally:
        root.removeHandler(plain)
        root.setLevel(level)
    screen = pyte.Screen(COLUMNS, LINES)
    pyte.Stream(screen).feed(terminal.getvalue().replace("\n", "\r\n"))
    return [line.rstrip() for line in screen.display]


def test_log_lines_go_above_the_live_table_which_is_drawn_once() -> None:
    screen = _screen_after(route=True)
    titles = [i for i, line in enumerate(screen) if "the node" in line]
    assert len(titles) == 1, "\n".join(screen)
    logged = [i for i, line in enumerate(screen) if "line 59" in line]
    assert logged and logged[0] < titles[0], "\n".join(screen)


def test_without_routing_the_terminal_shows_stale_copies_of_the_table() -> None:
    # What the routing prevents: the same lines, written to the terminal behind the display's back.
    screen = _screen_after(route=False)
    assert sum("the node" in line for line in screen) > 1, "\n".join(screen)


def test_without_a_terminal_progress_is_plain_lines_as_the_run_goes() -> None:
    from parallax.cli.progress import LINES_PER_RUN, run_progress

    out = io.StringIO()
    console = Console(file=out, width=200)  # a log file: no terminal
    with run_progress(100, console=console) as update:
        assert update is not None
        for step in range(1, 101):
            update("parallax", step, 3.0 - step / 100)
            if step == 50:
                assert "parallax: step 50 of 100, loss 2.500" in out.getvalue()  # written as it goes
    lines = out.getvalue().splitlines()
    assert len(lines) == LINES_PER_RUN and lines[-1].startswith("parallax: step 100 of 100, loss 2.000")
    assert "\x1b" not in out.getvalue()  # no control sequences in a file
