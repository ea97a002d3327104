"""A node's fetches of contributions (``gathered._Flights``, pure: a fake fetch, no network): each claim fetched
once while it is on offer, a new claim of the same name fetched anew, ended fetches forgotten when told."""

from __future__ import annotations

import threading

import torch

from parallax.node.outer.gathered import Fetched, _Flights
from parallax.node.outer.transport import RoundEntry


def test_a_claim_is_fetched_once_a_new_claim_of_its_name_anew_and_a_failed_fetch_again() -> None:
    calls: list[tuple[str, bytes]] = []
    failing = threading.Event()

    def fetch(name: str, entry: RoundEntry) -> Fetched | None:
        calls.append((name, entry.digest))
        return None if failing.is_set() else Fetched({"w": torch.zeros(2)}, 1.0, entry.base)

    flights = _Flights(fetch, "test")
    try:
        first = RoundEntry(3, bytes(32), 10, 1.0, session=1)
        restarted = RoundEntry(3, bytes([1] * 32), 10, 1.0, session=2)
        found: dict[str, Fetched] = {}
        flights.take(flights.start([("B@3", first)]), found, 5.0, every=True)
        flights.take(flights.start([("B@3", first)]), found, 5.0, every=True)  # a later pass or round
        assert calls == [("B@3", bytes(32))] and "B@3" in found
        flights.take(flights.start([("B@3", restarted)]), {}, 5.0, every=True)  # its sender claimed it again
        assert calls[-1] == ("B@3", bytes([1] * 32)) and len(calls) == 2
        failing.set()
        flights.take(flights.start([("C@1", first)]), {}, 5.0, every=True)
        flights.take(flights.start([("C@1", first)]), {}, 5.0, every=True)  # a failed fetch is started again
        assert [name for name, _ in calls].count("C@1") == 2
        flights.forget({"B@3"}.__contains__)
        failing.clear()
        flights.take(flights.start([("B@3", restarted)]), {}, 5.0, every=True)  # forgotten: fetched again
        assert len(calls) == 5
    finally:
        flights.close()
