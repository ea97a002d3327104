"""Gathered and partitioned outer rounds with a contributor that holds, trickles or slows its answers, equivocates
or signs blocks that are not finite, over real hivemind DHT peers on loopback: no round waits on it past its bound,
and provable faults are banned by every honest peer (``node.outer.testing``'s four peers live for the module).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from parallax.dht.testing import wait_until
from parallax.node.net.scores import PeerScores
from parallax.node.outer.averager import GroupAverager, RoundStatus
from parallax.node.outer.blocks import BlockedBody, block_layout
from parallax.node.outer.testing import (
    CAP,
    PARTS,
    SHAPES,
    Peer,
    gather_peers,
    gathered_config,
    noisy_deltas,
    own_gathers,
    run_all,
    start_averagers,
)
from parallax.node.outer.transport import (
    ContributionServicer,
    OuterGather,
    RoundEntry,
    RoundPeers,
    body_digest,
    decode_contribution,
    decode_entries,
    encode_contribution,
    encode_record,
)
from parallax.node.outer.witness import sign
from parallax.protocol import codec

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    with gather_peers() as made:
        yield made


def _merged_without(peers: Sequence[Peer], averagers: Sequence[GroupAverager], odd: int,
                    deltas: Sequence[dict[str, torch.Tensor]], *, round_id: int, honest: int) -> None:
    """Peer ``odd`` runs round ``round_id`` first (its entry is out before the others look for contributions, so
    each of them fetches it); the first ``honest`` peers then run it, and each merges exactly their contributions."""
    odd_id = peers[odd].dht.peer_id
    with ThreadPoolExecutor(honest + 1) as pool:
        first = pool.submit(averagers[odd].run_round, deltas[odd], CAP, round_id=round_id)
        wait_until(lambda: round_id in decode_entries(averagers[0].records.read([odd_id], 2.0).get(odd_id, b"")),
                   timeout=30)
        rest = [pool.submit(a.run_round, d, CAP, round_id=round_id)
                for a, d in zip(averagers[:honest], deltas[:honest], strict=True)]
        results = [f.result(timeout=60) for f in rest]
        first.result(timeout=60)
    for a, merged in zip(averagers[:honest], results, strict=True):
        report = a.last_report
        assert report.status is RoundStatus.OK and merged is not None, report
        assert sorted(report.participants) == sorted(p.dht.peer_id for p in peers[:honest]), report


class _HeldAnswers(ContributionServicer):
    """Accepts every contribution fetch (a body or blocks) and sends nothing for ``hold_s``; counts the fetches."""

    def __init__(self, *args: typing.Any, hold_s: float) -> None:
        super().__init__(*args)
        self.hold_s, self.asked = hold_s, 0

    async def rpc_contribution(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        self.asked += 1
        await asyncio.sleep(self.hold_s)
        for _ in ():
            yield runtime_pb2.ExpertInfo()

    rpc_blocks = rpc_contribution


_HeldAnswers.__name__ = ContributionServicer.__name__  # hivemind names the protocol after the servicer's class


def test_a_contributor_that_holds_its_fetches_costs_each_peer_one_bounded_fetch_and_is_scored(peers):
    """Peer 3 announces its contribution and holds every fetch of it open without sending a byte. Each honest
    peer asks once, merges the three others without waiting for that fetch, gives it up after
    ``next_chunk_timeout_s`` (not the round's ``allreduce_timeout_s``), does not ask again and scores the
    holder. In the next round the holder is asked again, but it counts in no quorum: two of the three honest peers
    merge between themselves (a majority of the two honest others and themselves), where counting the holder
    they would need three and end with no group."""
    config = gathered_config()
    holder = peers[3].dht.peer_id
    hold_s = 2 * config.net.next_chunk_timeout_s
    with own_gathers(peers, "held", 3, lambda store: _HeldAnswers(store, hold_s=hold_s)) as gathers:
        scores = [PeerScores() for _ in peers]
        with start_averagers(peers, "held", scores, gathers=gathers) as averagers:
            _merged_without(peers, averagers, 3, noisy_deltas(4, seed=21), round_id=1, honest=3)
            for score in scores[:3]:
                wait_until(lambda score=score: holder in score.snapshot(), timeout=30)  # the fetch's own bound
                reasons = score.snapshot()[holder]["reasons"]
                assert reasons == {"outer contribution fetch accepted and then held": 1}, reasons
                assert not score.banned(holder)
            assert isinstance(gathers[3].servicer, _HeldAnswers) and gathers[3].servicer.asked == 3

            _merged_without(peers, averagers, 3, noisy_deltas(4, seed=22), round_id=2, honest=2)  # peer 2 sits it out
            wait_until(lambda: gathers[3].servicer.asked == 5, timeout=30)  # asked again: it may have recovered
            for score in scores[:2]:  # held again: evidence again
                wait_until(lambda score=score: sum(score.snapshot()[holder]["reasons"].values()) == 2, timeout=30)


class _TrickledAnswers(ContributionServicer):
    """Answers every contribution fetch 64 bytes at a time, each message ``PAUSE_S`` after the one before (well
    within the loopback wait for the next message, 5 s)."""

    PAUSE_S = 0.5

    async def rpc_contribution(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        async for message in self._trickle(super().rpc_contribution(request, context)):
            yield message

    async def rpc_blocks(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        async for message in self._trickle(super().rpc_blocks(request, context)):
            yield message

    async def _trickle(self, answer: typing.AsyncIterator[runtime_pb2.ExpertInfo],  # noqa: UP006
                       ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006
        async for message in answer:
            for start in range(0, len(message.serialized_info), 64):
                await asyncio.sleep(self.PAUSE_S)
                yield runtime_pb2.ExpertInfo(serialized_info=message.serialized_info[start:start + 64])


_TrickledAnswers.__name__ = ContributionServicer.__name__


def test_a_contributor_that_trickles_its_answers_is_left_out_and_waited_for_by_no_later_round(peers):
    """Peer 3 answers every fetch of its contribution a few bytes at a time, never stalling long enough to be called
    held: each honest peer gives the fetch up at its overall bound (``allreduce_timeout_s``), merges the three others,
    and scores nothing (a link slower than the bound looks the same). In the next round the trickler counts in no
    quorum, as a holder does: two of the three honest peers merge between themselves."""
    trickler = peers[3].dht.peer_id
    timings = {"allreduce_timeout_s": 6.0}
    with own_gathers(peers, "trickled", 3, _TrickledAnswers) as gathers:
        scores = [PeerScores() for _ in peers]
        with start_averagers(peers, "trickled", scores, gathers=gathers, timings=timings) as averagers:
            _merged_without(peers, averagers, 3, noisy_deltas(4, seed=31), round_id=1, honest=3)
            wait_until(lambda: all(a._gathered is not None and trickler in a._gathered._held_peers()
                                   for a in averagers[:3]), timeout=30)  # the fetch's overall bound
            _merged_without(peers, averagers, 3, noisy_deltas(4, seed=32), round_id=2, honest=2)  # peer 2 sits it out
            assert all(trickler not in score.snapshot() for score in scores[:3])  # no evidence


@pytest.mark.parametrize("kind", ["held", "trickled"])
def test_a_partitioned_rounds_contributor_that_holds_or_trickles_its_blocks_is_set_aside(peers, kind):
    """Partitioned, peer 3 holds every fetch of its blocks open without a byte, or trickles them past the fetch's
    bound: its contribution, first seen, must serve a block before any set counts it, so the three honest peers
    merge among themselves and set peer 3 aside once that fetch ends (a holder is scored, a trickler not: a slow
    link looks the same). In the next round peer 3 counts in no quorum: two of the three honest peers merge between
    themselves."""
    odd = peers[3].dht.peer_id
    timings = {"allreduce_timeout_s": 6.0}
    servicer = ((lambda store: _HeldAnswers(store, hold_s=30.0)) if kind == "held" else _TrickledAnswers)
    shapes = {"w": PARTS["w"]}  # 8 blocks of 4,096 entries: any block trickled takes past the bound
    with own_gathers(peers, f"parts-{kind}", 3, servicer) as gathers:
        scores = [PeerScores() for _ in peers]
        with start_averagers(peers, f"parts-{kind}", scores, gathers=gathers, timings=timings, compression="int4",
                        aggregation="parts", shapes=shapes) as averagers:
            _merged_without(peers, averagers, 3, noisy_deltas(4, seed=33, shapes=shapes), round_id=1, honest=3)
            wait_until(lambda: all(a._gathered is not None and odd in a._gathered._held_peers()
                                   for a in averagers[:3]), timeout=30,
                       explain=lambda: repr([(a._gathered._held_peers(), a._gathered._refused)
                                             for a in averagers[:3] if a._gathered is not None]))
            _merged_without(peers, averagers, 3, noisy_deltas(4, seed=34, shapes=shapes), round_id=2, honest=2)
            if kind == "held":
                assert all(odd in score.snapshot() for score in scores[:3])
            else:
                assert all(odd not in score.snapshot() for score in scores[:3])  # no evidence


class _HeldOnce(_HeldAnswers):
    """Holds the first fetch (``hold_s``), then answers every later one after a second (a busy host: well within
    the bound on one message, longer than a round's poll)."""

    async def rpc_contribution(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        if self.asked == 0:
            async for message in super().rpc_contribution(request, context):
                yield message
            return
        self.asked += 1
        await asyncio.sleep(1.0)
        async for message in ContributionServicer.rpc_contribution(self, request, context):
            yield message


_HeldOnce.__name__ = ContributionServicer.__name__


def test_two_peers_merge_again_after_one_fetch_was_held(peers):
    """Of two peers, one holds the other's first fetch (a host busy for a moment): the other, which then waits for
    no one in particular, still waits for a quorum with its contribution on offer, so the next round merges the
    two of them (were it to end such rounds at once, each withdrawing its contribution before the held peer could
    fetch it, the pair would never merge again)."""
    config = gathered_config()
    pair = peers[:2]
    hold_s = 2 * config.net.next_chunk_timeout_s
    with own_gathers(pair, "held-once", 1, lambda store: _HeldOnce(store, hold_s=hold_s)) as gathers:
        ids = [p.dht.peer_id for p in pair]
        with start_averagers(pair, "held-once", gathers=gathers, round_peers=RoundPeers(lambda: ids)) as averagers:
            first = run_all(averagers, noisy_deltas(2, seed=31), [CAP] * 2, round_id=1)
            assert first[0] is None, averagers[0].last_report  # the held fetch: no quorum of two
            assert isinstance(gathers[1].servicer, _HeldOnce) and gathers[1].servicer.asked >= 1
            second = run_all(averagers, noisy_deltas(2, seed=32), [CAP] * 2, round_id=2)
            for a, merged in zip(averagers, second, strict=True):
                assert merged is not None and len(a.last_report.participants) == 2, a.last_report


class _SlowAnswers(ContributionServicer):
    """Sends each contribution in ``pieces`` messages, ``every_s`` apart (each within the receiver's bound on one
    message: slow, not stalled); records when each answer ends, sent whole or cut off by its reader."""

    def __init__(self, *args: typing.Any, pieces: int, every_s: float) -> None:
        super().__init__(*args)
        self.pieces, self.every_s = pieces, every_s
        self.started, self.ended = 0, threading.Event()

    async def rpc_contribution(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        group, _, n = request.uid.rpartition("/")
        body = self._store.get(group, int(n)) or b""
        size = -(-len(body) // self.pieces)
        self.started += 1
        try:
            for start in range(0, len(body), size):
                await asyncio.sleep(self.every_s)
                yield runtime_pb2.ExpertInfo(serialized_info=body[start:start + size])
        finally:
            self.ended.set()


_SlowAnswers.__name__ = ContributionServicer.__name__


def test_a_slow_contributor_delays_no_round_past_its_wait(peers):
    """Peer 3 sends its contribution slowly: every message within the bound on one message, the whole in longer
    than the bound on a fetch. The three others merge among themselves once their wait is over and each holds a
    quorum, while their fetches of peer 3's body are still running (they are abandoned, not awaited)."""
    timings = {"allreduce_timeout_s": 60.0}
    config = gathered_config(**timings)
    # 30 messages 2.5 s apart: 75 s in all
    answers = functools.partial(_SlowAnswers, pieces=30, every_s=config.net.next_chunk_timeout_s / 2)
    with own_gathers(peers, "slow", 3, answers) as gathers:
        slow = gathers[3].servicer
        assert isinstance(slow, _SlowAnswers)
        with start_averagers(peers, "slow", gathers=gathers, timings=timings) as averagers:
            deltas = noisy_deltas(4, seed=23)
            with ThreadPoolExecutor(4) as pool:
                late = pool.submit(averagers[3].run_round, deltas[3], CAP, round_id=1)
                wait_until(lambda: peers[3].dht.peer_id in averagers[0].records.read([peers[3].dht.peer_id], 2.0),
                           timeout=30)
                honest = [pool.submit(a.run_round, d, CAP, round_id=1)
                          for a, d in zip(averagers[:3], deltas[:3], strict=True)]
                results = [f.result(timeout=60) for f in honest]
                still_sending = not slow.ended.is_set()
                late.result(timeout=90)
            assert slow.started >= 1 and still_sending, "the rounds waited for the slow contribution"
            for a, merged in zip(averagers[:3], results, strict=True):
                report = a.last_report
                assert report.status is RoundStatus.OK and merged is not None, report
                assert sorted(report.participants) == sorted(p.dht.peer_id for p in peers[:3]), report


def _rounds_until_two_ban(averagers: Sequence[GroupAverager], scores: Sequence[PeerScores], reason: str, seed: int,
                          shapes: Mapping[str, tuple[int, ...]] = SHAPES) -> None:
    """Rounds of peers 0 to 2 (up to three) until peers 1 and 2 ban peer 0 for ``reason``; peer 3 sat them out and
    holds nothing against it."""
    liar = averagers[0].peer_id
    for n in range(1, 4):
        run_all(averagers[:3], noisy_deltas(3, seed=seed + n, shapes=shapes), [CAP] * 3, round_id=n)
        if scores[1].banned(liar) and scores[2].banned(liar):
            break
    for score in scores[1:3]:
        assert score.banned(liar) and reason in score.snapshot()[liar]["reasons"], score.snapshot()
    assert liar not in scores[3].snapshot()


class _Equivocating(ContributionServicer):
    """Serves each round's body once, then hands ``switch`` the round (group, number) to sign another body for."""

    def __init__(self, *args: typing.Any, switch: Callable[[str, int], None]) -> None:
        super().__init__(*args)
        self.switch, self._switched = switch, set()

    async def rpc_contribution(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        async for part in super().rpc_contribution(request, context):
            yield part
        group, _, n = request.uid.rpartition("/")
        if (group, n) not in self._switched:
            self._switched.add((group, n))
            asyncio.get_running_loop().run_in_executor(None, self.switch, group, int(n))


_Equivocating.__name__ = ContributionServicer.__name__


@pytest.mark.timeout(240)
def test_an_equivocating_peer_is_banned_by_every_honest_peer_and_the_others_merge_without_it(peers):
    """Peer 0 serves each round's body once, then signs a claim of another body for the same round (its session
    unchanged) and serves that: every fetch passes its own digest check, and the honest peers would merge different
    bodies. Peers 1 and 2 take part in its rounds and read both claims: each holds proof, bans peer 0 and shows the
    proof in its rounds record. Peer 3 sits those rounds out and never sees two claims: it bans peer 0 on the
    proof it reads in the others' records, checked against peer 0's key, and the honest three merge among
    themselves."""
    liar = peers[0].dht.peer_id
    holder: list[GroupAverager] = []
    gathers: list[OuterGather] = []

    def switch(group: str, n: int) -> None:
        gathered = holder[0]._gathered
        assert gathered is not None
        entry = gathered._entries[n]
        body = gathers[0].store.get(group, n)
        assert body is not None
        other = encode_contribution({name: 1.5 * t for name, t in decode_contribution(body, SHAPES, peer=liar).items()},
                                    "fp16")
        gathers[0].store.put(group, n, other)
        claim = RoundEntry(n, body_digest(other), len(other), entry.tokens, session=entry.session, base=entry.base)
        gathered._entries[n] = sign(peers[0].signer.identity, "gather", group, claim)  # in place: beside its round
        entries = dict(gathered._entries)
        gathered.records.store(encode_record([entries[k] for k in sorted(entries)]))

    scores = [PeerScores() for _ in peers]
    reason = "two signed contributions for one round"
    with own_gathers(peers, "equivocate", 0, lambda store: _Equivocating(store, switch=switch)) as made:
        gathers.extend(made)
        with start_averagers(peers, "equivocate", scores, gathers=made) as averagers:
            holder.append(averagers[0])
            _rounds_until_two_ban(averagers, scores, reason, seed=40)
            honest = sorted(p.dht.peer_id for p in peers[1:])
            for attempt in range(3):  # a round may still be lost to a view of the ban that came late
                results = run_all(averagers[1:], noisy_deltas(3, seed=50 + attempt), [CAP] * 3, round_id=10 + attempt)
                if all(r is not None for r in results):
                    break
            assert scores[3].banned(liar) and reason in scores[3].snapshot()[liar]["reasons"], scores[3].snapshot()
            for a, merged in zip(averagers[1:], results, strict=True):
                assert merged is not None and sorted(a.last_report.participants) == honest, a.last_report


@pytest.mark.timeout(240)
def test_a_sender_whose_signed_blocks_are_not_finite_is_banned_by_every_honest_peer_on_the_proof_one_shares(peers):
    """Peer 0 signs contributions whose blocks are NaN (packed by hand: the encoder refuses them). Peers 1 and 2 take
    part in its rounds: the first block each fetches of it (its probe) is not finite, and it is under peer 0's
    signed root: each bans peer 0 at once and serves the proof, its record referring to it. Peer 3 sits those rounds
    out and never fetches a block of peer 0; before it takes the group's state from peers (``hear_proofs``, as a
    joiner does) it reads their records, fetches the proof, checks it against peer 0's key and the group's shapes, and
    bans peer 0 too; the honest three then merge among themselves."""
    liar = peers[0].dht.peer_id
    scores = [PeerScores() for _ in peers]
    reason = "a signed contribution block with non-finite values"
    with start_averagers(peers, "bad-block", scores, compression="int4", aggregation="parts",
                         shapes=PARTS) as averagers:
        gathered, third = averagers[0]._gathered, averagers[3]._gathered
        assert gathered is not None and third is not None
        found, heard = [], []  # peer 3's own findings, and the proofs it heard that held
        convict, hear = third.witness.convict_block, third.witness.hear_block
        third.witness.convict_block = lambda proof: found.append(proof) or convict(proof)  # type: ignore[method-assign]
        third.witness.hear_block = (  # type: ignore[method-assign]
            lambda *args: heard.append(held := hear(*args)) or held)
        honest_offer = gathered._offer

        def poisoned(n: int, delta: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bytes, int]:
            mine, _, _ = honest_offer(n, delta)
            body = BlockedBody(tuple(codec._pack("raw", "float32", rows, [], np.full(rows, np.nan, "<f4").tobytes())
                                     for b in block_layout(PARTS) for rows in [(b.stop - b.start, *PARTS[b.name][1:])]))
            peers[0].gather.store.put("bad-block", n, body)
            return mine, body.digest, body.size

        gathered._offer = poisoned  # type: ignore[method-assign]
        _rounds_until_two_ban(averagers, scores, reason, seed=60, shapes=PARTS)
        # One read of the records each time (it may come back empty on a busy machine); banned once it returns.
        def banned_on_reading() -> bool:
            averagers[3].hear_proofs(10)
            return scores[3].banned(liar)

        wait_until(banned_on_reading, 60,
                   explain=lambda: repr(scores[3].snapshot()))
        assert scores[3].snapshot()[liar]["reasons"] == {reason: 1}, scores[3].snapshot()
        assert found == [] and True in heard, (found, heard)  # on the proof it heard of, not on a block of its own
        honest = sorted(p.dht.peer_id for p in peers[1:])
        for attempt in range(3):  # a round may still be lost to a view of the ban that came late
            results = run_all(averagers[1:], noisy_deltas(3, seed=70 + attempt, shapes=PARTS), [CAP] * 3,
                           round_id=10 + attempt)
            if all(r is not None for r in results):
                break
        for a, merged in zip(averagers[1:], results, strict=True):
            assert merged is not None and sorted(a.last_report.participants) == honest, a.last_report

