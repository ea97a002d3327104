"""What the participants of an outer round say about it in the DHT, and how a round's verdict is reached.

Every participant keeps one signed record per group under the group's protected rounds key
(``dht.keys.outer_rounds_key``), in its own subkey: the fingerprints of its latest all-reduce rounds
(``wire.encode_round_record``), or the entries of its latest gathered rounds (``transport.RoundEntry``).
A peer's record counts only under the key the membership names for its peer id. ``RoundRecords`` reads and
writes them for one group of one node and waits for a majority to agree with this node's result.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.keys import outer_rounds_key
from parallax.dht.records import owner_subkey
from parallax.node.outer.transport import RoundEntry, latest_entries, split_pair
from parallax.node.outer.wire import FingerprintSigner, OuterSyncConfig, majority_agrees

logger = logging.getLogger(__name__)

__all__ = ["LatestRecord", "Records", "RoundDue", "RoundRecords", "RoundReport", "RoundStatus"]

POLL_S = 0.05
IDLE_POLL_S = 0.25
"""How long a round's settling, with nothing to fetch, waits for a peer's record to change before it looks again
(a DHT read's time on busy cores): the peers that answer its questions wake it at once."""
SLOW_POLL_S = 1.0
"""How often a wait that has gone past its first bound reads the records (a waiting contribution, a verification
whose other senders still gather): a result is seen within about this long, and the DHT is not read twenty times a
second for as long as it waits."""
RETRY_S = 0.5
"""A fetch that failed without evidence against its server (not held yet, a stream broken or refused) is asked for
again after this."""


class Records(dict[str, bytes]):
    """peer -> its raw rounds record, as one read found them. ``unknown``: the peers asked of a DHT read that failed
    (timed out on a loaded host) and not heard otherwise: missing here, they are unknown, not without a record."""

    unknown: frozenset[str] = frozenset()


class RoundDue(threading.Event):
    """A round's ``due`` (``GatheredRounds.run``): set when a round that waits for a quorum must end, it merges with
    the quorum it has, or withdraws. ``withdraw`` sets it so that the round merges no set of its own making: its
    contribution comes off offer at once (a set the others already merged with it is still taken, as any round's
    last call takes one)."""

    def __init__(self) -> None:
        super().__init__()
        self.withdrawn = False

    def withdraw(self) -> None:
        self.withdrawn = True
        self.set()


class RoundStatus(StrEnum):
    """How one outer round ended for this node (``meaning`` says it for people: logs, ``parallax report``)."""

    OK = "ok"
    BAD_INPUT = "bad_input"
    BUSY = "busy"
    NO_GROUP = "no_group"
    FAILED = "failed"
    TIMEOUT = "timeout"
    NO_TOKENS = "no_tokens"
    DIVERGED = "diverged"
    UNVERIFIED = "unverified"
    SUPERSEDED = "superseded"
    UNANSWERED = "unanswered"
    CLAIMED_BEFORE = "claimed_before"

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    RoundStatus.OK: "merged, and a majority of the participants got the same result: applied",
    RoundStatus.BAD_INPUT: "this node's own pseudo-gradient was not finite: it did not take part",
    RoundStatus.BUSY: "an earlier round of the group still held its buffers: skipped",
    RoundStatus.NO_GROUP: "too few other composers had a contribution ready within the matchmaking wait (a quorum "
                          "of the live ones): nothing merged, the pseudo-gradient goes into the next round",
    RoundStatus.FAILED: "the exchange broke off (a participant vanished or timed out): nothing applied",
    RoundStatus.TIMEOUT: "the round outlived its time budget and was cancelled",
    RoundStatus.NO_TOKENS: "no participant had trained a token since the last merge: nothing to merge",
    RoundStatus.DIVERGED: "this node's result disagreed with the majority's: not applied, the group reloaded from "
                          "peers",
    RoundStatus.UNVERIFIED: "too few results arrived to form a majority: not applied, the group reloaded from peers",
    RoundStatus.SUPERSEDED: "the other senders of this node's set merged theirs in another set: not applied",
    RoundStatus.UNANSWERED: "no other sender of this node's set merged it in time: its contribution withdrawn, the "
                            "pseudo-gradient goes into the next round",
    RoundStatus.CLAIMED_BEFORE: "this node's earlier process already claimed a contribution for this round (a restart "
                                "from an earlier checkpoint): skipped, the pseudo-gradient goes into the next round",
}


