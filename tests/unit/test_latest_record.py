"""``records.LatestRecord``: a node's record stored one value at a time, the latest last."""

from __future__ import annotations

import threading

from parallax.dht.testing import wait_until
from parallax.node.outer.records import LatestRecord


class _Store:
    """Records what is stored; the first store waits for ``release``."""

    def __init__(self) -> None:
        self.stored: list[bytes] = []
        self.began = threading.Event()
        self.release = threading.Event()

    def __call__(self, value: bytes) -> bool:
        self.began.set()
        assert self.release.wait(30)
        self.stored.append(value)
        return True


def test_values_put_while_a_store_runs_go_out_after_it_and_only_the_latest_of_them() -> None:
    store = _Store()
    record = LatestRecord(store, "test")
    try:
        record.put(b"announce")
        record.flush(wait=False)
        assert store.began.wait(30)
        for value in (b"root", b"fingerprint"):  # both before the first store ends: the root is never stored alone
            record.put(value)
            record.flush(wait=False)
        assert store.stored == []
        store.release.set()
        wait_until(lambda: len(store.stored) == 2, timeout=30)
        assert store.stored == [b"announce", b"fingerprint"]
    finally:
        record.close()


def test_a_store_waited_for_returns_once_its_value_is_stored_after_the_one_in_flight() -> None:
    store = _Store()
    record = LatestRecord(store, "test")
    returned = threading.Event()

    def publish() -> None:
        record.put(b"withdrawn")
        record.flush()
        returned.set()

    try:
        record.put(b"announce")
        record.flush(wait=False)
        assert store.began.wait(30)
        waiter = threading.Thread(target=publish)
        waiter.start()
        assert not returned.wait(0.2)  # the store in flight holds it
        store.release.set()
        waiter.join(30)
        assert returned.is_set() and store.stored == [b"announce", b"withdrawn"]
    finally:
        record.close()


def test_a_value_put_after_closing_is_stored_at_once() -> None:
    """A round still running as its node shuts down publishes its step: the store is made in its own thread."""
    stored: list[bytes] = []
    record = LatestRecord(lambda value: stored.append(value) is None, "test")
    record.close()
    record.put(b"root")
    record.flush(wait=False)
    assert stored == [b"root"]
