"""The robust outer round's transport: every participant gathers every contribution and merges them itself.

hivemind's butterfly all-reduce gives each peer one part of the tensors to reduce and uses the weight each
sender declares, so one peer can scale the merge at will, or reduce its part wrongly unseen. In a gathered
round (``sync.aggregation = "gather"``) each peer instead:

1. encodes its pseudo-gradient (``encode_contribution``: the run's compression), keeps the body for a few
   rounds in a ``ContributionStore`` served over a P2P stream, and announces the round in its signed entry of
   the group's rounds record (``RoundEntry``: round, sha256 and size of the body, tokens);
2. fetches the bodies the other participants announced, from them, checking size and digest against their
   signed entries (``OuterGather.fetch``), and decodes them with shape and size limits;
3. merges all of them itself (``node.train.robust``): weights capped by the schedule, non-finite bodies
   dropped, norms clipped; every honest peer computes the same result from the same bodies.

Bytes: a peer downloads n - 1 bodies and serves its own to n - 1 peers, where the all-reduce moves about two
bodies each way: (n - 1) / 2 times the traffic, fine for the small groups of a run (4 peers: 1.5x).
Threats covered: a peer's scaled, reversed, random or NaN contribution, a declared weight above the schedule's
(the merge bounds each), a forged body (digest), a reducer lying about its part (there is none). Not covered
here: contributions inside the honest spread (bounded, not detected), and who may join (admission).

Concurrency: the servicer and the fetches run on the node's network loop; ``fetch`` is called from a round's
worker thread and blocks it, bounded by its timeout.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import math
import re
import threading
import time
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import msgpack
import numpy as np
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from parallax.node.config.train import GATHERED_WIRES
from parallax.node.net.network import ServedOnLoop, read_answer
from parallax.node.outer.blocks import (
    Answer,
    BlockedBody,
    BlockMismatch,
    answer_cap,
    check_answer,
    parse_wanted,
    wanted_uid,
)
from parallax.node.outer.wire import ANCHOR_FP_BYTES, CODEC_OF, encode_wire
from parallax.node.train.outer import OuterBundle, OuterOptimizer
from parallax.protocol.codec import TensorLimits, decode
from parallax.protocol.errors import (
    MalformedMessage,
    OversizedMessage,
    ProtocolError,
    RemoteProtocolError,
    SlowStream,
    malformed,
)
from parallax.protocol.identity import SIGNATURE_BYTES
from parallax.protocol.schema import MSGPACK_ERRORS

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # hivemind caps one stream message at 4 MiB
_MAX_PEER_ID_CHARS = 128
_MAX_PARTICIPANTS = 64
_CLAIM_FIELDS = 8  # ``RoundEntry.claim_to_wire``
PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,100}")  # a base58 libp2p peer id
_PAIR_RE = re.compile(PEER_ID_RE.pattern + r"@[0-9]{1,18}")  # a peer id, "@", its round number
RECORD_WAIT_S = 5.0
"""A peer asked for its rounds record (``OuterGather.watch_record``) answers at once when it differs from the one the
asker holds, else once it changes or after this long: a watch learns of a change as it is made, and asks once every
five seconds while nothing changes (each node holds a question at every working peer of each group whose round
runs: at half a second, an 8-composer swarm of the tiny preset ran 1.5x slower on two cores)."""
RECORD_ANSWER_S = 1.0
"""How much longer than ``RECORD_WAIT_S`` ``OuterGather.watch_record`` waits for an answer before it gives up (the
question itself runs on: never cancelled)."""
SILENT_FIRST_S = 30.0
"""A peer that did not answer a question for its rounds record (``RecordWatch``) is not asked again for this long,
twice as long after each further silence, up to ``SILENT_MAX_S``, and at once again after an answer: its record is
read from the DHT meanwhile. Identities whose records name peer ids nobody runs cost each node one failed dial each
per this backoff, not one each per round."""
SILENT_MAX_S = 600.0
_SILENT_KEPT = 1024  # peers remembered as silent (the longest-silent first forgotten)
_RECORD_TAG_BYTES = 16
WITHDRAWN = b"withdrawn"
"""The fingerprint field of an entry whose round merged nothing here: its contribution is no longer on offer."""


# ---- the contribution body ----------------------------------------------------------------------------


def encode_contribution(delta: Mapping[str, torch.Tensor], compression: str) -> bytes:
    """One peer's pseudo-gradient of a group as bytes: msgpack {name: tensor blob}; tensors under
    ``SMALL_TENSOR_NUMEL`` entries go raw (float32), the rest in the run's compression."""
    blobs = {}
    for name, t in delta.items():
        array = t.detach().to(device="cpu", dtype=torch.float32).numpy()
        blobs[name] = encode_wire(array, array.size, compression)
    return msgpack.packb(blobs, use_bin_type=True)


def keep_unsent(outer: OuterOptimizer | OuterBundle, pending: Mapping[str, torch.Tensor],
                sent: Mapping[str, torch.Tensor] | None, compression: str) -> None:
    """A round merged ``sent`` (its ``GroupAverager.last_sent``) of ``pending`` (``train.outer.to_send``'s): under a
    wire with error feedback (``error_feedback``) ``outer`` keeps what was not sent for its next rounds."""
    if error_feedback(compression):
        if sent is None:
            raise ValueError("error feedback needs what the round sent (a gathered round's last_sent)")
        outer.keep_unsent(pending, sent)


