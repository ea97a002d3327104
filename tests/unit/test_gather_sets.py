"""Which set of contributions a gathered round merges when its peers merged different ones (pure: the rounds
records as data, no network)."""

from __future__ import annotations

from parallax.node.outer.gathered import _better_set
from parallax.node.outer.transport import RoundEntry, pair

PEERS = ("A", "B", "C", "D")
MINE = pair("A", 4)


def _entry(peer: str, n: int, merged: tuple[str, ...]) -> dict[int, RoundEntry]:
    return {n: RoundEntry(n, bytes(32), 100, 1.0, fingerprint=b"fp", participants=merged)}


def _names(*peers: str) -> tuple[str, ...]:
    rounds = {"A": 4, "B": 3, "C": 6, "D": 5}
    return tuple(sorted(pair(p, rounds[p]) for p in peers))


def test_a_set_its_senders_already_verified_is_taken_over_one_that_cannot_verify() -> None:
    """A and B merged all four contributions; C and D merged A's, C's and D's, which verified among them (two of
    its three senders). A's set can reach no majority any more (C and D applied theirs): A takes theirs, even
    though as many peers merged A's (a tie kept A's set before, and the round was lost at A)."""
    everyone, theirs = _names(*PEERS), _names("A", "C", "D")
    entries = {"B": _entry("B", 3, everyone), "C": _entry("C", 6, theirs), "D": _entry("D", 5, theirs)}
    assert _better_set(entries, MINE, everyone, lambda _p: True, quorum=3) == theirs


def test_without_a_final_set_only_a_clearly_better_supported_one_is_taken() -> None:
    everyone, other = _names(*PEERS), _names("A", "B", "C")
    # One other peer each: a tie is no reason to switch, and no set is final (1 of 4, 1 of 3).
    entries = {"B": _entry("B", 3, everyone), "C": _entry("C", 6, other)}
    assert _better_set(entries, MINE, everyone, lambda _p: True, quorum=3) is None
    # A set that one more peer merged than ours (with our own vote) is taken.
    entries = {"B": _entry("B", 3, other), "C": _entry("C", 6, other)}
    assert _better_set(entries, MINE, everyone, lambda _p: True, quorum=3) == other


def test_a_final_set_of_a_banned_or_absent_peer_or_below_the_quorum_is_not_taken() -> None:
    everyone, theirs = _names(*PEERS), _names("A", "C", "D")
    entries = {"C": _entry("C", 6, theirs), "D": _entry("D", 5, theirs)}
    assert _better_set(entries, MINE, everyone, lambda p: p != "D", quorum=3) is None
    assert _better_set(entries, MINE, everyone, lambda _p: True, quorum=4) is None
