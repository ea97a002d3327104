"""Signed contribution claims, and proofs that a peer signed two different ones for one round.

A gathered round's participants fetch each contribution by the claim in its sender's rounds record (round,
sha256, size, tokens: ``transport.RoundEntry``). A sender that re-signs its claim with another digest after a
first fetch would hand each fetcher its own body: each check passes, the fetchers merge different sets, and no
round verifies. Local suspicion cannot stop it in agreement: one fetcher sees a mismatch, another sees nothing.

So each claim carries its sender's Ed25519 signature of its own (``sign``; domain ``CLAIM_DOMAIN``, over the run,
the group and the claim), and names the sender's *session* (its rounds' instance; ``new_session``). An honest
sender claims one contribution per round in a session. Every peer remembers the first claim it saw of each
(sender, round), and the claims whose bodies it fetched longer (``Witness``, fed every rounds record its polls
read); a second, different claim of the same round and session is an ``Equivocation``: two statements under one
key that anyone can check without trusting the peer that shows them. The finder bans the sender at once and puts
the proof in its own rounds record of the group (at most ``PROOFS_SHARED``, for as long as its ban lasts); every
peer that reads the record checks the proof against the key its membership names for the accused and bans it
too, so bans of an equivocator agree.

Claims of one round in two sessions are what a restarted sender makes when it reaches a round again from an
earlier checkpoint: no proof, but weak evidence (``Evidence.RESTARTED``, once per pair of sessions), since a
sender could also use a new session for each fetcher. No claim of an older session than the newest one seen of its
sender is fetched (it is a stale DHT copy, or a liar going back to an earlier session).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgpack

from parallax.node.net.scores import Evidence, PeerScores
from parallax.node.outer.transport import PEER_ID_RE, RoundEntry, decode_entries, record_proofs
from parallax.node.outer.wire import ROUNDS_KEPT
from parallax.protocol.identity import Identity, verify

logger = logging.getLogger(__name__)

__all__ = ["CLAIM_DOMAIN", "PROOFS_SHARED", "Equivocation", "Witness", "new_session", "sign"]

CLAIM_DOMAIN = b"parallax/outer-claim/v1"
PROOFS_SHARED = 2
"""Proofs a rounds record carries (each about 330 bytes; a record holds 5 KiB)."""
_ENTRIES_READ = ROUNDS_KEPT  # of a record, the highest rounds taken in: an honest record holds no more
_PEERS_KEPT = 1024  # senders whose claims are remembered, the least recently seen forgotten first
_ROUNDS_KEPT = 64  # per sender: first claims seen, and apart from them the claims fetched, oldest dropped first
_VERIFIED_KEPT = 4096  # claims whose signature was checked (valid or not), by digest
_PROOFS_KEPT = 256  # proofs checked, by digest: each is acted on once

_last_session = 0
_session_lock = threading.Lock()


def new_session() -> int:
    """A session number for a new rounds instance of this process: microseconds since the epoch, above every one
    handed out before (two instances started in the same microsecond still differ)."""
    global _last_session
    with _session_lock:
        _last_session = max(time.time_ns() // 1000, _last_session + 1)
        return _last_session


def _signed_data(run_id: str, group: str, entry: RoundEntry) -> bytes:
    return msgpack.packb([run_id, group, *entry.claim()], use_bin_type=True)


def sign(identity: Identity, run_id: str, group: str, entry: RoundEntry) -> RoundEntry:
    """``entry`` with its claim signed by ``identity``."""
    return dataclasses.replace(entry, signature=identity.sign(CLAIM_DOMAIN, _signed_data(run_id, group, entry)))


def signed_by(public_key: bytes, run_id: str, group: str, entry: RoundEntry) -> bool:
    """Whether ``entry``'s claim carries ``public_key``'s signature for this run and group."""
    return verify(public_key, entry.signature, CLAIM_DOMAIN, _signed_data(run_id, group, entry))


@dataclass(frozen=True)
class Equivocation:
    """Two claims ``peer`` signed for one round of one session that differ: proof that it equivocated."""

    peer: str
    first: RoundEntry
    second: RoundEntry

    def to_wire(self) -> list[object]:
        return [self.peer, self.first.claim_to_wire(), self.second.claim_to_wire()]

    @classmethod
    def from_wire(cls, obj: object) -> Equivocation | None:
        """None for anything malformed (checked for its content, not its signatures: ``proves``)."""
        if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[0], str) and PEER_ID_RE.fullmatch(obj[0])):
            return None
        first, second = RoundEntry.claim_from_wire(obj[1]), RoundEntry.claim_from_wire(obj[2])
        return None if first is None or second is None else cls(obj[0], first, second)

    def proves(self, public_key: bytes, run_id: str, group: str) -> bool:
        """Whether these are two different claims of one round and session, both signed with ``public_key``."""
        a, b = self.first, self.second
        return (a.round_id == b.round_id and a.session == b.session and a.claim() != b.claim()
                and signed_by(public_key, run_id, group, a) and signed_by(public_key, run_id, group, b))

    def digest(self) -> bytes:
        return hashlib.sha256(msgpack.packb(self.to_wire(), use_bin_type=True)).digest()


@dataclass
class _Claims:
    """What one node remembers of one sender's claims."""

    seen: OrderedDict[int, RoundEntry] = field(default_factory=OrderedDict)
    """round -> the claim that counts for it (the first seen; a newer session's replaces an older one's)."""
    fetched: OrderedDict[int, RoundEntry] = field(default_factory=OrderedDict)
    """round -> the claim whose body this node fetched: what it may have merged, kept apart from ``seen`` so that
    claims of made-up rounds cannot push it out."""
    newest: int = 0
    """The newest session seen."""
    pairs: set[tuple[int, int]] = field(default_factory=set)
    """Pairs of sessions already counted as a restart."""


