"""Gathered outer rounds over real hivemind DHT peers and P2P streams on loopback: every participant fetches
every contribution and merges them itself, robustly; an attacking participant moves the result little and is
named.

Four DHT peers (each with its network loop and contribution server) live for the module; each test runs its
rounds under a run id of its own and shuts its averagers down in ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import hivemind
import numpy as np
import pytest
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from parallax.benchmarks.attacks import whole_merges
from parallax.benchmarks.bytes import block_bytes, parts_bytes
from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.keys import outer_rounds_key
from parallax.dht.testing import LocalSwarm, fixed_identity, wait_until
from parallax.node.net.network import NetworkLoop
from parallax.node.net.scores import PeerScores
from parallax.node.outer import transport
from parallax.node.outer.averager import GroupAverager, RoundStatus
from parallax.node.outer.blocks import BlockedBody, block_layout, decode_all, encode_blocks, parse_wanted
from parallax.node.outer.partitioned import MERGED_WIRE, Unmergeable, assignment, merge_in_blocks
from parallax.node.outer.transport import (
    ROUND_RECORD_MAX_BYTES,
    WITHDRAWN,
    ContributionServicer,
    ContributionStore,
    OuterGather,
    RecordWatch,
    RoundEntry,
    RoundPeers,
    body_digest,
    decode_contribution,
    decode_entries,
    encode_contribution,
    encode_record,
    pair,
)
from parallax.node.outer.wire import FingerprintSigner, OuterSyncConfig
from parallax.node.outer.witness import sign
from parallax.node.train.robust import robust_merge_groups
from parallax.protocol import codec
from parallax.protocol.codec import encode
from parallax.protocol.errors import MalformedMessage

pytestmark = pytest.mark.timeout(90)

SHAPES = {"w": (64, 100), "b": (32,)}
CAP = 1000.0


@dataclass
class Peer:
    dht: SwarmDHT
    loop: NetworkLoop
    gather: OuterGather
    signer: FingerprintSigner


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    swarm = LocalSwarm(run_id="gather", groups=("router",))
    made: list[Peer] = []
    try:
        for i in range(4):
            swarm.add_dht(fixed_identity(i))
        keys = {p.dht.peer_id: p.identity.public_key for p in swarm.peers}
        for p in swarm.peers:
            loop = NetworkLoop(p.dht, f"net-{p.fp}")
            gather = OuterGather(loop.p2p, loop.loop, "gather").start()
            made.append(Peer(p.dht, loop, gather, FingerprintSigner(p.identity, keys.get)))
        yield made
    finally:
        for p in made:
            p.gather.close()
            p.loop.close()
        swarm.close()


def _gathered(**changes: typing.Any) -> OuterSyncConfig:
    """The loopback outer settings of a gathered round on the fp16 wire, with ``changes``."""
    return OuterSyncConfig.loopback(compression="fp16", aggregation="gather", **changes)


@contextlib.contextmanager
def _averagers(peers: Sequence[Peer], group: str, scores: Sequence[PeerScores | None] | None = None,
               round_peers: RoundPeers | Sequence[RoundPeers] | None = None,
               quorum_waits: Sequence[float] | None = None,
               gathers: Sequence[OuterGather] | None = None, compression: str = "fp16",
               timings: dict[str, float] | None = None, aggregation: str = "gather",
               shapes: Mapping[str, tuple[int, ...]] = SHAPES) -> Iterator[list[GroupAverager]]:
    """One averager of ``group`` per peer, shut down on leaving (also when one fails to start); the live
    composers are ``peers`` unless ``round_peers`` (one for all, or one per peer) says otherwise. A round waits up
    to 15 s for a quorum (the loopback profile's 4 s ran out on a machine busy with other work; ``quorum_waits``:
    each peer's wait instead): these tests are about what is merged. ``gathers``: each peer's contribution server
    and fetcher instead of the module's; ``compression``: the wire (fp16); ``timings``: other loopback timings
    (``net.outer``); ``aggregation``: gathered or partitioned; ``shapes``: the group's tensors."""
    ids = [p.dht.peer_id for p in peers]
    round_peers = round_peers or RoundPeers(lambda: ids)
    each = [round_peers] * len(peers) if isinstance(round_peers, RoundPeers) else list(round_peers)
    with contextlib.ExitStack() as stack:
        averagers = []
        for p, score, wait, gather, whom in zip(peers, scores or [None] * len(peers),
                                                quorum_waits or [15.0] * len(peers),
                                                gathers or [p.gather for p in peers], each, strict=True):
            config = OuterSyncConfig.loopback(compression=compression, aggregation=aggregation,
                                              matchmaking_timeout_s=wait, **(timings or {}))
            averagers.append(stack.enter_context(GroupAverager(
                p.dht, "gather", group, shapes, config, p.signer, gather=gather, peers=whom,
                weight_cap=CAP, scores=score)))
        yield averagers


@contextlib.contextmanager
def _gathers(peers: Sequence[Peer], name: str, one: int,
             servicer: Callable[[ContributionStore], ContributionServicer]) -> Iterator[list[OuterGather]]:
    """A contribution server and fetcher of its own per peer, named ``name``, peer ``one``'s answering with
    ``servicer(store)``; closed on leaving."""
    gathers: list[OuterGather] = []
    try:
        for i, p in enumerate(peers):
            gather = OuterGather(p.loop.p2p, p.loop.loop, name)
            if i == one:
                gather.servicer = servicer(gather.store)
            gathers.append(gather.start())
        yield gathers
    finally:
        for gather in gathers:
            gather.close()


def _deltas(n: int, seed: int, shapes: Mapping[str, tuple[int, ...]] = SHAPES) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    true = {name: torch.randn(shape, generator=g) * 0.01 for name, shape in shapes.items()}
    return [{name: t + 0.5 * torch.randn(t.shape, generator=g) * 0.01 for name, t in true.items()} for _ in range(n)]


def _run(averagers: Sequence[GroupAverager], deltas, tokens, round_id: int,
         fault: Callable | None = None) -> list[dict[str, torch.Tensor] | None]:
    with ThreadPoolExecutor(len(averagers)) as pool:
        futures = [pool.submit(a.run_round, d, t, round_id=round_id, fault=fault if i == 0 else None)
                   for i, (a, d, t) in enumerate(zip(averagers, deltas, tokens, strict=True))]
        return [f.result(timeout=60) for f in futures]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_four_peers_merge_exactly_what_one_process_merges_from_the_same_bodies(peers, compression):
    with _averagers(peers, f"router-{compression}", compression=compression) as averagers:
        deltas, tokens = _deltas(4, seed=0), [CAP, CAP, CAP / 2, CAP]
        results = _run(averagers, deltas, tokens, round_id=7)
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
        deltas = _deltas(4, seed=1)
        with ThreadPoolExecutor(4) as pool:
            rounds = [f.result(timeout=60) for f in [pool.submit(a.round, d, t, 8)
                                                     for a, d, t in zip(averagers, deltas, tokens, strict=True)]]
        for r, d in zip(rounds, deltas, strict=True):
            assert r.merged is not None and r.report.status is RoundStatus.OK and r.sent is not None
            decoded = decode_contribution(encode_contribution(d, compression), SHAPES, peer="p")
            assert all(torch.equal(r.sent[n], decoded[n]) for n in SHAPES)


PARTS = {"w": (128, 256), "b": (32,)}  # 32,800 entries: 9 blocks, 2 or 3 for each of four mergers


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
            _averagers(peers, "parts", compression="int4", aggregation="parts", shapes=PARTS) as averagers:
        deltas, tokens = _deltas(4, seed=0, shapes=PARTS), [CAP, CAP, CAP / 2, CAP]
        before = [p.gather.bytes_fetched for p in peers]
        results = _run(averagers, deltas, tokens, round_id=7)
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


def test_each_peer_is_told_of_the_others_answers_and_never_of_its_own(peers):
    """What a node's transport tells of each peer's answers (``OuterGather.answered``: the membership counts them as
    the peer being there) names, in a partitioned round, every other sender whose blocks it fetched, and not itself."""
    ids = [p.dht.peer_id for p in peers]
    heard: list[list[str]] = [[] for _ in peers]
    try:
        for p, told in zip(peers, heard, strict=True):
            p.gather.answered = told.append
        with _averagers(peers, "heard", compression="int4", aggregation="parts", shapes=PARTS) as averagers:
            results = _run(averagers, _deltas(4, seed=5, shapes=PARTS), [CAP] * 4, round_id=1)
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
    with _averagers(peers, "parts-liar", scores=scores, compression="int4", aggregation="parts", shapes=PARTS,
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
        deltas, tokens = _deltas(4, seed=2, shapes=PARTS), [CAP] * 4
        results = _run(averagers, deltas, tokens, round_id=3)
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
            _averagers(peers, "parts-silent", compression="int4", aggregation="parts", shapes=PARTS) as averagers:
        silent = averagers[0]._gathered.parts if averagers[0]._gathered is not None else None
        assert silent is not None
        resume = threading.Event()

        def stuck(*args, **kwargs):
            resume.wait(60)
            raise Unmergeable("stopped", peers[0].dht.peer_id)

        silent.merge = stuck
        deltas, tokens = _deltas(4, seed=4, shapes=PARTS), [CAP] * 4
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
    with _gathers(peers[:2], "watched", 0, ContributionServicer) as (server, asker):
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
            _gathers(peers, "gather-no-record", 0, _NoRecord) as gathers, \
            _averagers(peers, "parts-no-record", compression="int4", aggregation="parts", shapes=PARTS,
                       gathers=gathers) as averagers:
        deltas, tokens = _deltas(4, seed=5, shapes=PARTS), [CAP] * 4
        results = _run(averagers, deltas, tokens, round_id=3)
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
    with _gathers(peers, "gather-noted", 0, _NotingBlocks) as gathers, \
            _averagers(peers, "parts-noted", compression="int4", aggregation="parts", shapes=PARTS,
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
            deltas = _deltas(4, seed=round_id, shapes=PARTS)
            results = _run(averagers, deltas, tokens, round_id=round_id)
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
            _gathers(peers, "gather-drops", 0, _DropsARecheck) as gathers, \
            _averagers(peers, "parts-drops", compression="int4", aggregation="parts", shapes=PARTS,
                       gathers=gathers) as averagers:
        _run(averagers, _deltas(4, seed=6, shapes=PARTS), [CAP] * 4, round_id=1)
        participants = tuple(sorted(pair(p.dht.peer_id, 2) for p in peers))
        shares = assignment(participants, len(block_layout(PARTS)))
        servicer = typing.cast(_DropsARecheck, gathers[0].servicer)
        servicer.dropping = {p.dht.peer_id: set(shares[pair(p.dht.peer_id, 2)]) for p in peers[1:]}
        parts = [a._gathered.parts if a._gathered is not None else None for a in averagers[1:]]
        before = [p.rechecked if p is not None else 0 for p in parts]
        deltas = _deltas(4, seed=7, shapes=PARTS)
        results = _run(averagers, deltas, [CAP] * 4, round_id=2)
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
    with _gathers(peers, "no-blocks", 0, _NoBlocks) as gathers, \
            _averagers(peers, "parts-no-blocks", compression="int4", aggregation="parts", shapes=PARTS,
                       gathers=gathers) as averagers:
        for round_id in (1, 2, 3, 4):
            results = _run(averagers, _deltas(4, seed=round_id, shapes=PARTS), [CAP] * 4, round_id=round_id)
            statuses.append([a.last_report.status for a in averagers[1:]])
            if round_id >= 3:
                for a, merged in zip(averagers[1:], results[1:], strict=True):
                    assert a.last_report.status is RoundStatus.OK, (statuses, a.last_report)
                    assert set(a.last_report.participants) == honest and merged is not None


def test_each_contribution_is_fetched_once_by_each_peer(peers):
    """Over three rounds of four peers, each peer downloads each other's body at most once and serves its own at most
    once to each other (a fetch that ended between two passes of a round is taken, not started again)."""
    with _averagers(peers, "once", compression="int4") as averagers:
        before = [(p.gather.bytes_fetched, p.gather.servicer.bytes_served) for p in peers]
        sizes = []
        for round_id in range(1, 4):
            deltas = _deltas(4, seed=round_id)
            sizes.append([len(encode_contribution(d, "int4")) for d in deltas])
            _run(averagers, deltas, [CAP] * 4, round_id=round_id)
        for i, (p, (fetched, served)) in enumerate(zip(peers, before, strict=True)):
            others = sum(size for by_peer in sizes for j, size in enumerate(by_peer) if j != i)
            own = sum(3 * by_peer[i] for by_peer in sizes)
            assert 0 < p.gather.bytes_fetched - fetched <= others, (i, p.gather.bytes_fetched - fetched, others)
            assert 0 < p.gather.servicer.bytes_served - served <= own, (i, p.gather.servicer.bytes_served - served, own)


def test_a_recorded_merge_gives_the_inner_products_of_its_contributions_and_its_result(peers):
    """With ``net.outer.record_merges`` an applied round's report carries its contributions' inner products with each
    other and with the result, in its participants' order, with their capped weights."""
    deltas = _deltas(3, seed=41)
    with _averagers(peers[:3], "geometry", timings={"record_merges": True}) as averagers:
        results = _run(averagers, deltas, [CAP, CAP / 2, CAP], round_id=1)
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
    deltas, tokens = _deltas(4, seed=43, shapes=PARTS), [CAP, CAP / 2, CAP, CAP]
    with _averagers(peers, "parts-geometry", compression="int4", aggregation="parts", shapes=PARTS,
                    timings={"record_merges": True}) as averagers:
        results = _run(averagers, deltas, tokens, round_id=1)
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


def test_a_peer_whose_anchor_drifted_applies_the_round_and_is_told_who_holds_the_swarms(peers):
    g = torch.Generator().manual_seed(3)
    anchor = [torch.randn(shape, generator=g) for shape in SHAPES.values()]
    drifted = [anchor[0] + 0.05 * torch.randn(anchor[0].shape, generator=g), anchor[1]]  # it missed a round
    with _averagers(peers, "router-anchors") as averagers:
        deltas, tokens = _deltas(4, seed=5), [CAP] * 4
        with ThreadPoolExecutor(4) as pool:
            rounds = [f.result(timeout=60) for f in [
                pool.submit(a.round, d, t, 3, drifted if i == 3 else anchor)
                for i, (a, d, t) in enumerate(zip(averagers, deltas, tokens, strict=True))]]
    assert all(r.merged is not None and r.report.status is RoundStatus.OK for r in rounds), [r.report for r in rounds]
    assert [r.report.apart_from for r in rounds[:3]] == [(), (), ()]
    assert set(rounds[3].report.apart_from) == {p.dht.peer_id for p in peers[:3]}


def test_live_composers_that_never_contribute_stall_no_round_once_idle_and_contributions_are_work(peers):
    """Two of four live composers contribute; the two that never do are idle (left out of ``working``): the
    rounds merge the two without waiting on a quorum of four, and each tells the other's work. The idle two have no
    rounds record, and are asked for none (the DHT read shows that, whoever it names)."""
    ids = [p.dht.peer_id for p in peers]
    seen: list[str] = []
    with _averagers(peers[:2], "idle", round_peers=RoundPeers(lambda: ids, lambda: ids[:2], seen.append)) as avg:
        for round_id in (1, 2):
            results = _run(avg, _deltas(2, seed=round_id), [CAP, CAP], round_id=round_id)
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
    deltas = _deltas(3, seed=7)
    deltas[2] = {name: torch.zeros_like(t) for name, t in deltas[2].items()}
    with _averagers(peers[:3], "zeros", round_peers=RoundPeers(lambda: ids, lambda: ids, seen.append)) as avg:
        results = _run(avg, deltas, [CAP, CAP, CAP], round_id=1)
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
    with _averagers(peers, "vouching", round_peers=views) as averagers:
        results = _run(averagers[:3], _deltas(3, seed=11), [CAP] * 3, round_id=1)
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
            _averagers(peers, "narrow", round_peers=views) as averagers:
        results = _run(averagers, _deltas(4, seed=9), [CAP] * 4, round_id=2)
        for a, merged in zip(averagers, results, strict=True):
            assert merged is not None and a.last_report.status is RoundStatus.OK, a.last_report
            assert len(a.last_report.participants) == 4, a.last_report
    assert "contributions more of their senders merged" not in caplog.text


@pytest.mark.parametrize("attack", ["x1000", "x-10", "weight 1e12"])
def test_one_attacker_moves_the_honest_merge_less_than_an_honest_peer_differs(peers, attack):
    # A group of its own per attack: the same identities claiming round 3 of one group again would be skipped.
    with _averagers(peers, "backbone-" + attack.replace(" ", "-")) as averagers:
        deltas = _deltas(4, seed=2)
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
        results = _run(averagers, deltas, tokens, round_id=3)
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
    with _averagers(peers, "replayed", scores, quorum_waits=[3.0, 15.0, 15.0, 15.0]) as averagers:
        first = _deltas(4, seed=7)
        attacker = peers[0].dht.peer_id
        results = _run(averagers, first, [CAP] * 4, round_id=1)
        # The honest three merged peer 0's round-1 contribution, the one it replays next (peer 0's own round may
        # end on its short wait before it fetched theirs when the machine is loaded: not what is under test).
        for a, result in zip(averagers[1:], results[1:], strict=True):
            assert result is not None and attacker in a.last_report.participants, a.last_report
        again = _deltas(4, seed=8)
        again[0] = first[0]  # peer 0 sends its round-1 pseudo-gradient again
        _run(averagers, again, [CAP] * 4, round_id=2)
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
        with _averagers(peers, "router") as averagers:
            for n in range(100, 102):
                results = _run(averagers, _deltas(4, seed=n), [CAP] * 4, round_id=n)
                assert all(r is not None for r in results), [a.last_report for a in averagers]
                attacker.store(key, b"junk", dht_time() + 3600 + n)
        for p in peers:  # every peer still holds the signed entries, and only those
            stored = p.dht.local_dict(key)
            assert stored and all(isinstance(s, bytes) and s.startswith(b"px-ed25519:") for s in stored), stored
    finally:
        attacker.shutdown()


def test_a_peer_that_keeps_attacking_is_banned_and_left_out(peers):
    scores = [PeerScores() for _ in peers]
    with _averagers(peers, "attacked", scores) as averagers:
        attacker = peers[0].dht.peer_id
        for n in range(4):
            deltas = _deltas(4, seed=10 + n)
            deltas[0] = {name: 1000 * t for name, t in deltas[0].items()}
            results = _run(averagers, deltas, [CAP] * 4, round_id=n)
            assert all(r is not None for r in results[1:]), [a.last_report for a in averagers]
            if n < 3:
                assert all(attacker in a.last_report.participants for a in averagers[1:])
        # three clipped contributions: every honest peer bans it, and its fourth is not merged
        assert all(s.banned(attacker) for s in scores[1:]) and not scores[0].banned(attacker)
        assert all(attacker not in a.last_report.participants for a in averagers[1:])
        assert all(len(a.last_report.participants) == 3 for a in averagers[1:])


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
    config = _gathered()
    holder = peers[3].dht.peer_id
    hold_s = 2 * config.net.next_chunk_timeout_s
    with _gathers(peers, "held", 3, lambda store: _HeldAnswers(store, hold_s=hold_s)) as gathers:
        scores = [PeerScores() for _ in peers]
        with _averagers(peers, "held", scores, gathers=gathers) as averagers:
            _merged_without(peers, averagers, 3, _deltas(4, seed=21), round_id=1, honest=3)
            for score in scores[:3]:
                wait_until(lambda score=score: holder in score.snapshot(), timeout=30)  # the fetch's own bound
                reasons = score.snapshot()[holder]["reasons"]
                assert reasons == {"outer contribution fetch accepted and then held": 1}, reasons
                assert not score.banned(holder)
            assert isinstance(gathers[3].servicer, _HeldAnswers) and gathers[3].servicer.asked == 3

            _merged_without(peers, averagers, 3, _deltas(4, seed=22), round_id=2, honest=2)  # peer 2 sits it out
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
    with _gathers(peers, "trickled", 3, _TrickledAnswers) as gathers:
        scores = [PeerScores() for _ in peers]
        with _averagers(peers, "trickled", scores, gathers=gathers, timings=timings) as averagers:
            _merged_without(peers, averagers, 3, _deltas(4, seed=31), round_id=1, honest=3)
            wait_until(lambda: all(a._gathered is not None and trickler in a._gathered._held_peers()
                                   for a in averagers[:3]), timeout=30)  # the fetch's overall bound
            _merged_without(peers, averagers, 3, _deltas(4, seed=32), round_id=2, honest=2)  # peer 2 sits it out
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
    with _gathers(peers, f"parts-{kind}", 3, servicer) as gathers:
        scores = [PeerScores() for _ in peers]
        with _averagers(peers, f"parts-{kind}", scores, gathers=gathers, timings=timings, compression="int4",
                        aggregation="parts", shapes=shapes) as averagers:
            _merged_without(peers, averagers, 3, _deltas(4, seed=33, shapes=shapes), round_id=1, honest=3)
            wait_until(lambda: all(a._gathered is not None and odd in a._gathered._held_peers()
                                   for a in averagers[:3]), timeout=30,
                       explain=lambda: repr([(a._gathered._held_peers(), a._gathered._refused)
                                             for a in averagers[:3] if a._gathered is not None]))
            _merged_without(peers, averagers, 3, _deltas(4, seed=34, shapes=shapes), round_id=2, honest=2)
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
    config = _gathered()
    pair = peers[:2]
    hold_s = 2 * config.net.next_chunk_timeout_s
    with _gathers(pair, "held-once", 1, lambda store: _HeldOnce(store, hold_s=hold_s)) as gathers:
        ids = [p.dht.peer_id for p in pair]
        with _averagers(pair, "held-once", gathers=gathers, round_peers=RoundPeers(lambda: ids)) as averagers:
            first = _run(averagers, _deltas(2, seed=31), [CAP] * 2, round_id=1)
            assert first[0] is None, averagers[0].last_report  # the held fetch: no quorum of two
            assert isinstance(gathers[1].servicer, _HeldOnce) and gathers[1].servicer.asked >= 1
            second = _run(averagers, _deltas(2, seed=32), [CAP] * 2, round_id=2)
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
    config = _gathered(**timings)
    # 30 messages 2.5 s apart: 75 s in all
    answers = functools.partial(_SlowAnswers, pieces=30, every_s=config.net.next_chunk_timeout_s / 2)
    with _gathers(peers, "slow", 3, answers) as gathers:
        slow = gathers[3].servicer
        assert isinstance(slow, _SlowAnswers)
        with _averagers(peers, "slow", gathers=gathers, timings=timings) as averagers:
            deltas = _deltas(4, seed=23)
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
        _run(averagers[:3], _deltas(3, seed=seed + n, shapes=shapes), [CAP] * 3, round_id=n)
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
        claim = RoundEntry(n, body_digest(other), len(other), entry.tokens, session=entry.session)
        gathered._entries[n] = sign(peers[0].signer.identity, "gather", group, claim)  # in place: beside its round
        entries = dict(gathered._entries)
        gathered.records.store(encode_record([entries[k] for k in sorted(entries)]))

    scores = [PeerScores() for _ in peers]
    reason = "two signed contributions for one round"
    with _gathers(peers, "equivocate", 0, lambda store: _Equivocating(store, switch=switch)) as made:
        gathers.extend(made)
        with _averagers(peers, "equivocate", scores, gathers=made) as averagers:
            holder.append(averagers[0])
            _rounds_until_two_ban(averagers, scores, reason, seed=40)
            honest = sorted(p.dht.peer_id for p in peers[1:])
            for attempt in range(3):  # a round may still be lost to a view of the ban that came late
                results = _run(averagers[1:], _deltas(3, seed=50 + attempt), [CAP] * 3, round_id=10 + attempt)
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
    with _averagers(peers, "bad-block", scores, compression="int4", aggregation="parts", shapes=PARTS) as averagers:
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
            results = _run(averagers[1:], _deltas(3, seed=70 + attempt, shapes=PARTS), [CAP] * 3,
                           round_id=10 + attempt)
            if all(r is not None for r in results):
                break
        for a, merged in zip(averagers[1:], results, strict=True):
            assert merged is not None and sorted(a.last_report.participants) == honest, a.last_report


def test_a_restarted_node_skips_the_rounds_its_earlier_process_claimed(peers):
    """The four peers merge round 5, then restart (new averagers: new sessions, the same identities) from a checkpoint
    before it: round 5 again is skipped at once by each, since claiming it again would be a second, different claim
    of it (the others merged the first under the same name); round 6 merges as usual, and nobody holds anything
    against anybody."""
    scores = [PeerScores() for _ in peers]
    with _averagers(peers, "restarted", scores) as averagers:
        assert all(r is not None for r in _run(averagers, _deltas(4, seed=60), [CAP] * 4, round_id=5))
    with _averagers(peers, "restarted", scores) as averagers:
        assert all(r is None for r in _run(averagers, _deltas(4, seed=61), [CAP] * 4, round_id=5))
        for a in averagers:
            assert a.last_report.status is RoundStatus.CLAIMED_BEFORE and not a.last_report.needs_reload, a.last_report
        results = _run(averagers, _deltas(4, seed=62), [CAP] * 4, round_id=6)
        assert all(r is not None for r in results), [a.last_report for a in averagers]
    assert all(score.snapshot() == {} for score in scores)


def test_peers_at_different_round_numbers_merge_their_current_contributions(peers):
    # Composers reach a round at their own steps: their round numbers differ, their rounds still meet.
    with _averagers(peers, "latent") as averagers:
        deltas, tokens = _deltas(4, seed=4), [CAP] * 4
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(a.run_round, d, t, round_id=n) for a, d, t, n in
                       zip(averagers, deltas, tokens, (5, 6, 7, 9), strict=True)]
            results = [f.result(timeout=60) for f in futures]
        assert all(r is not None for r in results), [a.last_report for a in averagers]
        assert all(len(a.last_report.participants) == 4 for a in averagers)
        assert all(torch.equal(r["w"], results[0]["w"]) for r in results)


def test_a_peer_that_comes_after_the_others_merged_skips_the_round(peers):
    # Peer 3 comes late: the others merged without it. Its contribution was never fetched, so it skips this
    # round without reloading (its progress goes into its next round) and the next round includes it again.
    # It waits 3 s for a quorum that is not coming.
    with _averagers(peers, "latecomer", quorum_waits=[15.0, 15.0, 15.0, 3.0]) as averagers:
        deltas, tokens = _deltas(4, seed=5), [CAP] * 4
        with ThreadPoolExecutor(3) as pool:
            early = [pool.submit(a.run_round, d, t, round_id=5) for a, d, t in
                     zip(averagers[:3], deltas[:3], tokens[:3], strict=True)]
            results = [f.result(timeout=60) for f in early]
        assert all(r is not None for r in results), [a.last_report for a in averagers[:3]]
        assert all(len(a.last_report.participants) == 3 for a in averagers[:3])
        assert averagers[3].run_round(deltas[3], tokens[3], round_id=5) is None
        report = averagers[3].last_report
        assert report.status is RoundStatus.NO_GROUP and not report.needs_reload, report
        results = _run(averagers, _deltas(4, seed=6), tokens, round_id=6)
        assert all(r is not None for r in results) and len(averagers[3].last_report.participants) == 4


def test_a_peer_whose_set_the_others_merged_elsewhere_ends_its_round_as_soon_as_they_move_on(peers):
    """Peer 3 starts its round while the others, who stopped waiting for it, are merging theirs: it merges their
    contributions with its own, but they verify their set of three and go on to their next round. Nobody can
    apply peer 3's set: once its other senders are past it, peer 3 ends its round (no reload: nobody fetched its
    contribution) instead of waiting out its verification (20 s here), and its next round meets theirs."""
    config = _gathered(min_matchmaking_time_s=3.0, matchmaking_timeout_s=25.0, verify_timeout_s=20.0)
    ids = [p.dht.peer_id for p in peers]
    merging, go, hold = _held_merges()
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", "superseded", SHAPES, config, p.signer, gather=p.gather,
            peers=RoundPeers(lambda: ids), weight_cap=CAP)) for p in peers]
        deltas, tokens = _deltas(4, seed=7), [CAP] * 4
        with ThreadPoolExecutor(4) as pool:
            first = [pool.submit(a.run_round, d, t, round_id=5, fault=hold)
                     for a, d, t in zip(averagers[:3], deltas[:3], tokens[:3], strict=True)]
            for _ in range(3):
                assert merging.acquire(timeout=60), [a.last_report for a in averagers[:3]]
            late = pool.submit(averagers[3].run_round, deltas[3], tokens[3], round_id=5)
            wait_until(lambda: _merged_round(averagers[3], ids[3], 5), timeout=30)
            go.set()
            assert all(f.result(timeout=60) is not None for f in first), [a.last_report for a in averagers[:3]]
            assert all(len(a.last_report.participants) == 3 for a in averagers[:3])
            nxt = [pool.submit(a.run_round, d, t, round_id=6)
                   for a, d, t in zip(averagers[:3], _deltas(3, seed=8), tokens[:3], strict=True)]
            assert late.result(timeout=60) is None
            report = averagers[3].last_report
            assert report.status is RoundStatus.SUPERSEDED and not report.needs_reload, report
            assert all(f.result(timeout=60) is not None for f in nxt), [a.last_report for a in averagers[:3]]
        results = _run(averagers, _deltas(4, seed=9), tokens, round_id=7)
        assert all(r is not None for r in results), [a.last_report for a in averagers]
        assert all(len(a.last_report.participants) == 4 for a in averagers)


