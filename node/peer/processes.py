"""Child processes in their own session: start, signal, stop and supervise them, ending only our own.

A node is a tree of processes: the Python main process, hivemind's forked DHT and averager processes,
and the p2pd daemon the DHT spawns (through libuv, which resets every signal to its default in the
child). A signal sent to the whole process group — Ctrl+C in a terminal — would end p2pd at once and
leave the node's graceful leave (final snapshots, deathrattle) with no network. So a node runs in a
session of its own and is signalled by PID: by ``LocalSwarm`` in tests and ``parallax swarm local``,
and by ``supervise`` when a volunteer runs ``parallax node join`` in a terminal. Whatever of a child's
session is left after it (its daemons, when it died the hard way) is SIGKILLed by group.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any, Protocol

from parallax.signals import raising_safely

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class Stoppable(Protocol):
    def stop(self) -> None: ...

    @property
    def starting(self) -> bool:
        """True until the process is up (its network started, training or serving begun)."""
        ...


def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None, stdout: IO[Any] | int | None = None,
          stdin: IO[Any] | int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new session (its pid is its process group's id)."""
    return subprocess.Popen(list(argv), stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None,
                            stdin=stdin, start_new_session=True, env=dict(env) if env is not None else None)


def send(p: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the child itself (not its group), if it still runs."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


def kill_group(p: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signal every process left in the child's session (the child led it: its pid is the group id)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def stop(p: subprocess.Popen[bytes], timeout_s: float, *, interrupt: bool = True) -> int | None:
    """SIGINT (unless sent already), wait; SIGTERM, wait; SIGKILL the group. Returns the exit code."""
    steps = ([(signal.SIGINT, timeout_s)] if interrupt else [(None, timeout_s)]) + [(signal.SIGTERM, 10.0)]
    for sig, wait_s in steps:
        if sig is not None:
            send(p, sig)
        try:
            return p.wait(wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("process %d did not exit within %.0f s", p.pid, wait_s)
    kill_group(p)
    try:
        return p.wait(10)
    except subprocess.TimeoutExpired:
        return None


def supervise(argv: Sequence[str]) -> int:
    """Run ``argv`` in its own session and relay SIGINT/SIGTERM to it alone; returns its exit code.

    The first two signals are passed on (the node leaves gracefully, then stops at once); a third
    SIGKILLs the child's session. The child learns of our death through ``die_with_parent``. When the
    child did not exit cleanly, what is left of its session (p2pd, hivemind's children) is SIGKILLed.
    A child that died of a signal ends as a shell reports it: 130 for SIGINT or SIGTERM (a relayed Ctrl+C that
    came before the child's interpreter set its handlers, as a command stopped while importing exits), else
    128 + the signal's number.
    """
    child = spawn(argv, stdin=None)
    received = [0]

    def relay(signum: int, _frame: Any) -> None:
        received[0] += 1
        if received[0] <= 2:
            send(child, signum)
        else:
            kill_group(child)

    previous = {s: signal.signal(s, relay) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code: int | None = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:
            code = stop(child, 30.0)
    if code != 0:
        kill_group(child)
    if code is None:
        return 1
    if code < 0:
        sys.stderr.write(f"stopped by signal {-code}\n")
        return 130 if -code in (signal.SIGINT, signal.SIGTERM) else 128 - code
    return code


def die_with_parent(expected_parent: int) -> None:
    """Leave gracefully when our parent (a ``supervise`` process) dies, however it died: Linux then sends us SIGHUP
    (``PR_SET_PDEATHSIG``), which this turns into one SIGTERM to ourselves, the signal of a graceful leave. Linux sends
    it each time the parent's thread we hang from exits and we pass to another of its threads, so the death of a
    supervisor with several threads delivers it more than once: only the first counts (a second SIGTERM would stop
    the node without its graceful leave). Processes forked from us ignore it. Elsewhere (no prctl) a no-op.

    Raises:
        ProcessLookupError: the parent died before we could ask (we were re-parented already).
    """
    if sys.platform.startswith("linux"):
        owner, heard = os.getpid(), [False]

        def parent_gone(_signum: int, _frame: Any) -> None:
            if os.getpid() == owner and not heard[0]:
                heard[0] = True
                os.kill(owner, signal.SIGTERM)

        signal.signal(signal.SIGHUP, parent_gone)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGHUP))
    if os.getppid() != expected_parent:
        raise ProcessLookupError(f"the supervising process {expected_parent} is gone")


class ForcedStop(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: the node skips what is left of its graceful leave (rounds in flight, final
    snapshots); ``Node.run``'s ``close()`` still publishes the deathrattle and stops every child process."""


def install_signal_handlers(node: Stoppable) -> dict[int, Any]:
    """SIGINT/SIGTERM: the first asks ``node`` to leave gracefully after its step, the second raises
    ``ForcedStop`` in the main thread (a fast but clean shutdown), a third is left to the default handler.
    While ``node.starting``, there is nothing to leave yet: the first signal raises ``ForcedStop`` at once,
    interrupting whatever start-up waits on (a DHT bootstrap, a state download), and the next one meets the
    default handler (the process dies even if start-up is stuck in native code).

    hivemind's forked children (the DHT and averager processes) inherit this handler: they ignore SIGINT
    (Ctrl+C in a terminal reaches the whole process group and must not kill them under the parent's
    leave; hivemind ignores it there too) and die of SIGTERM, which is how hivemind's own shutdown stops
    them the hard way. A SIGTERM sent to the whole group (systemd's default KillMode=control-group) also
    ends p2pd at once, so the leave cannot reach peers: run units with KillMode=mixed (docs/architecture.md).
    """
    owner = os.getpid()
    signals = (signal.SIGINT, signal.SIGTERM)
    received = [0]

    def handler(signum: int, _frame: Any) -> None:
        if os.getpid() != owner:
            if signum == signal.SIGTERM:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        received[0] += 1
        if received[0] == 1 and not node.starting:
            logger.warning("signal %d: leaving after this step (again to stop at once)", signum)
            node.stop()
            return
        node.stop()
        for s in signals:
            signal.signal(s, signal.SIG_DFL)
        if received[0] == 1:
            raise ForcedStop(f"signal {signum} during start-up: stopping")
        raise ForcedStop(f"signal {signum} received twice: stopping without the graceful leave")

    # A stop raised inside an import could be swallowed there, or abort the process from a C++ frame.
    return {s: signal.signal(s, raising_safely(handler)) for s in signals}


def python_cli(*args: str) -> list[str]:
    """The command line that runs ``parallax`` with this interpreter."""
    return [sys.executable, "-m", "parallax.cli", *args]


def lower_thread_priority(steps: int) -> None:
    """Run the calling thread ``steps`` nice steps lower (Linux, where a thread has a nice value of its own; the
    threads it starts later inherit it). Elsewhere, or where the system refuses, it says so and runs on as is."""
    if steps <= 0:
        return
    if not sys.platform.startswith("linux"):
        logger.debug("training runs at the node's priority: per-thread priorities need Linux")
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except OSError as e:
        logger.warning("training runs at the node's priority: lowering it was refused (%s)", e)


__all__ = [
    "ForcedStop",
    "die_with_parent",
    "install_signal_handlers",
    "kill_group",
    "lower_thread_priority",
    "python_cli",
    "send",
    "spawn",
    "stop",
    "supervise",
]

