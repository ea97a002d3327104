"""Forgery tests with real hivemind DHT peers: honest peers refuse forged, altered, replayed and
overwriting records (and count/log each refusal), and the victim's records still read correctly.

The attacker is a DHT peer whose "validator" puts arbitrary bytes on the wire (hivemind lets a
peer's own validator rewrite its outgoing values), so it can send exactly the records it wants.
"""

from __future__ import annotations

import msgpack
import pytest

from parallax.dht.adapter import DHTConfig, DHTRecord, RecordValidatorBase, SwarmDHT, dht_time
from parallax.dht.claims import ClaimSet, ShardConfig
from parallax.dht.keys import claims_key, members_key
from parallax.dht.membership import parse_members
from parallax.dht.records import (
    SIG_MAGIC,
    owner_subkey,
    pack_message,
    sign_record_for_test,
    stored_value,
)
from parallax.dht.testing import LocalSwarm, ManyKeysValidator, agreed, fixed_identity, sign_for, wait_until
from parallax.protocol.identity import Identity
from parallax.protocol.messages import Heartbeat, ShardClaim

RUN = "itest"
SHARDS = ShardConfig(n_layers=2, n_experts=8)
FAST = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=3.0, refresh_s=0.25)


class RawWireValidator(RecordValidatorBase):
    """The attacker's tool: the value passed to store() is itself the exact bytes to send."""

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return msgpack.unpackb(record.value)


@pytest.fixture
def arena(swarm: LocalSwarm):
    honest = [swarm.add(i, shards=SHARDS, **FAST) for i in range(3)]
    attacker = SwarmDHT.start(
        DHTConfig(initial_peers=tuple(honest[0].dht.visible_maddrs())), [RawWireValidator()]
    )
    try:
        wait_until(lambda: all(len(p.membership.view().alive()) == 3 for p in honest), timeout=10)
        yield honest, attacker
    finally:
        attacker.shutdown()


def _send(attacker: SwarmDHT, key: str, subkey: bytes, wire_value: bytes, expiration: float) -> None:
    attacker.store(key, subkey, wire_value, expiration, timeout_s=5)


def _genuine_heartbeat_everywhere(honest, victim) -> bool:
    for p in honest:
        raw = p.dht.local_dict(members_key(RUN))
        entry = raw.get(owner_subkey(victim.identity.public_key))
        if entry is None:
            return False
        members, _ = parse_members({owner_subkey(victim.identity.public_key): (stored_value(entry[0]), entry[1])})
        hb = members[victim.fp].heartbeat
        if hb.peer_id != victim.dht.peer_id or hb.capacity != 1.0:
            return False
        view = p.membership.view()
        if victim.fp not in view.alive() or view.alive()[victim.fp].heartbeat.peer_id != victim.dht.peer_id:
            return False
    return True


def _forged_heartbeat(capacity: float = 1000.0) -> bytes:
    return pack_message(Heartbeat(peer_id="12D3KooWforged", addresses=(), role="composer", capacity=capacity,
                                  shards=(), step=0))