class Witness:
    """What one node saw its peers claim in one group's rounds records, and the proofs it holds and shares
    (thread-safe: the round's thread reads, its fetches check and pin claims).

    Args:
        run_id, group: what the claims are signed for.
        public_key_of: the key the live membership names for a libp2p peer id (None: unknown). None: claims are
            neither signed nor checked (tests of the averaging alone).
        scores: where evidence goes, and how long a ban lasts. None: proofs are found and shared, nobody banned.
        clock: monotonic seconds (tests).
    """

    def __init__(self, run_id: str, group: str, public_key_of: Callable[[str], bytes | None] | None,
                 scores: PeerScores | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_id, self.group, self.public_key_of, self.scores = run_id, group, public_key_of, scores
        self._clock = clock
        self._claims: OrderedDict[str, _Claims] = OrderedDict()
        self._verified: OrderedDict[bytes, bool] = OrderedDict()
        self._heard: OrderedDict[bytes, None] = OrderedDict()
        self._shared: dict[str, tuple[float, Equivocation]] = {}  # peer -> (until when, proof) this node shows
        self._lock = threading.Lock()

    def signed(self, peer: str, entry: RoundEntry) -> bool:
        """Whether ``entry``'s claim is signed by the key the membership names for ``peer`` (always, unchecked)."""
        if self.public_key_of is None:
            return True
        public_key = self.public_key_of(peer)
        if public_key is None:
            return False
        key = hashlib.sha256(public_key + msgpack.packb(entry.claim_to_wire(), use_bin_type=True)).digest()
        with self._lock:
            verdict = self._verified.get(key)
        if verdict is None:
            verdict = signed_by(public_key, self.run_id, self.group, entry)
            with self._lock:
                self._verified[key] = verdict
                while len(self._verified) > _VERIFIED_KEPT:
                    self._verified.popitem(last=False)
        return verdict

    def current(self, peer: str, entry: RoundEntry) -> bool:
        """Whether ``entry`` is of ``peer``'s newest session seen (a claim of an older one is not fetched)."""
        with self._lock:
            claims = self._claims.get(peer)
            return claims is None or entry.session >= claims.newest

    def fetched(self, peer: str, entry: RoundEntry) -> None:
        """This node fetched the body ``entry`` claims: remember the claim as long as it can matter."""
        if self.public_key_of is None:
            return
        with self._lock:
            kept = self._claims_of(peer).fetched
            kept.setdefault(entry.round_id, entry)
            while len(kept) > _ROUNDS_KEPT:
                kept.popitem(last=False)

    def read(self, records: Mapping[str, bytes]) -> bool:
        """Take in the rounds records one poll read (peer -> record): the claims each peer signed, and the proofs
        others share. Returns True when this node holds a proof it did not share before (its record should be
        stored again)."""
        if self.public_key_of is None:
            return False
        found = False
        for peer, record in records.items():
            entries = decode_entries(record)
            for n in sorted(entries)[-_ENTRIES_READ:]:
                found |= self._see(peer, entries[n])
            for obj in itertools.islice(record_proofs(record), PROOFS_SHARED):
                found |= self._hear(peer, obj)
        return found

    def shared(self) -> list[list[object]]:
        """The proofs this node's rounds record carries: those of its bans still running, newest first."""
        now = self._clock()
        with self._lock:
            for peer in [p for p, (until, _) in self._shared.items() if until <= now]:
                del self._shared[peer]
            newest = sorted(self._shared.values(), key=lambda kept: -kept[0])[:PROOFS_SHARED]
        return [proof.to_wire() for _, proof in newest]

    def _claims_of(self, peer: str) -> _Claims:
        """``peer``'s claims, made most recently used (under the lock)."""
        claims = self._claims.get(peer)
        if claims is None:
            claims = self._claims[peer] = _Claims()
            while len(self._claims) > _PEERS_KEPT:
                self._claims.popitem(last=False)
        self._claims.move_to_end(peer)
        return claims

    def _see(self, peer: str, entry: RoundEntry) -> bool:
        if not self.signed(peer, entry):
            return False  # refused when fetched (``GatheredRounds._fetch``); no claim of the peer's
        with self._lock:
            claims = self._claims_of(peer)
            claims.newest = max(claims.newest, entry.session)
            first = claims.fetched.get(entry.round_id) or claims.seen.get(entry.round_id)
            if first is None:
                claims.seen[entry.round_id] = entry
                while len(claims.seen) > _ROUNDS_KEPT:
                    claims.seen.popitem(last=False)
                return False
            if first.claim() == entry.claim():
                return False
            if first.session != entry.session:
                if entry.session > first.session:
                    claims.seen[entry.round_id] = entry
                pair = (min(first.session, entry.session), max(first.session, entry.session))
                counted = pair in claims.pairs
                if len(claims.pairs) >= _ROUNDS_KEPT:
                    claims.pairs.clear()
                claims.pairs.add(pair)
        if first.session != entry.session:
            if not counted and self.scores is not None:
                self.scores.record(peer, Evidence.RESTARTED)
            return False
        logger.warning("outer rounds %s: peer %s signed two different contributions for its round %d (digests "
                       "%s and %s): banned, and the proof shared", self.group, peer, entry.round_id,
                       first.digest.hex()[:12], entry.digest.hex()[:12])
        return self._convict(Equivocation(peer, first, entry))

    def _hear(self, accuser: str, obj: object) -> bool:
        proof = Equivocation.from_wire(obj)
        if proof is None or self.public_key_of is None:
            return False
        public_key = self.public_key_of(proof.peer)
        if public_key is None:
            return False  # checked once the membership names its key
        digest = hashlib.sha256(public_key + proof.digest()).digest()
        with self._lock:
            if digest in self._heard:
                return False
            self._heard[digest] = None
            while len(self._heard) > _PROOFS_KEPT:
                self._heard.popitem(last=False)
        if not proof.proves(public_key, self.run_id, self.group):
            logger.info("outer rounds %s: peer %s shows a proof of equivocation against %s that does not hold "
                        "(not two different claims of one round and session under its key): ignored", self.group,
                        accuser, proof.peer)
            return False
        logger.warning("outer rounds %s: peer %s shows that peer %s signed two different contributions for its "
                       "round %d: banned", self.group, accuser, proof.peer, proof.first.round_id)
        return self._convict(proof)

    def _convict(self, proof: Equivocation) -> bool:
        """Ban the proof's peer and show the proof while the ban lasts; True when it is newly shown."""
        if self.scores is not None:
            self.scores.record(proof.peer, Evidence.EQUIVOCATION)
        ban_s = self.scores.ban_s if self.scores is not None else 600.0
        with self._lock:
            new = proof.peer not in self._shared
            self._shared[proof.peer] = (self._clock() + ban_s, proof)
        return new
