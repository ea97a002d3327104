"""One group's gathered outer rounds (``sync.aggregation`` "parts", the default, or "gather"): collect, merge
robustly, verify. Partitioned ("parts"), step 3's merge is shared among the set's senders block by block
(``partitioned.PartsMerge``); gathered, each sender merges every contribution itself.

The transport and the pure parts are in ``transport``; this is the round itself, run by
``averager.GroupAverager`` in its round thread:

1. publish this node's contribution (its entry: round, sha256, size, tokens, session and the anchor it was taken from,
   signed as a claim anyone can check: ``witness``) and serve its body; a round this identity's earlier process
   claimed is skipped;
2. collect the live composers' *current* contributions (named ``peer@round``: composers reach a round at their own
   steps), waiting ``min_matchmaking_time_s`` for all of them; or take the set others already merged this node's
   contribution in. The quorum counts, beside the composers whose work reached this node, the senders of the
   contributions on offer (one record every node reads); a node holding a quorum merges at once only when its
   contribution ranks first among those on offer, and otherwise gives that one's sender ``verify_timeout_s`` to
   publish a set naming ours. While the round runs, every live peer's record is asked of the peer itself and known as
   it changes (``transport.RecordWatch``), read from the DHT for the peers that do not answer: the contributions on
   offer and the sets are seen as they are made. Without a quorum, a node that trains on meanwhile (``due``) keeps
   its contribution on offer until it is told to end (``background``: a few of its group's periods at most):
   composers of unequal pace then find one another's contributions on offer whenever they come, not only during a
   wait of their own; when a quorum then comes, it waits ``min_matchmaking_time_s`` more for the rest. Without
   ``due`` the round gives up after ``matchmaking_timeout_s``. Giving up takes the contribution off offer; when a
   peer had fetched it, this node watches the records for ``verify_timeout_s`` for a set naming it (a peer that read
   it on offer just before may be merging it) and takes that set, so that no peer applies a merge of its contribution
   that it does not apply itself. Fetches run in the background: once the wait is over and a quorum is held, fetches
   still in flight get ``next_chunk_timeout_s`` more (one message's bound: a body that sends at all has arrived by
   then unless it is large or slow), then the round goes on without them; they end on their own bounds, and what they
   bring is not merged. A peer that accepted a fetch and held it is waited for by no round and counted in no quorum
   until a fetch of its contribution arrives again (it is still asked each round): it costs a node one bounded fetch
   per group, not one per round until it is banned;
3. merge robustly (``train.robust``: weights capped, spans bounded, clipping), name suspects, score them;
4. publish the fingerprint and the set merged, and wait for a majority of the set's senders to agree (with
   ``due``, past ``verify_timeout_s`` while enough of them still gather to make one: they take the set when they see
   it). When nobody else published a result for it by then, the node takes its vote and contribution back as in
   step 2's last call, and takes a set naming its contribution if one shows, or carries its delta into its next
   round (``UNANSWERED``). A set more of its senders merged replaces ours (at most twice). When the others merged
   the contributions of our set in sets without ours and went on to their next rounds, nobody can apply ours: the
   round ends at once, its contribution withdrawn, and this node's delta goes into its next round (a composer that
   started its round while the others were merging theirs would otherwise wait out its verification and reload).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

import torch

from parallax.node.net.scores import Evidence, PeerScores
from parallax.node.outer.blocks import BlockMismatch, block_layout, blocks_cap, decode_all, encode_blocks
from parallax.node.outer.partitioned import PartsMerge, Unmergeable
from parallax.node.outer.records import (
    IDLE_POLL_S,
    POLL_S,
    RETRY_S,
    SLOW_POLL_S,
    LatestRecord,
    Records,
    RoundDue,
    RoundRecords,
    RoundStatus,
)
from parallax.node.outer.transport import (
    ROUND_RECORD_MAX_BYTES,
    WITHDRAWN,
    ContributionMismatch,
    OtherTensors,
    OuterGather,
    RecordWatch,
    RoundEntry,
    RoundPeers,
    best_set,
    body_digest,
    contribution_limit,
    decode_contribution,
    decode_entries,
    encode_contribution,
    encode_record,
    entry_of,
    latest_entries,
    merged_sets,
    open_contributions,
    pair,
    split_pair,
    vouched,
)
from parallax.node.outer.wire import (
    ANCHOR_TOLERANCE,
    ROUNDS_KEPT,
    OuterSyncConfig,
    anchor_fingerprint,
    anchor_majority,
    decode_fingerprint,
    encode_fingerprint,
    fingerprint,
    fingerprints_agree,
    round_tag,
    set_anchor,
)
from parallax.node.outer.witness import ASKS_AT_ONCE, Witness, new_session, proofs_key, sign
from parallax.node.train import own_data
from parallax.node.train.robust import MergeAudit, cap_weights, merge_geometry, robust_merge_groups, span_of
from parallax.protocol.errors import MalformedMessage, RemoteProtocolError, SlowStream, StalledStream

logger = logging.getLogger(__name__)

__all__ = ["GatheredRounds"]

_REFUSED_KEPT = 256
_FETCH_THREADS = 32  # per group: fetches at once, abandoned ones included (each ends on its own bounds)
_DIGESTS_KEPT = 64  # per peer: rounds back a replay is recognised
AUDIT_WAIT_S = 2.0
"""How much longer than its verification a round that merged waits for the contribution it audits (``_own_data_case``;
partitioned, fetched whole while the round verified): past it, no audit, and the round applies."""
_EVIDENCE = {"non-finite": Evidence.NON_FINITE, "zero weight": Evidence.ZERO_WEIGHT}
"""The robust merge's reasons to drop a contribution (``ContributionAudit.dropped``), as evidence."""


