"""The ``parallax`` console script: Ctrl+C or SIGTERM ends a command cleanly (exit 130, one line), also while it
is still importing, not with a traceback or click's "Aborted!"; ``finally`` blocks run on the way out. Commands
that run a peer replace these handlers with their own (``node.peer.processes.install_signal_handlers``).

While the command's modules import, a signal ends the process at once (``os._exit``): nothing has started yet,
and an exception raised in the middle of an import can leave a half-imported module behind (numpy's lazy
submodules then recurse until a ``RecursionError``, exit 1, instead of the clean 130). Once the command runs, the
modules it imports late (torch and hivemind, inside the command) are imported whole: a signal that lands inside
such an import raises ``Interrupted`` once the import has ended (``parallax.signals.raising_safely``: raised inside,
it may be swallowed, or abort the process from a C++ frame), and one that Python drops where it cannot pass it on
is raised again. Should an error stand in for it all the same, after a signal any error ends the command as the
signal does.

Python runs a signal handler only between bytecodes, so a command inside one long native call (a matrix product
of a large model's step on the CPU: tens of seconds) would not see Ctrl+C or SIGTERM until it returns. A
watchdog thread hears the signal at once (``signal.set_wakeup_fd``); if the handler has not run ``STUCK_S``
seconds later (or ``IMPORT_S`` while it waits for an import), it ends the process itself (exit 130, one line
saying why). It stands down for commands that installed handlers of their own (a peer's graceful leave takes its
time)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from parallax.signals import Handler, raising_safely, waiting_for_import

STUCK_S = 5.0
"""Seconds a signal may wait for its handler before the watchdog ends the process."""
IMPORT_S = 60.0
"""Seconds a signal may wait for an import to end (``raising_safely``): on a loaded machine, importing torch
takes several seconds; an import that is still running after this is taken for stuck."""


class Interrupted(BaseException):
    """A signal to a command that installed no handlers of its own (a BaseException: click lets it through)."""


_handled = threading.Event()
_signals: list[int] = []
"""The signals ``_interrupt`` raised ``Interrupted`` for."""


def _raise_interrupted(signum: int, _frame: Any) -> None:
    _signals.append(signum)
    _handled.set()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)  # a second signal ends the process even if stuck in native code
    raise Interrupted(signum)


_interrupt: Handler | None = None
"""``_raise_interrupted``, made safe to raise (``guard_signals``)."""


def guard_signals() -> None:
    """Ctrl+C and SIGTERM raise ``Interrupted`` in the main thread, and end the process within ``STUCK_S`` seconds
    when the main thread is inside a native call that does not return (the module docstring)."""
    global _interrupt
    _interrupt = raising_safely(_raise_interrupted)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _interrupt)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    # A forked child (hivemind's DHT process) would otherwise write its own signals into this pipe, and the
    # watchdog would end this process for a signal it never received.
    os.register_at_fork(after_in_child=_no_wakeup_fd)
    threading.Thread(target=_watch, args=(read,), name="parallax-signal-watchdog", daemon=True).start()


def _no_wakeup_fd() -> None:
    with contextlib.suppress(ValueError):  # not the main thread: Python then has no wakeup fd to reset
        signal.set_wakeup_fd(-1)


def _watch(read: int) -> None:
    while True:
        for signum in os.read(read, 64):
            if signal.getsignal(signum) is not _interrupt:
                continue  # not ours to act on: the command handles its signals itself, or it is another one
            give_up = time.monotonic() + IMPORT_S
            while not _handled.wait(STUCK_S):
                if not waiting_for_import() or time.monotonic() > give_up:
                    os.write(2, f"stopped by signal {signum} inside a computation or an import that does not "
                                "return; ended without waiting for it\n".encode())
                    os._exit(130)
            return


def _while_importing(signum: int, _frame: Any) -> None:
    os.write(2, f"stopped by signal {signum}\n".encode())
    os._exit(130)


def run() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _while_importing)
    from parallax.cli.main import app

    try:
        guard_signals()  # inside: a signal right after its handler is installed is a clean 130 too
        app()
    except Interrupted as e:
        sys.stderr.write(f"stopped by signal {e.args[0]}\n")
        _exit(130)
    except SystemExit as e:
        _exit(e.code)
    except Exception:
        # ``Interrupted`` raised inside a C extension's import comes out as another error (numpy turns it into
        # "ImportError: numpy._core.multiarray failed to import"): after a signal, any error is the signal's.
        if not _signals:
            raise
        sys.stderr.write(f"stopped by signal {_signals[0]}\n")
        _exit(130)
    _exit(0)


def _exit(code: int | str | None) -> None:
    """End the process once the command is done: its own ``finally`` blocks and ``with`` exits have run (the
    peer, its DHT process and p2pd stopped, files closed); the atexit handlers run and the streams are flushed,
    but the interpreter's teardown of every module and object (torch's included) is skipped. That teardown does
    nothing a finished command needs and takes seconds of CPU, so on a loaded machine a command that printed its
    answer would linger for many seconds before a script reading its output saw it end."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        sys.stderr.write(f"{code}\n")
        status = 1
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be said
            stream.flush()
    os._exit(status)