def error_feedback(compression: str) -> bool:
    """Whether the sender keeps what ``compression`` leaves out: the sparse wire drops most of each round, the 4-bit
    one rounds each entry to one of 15 levels of its chunk's largest."""
    return compression in GATHERED_WIRES


def contribution_limit(shapes: Mapping[str, Sequence[int]]) -> int:
    """The largest body a group of these shapes can have (raw float64 would be the worst case)."""
    return sum(TensorLimits(max_elements=math.prod(s), max_ndim=max(len(s), 1)).max_blob_bytes
               for s in shapes.values()) + 64 * (len(shapes) + 1)


def decode_contribution(body: bytes, shapes: Mapping[str, Sequence[int]], *, peer: str) -> dict[str, torch.Tensor]:
    """A peer's body back to float32 tensors of exactly ``shapes``.

    Raises:
        MalformedMessage: undecodable, other shapes or codecs, non-finite values, or too large; ``OtherTensors``:
            other names.
    """
    if len(body) > contribution_limit(shapes):
        raise MalformedMessage(f"outer contribution of {len(body)} bytes is over the group's cap", peer=peer)
    try:
        blobs = msgpack.unpackb(body, raw=False, max_map_len=len(shapes), max_str_len=256,
                                max_bin_len=len(body), max_array_len=0)
    except MSGPACK_ERRORS:
        raise MalformedMessage("undecodable outer contribution", peer=peer) from None
    if not isinstance(blobs, dict):
        raise MalformedMessage("outer contribution that is not a map of tensors", peer=peer)
    if set(blobs) != set(shapes):
        raise OtherTensors("outer contribution with other tensors than the group's", peer=peer)
    out = {}
    for name, shape in shapes.items():
        limits = TensorLimits(max_elements=math.prod(shape), max_ndim=max(len(shape), 1),
                              codecs=frozenset(CODEC_OF.values()), dtypes=frozenset({"float16", "float32"}))
        try:
            array = decode(blobs[name], limits, peer=peer, what=f"outer contribution {name}")
        except ProtocolError as e:
            raise malformed(e, peer) from None
        if tuple(array.shape) != tuple(shape):
            raise MalformedMessage(f"outer contribution {name} has shape {array.shape}, not {tuple(shape)}",
                                      peer=peer)
        out[name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    return out


def body_digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


# ---- what a peer says about its rounds (its signed DHT entry) -----------------------------------------


@dataclass(frozen=True)
class RoundPeers:
    """Whom a node's gathered rounds deal with, by libp2p peer id."""

    live: Callable[[], Sequence[str]]
    """The live composers: whose contributions may be merged."""
    working: Callable[[], Sequence[str]] | None = None
    """Those that show work (``dht.membership.Progress``): a round waits for them and counts its quorum over
    them, so identities that never contribute cannot stall it (None: every live composer)."""
    worked: Callable[[str], None] | None = None
    """Told of every contribution fetched and decoded: evidence of its sender's work."""
    vouched: Callable[[set[str]], None] | None = None
    """Told, after a download of the group's state, of the peers that the rounds records of the peers that served
    it vouch for (``vouched``): whose work others that run merged, before any reached this node."""



@dataclass(frozen=True)
class RoundEntry:
    """One round in a peer's rounds record: its contribution (digest, size, declared tokens), then, once
    merged, its fingerprint (``wire.encode_fingerprint``, tagged) and the participants it merged.

    The contribution's part (``claim``) is signed on its own by the sender (``signature``, over the run, the group
    and the claim): a statement any peer can show to others. It names the anchor the pseudo-gradient was taken from
    (``base``): a merge leaves out contributions taken from another anchor than its set's majority's
    (``wire.set_anchor``). ``session`` names the sender's round-taking instance (microseconds since the epoch when it
    started): within one session an honest sender claims one contribution per round, so two different signed claims
    of one round and session prove it equivocated (``witness.Equivocation``)."""

    round_id: int
    digest: bytes
    size: int
    tokens: float
    fingerprint: bytes = b""
    participants: tuple[str, ...] = ()
    session: int = 0
    signature: bytes = b""
    base: bytes = b""
    """The fingerprint of the sender's anchor this contribution's pseudo-gradient was taken from, which its merge of
    the round is applied to (``wire.anchor_fingerprint``, encoded untagged): who holds the swarm's anchor and who
    drifted from it. Empty where the rounds name no anchor (replicated experts)."""
    merged: bytes = b""
    """In a partitioned round (``partitioned``): the root (``blocks.BlockedBody.digest``) of the blocks of
    ``participants``' merge that this sender merged and serves; empty until then, and in a gathered round."""
    drawn: int = 0
    """How many batches the sender's data stream had handed out when this pseudo-gradient was taken
    (``data.BatchSampler.step``): with the sender's identity, what any peer needs to rebuild the batches it says it
    trained on (``BatchSampler.replay``) and check that the contribution learnt of them (``train.own_data``)."""

    def to_wire(self) -> list[object]:
        return [*self.claim_to_wire(), self.fingerprint, list(self.participants), self.merged]

    def claim_to_wire(self) -> list[object]:
        """The signed part: round, digest, size, tokens, session, base, draws and the signature."""
        return [self.round_id, self.digest, self.size, self.tokens, self.session, self.base, self.drawn,
                self.signature]

    def claim(self) -> tuple[int, bytes, int, float, int, bytes, int]:
        """What the signature covers besides the run and the group."""
        return self.round_id, self.digest, self.size, self.tokens, self.session, self.base, self.drawn

    @classmethod
    def from_wire(cls, obj: object) -> RoundEntry | None:
        """None for anything malformed (a peer's record is data, not trusted)."""
        if not (isinstance(obj, list) and len(obj) == _CLAIM_FIELDS + 3):
            return None
        claim = cls.claim_from_wire(obj[:_CLAIM_FIELDS])
        fp, who, merged = obj[_CLAIM_FIELDS:]
        if claim is None or not (isinstance(fp, bytes) and len(fp) <= 1024
                                 and isinstance(who, list) and len(who) <= _MAX_PARTICIPANTS
                                 and all(isinstance(p, str) and _PAIR_RE.fullmatch(p) for p in who)
                                 and isinstance(merged, bytes) and len(merged) in (0, 32)):
            return None
        return dataclasses.replace(claim, fingerprint=fp, participants=tuple(who), merged=merged)

    @classmethod
    def claim_from_wire(cls, obj: object) -> RoundEntry | None:
        """An entry holding only a claim (``claim_to_wire``); None for anything malformed."""
        if not (isinstance(obj, list) and len(obj) == _CLAIM_FIELDS):
            return None
        n, digest, size, tokens, session, base, drawn, signature = obj
        if not (type(n) is int and 0 <= n < 2**62 and isinstance(digest, bytes) and len(digest) == 32
                and type(size) is int and 0 < size < 2**40 and isinstance(tokens, float) and math.isfinite(tokens)
                and type(session) is int and 0 <= session < 2**62 and isinstance(base, bytes)
                and len(base) <= ANCHOR_FP_BYTES and type(drawn) is int and 0 <= drawn < 2**62
                and isinstance(signature, bytes) and len(signature) <= SIGNATURE_BYTES):
            return None
        return cls(n, digest, size, tokens, session=session, base=base, drawn=drawn, signature=signature)


ROUND_RECORD_MAX_BYTES = 5 * 1024


def encode_record(entries: Sequence[RoundEntry], proofs: Sequence[list[object]] = ()) -> bytes:
    """A peer's rounds record of a gathered group: its entries, and the proofs of equivocation it shares
    (``witness.Equivocation.to_wire``)."""
    return msgpack.packb([[e.to_wire() for e in entries], list(proofs)], use_bin_type=True)


def _unpack_record(record: object) -> tuple[list[object], list[object]] | None:
    if not isinstance(record, bytes) or len(record) > ROUND_RECORD_MAX_BYTES:
        return None
    try:
        raw = msgpack.unpackb(record, raw=False, max_bin_len=1024, max_str_len=_MAX_PEER_ID_CHARS,
                              max_array_len=_MAX_PARTICIPANTS, max_map_len=0)
    except MSGPACK_ERRORS:
        return None
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], list) and isinstance(raw[1], list)):
        return None
    return raw[0], raw[1]


