"""A set's merge shared among its senders (``sync.aggregation = "parts"``): each merges its blocks of everyone's
contribution, fetches the others' merged blocks, and recomputes some of them at random (BTARD's partitioned
aggregation with random checks).

The round around it is the gathered one (``gathered``): contributions on offer, the set settled among their senders,
the result's fingerprint verified by a majority of them. What changes is who merges what and what crosses the wire:

1. A sender's contribution is held in blocks (``blocks``): the group's tensors cut from their shapes alone, each block
   fetchable and checkable alone against the one root the sender signed in its round entry. A block under that root
   with non-finite values is proof against its sender (``witness.BadBlock``), which the finder shares.
2. The blocks of a set go to its senders by ``assignment``: an order drawn from the set's tag, the same on every
   peer, another for each set (a sender cannot pick the blocks it merges).
3. Each sender that merges the set announces it (its entry names the set, with no fingerprint yet), fetches its own
   blocks of every contribution of the set, merges them robustly block by block (``train.robust``: each block a
   tensor of its own, as ``train.parts`` measured), encodes the result in ``MERGED_WIRE``, serves it under
   ``merged_key`` and publishes its root in its entry (``RoundEntry.merged``).
4. It then fetches every other sender's merged blocks, each checked against that sender's published root. It learns
   of each root from the sender itself: the round holds a question for its record there, answered as soon as the
   record changes (``transport.RecordWatch``), where the DHT has it only after a store and a read (each 0.2-0.5 s on
   busy cores); a sender that does not answer is read from the DHT. The set's name and the root go out without waiting
   for their stores (``records.LatestRecord``). A sender that announces another set, withdrew, publishes no root
   within the wait (``verify_timeout_s`` to announce the set, ``allreduce_timeout_s`` more to publish), or serves
   blocks its root does not lead to, has its blocks merged by this node itself, from the contributions: a gathered
   round's cost for that share, so a round degrades to the gathered round's bytes, never to merging nothing.
5. It recomputes blocks of the others' shares drawn at random from the contributions (``rechecks``: a body's worth
   of fetches, a block of each merger in turn), fetched in one request per contribution for the shares whose mergers
   published their roots by then and merged at once, while the other shares come, and compares each share with them
   (``agrees``): a block off by more than ``RECHECK_TOLERANCE`` is evidence against its merger
   (``Evidence.MISMERGED``), whose blocks this node then merges itself; a recomputed block of a share that does not
   come is used as it is. Rechecks that cannot be made (a contribution's block does not arrive, asked for twice when
   the cause is no evidence) are skipped: the shares are here.

Every block anyone applies went through ``MERGED_WIRE`` once (the merger's own blocks included), so the peers that
took a set's blocks from its mergers, or merged some themselves, apply the same tensors.

Bytes each way per sender and round, n senders all merging: its blocks of the n - 1 other contributions, about
(n - 1) / n of a body; the other senders' merged blocks, (n - 1) / n of a merged body (int8: about twice the int4
body); the rechecks, about a body. About four int4 bodies at any n, where a gathered round moves n - 1
(``round_bytes``; ``parallax bench bytes``).

Not covered: a merger can pick the round numbers that give it the blocks it wants (the order is a hash of the set's
names), and a lie under ``RECHECK_TOLERANCE`` of a block passes its recheck; evidence of a lie is this node's own
(a score), not a proof others check.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from parallax.node.net.scores import Evidence, PeerScores
from parallax.node.outer.blocks import (
    MAX_BLOCKS,
    BlockedBody,
    BlockMismatch,
    assemble,
    block_layout,
    blocks_cap,
    decode_block,
)
from parallax.node.outer.records import POLL_S, RETRY_S
from parallax.node.outer.transport import (
    OuterGather,
    RoundEntry,
    pair,
    split_pair,
)
from parallax.node.outer.wire import OuterSyncConfig, encode_wire, round_tag
from parallax.node.outer.witness import BadBlock
from parallax.node.train.parts import Block
from parallax.node.train.robust import MergeAudit, merge_geometry, robust_merge_groups
from parallax.protocol.errors import MalformedMessage, NonFiniteTensor, SlowStream, StalledStream

logger = logging.getLogger(__name__)

__all__ = ["MERGED_WIRE", "RECHECK_TOLERANCE", "PartsMerge", "Unmergeable", "agrees", "assignment", "merge_blocks",
           "merge_in_blocks", "merged_key", "recheck_odds", "rechecks", "round_bytes"]

MERGED_WIRE = "uint8"
"""The wire of merged blocks: int8 with a scale per chunk, about twice an int4 contribution. Every peer applies the
same decoded blocks, so what the wire rounds off is the same everywhere; int4 there would round the merged update
without the error feedback a contribution's sender keeps."""
RECHECK_TOLERANCE = 1e-2
"""A recomputed block agrees with a merger's when their difference is at most this share of its norm: far above
the rounding of two machines' float arithmetic through ``MERGED_WIRE``, below any change that moves a round."""


