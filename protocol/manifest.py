"""A run's manifest (what every peer of the run must agree on, signed by its creator) and member certificates.

A manifest names the run, the training settings every composer must share (``node.config.train.run_settings``:
model shapes, optimizer and schedule, merges, surrogates, batch, steps, seed), the tokenizer, the corpus, the
admission policy and the creator's Ed25519 key, signed by that key. Its **run digest** is a hash of the *terms*: run
id, settings, tokenizer, corpus and admission, and for an ``allowlist`` run the creator's key (who certifies members).
Composers of one run train on one corpus: each draws its own batches of it, seeded by its identity, so any peer can
rebuild the batches another says it trained on and check its work against them (``node.train.own_data``).
Heartbeats carry the digest, and composers with another digest ignore each other.

The creator and the time of an ``open`` run are left out of its digest on purpose: composers started with the
same settings agree without having exchanged anything, whoever signed the manifest each holds. An
``allowlist`` run is the creator's: a **member certificate** is the creator's signature over (run digest,
member key, expiry), and the record validator refuses run records whose signer shows none
(``dht.records``).

Files are JSON, readable and diffable (``save``/``load``); the signature covers the canonical msgpack
encoding of the fields, so a file's formatting does not matter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgpack

from parallax.protocol.errors import LocalProtocolError, MalformedMessage, RemoteProtocolError
from parallax.protocol.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, fingerprint, verify
from parallax.protocol.messages import RUN_DIGEST_BYTES as DIGEST_BYTES
from parallax.protocol.schema import MSGPACK_ERRORS, Bytes, Float, Message, Str, register, wire

ADMISSIONS = frozenset({"open", "allowlist"})
MAX_MANIFEST_BYTES = 5 * 1024  # it travels in a DHT record (dht.records.MAX_RECORD_BYTES)
MAX_FILE_BYTES = 64 * 1024
BYTE_TOKENIZER = "bytes"
_MANIFEST_DOMAIN = b"parallax/run-manifest/v1"
_CERT_DOMAIN = b"parallax/member-cert/v1"
_TERMS_DOMAIN = b"parallax/run-terms/v1"


class ManifestError(ValueError):
    """A manifest or certificate that cannot be used here (the message says why and what to do)."""


@register
@dataclass(frozen=True, slots=True)
class RunManifest(Message):
    """A run's terms, signed by its creator.

    Fields:
        run_id: the run's name (the DHT keys' prefix).
        settings: the shared training settings as canonical JSON (sorted keys, no spaces).
        tokenizer: ``bytes``, or the hex sha256 of a tokenizer file stored with the run.
        corpus: the hex sha256 of the training corpus's bytes (``corpus_digest``).
        admission: ``open`` (anyone may join) or ``allowlist`` (only holders of a member certificate).
        creator: the creator's Ed25519 public key.
        created: when it was signed (seconds since the epoch; information only).
        signature: the creator's over the other fields (``signed_bytes``).
    """

    KIND: ClassVar[str] = "run_manifest"
    MAX_BYTES: ClassVar[int] = MAX_MANIFEST_BYTES

    run_id: str = wire(Str(128, min_len=1))
    settings: str = wire(Str(4096, min_len=2))
    tokenizer: str = wire(Str(64, min_len=1))
    corpus: str = wire(Str(64, min_len=64))
    admission: str = wire(Str(16, choices=ADMISSIONS))
    creator: bytes = wire(Bytes(length=PUBLIC_KEY_BYTES))
    created: float = wire(Float(0.0, 1e11))
    signature: bytes = wire(Bytes(max_len=SIGNATURE_BYTES), default=b"")

    def _validate(self) -> None:
        if _canonical(self.settings) != self.settings:
            raise ValueError("settings are not canonical JSON (sorted keys, no spaces)")

    def signed_bytes(self) -> bytes:
        return dataclasses.replace(self, signature=b"").encode()

    @property
    def digest(self) -> bytes:
        """The run digest: what composers compare (see the module docstring)."""
        who = self.creator if self.admission == "allowlist" else b""
        terms = msgpack.packb([self.run_id, self.settings, self.tokenizer, self.corpus, self.admission, who],
                              use_bin_type=True)
        return hashlib.sha256(_TERMS_DOMAIN + terms).digest()[:DIGEST_BYTES]

    @property
    def digest_hex(self) -> str:
        return self.digest.hex()

    def verified(self, *, source: str = "the manifest", peer: str | None = None) -> RunManifest:
        """``self`` when its signature is its creator's.

        Raises:
            RemoteProtocolError: unsigned or signed by another key (``peer`` is named when it came from one).
        """
        if len(self.signature) != SIGNATURE_BYTES or not verify(self.creator, self.signature, _MANIFEST_DOMAIN,
                                                                 self.signed_bytes()):
            raise RemoteProtocolError(f"{source} of run {self.run_id!r} is not signed by its creator "
                                      f"{fingerprint(self.creator)}", peer=peer)
        return self

    def settings_dict(self) -> dict[str, Any]:
        value = json.loads(self.settings)
        if not isinstance(value, dict):
            raise ManifestError(f"the manifest of run {self.run_id!r} holds settings that are not a table")
        return value


def corpus_digest(corpus: bytes) -> str:
    """A manifest's corpus term: the hex sha256 of the corpus's bytes."""
    return hashlib.sha256(corpus).hexdigest()


def create(identity: Identity, run_id: str, settings: str, *, corpus: str, tokenizer: str = BYTE_TOKENIZER,
           admission: str = "open", created: float | None = None) -> RunManifest:
    """A manifest of ``settings`` (canonical JSON) and ``corpus`` (``corpus_digest``) signed by ``identity``, its
    creator."""
    if admission not in ADMISSIONS:
        raise ManifestError(f"admission {admission!r} is not one of {sorted(ADMISSIONS)}")
    unsigned = RunManifest(run_id=run_id, settings=_canonical(settings), tokenizer=tokenizer, corpus=corpus,
                           admission=admission, creator=identity.public_key,
                           created=time.time() if created is None else created)
    return dataclasses.replace(unsigned, signature=identity.sign(_MANIFEST_DOMAIN, unsigned.signed_bytes()))


def _canonical(settings: str) -> str:
    try:
        return json.dumps(json.loads(settings), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        raise ValueError("settings are not JSON") from None


@register
@dataclass(frozen=True, slots=True)
class MemberCert(Message):
    """The creator of an ``allowlist`` run admits ``member`` to the run of ``run`` (its digest) until
    ``not_after``. A member's records carry ``wire_form`` (the member key is the record's signer)."""

    KIND: ClassVar[str] = "member_cert"
    MAX_BYTES: ClassVar[int] = 512

    run: bytes = wire(Bytes(length=DIGEST_BYTES))
    member: bytes = wire(Bytes(length=PUBLIC_KEY_BYTES))
    not_after: float = wire(Float(0.0, 1e11))
    signature: bytes = wire(Bytes(max_len=SIGNATURE_BYTES), default=b"")

    def signed_bytes(self) -> bytes:
        return dataclasses.replace(self, signature=b"").encode()

    def wire_form(self) -> bytes:
        """What a record carries: ``msgpack([not_after, signature])`` (run and member are the reader's)."""
        return msgpack.packb([self.not_after, self.signature], use_bin_type=True)  # type: ignore[no-any-return]


def admit(creator: Identity, manifest: RunManifest, member: bytes, *, valid_s: float) -> MemberCert:
    """A certificate admitting ``member`` (an Ed25519 public key) to ``manifest``'s run for ``valid_s`` seconds.

    Raises:
        ManifestError: the run is open, ``creator`` is not its creator, or the duration is not positive.
    """
    if manifest.admission != "allowlist":
        raise ManifestError(f"run {manifest.run_id!r} is open to anyone: it needs no member certificates")
    if creator.public_key != manifest.creator:
        raise ManifestError(f"only the run's creator {fingerprint(manifest.creator)} admits members; this key is "
                            f"{creator.fingerprint}")
    if not (valid_s > 0 and math.isfinite(valid_s)):
        raise ManifestError("a certificate must be valid for a positive number of seconds")
    unsigned = MemberCert(run=manifest.digest, member=member, not_after=time.time() + valid_s)
    return dataclasses.replace(unsigned, signature=creator.sign(_CERT_DOMAIN, unsigned.signed_bytes()))


def check_member(creator: bytes, run: bytes, member: bytes, carried: bytes | None, now: float) -> str | None:
    """Why ``member`` may not write in the ``allowlist`` run ``run`` of ``creator``, given the certificate its
    record ``carried`` (``MemberCert.wire_form``); ``None`` when it may. The creator needs no certificate."""
    if member == creator:
        return None
    if carried is None:
        return "no member certificate"
    try:
        not_after, signature = msgpack.unpackb(carried, raw=False, max_bin_len=SIGNATURE_BYTES, max_array_len=2)
        cert = MemberCert(run=run, member=member, not_after=not_after, signature=signature)
    except MSGPACK_ERRORS + (LocalProtocolError,):
        return "a malformed member certificate"
    if not verify(creator, cert.signature, _CERT_DOMAIN, cert.signed_bytes()):
        return "a member certificate not signed by the run's creator"
    if cert.not_after < now:
        return "an expired member certificate"
    return None


# --- files ------------------------------------------------------------------------------------------------


def save(message: RunManifest | MemberCert, path: Path) -> None:
    """Write a manifest or certificate as JSON (bytes as hex, settings as a table)."""
    obj: dict[str, Any] = {"kind": message.KIND}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        obj[f.name] = value.hex() if isinstance(value, bytes) else value
    if isinstance(message, RunManifest):
        obj["settings"] = message.settings_dict()
        obj["digest"] = message.digest_hex  # for people; recomputed on load
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_manifest(path: Path) -> RunManifest:
    """The verified manifest in the file at ``path``.

    Raises:
        ManifestError: a missing or unreadable file, another kind, or a bad signature, naming the file.
    """
    manifest: RunManifest = _load(path, RunManifest)
    try:
        return manifest.verified(source=f"manifest {path}")
    except RemoteProtocolError as e:
        raise ManifestError(f"{e}: the file was altered; ask the run's creator for it again") from None


def load_cert(path: Path) -> MemberCert:
    """The certificate in the file at ``path`` (its signature is checked against a manifest: ``check_member``)."""
    cert: MemberCert = _load(path, MemberCert)
    return cert


def _load(path: Path, cls: type[Any]) -> Any:
    what = "manifest" if cls is RunManifest else "member certificate"
    try:
        text = Path(path).read_bytes()[:MAX_FILE_BYTES + 1]
    except FileNotFoundError:
        raise ManifestError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise ManifestError(f"{what} {path} cannot be read: {e.strerror}") from None
    try:
        if len(text) > MAX_FILE_BYTES:
            raise ValueError("too large")
        obj = json.loads(text)
        if not isinstance(obj, dict) or obj.get("kind") != cls.KIND:
            raise ValueError(f"not a {what} (kind {obj.get('kind') if isinstance(obj, dict) else None!r})")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [f.name for f in fields.values() if f.default is dataclasses.MISSING and f.name not in obj]
        if missing:
            raise ValueError(f"it has no {', '.join(missing)} (a manifest of an older Parallax: ask the run's "
                             "creator for one written by this release, `parallax run create`)")
        kwargs: dict[str, Any] = {}
        for name, value in obj.items():
            if name not in fields:
                continue
            if name == "settings":
                value = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
            elif isinstance(value, str) and name in ("creator", "signature", "run", "member"):
                value = bytes.fromhex(value)
            kwargs[name] = value
        return cls(**kwargs)
    except (ValueError, TypeError, RecursionError, LocalProtocolError, MalformedMessage) as e:
        raise ManifestError(f"{what} {path} is not valid: {e}") from None


__all__ = [
    "ADMISSIONS",
    "BYTE_TOKENIZER",
    "ManifestError",
    "MemberCert",
    "RunManifest",
    "admit",
    "check_member",
    "corpus_digest",
    "create",
    "load_cert",
    "load_manifest",
    "save",
]
