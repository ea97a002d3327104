"""The Ed25519 record validator, without a network: the attacks of hivemind's RSASignatureValidator tests."""

from __future__ import annotations

import dataclasses
import logging

import msgpack
import pytest

from parallax.dht.adapter import DHTRecord, dht_key_id
from parallax.dht.keys import members_key
from parallax.dht.records import (
    SIG_MAGIC,
    Ed25519RecordValidator,
    owner_subkey,
    pack_message,
    sign_record_for_test,
    subkey_owner,
    unpack_message,
)
from parallax.protocol.errors import RemoteProtocolError
from parallax.protocol.identity import Identity
from parallax.protocol.messages import Deathrattle, Heartbeat, ShardClaim

NOW = 1_800_000_000.0
KEY = members_key("run")
ALICE = Identity.from_seed(b"a" * 32)
MALLORY = Identity.from_seed(b"m" * 32)


def validator(identity=None):
    return Ed25519RecordValidator(identity, protected_keys=[KEY], clock=lambda: NOW)


def record(identity=ALICE, signer=None, value=b"hello", expiration=NOW + 6, key=KEY):
    """A record under ``identity``'s subkey, signed by ``signer`` (default: the same identity)."""
    signed = sign_record_for_test(signer or identity, key, owner_subkey(identity.public_key), value, expiration)
    if signer is not None and signer is not identity:
        # sign_record_for_test signs only for the signer's own subkey: re-sign by hand as an impostor would.
        honest = sign_record_for_test(signer, key, owner_subkey(signer.public_key), value, expiration)
        signed = dataclasses.replace(signed, value=honest.value)
    return signed


def test_owner_record_is_valid_and_strips_back():
    r = record()
    v = validator()
    assert v.validate(r)
    assert msgpack.unpackb(v.strip_value(r)) == b"hello"


def test_a_record_seen_again_is_not_verified_again_and_a_changed_one_is(monkeypatch):
    import parallax.dht.records as records

    checks = []
    real = records.verify
    monkeypatch.setattr(records, "verify", lambda *a: checks.append(1) or real(*a))
    r, v = record(), validator()
    assert v.validate(r) and v.validate(r) and len(checks) == 1  # the same bytes: one Ed25519 check
    later = dataclasses.replace(r, expiration_time=r.expiration_time + 1)  # the signature covers the expiry
    assert not v.validate(later) and len(checks) == 2
    assert not v.validate(record(signer=MALLORY)) and not v.validate(record(signer=MALLORY)) and len(checks) == 4


def test_sign_value_signs_only_own_subkey():
    mine = DHTRecord(dht_key_id(KEY), msgpack.packb(owner_subkey(ALICE.public_key)), b"\xc4\x01x", NOW + 6)
    theirs = dataclasses.replace(mine, subkey=msgpack.packb(owner_subkey(MALLORY.public_key)))
    v = validator(ALICE)
    assert v.sign_value(mine) != mine.value and v.validate(dataclasses.replace(mine, value=v.sign_value(mine)))
    assert v.sign_value(theirs) == theirs.value and not v.validate(theirs)


def test_wrong_key_is_refused_and_logged(caplog):
    v = validator()
    with caplog.at_level(logging.DEBUG, logger="parallax.dht.records"):
        assert not v.validate(record(signer=MALLORY))
    assert "bad signature" in caplog.text and v.refused == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda r: dataclasses.replace(r, value=msgpack.packb(b"HELLO") + r.value[-(len(SIG_MAGIC) + 64):]),
        lambda r: dataclasses.replace(r, expiration_time=r.expiration_time + 1),
        lambda r: dataclasses.replace(r, key=dht_key_id(members_key("other-run"))),
        lambda r: dataclasses.replace(r, value=r.value[:-1] + bytes([r.value[-1] ^ 1])),
        lambda r: dataclasses.replace(r, value=r.value[: -(len(SIG_MAGIC) + 64)]),  # signature dropped
    ],
    ids=["value", "expiration", "key", "signature-bit", "unsigned"],
)
def test_altered_records_are_refused(change):
    assert not validator().validate(change(record()))