def test_a_contribution_stays_on_offer_until_its_round_is_told_to_end(peers):
    """Composers of unequal pace: two of four live composers reach their round and find no quorum (three); past
    their give-up time their contributions are still on offer (their rounds were not told to end), so a third that
    comes later merges with both. A waiting round told to end withdraws at once, and with nobody having fetched its
    contribution, nobody can have merged it: no reload."""
    config = _gathered(min_matchmaking_time_s=1.0, matchmaking_timeout_s=1.5)
    ids = [p.dht.peer_id for p in peers]
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", "offer", SHAPES, config, p.signer, gather=p.gather, peers=RoundPeers(lambda: ids),
            weight_cap=CAP)) for p in peers]
        deltas, dues = _deltas(3, seed=31), [threading.Event() for _ in range(3)]
        with ThreadPoolExecutor(3) as pool:
            try:
                early = [pool.submit(a.run_round, d, CAP, round_id=4, due=due)
                         for a, d, due in zip(averagers[:2], deltas[:2], dues[:2], strict=True)]
                began = time.monotonic()
                wait_until(lambda: time.monotonic() - began > 3 * config.net.matchmaking_timeout_s, timeout=30)
                records = averagers[2].records.read(ids[:2], 2.0)
                assert all(not f.done() for f in early), [a.last_report for a in averagers[:2]]
                assert all(not decode_entries(records[i])[4].fingerprint for i in ids[:2]), records
                late = pool.submit(averagers[2].run_round, deltas[2], CAP, round_id=9, due=dues[2])
                results = [f.result(timeout=60) for f in [*early, late]]
            finally:
                for due in dues:
                    due.set()
        assert all(r is not None for r in results), [a.last_report for a in averagers[:3]]
        assert all(sorted(a.last_report.participants) == sorted(ids[:3]) for a in averagers[:3])
        assert all(torch.equal(r["w"], results[0]["w"]) for r in results)

        due = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            try:
                alone = pool.submit(averagers[0].run_round, deltas[0], CAP, round_id=5, due=due)
                wait_until(lambda: 5 in decode_entries(averagers[1].records.read([ids[0]], 2.0).get(ids[0])),
                           timeout=30)
            finally:
                due.set()
            assert alone.result(timeout=30) is None
        report = averagers[0].last_report
        assert report.status is RoundStatus.NO_GROUP and not report.needs_reload, report


