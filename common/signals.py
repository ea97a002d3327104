"""Signal handlers that stop a command by raising, kept from raising where the stop would be lost.

A command's stop is an exception its signal handler raises in the main thread, at whatever bytecode that thread
runs next. Three kinds of place do not pass it on.

A fork: the next bytecodes are the at-fork callbacks (logging's, which releases the logging lock it took for
the fork): an exception raised there is reported as "Exception ignored" and dropped, and the logging lock stays
held, so every other thread that logs waits forever. A node stopped that way during start-up hangs with its DHT
half started. ``signals_deferred`` runs a block (a fork) with handlers that only remember SIGINT and SIGTERM,
then puts the previous handlers back and hands each remembered signal to them, in ordinary code where the
exception propagates. A process forked inside starts with the previous handlers, except that it ignores SIGINT:
Ctrl+C reaches the whole process group, and the parent decides when its children stop (hivemind's DHT and
averager processes ignore it too).

An import: a module's code runs inside the import system and inside C extensions that call back into Python; an
exception raised there can be swallowed (CPython's compiling a module's source, a library's ``except
ImportError`` after numpy turned it into one), and then the stop never happens; or it crosses a C++ frame that
cannot pass it on, and the process aborts (torch's ``_c10d_init``: "terminate called after throwing an instance
of 'pybind11::error_already_set'"). Commands import their heavy modules late, so this is a moment of every
start-up. ``raising_safely`` wraps a raising handler: a signal that lands while the main thread imports is
handed to the handler again once the import has ended.

Anywhere Python can only report an exception and go on ("Exception ignored in ...": a finaliser, a callback
from an extension that has no way to pass it on). ``raising_safely`` marks what its handler raised, and a hook on
such reports raises that stop again at the main thread's next bytecode.
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
"""Signals to send the main thread again once it imports nothing, in order, until they are sent (appended by the main
thread's handler, taken by the deliverer thread: list operations are atomic)."""
_wake = threading.Event()
_deliverer: threading.Thread | None = None


def raising_safely(handler: Handler) -> Handler:
    """``handler``, which stops the command by raising, for ``signal.signal``: a signal that lands while the main
    thread imports a module is handed to it again once the import has ended, and a stop it raised where Python
    can only report it ("Exception ignored in ...": a finaliser, an extension's callback) is raised again at the
    main thread's next bytecode (the module docstring). A second signal while one waits is handled at once:
    whoever presses Ctrl+C twice does not wait for an import that may never end."""
    global _hook_installed
    if not _hook_installed:
        _hook_installed = True
        previous_hook = sys.unraisablehook

        def dropped(unraisable: Any) -> None:
            signum = getattr(unraisable.exc_value, _RAISED_FOR, None)
            if signum is None or threading.current_thread() is not threading.main_thread():
                previous_hook(unraisable)
                return
            _in_hook.append(True)
            try:
                _raise_again(signum, unraisable.exc_value)
            finally:
                _in_hook.pop()

        sys.unraisablehook = dropped
        _start_deliverer()  # now, in ordinary code: a thread started from a handler or the hook could take its stop

    @functools.wraps(handler)
    def handle(signum: int, frame: FrameType | None) -> Any:
        if _postpone(signum, frame):
            return None
        try:
            return handler(signum, frame)
        except BaseException as stop:
            setattr(stop, _RAISED_FOR, signum)  # for the hook, should it be dropped
            raise

    return handle


_RAISED_FOR = "parallax_raised_for_signal"
_hook_installed = False
_in_hook: list[bool] = []
"""Non-empty while the hook runs: a stop raised there would be dropped for good."""


def _raise_again(signum: int, stop: BaseException) -> None:
    """In the main thread: ``stop`` was dropped; raise it again there once the signal is sent to it anew."""
    current = signal.getsignal(signum)

    def again(_signum: int, _frame: FrameType | None) -> None:
        if _in_hook:
            _send_after_imports(signum)  # still inside the hook: once more, later
            return
        signal.signal(signum, signal.SIG_DFL if current is None else current)
        raise stop

    signal.signal(signum, raising_safely(again))
    _send_after_imports(signum)


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
    if _postponed or not importing(frame):
        return False
    _send_after_imports(signum)
    return True


def _send_after_imports(signum: int) -> None:
    _start_deliverer()  # started already, except in a forked child
    _postponed.append(signum)
    _wake.set()


def _start_deliverer() -> None:
    global _deliverer
    if _deliverer is None:
        _deliverer = threading.Thread(target=_deliver, name="parallax-signal-deliverer", daemon=True)
        _deliverer.start()


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
    global _previous, _deliverer, _wake
    # The parent's to deliver; the child has no deliverer thread, and a lock it held at the fork stays held here.
    _postponed.clear()
    _wake = threading.Event()
    _deliverer = None
    if _previous is None:
        return
    previous, _previous = _previous, None
    for s, handler in previous.items():
        signal.signal(s, handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


os.register_at_fork(after_in_child=_in_forked_child)