@dataclass(frozen=True)
class RoundReport:
    """What happened in one ``run_round`` (logs, metrics, the node's decision to reload)."""

    group: str
    status: RoundStatus
    round_id: int | None = None
    participants: tuple[str, ...] = ()
    tokens: dict[str, float] = field(default_factory=dict)
    agreeing: int = 0
    pack_s: float = 0.0
    """Packing the components into the averaged buffers."""
    allreduce_s: float = 0.0
    """Matchmaking and all-reduce (hivemind's step); gathered and partitioned rounds: settling the set and fetching
    what it takes (whole bodies, or the claims of a partitioned set), the sets tried after the first included."""
    waited_s: float = 0.0
    """Of ``allreduce_s``: from this node's contribution on offer until the last of the set it merged was read on
    offer (their senders reach the round at their own steps); the rest is settling among contributions here."""
    merge_s: float = 0.0
    """Gathered and partitioned rounds: merging the set (partitioned: fetching this node's blocks of each
    contribution, merging them, waiting for the other mergers' shares and fetching them, the rechecks)."""
    verify_s: float = 0.0
    """Waiting for a majority of the set to publish our fingerprint (summed over the sets tried)."""
    total_s: float = 0.0
    began_allreduce: bool = False
    """A group formed and exchanged tensors: the other members may have completed the round."""
    suspects: tuple[str, ...] = ()
    """Peers whose contribution the robust merge dropped or clipped (gathered rounds)."""
    geometry: dict[str, Any] | None = None
    """With ``net.outer.record_merges``, an applied round's ``train.robust.merge_geometry`` of the set it merged, in
    ``participants``' order, with the capped weights under ``weights`` and the set's contributions (sorted pairs)
    under ``contributions``; partitioned, of the blocks this node merged (their indices under ``blocks``; absent
    when it merged none), which the set's other mergers' geometries complete."""
    apart_from: tuple[str, ...] = ()
    """An applied round whose other participants hold another anchor than this node's (gathered rounds): the peers
    of the strict majority that hold one; this node takes the group's state from them."""
    left_out: tuple[str, ...] = ()
    """Participants whose contributions the merge left out: taken from another anchor than the set's majority's
    (gathered rounds, ``wire.set_anchor``)."""
    ours_left_out: bool = False
    """This node's own contribution is among ``left_out``: the merge holds nothing of it, so what this node trained
    stays its own (``background``)."""
    base: tuple[float, ...] | None = None
    """The ``wire.anchor_fingerprint`` of the anchor the merge is a step from: the one a strict majority of its set's
    contributions were taken from (gathered rounds, ``wire.set_anchor``; None: none named, or no majority). A node
    whose download of the group's state lands on that anchor applies the merge again on it (``background``)."""
    detail: str = ""

    @property
    def needs_reload(self) -> bool:
        """True when others may have applied a round this peer did not: reload the group from peers."""
        if self.status in (RoundStatus.DIVERGED, RoundStatus.UNVERIFIED):
            return True
        return self.began_allreduce and self.status in (RoundStatus.FAILED, RoundStatus.TIMEOUT, RoundStatus.BUSY,
                                                        RoundStatus.NO_GROUP, RoundStatus.NO_TOKENS,
                                                        RoundStatus.SUPERSEDED, RoundStatus.UNANSWERED)