def test_a_set_merged_with_a_contribution_as_it_comes_off_offer_is_taken_by_its_sender(peers):
    """Peers 1 and 2 fetch peer 0's contribution and merge the three; before they publish it, peer 0 (whose view
    wants a larger quorum) is told its next round is due and takes its contribution off offer. It watches the
    records because its contribution was fetched, finds the set naming it (its view now wanting less) and merges
    it too: all three apply one result, none reloads, none applies a merge another does not."""
    config = _gathered(min_matchmaking_time_s=1.0, verify_timeout_s=20.0)
    ids = [p.dht.peer_id for p in peers]
    strangers = [p.dht.peer_id for p in peers[3:]] + ["QmS1ow1yTo5howUpAtA11aLONGTIMEhere1", "QmNeverC0mes2"]
    seen_by_0 = [*ids[1:3], *strangers]  # peer 0 waits for a quorum of four
    merging, go, hold = _held_merges()
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", "last-call", SHAPES, config, p.signer, gather=p.gather,
            peers=RoundPeers((lambda: list(seen_by_0)) if i == 0 else (lambda: ids[:3])), weight_cap=CAP))
            for i, p in enumerate(peers[:3])]
        deltas, due = _deltas(3, seed=37), threading.Event()
        with ThreadPoolExecutor(3) as pool:
            try:
                first = pool.submit(averagers[0].run_round, deltas[0], CAP, round_id=2, due=due)
                others = [pool.submit(a.run_round, d, CAP, round_id=2, fault=hold)
                          for a, d in zip(averagers[1:], deltas[1:], strict=True)]
                for _ in range(2):
                    assert merging.acquire(timeout=60), [a.last_report for a in averagers]
                due.set()
                wait_until(lambda: decode_entries(averagers[1].records.read([ids[0]], 2.0).get(ids[0])).get(
                    2, RoundEntry(2, b"", 1, 0.0)).fingerprint == WITHDRAWN, timeout=30)
                seen_by_0[:] = ids[1:3]
            finally:
                go.set()
                due.set()
            results = [f.result(timeout=60) for f in [first, *others]]
    assert all(r is not None for r in results), [a.last_report for a in averagers]
    assert all(sorted(a.last_report.participants) == sorted(ids[:3]) for a in averagers)
    assert all(torch.equal(r["w"], results[0]["w"]) for r in results)