def decode_entries(record: object) -> dict[int, RoundEntry]:
    """round -> entry of one peer's record; {} for anything malformed."""
    raw = _unpack_record(record)
    out = {}
    for item in raw[0] if raw is not None else ():
        entry = RoundEntry.from_wire(item)
        if entry is not None:
            out[entry.round_id] = entry
    return out


def record_proofs(record: object) -> list[object]:
    """The proofs of equivocation one peer's record shares, undecoded (``witness.Equivocation.from_wire``)."""
    raw = _unpack_record(record)
    return [] if raw is None else raw[1]


# ---- serving and fetching bodies ----------------------------------------------------------------------


class OtherTensors(MalformedMessage):
    """A contribution naming other tensors than the group's: a forgery in a shared group, or (replicated experts)
    an owner whose view assigned the round's key to other experts for a moment."""


class ContributionMismatch(RemoteProtocolError):
    """A served body that is not the one its sender announced and signed: evidence against the sender."""



class ContributionStore:
    """This node's latest contributions per group, ``keep`` rounds each (thread-safe): whole bodies, or bodies in
    blocks (``blocks.BlockedBody``) served a range at a time."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._bodies: dict[tuple[str, int], bytes | BlockedBody] = {}
        self._served: set[tuple[str, int]] = set()
        self._records: dict[str, tuple[bytes, str]] = {}  # group -> (record, its ``record_tag``)
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def post_record(self, group: str, record: bytes) -> None:
        """This node's rounds record of ``group`` as its peers may ask for it (``OuterGather.watch_record``): the one
        it stores in the DHT, served from the moment it is made."""
        tag = record_tag(record)
        with self._lock:
            self._records[group] = record, tag
            listeners = list(self._listeners)
        for listener in listeners:
            listener(group)

    def listen(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(group)`` after each record posted (in the poster's thread)."""
        with self._lock:
            self._listeners.append(listener)

    def record(self, group: str) -> tuple[bytes, str]:
        """This node's latest rounds record of ``group`` and its ``record_tag`` (b"" and "": none)."""
        with self._lock:
            return self._records.get(group, (b"", ""))

    def put(self, group: str, round_id: int, body: bytes | BlockedBody) -> None:
        with self._lock:
            self._bodies[(group, round_id)] = body
            mine = sorted(n for g, n in self._bodies if g == group)
            for n in mine[:-self.keep]:
                del self._bodies[(group, n)]
                self._served.discard((group, n))

    def rounds(self, group: str) -> list[int]:
        """The rounds of ``group`` whose bodies are held."""
        with self._lock:
            return sorted(n for g, n in self._bodies if g == group)

    def get(self, group: str, round_id: int) -> bytes | BlockedBody | None:
        """The body of a round, counted as served (a peer may merge it): ``peek`` and ``mark_served``."""
        body = self.peek(group, round_id)
        if body is not None:
            self.mark_served(group, round_id)
        return body

    def peek(self, group: str, round_id: int) -> bytes | BlockedBody | None:
        """The body of a round, not counted as served (``mark_served`` once a peer's request for it holds)."""
        with self._lock:
            return self._bodies.get((group, round_id))

    def mark_served(self, group: str, round_id: int) -> None:
        with self._lock:
            if (group, round_id) in self._bodies:
                self._served.add((group, round_id))

    def drop(self, group: str, round_id: int) -> None:
        """Stop serving a round's body (its round merged nothing here: it is withdrawn)."""
        with self._lock:
            self._bodies.pop((group, round_id), None)

    def served(self, group: str, round_id: int) -> bool:
        """Whether a peer has asked for this round's body: it may have merged it, so this node's state may now
        be behind (the round's caller reloads when its own merge fails)."""
        with self._lock:
            return (group, round_id) in self._served


