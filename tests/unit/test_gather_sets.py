"""Which set of contributions a gathered round merges when its peers merged different ones (pure: the rounds
records as data, no network)."""

from __future__ import annotations

import threading

from parallax.node.outer.gathered import _better_set, _may_yet_agree, _moved_on
from parallax.node.outer.transport import WITHDRAWN, RoundEntry, decode_entries, encode_record, pair
from parallax.node.outer.wire import encode_fingerprint, round_tag

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


def test_a_sender_has_moved_on_only_once_its_vote_on_that_contribution_is_final() -> None:
    """B's contribution of round 3 is in our set. B's vote on our set is never coming once B withdrew it, or merged
    it in another set and published a later round; while B is still verifying another set it may switch to ours,
    and a fingerprint for our set is a vote, not a refusal."""
    ours, theirs = round_tag(0, _names(*PEERS)), round_tag(0, _names("B", "C", "D"))
    fp = (1.0, 2.0, 3.0, 4.0)

    def record(*entries: RoundEntry) -> dict[int, RoundEntry]:  # as the sender's record reads back
        return decode_entries(encode_record(list(entries)))

    def merged(n: int, tag: bytes) -> RoundEntry:
        return RoundEntry(n, bytes(32), 100, 1.0, fingerprint=encode_fingerprint(fp, tag), participants=("x@1",))

    b3 = pair("B", 3)
    later = RoundEntry(4, bytes(32), 100, 1.0)
    assert _moved_on(b3, record(merged(3, theirs), later), ours)
    assert _moved_on(b3, record(RoundEntry(3, bytes(32), 100, 1.0, fingerprint=WITHDRAWN)), ours)
    assert not _moved_on(b3, record(merged(3, theirs)), ours)  # still verifying: it may take ours
    assert not _moved_on(b3, record(merged(3, ours), later), ours)  # it merged ours: a vote
    assert not _moved_on(b3, record(RoundEntry(3, bytes(32), 100, 1.0), later), ours)  # open: not merged yet
    assert not _moved_on(b3, record(later), ours)  # round 3 left its record: unknown


def test_a_verification_waits_on_while_enough_senders_still_gather_to_make_a_majority() -> None:
    """A merged all four and agrees with itself. While B and C still gather (their contributions on offer, unmerged)
    a majority may come; once C went on to a later round, or B merged another set, or A's round is told to end, it
    cannot (D's vote never came)."""
    everyone, due = _names(*PEERS), threading.Event()
    gathering = {"B": {3: RoundEntry(3, bytes(32), 100, 1.0)}, "C": {6: RoundEntry(6, bytes(32), 100, 1.0)}}
    assert _may_yet_agree(1, gathering, participants=everyone, due=due)
    went_on = {**gathering, "C": {6: RoundEntry(6, bytes(32), 100, 1.0), 7: RoundEntry(7, bytes(32), 100, 1.0)}}
    assert not _may_yet_agree(1, went_on, participants=everyone, due=due)
    merged_elsewhere = {**gathering, "B": _entry("B", 3, _names("A", "B", "C"))}
    assert not _may_yet_agree(1, merged_elsewhere, participants=everyone, due=due)
    assert _may_yet_agree(2, merged_elsewhere, participants=everyone, due=due)  # B agreed: B and C make three
    due.set()
    assert not _may_yet_agree(1, gathering, participants=everyone, due=due)
