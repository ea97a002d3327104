"""Signed envelopes: the only way a message leaves or enters a node.

Wire layout (canonical: one message, one encoding)::

    envelope  = prefix || header || body || signature
    prefix    = b"parallax/<kind>/v<protocol_version>" || 0x00      (the signing domain, in clear)
    header    = msgpack array [run_id, sender, seq, timestamp, body_len]
                (str, 32-byte bin, int, float64, int), shortest msgpack forms
    body      = the message's canonical encoding (``Message.encode``), ``body_len`` bytes
    signature = Ed25519 by ``sender`` over prefix || header || body
              = ``Identity.sign(domain, header || body)``

The domain travels in clear at the front, so the signed bytes are exactly the input minus its last 64
bytes (verification copies nothing, even for a 256 MiB snapshot), the kind is known before any msgpack
parsing (its size cap is checked first), and a signature made for one kind can never pass as another.

``Opener.open_envelope`` runs the checks in a fixed order, each before anything more expensive or more
trusting: total size against the cap of the expected kind(s); structure of the prefix; protocol
version; kind (registered, expected here, within its own cap): all before any decoding; then the header
(a bounded msgpack parse of at most ``MAX_HEADER_BYTES``, its types, canonical form and exact length);
run id; signature; timestamp within ``window_s`` of the local clock; sequence number not accepted before
from the sender for this kind (above the last one, or with ``replay_window`` W within W of the highest,
once). Only then is the body decoded (``Opener.open``).
Every refusal is a ``RemoteProtocolError`` subclass naming the claimed sender once it is known.

Sequence numbers: a ``Sealer`` starts at the current time in microseconds and counts up, so a node that
restarts keeps its numbers increasing without storing them. Receivers track the highest number per
(sender, kind), and with a window which of the W below it were seen, in a bounded LRU (``ReplayGuard``):
one counter per sender, but the kinds travel on different paths (DHT records, streams) and may overtake
each other, while replays across kinds are already impossible by the signing domain.
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgpack

from parallax.protocol.errors import (
    BadSignature,
    BadTimestamp,
    LocalProtocolError,
    MalformedMessage,
    OversizedMessage,
    ReplayedMessage,
    UnknownKind,
    UnsupportedVersion,
    WrongRun,
    WrongSigner,
)
from parallax.protocol.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    fingerprint,
    signing_prefix,
    verify_prefixed,
)
from parallax.protocol.messages import KINDS, Message
from parallax.protocol.schema import INT64_MAX, MSGPACK_ERRORS, domain, largest_cap

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION})
MAX_PREFIX_BYTES = 64
MAX_HEADER_BYTES = 192  # run id (<= 128 chars), 32-byte key, seq, time, length
MAX_RUN_ID = 128
DEFAULT_WINDOW_S = 60.0
DEFAULT_REPLAY_CACHE = 65536
MAX_REPLAY_WINDOW = 1 << 16
_HEADER_FIELDS = 5
_COPY_BELOW = 128 * 1024
_PREFIX = re.compile(rb"parallax/([a-z0-9_]{1,40})/v([1-9][0-9]{0,5})\x00")
_MIN_ENVELOPE = len(b"parallax/x/v1\x00") + 1 + _HEADER_FIELDS + SIGNATURE_BYTES

M = TypeVar("M", bound=Message)


def _max_cap(kinds: Iterable[type[Message]]) -> int:
    return max((k.MAX_BYTES for k in kinds), default=0)


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not 1 <= len(run_id) <= MAX_RUN_ID:
        raise ValueError(f"run_id must be a string of 1..{MAX_RUN_ID} characters, got {run_id!r:.80}")
    return run_id


@dataclass(frozen=True, slots=True)
class Envelope:
    """A verified envelope: who sent what, when, for which run.

    ``data`` is the whole signed envelope, as received: forward it as is to gossip the message on.
    The body is not decoded; ``body_view`` reads it without copying.
    """

    version: int
    kind: str
    run_id: str
    sender: bytes
    seq: int
    timestamp: float
    data: bytes
    body_offset: int

    @property
    def body_view(self) -> memoryview:
        return memoryview(self.data)[self.body_offset : -SIGNATURE_BYTES]

    @property
    def body(self) -> bytes:
        return self.data[self.body_offset : -SIGNATURE_BYTES]

    @property
    def peer(self) -> str:
        """The sender's short fingerprint, for logs."""
        return fingerprint(self.sender)