def test_a_set_nobody_else_merges_is_taken_back_without_a_reload(peers):
    """Peer 0 counts peer 1 alone as live and merges the two; peer 1 wants a quorum of three and never takes that
    set. Nobody else published a result for peer 0's set, so nobody can have applied it: peer 0 takes its vote and
    contribution back and keeps its delta (no reload, which would take an anchor without its contribution)."""
    config = _gathered(min_matchmaking_time_s=1.0)
    ids = [p.dht.peer_id for p in peers]
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", "unanswered", SHAPES, config, p.signer, gather=p.gather,
            peers=RoundPeers((lambda: ids[:2]) if i == 0 else (lambda: ids)), weight_cap=CAP))
            for i, p in enumerate(peers[:2])]
        deltas, due = _deltas(2, seed=41), threading.Event()
        with ThreadPoolExecutor(2) as pool:
            try:
                waiting = pool.submit(averagers[1].run_round, deltas[1], CAP, round_id=3, due=due)
                assert averagers[0].run_round(deltas[0], CAP, round_id=3) is None
            finally:
                due.set()
            assert waiting.result(timeout=60) is None
    report = averagers[0].last_report
    assert report.status is RoundStatus.UNANSWERED and not report.needs_reload, report
    entry = decode_entries(averagers[1].records.read([ids[0]], 2.0).get(ids[0])).get(3)
    assert entry is not None and entry.fingerprint == WITHDRAWN, entry


