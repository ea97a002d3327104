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

An import is the other place where a raising handler does harm. A module's code runs inside the import system
and inside C extensions that call back into Python: an exception raised there can be swallowed (CPython's
compiling a module's source, a library's ``except ImportError`` after numpy turned it into one), and then the
stop never happens; or it crosses a C++ frame that cannot pass it on, and the process aborts (torch's
``_c10d_init``: "terminate called after throwing an instance of 'pybind11::error_already_set'"). Commands import
their heavy modules late, so this is a moment of every start-up. ``after_imports`` wraps a raising handler: a
signal that lands while the main thread imports is handed to the handler again once the import has ended.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
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


Handler = Callable[[int, FrameType | None], Any]

POLL_S = 0.02
"""How often the main thread is looked at while a signal waits for its import to end."""

_postponed: list[int] = []
"""Signals that landed inside an import, in order, until they are handed over again (appended by the main
thread's handler, taken by the deliverer thread: list operations are atomic)."""
_wake = threading.Event()
_deliverer: threading.Thread | None = None


def after_imports(handler: Handler) -> Handler:
    """``handler`` for ``signal.signal``, except that a signal landing while the main thread imports a module
    is handed to it again once the import has ended (the module docstring). A second signal while one waits is
    handled at once: whoever presses Ctrl+C twice does not wait for an import that may never end."""

    @functools.wraps(handler)
    def handle(signum: int, frame: FrameType | None) -> Any:
        if _postpone(signum, frame):
            return None
        return handler(signum, frame)

    return handle


def waiting_for_import() -> bool:
    """Whether a signal waits for the main thread's import to end."""
    return bool(_postponed)


def importing(frame: FrameType | None) -> bool:
    """Whether the thread at ``frame`` is inside an import: the import system's own frames are on its stack."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _postpone(signum: int, frame: FrameType | None) -> bool:
    global _deliverer
    if _postponed or not importing(frame):
        return False
    _postponed.append(signum)
    _wake.set()
    if _deliverer is None:
        _deliverer = threading.Thread(target=_deliver, name="parallax-signal-after-import", daemon=True)
        _deliverer.start()
    return True


def _deliver() -> None:
    main = threading.main_thread().ident
    assert main is not None
    while True:
        _wake.wait()
        _wake.clear()
        while _postponed:
            while importing(sys._current_frames().get(main)):
                time.sleep(POLL_S)
            # The handler runs at the main thread's next bytecode; until this one is taken off the list, it is
            # handled there even if another import has begun meanwhile.
            signal.pthread_kill(main, _postponed[0])
            _postponed.pop(0)


def _in_forked_child() -> None:
    global _previous, _deliverer
    _postponed.clear()  # the parent's to deliver; the child has no deliverer thread
    _wake.clear()
    _deliverer = None
    if _previous is None:
        return
    previous, _previous = _previous, None
    for s, handler in previous.items():
        signal.signal(s, handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


os.register_at_fork(after_in_child=_in_forked_child)