@dataclass(frozen=True, slots=True)
class Signed(Generic[M]):
    """A verified envelope and its decoded message."""

    envelope: Envelope
    message: M

    @property
    def sender(self) -> bytes:
        return self.envelope.sender


def _header_unpacker() -> msgpack.Unpacker:
    # Every limit is tight: the header is a few small scalars, so nothing in it may be large or nested.
    return msgpack.Unpacker(
        raw=False,
        max_buffer_size=MAX_HEADER_BYTES,
        max_str_len=MAX_RUN_ID,
        max_bin_len=PUBLIC_KEY_BYTES,
        max_array_len=_HEADER_FIELDS,
        max_map_len=0,
        max_ext_len=0,
    )


def _pack_header(run_id: str, sender: bytes, seq: int, timestamp: float, body_len: int) -> bytes:
    return msgpack.packb([run_id, sender, seq, float(timestamp), body_len], use_bin_type=True)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=256)
def _prefix(kind: str, version: int = PROTOCOL_VERSION) -> bytes:
    return signing_prefix(domain(kind, version))


def seal_body(
    identity: Identity,
    kind: str,
    body: bytes,
    *,
    run_id: str,
    seq: int,
    timestamp: float,
    _public_key: bytes | None = None,
) -> bytes:
    """Sign an already-encoded body as an envelope of ``kind`` (``Sealer.seal`` is the usual entry).

    Raises:
        LocalProtocolError: unknown kind, bad run id, sequence number or timestamp, or the envelope
            would exceed the kind's cap.
    """
    cls = KINDS.get(kind)
    if cls is None:
        raise LocalProtocolError(f"unknown message kind {kind!r}; register it in parallax.protocol.messages")
    try:
        _check_run_id(run_id)
    except ValueError as e:
        raise LocalProtocolError(str(e)) from None
    if not (isinstance(seq, int) and 0 <= seq <= INT64_MAX):
        raise LocalProtocolError(f"sequence number must be an int in [0, 2^63), got {seq!r}")
    if not math.isfinite(timestamp):
        raise LocalProtocolError(f"timestamp must be finite, got {timestamp!r}")
    sender = identity.public_key if _public_key is None else _public_key
    signed = b"".join((_prefix(kind), _pack_header(run_id, sender, seq, timestamp, len(body)), body))
    if len(signed) + SIGNATURE_BYTES > cls.MAX_BYTES:
        raise LocalProtocolError(
            f"a {kind} envelope of {len(signed) + SIGNATURE_BYTES} bytes exceeds its cap of {cls.MAX_BYTES}"
        )
    return signed + identity.sign_prefixed(signed)


def seal(identity: Identity, message: Message, *, run_id: str, seq: int, timestamp: float) -> bytes:
    """The envelope of ``message``: a pure function of its arguments (golden tests use it)."""
    return seal_body(identity, message.KIND, message.encode(), run_id=run_id, seq=seq, timestamp=timestamp)


class Sealer:
    """Signs a node's outgoing messages with its identity, run id, a clock and increasing sequence numbers.

    Thread-safe. ``first_seq`` defaults to the clock in microseconds, so numbers keep increasing across
    restarts (as long as the node sends fewer than a million messages a second).
    """

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        *,
        now: Callable[[], float] = time.time,
        first_seq: int | None = None,
    ) -> None:
        try:
            self.run_id = _check_run_id(run_id)
        except ValueError as e:
            raise LocalProtocolError(str(e)) from None
        self.identity = identity
        self._public_key = identity.public_key
        self._now = now
        self._next_seq = int(now() * 1e6) if first_seq is None else first_seq
        self._lock = threading.Lock()

    def _take_seq(self) -> int:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            return seq

    def seal(self, message: Message) -> bytes:
        """The signed envelope of ``message``, ready to send or store."""
        return self.seal_body(message.KIND, message.encode())

    def seal_body(self, kind: str, body: bytes) -> bytes:
        """Sign an already-encoded body (benchmarks and fuzzing use this to skip ``Message.encode``)."""
        return seal_body(
            self.identity,
            kind,
            body,
            run_id=self.run_id,
            seq=self._take_seq(),
            timestamp=self._now(),
            _public_key=self._public_key,
        )