def _held_merges() -> tuple[threading.Semaphore, threading.Event, Callable[[dict[str, torch.Tensor]], None]]:
    """(merging, go, hold): ``hold`` is a ``fault`` hook that stops a peer between its merge and its fingerprint,
    releasing ``merging`` once and waiting (bounded) for ``go``."""
    merging, go = threading.Semaphore(0), threading.Event()

    def hold(_merged: dict[str, torch.Tensor]) -> None:
        merging.release()
        go.wait(timeout=60)

    return merging, go, hold


def _merged_round(averager: GroupAverager, peer: str, n: int) -> bool:
    """Has ``peer`` published a fingerprint for its round ``n`` of ``averager``'s group?"""
    record = averager.records.read([peer], 2.0).get(peer)
    entry = decode_entries(record).get(n) if record is not None else None
    return entry is not None and bool(entry.fingerprint)


@pytest.mark.parametrize("blameless", [False, True])
def test_a_contribution_of_other_tensors_is_left_out_and_blamed_only_where_views_may_differ(peers, blameless):
    """Two peers name one round key for different tensors. In a shared group that is a forgery, counted against
    its sender; in a replicated experts' round (``other_tensors_blameless``) the owners' views differ for a moment:
    the contribution is left out and nobody is blamed. The second peer's tensors are larger too: the first refuses
    its body by the announced size alone (never fetched), the second by its tensors."""
    config = _gathered(matchmaking_timeout_s=3.0)  # no quorum comes: 3 s, not 15
    ids = [p.dht.peer_id for p in peers[:2]]
    scores = [PeerScores() for _ in range(2)]
    shapes = [SHAPES, {"w": SHAPES["w"], "other": (32768,)}]
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", f"experts-0-{int(blameless)}", s, config, p.signer, gather=p.gather,
            peers=RoundPeers(lambda: ids), weight_cap=CAP, scores=score, other_tensors_blameless=blameless))
            for p, s, score in zip(peers[:2], shapes, scores, strict=True)]
        g = torch.Generator().manual_seed(3)
        deltas = [{n: torch.randn(shape, generator=g) * 0.01 for n, shape in s.items()} for s in shapes]
        results = _run(averagers, deltas, [CAP, CAP], round_id=1)
    assert results == [None, None]  # neither merges the other's: no quorum of two
    for i, score in enumerate(scores):
        other = ids[1 - i]
        reasons = score.snapshot().get(other, {}).get("reasons", {})
        assert ("forged or malformed outer contribution" in reasons) is not blameless, (i, reasons)
