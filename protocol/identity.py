"""Ed25519 node identities: generate, save, load, sign, verify.

A node's identity is one Ed25519 key pair (RFC 8032, via ``cryptography``), kept in a PEM file that only
its owner may read. Peers are named by their 32-byte raw public key; ``fingerprint`` is a short stable
form for logs and tables. Signing always goes through a per-purpose domain prefix, so a signature made
for one kind of message can never be replayed as another (libp2p's signing-prefix habit).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from parallax.files import create_whole
from parallax.protocol.errors import BadSignature, KeyFileError

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
_DOMAIN_SEPARATOR = b"\x00"


def fingerprint(public_key: bytes) -> str:
    """A short, stable, human-readable name for a raw Ed25519 public key (12 base32 characters)."""
    digest = hashlib.sha256(b"parallax/fingerprint/v1" + public_key).digest()
    return base64.b32encode(digest).decode("ascii")[:12].lower()


def _signed_bytes(domain: bytes, data: bytes) -> bytes:
    if not domain or _DOMAIN_SEPARATOR in domain:
        raise ValueError("a signing domain must be non-empty and contain no NUL byte")
    return domain + _DOMAIN_SEPARATOR + data


_P = 2**255 - 19
# The y-coordinates of edwards25519's eight points of small order (the 8-torsion): the identity (1),
# the point of order 2 (p - 1), those of order 4 (0) and of order 8 (+-Y8). tests/unit/test_protocol_
# identity.py checks these with the curve arithmetic.
_Y8 = 0x7A03AC9277FDC74EC6CC392CFA53202A0F67100D760B3CBA4FD84D3D706A17C7
_SMALL_ORDER_Y = frozenset({0, 1, _P - 1, _Y8, _P - _Y8})


def is_weak_public_key(public_key: bytes) -> bool:
    """True for encodings a signature check must not trust: the wrong length, non-canonical, or of small order.

    OpenSSL's Ed25519 verification (cofactorless, RFC 8032) accepts small-order public keys, for which
    signatures verify without any secret (the all-zero key with the all-zero signature "verifies" about
    a quarter of all messages). libsodium refuses such keys; so do we. Constant cost: no curve arithmetic.
    """
    if len(public_key) != PUBLIC_KEY_BYTES:
        return True
    y = int.from_bytes(public_key, "little") & ((1 << 255) - 1)
    return y >= _P or y in _SMALL_ORDER_Y


@functools.lru_cache(maxsize=4096)
def _public_key_object(public_key: bytes) -> Ed25519PublicKey:
    # Parsing and checking a key costs more than verifying a short message; peers sign many messages each.
    if is_weak_public_key(public_key):
        raise ValueError("weak (small-order, non-canonical or invalid) Ed25519 public key")
    return Ed25519PublicKey.from_public_bytes(public_key)


def signing_prefix(domain: bytes) -> bytes:
    """The bytes ``sign`` puts before the data: ``domain || 0x00``."""
    return _signed_bytes(domain, b"")


def verify(public_key: bytes, signature: bytes, domain: bytes, data: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s Ed25519 signature of ``data`` under ``domain``.

    Never raises on peer-supplied garbage: a malformed key or signature is simply not valid.
    """
    return verify_prefixed(public_key, signature, _signed_bytes(domain, data))


def verify_prefixed(public_key: bytes, signature: bytes, prefixed: bytes | memoryview) -> bool:
    """``verify`` for data that already starts with ``signing_prefix(domain)``: no copy of large inputs.

    ``verify(k, s, domain, data) == verify_prefixed(k, s, signing_prefix(domain) + data)``.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        _public_key_object(bytes(public_key)).verify(bytes(signature), prefixed)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def require_valid(public_key: bytes, signature: bytes, domain: bytes, data: bytes) -> None:
    """Like ``verify`` but raises ``BadSignature`` (a ``RemoteProtocolError``) naming the claimed signer."""
    if not verify(public_key, signature, domain, data):
        claimed = fingerprint(public_key) if len(public_key) == PUBLIC_KEY_BYTES else "<malformed key>"
        raise BadSignature("bad signature", peer=claimed)


@dataclass(frozen=True, slots=True)
class Identity:
    """An Ed25519 private key and the names derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """A deterministic identity from 32 seed bytes: for tests and golden vectors only."""
        if len(seed) != 32:
            raise ValueError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_key(self) -> bytes:
        """The 32-byte raw public key: the node's name on the wire."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def sign(self, domain: bytes, data: bytes) -> bytes:
        """Sign ``data`` under a purpose ``domain`` (e.g. ``b"parallax/envelope/heartbeat"``)."""
        return self.private_key.sign(_signed_bytes(domain, data))

    def sign_prefixed(self, prefixed: bytes) -> bytes:
        """``sign`` for data that already starts with ``signing_prefix(domain)`` (saves a copy).

        ``sign(domain, data) == sign_prefixed(signing_prefix(domain) + data)``.

        Raises:
            ValueError: ``prefixed`` does not start with a domain and its NUL separator.
        """
        if prefixed.find(_DOMAIN_SEPARATOR, 0, 256) <= 0:
            raise ValueError("prefixed data must start with a non-empty domain and a NUL byte")
        return self.private_key.sign(prefixed)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the key as unencrypted PKCS#8 PEM, readable by its owner only (mode 0600).

        Refuses to overwrite an existing file, so a typo cannot destroy a node's identity. The file appears whole
        or not at all: a stop in the middle leaves no empty key file behind.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

        def write(tmp: Path) -> None:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(pem)

        try:
            return create_whole(path, write)
        except FileExistsError:
            raise KeyFileError(f"{path} already exists; choose another path or delete it first") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Load a key written by ``save``.

        Raises:
            KeyFileError: the file is missing, is readable or writable by group/others, or is not an
                Ed25519 private key. The message says how to fix it.
        """
        path = Path(path)
        if not path.is_file():
            raise KeyFileError(f"no key file at {path}; create one with `parallax keys new {path}`")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise KeyFileError(
                f"{path} is accessible by other users (mode {mode:o}); "
                f"run `chmod 600 {path}` if you trust it, or create a new key"
            )
        if path.stat().st_size == 0:
            raise KeyFileError(f"{path} is empty: not a key; delete it, and a new key is created at the next start "
                               "(a new identity), or restore the key from a copy")
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise KeyFileError(f"{path} is not a readable unencrypted PEM private key: {e}") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at ``path``, creating it first if there is none (``node join --identity``)."""
        path = Path(path)
        if not path.exists():
            try:
                cls.generate().save(path)
            except KeyFileError:
                if not path.exists():
                    raise
                # another process created it meanwhile: that key is the one
        return cls.load(path)
