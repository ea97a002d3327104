"""The ``parallax`` console script: Ctrl+C or SIGTERM ends a command cleanly (exit 130, one line), also while it
is still importing, not with a traceback or click's "Aborted!"; ``finally`` blocks run on the way out. Commands
that run a peer replace these handlers with their own (``node.peer.processes.install_signal_handlers``).

While the command's modules import, a signal ends the process at once (``os._exit``): nothing has started yet,
and an exception raised in the middle of an import can leave a half-imported module behind (numpy's lazy
submodules then recurse until a ``RecursionError``, exit 1, instead of the clean 130)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


class Interrupted(BaseException):
    """A signal to a command that installed no handlers of its own (a BaseException: click lets it through)."""


def _interrupt(signum: int, _frame: Any) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)  # a second signal ends the process even if stuck in native code
    raise Interrupted(signum)


def _while_importing(signum: int, _frame: Any) -> None:
    os.write(2, f"stopped by signal {signum}\n".encode())
    os._exit(130)


def run() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _while_importing)
    from parallax.cli.main import app

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _interrupt)
    try:
        app()
    except Interrupted as e:
        sys.stderr.write(f"stopped by signal {e.args[0]}\n")
        sys.exit(130)
