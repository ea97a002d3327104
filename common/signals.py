"""Ctrl+C and SIGTERM held back while the main thread forks, so that a handler which raises is never lost.

A command's stop is an exception its signal handler raises in the main thread, at whatever bytecode that thread
runs next. Inside a fork, the next bytecodes are the at-fork callbacks (logging's, which releases the logging
lock it took for the fork): an exception raised there is reported as "Exception ignored" and dropped, the stop
never happens, and the logging lock stays held, so every other thread that logs waits forever. A node stopped
that way during start-up hangs with its DHT half started.

``signals_deferred`` runs a block (a fork) with handlers that only remember SIGINT and SIGTERM, then puts the
previous handlers back and hands each remembered signal to them, in ordinary code where the exception
propagates. A process forked inside starts with the previous handlers, except that it ignores SIGINT: Ctrl+C
reaches the whole process group, and the parent decides when its children stop (hivemind's DHT and averager
processes ignore it too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

HELD = (signal.SIGINT, signal.SIGTERM)

_previous: dict[int, Any] | None = None
"""The handlers a ``signals_deferred`` block replaced, while one runs."""


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Run the block with SIGINT and SIGTERM remembered instead of handled; on leaving it (also by an exception),
    the previous handlers are back and receive what came meanwhile. Outside the main thread (where Python runs no
    handler) and inside another such block it changes nothing."""
    global _previous
    if threading.current_thread() is not threading.main_thread() or _previous is not None:
        yield
        return
    received: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for s in HELD:  # a signal before both are in place meets the handler it replaces, as before the block
            before = signal.signal(s, lambda signum, _frame: received.append(signum))
            previous[s] = signal.SIG_DFL if before is None else before  # None: a handler not set from Python
        _previous = previous
        yield
    finally:
        _previous = None
        for held, handler in previous.items():
            signal.signal(held, handler)
        for signum in received:
            signal.raise_signal(signum)  # the handler runs once this returns, here: its exception propagates


def _in_forked_child() -> None:
    global _previous
    if _previous is None:
        return
    previous, _previous = _previous, None
    for s, handler in previous.items():
        signal.signal(s, handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


os.register_at_fork(after_in_child=_in_forked_child)
