"""A DHT start after a hivemind process forked from the same parent was SIGKILLed holding the lock that hivemind's
futures share: the lock is replaced, and the start does not wait forever for its process's "ready"."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

from hivemind.utils.mpfuture import MPFuture

from parallax.dht.adapter import DHTConfig, SwarmDHT, recover_hivemind_locks


def _hold_and_sleep(held: object) -> None:
    MPFuture._update_lock.acquire()
    held.set()  # type: ignore[attr-defined]
    time.sleep(600)


def _killed_holding_the_lock() -> None:
    """Fork a process that takes hivemind's result lock, and SIGKILL it while it holds it."""
    context = multiprocessing.get_context("fork")
    held = context.Event()
    holder = context.Process(target=_hold_and_sleep, args=(held,), daemon=True)
    holder.start()
    try:
        assert held.wait(30), "the forked process did not take the lock"
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]  # started above
        holder.join(30)
    assert not MPFuture._update_lock.acquire(timeout=0.2)  # it died holding it


def _start_and_stop() -> float:
    started = time.monotonic()
    dht = SwarmDHT.start(DHTConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), startup_timeout_s=30.0))
    dht.shutdown()
    return time.monotonic() - started


def test_a_lock_left_held_by_a_killed_process_is_replaced_and_the_next_dht_starts() -> None:
    _killed_holding_the_lock()
    assert recover_hivemind_locks(wait_s=0.5) == ["MPFuture._update_lock"]
    assert recover_hivemind_locks(wait_s=0.5) == []  # the new one is free
    _start_and_stop()


def test_a_dht_start_replaces_such_a_lock_itself() -> None:
    _killed_holding_the_lock()
    # The start's own check waits HIVEMIND_LOCK_WAIT_S for the lock, then replaces it; without it the DHT process
    # would block on its first result and the start would fail after its whole bound.
    _start_and_stop()
    assert recover_hivemind_locks(wait_s=0.5) == []
