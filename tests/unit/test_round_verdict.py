"""``RoundRecords.await_majority``: a read that failed decides no verdict; one that succeeded does."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from parallax.node.outer.records import Records, RoundRecords, RoundStatus
from parallax.node.outer.wire import OuterSyncConfig, fingerprint

MINE = fingerprint([torch.ones(8)], [1.0])
OTHER = fingerprint([-torch.ones(8)], [1.0])


def _records(**changes: float) -> RoundRecords:
    dht = SimpleNamespace(peer_id="A")
    return RoundRecords(dht, "run", "router", OuterSyncConfig.loopback(**changes), signer=None)  # type: ignore[arg-type]


def _source(failing_until: float, answers: dict[str, bytes]):  # type: ignore[no-untyped-def]
    """Reads that fail (a DHT read past its bound on a loaded host) until ``failing_until``, then give ``answers``."""
    calls: list[float] = []

    def read(peers: Sequence[str], timeout_s: float) -> Records:
        calls.append(timeout_s)
        if time.monotonic() < failing_until:
            out = Records()
            out.unknown = frozenset(peers)
            return out
        return Records({p: answers[p] for p in peers if p in answers})

    return read, calls


def _fingerprint(_peer: str, record: bytes) -> tuple[float, ...] | None:
    return {b"agrees": MINE, b"other": OTHER}.get(record)


def test_reads_that_fail_past_the_deadline_leave_the_verdict_to_the_first_read_that_succeeds() -> None:
    records = _records()
    deadline = time.monotonic() + 0.1
    source, calls = _source(deadline + 0.5, {"B": b"agrees", "C": b"agrees"})
    status, agreeing, answered, _ = records.await_majority(MINE, ["A", "B", "C"], _fingerprint, deadline=deadline,
                                                           source=source)
    assert (status, agreeing, answered) == (RoundStatus.OK, 3, 3)
    assert max(calls) == records.config.net.dht_timeout_s  # a read past the deadline gets a read's whole bound


def test_a_read_that_succeeds_past_the_deadline_and_finds_too_few_decides_unverified() -> None:
    records = _records()
    source, _ = _source(0.0, {"B": b"agrees"})
    status, agreeing, _, _ = records.await_majority(MINE, ["A", "B", "C", "D", "E"], _fingerprint,
                                                    deadline=time.monotonic() + 0.1, source=source)
    assert (status, agreeing) == (RoundStatus.UNVERIFIED, 2)


def test_reads_that_keep_failing_end_the_wait_a_verification_bound_past_the_deadline() -> None:
    records = _records(verify_timeout_s=0.5)
    deadline = time.monotonic() + 0.1
    source, _ = _source(float("inf"), {})
    status, _, answered, _ = records.await_majority(MINE, ["A", "B", "C"], _fingerprint, deadline=deadline,
                                                    source=source)
    assert (status, answered) == (RoundStatus.UNVERIFIED, 1)
    assert time.monotonic() >= deadline + 0.5


def test_a_failed_read_of_senders_whose_fingerprints_are_in_decides() -> None:
    """B's agreeing and D's other fingerprint came on the first read; reads that then fail for B and D alone (owed
    nothing more) decide: past the deadline the verdict is unverified, not held for the failed reads."""
    records = _records()
    answers = iter([Records({"B": b"agrees", "D": b"other"})])

    def source(peers: Sequence[str], timeout_s: float) -> Records:
        out = next(answers, None)
        if out is None:
            out = Records()
            out.unknown = frozenset({"B", "D"})
        return out

    started = time.monotonic()
    status, _, answered, _ = records.await_majority(MINE, ["A", "B", "C", "D", "E"], _fingerprint,
                                                    deadline=started + 0.1, source=source)
    assert status is RoundStatus.UNVERIFIED
    assert time.monotonic() - started < records.config.net.verify_timeout_s
