"""Signed contribution claims, and proofs that a peer signed two different ones for one round, or a block with
non-finite values.

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

A block of a partitioned round's contribution that lies under its sender's signed root and holds non-finite values
is the other proof (``BadBlock``): no honest encoder makes one. Too large for a record, it is served by the node that
found it and referred to in that node's record; readers fetch it, check it, ban and refer to it in turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from parallax.node.net.scores import Evidence, PeerScores
from parallax.node.outer.blocks import answer_cap, block_layout, blocks_cap, check_answer, decode_block
from parallax.node.outer.transport import PEER_ID_RE, RoundEntry, decode_entries, record_proofs
from parallax.node.outer.wire import ROUNDS_KEPT
from parallax.protocol.errors import NonFiniteTensor, ProtocolError
from parallax.protocol.identity import Identity, verify
from parallax.protocol.schema import MSGPACK_ERRORS

logger = logging.getLogger(__name__)

__all__ = ["ASKS_AT_ONCE", "CLAIM_DOMAIN", "PROOFS_SHARED", "BadBlock", "Equivocation", "Witness", "new_session",
           "proof_cap", "proofs_key", "sign", "signed_by"]

CLAIM_DOMAIN = b"parallax/outer-claim/v1"
PROOFS_SHARED = 2
"""Proofs a rounds record carries (each about 330 bytes, a bad block's reference about 130; a record holds 5 KiB)."""
_BLOCK_TAG = "block"  # a shared bad block's reference: [tag, accused, number, sha256 of the proof, its size]
_ENTRIES_READ = ROUNDS_KEPT  # of a record, the highest rounds taken in: an honest record holds no more
_PEERS_KEPT = 1024  # senders whose claims are remembered, the least recently seen forgotten first
_ROUNDS_KEPT = 64  # per sender: first claims seen, and apart from them the claims fetched, oldest dropped first
_VERIFIED_KEPT = 4096  # claims whose signature was checked (valid or not), by digest
_PROOFS_KEPT = 256  # proofs checked, by digest: each is acted on once
ASKS_AT_ONCE = 4
"""Proofs of bad blocks asked for and not arrived yet, at most (one per peer asked)."""
_FAILED_S = 600.0  # a peer that did not serve a proof it showed, or served one that does not hold, is not asked again
_proof_numbers = itertools.count(1)  # of the bad blocks this process serves, under one store key a group

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


@dataclass(frozen=True)
class BadBlock:
    """A block ``peer`` signed whose values are not finite: its claim (signed), the block's index and the answer its
    sender gives to a fetch of that block alone (``blocks.Answer.alone``: the block and the hashes that lead from it
    to the claim's root). No honest sender makes one (every encoder refuses non-finite values), so a peer's own
    signature over such a block is proof against it: a partitioned round's block reaches only the peers that merge,
    probe or recheck it, and the others ban its sender on this proof (``Witness``). A block that fails for any other
    reason (a codec or shape this node does not take) is no proof: peers of other versions, or owners of replicated
    experts whose views differ for a moment, cut and encode blocks this node cannot read."""

    peer: str
    claim: RoundEntry
    index: int
    answer: bytes

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.peer, self.claim.claim_to_wire(), self.index, self.answer], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> BadBlock | None:
        """None for anything malformed (checked for its form, not its content: ``proves``)."""
        try:
            obj = msgpack.unpackb(data, raw=False, max_bin_len=len(data), max_str_len=128, max_array_len=8,
                                  max_map_len=0)
        except MSGPACK_ERRORS:
            return None
        if not (isinstance(obj, list) and len(obj) == 4 and isinstance(obj[0], str) and PEER_ID_RE.fullmatch(obj[0])
                and type(obj[2]) is int and obj[2] >= 0 and isinstance(obj[3], bytes)):
            return None
        claim = RoundEntry.claim_from_wire(obj[1])
        return None if claim is None else cls(obj[0], claim, obj[2], obj[3])

    def proves(self, public_key: bytes, run_id: str, group: str, shapes: Mapping[str, Sequence[int]]) -> str | None:
        """What is not finite in the block, when ``public_key`` signed its claim and the claim's root leads to it;
        None when it proves nothing (another key, another block, an answer that does not check, or a block that
        decodes or fails for another reason)."""
        layout = block_layout(shapes)
        if self.index >= len(layout) or not signed_by(public_key, run_id, group, self.claim):
            return None
        block = layout[self.index]
        try:
            blob = check_answer(self.answer, self.claim.digest, [self.index], len(layout), peer=self.peer).blobs
        except ProtocolError:
            return None
        try:
            decode_block(blob[self.index], block, shapes[block.name], peer=self.peer)
        except NonFiniteTensor as e:
            return e.reason
        except ProtocolError:
            return None
        return None

    def digest(self) -> bytes:
        return hashlib.sha256(self.to_bytes()).digest()