class ReplayGuard:
    """Which sequence numbers were accepted per (sender, kind), in an LRU of at most ``capacity`` entries.

    With ``window == 0`` a number must be above the last accepted one (messages of one kind arrive in
    order: DHT records). With ``window = W > 0`` a number below the highest accepted one still passes once
    if it is within ``W`` of it (the anti-replay window of IPsec, RFC 4303 section 3.4.3): concurrent
    requests on separate streams may arrive out of order, and each is accepted exactly once. The seen
    numbers of a window are one bitmask per entry.

    Evicting an entry forgets a sender's numbers; to stay safe, the guard remembers the latest timestamp
    it has evicted (``horizon``) and refuses messages from senders it does not know that are not newer
    than that. With the default capacity this only bites when more than 65,536 senders talk within one
    timestamp window.
    """

    def __init__(self, capacity: int = DEFAULT_REPLAY_CACHE, *, window: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"replay cache capacity must be >= 1, got {capacity}")
        if not 0 <= window <= MAX_REPLAY_WINDOW:
            raise ValueError(f"replay window must be in [0, {MAX_REPLAY_WINDOW}], got {window}")
        self.capacity, self.window = capacity, window
        self.horizon = -math.inf
        # (sender, kind) -> (highest accepted seq, bit i set = highest - i accepted, latest timestamp)
        self._last: OrderedDict[tuple[bytes, str], tuple[int, int, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._last)

    def accept(self, sender: bytes, kind: str, seq: int, timestamp: float) -> None:
        """Record ``seq`` or raise ``ReplayedMessage`` if it is not new."""
        key = (sender, kind)
        with self._lock:
            last = self._last.get(key)
            if last is None:
                if timestamp <= self.horizon:
                    raise ReplayedMessage(
                        f"{kind} from a sender the replay cache has forgotten, not newer than its horizon",
                        peer=fingerprint(sender),
                    )
                entry = (seq, 1, timestamp)
            else:
                top, seen, latest = last
                behind = top - seq
                if behind >= 0 and (behind > self.window or behind == 0 or seen >> behind & 1):
                    if self.window == 0:
                        why = f"is not above the last accepted {top}"
                    elif behind > self.window:
                        why = f"is more than {self.window} below the highest accepted {top}"
                    else:
                        why = "was accepted before"
                    raise ReplayedMessage(f"{kind} sequence number {seq} {why}", peer=fingerprint(sender))
                latest = max(latest, timestamp)
                if behind < 0:  # a new highest number: slide the window (a jump past it clears it, no huge shift)
                    kept = (seen << -behind) & ((1 << (self.window + 1)) - 1) if -behind <= self.window else 0
                    entry = (seq, kept | 1, latest)
                else:
                    entry = (top, seen | 1 << behind, latest)
            self._last[key] = entry
            self._last.move_to_end(key)
            while len(self._last) > self.capacity:
                _, (_, _, evicted_ts) = self._last.popitem(last=False)
                self.horizon = max(self.horizon, evicted_ts)


def _read_prefix(data: bytes) -> tuple[str, int, int] | None:
    """``(kind, version, prefix length)`` of an envelope, or None when it does not start with a domain."""
    match = _PREFIX.match(data, 0, MAX_PREFIX_BYTES)
    if match is None:
        return None
    return match.group(1).decode("ascii"), int(match.group(2)), match.end()


class Opener:
    """Verifies envelopes for one run: size, prefix, version, kind, header, run, signature, time, replay.

    Thread-safe. ``now`` is injectable so tests can move the clock. ``replay_window``: see ``ReplayGuard``
    (0: strictly increasing numbers per sender and kind; > 0 for requests that may overtake each other).
    """

    def __init__(
        self,
        run_id: str,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        now: Callable[[], float] = time.time,
        replay_cache: int = DEFAULT_REPLAY_CACHE,
        replay_window: int = 0,
    ) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        self.run_id = _check_run_id(run_id)
        self.window_s = float(window_s)
        self._now = now
        self.replay = ReplayGuard(replay_cache, window=replay_window)

    def open(self, data: bytes, expect: type[M], *, check_replay: bool = True,
             signer: bytes | None = None) -> Signed[M]:
        """Verify ``data`` as an envelope of kind ``expect`` and decode its body.

        Args:
            signer: when given, the public key that must have signed it (the peer we asked, by the key the
                membership names for it); checked after the signature, before the body is decoded.

        Raises:
            RemoteProtocolError: a subclass naming the failed check and the claimed sender (``WrongSigner``: a
                valid signature by another key than ``signer``).
        """
        env = self.open_envelope(data, expect=(expect,), check_replay=check_replay)
        if signer is not None and env.sender != signer:
            raise WrongSigner(f"{expect.KIND} signed by another key than the one the membership names for the "
                              "peer asked", peer=env.peer)
        return Signed(env, expect.decode(env.body_view, peer=env.peer))

    def open_any(self, data: bytes, *, check_replay: bool = True) -> Signed[Message]:
        """Verify ``data`` as an envelope of any registered kind and decode its body."""
        env = self.open_envelope(data, check_replay=check_replay)
        return Signed(env, KINDS[env.kind].decode(env.body_view, peer=env.peer))

    def open_envelope(
        self,
        data: bytes,
        *,
        expect: Iterable[type[Message]] | None = None,
        check_replay: bool = True,
    ) -> Envelope:
        """Run every envelope check; return the verified envelope with its body still encoded.

        Args:
            data: the bytes a peer sent.
            expect: the kinds acceptable here (default: any registered kind). Their largest cap is
                checked before anything else.
            check_replay: record and check the sequence number. Turn it off only where the same record
                is legitimately read again (a DHT lookup); the timestamp window still applies.
        """
        expected = tuple(expect) if expect is not None else None
        # 1. Size.
        if not isinstance(data, bytes):
            raise MalformedMessage(f"envelope must be bytes, got {type(data).__name__}")
        cap = _max_cap(expected) if expected is not None else largest_cap()
        if len(data) > cap:
            raise OversizedMessage(f"envelope of {len(data)} bytes exceeds the cap of {cap}")
        if len(data) < _MIN_ENVELOPE:
            raise MalformedMessage(f"envelope of {len(data)} bytes is truncated")

        # 2-4. Prefix, version, kind and the kind's cap: still no decoding.
        prefix = _read_prefix(data)
        if prefix is None:
            raise MalformedMessage("envelope does not start with b'parallax/<kind>/v<version>\\x00'")
        kind, version, header_start = prefix
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersion(f"protocol version {version} is not one of {sorted(SUPPORTED_VERSIONS)}")
        cls = KINDS.get(kind)
        if cls is None or (expected is not None and cls not in expected):
            want = "any registered kind" if expected is None else [k.KIND for k in expected]
            raise UnknownKind(f"message kind {kind!r} is not expected here (want {want})")
        if len(data) > cls.MAX_BYTES:
            raise OversizedMessage(f"{kind} envelope of {len(data)} bytes exceeds its cap of {cls.MAX_BYTES}")

        # 5. Header: a bounded parse, exact types, canonical form, exact total length.
        unpacker = _header_unpacker()
        unpacker.feed(data[header_start : header_start + MAX_HEADER_BYTES])
        try:
            header = unpacker.unpack()
        except msgpack.OutOfData:
            raise MalformedMessage(f"{kind} envelope header is truncated or too long") from None
        except MSGPACK_ERRORS as e:
            raise MalformedMessage(f"{kind} envelope header does not parse ({type(e).__name__})") from None
        body_offset = header_start + unpacker.tell()
        if not isinstance(header, list) or len(header) != _HEADER_FIELDS:
            raise MalformedMessage(f"{kind} envelope header is not an array of {_HEADER_FIELDS} fields")
        run_id, sender, seq, timestamp, body_len = header
        if not (isinstance(sender, bytes) and len(sender) == PUBLIC_KEY_BYTES):
            raise MalformedMessage(f"{kind} envelope sender is not a 32-byte public key")
        # The fingerprint (a hash) is computed only for an error message: refusals are the rare path.
        if not (isinstance(run_id, str) and type(seq) is int and type(timestamp) is float and type(body_len) is int):
            raise MalformedMessage(f"{kind} envelope header fields have the wrong types", peer=fingerprint(sender))
        if body_offset + body_len + SIGNATURE_BYTES != len(data):
            raise MalformedMessage(
                f"{kind} envelope is {len(data)} bytes, its header announces "
                f"{body_offset + body_len + SIGNATURE_BYTES} (truncated or padded)",
                peer=fingerprint(sender),
            )
        if not (0 <= seq <= INT64_MAX and math.isfinite(timestamp)):
            raise MalformedMessage(f"{kind} envelope seq or timestamp out of range", peer=fingerprint(sender))
        if _pack_header(run_id, sender, seq, timestamp, body_len) != data[header_start:body_offset]:
            raise MalformedMessage(f"{kind} envelope header is not in canonical form", peer=fingerprint(sender))

        # 6. Run id.
        if run_id != self.run_id:
            raise WrongRun(
                f"{kind} for run {run_id!r:.80}, this node is in run {self.run_id!r}", peer=fingerprint(sender)
            )

        # 7. Signature over everything before it (the domain prefix included). cryptography takes a
        # memoryview at a fixed cost of ~40 us, a bytes slice at the cost of a copy: measured break-even
        # near 128 KiB.
        signed = memoryview(data)[:-SIGNATURE_BYTES] if len(data) > _COPY_BELOW else data[:-SIGNATURE_BYTES]
        if not verify_prefixed(sender, data[-SIGNATURE_BYTES:], signed):
            raise BadSignature(f"{kind} signature does not verify for the claimed sender", peer=fingerprint(sender))

        # 8. Timestamp window.
        now = self._now()
        if timestamp < now - self.window_s:
            raise BadTimestamp(
                f"{kind} is {now - timestamp:.1f} s old (window {self.window_s:g} s)",
                peer=fingerprint(sender),
                stale=True,
            )
        if timestamp > now + self.window_s:
            raise BadTimestamp(
                f"{kind} is {timestamp - now:.1f} s in the future (window {self.window_s:g} s)",
                peer=fingerprint(sender),
                stale=False,
            )

        envelope = Envelope(version, kind, run_id, sender, seq, timestamp, data, body_offset)
        # 9. Replay.
        if check_replay:
            self.accept(envelope)
        return envelope

    def accept(self, envelope: Envelope) -> None:
        """Record a verified envelope's sequence number, or raise ``ReplayedMessage`` if it is not new. The
        replay check of ``open_envelope``, for a caller that opened with ``check_replay=False`` and records
        the number only once it knows it will act on the message (so strangers cannot fill the cache)."""
        self.replay.accept(envelope.sender, envelope.kind, envelope.seq, envelope.timestamp)


def peek_kind(data: bytes) -> str | None:
    """The kind an envelope claims, unverified (for routing and logs only); None if unreadable."""
    prefix = _read_prefix(data) if isinstance(data, bytes) else None
    return prefix[0] if prefix is not None else None


__all__ = [
    "DEFAULT_WINDOW_S",
    "PROTOCOL_VERSION",
    "Envelope",
    "Opener",
    "ReplayGuard",
    "Sealer",
    "Signed",
    "peek_kind",
    "seal",
    "seal_body",
]
