"""The ``parallax`` console script: Ctrl+C or SIGTERM ends a command cleanly (exit 130, one line), also while it
is still importing, not with a traceback or click's "Aborted!"; ``finally`` blocks run on the way out. Commands
that run a peer replace these handlers with their own (``node.peer.processes.install_signal_handlers``)."""

from __future__ import annotations

import signal
import sys
from typing import Any


class Interrupted(BaseException):
    """A signal to a command that installed no handlers of its own (a BaseException: click lets it through)."""


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
        sys.stderr.write(f"stopped by signal {e.args[0]}\n")
        sys.exit(130)
