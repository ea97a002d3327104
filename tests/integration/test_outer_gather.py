"""Gathered and partitioned outer rounds over real hivemind DHT peers and P2P streams on loopback: every participant
fetches every contribution (or the blocks of its share) and merges them robustly; rounds records asked of their
senders; an attacking participant moves the result little and is named (``node.outer.testing``'s four peers live for
the module; each test runs its rounds under a run id of its own and shuts its averagers down on leaving).
"""

from __future__ import annotations

import threading
import time
import typing
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from parallax.benchmarks.attacks import whole_merges
from parallax.benchmarks.bytes import block_bytes, parts_bytes
from parallax.dht.adapter import dht_time
from parallax.dht.keys import outer_rounds_key
from parallax.dht.testing import wait_until
from parallax.node.net.scores import PeerScores
from parallax.node.outer import transport
from parallax.node.outer.averager import RoundStatus
from parallax.node.outer.blocks import block_layout, decode_all, encode_blocks, parse_wanted
from parallax.node.outer.partitioned import MERGED_WIRE, Unmergeable, assignment, merge_in_blocks
from parallax.node.outer.testing import (
    CAP,
    PARTS,
    SHAPES,
    Peer,
    gather_peers,
    noisy_deltas,
    own_gathers,
    run_all,
    start_averagers,
)
from parallax.node.outer.transport import (
    ROUND_RECORD_MAX_BYTES,
    ContributionServicer,
    ContributionStore,
    RecordWatch,
    RoundEntry,
    RoundPeers,
    decode_contribution,
    decode_entries,
    encode_contribution,
    encode_record,
    pair,
)
from parallax.node.outer.wire import ANCHOR_TOLERANCE, OuterSyncConfig, anchor_fingerprint, fingerprints_agree
from parallax.node.train import own_data
from parallax.node.train.robust import robust_merge_groups
from parallax.protocol.codec import encode
from parallax.protocol.errors import MalformedMessage

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    with gather_peers() as made:
        yield made


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_four_peers_merge_exactly_what_one_process_merges_from_the_same_bodies(peers, compression):
    with start_averagers(peers, f"router-{compression}", compression=compression) as averagers:
        deltas, tokens = noisy_deltas(4, seed=0), [CAP, CAP, CAP / 2, CAP]
        results = run_all(averagers, deltas, tokens, round_id=7)
        received = [decode_contribution(encode_contribution(d, compression), SHAPES, peer="p") for d in deltas]
        order = sorted(range(4), key=lambda i: peers[i].dht.peer_id)  # participants merge in peer-id order
        reference, _ = robust_merge_groups([received[i] for i in order], [tokens[i] for i in order], "rda",
                                           eps=OuterSyncConfig.of(compression=compression).rda_eps)
        assert reference is not None
        for a, merged in zip(averagers, results, strict=True):
            assert a.last_report.status is RoundStatus.OK, a.last_report
            assert len(a.last_report.participants) == 4 and a.last_report.agreeing >= 3
            assert merged is not None and all(torch.equal(merged[n], reference[n]) for n in SHAPES)
        # The next round numbers itself and works as well, and says what each peer sent as the others decoded it.
        deltas = noisy_deltas(4, seed=1)
        with ThreadPoolExecutor(4) as pool:
            rounds = [f.result(timeout=60) for f in [pool.submit(a.round, d, t, 8)
                                                     for a, d, t in zip(averagers, deltas, tokens, strict=True)]]
        for r, d in zip(rounds, deltas, strict=True):
            assert r.merged is not None and r.report.status is RoundStatus.OK and r.sent is not None
            assert r.case is None  # only the backbone's contributions are audited
            decoded = decode_contribution(encode_contribution(d, compression), SHAPES, peer="p")
            assert all(torch.equal(r.sent[n], decoded[n]) for n in SHAPES)


def _merged_in_blocks(peers: Sequence[Peer], deltas, tokens) -> dict[str, torch.Tensor]:
    """The partitioned merge of the four peers' contributions computed in one process, as the peers send them."""
    received = [decode_all(encode_blocks(d, "int4"), PARTS, peer="p") for d in deltas]
    order = sorted(range(len(peers)), key=lambda i: peers[i].dht.peer_id)  # participants merge in peer-id order
    merged, _ = merge_in_blocks([received[i] for i in order], [tokens[i] for i in order],
                                OuterSyncConfig.of(compression="int4", aggregation="parts"))
    assert merged is not None
    return merged


def test_four_peers_share_a_partitioned_merge_and_apply_what_one_process_merges_in_blocks(peers, caplog):
    """Each peer merges its share of the blocks of every contribution and fetches the others' merged shares; all
    apply what one process merges from the same blocks, each recomputed a block of another's share, and nobody had
    to merge another's share itself."""
    with caplog.at_level("INFO", logger="parallax.node.outer.partitioned"), \
            start_averagers(peers, "parts", compression="int4", aggregation="parts", shapes=PARTS) as averagers:
        deltas, tokens = noisy_deltas(4, seed=0, shapes=PARTS), [CAP, CAP, CAP / 2, CAP]
        before = [p.gather.bytes_fetched for p in peers]
        results = run_all(averagers, deltas, tokens, round_id=7)
        reference = _merged_in_blocks(peers, deltas, tokens)
        for a, merged in zip(averagers, results, strict=True):
            assert a.last_report.status is RoundStatus.OK, a.last_report
            assert len(a.last_report.participants) == 4 and a.last_report.agreeing >= 3
            assert merged is not None and all(torch.equal(merged[n], reference[n]) for n in PARTS)
            parts = a._gathered.parts if a._gathered is not None else None
            assert parts is not None and parts.rechecked >= 1 and parts.mismerged == 0
        # a share of three bodies, three merged shares and the rechecks: the schedule bench bytes counts
        expected = parts_bytes(block_bytes(PARTS, "int4"), block_bytes(PARTS, MERGED_WIRE), 4, 1)
        for p, fetched in zip(peers, before, strict=True):
            assert 0 < p.gather.bytes_fetched - fetched < 1.25 * expected, (p.gather.bytes_fetched - fetched, expected)
    assert "itself" not in caplog.text, caplog.text