class LatestRecord:
    """One node's record of a group as it goes to the DHT: one store at a time, the latest value last.

    A value is ``put`` (by callers that order their values themselves), then stored: ``flush()`` returns once it or a
    later value is stored; ``flush(wait=False)`` stores it in the background after any store in flight, or not at all
    when a later value replaced it first (a partitioned merge's steps go on while the set it names, or its root,
    reaches the DHT: each store takes a DHT round trip, 0.2-0.5 s on busy cores).

    Args:
        store: stores a value; False when no peer took it.
        name: names the background thread.
    """

    def __init__(self, store: Callable[[bytes], bool], name: str) -> None:
        self._store = store
        self._lock = threading.Lock()  # ``_pending``
        self._storing = threading.Lock()  # one store at a time
        self._pending: bytes | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def put(self, value: bytes) -> None:
        """``value`` replaces whatever was put and not stored yet."""
        with self._lock:
            self._pending = value

    def flush(self, *, wait: bool = True) -> None:
        """Store the latest value put, now (``wait``) or in the background."""
        if not wait:
            try:
                self._pool.submit(self._flush)
                return
            except RuntimeError:  # closed: a round still running as its node shuts down stores it here
                pass
        self._flush()

    def _flush(self) -> None:
        with self._storing:
            with self._lock:
                value, self._pending = self._pending, None
            if value is not None and not self._store(value):
                logger.debug("a rounds record of %d bytes was taken by no peer", len(value))

    def close(self) -> None:
        """Drop the stores not begun; one running ends on its own bound."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class RoundRecords:
    """The rounds records of one group, as one node reads and writes them.

    Args:
        dht: this node's DHT.
        run_id, group: name the key.
        config: timeouts and the agreement tolerance.
        signer: this node's identity (its record goes under its signing key's subkey, signed by the DHT's record
            validator) and the key the membership names for each peer; None keeps records under peer-id
            subkeys, unsigned (tests of the averaging alone).
    """

    def __init__(self, dht: SwarmDHT, run_id: str, group: str, config: OuterSyncConfig,
                 signer: FingerprintSigner | None) -> None:
        self.key = outer_rounds_key(run_id, group)
        self.run_id, self.group, self.config, self.signer = run_id, group, config, signer
        self.on_read: Callable[[Mapping[str, bytes]], None] | None = None
        """Shown every read's records (a gathered round's ``witness.Witness``)."""
        self.peer_id = dht.peer_id
        self._dht = dht
        self._own_subkey = owner_subkey(signer.identity.public_key) if signer is not None else self.peer_id.encode()

    def store(self, value: bytes) -> bool:
        """Replace this node's record of the group; False when no peer took it."""
        return self._dht.store(self.key, self._own_subkey, value, dht_time() + self.config.net.fingerprint_ttl_s,
                               timeout_s=self.config.net.dht_timeout_s)

    def read(self, peers: Sequence[str], timeout_s: float) -> Records:
        """peer -> its raw record, for the peers whose key the membership names (all of ``peers`` in
        ``Records.unknown`` when the read failed)."""
        found = self._dht.get_dicts([self.key], latest=True, timeout_s=max(0.1, timeout_s))
        records = (found or {}).get(self.key, {})
        out = Records()
        if found is None:
            out.unknown = frozenset(peers)
        for peer in peers:
            subkey = self.subkey_of(peer)
            if subkey is not None and subkey in records and isinstance(records[subkey][0], bytes):
                out[peer] = records[subkey][0]
        if self.on_read is not None:
            self.on_read(out)
        return out

    def read_own(self, timeout_s: float) -> bytes | None:
        """This node's own record as the DHT holds it (one its earlier process left, until it expires); None when
        there is none or the read failed."""
        found = self._dht.get_dicts([self.key], latest=True, timeout_s=max(0.1, timeout_s))
        held = (found or {}).get(self.key, {}).get(self._own_subkey)
        return held[0] if held is not None and isinstance(held[0], bytes) else None

    def subkey_of(self, peer: str) -> bytes | None:
        """The subkey ``peer`` keeps its fingerprints under: its signing key's (None: no key known for it)."""
        if self.signer is None:
            return peer.encode()
        public_key = self.signer.public_key_of(peer)
        return None if public_key is None else owner_subkey(public_key)

    def await_majority(
        self, fp: tuple[float, ...], participants: Sequence[str],
        read: Callable[[str, bytes], tuple[float, ...] | None], *, deadline: float | None = None,
        other_set: Callable[[Mapping[str, Mapping[int, RoundEntry]]], tuple[str, ...] | None] | None = None,
        readers: Callable[[], set[str]] = set,
        moved_on: Callable[[str, Mapping[int, RoundEntry]], bool] | None = None,
        extend: Callable[[int, Mapping[str, Mapping[int, RoundEntry]]], bool] | None = None,
        source: Callable[[Sequence[str], float], Records] | None = None,
    ) -> tuple[RoundStatus, int, int, tuple[str, ...] | None]:
        """Wait for a majority verdict on our fingerprint (until ``deadline``, default verify_timeout_s from now, and
        past it while ``extend`` holds). A read that left a sender whose fingerprint is still missing unknown (its
        DHT read failed) decides nothing: past the deadline, such reads extend the wait by at most
        ``verify_timeout_s`` more (``OuterSyncConfig.round_budget_s`` counts it). On a loaded host a DHT read can take
        longer than the verification's bound, and a verdict on a read that found nobody takes this node's vote back
        from a set its other senders may be verifying.

        Args:
            participants: the round's participants; in a gathered round, contributions named "peer@round".
            read: (participant, its sender's rounds record) -> the round's fingerprint there, or None.
            other_set: a gathered round's check, each poll, for a set of contributions that more of their
                senders merged than ours: the wait then ends, and the caller may merge that set instead.
            readers: () -> further peers whose records ``other_set`` sees (a gathered round: the live composers).
            moved_on: a gathered round's (participant, its sender's entries by round) -> True when that sender has
                finished the participant's round without merging our set: its vote is never coming.
            extend: a gathered round's (participants agreeing so far, the senders' entries by round) -> True to wait
                on past ``deadline`` (the records are then read once every ``SLOW_POLL_S``).
            source: (peers, timeout) -> their records (default ``read``: the DHT); a gathered round's gives the
                answers of the peers that answer its questions as they come, and the DHT's for the others.

        Returns:
            (OK, DIVERGED when those who answered outvoted us, UNVERIFIED when too few answered, or
            SUPERSEDED when every fingerprint found agrees with ours but senders that ``moved_on`` leave a
            majority out of reach: nobody can have applied our set;
            how many participants agree with us, us included; how many fingerprints we had, ours included;
            the other set, or None).
        """
        cfg = self.config
        deadline = time.monotonic() + cfg.net.verify_timeout_s if deadline is None else deadline
        source = self.read if source is None else source
        others: dict[str, tuple[float, ...]] = {}
        mine = [p for p in participants if split_pair(p)[0] == self.peer_id] if other_set else [self.peer_id]
        wanted = [p for p in participants if p not in mine]
        while True:
            remaining = deadline - time.monotonic()
            senders = {split_pair(p)[0] if other_set else p: p for p in wanted}
            # past the deadline, a read gets a DHT read's whole bound: it is the one that decides
            timeout_s = min(cfg.net.dht_timeout_s, remaining) if remaining > 0 else cfg.net.dht_timeout_s
            records = source(sorted(set(senders) | readers()), timeout_s)
            for sender, name in senders.items():
                decoded = read(name, records[sender]) if sender in records else None
                if decoded is not None:
                    others[name] = decoded
            verdict, agreeing = majority_agrees(fp, others, len(participants), cfg.tolerance)
            if verdict:
                return RoundStatus.OK, agreeing, len(others) + 1, None
            missing = {sender for sender, name in senders.items() if name not in others}
            unknown = bool(records.unknown & missing)  # a sender still owed was not read: this read decides nothing
            entries = latest_entries(records) if other_set is not None or moved_on is not None or extend else {}
            # another set's votes are counted on a read that left no peer it asked unknown, not on part of them
            other = other_set(entries) if other_set is not None and not records.unknown else None
            if other is not None:
                return RoundStatus.DIVERGED, agreeing, len(others) + 1, other
            disagreeing = len(others) + 1 - agreeing
            if moved_on is not None and disagreeing == 0:
                gone = sum(1 for sender, name in senders.items()
                           if name not in others and sender in entries and moved_on(name, entries[sender]))
                if 2 * gone >= len(participants):
                    return RoundStatus.SUPERSEDED, agreeing, len(others) + 1, None
            if 2 * disagreeing >= len(participants) or len(others) == len(wanted):
                # A majority is out of reach whoever answers later.
                return RoundStatus.DIVERGED, agreeing, len(others) + 1, None
            now = time.monotonic()
            late = now >= deadline
            undecided = unknown and now < deadline + cfg.net.verify_timeout_s
            if late and not undecided and not (extend is not None and extend(agreeing, entries)):
                return RoundStatus.UNVERIFIED, agreeing, len(others) + 1, None
            time.sleep(SLOW_POLL_S if late else POLL_S)