def test_forgeries_are_refused_and_the_victim_still_reads(arena):
    honest, attacker = arena
    victim = honest[1]
    mallory = fixed_identity(66)
    key = members_key(RUN)
    victim_sub = owner_subkey(victim.identity.public_key)
    before = sum(p.dht.refusals() for p in honest)
    now = dht_time()

    # 1. Signed by the wrong key: Mallory signs a heartbeat under the victim's subkey.
    forged = sign_record_for_test(mallory, key, victim_sub, _forged_heartbeat(), now + 60)
    _send(attacker, key, victim_sub, forged.value, now + 60)

    # 2. Altered value: a genuine signature by the victim, over another value.
    genuine = sign_record_for_test(victim.identity, key, victim_sub, _forged_heartbeat(2.0), now + 61)
    altered = msgpack.packb(_forged_heartbeat(), use_bin_type=True) + genuine.value[-(len(SIG_MAGIC) + 64):]
    _send(attacker, key, victim_sub, altered, now + 61)

    # 3. Expired, then replayed: a record the victim really signed, long expired.
    old = sign_record_for_test(victim.identity, key, victim_sub, _forged_heartbeat(3.0), now - 120)
    _send(attacker, key, victim_sub, old.value, now - 120)

    # 4. Overwrite the victim's heartbeat with an unsigned record, far in the future.
    _send(attacker, key, victim_sub, msgpack.packb(_forged_heartbeat(), use_bin_type=True), now + 300)

    # 5. Overwrite the victim's claim on layer 0 with Mallory's signature.
    ckey = claims_key(RUN, 0)
    fake_claims = ClaimSet(tuple(ShardClaim(layer=0, expert=e, lease_expiry=now + 60) for e in range(8))).encode()
    forged_claim = sign_record_for_test(mallory, ckey, victim_sub, fake_claims, now + 60)
    _send(attacker, ckey, victim_sub, forged_claim.value, now + 60)

    # 6. An unsigned record under a protected key (a junk subkey).
    _send(attacker, key, b"junk", msgpack.packb(b"junk", use_bin_type=True), now + 60)

    # Honest peers refused every one of these (counted by their validators, which also log them)...
    wait_until(lambda: sum(p.dht.refusals() for p in honest) - before >= 6, timeout=5)
    for p in honest:
        assert b"junk" not in p.dht.local_dict(key)
    # ... and the victim's heartbeat and claims still read correctly in every honest view.
    assert _genuine_heartbeat_everywhere(honest, victim)
    wait_until(lambda: _views_agree_on_genuine_claims(honest), timeout=5)


def _views_agree_on_genuine_claims(honest) -> bool:
    return agreed([p.membership.view() for p in honest])


def test_replay_of_an_older_genuine_record_cannot_roll_the_victim_back(arena):
    honest, attacker = arena
    victim = honest[2]
    key, sub = members_key(RUN), owner_subkey(victim.identity.public_key)
    # A genuine record the victim signed, still unexpired but older than its latest heartbeat.
    now = dht_time()
    stale = sign_record_for_test(victim.identity, key, sub, _forged_heartbeat(5.0), now + 0.5)
    _send(attacker, key, sub, stale.value, now + 0.5)
    for p in honest:
        entry = p.dht.local_dict(key).get(sub)
        assert entry is not None and entry[1] > now + 0.5  # hivemind keeps the strictly later record
    assert _genuine_heartbeat_everywhere(honest, victim)


def test_an_attackers_peer_signs_for_keys_given_once_it_runs_and_the_honest_peers_take_them(swarm: LocalSwarm):
    """``ManyKeysValidator`` signs in the DHT process, forked with the keys it held: a key added there afterwards
    only (the parent's copy) signs nothing; ``sign_for`` gives it to the running peer, whose heartbeats under it
    every honest view then shows (the tool the heartbeat-flood attacks of ``bench attacks`` write with)."""
    honest = [swarm.add(i, shards=SHARDS, **FAST) for i in range(2)]
    first, later = fixed_identity(200), fixed_identity(201)
    validator = ManyKeysValidator([first])
    writer = SwarmDHT.start(DHTConfig(initial_peers=tuple(honest[0].dht.visible_maddrs())), [validator])
    try:
        beat = pack_message(Heartbeat(peer_id=str(writer.peer_id), addresses=(), role="composer", capacity=1.0,
                                      shards=(), step=0))

        def store(identity: Identity) -> bool:
            return writer.store(members_key(swarm.run_id), owner_subkey(identity.public_key), beat,
                                dht_time() + 30, timeout_s=10)

        validator.add(later)  # the parent's copy only
        assert not store(later)
        sign_for(writer, [later])
        assert store(later) and store(first)
        wait_until(lambda: all({first.fingerprint, later.fingerprint} <= set(p.membership.view().alive())
                               for p in honest), timeout=20)
    finally:
        writer.shutdown()
