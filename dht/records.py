"""Signed DHT records for Ed25519 identities: a hivemind record validator, and the value codec.

Protection (the pattern of hivemind's ``RSASignatureValidator``, with our Ed25519 keys):

- a protected record lives under a *subkey bound to its signer*: ``owner_subkey(public_key)``, i.e.
  the bytes ``b"px-ed25519:" + <32-byte raw public key>``;
- the value the DHT stores is ``value || SIG_MAGIC || signature``, the signature being Ed25519 over
  ``msgpack([key, subkey, value, expiration_time])`` under the domain ``RECORD_DOMAIN``, so altering
  any of the four, or moving the record to another key, subkey or expiry, breaks it;
- ``validate`` runs on every honest peer when another peer asks it to store a record and when a peer
  answers its get: a record that is unsigned under a protected key, signed by a key other than the
  one in its subkey, altered, oversized, already expired or expiring implausibly far in the future
  is refused (and logged). Overwrites by an impostor thus fail: the impostor cannot sign for the
  victim's subkey. Replays of an old genuine record fail too: hivemind keeps only a *strictly later*
  expiration per subkey, and refuses already-expired stores; the validator also refuses records past
  their expiry by more than the clock-skew allowance.
- in an ``allowlist`` run (``Admission``), a record under a protected key must also carry its signer's member
  certificate (``protocol.manifest.MemberCert``), appended to the value before the signature as
  ``cert || len(cert) as 2 bytes || CERT_MAGIC``; a signer the run's creator did not admit cannot write
  a heartbeat, a claim, a surrogate announcement or a round fingerprint anywhere an honest peer stores it;
- a key that has held one valid signed record is protected from then on (``learn_protected``), in the
  process that saw it: a peer that knows no run (a bootstrap started without ``--run``) still refuses
  the plain values a stock hivemind client writes to replace a run's signed entries (hivemind lets a
  later-expiring plain value replace a dictionary).

Values are Parallax messages (``parallax.protocol.messages``), packed as ``msgpack([kind, body])``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgpack

from parallax.dht.adapter import DHTRecord, RecordValidatorBase, dht_key_id, dht_time
from parallax.protocol.errors import RemoteProtocolError
from parallax.protocol.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, fingerprint, verify
from parallax.protocol.manifest import check_member
from parallax.protocol.schema import MSGPACK_ERRORS, Message, message_class

logger = logging.getLogger(__name__)

RECORD_DOMAIN = b"parallax/dht-record/v1"
SUBKEY_MARKER = b"px-ed25519:"
SIG_MAGIC = b"\x00pxsig1\x00"
CERT_MAGIC = b"\x00pxcert1\x00"
MAX_CERT_BYTES = 256
MAX_RECORD_BYTES = 6 * 1024  # hivemind's DHT process can crash on values of ~16 KB (HIVEMIND.md trap 2)
DEFAULT_MAX_TTL_S = 600.0  # no honest record lives longer: heartbeats 6 s, leases tens of seconds
DEFAULT_CLOCK_SKEW_S = 5.0  # peers' clocks must agree within this (hivemind assumes ~3 s)
_REFUSAL_LOG_INTERVAL_S = 10.0
_TRAILERS_BYTES = MAX_CERT_BYTES + 2 + len(CERT_MAGIC) + len(SIG_MAGIC) + SIGNATURE_BYTES
MAX_LEARNED_KEYS = 65536  # keys learnt as protected, oldest forgotten first: bounded memory under a flood
MAX_VERIFIED_KEPT = 16384  # signatures remembered as checked (32 B each), oldest forgotten first


def owner_subkey(public_key: bytes) -> bytes:
    """The subkey under which only the holder of ``public_key`` may write."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return SUBKEY_MARKER + public_key


def subkey_owner(subkey: object) -> bytes | None:
    """The public key bound in a (deserialized) subkey, or ``None`` when the subkey is not ours."""
    if (
        isinstance(subkey, bytes)
        and len(subkey) == len(SUBKEY_MARKER) + PUBLIC_KEY_BYTES
        and subkey.startswith(SUBKEY_MARKER)
    ):
        return subkey[len(SUBKEY_MARKER) :]
    return None


def _signed_payload(key: bytes, subkey: bytes, value: bytes, expiration_time: float) -> bytes:
    return msgpack.packb([key, subkey, value, float(expiration_time)], use_bin_type=True)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Admission:
    """An ``allowlist`` run's rule for the validator: records under its keys need a certificate of ``creator``
    for ``run`` (the run digest); ``carried`` is this node's own (``MemberCert.wire_form``; ``None`` for the
    creator, or a peer that only validates)."""

    creator: bytes
    run: bytes
    carried: bytes | None = None

    def __post_init__(self) -> None:
        if self.carried is not None and len(self.carried) > MAX_CERT_BYTES:
            raise ValueError(f"a member certificate is at most {MAX_CERT_BYTES} bytes")