_UNSERVED_LOG_S = 1.0
"""Blocks requests answered empty for a fault are logged at most once in this many seconds (``_unserved``)."""
_GROUPS_COUNTED = 256
_GROUP_NAME_COUNTED = 200
"""``ContributionServicer.records_asked`` counts questions apart for at most this many group names of at most
this many characters."""


class ContributionServicer(ServicerBase):
    """Streams a held contribution: request ``uid`` = ``{group}/{round}`` for a whole body, ``{group}/{round}/{i,j}``
    for blocks of one held in blocks (``blocks.wanted_uid``), ``{group}#proofs/{number}`` for a proof the node shares
    (``witness.BadBlock``); an empty stream means "not held". ``rpc_record`` answers with this node's rounds record of
    a group (``OuterGather.watch_record``). Do not rename (protocol id)."""

    def __init__(self, store: ContributionStore) -> None:
        self._store = store
        self.bytes_served = 0
        self.records_served = 0
        """Bytes of rounds records answered (``rpc_record``), apart from the bodies' and blocks'."""
        self.records_asked: collections.Counter[str] = collections.Counter()
        """Questions for a rounds record received (``rpc_record``), by group: the first ``_GROUPS_COUNTED`` group
        names asked for (a peer names any it likes), the others' questions together under ""."""
        self._loop: asyncio.AbstractEventLoop | None = None  # where questions are held (set by the first)
        self._posted: dict[str, asyncio.Event] = {}  # group -> set at its next post (``rpc_record``)
        self._unserved_quiet_until = 0.0  # ``_unserved``: no line before then
        self._unserved_quiet = 0  # requests not logged since the last line
        store.listen(self._on_post)

    def _on_post(self, group: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake, group)

    def _wake(self, group: str) -> None:
        """Wake the questions held for ``group``'s record (in the loop)."""
        if (event := self._posted.pop(group, None)) is not None:
            event.set()

    async def rpc_contribution(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        group, _, n = request.uid.rpartition("/")
        if not (group and re.fullmatch(r"[0-9]{1,18}", n)):
            logger.debug("bad contribution request %r from %s", request.uid[:80], context.remote_id)
            return
        body = self._store.peek(group, int(n))
        if not isinstance(body, bytes):
            return
        self._store.mark_served(group, int(n))
        for message in _messages(body):
            yield message
        self.bytes_served += len(body)

    async def rpc_blocks(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        asked = parse_wanted(request.uid)
        if asked is None:
            logger.debug("bad contribution blocks request %r from %s", request.uid[:80], context.remote_id)
            return
        group, n, wanted = asked
        body = self._store.peek(group, n)
        if not isinstance(body, BlockedBody) or wanted[-1] >= len(body.blobs):
            self._unserved(context.remote_id, group, n, wanted, body)
            return
        self._store.mark_served(group, n)
        answer = body.answer(wanted)
        for message in _messages(answer):
            yield message
        self.bytes_served += len(answer)

    def _unserved(self, peer: object, group: str, n: int, wanted: list[int], body: bytes | BlockedBody | None) -> None:
        """Log why a blocks request is answered empty ("not held"). A round withdrawn or past ``keep`` is the
        usual reason (debug); a round asked for beyond the newest held, a body held whole, or blocks past the body's
        are logged at most once every ``_UNSERVED_LOG_S`` (a peer names any group and blocks it likes)."""
        held = self._store.rounds(group)
        if body is None and held and n < held[-1]:
            logger.debug("peer %s asked for blocks of %r round %d: withdrawn, or past the rounds kept", peer,
                         group[:80], n)
            return
        why = ("not held" if body is None else "held whole, not in blocks" if isinstance(body, bytes)
               else f"past its {len(body.blobs)} blocks")
        now = time.monotonic()
        if now < self._unserved_quiet_until:
            self._unserved_quiet += 1
            return
        self._unserved_quiet_until = now + _UNSERVED_LOG_S
        more, self._unserved_quiet = self._unserved_quiet, 0
        logger.info("peer %s asked for %d blocks (%d-%d) of %r round %d: %s (rounds held: %s)%s", peer, len(wanted),
                    wanted[0], wanted[-1], group[:80], n, why, held[-4:],
                    f"; {more} such requests not logged before it" if more else "")

    async def rpc_record(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """``uid`` = ``{group}/{tag}``: this node's record of ``group`` once its ``record_tag`` is not ``tag`` (the
        asker's), or as it is after ``RECORD_WAIT_S``."""
        group, _, known = request.uid.rpartition("/")
        counted = group in self.records_asked or (len(self.records_asked) < _GROUPS_COUNTED
                                                   and len(group) <= _GROUP_NAME_COUNTED)
        self.records_asked[group if counted else ""] += 1
        loop = self._loop = asyncio.get_running_loop()
        until = loop.time() + RECORD_WAIT_S
        while True:
            # The event before the record: a post after this look wakes the wait below (its wake runs in this loop).
            posted = self._posted.setdefault(group, asyncio.Event())
            record, tag = self._store.record(group)
            if tag != known or loop.time() >= until:
                self.records_served += len(record)
                return runtime_pb2.ExpertInfo(serialized_info=record)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(posted.wait(), max(0.0, until - loop.time()))


class RecordWatch:
    """The rounds records of a group's live peers, each asked of the peer itself with a question held there
    (``OuterGather.ask_record``: answered as soon as the record changes, or as it is after ``RECORD_WAIT_S``) and
    asked again at each answer, while a round of this node's runs: a change is known as it is made, where the DHT
    shows it after the sender's store and the next read. A question not answered in time (a busy peer, or this
    node's own event loop held up) is waited for on; the peer's last answer stands meanwhile (its post reaches the
    question before its DHT store begins, so the DHT holds nothing newer that the answer will not bring; reading one
    and then the other, a round would see the peer's contributions leave and come back). A peer that refuses the
    question, or answers past the bounds, is not asked again for ``SILENT_FIRST_S``, a backoff that doubles at each
    further silence, over rounds (``stop`` keeps it), and ends at an answer. One question at a time per peer,
    at most one every ``poll_s`` (a peer that answers at once with what the asker holds is not asked in a loop).

    Args:
        gather: asks the questions (in its event loop).
        group: the shared group.
        poll_s: the least time between two questions to one peer.
    """

    def __init__(self, gather: OuterGather, group: str, poll_s: float) -> None:
        self.gather, self.group, self.poll_s = gather, group, poll_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._records: dict[str, bytes] = {}  # peer -> its latest answer
        # peer -> (the question's token, its task): a question withdrawn (``follow``, ``stop``) writes nothing more
        self._asking: dict[str, tuple[object, concurrent.futures.Future[None]]] = {}
        self._silent: dict[str, tuple[float, float]] = {}  # peer -> (asked again from, backoff s): refused a question
        self._questions: dict[str, asyncio.Future[bytes]] = {}  # peer -> its question still open (the event loop's own)
        self._asked_with: dict[str, bytes] = {}  # peer -> the record its open question was asked with (the loop's own)
        self.version = 0
        """Counts the records that changed (``wait``)."""

    def follow(self, peers: Collection[str]) -> dict[str, bytes]:
        """Hold a question at each of ``peers`` (but those that refused one within their backoff) and at no other;
        returns ``heard(peers)``."""
        now = time.monotonic()
        with self._lock:
            for peer in [p for p in self._asking if p not in peers]:
                self._asking.pop(peer)[1].cancel()
                self._records.pop(peer, None)
            for peer in peers:
                if peer not in self._asking and self._silent.get(peer, (now,))[0] <= now:
                    token = object()
                    self._asking[peer] = token, asyncio.run_coroutine_threadsafe(self._ask(peer, token),
                                                                                 self.gather.loop)
        return self.heard(peers)

    def heard(self, peers: Collection[str]) -> dict[str, bytes]:
        """The latest records of those of ``peers`` that answered with one (peer -> record; a peer that holds none
        is read from the DHT, where a record of its earlier process may be)."""
        with self._lock:
            return {peer: record for peer, record in self._records.items() if record and peer in peers}

    def wait(self, version: int, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for a record to change after ``version`` (a ``version`` read before); returns the
        version then."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != version, timeout_s)
            return self.version

    def stop(self) -> None:
        """Withdraw every question (the round ended): the next round asks every peer anew, but those silent within
        their backoff."""
        with self._lock:
            for _, flight in self._asking.values():
                flight.cancel()
            self._asking.clear()
            self._records.clear()

    def _fell_silent(self, peer: str) -> float:
        """``peer`` did not answer: its backoff starts, or doubles (under the lock); returns it."""
        backoff = min(SILENT_MAX_S, 2 * self._silent.pop(peer, (0.0, SILENT_FIRST_S / 2))[1])
        self._silent[peer] = time.monotonic() + backoff, backoff
        while len(self._silent) > _SILENT_KEPT:
            del self._silent[next(iter(self._silent))]
        return backoff

    def _forget(self, peer: str, question: asyncio.Future[bytes]) -> None:
        """Drop ``peer``'s question once it ended, unless another took its place (in the event loop). Its error is
        taken here: the round that asked it may have withdrawn, and its ``_ask`` logged the peer's silence if not."""
        if not question.cancelled():
            question.exception()
        if self._questions.get(peer) is question:
            del self._questions[peer]
            self._asked_with.pop(peer, None)

    def _current(self, peer: str, token: object) -> bool:
        """Whether ``token``'s question is still the one held at ``peer`` (under the lock)."""
        return self._asking.get(peer, (None,))[0] is token

    async def _ask(self, peer: str, token: object) -> None:
        known = b""
        while True:
            # The question runs as a task of its own that nothing cancels (withdrawing this loop leaves it to end):
            # the peer holds it until its record changes, and the answer, however late, is its record all the same.
            question = self._questions.get(peer)
            if question is None or question.done():  # one at a time per peer, an earlier round's too
                question = self._questions[peer] = asyncio.ensure_future(
                    self.gather.ask_record(peer, self.group, known))
                self._asked_with[peer] = known
                question.add_done_callback(partial(self._forget, peer))
            elif not known and (held := self._asked_with.get(peer)):
                # An earlier round's question, still open: the peer answers at once when its record differs from the
                # one asked with, so that record stands until the answer (up to ``RECORD_WAIT_S`` when it stands still).
                self._note(peer, token, held, first=True)
            try:  # however long it takes, the peer's last answer standing meanwhile; withdrawn, it runs on (shielded)
                record = await asyncio.shield(question)
            except Exception as e:  # unreachable directly, rate-limited, or a record past the bound
                with self._lock:
                    backoff = self._fell_silent(peer) if self._current(peer, token) else None
                    if backoff is not None:
                        self._asking.pop(peer)
                        self._records.pop(peer, None)
                if backoff is not None:
                    logger.info("peer %s did not give its rounds record of %s (%r); it is read from the DHT, and asked "
                                "again in %.0f s at the earliest", peer, self.group, e, backoff)
                return
            if not self._note(peer, token, record):
                return
            known = record
            await asyncio.sleep(self.poll_s)

    def _note(self, peer: str, token: object, record: bytes, *, first: bool = False) -> bool:
        """Take ``record`` as ``peer``'s (``first``: only when none stands yet), waking the waiters when it changed;
        False when the question ``token`` names is no longer the current one."""
        with self._changed:
            if not first:
                self._silent.pop(peer, None)  # it answered (a withdrawn question's answer too)
            if not self._current(peer, token):
                return False
            if self._records.get(peer) != record and not (first and peer in self._records):
                self._records[peer] = record
                self.version += 1
                self._changed.notify_all()
            return True


def record_tag(record: bytes) -> str:
    """What names a rounds record in a watch (``rpc_record``): a prefix of its sha256, "" for none."""
    return hashlib.sha256(record).hexdigest()[:2 * _RECORD_TAG_BYTES] if record else ""


async def _noting_first(stream: typing.AsyncIterator[typing.Any],  # noqa: UP006 - hivemind's stream type
                        began: list[bool]) -> typing.AsyncIterator[typing.Any]:  # noqa: UP006
    """``stream``'s messages, ``began`` noting the first; closing it closes ``stream``."""
    try:
        async for message in stream:
            if not began:
                began.append(True)
            yield message
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]


def _messages(data: bytes) -> typing.Iterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - as above
    for start in range(0, len(data), CHUNK_BYTES):
        yield runtime_pb2.ExpertInfo(serialized_info=data[start:start + CHUNK_BYTES])


class OuterGather(ServedOnLoop):
    """A node's contributions served to its groupmates, and the fetching of theirs.

    Args:
        p2p: this node's P2P replica, on ``loop``.
        loop: the node's network loop (a running asyncio loop in another thread).
        run_id: namespaces the P2P handler.
        keep: rounds kept per group (a slower groupmate may still ask for an earlier one).
    """

    def __init__(self, p2p: P2P, loop: asyncio.AbstractEventLoop, run_id: str, *, keep: int = 4) -> None:
        self.store = ContributionStore(keep)
        super().__init__(p2p, loop, f"parallax.{run_id}.outer", ContributionServicer(self.store))
        self.bytes_fetched = 0
        self.records_fetched = 0
        """Bytes of rounds records asked of their peers (``watch_record``), apart from the bodies' and blocks'."""
        self._count_lock = threading.Lock()  # rounds fetch from several threads at once
        self.answered: Callable[[str], None] | None = None
        """Told of each peer whose answer arrived whole and checked (a body, blocks, a rounds record), as it is
        counted: this node reached that peer itself just now (``Membership.heard``). Called in the fetching thread,
        or in the event loop for a record: it must be quick."""

    def fetch(self, peer: str, group: str, entry: RoundEntry, timeout_s: float, *,
              chunk_timeout_s: float | None = None) -> bytes:
        """``peer``'s body for ``entry``'s round, exactly ``entry.size`` bytes hashing to ``entry.digest``, within
        ``timeout_s``, each message within ``chunk_timeout_s`` of the one before (None: no bound of its own).

        Raises:
            ContributionMismatch: another size or digest (the peer is named).
            StalledStream: the peer opened its answer and then held it (the peer is named).
            SlowStream: the answer was still coming at ``timeout_s`` (the peer is named).
            RemoteProtocolError: not held.
            TimeoutError, and hivemind's errors on a broken stream.
        """
        body = self._bounded(peer, f"{group}/{entry.round_id}", entry.size, timeout_s, chunk_timeout_s)
        if len(body) != entry.size or body_digest(body) != entry.digest:
            raise ContributionMismatch(f"outer contribution of {len(body)} bytes does not match the announced "
                                       f"{entry.size} bytes and digest", peer=peer)
        self._count(peer, len(body))
        return body

    def watch_record(self, peer: str, group: str, known: bytes,
                     timeout_s: float = RECORD_WAIT_S + RECORD_ANSWER_S) -> bytes:
        """``peer``'s rounds record of ``group`` asked of the peer itself: at once when it is not ``known`` (b"": none
        held), else once it changes or ``RECORD_WAIT_S`` later. The answer is not signed as a DHT record is: it is
        what the peer id libp2p authenticated says over that channel, which this node acts on as on the peer's DHT
        record (the membership names one key per peer id), and it is decoded as one is (``decode_entries``).

        Raises:
            MalformedMessage: a record over ``ROUND_RECORD_MAX_BYTES`` (the peer is named).
            RemoteProtocolError (rate-limited), TimeoutError and hivemind's errors: no answer within ``timeout_s``.
        """
        # Past the bound the question is left to end on its own, never cancelled (as ``RecordWatch``'s).
        return asyncio.run_coroutine_threadsafe(self.ask_record(peer, group, known), self.loop).result(timeout_s)

    async def ask_record(self, peer: str, group: str, known: bytes) -> bytes:
        """``watch_record``'s question, in the node's event loop, with no bound of its own."""
        stub = ContributionServicer.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        answer = await stub.rpc_record(runtime_pb2.ExpertRequest(uid=f"{group}/{record_tag(known)}"))
        record = bytes(answer.serialized_info)
        if len(record) > ROUND_RECORD_MAX_BYTES:
            raise MalformedMessage(f"a rounds record of {len(record)} bytes, over {ROUND_RECORD_MAX_BYTES}", peer=peer)
        self._count(peer, len(record), record=True)
        return record

    def fetch_blocks(self, peer: str, key: str, round_id: int, digest: bytes, size: int, wanted: Sequence[int],
                     count: int, timeout_s: float, *, chunk_timeout_s: float | None = None) -> Answer:
        """Blocks ``wanted`` (increasing) of the body in blocks ``peer`` holds under ``key`` (a group, or its merged
        blocks: ``partitioned``) for ``round_id``, of ``count`` blocks and at most ``size`` bytes, each checked against
        the root ``digest`` the peer published; bounds as ``fetch``.

        Raises:
            BlockMismatch: a block that is not the one published, or not the blocks asked for (the peer is named).
            MalformedMessage, StalledStream, SlowStream, RemoteProtocolError (not held), TimeoutError and hivemind's
            errors.
        """
        uid = wanted_uid(key, round_id, wanted)
        answer = self._bounded(peer, uid, answer_cap(size, len(wanted), count), timeout_s, chunk_timeout_s,
                               blocks=True)
        out = check_answer(answer, digest, wanted, count, peer=peer)
        self._count(peer, len(answer))
        return out

    def _count(self, peer: str, size: int, *, record: bool = False) -> None:
        """Count an answer of ``size`` bytes from ``peer`` and tell ``answered``."""
        with self._count_lock:
            if record:
                self.records_fetched += size
            else:
                self.bytes_fetched += size
        if self.answered is not None:
            try:
                self.answered(peer)
            except Exception:  # a fetch goes on whatever the listener does
                logger.exception("the listener to peer %s's answers failed", peer)

    def _bounded(self, peer: str, uid: str, size: int, timeout_s: float, chunk_timeout_s: float | None, *,
                 blocks: bool = False) -> bytes:
        """``_fetch`` within ``timeout_s``; an answer that had begun and was still coming at the bound raises
        ``SlowStream`` (a plain ``TimeoutError`` when no message came)."""
        began: list[bool] = []
        coro = self._fetch(peer, uid, size, chunk_timeout_s, blocks=blocks, began=began)
        try:
            return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), self.loop).result(timeout_s + 1)
        except TimeoutError:
            if began:
                raise SlowStream(f"outer contribution {uid}: its answer was still coming after {timeout_s:g} s",
                                 peer=peer) from None
            raise

    async def _fetch(self, peer: str, uid: str, size: int, chunk_timeout_s: float | None, *,
                     blocks: bool = False, began: list[bool]) -> bytes:
        stub = ContributionServicer.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        call = stub.rpc_blocks if blocks else stub.rpc_contribution
        stream = await call(runtime_pb2.ExpertRequest(uid=uid))
        try:
            parts = await read_answer(_noting_first(stream, began), cap=size, peer=peer,
                                      what=f"outer contribution {uid}", chunk_timeout_s=chunk_timeout_s)
        except OversizedMessage as e:
            raise (BlockMismatch if blocks else ContributionMismatch)(
                f"outer contribution longer than the announced {size} bytes", peer=peer) from e
        body = b"".join(parts)
        if not body:
            raise RemoteProtocolError(f"no outer contribution {uid} held", peer=peer)
        return body


# ---- which contributions a round merges -------------------------------------------------------------------
#
# Peers run their rounds of a group at their own steps, so their round numbers differ; a round merges each
# participant's *current* contribution, named by a pair "peer@round". A contribution is open while its sender
# is still gathering (its entry has no fingerprint yet) and closed once merged: the entry then lists the pairs
# it merged. Every peer that merges the same pairs computes the same result.


def pair(peer: str, round_id: int) -> str:
    """The name of one contribution: its sender and the sender's round number."""
    return f"{peer}@{round_id}"


def split_pair(name: str) -> tuple[str, int]:
    """(peer, round) of a contribution's name; names come from ``RoundEntry.from_wire``, which checks their form."""
    peer, _, n = name.rpartition("@")
    return peer, int(n) if n.isascii() and n.isdigit() else -1


def latest_entries(records: Mapping[str, bytes]) -> dict[str, dict[int, RoundEntry]]:
    """peer -> its entries by round, for the peers whose record has any."""
    out = {}
    for peer, record in records.items():
        entries = decode_entries(record)
        if entries:
            out[peer] = entries
    return out


def vouched(entries: Mapping[str, Mapping[int, RoundEntry]], least: int = 2, *,
            by: Collection[str] | None = None) -> set[str]:
    """The peers named among the senders of a merged round (an entry with its fingerprint, not ``WITHDRAWN``) in the
    records of at least ``least`` other peers (of those in ``by``, when given): peers whose contributions others
    merged. Each record is signed by its own peer's key, so a peer cannot vouch for itself, and one record cannot
    vouch for identities by naming them all as the senders of a round it says it merged; records stored under
    ``least`` identities can (an attacker holding the keys of its flood can write them). Two uses, neither a reason
    to take what a peer serves: a download asks them first (``state.source_order``), and a node no work has reached
    yet counts as working, until their own work arrives, those that the records of peers that served it the group's
    state vouch for (``by``: peers that run; ``GatheredRounds.vouch``, ``dht.membership.Progress.vouched``)."""
    vouchers: dict[str, set[str]] = {}
    for sender, rounds in entries.items():
        if by is not None and sender not in by:
            continue
        for entry in rounds.values():
            if entry.fingerprint and entry.fingerprint != WITHDRAWN:
                for peer in (split_pair(name)[0] for name in entry.participants):
                    if peer != sender:
                        vouchers.setdefault(peer, set()).add(sender)
    return {peer for peer, named_by in vouchers.items() if len(named_by) >= least}


def open_contributions(entries: Mapping[str, Mapping[int, RoundEntry]], *,
                       announced: bool = False) -> dict[str, RoundEntry]:
    """pair -> entry of each peer's latest contribution that it has neither merged nor (unless ``announced``) given to
    a set it announced. A partitioned round's sender names the set it merges before its result: its contribution is
    that set's, and a set built around it elsewhere would never get its sender's vote; its sender still gathers, and
    counts in a round's quorum (``announced``)."""
    out = {}
    for peer, by_round in entries.items():
        latest = by_round[max(by_round)]
        if not latest.fingerprint and (announced or not latest.participants):
            out[pair(peer, latest.round_id)] = latest
    return out


def merged_sets(entries: Mapping[str, Mapping[int, RoundEntry]], mine: str,
                acceptable: Callable[[str], bool] = lambda _peer: True, *,
                announced: bool = False) -> dict[tuple[str, ...], int]:
    """The sets of contributions that include ``mine``, name each peer once and only ``acceptable`` peers (live,
    not banned), and that other peers have merged (``announced``: or are merging, ``partitioned``), with how many of
    their own members merged each (only a member's vote counts)."""
    votes: dict[tuple[str, ...], int] = {}
    for peer, by_round in entries.items():
        for n, entry in by_round.items():
            members = [split_pair(p)[0] for p in entry.participants]
            if ((entry.fingerprint or announced) and mine in entry.participants and pair(peer, n) in entry.participants
                    and len(set(members)) == len(members)
                    and all(acceptable(m) for m in members if m != split_pair(mine)[0])):
                votes[entry.participants] = votes.get(entry.participants, 0) + 1
    return votes


def best_set(votes: Mapping[tuple[str, ...], int]) -> tuple[str, ...] | None:
    """The set most members merged (ties: the first in sorted order, the same on every peer)."""
    return min(votes, key=lambda s: (-votes[s], s)) if votes else None


def entry_of(entries: Mapping[str, Mapping[int, RoundEntry]], name: str) -> RoundEntry | None:
    peer, n = split_pair(name)
    return entries.get(peer, {}).get(n)
