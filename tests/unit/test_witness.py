"""Signed contribution claims and proofs of equivocation (pure: rounds records as bytes, no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

from parallax.dht.testing import fixed_identity
from parallax.node.net.scores import Evidence, PeerScores
from parallax.node.outer.blocks import BlockedBody, block_layout, encode_blocks
from parallax.node.outer.transport import RoundEntry, decode_entries, encode_record, record_proofs
from parallax.node.outer.wire import ANCHOR_FP_BYTES, encode_fingerprint
from parallax.node.outer.witness import BadBlock, Equivocation, Witness, new_session, proof_cap, sign, signed_by

RUN, GROUP = "run", "router"
LIAR, ACCUSER, OTHER = "12D3KooWLiar", "12D3KooWAccuser", "12D3KooWOther"
KEYS = {LIAR: fixed_identity(1), ACCUSER: fixed_identity(2), OTHER: fixed_identity(3)}


def _claim(peer: str, n: int, digest: int, session: int = 7, *, group: str = GROUP) -> RoundEntry:
    return sign(KEYS[peer], RUN, group, RoundEntry(n, bytes([digest]) * 32, 100, 10.0, session=session))


def _record(*entries: RoundEntry, proofs: tuple[Equivocation, ...] = ()) -> bytes:
    return encode_record(list(entries), [p.to_wire() for p in proofs])


def _witness(scores: PeerScores | None = None, **kwargs: object) -> Witness:
    return Witness(RUN, GROUP, lambda peer: KEYS[peer].public_key if peer in KEYS else None, scores or PeerScores(),
                   **kwargs)  # type: ignore[arg-type]


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
    for change in ({"size": 101}, {"digest": bytes(32)}, {"tokens": 11.0}, {"session": 8}, {"round_id": 4},
                   {"base": b"another anchor"}, {"drawn": 1}):
        assert not signed_by(key, RUN, GROUP, dataclasses.replace(claim, **change))
    witness = _witness()
    assert witness.signed(LIAR, claim) and witness.signed(LIAR, claim)  # the second from the cache
    assert not witness.signed(OTHER, claim) and not witness.signed("12D3KooWStranger", claim)
    assert Witness(RUN, GROUP, None, None).signed(LIAR, dataclasses.replace(claim, signature=b""))  # unchecked mode
    forged = dataclasses.replace(claim, signature=bytes(64))
    assert not witness.signed(LIAR, forged) and not witness.signed(LIAR, forged)  # a failed check is kept too


def test_two_claims_of_one_round_that_name_two_anchors_prove_an_equivocation() -> None:
    """A sender that tells some peers its contribution was taken from the majority's anchor, and others another,
    splits the merge (``wire.set_anchor`` leaves it out on one side only): that is two claims of one round."""
    first = sign(KEYS[LIAR], RUN, GROUP, RoundEntry(3, bytes([1]) * 32, 100, 10.0, session=7, base=b"anchor a"))
    second = sign(KEYS[LIAR], RUN, GROUP, dataclasses.replace(first, base=b"anchor b"))
    proof = Equivocation(LIAR, first, second)
    assert proof.proves(KEYS[LIAR].public_key, RUN, GROUP)
    assert Equivocation.from_wire(proof.to_wire()) == proof
    assert decode_entries(_record(second)) == {3: second}
    # A base is an anchor's fingerprint, no longer: a claim padded to fill the records proofs travel in reads as junk.
    padded = sign(KEYS[LIAR], RUN, GROUP, dataclasses.replace(first, base=bytes(ANCHOR_FP_BYTES + 1)))
    assert decode_entries(_record(padded)) == {} and RoundEntry.claim_from_wire(padded.claim_to_wire()) is None
    fitting = sign(KEYS[LIAR], RUN, GROUP, dataclasses.replace(first, base=encode_fingerprint([1.0] * 16)))
    assert len(fitting.base) == ANCHOR_FP_BYTES and decode_entries(_record(fitting)) == {3: fitting}


def test_a_claim_names_the_draws_its_sender_trained_on_and_two_counts_of_one_round_prove_an_equivocation() -> None:
    """The draw count tells a peer which batches to rebuild (``train.own_data``): a sender that names one count to
    some peers and another to others signed two claims of one round."""
    first = sign(KEYS[LIAR], RUN, GROUP, RoundEntry(3, bytes([1]) * 32, 100, 10.0, session=7, drawn=400))
    assert RoundEntry.claim_from_wire(first.claim_to_wire()) == first and decode_entries(_record(first)) == {3: first}
    second = sign(KEYS[LIAR], RUN, GROUP, dataclasses.replace(first, drawn=401))
    assert Equivocation(LIAR, first, second).proves(KEYS[LIAR].public_key, RUN, GROUP)
    wire = first.claim_to_wire()
    for drawn in (-1, 2**62, 1.0, True, None):
        assert RoundEntry.claim_from_wire([*wire[:6], drawn, wire[7]]) is None


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


SHAPES = {"w": (96, 512), "norm": (128,)}


def _bad_block(peer: str = LIAR, *, poison: bool = True, blob: bytes = b"") -> BadBlock:
    """Block 1 of a body ``peer`` signs, its entries NaN (written by hand: the encoder refuses them; ``blob``: that
    block instead)."""
    body = encode_blocks({name: torch.randn(shape, generator=torch.Generator().manual_seed(0))
                          for name, shape in SHAPES.items()}, "int4")
    blobs = list(body.blobs)
    if poison:
        block = block_layout(SHAPES)[1]
        rows = [block.stop - block.start, *SHAPES[block.name][1:]]
        blobs[1] = blob or msgpack.packb(["raw", "float32", rows, [], np.full(rows, np.nan, "<f4").tobytes()],
                                         use_bin_type=True)
    signed = BlockedBody(tuple(blobs))
    claim = sign(KEYS[peer], RUN, GROUP, RoundEntry(3, signed.digest, signed.size, 10.0, session=7))
    return BadBlock(peer, claim, 1, signed.answer([1]))


def test_a_signed_block_with_non_finite_values_is_proof_the_finder_serves_and_every_reader_bans_on() -> None:
    served: dict[int, bytes] = {}
    scores = PeerScores(threshold=1e9)  # a proof bans whatever the threshold
    finder = _witness(scores, shapes=SHAPES, serve=served.__setitem__)
    assert finder.convict_block(_bad_block()) and scores.banned(LIAR)
    assert finder.read({}) and not finder.read({})  # the record goes out again once
    (ref,) = finder.shared()
    assert ref[1] == LIAR and len(served) == 1 and len(served[ref[2]]) == ref[4] <= proof_cap(SHAPES)
    assert len(encode_record([], [ref, ref])) < 500  # a reference, not the block: records stay small
    assert finder.convict_block(_bad_block()) and len(served) == 1  # one proof of a sender is enough
    # Readers that never fetched the block ask the finder for it, check it and ban; then they share it too.
    asked: list[tuple[str, int]] = []
    now = [0.0]
    reader_scores = PeerScores(clock=lambda: now[0])

    def ask(accuser: str, accused: str, number: int, digest: bytes, size: int) -> None:
        asked.append((accuser, number))
        reader.hear_block(accuser, accused, digest, served[number])

    reader = _witness(reader_scores, shapes=SHAPES, ask=ask, serve=lambda n, d: None)
    assert reader.read({ACCUSER: encode_record([], finder.shared())}) and reader_scores.banned(LIAR)
    assert Evidence.BAD_BLOCK.reason in reader_scores.snapshot()[LIAR]["reasons"]
    assert reader.shared()[0][1] == LIAR and reader.shared()[0][3] == ref[3]  # the same proof, shown in turn
    # Acted on once: from the same accuser, from another, and once the reader's ban has ended (a proof that every
    # node shows would otherwise renew every ban for as long as any shows it).
    shown = {ACCUSER: encode_record([], finder.shared()), OTHER: encode_record([], reader.shared())}
    assert not reader.read(shown)
    now[0] += reader_scores.ban_s + 1
    assert not reader_scores.banned(LIAR) and not reader.read(shown) and not reader_scores.banned(LIAR)
    assert asked == [(ACCUSER, ref[2])]
    late = _witness(PeerScores(), shapes=SHAPES, ask=lambda *a: asked.append(a[:2]))
    late_scores = late.scores
    assert late_scores is not None
    late_scores.record(LIAR, Evidence.BAD_BLOCK)
    late.read({ACCUSER: encode_record([], finder.shared())})
    assert len(asked) == 1  # banned there already: not asked


def test_a_proof_that_does_not_arrive_is_asked_of_another_accuser_and_asks_are_bounded() -> None:
    asks: list[tuple[str, str, int, bytes, int]] = []
    witness = _witness(PeerScores(), shapes=SHAPES, ask=lambda *a: asks.append(a))
    data = _bad_block().to_bytes()
    digest = hashlib.sha256(data).digest()
    ref = ["block", LIAR, 1, digest, len(data)]
    witness.read({ACCUSER: encode_record([], [ref]), OTHER: encode_record([], [ref])})
    assert [a[0] for a in asks] == [ACCUSER]  # one accuser at a time for a proof
    witness.read({ACCUSER: encode_record([], [ref])})
    assert len(asks) == 1 and not witness.asks_ended(0.01)  # still open
    assert not witness.hear_block(ACCUSER, LIAR, digest, None)  # it did not arrive: that accuser is not asked again
    assert witness.asks_ended(0.0)
    witness.read({ACCUSER: encode_record([], [ref])})
    assert len(asks) == 1
    witness.read({OTHER: encode_record([], [ref])})
    assert [a[0] for a in asks] == [ACCUSER, OTHER]
    assert witness.hear_block(OTHER, LIAR, digest, data) and witness.scores is not None
    assert witness.scores.banned(LIAR)
    # Many references at once: a few asks open, one per accuser.
    flood = _witness(PeerScores(), shapes=SHAPES, ask=lambda *a: asks.append(a))
    asks.clear()
    flood.read({ACCUSER: encode_record([], [["block", LIAR, n, bytes([n]) * 32, 100] for n in (1, 2)])})
    flood.read({f"12D3KooWSybi{c}": encode_record([], [["block", LIAR, 1, bytes([9 + i]) * 32, 100]])
                for i, c in enumerate("abcdefgh")})
    assert len(asks) == 4 and len({a[0] for a in asks}) == 4


def test_a_liar_that_shows_its_own_proof_under_another_name_is_banned_by_it_and_cannot_bury_it() -> None:
    """The liar refers to the proof against itself naming an honest peer, hoping readers refuse it as a mismatch and
    never ask the honest finders for it: the proof holds whoever the reference names."""
    scores = PeerScores()
    data = _bad_block().to_bytes()
    digest = hashlib.sha256(data).digest()
    witness = _witness(scores, shapes=SHAPES,
                       ask=lambda accuser, accused, n, d, size: witness.hear_block(accuser, accused, d, data))
    witness.read({LIAR: encode_record([], [["block", ACCUSER, 1, digest, len(data)]])})
    assert scores.banned(LIAR) and ACCUSER not in scores.snapshot()


def test_a_reader_waiting_for_its_asks_sees_the_ban_when_they_end() -> None:
    scores = PeerScores()
    data = _bad_block().to_bytes()
    digest = hashlib.sha256(data).digest()

    def ask(accuser: str, accused: str, number: int, d: bytes, size: int) -> None:  # answered by another thread
        threading.Thread(target=lambda: (time.sleep(0.05), witness.hear_block(accuser, accused, d, data))).start()

    witness = _witness(scores, shapes=SHAPES, ask=ask)
    witness.read({ACCUSER: encode_record([], [["block", LIAR, 1, digest, len(data)]])})
    assert witness.asks_ended(10) and scores.banned(LIAR)
    served_junk = _witness(PeerScores(), shapes=SHAPES, ask=lambda *a: asked.append(a[0]))
    asked: list[str] = []
    junk = _bad_block(poison=False).to_bytes()  # a block that decodes: proves nothing
    served_junk.read({ACCUSER: encode_record([], [["block", LIAR, 1, hashlib.sha256(junk).digest(), len(junk)]])})
    assert not served_junk.hear_block(ACCUSER, LIAR, hashlib.sha256(junk).digest(), junk)
    served_junk.read({ACCUSER: encode_record([], [["block", LIAR, 2, digest, len(data)]]),  # not asked again
                      OTHER: encode_record([], [["block", LIAR, 1, hashlib.sha256(junk).digest(), len(junk)]])})
    assert asked == [ACCUSER]  # the accuser that served junk, and the junk itself, are not asked for again
    served_junk.close()
    served_junk.read({OTHER: encode_record([], [["block", LIAR, 3, digest, len(data)]])})
    assert asked == [ACCUSER] and served_junk.asks_ended(0.0)  # closed: no more asks


@pytest.mark.parametrize("forgery", ["a block that decodes", "another key", "another block", "altered block",
                                     "junk", "junk answer", "long answer", "another shape", "unknown peer",
                                     "too large", "against this node"])
def test_a_bad_block_that_is_not_one_bans_nobody(forgery: str) -> None:
    proof = _bad_block()
    if forgery == "a block that decodes":
        proof = _bad_block(poison=False)
    elif forgery == "another key":
        proof = dataclasses.replace(proof, claim=sign(KEYS[OTHER], RUN, GROUP, proof.claim))
    elif forgery == "another block":
        proof = dataclasses.replace(proof, index=2)
    elif forgery == "altered block":
        items, path = msgpack.unpackb(proof.answer)
        items[0][1] = items[0][1][:-1] + b"\x00"
        proof = dataclasses.replace(proof, answer=msgpack.packb([items, path]))
    elif forgery == "junk answer":  # a genuine claim of the accused, and bytes that are no answer
        proof = dataclasses.replace(proof, answer=b"\xc1")
    elif forgery == "long answer":
        items, path = msgpack.unpackb(proof.answer)
        proof = dataclasses.replace(proof, answer=msgpack.packb([items, path * 50]))
    elif forgery == "another shape":  # a block this node cannot read, under the signed root: no proof
        block = block_layout(SHAPES)[1]
        rows = [block.stop - block.start + 1, *SHAPES[block.name][1:]]
        proof = _bad_block(blob=msgpack.packb(["raw", "float32", rows, [], np.zeros(rows, "<f4").tobytes()],
                                              use_bin_type=True))
    elif forgery == "unknown peer":
        proof = dataclasses.replace(proof, peer="12D3KooWStranger")
    data = {"junk": b"\xc1 not msgpack", "too large": proof.to_bytes() + b"x" * proof_cap(SHAPES)}.get(
        forgery, proof.to_bytes())
    scores = PeerScores()
    witness = _witness(scores, shapes=SHAPES, me=LIAR if forgery == "against this node" else ACCUSER)
    assert not witness.hear_block(ACCUSER, proof.peer, hashlib.sha256(data).digest(), data)
    assert forgery in ("junk", "too large") or not witness.convict_block(proof)
    assert scores.snapshot() == {} and witness.shared() == []