def _split_cert(value: bytes) -> tuple[bytes, bytes | None]:
    """``value`` without its certificate trailer, and the certificate (``None`` when it carries none)."""
    if not value.endswith(CERT_MAGIC) or len(value) < len(CERT_MAGIC) + 2:
        return value, None
    end = len(value) - len(CERT_MAGIC)
    size = int.from_bytes(value[end - 2:end], "big")
    if size > MAX_CERT_BYTES or size > end - 2:
        return value, None
    return value[:end - 2 - size], value[end - 2 - size:end - 2]


def _split_signature(value: bytes) -> tuple[bytes, bytes] | None:
    tail = len(SIG_MAGIC) + SIGNATURE_BYTES
    if len(value) < tail or value[-tail : -SIGNATURE_BYTES] != SIG_MAGIC:
        return None
    return value[:-tail], value[-SIGNATURE_BYTES:]


class Ed25519RecordValidator(RecordValidatorBase):  # type: ignore[misc]  # hivemind has no type hints: its base is Any
    """Only the owner of a subkey's Ed25519 key may write under it; see the module docstring.

    Args:
        identity: this node's key, used to sign its own records (``None``: validate only).
        protected_keys: DHT keys (``keys.protected_keys``) whose every entry must be signed; a record
            under them with a foreign or missing subkey is refused. Signed records under other keys
            are checked too; unsigned ones under other keys are left to other validators.
        max_ttl_s: refuse records expiring more than this (plus ``clock_skew_s``) in the future, so a
            dead peer cannot leave a heartbeat that lives for a year.
        clock_skew_s: tolerance for disagreeing clocks on both ends of a record's life.
        clock: the DHT clock (injected for tests).
        learn_protected: protect every key once a valid signed record has been seen under it.
        admission: an ``allowlist`` run's rule: records under ``protected_keys`` need a member certificate.
    """

    def __init__(
        self,
        identity: Identity | None = None,
        *,
        protected_keys: Iterable[str] = (),
        max_ttl_s: float = DEFAULT_MAX_TTL_S,
        clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
        clock: Callable[[], float] = dht_time,
        learn_protected: bool = True,
        admission: Admission | None = None,
    ) -> None:
        self._identity = identity
        self._own_subkey_bytes = None
        if identity is not None:
            self._own_subkey_bytes = msgpack.packb(owner_subkey(identity.public_key), use_bin_type=True)
        self._protected = frozenset(dht_key_id(k) for k in protected_keys)
        self._learn = learn_protected
        self._learned: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._admission = admission
        self._max_ttl_s = max_ttl_s
        self._clock_skew_s = clock_skew_s
        self._clock = clock
        self._last_log = 0.0
        self.refused = 0  # count of refused records, in the process that ran validate (the DHT's)
        self._verified: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """Digests of (signer, signature, signed payload) whose signature checked out, the most recent last: every
        read of a hot key brings the same records back from several peers, and an Ed25519 check costs about as
        much as the rest of a DHT process's work together."""

    def _refuse(self, why: str, record: DHTRecord, signer: bytes | None = None) -> bool:
        self.refused += 1
        who = fingerprint(signer) if signer is not None else "unsigned"
        now = time.monotonic()
        # Forgeries are worth a warning, but a hostile peer must not be able to flood our logs.
        if now - self._last_log >= _REFUSAL_LOG_INTERVAL_S:
            self._last_log = now
            logger.warning(
                "refused a DHT record (%s), claimed signer %s; %d refused so far", why, who, self.refused
            )
        else:
            logger.debug("refused a DHT record (%s), claimed signer %s", why, who)
        return False

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES + _TRAILERS_BYTES:
            return self._refuse(f"value of {len(record.value)} bytes", record)
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False) if record.subkey else None
        except MSGPACK_ERRORS:
            subkey = None
        signer = subkey_owner(subkey)
        if signer is None:
            if record.key in self._protected or record.key in self._learned:
                return self._refuse("unsigned record under a protected key", record)
            return True  # not ours to judge
        split = _split_signature(record.value)
        if split is None:
            return self._refuse("no signature", record, signer)
        value, signature = split
        now = self._clock()
        if record.expiration_time < now - self._clock_skew_s:
            return self._refuse("expired", record, signer)
        if record.expiration_time > now + self._max_ttl_s + self._clock_skew_s:
            return self._refuse("expiration too far in the future", record, signer)
        payload = _signed_payload(record.key, record.subkey, value, record.expiration_time)
        if not self._verify(signer, signature, payload):
            return self._refuse("bad signature", record, signer)
        admission = self._admission
        if admission is not None and record.key in self._protected:
            why = check_member(admission.creator, admission.run, signer, _split_cert(value)[1], now)
            if why is not None:
                return self._refuse(f"{why} in an allowlist run", record, signer)
        if self._learn and record.key not in self._protected and record.key not in self._learned:
            self._learned[record.key] = None
            if len(self._learned) > MAX_LEARNED_KEYS:
                self._learned.popitem(last=False)
        return True

    def _verify(self, signer: bytes, signature: bytes, payload: bytes) -> bool:
        """``verify``, remembering the last ``MAX_VERIFIED_KEPT`` signatures that checked out (by a digest of the
        signer, the signature and the payload: a cached answer holds for exactly those bytes)."""
        if len(signer) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return False  # fixed lengths: no other split of the same bytes can hit the cache
        digest = hashlib.blake2b(signer + signature + payload, digest_size=32).digest()
        if digest in self._verified:
            self._verified.move_to_end(digest)
            return True
        if not verify(signer, signature, RECORD_DOMAIN, payload):
            return False
        self._verified[digest] = None
        if len(self._verified) > MAX_VERIFIED_KEPT:
            self._verified.popitem(last=False)
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        value: bytes = record.value
        if self._identity is None or record.subkey != self._own_subkey_bytes:
            return value  # not our subkey: left unsigned, so validate() will refuse it if protected
        carried = self._admission.carried if self._admission is not None else None
        if carried is not None and record.key in self._protected:
            value = value + carried + len(carried).to_bytes(2, "big") + CERT_MAGIC
        payload = _signed_payload(record.key, record.subkey, value, record.expiration_time)
        return value + SIG_MAGIC + self._identity.sign(RECORD_DOMAIN, payload)

    def strip_value(self, record: DHTRecord) -> bytes:
        value: bytes = record.value
        split = _split_signature(value)
        return value if split is None else _split_cert(split[0])[0]

    @property
    def priority(self) -> int:
        return 10  # validate signatures before any validator that decodes the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def sign_record_for_test(
    identity: Identity, key: str, subkey: bytes, value: object, expiration_time: float
) -> DHTRecord:
    """A record exactly as ``identity``'s node would put it on the wire (for forgery tests)."""
    key_bytes = dht_key_id(key)
    subkey_bytes = msgpack.packb(subkey, use_bin_type=True)
    value_bytes = msgpack.packb(value, use_bin_type=True)
    record = DHTRecord(key_bytes, subkey_bytes, value_bytes, expiration_time)
    signed = Ed25519RecordValidator(identity).sign_value(record)
    return dataclasses.replace(record, value=signed)