@pytest.mark.parametrize("aggregation", ["gather", "parts"])
def test_a_backbone_round_hands_one_other_contribution_to_audit_with_its_draws_and_the_merge_of_the_rest(
        peers, aggregation):
    """A node that audits (``net.outer.own_data_audits``) takes one other contribution of each backbone round it
    applies (``train.own_data``): as its sender's peers decode it (partitioned: every block of it, fetched), with the
    draws and session its signed claim names, and the round's merge. Without the setting, no round hands one over."""
    shapes, wire = (PARTS, "int4") if aggregation == "parts" else (SHAPES, "fp16")
    with start_averagers(peers, own_data.GROUP, compression=wire, aggregation=aggregation, shapes=shapes,
                         timings={"own_data_audits": True}) as averagers:
        deltas, tokens, drawn = noisy_deltas(4, seed=9, shapes=shapes), [CAP, CAP, CAP / 2, CAP], [96, 200, 7, 4000]
        with ThreadPoolExecutor(4) as pool:
            # Each parametrization its own round: both run under the same group of the same peers.
            n = 3 if aggregation == "gather" else 10
            rounds = [f.result(timeout=60) for f in [pool.submit(a.round, d, t, n, drawn=k) for a, d, t, k
                                                     in zip(averagers, deltas, tokens, drawn, strict=True)]]
        ids = [p.dht.peer_id for p in peers]
        for i, r in enumerate(rounds):
            assert r.merged is not None and r.report.status is RoundStatus.OK and r.case is not None, r.report
            assert r.case.session != 0
            j = ids.index(r.case.peer)
            assert j != i and r.case.drawn == drawn[j]
            sent = (decode_all(encode_blocks(deltas[j], wire), shapes, peer="p") if aggregation == "parts"
                    else decode_contribution(encode_contribution(deltas[j], wire), shapes, peer="p"))
            assert all(torch.equal(r.case.offered[n], sent[n]) for n in shapes)
            assert r.case.merged is r.merged
    with start_averagers(peers, own_data.GROUP, compression=wire, aggregation=aggregation,
                         shapes=shapes) as averagers:
        results = run_all(averagers, deltas, tokens, round_id=n + 1)
        assert all(m is not None for m in results) and all(a._gathered.last_case is None for a in averagers)


def test_each_peer_is_told_of_the_others_answers_and_never_of_its_own(peers):
    """What a node's transport tells of each peer's answers (``OuterGather.answered``: the membership counts them as
    the peer being there) names, in a partitioned round, every other sender whose blocks it fetched, and not itself."""
    ids = [p.dht.peer_id for p in peers]
    heard: list[list[str]] = [[] for _ in peers]
    try:
        for p, told in zip(peers, heard, strict=True):
            p.gather.answered = told.append
        with start_averagers(peers, "heard", compression="int4", aggregation="parts", shapes=PARTS) as averagers:
            results = run_all(averagers, noisy_deltas(4, seed=5, shapes=PARTS), [CAP] * 4, round_id=1)
        assert all(r is not None for r in results), [a.last_report for a in averagers]
    finally:
        for p in peers:
            p.gather.answered = None
    for me, told in zip(ids, heard, strict=True):
        assert set(told) == set(ids) - {me}, (me, told)


def test_a_merger_whose_blocks_its_contributions_do_not_give_is_caught_and_its_share_merged_by_the_others(peers):
    """Peer 0 serves merged blocks three times what the contributions give: every honest peer's recheck (all
    blocks, here) catches it, scores it, and merges its share itself; the honest three apply the honest merge and
    agree, peer 0's result is outvoted."""
    scores = [PeerScores() for _ in peers]
    with start_averagers(peers, "parts-liar", scores=scores, compression="int4", aggregation="parts", shapes=PARTS,
                    timings={"parts_rechecks": 64}) as averagers:
        liar = averagers[0]._gathered.parts if averagers[0]._gathered is not None else None
        assert liar is not None
        honest, calls = liar._merge_here, []

        def lying(*args, **kwargs):  # its own share (the first merge of the round) scaled; its rechecks honest
            got, blobs, audit = honest(*args, **kwargs)
            calls.append(1)
            if got is None or len(calls) > 1:
                return got, blobs, audit
            scaled = {i: 3 * t for i, t in got.items()}
            return scaled, {i: encode(t.numpy(), "raw") for i, t in scaled.items()}, audit

        liar._merge_here = lying
        deltas, tokens = noisy_deltas(4, seed=2, shapes=PARTS), [CAP] * 4
        results = run_all(averagers, deltas, tokens, round_id=3)
        reference = _merged_in_blocks(peers, deltas, tokens)
        attacker = peers[0].dht.peer_id
        for a, merged, score in zip(averagers[1:], results[1:], scores[1:], strict=True):
            assert a.last_report.status is RoundStatus.OK, a.last_report
            assert merged is not None and all(torch.equal(merged[n], reference[n]) for n in PARTS)
            assert "merged blocks of a partitioned round that its contributions do not give" in \
                score.snapshot()[attacker]["reasons"]
            parts = a._gathered.parts if a._gathered is not None else None
            assert parts is not None and parts.rechecked > 1 and parts.mismerged == 1  # once a round, many blocks off
        assert results[0] is None and averagers[0].last_report.status is not RoundStatus.OK


