"""Ed25519 identities: key files (mode 0600, refusals), fingerprints, domain-separated signatures."""

from __future__ import annotations

import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from parallax.protocol.errors import BadSignature, KeyFileError, RemoteProtocolError
from parallax.protocol.identity import (
    Identity,
    fingerprint,
    is_weak_public_key,
    require_valid,
    signing_prefix,
    verify,
    verify_prefixed,
)

SEEDED = Identity.from_seed(bytes(range(32)))


def test_golden_identity():
    # RFC 8032 keys are a pure function of the seed; the fingerprint is part of logs and tables.
    assert SEEDED.public_key.hex() == "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
    assert SEEDED.fingerprint == "sg7kbuh6vdue" == fingerprint(SEEDED.public_key)
    assert SEEDED.sign(b"parallax/test", b"hello").hex() == (
        "846af66f044f4d4cc13ff877aec4801bc96f32b232e591889869efbae6fef0da"
        "e5951680a297177c1530a8df2a6a1a16e880a8000a4b41c84e739cfe855e8801"
    )


def test_save_load_round_trip_with_owner_only_mode(tmp_path):
    path = tmp_path / "keys" / "node.key"
    identity = Identity.generate()
    identity.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).public_key == identity.public_key
    assert Identity.load_or_create(path).public_key == identity.public_key


def test_save_refuses_to_overwrite(tmp_path):
    path = tmp_path / "node.key"
    Identity.generate().save(path)
    with pytest.raises(KeyFileError, match="already exists"):
        Identity.generate().save(path)


def test_a_save_stopped_midway_leaves_no_key_file_and_the_next_start_creates_one(tmp_path, monkeypatch):
    path = tmp_path / "node.key"

    def stopped(*_args):
        raise KeyboardInterrupt  # a Ctrl+C while the key is written

    monkeypatch.setattr(os, "fsync", stopped)
    with pytest.raises(KeyboardInterrupt):
        Identity.load_or_create(path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert Identity.load_or_create(path).public_key == Identity.load(path).public_key


def test_an_empty_key_file_is_named_with_what_to_do(tmp_path):
    path = tmp_path / "node.key"
    path.touch(mode=0o600)
    with pytest.raises(KeyFileError, match="is empty.*delete it"):
        Identity.load_or_create(path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_load_refuses_a_key_others_can_access(tmp_path, mode):
    path = tmp_path / "node.key"
    Identity.generate().save(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match=r"accessible by other users.*chmod 600"):
        Identity.load(path)


def test_load_refuses_missing_garbage_and_foreign_keys(tmp_path):
    with pytest.raises(KeyFileError, match="parallax keys new"):
        Identity.load(tmp_path / "missing.key")
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    os.chmod(garbage, 0o600)
    with pytest.raises(KeyFileError, match="not a readable"):
        Identity.load(garbage)
    foreign = tmp_path / "ec.key"
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    foreign.write_bytes(pem)
    os.chmod(foreign, 0o600)
    with pytest.raises(KeyFileError, match="not an Ed25519 key"):
        Identity.load(foreign)


def test_signatures_are_bound_to_key_domain_and_data():
    other = Identity.from_seed(bytes(32))
    sig = SEEDED.sign(b"parallax/a", b"data")
    assert verify(SEEDED.public_key, sig, b"parallax/a", b"data")
    assert not verify(SEEDED.public_key, sig, b"parallax/b", b"data")
    assert not verify(SEEDED.public_key, sig, b"parallax/a", b"date")
    assert not verify(other.public_key, sig, b"parallax/a", b"data")
    # The NUL separator keeps domain and data apart: "ab" + "c" is not "a" + "bc".
    assert not verify(SEEDED.public_key, SEEDED.sign(b"ab", b"c"), b"a", b"bc")
    with pytest.raises(ValueError):
        SEEDED.sign(b"bad\x00domain", b"")


def test_prefixed_forms_are_the_same_signature():
    prefixed = signing_prefix(b"parallax/a") + b"data"
    assert SEEDED.sign_prefixed(prefixed) == SEEDED.sign(b"parallax/a", b"data")
    assert verify_prefixed(SEEDED.public_key, SEEDED.sign(b"parallax/a", b"data"), memoryview(prefixed))
    with pytest.raises(ValueError):
        SEEDED.sign_prefixed(b"no separator at all")


@pytest.mark.parametrize(
    "key, sig",
    [(b"", b""), (b"\x00" * 32, b"\x00" * 64), (b"\xff" * 32, b"\xff" * 64), (b"k" * 31, b"s" * 64), (b"k" * 32, b"s")],
)
def test_verification_never_raises_on_garbage(key, sig):
    assert not verify(key, sig, b"parallax/a", b"data")
    with pytest.raises(BadSignature) as info:
        require_valid(key, sig, b"parallax/a", b"data")
    assert isinstance(info.value, RemoteProtocolError)


# --- small-order keys: checked against the curve arithmetic ---------------------------------------

P = 2**255 - 19
D = -121665 * pow(121666, P - 2, P) % P


def _decode_point(key: bytes) -> tuple[int, int] | None:
    """RFC 8032 5.1.3 point decoding; None when the encoding is not a curve point."""
    n = int.from_bytes(key, "little")
    y, sign = n & ((1 << 255) - 1), n >> 255
    if y >= P:
        return None
    u, v = (y * y - 1) % P, (D * y * y + 1) % P
    x = u * pow(v, 3, P) * pow(u * pow(v, 7, P), (P - 5) // 8, P) % P
    if v * x * x % P == (-u) % P:
        x = x * pow(2, (P - 1) // 4, P) % P
    if v * x * x % P != u or (x == 0 and sign):
        return None
    return (P - x if x & 1 != sign else x), y


def _times8(point: tuple[int, int]) -> tuple[int, int]:
    x, y = point
    for _ in range(3):  # affine doubling on -x^2 + y^2 = 1 + d x^2 y^2
        t = D * x * x * y * y % P
        x, y = 2 * x * y * pow(1 + t, P - 2, P) % P, (y * y + x * x) * pow(1 - t, P - 2, P) % P
    return x, y


def _small_order(key: bytes) -> bool:
    point = _decode_point(key)
    return point is not None and _times8(point) == (0, 1)


def _y_encoding(y: int, sign: int) -> bytes:
    return (y | sign << 255).to_bytes(32, "little")


def test_the_small_order_blocklist_is_exactly_the_8_torsion():
    y8 = 0x7A03AC9277FDC74EC6CC392CFA53202A0F67100D760B3CBA4FD84D3D706A17C7
    torsion = [_y_encoding(y, sign) for y in (0, 1, P - 1, y8, P - y8) for sign in (0, 1)]
    points = {k for k in torsion if _decode_point(k) is not None}
    assert all(_small_order(k) for k in points)
    assert len({_decode_point(k) for k in points}) == 8  # every point of order dividing 8, found
    assert all(is_weak_public_key(k) for k in points)
    for _ in range(50):
        honest = Identity.generate().public_key
        assert not _small_order(honest) and not is_weak_public_key(honest)
    assert is_weak_public_key(_y_encoding(P + 3, 0))  # non-canonical y


def test_small_order_keys_cannot_sign_without_a_secret():
    # OpenSSL alone accepts the all-zero key and signature for about a quarter of messages.
    messages = [str(i).encode() for i in range(64)]
    assert not any(verify(bytes(32), bytes(64), b"parallax/a", m) for m in messages)
