"""Signed contribution claims and proofs of equivocation (pure: rounds records as bytes, no network)."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from parallax.dht.testing import fixed_identity
from parallax.node.net.scores import Evidence, PeerScores
from parallax.node.outer.transport import RoundEntry, decode_entries, encode_record, record_proofs
from parallax.node.outer.witness import Equivocation, Witness, new_session, sign, signed_by

RUN, GROUP = "run", "router"
LIAR, ACCUSER, OTHER = "12D3KooWLiar", "12D3KooWAccuser", "12D3KooWOther"
KEYS = {LIAR: fixed_identity(1), ACCUSER: fixed_identity(2), OTHER: fixed_identity(3)}


def _claim(peer: str, n: int, digest: int, session: int = 7, *, group: str = GROUP) -> RoundEntry:
    return sign(KEYS[peer], RUN, group, RoundEntry(n, bytes([digest]) * 32, 100, 10.0, session=session))


def _record(*entries: RoundEntry, proofs: tuple[Equivocation, ...] = ()) -> bytes:
    return encode_record(list(entries), [p.to_wire() for p in proofs])


def _witness(scores: PeerScores | None = None) -> Witness:
    return Witness(RUN, GROUP, lambda peer: KEYS[peer].public_key if peer in KEYS else None, scores or PeerScores())


def test_two_claims_of_one_round_and_session_are_proof_that_others_check_and_ban_on() -> None:
    scores = PeerScores(threshold=1e9)  # a proof bans whatever the threshold
    finder = _witness(scores)
    assert not finder.read({LIAR: _record(_claim(LIAR, 3, 1))})
    assert finder.read({LIAR: _record(_claim(LIAR, 3, 2))})  # a new proof: the record goes out again
    assert scores.banned(LIAR) and not finder.read({LIAR: _record(_claim(LIAR, 3, 3))})
    shown = finder.shared()
    assert len(shown) == 1 and Equivocation.from_wire(shown[0]) is not None
    # A peer that saw only one of the claims reads the finder's record and bans the same peer.
    other_scores = PeerScores()
    other = _witness(other_scores)
    assert other.read({ACCUSER: encode_record([], shown)})
    assert other_scores.banned(LIAR)
    assert "two signed contributions for one round" in other_scores.snapshot()[LIAR]["reasons"]
    assert not other.read({ACCUSER: encode_record([], shown)})  # each proof is acted on once


def test_a_claim_seen_again_a_later_session_or_a_stale_copy_is_no_proof() -> None:
    scores = PeerScores()
    witness = _witness(scores)
    first = _claim(LIAR, 3, 1, session=7)
    merged = dataclasses.replace(first, fingerprint=b"fp", participants=(f"{LIAR}@3",))
    assert not witness.read({LIAR: _record(first)}) and not witness.read({LIAR: _record(merged)})
    assert LIAR not in scores.snapshot()
    # A restart from a checkpoint claims rounds again in a new session: weak evidence, once per pair of sessions
    # however many rounds it claims again.
    assert not witness.read({LIAR: _record(_claim(LIAR, 2, 1, session=7))})
    restarted = [_claim(LIAR, 2, 2, session=8), _claim(LIAR, 3, 2, session=8)]
    assert not witness.read({LIAR: _record(*restarted)}) and not witness.read({LIAR: _record(*restarted)})
    assert scores.snapshot()[LIAR]["reasons"] == {Evidence.RESTARTED.reason: 1} and not scores.banned(LIAR)
    # A stale copy of the earlier session: no more evidence, and not fetched.
    assert not witness.read({LIAR: _record(first)})
    assert scores.snapshot()[LIAR]["reasons"] == {Evidence.RESTARTED.reason: 1}
    assert not witness.current(LIAR, first) and witness.current(LIAR, restarted[1])
    assert not scores.banned(LIAR) and witness.shared() == []


def test_a_sender_that_starts_a_session_for_each_round_it_splits_is_banned() -> None:
    scores = PeerScores()
    witness = _witness(scores)
    for n in range(6):  # two sessions a round: six restarts in quick succession (five decay just under the ban)
        witness.read({LIAR: _record(_claim(LIAR, n, 1, session=10 * n))})
        witness.read({LIAR: _record(_claim(LIAR, n, 2, session=10 * n + 1))})
    assert scores.banned(LIAR) and scores.snapshot()[LIAR]["reasons"] == {Evidence.RESTARTED.reason: 6}


def test_a_fetched_claim_outlives_claims_of_made_up_rounds_and_is_proof_against_a_second_one() -> None:
    scores = PeerScores()
    witness = _witness(scores)
    fetched = _claim(LIAR, 3, 1)
    witness.read({LIAR: _record(fetched)})
    witness.fetched(LIAR, fetched)
    for n in range(1000, 1400, 4):  # made-up rounds, four a record
        witness.read({LIAR: _record(*(_claim(LIAR, k, 9) for k in range(n, n + 4)))})
    assert witness.read({LIAR: _record(_claim(LIAR, 3, 2))}) and scores.banned(LIAR)


def test_a_proof_against_a_peer_of_unknown_key_is_checked_once_its_key_is_known() -> None:
    keys: dict[str, bytes] = {}
    scores = PeerScores()
    witness = Witness(RUN, GROUP, keys.get, scores)
    record = encode_record([], [Equivocation(LIAR, _claim(LIAR, 3, 1), _claim(LIAR, 3, 2)).to_wire()])
    assert not witness.read({ACCUSER: record}) and not scores.banned(LIAR)
    keys[LIAR] = KEYS[LIAR].public_key
    assert witness.read({ACCUSER: record}) and scores.banned(LIAR)


@pytest.mark.parametrize("forgery", ["another key", "other rounds", "other sessions", "same claim", "other group",
                                     "altered claim", "unknown peer"])
def test_a_proof_that_does_not_hold_bans_nobody(forgery: str) -> None:
    a, b = _claim(LIAR, 3, 1), _claim(LIAR, 3, 2)
    accused = LIAR
    if forgery == "another key":
        b = _claim(OTHER, 3, 2)
    elif forgery == "other rounds":
        b = _claim(LIAR, 4, 2)
    elif forgery == "other sessions":
        b = _claim(LIAR, 3, 2, session=8)
    elif forgery == "same claim":
        b = a
    elif forgery == "other group":
        b = _claim(LIAR, 3, 2, group="backbone")
    elif forgery == "altered claim":
        b = dataclasses.replace(b, tokens=1e9)
    elif forgery == "unknown peer":
        accused = "12D3KooWStranger"
    scores = PeerScores()
    assert not _witness(scores).read({ACCUSER: encode_record([], [Equivocation(accused, a, b).to_wire()])})
    assert scores.snapshot() == {}


def test_claims_are_signed_for_their_run_group_and_content() -> None:
    claim = _claim(LIAR, 3, 1)
    key = KEYS[LIAR].public_key
    assert signed_by(key, RUN, GROUP, claim)
    assert not signed_by(KEYS[OTHER].public_key, RUN, GROUP, claim)
    assert not signed_by(key, "other run", GROUP, claim) and not signed_by(key, RUN, "backbone", claim)
    for change in ({"size": 101}, {"digest": bytes(32)}, {"tokens": 11.0}, {"session": 8}, {"round_id": 4}):
        assert not signed_by(key, RUN, GROUP, dataclasses.replace(claim, **change))
    witness = _witness()
    assert witness.signed(LIAR, claim) and witness.signed(LIAR, claim)  # the second from the cache
    assert not witness.signed(OTHER, claim) and not witness.signed("12D3KooWStranger", claim)
    assert Witness(RUN, GROUP, None, None).signed(LIAR, dataclasses.replace(claim, signature=b""))  # unchecked mode
    forged = dataclasses.replace(claim, signature=bytes(64))
    assert not witness.signed(LIAR, forged) and not witness.signed(LIAR, forged)  # a failed check is kept too


def test_records_carry_entries_and_proofs_and_malformed_ones_read_as_empty() -> None:
    proof = Equivocation(LIAR, _claim(LIAR, 3, 1), _claim(LIAR, 3, 2))
    merged = dataclasses.replace(_claim(LIAR, 4, 1), fingerprint=b"fp", participants=(f"{LIAR}@4",))
    record = _record(_claim(LIAR, 3, 1), merged, proofs=(proof,))
    assert decode_entries(record) == {3: _claim(LIAR, 3, 1), 4: merged}
    assert [Equivocation.from_wire(p) for p in record_proofs(record)] == [proof]
    for junk in (b"", b"\xc1", msgpack.packb([[], []]), msgpack.packb([1, 2]), msgpack.packb({"a": 1}),
                 msgpack.packb([[[1, 2]], [[3]]]), b"x" * 6000, None):
        assert isinstance(decode_entries(junk), dict) and isinstance(record_proofs(junk), list)
        assert Witness(RUN, GROUP, lambda _p: KEYS[LIAR].public_key, PeerScores()).read({LIAR: junk}) is False
    assert Equivocation.from_wire([LIAR, [1], [2]]) is None and Equivocation.from_wire("x") is None
    wire = proof.to_wire()
    for peer in ("", "not a peer id!", "0OIl", "x" * 101, 5):
        assert Equivocation.from_wire([peer, *wire[1:]]) is None


def test_sessions_only_increase_within_a_process() -> None:
    sessions = [new_session() for _ in range(100)]
    assert sessions == sorted(set(sessions))
