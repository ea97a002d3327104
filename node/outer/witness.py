"""Signed contribution claims, and proofs that a peer signed two different ones for one round.

A gathered round's participants fetch each contribution by the claim in its sender's rounds record (round,
sha256, size, tokens: ``transport.RoundEntry``). A sender that re-signs its claim with another digest after a
first fetch would hand each fetcher its own body: each check passes, the fetchers merge different sets, and no
round verifies. Local suspicion cannot stop it in agreement: one fetcher sees a mismatch, another sees nothing.

So each claim carries its sender's Ed25519 signature of its own (``sign``; domain ``CLAIM_DOMAIN``, over the run,
the group and the claim), and names the sender's *session* (its rounds' instance; ``new_session``). An honest
sender claims one contribution per round in a session. Every peer remembers the first claim it saw of each
(sender, round) (``Witness``, fed every rounds record its polls read); a second, different claim of the same round
and session is an ``Equivocation``: two statements under one key that anyone can check without trusting the
peer that shows them. The finder bans the sender at once and puts the proof in its own rounds record of the
group (at most ``PROOFS_SHARED``, for as long as its ban lasts); every peer that reads the record checks the
proof against the key its membership names for the accused and bans it too, so bans of an equivocator agree.

A claim of a round from a *newer* session is what a restarted sender sends when it reaches a round again from an
earlier checkpoint: no proof, but weak evidence (``Evidence.RESTARTED``), since a sender could also start a new
session for each fetcher. A claim of an older session than one seen is a stale copy of the DHT: ignored.
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
from dataclasses import dataclass

import msgpack

from parallax.node.net.scores import Evidence, PeerScores
from parallax.node.outer.transport import RoundEntry, decode_entries, record_proofs
from parallax.protocol.identity import Identity, verify

logger = logging.getLogger(__name__)

__all__ = ["CLAIM_DOMAIN", "PROOFS_SHARED", "Equivocation", "Witness", "new_session", "sign"]

CLAIM_DOMAIN = b"parallax/outer-claim/v1"
PROOFS_SHARED = 2
"""Proofs a rounds record carries (each about 330 bytes; a record holds 5 KiB)."""
_SEEN_KEPT = 4096  # (sender, round) first claims remembered, oldest forgotten first
_VERIFIED_KEPT = 4096  # claims whose signature was checked, by digest
_PROOFS_KEPT = 256  # proofs heard, by digest: each is checked and acted on once

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
        if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[0], str) and 0 < len(obj[0]) <= 128):
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


class Witness:
    """What one node saw its peers claim in one group's rounds records, and the proofs it holds and shares.

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
        self._first: OrderedDict[tuple[str, int], RoundEntry] = OrderedDict()
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._heard: OrderedDict[bytes, None] = OrderedDict()
        self._restarts: set[tuple[str, int, int]] = set()
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
            if key in self._verified:
                return True
        if not signed_by(public_key, self.run_id, self.group, entry):
            return False
        with self._lock:
            self._verified[key] = None
            while len(self._verified) > _VERIFIED_KEPT:
                self._verified.popitem(last=False)
        return True

    def read(self, records: Mapping[str, bytes]) -> bool:
        """Take in the rounds records one poll read (peer -> record): the claims each peer signed, and the proofs
        others share. Returns True when this node holds a proof it did not share before (its record should be
        stored again)."""
        if self.public_key_of is None:
            return False
        found = False
        for peer, record in records.items():
            for entry in decode_entries(record).values():
                found |= self._see(peer, entry)
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

    def _see(self, peer: str, entry: RoundEntry) -> bool:
        if not self.signed(peer, entry):
            return False  # refused when fetched (``GatheredRounds._fetch``); no claim of the peer's
        with self._lock:
            first = self._first.setdefault((peer, entry.round_id), entry)
            while len(self._first) > _SEEN_KEPT:
                self._first.popitem(last=False)
            if first.claim() == entry.claim() or entry.session < first.session:
                return False  # the same claim, or a stale copy of an earlier session's
            restarted = entry.session > first.session
            if restarted:
                self._first[(peer, entry.round_id)] = entry
                if (peer, entry.round_id, entry.session) in self._restarts:
                    return False
                if len(self._restarts) >= _SEEN_KEPT:
                    self._restarts.clear()
                self._restarts.add((peer, entry.round_id, entry.session))
        if restarted:
            if self.scores is not None:
                self.scores.record(peer, Evidence.RESTARTED)
            return False
        logger.warning("outer rounds %s: peer %s signed two different contributions for its round %d (digests "
                       "%s and %s): banned, and the proof shared", self.group, peer, entry.round_id,
                       first.digest.hex()[:12], entry.digest.hex()[:12])
        return self._convict(Equivocation(peer, first, entry))

    def _hear(self, accuser: str, obj: object) -> bool:
        proof = Equivocation.from_wire(obj)
        if proof is None:
            return False
        digest = proof.digest()
        with self._lock:
            if digest in self._heard:
                return False
            self._heard[digest] = None
            while len(self._heard) > _PROOFS_KEPT:
                self._heard.popitem(last=False)
        public_key = self.public_key_of(proof.peer) if self.public_key_of is not None else None
        if public_key is None or not proof.proves(public_key, self.run_id, self.group):
            logger.info("outer rounds %s: peer %s shows a proof of equivocation against %s that does not hold "
                        "here (no key known for it, or not its signatures): ignored", self.group, accuser,
                        proof.peer)
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