_NOT_ASKED_AGAIN = (BlockMismatch, MalformedMessage, NonFiniteTensor, StalledStream, SlowStream, TimeoutError)
"""Why a recheck's blocks did not arrive that asking again would not mend: evidence against their sender, or a bound
spent already."""

Entries = Mapping[int, RoundEntry]
"""One peer's rounds record: round -> entry."""


def merged_key(group: str) -> str:
    """The store key (``transport.ContributionStore``) a node's merged blocks of ``group`` are served under."""
    return f"{group}#merged"


def assignment(participants: Sequence[str], count: int) -> dict[str, list[int]]:
    """contribution (``peer@round``) -> the blocks its sender merges, of ``count`` blocks: a contiguous range each
    (its proof is then about two hashes a level of the tree), about ``count / n`` blocks, in an order of the ``n``
    participants drawn from the set's tag; with more participants than blocks, some merge none."""
    tag = round_tag(0, participants)
    order = sorted(participants, key=lambda name: hashlib.sha256(tag + name.encode()).digest())
    out: dict[str, list[int]] = {name: [] for name in order}
    for i in range(count):
        out[order[i * len(order) // count]].append(i)
    return out


def agrees(recomputed: torch.Tensor, served: torch.Tensor) -> bool:
    """Does a merger's block agree with this node's recomputation of it (``RECHECK_TOLERANCE``)?"""
    diff = float(torch.linalg.vector_norm(recomputed - served, dtype=torch.float64))
    return diff <= RECHECK_TOLERANCE * float(torch.linalg.vector_norm(recomputed, dtype=torch.float64)) + 1e-12


def merge_blocks(parts: Sequence[Mapping[int, torch.Tensor]], want: Sequence[int], layout: Sequence[Block],
                 shapes: Mapping[str, Sequence[int]], weights: Sequence[float], config: OuterSyncConfig, *,
                 spans: Sequence[float] | None = None,
                 ) -> tuple[dict[int, torch.Tensor] | None, dict[int, bytes], MergeAudit]:
    """Blocks ``want`` (of ``layout``, ``block_layout(shapes)``) of the contributions ``parts`` (each: block -> rows),
    merged robustly block by block (each block a tensor of its own) and put through ``MERGED_WIRE`` (a tensor under
    ``SMALL_TENSOR_NUMEL`` entries raw): (the merged blocks as every peer applies them, or None when no contribution
    had weight; their encoded bytes; the robust merge's audit)."""
    merged, audit = robust_merge_groups([{str(i): p[i] for i in want} for p in parts], weights, config.method,
                                        eps=config.rda_eps, spans=spans)
    if merged is None:
        return None, {}, audit
    blobs, out = {}, {}
    for i in want:
        block = layout[i]
        blobs[i] = encode_wire(merged[str(i)].numpy(), math.prod(shapes[block.name]), MERGED_WIRE)
        out[i] = decode_block(blobs[i], block, shapes[block.name], peer="this node")
    return out, blobs, audit


def merge_in_blocks(contributions: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
                    config: OuterSyncConfig, *, spans: Sequence[float] | None = None,
                    ) -> tuple[dict[str, torch.Tensor] | None, list[int]]:
    """The partitioned merge of whole contributions in one process (the simulator, tests): every block merged as its
    merger merges it (``merge_blocks``), the blocks put together; with the merged blocks' encoded sizes."""
    shapes = {name: tuple(t.shape) for name, t in contributions[0].items()}
    layout = block_layout(shapes)
    parts = [{i: c[b.name][b.start:b.stop] for i, b in enumerate(layout)} for c in contributions]
    merged, blobs, _ = merge_blocks(parts, range(len(layout)), layout, shapes, weights, config, spans=spans)
    return (None if merged is None else assemble(merged, shapes)), [len(blobs[i]) for i in sorted(blobs)]


def rechecks(n: int, count: int, least: int) -> int:
    """How many blocks of the others' shares a sender recomputes among ``n`` senders of a body of ``count`` blocks: as
    many as a body's worth of fetches pays for (each a block of each of the n - 1 other contributions:
    ``count / (n - 1)``), at least ``least`` (``net.outer.parts_rechecks``)."""
    return max(least, count // max(1, n - 1))


def recheck_odds(n: int, count: int) -> float:
    """The odds that a sender makes each of its rechecks, among ``n`` senders of a body of ``count`` blocks: 1 while
    the blocks are at least the other senders, else ``count / (n - 1)``, so that a recheck costs a sender about a body
    at any n (a block of each other contribution) and each block is still recomputed about once a round."""
    return 1.0 if n - 1 <= count else count / (n - 1)


def round_bytes(block_sizes: Sequence[Sequence[int]], merged_sizes: Sequence[int], least: int = 1) -> int:
    """The bytes a partitioned round moves, all its senders together, every sender merging its share: each block of
    each contribution to the block's merger (none for its own), each merged block to the n - 1 others, and each
    sender's ``rechecks`` (each made with ``recheck_odds``), a block of each of the n - 1 other contributions (the
    mean block).

    Args:
        block_sizes: per contribution, its encoded blocks' sizes (``BlockedBody.blobs``).
        merged_sizes: the merged blocks' sizes (``merge_blocks``' blobs).
        least: ``net.outer.parts_rechecks``.
    """
    n, count = len(block_sizes), len(merged_sizes)
    merger = [i * n // count for i in range(count)]  # which position merges each block (``assignment``'s ranges)
    to_mergers = sum(sizes[b] for j, sizes in enumerate(block_sizes) for b in range(count) if merger[b] != j)
    mean_block = sum(map(sum, block_sizes)) / (n * count)
    checks = n * min(rechecks(n, count, least), count) * recheck_odds(n, count)
    return round(to_mergers + (n - 1) * sum(merged_sizes) + checks * (n - 1) * mean_block)


class Commits:
    """The other mergers of a round (their contributions' names) that published the root of their merged blocks, or
    whose wait for it ended whatever ended it, in the order they did."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._marked: list[str] = []

    def mark(self, name: str, *_: object) -> None:
        """``name`` committed (or was given up); also a future's done callback."""
        with self._changed:
            if name not in self._marked:
                self._marked.append(name)
                self._changed.notify_all()

    def marked_among(self, names: Collection[str]) -> list[str]:
        """Wait until one of ``names`` is marked (each merger's wait is bounded, and its end marks it); those marked
        by then, in the order they were."""
        with self._changed:
            self._changed.wait_for(lambda: any(name in names for name in self._marked))
            return [name for name in self._marked if name in names]


class Unmergeable(Exception):
    """A contribution's blocks did not arrive usable: this node cannot merge the set (its sender is named, and the
    contribution when it is one on offer)."""

    def __init__(self, message: str, peer: str, name: str = "") -> None:
        super().__init__(message)
        self.peer, self.name = peer, name


class PartsMerge:
    """One group's partitioned merges on one node (the module docstring).

    Args:
        group: the shared group.
        peer_id: this node's.
        shapes: the group's tensors.
        config: timings, merge rule, wire.
        gather: serves this node's blocks and fetches the others'.
        entries_of: the rounds records of the given peers (peer -> round -> entry): as each last answered the round's
            question for it (``transport.RecordWatch``), read from the DHT within a timeout for the others.
        announce: publishes this node's entry of a round (its number) naming a set and, once merged, the root of its
            merged blocks (b"" before).
        scores: where evidence against peers goes.
        worked: told of each peer whose blocks arrived usable, with the digest its claim signed (evidence of its
            work unless that is an all-zero contribution's).
        set_aside: told of each peer that held a fetch of blocks (its contribution's or its merged share) or
            trickled one past its bound: no round should wait for it.
        proven: given each block a sender signed that decodes to non-finite values (``witness.BadBlock``); returns
            whether it holds as proof (the sender is then banned there, else this node scores it as a forged block).
        pool: runs the fetches.
    """

    def __init__(self, *, group: str, peer_id: str, shapes: Mapping[str, Sequence[int]], config: OuterSyncConfig,
                 gather: OuterGather, entries_of: Callable[[Sequence[str], float], Mapping[str, Entries]],
                 announce: Callable[[int, tuple[str, ...], bytes], None], scores: PeerScores | None,
                 worked: Callable[[str, bytes], None] | None, pool: ThreadPoolExecutor,
                 set_aside: Callable[[str], None] | None = None,
                 proven: Callable[[BadBlock], bool] | None = None) -> None:
        self.group, self.peer_id, self.config, self.gather = group, peer_id, config, gather
        self.shapes = {name: tuple(s) for name, s in shapes.items()}
        self.layout = block_layout(self.shapes)
        self.count = len(self.layout)
        self.entries_of, self.announce, self.scores, self.worked, self.pool = entries_of, announce, scores, worked, pool
        self.set_aside, self.proven = set_aside, proven
        self.rechecked = 0
        """Blocks of others recomputed so far, and how many disagreed (``mismerged``)."""
        self.mismerged = 0

    def merge(self, n: int, participants: tuple[str, ...], claims: Mapping[str, RoundEntry],
              mine: Mapping[str, torch.Tensor], weights: Sequence[float], spans: Sequence[float] | None,
              ) -> tuple[dict[str, torch.Tensor] | None, MergeAudit | None, dict[str, Any] | None]:
        """The merge of ``participants``' contributions (sorted pairs; ``claims``: the signed entry of each but ours,
        ``mine``: ours as the others decode it), shared with their senders.

        Returns:
            (the merged tensors, or None when no contribution had weight; the robust merge's audit of this node's
            own blocks, or None when it merged none; with ``net.outer.record_merges``, ``train.robust.merge_geometry``
            of those blocks under ``blocks``, their indices, or None).

        Raises:
            Unmergeable: a contribution's blocks did not arrive usable.
        """
        me = pair(self.peer_id, n)
        owners = assignment(participants, self.count)
        began = time.monotonic()
        self.announce(n, participants, b"")
        announced = merged_own = time.monotonic()
        own = owners.get(me, [])
        blocks: dict[int, torch.Tensor] = {}
        audit, geometry = None, None
        if own:
            fetched: list[dict[int, torch.Tensor]] | None = [] if self.config.net.record_merges else None
            got, blobs, audit = self._merge_here(me, own, participants, claims, mine, weights, spans, fetched=fetched)
            if got is None:
                return None, audit, None
            if fetched:  # inner products add up over disjoint blocks: the mergers' shares sum to the whole merge's
                geometry = {**merge_geometry([{str(i): p[i] for i in own} for p in fetched],
                                             {str(i): got[i] for i in own}), "blocks": own}
            body = BlockedBody(tuple(blobs[i] for i in own))
            self.gather.store.put(merged_key(self.group), n, body)
            merged_own = time.monotonic()
            self.announce(n, participants, body.digest)
            blocks.update(got)
        published = time.monotonic()
        others = {name: want for name, want in owners.items() if name != me and want}
        commits = Commits()
        flights = self._await_mergers(n, others, participants, commits)
        # While the others' shares come: this node's own merge of blocks of theirs drawn at random, to check the
        # shares against (and to use for any share that does not come). The blocks of a merger's share are asked of
        # their senders once that merger published its root (or was given up): a merger learns which of its blocks
        # are checked only after it committed to them.
        picks = self._picks(others, len(participants))[:MAX_BLOCKS]  # one request per contribution holds these
        again = self._recheck(n, me, picks, commits, participants, claims, mine, weights, spans)
        rechecked = time.monotonic()
        taken: dict[str, list[int]] = {}
        for name, flight in flights.items():
            merged = flight.result()
            if merged is not None:
                blocks.update(merged)
                taken[name] = others[name]
        shared = time.monotonic()
        redo = {i for name, want in others.items() if name not in taken for i in want}
        redo |= self._compare(n, picks, again, taken, blocks)
        known = {i: again[i] for i in redo if i in again}  # merged here already
        blocks.update(known)
        if redo:
            logger.info("outer round %s/%d: this node merges %d blocks of %d others' shares itself (%d of them merged "
                        "here already as rechecks)", self.group, n, len(redo), len(others) - len(taken), len(known))
        if rest := sorted(redo - known.keys()):
            got, _, _ = self._merge_here(me, rest, participants, claims, mine, weights, spans)
            if got is None:
                return None, audit, None
            blocks.update(got)
        logger.info("outer round %s/%d: merged %d senders' blocks in %.2f s: announcing the set %.2f s, its %d blocks "
                    "fetched and merged %.2f s, their root published %.2f s, %d rechecks %.2f s, the others' shares "
                    "%.2f s more, blocks merged again %.2f s", self.group, n, len(participants),
                    time.monotonic() - began, announced - began, len(own), merged_own - announced,
                    published - merged_own, len(picks), rechecked - published, shared - rechecked,
                    time.monotonic() - shared)
        return assemble(blocks, self.shapes), audit, geometry

    def _recheck(self, n: int, me: str, picks: Sequence[tuple[str, int]], commits: Commits,
                 participants: tuple[str, ...], claims: Mapping[str, RoundEntry], mine: Mapping[str, torch.Tensor],
                 weights: Sequence[float], spans: Sequence[float] | None) -> dict[int, torch.Tensor]:
        """The blocks ``picks`` names (merger, block) merged here, the shares' of the mergers marked in ``commits`` by
        then at each turn, while the others still merge: each contribution's picked blocks of those shares come in
        one request, and each block is merged on its own, as its merger merges it. None are left when no
        contribution had weight; when a contribution's blocks do not arrive, the rest of the rechecks are skipped
        (each needs every contribution's block; the shares are here)."""
        pending: dict[str, list[int]] = {}
        for name, i in picks:
            pending.setdefault(name, []).append(i)
        again: dict[int, torch.Tensor] = {}
        while pending:
            want = sorted(i for name in commits.marked_among(pending) for i in pending.pop(name))
            try:
                got = self._merged_again(n, me, want, participants, claims, mine, weights, spans)
            except Unmergeable as e:
                skipped = len(want) + sum(map(len, pending.values()))
                logger.info("outer round %s/%d: %d rechecks skipped: %s", self.group, n, skipped, e)
                break
            again.update(got or {})
        return again

    def _merged_again(self, n: int, me: str, want: list[int], participants: tuple[str, ...],
                      claims: Mapping[str, RoundEntry], mine: Mapping[str, torch.Tensor], weights: Sequence[float],
                      spans: Sequence[float] | None) -> dict[int, torch.Tensor] | None:
        """Blocks ``want`` merged here (``_merge_here``) as a recheck: asked for once more after ``RETRY_S`` when a
        contribution's blocks did not arrive for a cause that is no evidence and cost no bound (not held, a stream
        broken or refused on the way: every sender of the set held its contribution when the set was merged).

        Raises:
            Unmergeable: they did not arrive usable (twice, for such a cause).
        """
        try:
            return self._merge_here(me, want, participants, claims, mine, weights, spans)[0]
        except Unmergeable as e:
            if isinstance(e.__cause__, _NOT_ASKED_AGAIN):
                raise
            logger.info("outer round %s/%d: rechecks asked for again in %g s: %s", self.group, n, RETRY_S, e)
        time.sleep(RETRY_S)
        return self._merge_here(me, want, participants, claims, mine, weights, spans)[0]

    def _compare(self, n: int, picks: Sequence[tuple[str, int]], again: Mapping[int, torch.Tensor],
                 taken: dict[str, list[int]], blocks: Mapping[int, torch.Tensor]) -> set[int]:
        """Check the shares that came (``taken``: merger -> its blocks, which ``blocks`` holds as served) against this
        node's recomputation ``again`` of the blocks ``picks`` drew. A merger with a block off by more than
        ``RECHECK_TOLERANCE`` is evidence (``Evidence.MISMERGED``), leaves ``taken``, and its blocks are returned for
        this node to merge itself."""
        self.rechecked += sum(1 for name, i in picks if name in taken and i in again)
        redo: set[int] = set()
        for name, i in picks:
            if name not in taken or i not in again or agrees(again[i], blocks[i]):
                continue  # right, not recomputed, did not come (merged here), or another of its blocks disagreed
            self.mismerged += 1
            peer = split_pair(name)[0]
            if self.scores is not None:
                self.scores.record(peer, Evidence.MISMERGED)
            logger.warning("outer round %s/%d: peer %s served merged block %s that its contributions do not give "
                           "(off by more than %g of its norm); this node merges that peer's blocks itself",
                           self.group, n, peer, self.layout[i].key, RECHECK_TOLERANCE)
            redo.update(taken.pop(name))
        return redo

    def _picks(self, shares: Mapping[str, Sequence[int]], n: int) -> list[tuple[str, int]]:
        """The blocks of others' this node recomputes among ``n`` senders, drawn at random (an unpredictable draw: a
        merger cannot tell which of its blocks will be checked) of ``shares`` (merger -> its blocks): ``rechecks`` of
        them, a block of each merger in turn (each merger's share is checked before any is checked twice), each kept
        with ``recheck_odds``."""
        draw = random.SystemRandom()
        turns_of = [[(name, i) for i in draw.sample(list(want), len(want))] for name, want in shares.items()]
        draw.shuffle(turns_of)
        turns = [pick for turn in itertools.zip_longest(*turns_of) for pick in turn if pick is not None]
        odds = recheck_odds(n, self.count)
        return [pick for pick in turns[:rechecks(n, self.count, self.config.net.parts_rechecks)]
                if odds >= 1 or draw.random() < odds]

    def _await_mergers(self, n: int, others: Mapping[str, list[int]], participants: tuple[str, ...],
                       commits: Commits) -> dict[str, Future[dict[int, torch.Tensor] | None]]:
        """Watch the other mergers (``others``: contribution -> its blocks) until each publishes the root of its merged
        blocks of ``participants``, and fetch them: one watch of them all (``_watch_mergers``: a set of n senders holds
        one of the pool's threads while it waits, whatever n), each fetch on the pool once its root is known. Each
        merger is marked in ``commits`` as it published its root or was given up; its future gives its merged blocks,
        or None (this node merges them itself)."""
        net = self.config.net
        named_by = time.monotonic() + net.verify_timeout_s
        deadline = named_by + net.allreduce_timeout_s
        flights: dict[str, Future[dict[int, torch.Tensor] | None]] = {name: Future() for name in others}
        for name, flight in flights.items():
            flight.add_done_callback(functools.partial(commits.mark, name))
        if not flights:
            return flights
        watch = self.pool.submit(self._watch_mergers, n, dict(others), participants, named_by, deadline, commits,
                                 flights)
        watch.add_done_callback(functools.partial(_dropped, flights.values()))
        return flights

    def _watch_mergers(self, n: int, waiting: dict[str, list[int]], participants: tuple[str, ...], named_by: float,
                       deadline: float, commits: Commits,
                       flights: Mapping[str, Future[dict[int, torch.Tensor] | None]]) -> None:
        """Read the records of the mergers ``waiting`` for (contribution -> its blocks) until each names
        ``participants`` and the root of its blocks, then fetch them (``_fetch_merged``, marked in ``commits`` as it
        starts) into its flight. Its flight gives None when it merges another set, merged one or withdrew, does not
        name the set by ``named_by`` or publishes no root by ``deadline``, and when the watch itself fails. Each
        record is as its merger last answered the round's question for it (known as it changes), read from the DHT
        while it does not answer (``entries_of``)."""
        net = self.config.net
        try:
            while waiting:
                timeout_s = max(0.1, min(net.dht_timeout_s, deadline - time.monotonic()))
                entries = self.entries_of(sorted(split_pair(name)[0] for name in waiting), timeout_s)
                now = time.monotonic()
                for name in list(waiting):
                    peer, round_id = split_pair(name)
                    entry = entries.get(peer, {}).get(round_id)
                    named = entry is not None and entry.participants == participants
                    if entry is not None and named and entry.merged:
                        commits.mark(name)
                        fetch = self.pool.submit(self._fetch_merged, name, waiting[name], entry.merged, participants)
                        del waiting[name]
                        fetch.add_done_callback(functools.partial(_pass_on, flights[name]))
                    elif entry is not None and not named and (entry.fingerprint or entry.participants):
                        _settle(flights[name], None)  # it merges another set, merged one, or withdrew
                        del waiting[name]
                    elif now >= (deadline if named else named_by):
                        logger.info("outer round %s/%d: peer %s published no merged blocks of the set in time",
                                    self.group, n, peer)
                        _settle(flights[name], None)
                        del waiting[name]
                if waiting:
                    time.sleep(POLL_S)
        except Exception as e:  # the pool shut down (the node closes), or a read failed in a way none should
            logger.warning("outer round %s/%d: the watch of the other mergers ended (%r): this node merges the "
                           "blocks of the %d it waited for itself", self.group, n, e, len(waiting))
        finally:
            for name in waiting:
                _settle(flights[name], None)

    def _fetch_merged(self, name: str, want: list[int], root: bytes,
                      participants: tuple[str, ...]) -> dict[int, torch.Tensor] | None:
        """The merged blocks ``want`` of the sender of contribution ``name``, checked against the ``root`` it published
        for ``participants`` and decoded; None when they do not arrive usable. Blocks its root does not give count
        against it only while its entry still shows that root: a merger that moved to another set since serves that
        set's blocks under the round's key."""
        net = self.config.net
        peer, round_id = split_pair(name)
        try:
            blobs = self.gather.fetch_blocks(peer, merged_key(self.group), round_id, root,
                                             blocks_cap([self.layout[i] for i in want], self.shapes),
                                             list(range(len(want))), len(want), net.allreduce_timeout_s,
                                             chunk_timeout_s=net.next_chunk_timeout_s).blobs
            return {i: decode_block(blobs[k], self.layout[i], self.shapes[self.layout[i].name], peer=peer)
                    for k, i in enumerate(want)}
        except Exception as e:  # merged here instead; a forged or malformed block counts against its server
            self._held(peer, e)
            if self.scores is not None and isinstance(e, BlockMismatch | MalformedMessage):
                # its entry now, as the merger last gave it (where this node learned the root), else the DHT's
                entry = self.entries_of([peer], net.dht_timeout_s).get(peer, {}).get(round_id)
                if entry is not None and entry.participants == participants and entry.merged == root:
                    self.scores.record(peer, Evidence.MISMERGED)
            logger.warning("outer round %s: no usable merged blocks from peer %s: %s", self.group, peer, e)
            return None

    def _merge_here(self, me: str, want: list[int], participants: tuple[str, ...], claims: Mapping[str, RoundEntry],
                    mine: Mapping[str, torch.Tensor], weights: Sequence[float], spans: Sequence[float] | None, *,
                    fetched: list[dict[int, torch.Tensor]] | None = None,
                    ) -> tuple[dict[int, torch.Tensor] | None, dict[int, bytes], MergeAudit]:
        """Blocks ``want`` merged here from every contribution's blocks (``me``: ours): (the merged blocks as
        ``MERGED_WIRE`` gives them back, or None when no contribution had weight; their encoded bytes; the robust
        merge's audit). ``fetched``, when given, receives each participant's blocks in ``participants``' order. The
        blocks of a contribution without weight (left out: ``GatheredRounds._left_out``, or no tokens) are not
        fetched: the merge drops it whatever they hold.

        Raises:
            Unmergeable: a contribution's blocks did not arrive usable.
        """
        weighed = {name for name, w in zip(participants, weights, strict=True) if w > 0}
        flights = {name: self.pool.submit(self._fetch_blocks, name, claims[name], want)
                   for name in participants if name != me and name in weighed}
        parts: dict[str, dict[int, torch.Tensor]] = {}
        for name, flight in flights.items():
            parts[name] = flight.result()
        parts[me] = {i: mine[self.layout[i].name][self.layout[i].start:self.layout[i].stop] for i in want}
        for name in participants:
            if name not in parts:
                parts[name] = {i: torch.zeros_like(block) for i, block in parts[me].items()}
        if fetched is not None:
            fetched.extend(parts[name] for name in participants)
        return merge_blocks([parts[name] for name in participants], want, self.layout, self.shapes, weights,
                            self.config, spans=spans)

    def _held(self, peer: str, error: Exception) -> None:
        """Tell ``set_aside`` of ``peer`` when ``error`` ended a fetch of its blocks because it held the stream or
        trickled it past the fetch's bound."""
        if self.set_aside is not None and isinstance(error, StalledStream | SlowStream):
            self.set_aside(peer)

    def probe(self, name: str, claim: RoundEntry) -> None:
        """Fetch one block of contribution ``name``, drawn at random, and check it (a sender whose blocks did not
        arrive before shows it serves them). An honest answer is one message (a block is far under a stream
        message's megabyte), so the whole fetch is bounded by twice the wait for one message, where a merge's fetch
        has its own bound (a held answer still ends on the wait for its first message: a held fetch, evidence).

        Raises:
            Unmergeable: it did not arrive usable.
        """
        self._fetch_blocks(name, claim, [random.SystemRandom().randrange(self.count)],
                           timeout_s=min(2 * self.config.net.next_chunk_timeout_s, self.config.net.allreduce_timeout_s))

    def fetch_whole(self, name: str, claim: RoundEntry) -> dict[str, torch.Tensor]:
        """Contribution ``name`` (announced by ``claim``) whole: every block of it, checked and decoded.

        Raises:
            Unmergeable: they did not arrive usable.
        """
        return assemble(self._fetch_blocks(name, claim, list(range(self.count))), self.shapes)

    def _fetch_blocks(self, name: str, claim: RoundEntry, want: list[int], *,
                      timeout_s: float | None = None) -> dict[int, torch.Tensor]:
        """Blocks ``want`` of contribution ``name`` (announced by ``claim``), checked and decoded, within
        ``timeout_s`` (None: ``allreduce_timeout_s``).

        Raises:
            Unmergeable: they did not arrive usable (a forged or malformed block, or a held fetch, is scored).
        """
        peer = split_pair(name)[0]
        net = self.config.net
        proven = False
        try:
            size = min(claim.size, blocks_cap([self.layout[i] for i in want], self.shapes))
            answer = self.gather.fetch_blocks(peer, self.group, claim.round_id, claim.digest, size, want, self.count,
                                              net.allreduce_timeout_s if timeout_s is None else timeout_s,
                                              chunk_timeout_s=net.next_chunk_timeout_s)
            out = {}
            for i in want:
                try:
                    out[i] = decode_block(answer.blobs[i], self.layout[i], self.shapes[self.layout[i].name], peer=peer)
                except NonFiniteTensor:  # signed, and no honest encoder makes it: proof others can check
                    proven = self.proven is not None and self.proven(BadBlock(peer, claim, i, answer.alone(i)))
                    raise
        except Exception as e:
            bad = isinstance(e, BlockMismatch | MalformedMessage)
            if self.scores is not None and not proven and (bad or isinstance(e, StalledStream)):
                self.scores.record(peer, Evidence.FORGED if bad else Evidence.STALLED)
            self._held(peer, e)
            raise Unmergeable(f"blocks of contribution {name} unusable: {e!r}", peer, name) from e
        if self.worked is not None:
            self.worked(peer, claim.digest)
        return out


def _settle(flight: Future[Any], value: Any) -> None:
    """End ``flight`` with ``value`` unless it has ended."""
    if not flight.done():
        flight.set_result(value)


def _dropped(flights: Iterable[Future[Any]], watch: Future[Any]) -> None:
    """End ``flights`` with None (their mergers' blocks merged here) when their ``watch`` was dropped before it ran
    (the node closes)."""
    if watch.cancelled():
        for flight in flights:
            _settle(flight, None)


def _pass_on(flight: Future[Any], source: Future[Any]) -> None:
    """End ``flight`` with what ``source`` gave (None when it failed or was dropped)."""
    _settle(flight, None if source.cancelled() or source.exception() is not None else source.result())