class GatheredRounds:
    """The gathered rounds of one group of one node.

    Args:
        records: the group's rounds records.
        shapes: name -> shape of the group's tensors.
        config: timings, merge method, compression.
        gather: serves and fetches contributions.
        peers: the live composers, those of them that show work, and where evidence of work goes.
        weight_cap: the most tokens one peer can have processed in a period (batch x sequence x period); a
            declared weight above it counts as the cap. None: no cap (tests).
        scores: where evidence against peers goes, and whose bans the rounds honour.
        report: ``GroupAverager``'s report hook: (status, started, **fields).
        other_tensors_blameless: a contribution naming other tensors is left out without counting against its
            sender.
    """

    def __init__(self, records: RoundRecords, shapes: Mapping[str, torch.Size], config: OuterSyncConfig,
                 gather: OuterGather, peers: RoundPeers, *, weight_cap: float | None,
                 scores: PeerScores | None, report: Callable[..., None], other_tensors_blameless: bool = False) -> None:
        self.records, self.shapes, self.config, self.gather, self.peers = records, shapes, config, gather, peers
        self.other_tensors_blameless = other_tensors_blameless
        self.group, self.peer_id = records.group, records.peer_id
        self.weight_cap, self.scores, self.report = weight_cap, scores, report
        self._entries: dict[int, RoundEntry] = {}  # this node's latest rounds
        self._refused: dict[str, str] = {}  # contributions ("peer@round") found unusable, and why
        self._retry_at: dict[str, float] = {}  # contributions a fetch of failed for now -> when to ask again
        self._digests: dict[str, dict[bytes, int]] = {}  # peer -> digests of its bodies -> the round of each
        self._held: dict[str, None] = {}  # peers that held a fetch, or trickled one past its bound, and sent nothing
        # usable since (insertion order)
        self._failing: dict[str, None] = {}  # peers whose latest fetch failed, for any reason (insertion order)
        self._served: dict[str, None] = {}  # partitioned: peers whose blocks arrived usable here (latest last)
        self._work_arrived: dict[str, None] = {}  # peers whose contribution, not all zeros, arrived here (latest last)
        self._lock = threading.Lock()  # the dicts above but _entries: contributions are fetched in parallel
        self._flights = _Flights(self._fetch, f"gather-{records.group}")
        self._watch = RecordWatch(gather, records.group, POLL_S)  # the live peers' records while a round runs
        self._shown: dict[str, bytes] = {}  # the records ``_watch`` gave that the witness was shown, this round
        self._read_all_at = 0.0  # when ``_entries_of`` next reads every peer's record from the DHT
        self._recorded: set[str] = set()  # the live peers whose rounds records were found (``_entries_of_live``)
        self.parts: PartsMerge | None = None
        """The merge shared among a set's senders (``sync.aggregation = "parts"``); None: each merges it all."""
        self._claims: dict[str, dict[str, RoundEntry]] = {}  # partitioned: peer -> its checked claims, latest last
        self._zero_digest: bytes | None = None  # partitioned: the digest of an all-zero contribution
        signer = records.signer
        self._publishing = threading.RLock()  # ``_publish``
        self._record = LatestRecord(records.store, f"record-{records.group}")
        self._proofs_pool = ThreadPoolExecutor(ASKS_AT_ONCE, thread_name_prefix=f"proofs-{records.group}")
        parts = config.aggregation == "parts"  # bad blocks: proofs of the partitioned round's
        self.witness = Witness(records.run_id, records.group, signer.public_key_of if signer is not None else None,
                               scores, me=records.peer_id, shapes=shapes if parts else None,
                               serve=self._serve_proof, ask=self._ask_proof if parts else None)
        """The claims this node saw its peers sign, and the proofs it holds (``witness``)."""
        if config.aggregation == "parts":
            self._body_cap = blocks_cap(block_layout(shapes), shapes)
            pool = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix=f"parts-{records.group}")
            self.parts = PartsMerge(group=records.group, peer_id=records.peer_id, shapes=shapes, config=config,
                                    gather=gather, entries_of=self._entries_of, announce=self._announce,
                                    scores=scores, worked=self._worked, set_aside=self._set_aside,
                                    proven=self.witness.convict_block, pool=pool)
        else:
            self._body_cap = contribution_limit(shapes)
        self.session = new_session()
        self._floor: int | None = None  # ``_claimed_before``
        records.on_read = self._read
        self.last_sent: dict[str, torch.Tensor] | None = None
        """This node's pseudo-gradient of its last round as its peers decode it (what error feedback subtracts)."""
        self.last_case: own_data.Case | None = None
        """A contribution of the last round's set to audit for work on its sender's own data (``own_data_case``)."""

    def run(self, delta: Mapping[str, torch.Tensor], tokens: float, n: int,
            fault: Callable[[dict[str, torch.Tensor]], None] | None, started: float,
            anchor: Sequence[torch.Tensor] | None = None,
            due: threading.Event | None = None, *, drawn: int = 0) -> dict[str, torch.Tensor] | None:
        """One gathered round of this node's round ``n`` (the module docstring); reports through ``report``.

        ``due``: set to end the round's wait (``background``: after a few of the group's periods, alone for good, or
        leaving). Until then a round that has no quorum keeps its contribution on offer; None: it gives up after
        ``matchmaking_timeout_s``.

        ``anchor``: the group's anchor ``delta`` was taken from and the merge will be applied to, in the group's order
        (not changed while the round runs). Its fingerprint goes out with the claim: a merge leaves out the
        contributions taken from another anchor than its set's majority's (``RoundReport.left_out``). When the anchors
        of a strict majority of the participants agree and this node's is not theirs, the report names them
        (``RoundReport.apart_from``): the round still applies, and the node then takes the group's state from them.

        ``drawn``: the batches this node's data stream had handed out when ``delta`` was taken, signed with the claim
        (``RoundEntry.drawn``).

        Returns:
            The merged pseudo-gradient, or None (the report says why).
        """
        self.last_case = None
        try:
            return self._round(delta, tokens, n, fault, started, anchor, due, drawn)
        finally:
            self._watch.stop()  # the round's questions to its peers
            with self._lock:
                self._shown.clear()

    def _round(self, delta: Mapping[str, torch.Tensor], tokens: float, n: int,
               fault: Callable[[dict[str, torch.Tensor]], None] | None, started: float,
               anchor: Sequence[torch.Tensor] | None, due: threading.Event | None,
               drawn: int) -> dict[str, torch.Tensor] | None:
        cfg = self.config
        if not all(bool(torch.isfinite(d).all()) for d in delta.values()):
            self.report(RoundStatus.BAD_INPUT, started, round_id=n, detail="non-finite pseudo-gradient")
            return None
        if n <= self._claimed_before():
            self.report(RoundStatus.CLAIMED_BEFORE, started, round_id=n,
                        detail=f"rounds up to {self._claimed_before()} were claimed before this process")
            return None
        mine, digest, size = self._offer(n, delta)  # mine: the tensors the others will merge
        self.last_sent = mine
        mine_anchor = anchor_fingerprint(anchor) if anchor is not None else None
        entry = RoundEntry(n, digest, size, float(tokens), session=self.session,
                           base=encode_fingerprint(mine_anchor) if mine_anchor else b"", drawn=drawn)
        if self.records.signer is not None:
            entry = sign(self.records.signer.identity, self.records.run_id, self.group, entry)
        self._publish(entry)
        me = pair(self.peer_id, n)
        found = {me: Fetched(mine, float(tokens), entry.base, drawn, self.session)}
        pack_s = time.monotonic() - started
        seen: dict[str, float] = {}  # contribution -> when this node first read it on offer
        participants = self._collect(me, found, due, seen)
        collected = time.monotonic()
        merged_ours = False  # a set naming our contribution was seen after it came off offer
        if participants is None:
            participants, merged_ours = self._last_call(n, me, found)
        last_offer = max((seen.get(p, collected) for p in participants or () if p != me), default=started + pack_s)
        common: dict[str, Any] = dict(round_id=n, pack_s=pack_s, allreduce_s=time.monotonic() - started - pack_s,
                                      waited_s=max(0.0, last_offer - started - pack_s))
        local_norms = [float(torch.linalg.vector_norm(mine[name], dtype=torch.float64)) for name in self.shapes]
        verify_started = time.monotonic()
        deadline = verify_started + cfg.net.verify_timeout_s
        status, agreeing, answered = RoundStatus.NO_GROUP, 1, 1
        audit: tuple[str, Future[dict[str, torch.Tensor]]] | None = None
        for _attempt in range(3):  # our own set, then at most twice a set more of its members merged
            if participants is None or len(participants) < self._quorum():
                common.setdefault("participants", tuple(sorted(split_pair(p)[0] for p in found)))
                self._withdrawn(n, RoundStatus.NO_GROUP, started, common, merged_elsewhere=merged_ours)
                return None
            merging = time.monotonic()
            merged = self._merge(n, participants, found, common)
            merge_s = _add_time(common, "merge_s", merging)
            share = common.pop("geometry", None)  # partitioned: the geometry of this node's blocks of the merge
            if self.parts is not None:
                # A partitioned merge waits on the other mergers, and one that failed on a contribution's blocks on
                # that fetch's bound: not the verification's time.
                deadline += merge_s
            if merged is None:
                failed = common.pop("failed", None)
                rest = tuple(p for p in participants if split_pair(p)[0] != failed)
                if failed is not None and failed != self.peer_id and len(rest) >= self._quorum():
                    # Partitioned: a contribution whose blocks did not arrive (its sender died, or withdrew it) fails
                    # the set on every node that asked; each merges the rest, as the others do.
                    logger.info("outer round %s/%d: merging the set without the contribution of peer %s", self.group,
                                n, failed)
                    participants = rest
                    continue
                self._withdrawn(n, RoundStatus.FAILED if failed is not None else RoundStatus.NO_TOKENS, started,
                                common)
                return None
            if audit is not None:  # another set's, merged before: not fetched yet, never asked
                audit[1].cancel()
            try:
                audit = self._start_audit(n, participants, found, common["tokens"])
            except Exception as e:  # an audit is evidence about a peer, never a reason to lose a round
                logger.warning("outer round %s/%d: no contribution to audit: %r", self.group, n, e)
                audit = None
            if fault is not None:
                fault(merged)
            fp = fingerprint([merged[name] for name in self.shapes], local_norms)
            tag = round_tag(0, participants)
            self._publish(dataclasses.replace(self._entries[n], fingerprint=encode_fingerprint(fp, tag),
                                              participants=participants))
            anchors: dict[str, tuple[float, ...]] = {}
            verifying = time.monotonic()
            status, agreeing, answered, other = self.records.await_majority(
                fp, participants, functools.partial(_entry_fingerprint, tag=tag, anchors=anchors), deadline=deadline,
                other_set=functools.partial(self._better_set, mine=me, current=participants),
                readers=self._live, moved_on=functools.partial(_moved_on, tag=tag), source=self._records_of,
                extend=None if due is None else functools.partial(_may_yet_agree, participants=participants,
                                                                  due=due))
            _add_time(common, "verify_s", verifying)
            common.update(agreeing=agreeing, began_allreduce=self.gather.store.served(self.group, n))
            if status is RoundStatus.OK:
                if mine_anchor is not None:
                    common["apart_from"] = self._apart_from(n, mine_anchor, anchors, participants, tag, deadline)
                if cfg.net.record_merges:
                    weights = [common["tokens"][split_pair(p)[0]] for p in participants]
                    geometry = share
                    if self.parts is None:
                        geometry = merge_geometry([found[p].tensors for p in participants], merged)
                    if geometry is not None:
                        common["geometry"] = {**geometry, "weights": weights, "contributions": list(participants)}
                self.report(RoundStatus.OK, started, **common)
                self._flights.forget(set(participants).__contains__)  # merged: no round of this node asks again
                self.last_case = self._own_data_case(n, audit, found, merged)
                return merged
            if status is RoundStatus.SUPERSEDED:
                # Nobody can apply our set: its other senders merged their contributions in sets without ours and went
                # on. Ours comes off offer; this node's delta and tokens go into its next round, which meets theirs.
                common["detail"] = "a majority of the set's other senders merged theirs elsewhere and went on"
                self._withdrawn(n, status, started, common)
                return None
            if status is RoundStatus.UNVERIFIED and answered == 1:
                # Nobody else published a result for our set: nobody can have applied it without our vote, so rather
                # than reload an anchor that may lack our contribution (and drop our delta with it), take our vote
                # and contribution back, and take a set naming ours if one shows now (``_last_call``).
                settling = time.monotonic()
                taken, merged_ours = self._last_call(n, me, found)
                _add_time(common, "allreduce_s", settling)
                if taken is None:
                    common["detail"] = f"no other of the set's {len(participants)} senders merged it in time"
                    self._withdrawn(n, RoundStatus.UNANSWERED, started, common, merged_elsewhere=merged_ours)
                    return None
                participants = taken
                continue
            if other is None:
                break
            settling = time.monotonic()
            fetched = self._fetch_set(other, found, deadline)
            _add_time(common, "allreduce_s", settling)
            if not fetched:
                break
            logger.info("outer round %s/%d: merging the %d contributions more of their senders merged", self.group,
                        n, len(other))
            participants = other
        common["detail"] = (f"{agreeing} of {len(common['participants'])} participants agree, {answered} fingerprints "
                            "found")
        self.report(status, started, **common)
        return None

    def _start_audit(self, n: int, participants: tuple[str, ...], found: Mapping[str, Fetched],
                     weights: Mapping[str, float]) -> tuple[str, Future[dict[str, torch.Tensor]]] | None:
        """One other contribution of the set being merged, drawn at random among those with weight, to audit for work
        on its sender's own data (``train.own_data``), and its tensors: at hand in a gathered round; partitioned, its
        blocks fetched whole in the background while the round verifies (one contribution a round, whatever the
        set's size). None without ``net.outer.own_data_audits``, and in another group than ``own_data.GROUP``."""
        if not self.config.net.own_data_audits or self.group != own_data.GROUP:
            return None
        me = pair(self.peer_id, n)
        candidates = [p for p in participants if p != me and weights.get(split_pair(p)[0], 0.0) > 0]
        if not candidates:
            return None
        name = random.SystemRandom().choice(candidates)
        if self.parts is None:
            held: Future[dict[str, torch.Tensor]] = Future()
            held.set_result(found[name].tensors)
            return name, held
        with self._lock:
            claim = self._claims.get(split_pair(name)[0], {}).get(name)
        return None if claim is None else (name, self.parts.pool.submit(self.parts.fetch_whole, name, claim))

    def _own_data_case(self, n: int, audit: tuple[str, Future[dict[str, torch.Tensor]]] | None,
                       found: Mapping[str, Fetched], merged: dict[str, torch.Tensor]) -> own_data.Case | None:
        """The case ``_start_audit`` began, with the round's merge; None when its contribution did not arrive within
        ``AUDIT_WAIT_S`` more (the fetch ends on its own bound: a round that verified waits no longer to apply)."""
        if audit is None:
            return None
        name, flight = audit
        try:
            offered = flight.result(timeout=AUDIT_WAIT_S)
        except Exception as e:  # a fetch that failed or is still on its way: no audit this round
            flight.cancel()
            logger.info("outer round %s/%d: the contribution %s to audit did not arrive: %r", self.group, n, name, e)
            return None
        fetched = found[name]
        return own_data.Case(split_pair(name)[0], fetched.drawn, offered, merged, fetched.session)

    def _apart_from(self, n: int, mine: tuple[float, ...], anchors: dict[str, tuple[float, ...]],
                    participants: Sequence[str], tag: bytes, deadline: float) -> tuple[str, ...]:
        """The peers of the strict majority of ``participants`` that hold one anchor, when this node's (``mine``)
        is not theirs (``wire.anchor_majority``); named in the log. ``anchors``: those found while the round verified;
        while they neither settle it nor show ours held by a majority, the others' records are read again until
        ``deadline`` (a majority verdict comes before every participant has published)."""
        others = [name for name in participants if split_pair(name)[0] != self.peer_id]
        while True:
            found = {name: anchors[name] for name in others if name in anchors}
            apart = anchor_majority(mine, found, len(participants))
            ours = 1 + sum(fingerprints_agree(mine, fp, ANCHOR_TOLERANCE) for fp in found.values())
            if apart or 2 * ours > len(participants) or len(found) == len(others) or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
            senders = {split_pair(name)[0]: name for name in others if name not in found}
            records = self.records.read(sorted(senders), max(0.1, deadline - time.monotonic()))
            for sender, name in senders.items():
                if sender in records:
                    _entry_fingerprint(name, records[sender], tag, anchors)
        apart = tuple(split_pair(name)[0] for name in apart)
        if apart:
            logger.warning("outer round %s/%d: this node's anchor of the group is not the one %d of the %d "
                           "participants hold (rounds one side applied and the other did not); it applies the round "
                           "and takes the group's state from them", self.group, n, len(apart), len(participants))
        return apart

    def close(self) -> None:
        """Drop the fetches not started yet; those running end on their own bounds."""
        self._watch.stop()
        self._flights.close()
        self.witness.close()
        self._proofs_pool.shutdown(wait=False, cancel_futures=True)
        self._record.close()
        if self.parts is not None:
            self.parts.pool.shutdown(wait=False, cancel_futures=True)

    def hear_proofs(self, timeout_s: float) -> set[str]:
        """Read the live composers' rounds records (the witness takes in their claims and the proofs they show) and
        wait up to ``timeout_s`` in all for the proofs asked for to arrive and be checked. Returns where a download
        of the group's state asks first: once work reached this node in this group, the live peers whose work did
        (a contribution not all zeros, fetched and decoded here) and those their records vouch for; before, the live
        peers the records vouch for (``transport.vouched``), which identities that name each other in their records
        can be. Either way not a peer the proofs just convicted."""
        deadline = time.monotonic() + timeout_s
        peers = sorted(self._live())
        if not peers:
            return set()
        records = self.records.read(peers, min(timeout_s, self.config.net.dht_timeout_s))
        self.witness.asks_ended(deadline - time.monotonic())
        entries = latest_entries(records)
        live = self._live()  # not a peer the proofs just heard convicted
        with self._lock:
            arrived = self._work_arrived.keys() & live
        found = (arrived | vouched(entries, least=1, by=arrived)) if arrived else vouched(entries)
        return found & live

    def vouch(self, served: Collection[str]) -> set[str]:
        """The live peers that the rounds records of the peers in ``served`` (those that served this node the group's
        state, each from its own peer id: they run) vouch for, read now; ``RoundPeers.vouched`` is told of them.
        Named by two of those records, or by one for a peer that served too. Records stored under identities nobody
        runs, each naming the others, vouch for nobody here."""
        runs = set(served) & self._live()  # not a peer banned meanwhile
        if not runs:
            return set()
        entries = latest_entries(self.records.read(sorted(runs), self.config.net.dht_timeout_s))
        found = (vouched(entries, by=runs) | (vouched(entries, least=1, by=runs) & runs)) & self._live()
        if found and self.peers.vouched is not None:
            self.peers.vouched(found)
        return found

    def _serve_proof(self, number: int, data: bytes) -> None:
        """Serve the bytes of a proof this node shares (``witness.BadBlock``), its latest few."""
        self.gather.store.put(proofs_key(self.group), number, data)

    def _ask_proof(self, accuser: str, accused: str, number: int, digest: bytes, size: int) -> None:
        """Fetch, in the background, the proof against ``accused`` that ``accuser``'s record refers to; the witness
        checks it."""
        try:
            self._proofs_pool.submit(self._fetch_proof, accuser, accused, RoundEntry(number, digest, size, 0.0))
        except RuntimeError:  # closed: the rounds are over
            self.witness.hear_block(accuser, accused, digest, None)

    def _fetch_proof(self, accuser: str, accused: str, ref: RoundEntry) -> None:
        """A proof is at most a block and its claim, one message: its fetch is bounded by the wait for one."""
        bound = self.config.net.next_chunk_timeout_s
        data = None
        try:
            data = self.gather.fetch(accuser, proofs_key(self.group), ref, bound, chunk_timeout_s=bound)
        except Exception as e:  # no evidence either way: the proof is not here
            logger.info("outer rounds %s: the proof against peer %s that peer %s refers to did not arrive: %r",
                        self.group, accused, accuser, e)
        try:
            self.witness.hear_block(accuser, accused, ref.digest, data)
        except Exception:  # a bug here must not end the proofs' thread unseen
            logger.exception("outer rounds %s: checking the proof peer %s served failed", self.group, accuser)

    def _offer(self, n: int, delta: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bytes, int]:
        """Encode this node's contribution of round ``n`` in the run's wire and serve it (whole, or in blocks when
        the merge is partitioned): (its tensors as the others decode them, its digest, its size)."""
        tensors = {name: delta[name] for name in self.shapes}
        wire = self.config.compression
        if self.parts is None:
            body = encode_contribution(tensors, wire)
            self.gather.store.put(self.group, n, body)
            return decode_contribution(body, self.shapes, peer=self.peer_id), body_digest(body), len(body)
        blocked = encode_blocks(tensors, wire)
        self.gather.store.put(self.group, n, blocked)
        return decode_all(blocked, self.shapes, peer=self.peer_id), blocked.digest, blocked.size

    def _announce(self, n: int, participants: tuple[str, ...], merged: bytes) -> None:
        """A partitioned round's step (``partitioned``): this node's entry of round ``n`` names the set it merges
        and, once merged, the root of its merged blocks. The merge goes on while the record is stored: nothing it does
        next waits for the others to see it."""
        self._publish(dataclasses.replace(self._entries[n], fingerprint=b"", participants=participants,
                                          merged=merged), wait=False)

    def _claimed_before(self) -> int:
        """The last round this node's identity claimed in an earlier session, by its own record in the DHT (read once,
        at the first round; -1 for none). Claiming such a round again would be a second, different claim of it: the
        others may have merged the first under the same name, or take the two for an equivocation's halves."""
        if self._floor is None:
            own = self.records.read_own(self.config.net.dht_timeout_s)
            earlier = [n for n, e in decode_entries(own).items() if e.session != self.session]
            self._floor = max(earlier, default=-1)
        return self._floor

    def _merge(self, n: int, participants: tuple[str, ...], found: Mapping[str, Fetched],
               common: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The robust merge of the ``participants``' contributions (in sorted order, as on every peer), or with
        ``parts`` this node's share of it and the others' shares fetched; notes the capped weights and the suspects
        (of the blocks this node merged, with ``parts``) in ``common`` and names each suspect in the log. None: no
        contribution had weight, or (``common["failed"]``: its sender) a contribution's blocks did not arrive usable.
        """
        declared = [found[p].tokens for p in participants]
        cap = self.weight_cap
        weights = cap_weights(declared, cap) if cap is not None else declared
        spans = [span_of(t, cap) for t in declared] if cap is not None else None
        me = pair(self.peer_id, n)
        base, left_out = self._left_out(n, me, {p: found[p].base for p in participants})
        weights = [0.0 if p in left_out else w for p, w in zip(participants, weights, strict=True)]
        common.update(participants=tuple(split_pair(p)[0] for p in participants),
                      tokens={split_pair(p)[0]: w for p, w in zip(participants, weights, strict=True)},
                      left_out=tuple(sorted(split_pair(p)[0] for p in left_out)), ours_left_out=me in left_out,
                      base=base)
        audit: MergeAudit | None
        if self.parts is None:
            merged, audit = robust_merge_groups([found[p].tensors for p in participants], weights, self.config.method,
                                                eps=self.config.rda_eps, spans=spans)
        else:
            with self._lock:
                claims = {p: self._claims.get(split_pair(p)[0], {}).get(p) for p in participants if p != me}
            try:
                forgotten = next((p for p, claim in claims.items() if claim is None), None)
                if forgotten is not None:  # its sender's later rounds, or many others' since: the set is long gone
                    raise Unmergeable(f"the claim of contribution {forgotten} is no longer held",
                                      split_pair(forgotten)[0])
                merged, audit, geometry = self.parts.merge(n, participants,
                                                           {p: c for p, c in claims.items() if c is not None},
                                                           found[me].tensors, weights, spans)
                if geometry is not None:
                    common["geometry"] = geometry
            except Unmergeable as e:  # its contribution is out of this node's sets; its next one is probed first
                common.update(failed=e.peer, detail=str(e))
                with self._lock:
                    self._failing[e.peer] = None
                    if e.name:
                        self._refused[e.name] = str(e)
                logger.warning("outer round %s/%d: the set of %d contributions cannot be merged here: %s", self.group,
                               n, len(participants), e)
                return None
        suspects = []
        for name, a in zip(participants, audit.contributions if audit is not None else (), strict=False):
            if a.suspicious:  # a contribution left out has no weight: dropped as such, never suspected
                peer = split_pair(name)[0]
                suspects.append(peer)
                if self.scores is not None and peer != self.peer_id:
                    self.scores.record(peer, _EVIDENCE.get(a.dropped, Evidence.OUTLIER))
                logger.warning("outer round %s/%d: the contribution of peer %s was %s (norm x%.3g, pulled in "
                               "x%.3g, declared %.6g tokens)", self.group, n, peer, a.dropped or "clipped",
                               a.norm_scale, a.clip, found[name].tokens)
        common["suspects"] = tuple(suspects)
        return merged

    def _left_out(self, n: int, me: str, bases: Mapping[str, bytes]) -> tuple[tuple[float, ...] | None, set[str]]:
        """(the anchor the set's merge is a step from; the contributions it leaves out: those taken from another
        anchor than the set's majority's), given the anchor each one's signed claim names (``bases``, by contribution;
        ``wire.set_anchor``). Neither in rounds that name no anchor (this node's names none: replicated experts),
        whatever others name. Named in the log."""
        if not bases.get(me):
            return None, set()
        base, left_out = set_anchor({p: decode_fingerprint(b) if b else None for p, b in bases.items()})
        if left_out:
            logger.info("outer round %s/%d: leaving out of the merge the contributions of %s: taken from another "
                        "anchor than the %d others'", self.group, n, ", ".join(sorted(left_out)),
                        len(bases) - len(left_out))
        return None if base is None else tuple(base), left_out

    def _withdrawn(self, n: int, status: RoundStatus, started: float, common: dict[str, Any],
                   merged_elsewhere: bool | None = None) -> None:
        """Round ``n`` merged nothing here: take its contribution off offer (a late peer must not merge what this
        node will send again next round) and report ``status``, saying whether others may have merged the
        contribution (then the caller reloads): ``merged_elsewhere`` when known (``_last_call``), else whether
        anyone fetched it. Partitioned, a contribution others may be merging (fetched, or named by a set its senders
        announced) stays served: its blocks are fetched as the set is merged, and this node reloads what they apply."""
        common["began_allreduce"] = (self.gather.store.served(self.group, n) if merged_elsewhere is None
                                     else merged_elsewhere)
        self._publish(dataclasses.replace(self._entries[n], fingerprint=WITHDRAWN, participants=(), merged=b""))
        if self.parts is not None and not common["began_allreduce"]:
            # a set announced before the withdrawal may name it, its mergers not having asked for its blocks yet
            named = merged_sets(self._entries_of_live(self.config.net.dht_timeout_s), pair(self.peer_id, n),
                                announced=True)
            common["began_allreduce"] = bool(named)
        if self.parts is None or not common["began_allreduce"]:
            self.gather.store.drop(self.group, n)
        self.report(status, started, **common)

    def _publish(self, entry: RoundEntry, *, wait: bool = True) -> None:
        """Put ``entry`` in this node's rounds record (its latest ``ROUNDS_KEPT`` rounds, fewer when large
        participant lists would not fit a DHT record) with the proofs it shares, serve it to the peers that ask this
        node (``OuterGather.watch_record``) and store it (one at a time, the latest last: a read in a merge's fetch may
        publish a proof found meanwhile); without ``wait``, in the background."""
        with self._publishing:
            self._entries[entry.round_id] = entry
            for old in sorted(self._entries)[:-ROUNDS_KEPT]:
                del self._entries[old]
            proofs = self.witness.shared()
            value = encode_record([self._entries[k] for k in sorted(self._entries)], proofs)
            while len(value) > ROUND_RECORD_MAX_BYTES and len(self._entries) > 1:
                del self._entries[min(self._entries)]
                value = encode_record([self._entries[k] for k in sorted(self._entries)], proofs)
            self._record.put(value)
            self.gather.store.post_record(self.group, value)
        self._record.flush(wait=wait)

    def _read(self, records: Mapping[str, bytes]) -> None:
        """Show the witness what a read found (a poll in the round's thread, or a record asked of its peer:
        ``RecordWatch``, a partitioned merge's wait for its mergers); a proof it holds that this node's record does
        not show yet goes out with the record at once (stored in the background: the read's caller goes on)."""
        if self.witness.read(records):
            with self._publishing:
                if self._entries:
                    self._publish(self._entries[max(self._entries)], wait=False)

    def _banned(self, peer: str) -> bool:
        return self.scores is not None and self.scores.banned(peer)

    def _quorum(self, offered: Collection[str] = ()) -> int:
        """The fewest contributions a round merges: a majority of the working composers (this one included) but
        those that held a fetch (``_expected``), with the senders of the contributions ``offered`` (``_offered``),
        and at least ``min_group_size``. When the working set shrinks to a pair, the robust merge holds the longer of
        the two to twice the shorter (``train.robust``): no outlier can be told, but a liar is bounded.

        Which composers' work reached a node differs from node to node (crowded ones fetch slowly), while the
        contributions on offer are one record that every node reads: counting them, a node whose own view is narrow
        neither merges a set too small for the others to take, nor ends its wait before theirs reach it."""
        return max(self.config.net.min_group_size, (len(self._expected() | set(offered)) + 1) // 2 + 1)

    def _offered(self, entries: Mapping[str, Mapping[int, RoundEntry]]) -> set[str]:
        """The live composers (this node and those it bans aside) with a contribution on offer in ``entries`` that
        count in a round's quorum: not those that held a fetch, nor those whose latest fetch here failed, until
        one succeeds (an identity that announces contributions, new ones as often as it likes, and serves none raises
        a node's quorum for one try)."""
        with self._lock:
            out = self._held.keys() | self._failing.keys()
        return {split_pair(name)[0] for name in open_contributions(entries, announced=True)} & (self._live() - out)

    def _adoptable(self) -> set[str]:
        """The peers whose contributions may be merged in a set that others merged: the live composers this node
        does not ban but those that held a fetch (``_held``). Taking such a set means fetching every body in it, and
        a held peer's is the one most likely to stall: a holder that merged everyone's contributions with its own
        would otherwise draw every honest peer into waiting out a fetch of it each round."""
        return self._live() - self._held_peers()

    def _better_set(self, entries: Mapping[str, Mapping[int, RoundEntry]], *, mine: str,
                    current: tuple[str, ...]) -> tuple[str, ...] | None:
        """``_better_set`` of ``current`` among the peers ``_adoptable`` now (read once a poll, not once per member
        of every merged set)."""
        return _better_set(entries, mine, current, self._adoptable().__contains__, self._quorum(self._offered(entries)))

    def _live(self) -> set[str]:
        """The live composers but this node and the peers it bans."""
        return {p for p in self.peers.live() if p != self.peer_id and not self._banned(p)}

    def _working(self, live: set[str] | None = None) -> set[str]:
        """Those of ``_live`` (``live`` when given: read already) that show work: a round waits for them."""
        live = self._live() if live is None else live
        return live if self.peers.working is None else live & set(self.peers.working())

    def _expected(self) -> set[str]:
        """Those of ``_working`` a round waits for and counts its quorum over: all but the peers that held a fetch
        and have sent nothing usable since (however many identities hold, they stall no round and make up no
        quorum)."""
        return self._working() - self._held_peers()

    def _held_peers(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def _entries_of_live(self, timeout_s: float) -> dict[str, dict[int, RoundEntry]]:
        """The live peers' entries by round (``_entries_of``), each live peer that shows work (``_working``) or whose
        rounds record a read here found asked for it while the round runs (``RecordWatch.follow``), from the read that
        found it on. The others are read from the DHT alone: identities that heartbeat and never contribute, however
        many, cost a round no question each (the DHT read is one request whoever it names)."""
        live = self._live()
        heard = self._watch.heard(live).keys()  # an answer that came since the last read
        with self._lock:
            self._recorded = (self._recorded | heard) & live
            asked = self._working(live) | self._recorded
        self._watch.follow(asked)
        out = self._entries_of(sorted(live), timeout_s)  # of ``live`` only
        with self._lock:
            self._recorded |= out.keys()
        if new := out.keys() - asked:  # asked from now on: a set taken on this read names it, perhaps
            self._watch.follow(asked | new)
        return out

    def _entries_of(self, peers: Sequence[str], timeout_s: float) -> dict[str, dict[int, RoundEntry]]:
        """``peers``' entries by round (``_records_of``)."""
        return latest_entries(self._records_of(peers, timeout_s))

    def _records_of(self, peers: Sequence[str], timeout_s: float) -> Records:
        """``peers``' records: of those that answer this round's questions (``RecordWatch``) as they last answered
        (shown to the witness as a read's are, once each), of the others as the DHT gives them within ``timeout_s``
        (those of them in ``Records.unknown`` when that read failed). The DHT is still read for all of them every
        ``SLOW_POLL_S``: the witness sees what a peer stores beside what it answers (two claims of one round signed
        apart are a proof, ``witness``)."""
        with self._lock:
            heard = self._watch.heard(peers)
            fresh = {peer: record for peer, record in heard.items() if self._shown.get(peer) != record}
            self._shown.update(fresh)
            whole = time.monotonic() >= self._read_all_at
            if whole:
                self._read_all_at = time.monotonic() + SLOW_POLL_S
        if fresh:
            self._read(fresh)
        rest = list(peers) if whole else [peer for peer in peers if peer not in heard]
        read = self.records.read(rest, timeout_s) if rest else Records()
        out = Records({**read, **heard})
        out.unknown = read.unknown - heard.keys()
        return out

    def _collect(self, me: str, found: dict[str, Fetched],
                 due: threading.Event | None = None, seen: dict[str, float] | None = None) -> tuple[str, ...] | None:
        """Fetch the open contributions of the live composers into ``found``, waiting up to
        ``min_matchmaking_time_s`` for every one to have one (and on while fewer than a quorum have: until ``due``
        is set, or for ``matchmaking_timeout_s`` without it; a quorum that comes after the wait waits
        ``min_matchmaking_time_s`` more for the rest); or, when others already merged ours with theirs, their set.
        Returns the contributions to merge (sorted pairs), or None when no quorum could be had. Fetches still in
        flight when it returns are left to end on their own bounds; ``found`` no longer changes. ``seen`` is told when
        each contribution was first read on offer."""
        cfg = self.config
        now = time.monotonic()
        wait_until, give_up = now + cfg.net.min_matchmaking_time_s, now + cfg.net.matchmaking_timeout_s
        late_quorum = False
        defer_until: float | None = None  # a quorum held, the first-ranked contribution's sender merges first
        unreached: set[tuple[str, ...]] = set()  # sets taken whose bodies did not arrive (``_take_set``)
        heard = self._watch.version  # the records' changes seen (``RecordWatch.wait``)
        while True:
            timeout_s = cfg.net.dht_timeout_s if due is not None else min(cfg.net.dht_timeout_s,
                                                                           give_up - time.monotonic())
            entries = self._entries_of_live(timeout_s)
            read_at = time.monotonic()
            offered = self._offered(entries)
            quorum = self._quorum(offered)
            taken, _ = self._merged_with_ours(entries, me, quorum, unreached)
            if taken is not None and self._take_set(taken, found, time.monotonic() + cfg.net.next_chunk_timeout_s,
                                                    entries, unreached):
                return taken  # the others merged ours already: their set, if its bodies arrive within a message's bound
            if isinstance(due, RoundDue) and due.withdrawn:
                return None  # told to merge nothing of its own making (``background.rebase``)
            current = open_contributions(entries)
            if seen is not None:  # those given to an announced set count too: a set taken names them
                for name in open_contributions(entries, announced=True):
                    seen.setdefault(name, read_at)
            self._flights.forget(functools.partial(_off_offer, live=self._live(), entries=entries, mine=me))
            for name in [name for name in found if name != me and _passed(entries, name)]:
                del found[name]  # its sender withdrew it or went on to a later round: it is merged nowhere now
            wanted = [(n, e) for n, e in current.items() if n not in found and self._may_ask(n)]
            flights = self._flights.start(wanted)
            offering = due is not None and time.monotonic() >= wait_until + cfg.net.next_chunk_timeout_s
            if flights:
                self._flights.take(flights, found, SLOW_POLL_S if offering else POLL_S)
            else:  # nothing to fetch: the next pass once a peer's record changes (a DHT read's time at most)
                heard = self._watch.wait(heard, SLOW_POLL_S if offering else IDLE_POLL_S)
            held, working = self._held_peers(), self._working()
            expected = (working | offered) - held
            have = {split_pair(name)[0] for name in current if name in found}
            now = time.monotonic()
            if now >= wait_until and len(have) + 1 >= quorum and not late_quorum and offering:
                late_quorum, wait_until = True, now + cfg.net.min_matchmaking_time_s  # the others' first wait
            # Past the wait with a quorum: fetches still running get one message's bound more (a small body has
            # arrived or stalled by then), then the round goes on without them; a peer that held a fetch gets none.
            waiting = now < wait_until + cfg.net.next_chunk_timeout_s and any(
                not f.done() and split_pair(name)[0] not in held for name, f in flights.items())
            # Everyone expected is here: go on at once. Not when nobody is expected (no live composer shows work
            # here yet, or all that do held a fetch): then the round waits for a quorum as below, its contribution
            # on offer. Ending at once would withdraw it before anyone could fetch it, and fetching contributions is
            # how composers show each other work: crowded ones whose work had not reached each other yet would
            # never merge again (and two peers that each held one fetch of the other's under load neither).
            # Told to end, the round goes on with the quorum it has, or ends; not before its first wait is over (a node
            # that leaves lets the round it just began meet the others').
            hurried = due is not None and due.is_set() and now >= wait_until
            if (expected and expected <= have) or (
                    (now >= wait_until and not waiting or hurried) and len(have) + 1 >= quorum):
                # Composers that reach a quorum at once would each merge the contributions they hold, all a little
                # different, and no set would win its senders' votes: the one whose contribution ranks first among
                # those on offer merges at once, the others give it the time a set's senders get to see the set
                # (``verify_timeout_s``) to publish one naming theirs (taken above), then merge their own.
                first = _first_ranked(self.records.run_id, self.group,
                                      [me, *(n for n in current if split_pair(n)[0] in offered)])
                if hurried or defer_until is not None and now >= defer_until or first == me:
                    return tuple(sorted({me} | {name for name in current if name in found}))
                if defer_until is None:  # a round with a time limit merges what it holds at the limit
                    defer_until = min(now + cfg.net.verify_timeout_s, give_up if due is None else math.inf)
            else:
                defer_until = None  # the quorum went (a contribution merged elsewhere): a new one waits anew
            if hurried or (due is None and now >= give_up):
                return None

    def _merged_with_ours(self, entries: Mapping[str, Mapping[int, RoundEntry]], me: str, quorum: int,
                          unreached: Collection[tuple[str, ...]] = ()) -> tuple[tuple[str, ...] | None, bool]:
        """(the set of at least ``quorum`` contributions, ours among them, that most of its members merged, if any
        peer merged one, but the ``unreached``; whether any peer merged a set naming ours, of any size)."""
        # the adoptable peers read once a pass; partitioned, a set its senders announce is taken before it is merged:
        # its mergers wait for each other's blocks
        sets = merged_sets(entries, me, self._adoptable().__contains__, announced=self.parts is not None)
        return best_set({members: votes for members, votes in sets.items()
                         if len(members) >= quorum and members not in unreached}), bool(sets)

    def _last_call(self, n: int, me: str, found: dict[str, Fetched],
                   ) -> tuple[tuple[str, ...] | None, bool]:
        """Round ``n`` had no quorum, or nobody else merged its set in time: its contribution (and any vote of ours)
        comes off offer at once (no new set takes it). A peer that read it on offer just before may be merging it
        still: when a peer fetched it, the records are watched for ``verify_timeout_s`` for a set naming it, and such
        a set is taken as ``_collect`` takes one (its bodies fetched into ``found``). Returns (the set taken or None,
        whether a set naming ours was seen): a set seen and not taken may be applied by others (the caller
        reloads); none seen, nobody merged ours (this node's delta goes into its next round)."""
        self._publish(dataclasses.replace(self._entries[n], fingerprint=WITHDRAWN, participants=(), merged=b""))
        if not self.gather.store.served(self.group, n):
            return None, False
        cfg = self.config
        deadline = time.monotonic() + cfg.net.verify_timeout_s
        seen = False
        unreached: set[tuple[str, ...]] = set()  # sets taken whose bodies did not arrive (``_take_set``)
        while time.monotonic() < deadline:
            entries = self._entries_of_live(min(cfg.net.dht_timeout_s, deadline - time.monotonic()))
            taken, any_set = self._merged_with_ours(entries, me, self._quorum(self._offered(entries)), unreached)
            seen = seen or any_set
            if taken is not None and self._take_set(taken, found, deadline + cfg.net.next_chunk_timeout_s, entries,
                                                    unreached):
                logger.info("outer round %s/%d: a set of %d contributions naming this node's was merged as it came "
                            "off offer; this node merges it too", self.group, n, len(taken))
                return taken, True
            time.sleep(POLL_S)
        return None, seen

    def _may_ask(self, name: str) -> bool:
        """Whether contribution ``name`` may be fetched now: not refused this round, not waiting to be asked again."""
        with self._lock:
            return name not in self._refused and time.monotonic() >= self._retry_at.get(name, 0.0)

    def _fetch(self, name: str, entry: RoundEntry) -> Fetched | None:
        """Fetch contribution ``name`` (announced by ``entry``): its tensors and tokens, or None when unusable. With
        ``parts``, the claim checked and kept: no tensors (its blocks are fetched as the set is merged)."""
        if not self._may_ask(name):
            return None
        peer = split_pair(name)[0]
        try:
            if not self.witness.signed(peer, entry):
                if self.records.signer is not None and self.records.signer.public_key_of(peer) is None:
                    raise RemoteProtocolError("no key known for the sender yet", peer=peer)
                raise ContributionMismatch("outer contribution claim not signed by its sender's key", peer=peer)
            if not self.witness.current(peer, entry):
                raise RemoteProtocolError("outer contribution claimed in an earlier session than one seen of its "
                                          "sender (a stale copy)", peer=peer)
            if entry.size > self._body_cap:
                # Fetched by nobody. In a replicated experts' round, an owner whose view gave the round's key to a
                # larger bundle for a moment announces a larger body: other tensors, not a lie.
                error = OtherTensors if self.other_tensors_blameless else ContributionMismatch
                raise error(f"outer contribution announced at {entry.size} bytes, over the group's {self._body_cap}",
                            peer=peer)
            if self.parts is not None:
                # Partitioned: the claim checked is the contribution found; its blocks are fetched by those who
                # merge them (``partitioned``), and they are the evidence of its sender's work. A sender whose
                # blocks never arrived here, or did not arrive last time, must serve one block first: a sender that
                # holds or trickles its blocks then stays out of every set (as a gathered round's body that does not
                # arrive does), instead of failing the first set that names it on the merge's fetch bound.
                self._check_fresh(peer, entry, None)
                with self._lock:
                    suspect = peer in self._failing or peer in self._held or peer not in self._served
                if suspect:
                    self.parts.probe(name, entry)
                room = self._peers_kept()
                with self._lock:
                    held = self._claims.pop(peer, {})  # reinserted last: the peers heard from least lately go first
                    held[name] = entry
                    while len(held) > ROUNDS_KEPT:
                        del held[next(iter(held))]
                    self._claims[peer] = held
                    while len(self._claims) > room:
                        del self._claims[next(iter(self._claims))]
                self.witness.fetched(peer, entry)
                return Fetched({}, entry.tokens, entry.base, entry.drawn, entry.session)
            body = self.gather.fetch(peer, self.group, entry, self.config.net.allreduce_timeout_s,
                                     chunk_timeout_s=self.config.net.next_chunk_timeout_s)
            tensors = decode_contribution(body, self.shapes, peer=peer)
            self._check_fresh(peer, entry, tensors)
        except Exception as e:  # a bad body, a held or broken stream: that contribution is out, or out for now
            # A partitioned probe's failure is judged by its cause; it was scored, and a holder set aside, where its
            # block was fetched (``PartsMerge._fetch_blocks``).
            probed = isinstance(e, Unmergeable)
            cause = e.__cause__ if probed and e.__cause__ is not None else e
            bad = isinstance(cause, ContributionMismatch | MalformedMessage | BlockMismatch)
            stalled = isinstance(cause, StalledStream)  # it accepted the fetch and held it: evidence
            # Held, or its answer still coming at the fetch's bound (a trickle, or a link slower than the bound
            # assumes; no evidence): not asked again this round, and waited for by no round until a contribution of
            # it arrives usable.
            set_aside = stalled or isinstance(cause, SlowStream)
            blameless = self.other_tensors_blameless and isinstance(e, OtherTensors)
            if self.scores is not None and (bad or stalled) and not blameless and not probed:
                self.scores.record(peer, Evidence.STALLED if stalled else Evidence.FORGED)
            with self._lock:
                if bad or set_aside:
                    self._refused[name] = repr(e)
                else:  # not held (yet), a timeout, a broken stream: asked again after a pause
                    self._retry_at[name] = time.monotonic() + RETRY_S
                self._failing[peer] = None
                for kept in (self._refused, self._retry_at, self._failing):
                    while len(kept) > _REFUSED_KEPT:
                        del kept[next(iter(kept))]
            if set_aside and not probed:
                self._set_aside(peer)
            logger.warning("outer round %s: no usable contribution %s from peer %s%s: %s", self.group, name, peer,
                           "" if bad or set_aside else " for now", e)
            return None
        self.witness.fetched(peer, entry)
        self._worked(peer, tensors=tensors)
        return Fetched(tensors, entry.tokens, entry.base, entry.drawn, entry.session)

    def _peers_kept(self) -> int:
        """How many peers the partitioned round's per-peer state keeps (claims, senders whose blocks arrived): twice
        the live composers, at least ``_REFUSED_KEPT``. A set can name every live composer, so a fixed cap below the
        swarm's size would drop claims of the set being merged and re-probe every sender every round."""
        return max(_REFUSED_KEPT, 2 * len(self._live()))

    def _set_aside(self, peer: str) -> None:
        """``peer`` held a fetch, or trickled one past its bound (a contribution's body or blocks, or a merged share):
        no round waits for it or counts it in a quorum until a contribution of it arrives usable (``_worked``)."""
        with self._lock:
            self._held[peer] = None
            while len(self._held) > _REFUSED_KEPT:
                del self._held[next(iter(self._held))]

    def _worked(self, peer: str, digest: bytes | None = None, *,
                tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """A contribution of ``peer`` arrived usable (whole: its ``tensors``, or blocks of the contribution whose
        claim signed ``digest``): it holds no fetch and fails none now, and it shows work, unless it is all zeros (a
        body any identity can send without training)."""
        room = self._peers_kept()
        zeros = (not any(bool(t.any()) for t in tensors.values()) if tensors is not None
                 else digest is not None and digest == self._zeros())
        with self._lock:
            self._held.pop(peer, None)
            self._failing.pop(peer, None)
            for kept, noted in ((self._served, digest is not None), (self._work_arrived, not zeros)):
                if noted:
                    kept.pop(peer, None)
                    kept[peer] = None
                    while len(kept) > room:
                        del kept[next(iter(kept))]
        if self.peers.worked is not None and not zeros:
            self.peers.worked(peer)

    def _check_fresh(self, peer: str, entry: RoundEntry, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Refuse a body ``peer`` already sent for another round: two rounds of training never give the same
        pseudo-gradient bit for bit (an all-zero one aside), so it replays an old one. ``tensors``: the body's (None:
        not fetched whole, judged by its digest alone).

        Raises:
            ContributionMismatch: a replay.
        """
        with self._lock:
            seen = self._digests.setdefault(peer, {})
            earlier = seen.get(entry.digest)
            nonzero = entry.digest != self._zeros() if tensors is None else any(bool(t.any()) for t in tensors.values())
            if earlier is not None and earlier != entry.round_id and nonzero:
                raise ContributionMismatch(f"outer contribution of round {entry.round_id} replays its round "
                                           f"{earlier}", peer=peer)
            seen.setdefault(entry.digest, entry.round_id)
            while len(seen) > _DIGESTS_KEPT:
                del seen[next(iter(seen))]
            while len(self._digests) > _REFUSED_KEPT:
                del self._digests[next(iter(self._digests))]

    def _zeros(self) -> bytes:
        """The digest of an all-zero contribution in blocks (partitioned rounds), computed once: every round of it
        has this digest, and it replays nothing."""
        if self._zero_digest is None:
            zeros = {name: torch.zeros(shape) for name, shape in self.shapes.items()}
            self._zero_digest = encode_blocks(zeros, self.config.compression).digest
        return self._zero_digest

    def _take_set(self, taken: tuple[str, ...], found: dict[str, Fetched],
                  deadline: float, entries: Mapping[str, Mapping[int, RoundEntry]],
                  unreached: set[tuple[str, ...]]) -> bool:
        """Whether the set ``taken`` (one others merged naming ours) can be merged here: its bodies fetched into
        ``found`` by ``deadline`` (``_fetch_set``). One whose bodies did not arrive goes into ``unreached``, and the
        round does not take it again: a set naming a sender that serves nothing would otherwise be taken every pass
        and hide the sets ranked after it (another set of the same members among them)."""
        fetched = self._fetch_set(taken, found, deadline, entries)
        if fetched is False:
            unreached.add(taken)
        return bool(fetched)

    def _fetch_set(self, names: Sequence[str], found: dict[str, Fetched],
                   deadline: float, entries: Mapping[str, Mapping[int, RoundEntry]] | None = None) -> bool | None:
        """Fetch every contribution of ``names`` not held yet, asking again until ``deadline`` for those whose
        fetch failed for now, waiting for those in flight until then (the fetches go on after it). A sender whose
        latest fetch here had failed gets one try (once it may be asked again, ``RETRY_S``): it counts in no quorum
        until it serves one (``_offered``), and a set naming it costs no more than that try either.

        Returns:
            True when all are held; None when a claim of the set is not read here yet, or the bound passed with a
            fetch of another sender still running (a later pass may find its body); False when a body did not arrive:
            refused, failed at a failing sender's one try, or not there at the bound.
        """
        with self._lock:
            failing = {name for name in names if split_pair(name)[0] in self._failing}
        while True:
            missing = [name for name in names if name not in found]
            if not missing:
                return True
            if any(name in self._refused for name in missing):
                return False
            if entries is None:
                entries = self._entries_of_live(min(self.config.net.dht_timeout_s, deadline - time.monotonic()))
            announced = [(name, entry_of(entries, name)) for name in missing]
            if any(entry is None for _, entry in announced):
                return None
            flights = self._flights.start([(n, e) for n, e in announced if e is not None and self._may_ask(n)])
            if flights:
                self._flights.take(flights, found, max(POLL_S, deadline - time.monotonic()), every=True)
            if all(name in found for name in names):
                return True
            if any(name in failing and name not in found for name in flights):
                return False  # a failing sender's one try
            if time.monotonic() >= deadline:
                return None if any(not flight.done() for name, flight in flights.items() if name not in failing) \
                    else False
            retry = min((self._retry_at.get(name, 0.0) for name in missing if name not in found), default=0.0)
            time.sleep(max(POLL_S, min(retry, deadline) - time.monotonic()))


class Fetched(NamedTuple):
    """A usable contribution: its tensors (none yet in a partitioned round: its blocks are fetched as the set is
    merged), its sender's tokens, and what its signed claim names: the anchor (``RoundEntry.base``), the draws
    (``RoundEntry.drawn``) and the session (``RoundEntry.session``)."""

    tensors: dict[str, torch.Tensor]
    tokens: float
    base: bytes
    drawn: int = 0
    session: int = 0


class _Flights:
    """A node's fetches of one group's contributions, each running at most once at a time (a round that went on
    without one still in flight, and a later phase or round that wants the same contribution, share it); they
    end on their own bounds. Its pool's size bounds the fetches at once."""

    def __init__(self, fetch: Callable[[str, RoundEntry], Fetched | None], name: str) -> None:
        self._fetch = fetch
        self._pool = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix=name)
        self._running: dict[str, tuple[RoundEntry, Future[Fetched | None]]] = {}  # name -> (claim, its fetch)
        self._lock = threading.Lock()

    def start(self, named: Iterable[tuple[str, RoundEntry]]) -> dict[str, Future[Fetched | None]]:
        """The fetch of each of ``named``: the one in flight or ended with a usable body (a contribution is fetched
        once while it is on offer, whichever pass, phase or round asks for it), or one started now."""
        out = {}
        with self._lock:
            for name, entry in named:
                held = self._running.get(name)
                if held is None or held[0].claim() != entry.claim() or (held[1].done() and not _usable(held[1])):
                    # A claim of that name other than the one fetched (its sender restarted) is fetched anew.
                    held = self._running[name] = entry, self._pool.submit(self._fetch, name, entry)
                out[name] = held[1]
        return out

    def forget(self, gone: Callable[[str], bool]) -> None:
        """Forget the ended fetches of the contributions that ``gone`` says no round will merge now (merged, off
        offer, their sender gone): the tensors of the others serve this node's later rounds."""
        with self._lock:
            for name in [n for n, (_, f) in self._running.items() if f.done() and gone(n)]:
                del self._running[name]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._running.clear()

    @staticmethod
    def take(flights: Mapping[str, Future[Fetched | None]], found: dict[str, Fetched], timeout_s: float,
             every: bool = False) -> None:
        """Wait up to ``timeout_s`` for one of ``flights`` to end (``every``: for all of them), then put those that
        ended usable into ``found``; the others go on."""
        if flights:
            wait(list(flights.values()), timeout=timeout_s, return_when=ALL_COMPLETED if every else FIRST_COMPLETED)
        else:
            time.sleep(timeout_s)
        for name, flight in flights.items():
            if flight.done() and (got := flight.result()) is not None:
                found[name] = got


def _usable(flight: Future[Fetched | None]) -> bool:
    """Did the ended ``flight`` bring a usable contribution?"""
    return not flight.cancelled() and flight.exception() is None and flight.result() is not None


def _entry_fingerprint(name: str, record: bytes, tag: bytes,
                       anchors: dict[str, tuple[float, ...]] | None = None) -> tuple[float, ...] | None:
    """The fingerprint, tagged ``tag``, of contribution ``name``'s round in its sender's rounds record; the fingerprint
    of the anchor its merge is applied to (the contribution's ``base``) goes in ``anchors`` under ``name``."""
    entry = decode_entries(record).get(split_pair(name)[1])
    fp = decode_fingerprint(entry.fingerprint, tag) if entry is not None and entry.fingerprint else None
    if fp is not None and anchors is not None and entry is not None and entry.base:
        anchor = decode_fingerprint(entry.base)
        if anchor is not None:
            anchors[name] = anchor
    return fp


def _may_yet_agree(agreeing: int, entries: Mapping[str, Mapping[int, RoundEntry]], *,
                   participants: Sequence[str], due: threading.Event) -> bool:
    """May a strict majority of ``participants`` still agree, counting those whose senders still gather (their
    contribution on offer, unmerged: they may take our set when they see it) beside the ``agreeing``? Not once ``due``
    is set. A node whose round trains beside it waits that long past the verification's bound: crowded composers
    take seconds to see a set, fetch its bodies and merge it."""
    if due.is_set():
        return False
    gathering = 0
    for name in participants:
        peer, n = split_pair(name)
        by_round = entries.get(peer, {})
        entry = by_round.get(n)
        gathering += entry is not None and not entry.fingerprint and max(by_round) == n
    return 2 * (agreeing + gathering) > len(participants)


def _first_ranked(run_id: str, group: str, names: Iterable[str]) -> str:
    """The contribution (pair) of ``names`` that ranks first: the rank is a hash of the run, the group and the pair,
    the same on every node, and another contribution's each round."""
    return min(names, key=lambda name: hashlib.sha256(f"{run_id}/{group}/{name}".encode()).digest())


def _add_time(common: dict[str, Any], phase: str, since: float) -> float:
    """Add the time since ``since`` to a round report's ``phase`` (``RoundReport``: a round's phases sum over the
    sets it tries); returns that time."""
    spent = time.monotonic() - since
    common[phase] = common.get(phase, 0.0) + spent
    return spent


def _off_offer(name: str, *, live: Collection[str], entries: Mapping[str, Mapping[int, RoundEntry]],
               mine: str) -> bool:
    """Will no round ask for contribution ``name`` now: its sender is not live, it is ``_passed``, or its sender
    merged it in a set that does not name ``mine`` (this node's contribution)? One its sender merged in a set naming
    ours is still asked for: this node may take that set (a fetch that ended after the pass that started it would
    otherwise be forgotten unread and its body fetched again). A sender whose record a read missed is not judged."""
    peer, n = split_pair(name)
    if peer not in live or _passed(entries, name):
        return True
    entry = entries.get(peer, {}).get(n)
    return entry is not None and bool(entry.fingerprint) and mine not in entry.participants


def _passed(entries: Mapping[str, Mapping[int, RoundEntry]], name: str) -> bool:
    """Is contribution ``name`` off offer for good: its sender withdrew it or published a later round (read in
    ``entries``; a sender whose record was not read is not judged)?"""
    peer, n = split_pair(name)
    by_round = entries.get(peer)
    if not by_round:
        return False
    entry = by_round.get(n)
    return max(by_round) > n or (entry is not None and entry.fingerprint == WITHDRAWN)


def _moved_on(name: str, entries: Mapping[int, RoundEntry], tag: bytes) -> bool:
    """Has the sender of contribution ``name`` (its rounds record's ``entries``) finished its round without merging
    the set tagged ``tag``: it withdrew it, or merged it in another set and published a later round (a node runs
    one round of a group at a time, so that vote is final)?"""
    entry = entries.get(split_pair(name)[1])
    if entry is None or not entry.fingerprint:
        return False
    if entry.fingerprint == WITHDRAWN:
        return True
    return max(entries) > entry.round_id and decode_fingerprint(entry.fingerprint, tag) is None


def _better_set(entries: Mapping[str, Mapping[int, RoundEntry]], mine: str, current: tuple[str, ...],
                acceptable: Callable[[str], bool], quorum: int) -> tuple[str, ...] | None:
    """A set of at least ``quorum`` contributions, ours and only acceptable peers' among them, that a strict
    majority of its senders already merged (it verified among them: they applied it, and it is final), or that
    more of its senders merged than merged ours (our own vote for ours included: ``entries`` are the others').

    A final set is taken over ours even when as many merged ours: ours then waits for votes that are not coming
    (its other senders applied that set), and the round would be lost here while the others keep it."""
    votes = merged_sets(entries, mine, acceptable)
    ours = votes.pop(current, 0)
    votes = {members: n for members, n in votes.items() if len(members) >= quorum}
    final = {members: n for members, n in votes.items() if 2 * n > len(members)}
    if final:
        return best_set(final)
    best = best_set(votes)
    return best if best is not None and votes[best] > ours + 1 else None