def test_a_sender_that_never_merges_its_share_costs_the_others_that_share_not_the_round(peers, caplog):
    """Peer 0 offers its contribution and then never merges (a crash after the set settled): the others wait a
    verification's bound for it to name the set, merge its share themselves, and apply the merge of all four. The
    block of its share each drew to recheck (three rechecks, a block of each other merger) was merged while they
    waited, and is used as it is."""
    with caplog.at_level("INFO", logger="parallax.node.outer.partitioned"), \
            start_averagers(peers, "parts-silent", compression="int4", aggregation="parts", shapes=PARTS) as averagers:
        silent = averagers[0]._gathered.parts if averagers[0]._gathered is not None else None
        assert silent is not None
        resume = threading.Event()

        def stuck(*args, **kwargs):
            resume.wait(60)
            raise Unmergeable("stopped", peers[0].dht.peer_id)

        silent.merge = stuck
        deltas, tokens = noisy_deltas(4, seed=4, shapes=PARTS), [CAP] * 4
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(a.run_round, d, t, round_id=5)
                       for a, d, t in zip(averagers, deltas, tokens, strict=True)]
            try:
                results = [f.result(timeout=60) for f in futures[1:]]
            finally:
                resume.set()
            assert futures[0].result(timeout=60) is None
        reference = _merged_in_blocks(peers, deltas, tokens)
        for a, merged in zip(averagers[1:], results, strict=True):
            assert a.last_report.status is RoundStatus.OK and len(a.last_report.participants) == 4, a.last_report
            assert merged is not None and all(torch.equal(merged[n], reference[n]) for n in PARTS)
    assert f"peer {peers[0].dht.peer_id} published no merged blocks of the set in time" in caplog.text
    assert caplog.text.count("(1 of them merged here already as rechecks)") == 3, caplog.text


def test_a_peers_rounds_record_is_asked_of_it_and_a_watch_answers_with_the_change(peers, monkeypatch):
    """A node serves its rounds record of a group to whoever asks: the one it holds now when the asker holds
    another, as it is after the wait when the asker holds it (a change meanwhile is answered as it is made: the
    benchmarks time that); a record past the bound is refused, its server named. The wait is half a second here
    (five by default) so that each unchanged answer comes well within the test's bounds."""
    monkeypatch.setattr(transport, "RECORD_WAIT_S", 0.5)
    first = encode_record([RoundEntry(1, b"d" * 32, 10, CAP)])
    second = encode_record([RoundEntry(2, b"e" * 32, 10, CAP)])
    peer = peers[0].dht.peer_id
    # Servers and fetchers of this test's own: the module's count the questions other tests left to end.
    with own_gathers(peers[:2], "watched", 0, ContributionServicer) as (server, asker):
        assert asker.watch_record(peer, "watched", b"", 10) == b""  # none: the wait ends with none
        server.store.post_record("watched", first)
        counted = asker.records_fetched
        assert asker.watch_record(peer, "watched", b"", 10) == first
        assert asker.records_fetched - counted == len(first)  # outer traffic, apart from the bodies'
        assert asker.watch_record(peer, "watched", first, 10) == first  # unchanged: as it is after the wait
        server.store.post_record("watched", second)
        assert asker.watch_record(peer, "watched", first, 10) == second
        assert decode_entries(asker.watch_record(peer, "watched", second, 10)).keys() == {2}
        server.store.post_record("watched", b"x" * (ROUND_RECORD_MAX_BYTES + 1))
        with pytest.raises(MalformedMessage) as refused:
            asker.watch_record(peer, "watched", b"", 10)
        assert refused.value.peer == peer


def test_a_watch_knows_each_followed_peers_record_as_the_peer_changes_it(peers, monkeypatch):
    """A ``RecordWatch`` holds a question at each peer it follows and knows each one's latest record as it is
    posted (a wait for a change ends with it), with no DHT store or read; a peer that holds none is left to the DHT;
    a peer no longer followed, and every answer once the round stopped, is dropped; a peer followed again while its
    question is still open is known by the record that question was asked with; no question is kept once it ended.
    Unchanged records are answered after half a second here (five by default)."""
    monkeypatch.setattr(transport, "RECORD_WAIT_S", 0.5)
    watch = RecordWatch(peers[1].gather, "followed", 0.05)
    server, empty = peers[0].dht.peer_id, peers[2].dht.peer_id
    first = encode_record([RoundEntry(1, b"d" * 32, 10, CAP)])
    second = encode_record([RoundEntry(2, b"e" * 32, 10, CAP)])
    try:
        peers[0].gather.store.post_record("followed", first)
        wait_until(lambda: watch.follow([server, empty]) == {server: first}, timeout=10,
                   explain=lambda: repr(watch.follow([server, empty])))
        version = watch.version
        peers[0].gather.store.post_record("followed", second)
        assert watch.wait(version, 10) != version  # woken by the change
        wait_until(lambda: watch.follow([server, empty]) == {server: second}, timeout=10,
                   explain=lambda: repr(watch.follow([server, empty])))
        assert watch.follow([empty]) == {}  # the server no longer followed: its record dropped
        wait_until(lambda: watch.follow([server]) == {server: second}, timeout=10)  # followed again
        watch.stop()
        assert watch.heard([server]) == {}  # nothing the stopped round heard is kept
        # Asked anew: by the question still open (the record it was asked with), or a new one.
        wait_until(lambda: watch.follow([server]) == {server: second}, timeout=10)
        watch.stop()
        wait_until(lambda: not watch._questions and not watch._asked_with, timeout=10,  # each forgotten as it ends
                   explain=lambda: repr(watch._questions))
    finally:
        watch.stop()