def proofs_key(group: str) -> str:
    """The store key (``transport.ContributionStore``) of the ``BadBlock`` proofs a node serves for ``group``, each
    under its number."""
    return f"{group}#proofs"


def proof_cap(shapes: Mapping[str, Sequence[int]]) -> int:
    """The most bytes a ``BadBlock`` of a group of ``shapes`` holds: its largest block's answer, and the claim."""
    layout = block_layout(shapes)
    return max(answer_cap(blocks_cap([b], shapes), 1, len(layout)) for b in layout) + 1024


def _keep(kept: OrderedDict[Any, Any], key: object, value: object = None) -> None:
    """``kept[key] = value``, made the newest, the oldest dropped past ``_PROOFS_KEPT`` (the caller holds the lock)."""
    kept.pop(key, None)
    kept[key] = value
    while len(kept) > _PROOFS_KEPT:
        kept.popitem(last=False)


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

    Proofs of equivocation go in the rounds record whole. A ``BadBlock`` holds a block, too large for a record: the
    finder serves it (``serve``: under a number of its own) and its record carries a reference (the number, the
    proof's sha256 and size); a reader asks the finder for it (``ask``), checks it and bans and shares it in turn.

    Args:
        run_id, group: what the claims are signed for.
        me: this node's peer id: no proof against it is acted on (an honest node's own claims and blocks are sound).
        public_key_of: the key the live membership names for a libp2p peer id (None: unknown). None: claims are
            neither signed nor checked (tests of the averaging alone).
        scores: where evidence goes, and how long a ban lasts. None: proofs are found and shared, nobody banned.
        shapes: the group's tensors (bad blocks are checked against their layout); None: none checked or shared.
        serve: serves the bytes of a ``BadBlock`` under a number (the latest few; ``transport.OuterGather``).
        ask: asks a peer (accuser, accused, number, sha256, size) for a ``BadBlock`` its record refers to, in the
            background; what arrives, or None when nothing usable did, goes to ``hear_block``. At most
            ``ASKS_AT_ONCE`` asks are open at once, one per accuser, each proof asked of one accuser at a time; an
            accuser that did not serve a proof that holds is not asked again for ``_FAILED_S``.
        clock: monotonic seconds (tests).
    """

    def __init__(self, run_id: str, group: str, public_key_of: Callable[[str], bytes | None] | None,
                 scores: PeerScores | None, *, me: str = "", shapes: Mapping[str, Sequence[int]] | None = None,
                 serve: Callable[[int, bytes], None] | None = None,
                 ask: Callable[[str, str, int, bytes, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_id, self.group, self.public_key_of, self.scores = run_id, group, public_key_of, scores
        self.me = me
        self.shapes = None if shapes is None else {name: tuple(s) for name, s in shapes.items()}
        self._proof_cap = 0 if self.shapes is None else proof_cap(self.shapes)
        self._serve, self._ask, self._clock = serve, ask, clock
        self._claims: OrderedDict[str, _Claims] = OrderedDict()
        self._verified: OrderedDict[bytes, bool] = OrderedDict()
        self._heard: OrderedDict[bytes, None] = OrderedDict()
        self._shared: dict[str, tuple[float, list[object]]] = {}  # peer -> (until when, proof) this node shows
        self._asking: dict[bytes, str] = {}  # proof sha256 -> the accuser asked for it, while the ask is open
        self._failed: OrderedDict[str, float] = OrderedDict()  # accuser -> until when it is not asked
        self._held: OrderedDict[bytes, None] = OrderedDict()  # sha256 of the bad blocks that held as proof
        self._refuted: OrderedDict[bytes, None] = OrderedDict()  # sha256 of bytes shown as one that prove nothing
        self._unshown = False  # a proof found outside a read, not in this node's record yet
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # an ask ended

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
        with self._lock:
            found |= self._unshown
            self._unshown = False
        return found

    def shared(self) -> list[list[object]]:
        """The proofs this node's rounds record carries: those of its bans still running, newest first."""
        now = self._clock()
        with self._lock:
            for peer in [p for p, (until, _) in self._shared.items() if until <= now]:
                del self._shared[peer]
            return [wire for _, wire in sorted(self._shared.values(), key=lambda kept: -kept[0])[:PROOFS_SHARED]]

    def convict_block(self, proof: BadBlock) -> bool:
        """This node fetched a block that ``proof`` shows its sender signed with non-finite values: ban the sender
        and share the proof (its record goes out at the next read). False when the proof does not hold here (no key
        known for the sender, no shapes, a block past the group's cap: the caller's own evidence stands)."""
        reason = self._proves(proof) if len(proof.to_bytes()) <= self._proof_cap else None
        if reason is None:
            return False
        logger.warning("outer rounds %s: peer %s signed block %d of its round %d with non-finite values (%s): banned, "
                       "and the proof shared", self.group, proof.peer, proof.index, proof.claim.round_id, reason)
        self._convict_block(proof)
        return True

    def hear_block(self, accuser: str, accused: str, digest: bytes, data: bytes | None) -> bool:
        """What ``accuser`` served for the proof its record refers to by ``digest`` (naming ``accused``; ``ask``),
        None when nothing usable arrived: checked, and when it holds, its sender banned and the proof shared by this
        node too (whomever the reference named). True when it held. The ask ends once the ban is in place."""
        try:
            if data is None:
                self._fail(accuser)
                return False
            with self._lock:
                if digest in self._held or digest in self._refuted:
                    return False
            proof = BadBlock.from_bytes(data) if len(data) <= self._proof_cap else None
            reason = None if proof is None else self._proves(proof)
            if proof is None or reason is None:
                logger.warning("outer rounds %s: peer %s refers to a proof against peer %s that does not hold (not "
                               "signed by it, not the block its claim signed, or finite values): ignored", self.group,
                               accuser, accused)
                self._fail(accuser)
                if proof is None or self.public_key_of is None or self.public_key_of(proof.peer) is not None:
                    with self._lock:  # those bytes prove nothing, whoever shows them
                        _keep(self._refuted, digest)
                return False
            logger.warning("outer rounds %s: peer %s shows that peer %s signed block %d of its round %d with "
                           "non-finite values (%s): banned", self.group, accuser, proof.peer, proof.index,
                           proof.claim.round_id, reason)
            with self._lock:
                _keep(self._held, digest)
            self._convict_block(proof)
            return True
        finally:
            with self._lock:
                self._asking.pop(digest, None)
                self._answered.notify_all()

    def close(self) -> None:
        """No more asks; whoever waits for the open ones stops waiting."""
        with self._lock:
            self._ask = None
            self._asking.clear()
            self._answered.notify_all()

    def _fail(self, accuser: str) -> None:
        with self._lock:
            _keep(self._failed, accuser, self._clock() + _FAILED_S)

    def asks_ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the proofs asked for to arrive (or fail); True when none is open."""
        with self._answered:
            return self._answered.wait_for(lambda: not self._asking, timeout=max(0.0, timeout_s))

    def _proves(self, proof: BadBlock) -> str | None:
        public_key = None if self.public_key_of is None else self.public_key_of(proof.peer)
        if public_key is None or self.shapes is None or proof.peer == self.me:
            return None
        return proof.proves(public_key, self.run_id, self.group, self.shapes)

    def _convict_block(self, proof: BadBlock) -> None:
        with self._lock:
            if proof.peer in self._shared and self._shared[proof.peer][0] > self._clock():
                return  # one proof of a sender is enough while its ban runs
            data = proof.to_bytes()
            number = next(_proof_numbers)
            self._shared[proof.peer] = (self._ban_ends(),
                                        [_BLOCK_TAG, proof.peer, number, hashlib.sha256(data).digest(), len(data)])
            self._unshown = True
        if self._serve is not None:
            self._serve(number, data)
        if self.scores is not None:
            self.scores.record(proof.peer, Evidence.BAD_BLOCK)

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
        logger.warning("outer rounds %s: peer %s signed two different claims of its round %d (digests %s and %s%s): "
                       "banned, and the proof shared", self.group, peer, entry.round_id, first.digest.hex()[:12],
                       entry.digest.hex()[:12], "" if first.base == entry.base else ", two anchors named")
        return self._convict(peer, Evidence.EQUIVOCATION, Equivocation(peer, first, entry).to_wire())

    def _hear(self, accuser: str, obj: object) -> bool:
        if isinstance(obj, list) and obj[:1] == [_BLOCK_TAG]:
            self._hear_of_block(accuser, obj)
            return False  # a bad block is shared once its bytes arrived and were checked (``hear_block``)
        proof = Equivocation.from_wire(obj)
        if proof is None or self.public_key_of is None or proof.peer == self.me:
            return False
        public_key = self.public_key_of(proof.peer)
        if public_key is None:
            return False  # checked once the membership names its key
        if not self._first_time(public_key + proof.digest()):
            return False
        if not proof.proves(public_key, self.run_id, self.group):
            logger.info("outer rounds %s: peer %s shows a proof of equivocation against %s that does not hold "
                        "(not two different claims of one round and session under its key): ignored", self.group,
                        accuser, proof.peer)
            return False
        logger.warning("outer rounds %s: peer %s shows that peer %s signed two different claims of its round %d: "
                       "banned", self.group, accuser, proof.peer, proof.first.round_id)
        return self._convict(proof.peer, Evidence.EQUIVOCATION, proof.to_wire())

    def _hear_of_block(self, accuser: str, obj: list[object]) -> None:
        """A reference to a bad block in ``accuser``'s record: ask for the proof unless it was heard of already, its
        sender is banned here already, it is asked of another accuser now, this accuser has an ask open or lately
        failed to serve a proof that holds, or ``ASKS_AT_ONCE`` asks are open."""
        if not (len(obj) == 5 and isinstance(obj[1], str) and PEER_ID_RE.fullmatch(obj[1]) and type(obj[2]) is int
                and 0 < obj[2] < 2**62 and isinstance(obj[3], bytes) and len(obj[3]) == 32 and type(obj[4]) is int
                and 0 < obj[4] <= self._proof_cap):
            return
        accused, number, digest, size = obj[1], obj[2], obj[3], obj[4]
        if (accused == self.me or self.public_key_of is None or self.public_key_of(accused) is None
                or (self.scores is not None and self.scores.banned(accused))):
            return  # asked for once the membership names its key, or once a ban here ends
        with self._lock:
            ask = self._ask
            if (ask is None or digest in self._held or digest in self._refuted or digest in self._asking
                    or self._failed.get(accuser, 0.0) > self._clock() or accuser in self._asking.values()
                    or len(self._asking) >= ASKS_AT_ONCE):
                return
            self._asking[digest] = accuser
        ask(accuser, accused, number, digest, size)

    def _first_time(self, key: bytes) -> bool:
        """Whether a proof (by ``key``) is heard of for the first time lately: each is acted on once."""
        digest = hashlib.sha256(key).digest()
        with self._lock:
            if digest in self._heard:
                return False
            _keep(self._heard, digest)
        return True

    def _convict(self, peer: str, evidence: Evidence, wire: list[object]) -> bool:
        """Ban ``peer`` and show the proof (``wire``) while the ban lasts; True when it is newly shown."""
        if self.scores is not None:
            self.scores.record(peer, evidence)
        with self._lock:
            new = peer not in self._shared
            self._shared[peer] = (self._ban_ends(), wire)
        return new

    def _ban_ends(self) -> float:
        """When a ban starting now ends: how long this node shows the proof behind it."""
        return self._clock() + (self.scores.ban_s if self.scores is not None else 600.0)