def stored_value(raw: bytes) -> object:
    """Decode raw stored bytes (``SwarmDHT.local_dict``): drop the signature, then msgpack-decode."""
    split = _split_signature(raw)
    return msgpack.unpackb(raw if split is None else _split_cert(split[0])[0], raw=False)


# --- values -------------------------------------------------------------------------------------------


def pack_message(msg: Message) -> bytes:
    """A message as a DHT value: ``msgpack([kind, canonical body])``."""
    return msgpack.packb([msg.KIND, msg.encode()], use_bin_type=True)  # type: ignore[no-any-return]


def unpack_message(data: object, allowed: tuple[type[Message], ...], *, peer: str | None = None) -> Message:
    """Decode a value written by ``pack_message``, accepting only the ``allowed`` kinds.

    Raises:
        RemoteProtocolError: the value is not bytes, does not parse, or is of another kind.
    """
    if not isinstance(data, bytes) or len(data) > MAX_RECORD_BYTES:
        raise RemoteProtocolError("DHT value is not a bounded byte string", peer=peer)
    try:
        obj = msgpack.unpackb(data, raw=False, max_bin_len=MAX_RECORD_BYTES, max_str_len=256, max_array_len=4)
    except MSGPACK_ERRORS as e:
        raise RemoteProtocolError(f"undecodable DHT value ({type(e).__name__})", peer=peer) from None
    if not (
        isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], bytes)
    ):
        raise RemoteProtocolError("DHT value is not [kind, body]", peer=peer)
    cls = message_class(obj[0], peer=peer)
    if cls not in allowed:
        raise RemoteProtocolError(f"unexpected message kind {obj[0]!r} here", peer=peer)
    return cls.decode(obj[1], peer=peer)
