"""The ``parallax`` console script: Ctrl+C or SIGTERM while the command is still importing or parsing ends it
cleanly (exit 130, one line), not with a traceback or click's "Aborted!". Commands that run a peer replace
these handlers with their own (``node.peer.processes.install_signal_handlers``)."""

from __future__ import annotations

import signal
import sys
from typing import Any


class Interrupted(BaseException):
    """A signal before the command installed its own handlers (a BaseException: click lets it through)."""


def _interrupt(signum: int, _frame: Any) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)  # a second signal ends the process even if stuck in native code
    raise Interrupted(signum)


def run() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _interrupt)
    try:
        from parallax.cli.main import app

        app()
    except Interrupted as e:
        sys.stderr.write(f"stopped by signal {e.args[0]} before the command was running\n")
        sys.exit(130)