def test_moving_a_signed_record_to_another_subkey_is_refused():
    r = record()
    moved = dataclasses.replace(r, subkey=msgpack.packb(owner_subkey(MALLORY.public_key)))
    assert not validator().validate(moved)


def test_expired_replay_and_far_future_records_are_refused():
    v = validator()
    assert not v.validate(record(expiration=NOW - 60))
    assert not v.validate(record(expiration=NOW + 10 * 24 * 3600))
    assert v.validate(record(expiration=NOW - 1))  # within clock-skew allowance


def test_unsigned_records_under_protected_keys_are_refused_others_pass():
    v = validator()
    junk = DHTRecord(dht_key_id(KEY), msgpack.packb(b"junk"), msgpack.packb(b"x"), NOW + 6)
    assert not v.validate(junk)
    assert v.validate(dataclasses.replace(junk, key=dht_key_id("unprotected/key")))
    regular = DHTRecord(dht_key_id(KEY), msgpack.packb(None), msgpack.packb(b"x"), NOW + 6)
    assert not v.validate(regular)


def test_a_key_that_held_a_signed_record_refuses_plain_values_from_then_on():
    other = "some-run/outer/router/rounds"  # a key this validator was not told about (a bootstrap without --run)
    v = Ed25519RecordValidator(None, clock=lambda: NOW)
    plain = DHTRecord(dht_key_id(other), msgpack.packb(None), msgpack.packb(b"x"), NOW + 3600)
    plain_subkey = dataclasses.replace(plain, subkey=msgpack.packb(b"QmPeer"))
    assert v.validate(plain) and v.validate(plain_subkey)  # nothing known yet: not ours to judge
    assert v.validate(record(key=other))
    assert not v.validate(plain) and not v.validate(plain_subkey)
    assert v.validate(dataclasses.replace(plain, key=dht_key_id("hivemind/own/key")))
    unlearning = Ed25519RecordValidator(None, clock=lambda: NOW, learn_protected=False)
    assert unlearning.validate(record(key=other)) and unlearning.validate(plain)


def test_oversized_and_garbage_subkeys():
    v = validator()
    assert not v.validate(record(value=b"x" * 10_000))
    garbage = DHTRecord(dht_key_id(KEY), b"\xc1\xc1", b"\x00", NOW + 6)
    assert not v.validate(garbage)
    assert subkey_owner(b"nope") is None and subkey_owner(owner_subkey(ALICE.public_key)) == ALICE.public_key


def test_message_values_round_trip_and_refuse_other_kinds():
    hb = Heartbeat(peer_id="12D3KooWx", addresses=(), role="composer", capacity=1.0, shards=((0, 1),), step=3)
    assert unpack_message(pack_message(hb), (Heartbeat, Deathrattle)) == hb
    with pytest.raises(RemoteProtocolError, match="unexpected message kind"):
        unpack_message(pack_message(ShardClaim(layer=0, expert=1, lease_expiry=NOW)), (Heartbeat,))
    for bad in [b"", b"\x93\x01\x02\x03", msgpack.packb(["heartbeat", b"\x00"]), msgpack.packb(["nokind", b""]), 7]:
        with pytest.raises(RemoteProtocolError):
            unpack_message(bad, (Heartbeat,))


def test_one_forged_entry_does_not_hide_the_valid_ones_of_a_dictionary():
    """hivemind drops a whole dictionary answer when one subkey fails; ``keep_valid_subkeys`` drops only that one."""
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer

    from parallax.dht.adapter import keep_valid_subkeys

    good, bob = record(ALICE), record(Identity.from_seed(b"b" * 32))
    dictionary = DictionaryDHTValue()
    for r in (good, bob):
        dictionary.store(msgpack.unpackb(r.subkey), r.value, r.expiration_time)
    dictionary.store(owner_subkey(MALLORY.public_key), good.value, good.expiration_time)  # Alice's, as Mallory
    protocol = type("Protocol", (), {"record_validator": validator(), "serializer": MSGPackSerializer})()
    assert keep_valid_subkeys(protocol, dht_key_id(KEY), dictionary)
    assert {s for s, _ in dictionary.items()} == {owner_subkey(ALICE.public_key), msgpack.unpackb(bob.subkey)}