def test_a_watch_asks_a_silent_peer_again_only_after_a_backoff_that_doubles_over_rounds(peers, monkeypatch):
    """A peer id nobody runs does not answer a watch's question: it is not asked again when the round stops and the
    next one follows it, until its backoff ends; asked then and silent again, its backoff doubles."""
    monkeypatch.setattr(transport, "SILENT_FIRST_S", 3.0)
    watch = RecordWatch(peers[1].gather, "silent", 0.05)
    nobody = str(PeerID(b"\x12\x20" + bytes(range(32))).to_base58())
    try:
        watch.follow([nobody])
        wait_until(lambda: nobody in watch._silent, timeout=30, explain=lambda: repr(watch._asking))
        assert watch._silent[nobody][1] == 3.0
        watch.stop()
        assert watch.follow([nobody]) == {} and nobody not in watch._asking  # within its backoff: not asked
        wait_until(lambda: watch.follow([nobody]) == {} and watch._silent.get(nobody, (0, 0))[1] == 6.0, timeout=30,
                   explain=lambda: repr(watch._silent))
    finally:
        watch.stop()


class _NoRecord(ContributionServicer):
    """Serves its blocks and refuses every question for its rounds record (a peer on an older version)."""

    async def rpc_record(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise RuntimeError("no such handler")


_NoRecord.__name__ = ContributionServicer.__name__


def test_a_merger_that_does_not_give_its_record_is_read_from_the_dht_and_its_share_taken(peers, caplog):
    """Peer 0 answers no question for its rounds record: the others read its root from the DHT, take its merged
    share, and all apply the merge one process makes."""
    with caplog.at_level("INFO", logger="parallax.node.outer.partitioned"), \
            caplog.at_level("INFO", logger="parallax.node.outer.transport"), \
            own_gathers(peers, "gather-no-record", 0, _NoRecord) as gathers, \
            start_averagers(peers, "parts-no-record", compression="int4", aggregation="parts", shapes=PARTS,
                       gathers=gathers) as averagers:
        deltas, tokens = noisy_deltas(4, seed=5, shapes=PARTS), [CAP] * 4
        results = run_all(averagers, deltas, tokens, round_id=3)
        reference = _merged_in_blocks(peers, deltas, tokens)
        for a, merged in zip(averagers, results, strict=True):
            assert a.last_report.status is RoundStatus.OK and len(a.last_report.participants) == 4, a.last_report
            assert merged is not None and all(torch.equal(merged[n], reference[n]) for n in PARTS)
    assert f"peer {peers[0].dht.peer_id} did not give its rounds record" in caplog.text
    assert "itself" not in caplog.text, caplog.text


class _NotingBlocks(ContributionServicer):
    """Serves its blocks as a node does, and notes when each question for blocks of its contributions came (the
    blocks it named)."""

    def __init__(self, store: ContributionStore) -> None:
        super().__init__(store)
        self.asked: list[tuple[float, list[int]]] = []

    async def rpc_blocks(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        asked = parse_wanted(request.uid)
        if asked is not None and asked[0] == "parts-noted":  # its contributions' blocks, not its merged ones
            self.asked.append((time.monotonic(), asked[2]))
        async for message in super().rpc_blocks(request, context):
            yield message


_NotingBlocks.__name__ = ContributionServicer.__name__


def test_a_merger_is_asked_for_the_blocks_rechecked_in_its_share_only_once_it_published_their_root(peers):
    """Peer 0 publishes the root of its share two seconds late. Every other sender draws one block of each other
    merger's share to recheck and merges the drawn blocks while the shares come; no question for a block of peer 0's
    share reaches peer 0 before its root is out (a merger that knew which of its blocks are checked could lie on the
    others), while the shares committed on time are rechecked meanwhile (peer 0, a sender of every block, is asked
    for their blocks before its root is out), and all apply the merge one process makes. Measured in a second round:
    in the first, each node probes one block of peer 0's contribution at random before the set is known (a sender
    not yet heard from serves a block first)."""
    with own_gathers(peers, "gather-noted", 0, _NotingBlocks) as gathers, \
            start_averagers(peers, "parts-noted", compression="int4", aggregation="parts", shapes=PARTS,
                       gathers=gathers) as averagers:
        late = averagers[0]._gathered.parts if averagers[0]._gathered is not None else None
        assert late is not None
        honest, rooted = late.announce, []

        def announce(n: int, participants: tuple[str, ...], root: bytes) -> None:
            if root:
                time.sleep(2.0)
                rooted.append(time.monotonic())
            honest(n, participants, root)

        late.announce = announce
        tokens = [CAP] * 4
        for round_id in (3, 4):
            began = time.monotonic()
            deltas = noisy_deltas(4, seed=round_id, shapes=PARTS)
            results = run_all(averagers, deltas, tokens, round_id=round_id)
            reference = _merged_in_blocks(peers, deltas, tokens)
            for a, merged in zip(averagers, results, strict=True):
                assert a.last_report.status is RoundStatus.OK and len(a.last_report.participants) == 4, a.last_report
                assert merged is not None and all(torch.equal(merged[n], reference[n]) for n in PARTS)
        participants = tuple(sorted(pair(p.dht.peer_id, 4) for p in peers))
        shares = assignment(participants, len(block_layout(PARTS)))
        share = set(shares[pair(peers[0].dht.peer_id, 4)])
        asked = [(at, wanted) for at, wanted in gathers[0].servicer.asked if at >= began]
        rechecks = [at for at, wanted in asked if share & set(wanted)]
        assert len(rechecks) == 3 and min(rechecks) >= rooted[-1], (rooted, asked, share)
        merges = [sorted(shares[pair(p.dht.peer_id, 4)]) for p in peers[1:]]  # each merger's fetch of its share
        early = [wanted for at, wanted in asked if at < rooted[-1] and sorted(wanted) not in merges]
        assert early, (rooted, asked, merges)  # the shares committed on time were rechecked while peer 0 merged


class _DropsARecheck(ContributionServicer):
    """Serves its blocks as a node does, but once ``dropping``, ends each asker's first question for blocks outside
    the asker's own share of ``parts-drops`` unanswered (a stream broken on the way reads as "not held")."""

    def __init__(self, store: ContributionStore) -> None:
        super().__init__(store)
        self.dropping: dict[str, set[int]] = {}  # asker -> its own share of the round, once dropping
        self.dropped: set[str] = set()

    async def rpc_blocks(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        asker, asked = str(context.remote_id), parse_wanted(request.uid)
        own = self.dropping.get(asker)
        if asked is not None and asked[0] == "parts-drops" and own is not None and asker not in self.dropped \
                and not set(asked[2]) <= own:
            self.dropped.add(asker)
            return
        async for message in super().rpc_blocks(request, context):
            yield message


_DropsARecheck.__name__ = ContributionServicer.__name__


def test_a_recheck_whose_blocks_did_not_come_for_no_fault_is_asked_for_again(peers, caplog):
    """Peer 0, a sender of every block, answers each other node's first question for blocks to recheck with nothing
    (a stream broken on the way reads as "not held"): each asks again a moment later and makes all its rechecks, and
    all apply the merge one process makes. In a second round: the first has each node probe peer 0 at random."""
    with caplog.at_level("INFO", logger="parallax.node.outer.partitioned"), \
            own_gathers(peers, "gather-drops", 0, _DropsARecheck) as gathers, \
            start_averagers(peers, "parts-drops", compression="int4", aggregation="parts", shapes=PARTS,
                       gathers=gathers) as averagers:
        run_all(averagers, noisy_deltas(4, seed=6, shapes=PARTS), [CAP] * 4, round_id=1)
        participants = tuple(sorted(pair(p.dht.peer_id, 2) for p in peers))
        shares = assignment(participants, len(block_layout(PARTS)))
        servicer = typing.cast(_DropsARecheck, gathers[0].servicer)
        servicer.dropping = {p.dht.peer_id: set(shares[pair(p.dht.peer_id, 2)]) for p in peers[1:]}
        parts = [a._gathered.parts if a._gathered is not None else None for a in averagers[1:]]
        before = [p.rechecked if p is not None else 0 for p in parts]
        deltas = noisy_deltas(4, seed=7, shapes=PARTS)
        results = run_all(averagers, deltas, [CAP] * 4, round_id=2)
        reference = _merged_in_blocks(peers, deltas, [CAP] * 4)
        for a, merged in zip(averagers, results, strict=True):
            assert a.last_report.status is RoundStatus.OK and len(a.last_report.participants) == 4, a.last_report
            assert merged is not None and all(torch.equal(merged[n], reference[n]) for n in PARTS)
        assert servicer.dropped == set(servicer.dropping)
        # a block of each other merger's share, each recomputed and compared
        assert [p.rechecked - b if p is not None else 0 for p, b in zip(parts, before, strict=True)] == [3, 3, 3]
    # Round 2's questions are the ones peer 0 dropped; a stream broken on the way in round 1 (a loaded host) is asked
    # again as well, and counted there.
    assert caplog.text.count("parts-drops/2: rechecks asked for again") == 3, caplog.text
    assert "skipped" not in caplog.text, caplog.text


class _NoBlocks(ContributionServicer):
    """Announces its contributions and serves none of their blocks (every answer says "not held")."""

    async def rpc_blocks(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        for _ in ():
            yield runtime_pb2.ExpertInfo()


_NoBlocks.__name__ = ContributionServicer.__name__


def test_a_sender_that_serves_no_blocks_is_left_out_once_the_nodes_failed_on_it(peers):
    """Peer 0 claims contributions and serves none of their blocks: a set naming it cannot be merged, and once a node
    failed on it, peer 0's next contribution must serve a block before that node counts it. A node that has not failed
    on it yet may still name it in a set (and fail the others that took that set) for a round: from the third round
    on, the honest three merge among themselves."""
    statuses: list[list[RoundStatus]] = []
    honest = set(p.dht.peer_id for p in peers[1:])
    with own_gathers(peers, "no-blocks", 0, _NoBlocks) as gathers, \
            start_averagers(peers, "parts-no-blocks", compression="int4", aggregation="parts", shapes=PARTS,
                       gathers=gathers) as averagers:
        for round_id in (1, 2, 3, 4):
            results = run_all(averagers, noisy_deltas(4, seed=round_id, shapes=PARTS), [CAP] * 4, round_id=round_id)
            statuses.append([a.last_report.status for a in averagers[1:]])
            if round_id >= 3:
                for a, merged in zip(averagers[1:], results[1:], strict=True):
                    assert a.last_report.status is RoundStatus.OK, (statuses, a.last_report)
                    assert set(a.last_report.participants) == honest and merged is not None


def test_each_contribution_is_fetched_once_by_each_peer(peers):
    """Over three rounds of four peers, each peer downloads each other's body at most once and serves its own at most
    once to each other (a fetch that ended between two passes of a round is taken, not started again)."""
    with start_averagers(peers, "once", compression="int4") as averagers:
        before = [(p.gather.bytes_fetched, p.gather.servicer.bytes_served) for p in peers]
        sizes = []
        for round_id in range(1, 4):
            deltas = noisy_deltas(4, seed=round_id)
            sizes.append([len(encode_contribution(d, "int4")) for d in deltas])
            run_all(averagers, deltas, [CAP] * 4, round_id=round_id)
        for i, (p, (fetched, served)) in enumerate(zip(peers, before, strict=True)):
            others = sum(size for by_peer in sizes for j, size in enumerate(by_peer) if j != i)
            own = sum(3 * by_peer[i] for by_peer in sizes)
            assert 0 < p.gather.bytes_fetched - fetched <= others, (i, p.gather.bytes_fetched - fetched, others)
            assert 0 < p.gather.servicer.bytes_served - served <= own, (i, p.gather.servicer.bytes_served - served, own)


def test_a_recorded_merge_gives_the_inner_products_of_its_contributions_and_its_result(peers):
    """With ``net.outer.record_merges`` an applied round's report carries its contributions' inner products with each
    other and with the result, in its participants' order, with their capped weights."""
    deltas = noisy_deltas(3, seed=41)
    with start_averagers(peers[:3], "geometry", timings={"record_merges": True}) as averagers:
        results = run_all(averagers, deltas, [CAP, CAP / 2, CAP], round_id=1)
    index = {p.dht.peer_id: i for i, p in enumerate(peers[:3])}
    for a, merged in zip(averagers, results, strict=True):
        report, geometry = a.last_report, a.last_report.geometry
        assert report.status is RoundStatus.OK and merged is not None and geometry is not None, report
        order = [index[peer] for peer in report.participants]
        flat = [torch.cat([deltas[i][n].reshape(-1) for n in SHAPES]).double() for i in order]
        result = torch.cat([merged[n].reshape(-1) for n in SHAPES]).double()
        assert geometry["weights"] == [[CAP, CAP / 2, CAP][i] for i in order]
        for i, x in enumerate(flat):  # the contributions as sent, within the fp16 wire's rounding
            assert geometry["dots"][i] == pytest.approx(float(x @ result), rel=1e-2)
            assert geometry["gram"][i] == pytest.approx([float(x @ y) for y in flat], rel=1e-2)
        assert geometry["square"] == pytest.approx(float(result @ result), rel=1e-6)


def test_a_partitioned_rounds_recorded_shares_add_up_to_the_whole_merges_inner_products(peers):
    """Partitioned, each merger records the products over the blocks it merged; summed over the set's mergers
    (``bench attacks``' ``whole_merges``) they are the whole merge's, of the contributions as the mergers decode
    them."""
    deltas, tokens = noisy_deltas(4, seed=43, shapes=PARTS), [CAP, CAP / 2, CAP, CAP]
    with start_averagers(peers, "parts-geometry", compression="int4", aggregation="parts", shapes=PARTS,
                    timings={"record_merges": True}) as averagers:
        results = run_all(averagers, deltas, tokens, round_id=1)
    reports = [a.last_report for a in averagers]
    assert all(r.status is RoundStatus.OK and r.geometry is not None for r in reports), reports
    assert all(len(r.geometry["blocks"]) < len(block_layout(PARTS)) for r in reports)  # a share each
    assert all(r.merge_s > 0 and r.verify_s > 0 and r.total_s >= r.allreduce_s + r.merge_s + r.verify_s
               and 0 <= r.waited_s <= r.allreduce_s for r in reports), reports  # the phases, apart
    (merge,) = whole_merges([{"group": r.group, "senders": list(r.participants), **r.geometry} for r in reports])
    assert merge["blocks"] == set(range(len(block_layout(PARTS))))
    index = {p.dht.peer_id: i for i, p in enumerate(peers)}
    order = [index[peer] for peer in reports[0].participants]
    assert merge["weights"] == [tokens[i] for i in order]
    sent = [decode_all(encode_blocks(deltas[i], "int4"), PARTS, peer="p") for i in order]
    flat = [torch.cat([d[n].reshape(-1) for n in PARTS]).double() for d in sent]
    result = torch.cat([results[0][n].reshape(-1) for n in PARTS]).double()
    for i, x in enumerate(flat):
        assert merge["dots"][i] == pytest.approx(float(x @ result), rel=1e-6)
        assert merge["gram"][i] == pytest.approx([float(x @ y) for y in flat], rel=1e-6)
    assert merge["square"] == pytest.approx(float(result @ result), rel=1e-6)


@pytest.mark.parametrize("aggregation", ["gather", "parts"])
def test_a_peer_whose_anchor_drifted_is_left_out_of_the_merge_applies_it_and_is_told_who_holds_the_swarms(
        peers, aggregation):
    """Its pseudo-gradient was taken from an anchor the others left: every peer merges the other three alone (the
    anchors the signed claims name), and it is told so and whom to take the swarm's anchor from."""
    shapes, compression = (SHAPES, "fp16") if aggregation == "gather" else (PARTS, "int4")
    g = torch.Generator().manual_seed(3)
    anchor = [torch.randn(shape, generator=g) for shape in shapes.values()]
    drifted = [anchor[0] + 0.05 * torch.randn(anchor[0].shape, generator=g), anchor[1]]  # it missed a round
    deltas, tokens = noisy_deltas(4, seed=5, shapes=shapes), [CAP] * 4
    with start_averagers(peers, f"router-anchors-{aggregation}", compression=compression, aggregation=aggregation,
                         shapes=shapes) as averagers, ThreadPoolExecutor(4) as pool:
        rounds = [f.result(timeout=60) for f in [
            pool.submit(a.round, d, t, 3, drifted if i == 3 else anchor)
            for i, (a, d, t) in enumerate(zip(averagers, deltas, tokens, strict=True))]]
    assert all(r.merged is not None and r.report.status is RoundStatus.OK for r in rounds), [r.report for r in rounds]
    assert [r.report.apart_from for r in rounds[:3]] == [(), (), ()]
    assert set(rounds[3].report.apart_from) == {p.dht.peer_id for p in peers[:3]}
    assert all(r.report.left_out == (peers[3].dht.peer_id,) for r in rounds), [r.report for r in rounds]
    assert [r.report.ours_left_out for r in rounds] == [False, False, False, True]
    # Every peer is told the merge is a step from the majority's anchor: where the drifted one's download lands.
    assert all(r.report.base is not None and fingerprints_agree(r.report.base, anchor_fingerprint(anchor),
                                                                ANCHOR_TOLERANCE) for r in rounds)
    assert not any(r.report.suspects for r in rounds)  # a stale anchor is no evidence
    if aggregation == "gather":
        received = [decode_contribution(encode_contribution(d, compression), shapes, peer="p") for d in deltas[:3]]
        order = sorted(range(3), key=lambda i: peers[i].dht.peer_id)
        reference, _ = robust_merge_groups([received[i] for i in order], [tokens[i] for i in order], "rda",
                                           eps=OuterSyncConfig.of(compression=compression).rda_eps)
    else:
        reference = _merged_in_blocks(peers[:3], deltas[:3], tokens[:3])
    assert reference is not None
    assert all(torch.allclose(r.merged[n], reference[n], rtol=0, atol=1e-6) for r in rounds for n in shapes)


def test_live_composers_that_never_contribute_stall_no_round_once_idle_and_contributions_are_work(peers):
    """Two of four live composers contribute; the two that never do are idle (left out of ``working``): the
    rounds merge the two without waiting on a quorum of four, and each tells the other's work. The idle two have no
    rounds record, and are asked for none (the DHT read shows that, whoever it names)."""
    ids = [p.dht.peer_id for p in peers]
    seen: list[str] = []
    with start_averagers(peers[:2], "idle", round_peers=RoundPeers(lambda: ids, lambda: ids[:2], seen.append)) as avg:
        for round_id in (1, 2):
            results = run_all(avg, noisy_deltas(2, seed=round_id), [CAP, CAP], round_id=round_id)
            assert all(r is not None for r in results), [a.last_report for a in avg]
            assert all(a.last_report.status is RoundStatus.OK and len(a.last_report.participants) == 2 for a in avg)
    assert sorted(set(seen)) == sorted(ids[:2])  # each fetched the other's contribution: evidence of its work
    assert [p.gather.servicer.records_asked["idle"] for p in peers[2:]] == [0, 0]
    assert all(p.gather.servicer.records_asked["idle"] > 0 for p in peers[:2])  # the contributors were followed


def test_an_all_zero_contribution_is_merged_but_shows_no_work(peers):
    """A body of zeros is what any identity can send without training: it is merged like any other, and it does not
    count as its sender's work (``dht.membership.Progress``), so a key that sends only zeros earns no experts."""
    ids = [p.dht.peer_id for p in peers[:3]]
    seen: list[str] = []
    deltas = noisy_deltas(3, seed=7)
    deltas[2] = {name: torch.zeros_like(t) for name, t in deltas[2].items()}
    with start_averagers(peers[:3], "zeros", round_peers=RoundPeers(lambda: ids, lambda: ids, seen.append)) as avg:
        results = run_all(avg, deltas, [CAP, CAP, CAP], round_id=1)
        assert all(r is not None for r in results), [a.last_report for a in avg]
        assert all(len(a.last_report.participants) == 3 for a in avg)
    assert sorted(set(seen)) == sorted(ids[:2])


def test_a_node_is_told_whom_the_records_of_the_peers_that_served_it_vouch_for(peers):
    """Three peers merge a round; the fourth took no part. Reading the records before it downloads the group's state
    (``hear_proofs``), it finds the three vouched for (each named among the merged senders by the two others'
    records), to be asked first. Once the download is done it is told whom the records of the peers that served it
    vouch for (``vouch``: named by two of them, or by one for a peer that served too), and its membership counts them
    before any work reached it (``dht.membership.Progress.vouched``); the records of peers that served it nothing
    vouch for nobody."""
    ids = [p.dht.peer_id for p in peers]
    told: list[set[str]] = []
    views = [RoundPeers(lambda: ids, lambda: ids[:3])] * 3 + [RoundPeers(lambda: ids, vouched=told.append)]
    with start_averagers(peers, "vouching", round_peers=views) as averagers:
        results = run_all(averagers[:3], noisy_deltas(3, seed=11), [CAP] * 3, round_id=1)
        assert all(r is not None for r in results), [a.last_report for a in averagers[:3]]
        wait_until(lambda: averagers[3].hear_proofs(10) == set(ids[:3]), 60)
        assert not told  # the records' word alone
        assert averagers[3].vouch({ids[0]}) == set() and not told  # one record: the others served nothing
        assert averagers[3].vouch({ids[1], ids[2]}) == set(ids[:3])  # 0 named by both, 1 and 2 by each other
        assert averagers[3].vouch({ids[3]}) == set() and averagers[3].vouch(set()) == set()
    assert told == [set(ids[:3])]


def test_a_node_whose_view_of_work_is_narrow_waits_for_the_contributions_on_offer(peers, caplog):
    """Only peer 1's work has reached peer 0 (crowded nodes fetch slowly); the others see everyone's. Peer 0 counts
    the contributions on offer in its quorum, so it merges the set of four the others merge from the first, not a
    set of two it would have to give up for theirs."""
    ids = [p.dht.peer_id for p in peers]
    views = [RoundPeers(lambda: ids, lambda: ids[1:2])] + [RoundPeers(lambda: ids, lambda: ids)] * 3
    with caplog.at_level("INFO", logger="parallax.node.outer.gathered"), \
            start_averagers(peers, "narrow", round_peers=views) as averagers:
        results = run_all(averagers, noisy_deltas(4, seed=9), [CAP] * 4, round_id=2)
        for a, merged in zip(averagers, results, strict=True):
            assert merged is not None and a.last_report.status is RoundStatus.OK, a.last_report
            assert len(a.last_report.participants) == 4, a.last_report
    assert "contributions more of their senders merged" not in caplog.text


@pytest.mark.parametrize("attack", ["x1000", "x-10", "weight 1e12"])
def test_one_attacker_moves_the_honest_merge_less_than_an_honest_peer_differs(peers, attack):
    # A group of its own per attack: the same identities claiming round 3 of one group again would be skipped.
    with start_averagers(peers, "backbone-" + attack.replace(" ", "-")) as averagers:
        deltas = noisy_deltas(4, seed=2)
        honest_only, _ = robust_merge_groups(deltas[1:], [CAP] * 3)
        assert honest_only is not None
        spread = sum(_rel(d["w"], honest_only["w"]) for d in deltas[1:]) / 3
        tokens = [CAP] * 4
        if attack == "x1000":
            deltas[0] = {n: 1000 * t for n, t in deltas[0].items()}
        elif attack == "x-10":
            deltas[0] = {n: -10 * t for n, t in deltas[0].items()}
        else:
            deltas[0] = {n: -t for n, t in deltas[0].items()}
            tokens[0] = 1e12
        results = run_all(averagers, deltas, tokens, round_id=3)
        attacker = peers[0].dht.peer_id
        for a, merged in zip(averagers[1:], results[1:], strict=True):
            report = a.last_report
            assert report.status is RoundStatus.OK and merged is not None, report
            assert _rel(merged["w"], honest_only["w"]) < spread, attack
            assert report.tokens[attacker] <= CAP
            if attack != "weight 1e12":  # a capped weight is no evidence: honest peers declare the cap too
                assert attacker in report.suspects, report


def test_a_replayed_contribution_is_refused_and_counts_against_its_sender(peers):
    scores = [PeerScores() for _ in peers]
    # The replayer's own round, whose set nobody else merges, waits out a short quorum wait of its own.
    with start_averagers(peers, "replayed", scores, quorum_waits=[3.0, 15.0, 15.0, 15.0]) as averagers:
        first = noisy_deltas(4, seed=7)
        attacker = peers[0].dht.peer_id
        results = run_all(averagers, first, [CAP] * 4, round_id=1)
        # The honest three merged peer 0's round-1 contribution, the one it replays next (peer 0's own round may
        # end on its short wait before it fetched theirs when the machine is loaded: not what is under test).
        for a, result in zip(averagers[1:], results[1:], strict=True):
            assert result is not None and attacker in a.last_report.participants, a.last_report
        again = noisy_deltas(4, seed=8)
        again[0] = first[0]  # peer 0 sends its round-1 pseudo-gradient again
        run_all(averagers, again, [CAP] * 4, round_id=2)
        for a, score in zip(averagers[1:], scores[1:], strict=True):
            report = a.last_report
            # Refused when fetched; the honest three merge without it (their verification may run out of time
            # on a loaded machine: the merge is what is under test).
            assert report.began_allreduce and attacker not in report.participants, report
            assert "forged or malformed outer contribution" in score.snapshot()[attacker]["reasons"]


def test_plain_values_written_to_the_rounds_key_by_a_stock_client_do_not_stop_rounds(peers):
    # A stock hivemind peer writes long-lived plain values to the key every round's records go to (the module's
    # run, whose keys every peer here protects), before and between rounds.
    attacker = hivemind.DHT(initial_peers=[str(a) for a in peers[0].dht.visible_maddrs()], start=True)
    key = outer_rounds_key("gather", "router")
    try:
        attacker.store(key, b"junk", dht_time() + 3600)
        attacker.store(key, b"junk", dht_time() + 3600, subkey=b"12D3KooWjunk")
        with start_averagers(peers, "router") as averagers:
            for n in range(100, 102):
                results = run_all(averagers, noisy_deltas(4, seed=n), [CAP] * 4, round_id=n)
                assert all(r is not None for r in results), [a.last_report for a in averagers]
                attacker.store(key, b"junk", dht_time() + 3600 + n)
        for p in peers:  # every peer still holds the signed entries, and only those
            stored = p.dht.local_dict(key)
            assert stored and all(isinstance(s, bytes) and s.startswith(b"px-ed25519:") for s in stored), stored
    finally:
        attacker.shutdown()


def test_a_peer_that_keeps_attacking_is_banned_and_left_out(peers):
    scores = [PeerScores() for _ in peers]
    with start_averagers(peers, "attacked", scores) as averagers:
        attacker = peers[0].dht.peer_id
        for n in range(4):
            deltas = noisy_deltas(4, seed=10 + n)
            deltas[0] = {name: 1000 * t for name, t in deltas[0].items()}
            results = run_all(averagers, deltas, [CAP] * 4, round_id=n)
            assert all(r is not None for r in results[1:]), [a.last_report for a in averagers]
            if n < 3:
                assert all(attacker in a.last_report.participants for a in averagers[1:])
        # three clipped contributions: every honest peer bans it, and its fourth is not merged
        assert all(s.banned(attacker) for s in scores[1:]) and not scores[0].banned(attacker)
        assert all(attacker not in a.last_report.participants for a in averagers[1:])
        assert all(len(a.last_report.participants) == 3 for a in averagers[1:])

