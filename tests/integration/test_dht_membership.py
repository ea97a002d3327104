"""Membership and shard ownership with real hivemind DHT peers on loopback, at the default timings.

The targets: 4 peers see each other; a peer killed without a deathrattle is seen
dead within 6 s by all; a deathrattle is seen within 2 s; the dead peer's experts have new owners,
agreed by every view, within 8 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from hivemind.p2p import PeerID

from parallax.dht.adapter import DHTConfig, SwarmDHT, dht_time
from parallax.dht.claims import ShardConfig
from parallax.dht.keys import member_part, members_key, members_keys
from parallax.dht.membership import (
    DuplicateIdentityError,
    Membership,
    PeerState,
    Presence,
    QuorumState,
    heartbeat_value,
    read_view,
)
from parallax.dht.records import owner_subkey, subkey_owner
from parallax.dht.testing import LocalPeer, LocalSwarm, ManyKeysValidator, agreed, fixed_identity, wait_until
from parallax.node.peer.views import SwarmViews
from parallax.protocol.identity import Identity, fingerprint
from parallax.protocol.messages import Heartbeat

SHARDS = ShardConfig(n_layers=2, n_experts=8)

# Default config: heartbeat every 2 s, TTL 6 s, refresh 0.5 s.


def _agreed_and_claimed(peers, gone: str) -> bool:
    """Every view: same assignment without ``gone``, and every expert validly claimed by its owners."""
    return agreed([p.membership.view() for p in peers], gone)


@pytest.mark.parametrize("replicas", [1, 2])
def test_four_peers_detection_deathrattle_and_reassignment(swarm: LocalSwarm, replicas: int):
    shards = dataclasses.replace(SHARDS, replicas=replicas)
    peers = [swarm.add(i, shards=shards) for i in range(4)]
    fps = {p.fp for p in peers}
    for p in peers:
        assert p.membership.state is PeerState.ONLINE
    wait_until(lambda: all(set(p.membership.view().alive()) == fps for p in peers), timeout=5)
    wait_until(lambda: _agreed_and_claimed(peers, gone="nobody"), timeout=5)

    # Kill one without a deathrattle: all others see it dead at their first read that begins after its last
    # heartbeat expired, the 6 s TTL after it landed (its store lag: about zero on an idle host), so within a
    # refresh period and a read of the expiry.
    victim, rest = peers[1], [peers[0], peers[2], peers[3]]
    owned_before = victim.membership.owned()
    assert owned_before
    expires_in = victim.membership._members_expiry - dht_time()
    victim.kill()
    killed_at = time.monotonic()
    victim.membership.abandon(wait=False)
    # With two owners, every expert the victim owned is claimed by a live co-owner when it dies: no expert waits on
    # the reassignment. (Once the others see the death, the balanced matching may move an expert on, so the claims
    # are looked at in the view the kill left.)
    held = rest[0].membership.view().claims()
    if replicas > 1:
        assert all(set(held.get((layer, e), ())) - {victim.fp} for layer, es in owned_before.items() for e in es), held
    seen = {}
    while len(seen) < len(rest) and time.monotonic() - killed_at < expires_in + 2.0:
        for p in rest:
            if p.fp not in seen and victim.fp not in p.membership.view().alive():
                seen[p.fp] = time.monotonic() - killed_at
        time.sleep(0.02)
    print(f"detection latencies (s): {sorted(seen.values())}")
    cycle = rest[0].membership.timing.refresh_s + 0.2  # a read on an idle host, polling and scheduling slack
    assert len(seen) == len(rest) and max(seen.values()) <= expires_in + cycle

    # Its experts get new owners, the same in every view, each claimed: within 8 s of the kill.
    budget = max(0.1, 8.0 - (time.monotonic() - killed_at))
    wait_until(lambda: _agreed_and_claimed(rest, gone=victim.fp), timeout=budget)
    reassigned = time.monotonic() - killed_at
    print(f"reassignment complete {reassigned:.2f} s after the kill")
    a = rest[0].membership.view().assignment()
    for layer, experts in owned_before.items():
        for e in experts:
            assert victim.fp not in a.owners_of(layer, e)

    # A deathrattle is seen within 2 s, and the leaver's experts move on too.
    leaver, stay = rest[2], rest[:2]
    assert leaver.membership.leave("test")
    left_at = time.monotonic()
    rattle = wait_until(lambda: all(leaver.fp in p.membership.view().departed
                                    and leaver.fp not in p.membership.view().alive() for p in stay), timeout=2.0)
    print(f"deathrattle seen by all after {rattle:.2f} s")
    wait_until(lambda: _agreed_and_claimed(stay, gone=leaver.fp), timeout=max(0.1, 8.0 - (time.monotonic() - left_at)))


def test_past_full_pace_three_peers_stretch_their_periods_and_still_see_a_kill(swarm: LocalSwarm):
    """With ``full_pace_members`` 1, three peers run 4x the periods (the power of two at or above 3 / 1): their
    heartbeats live 4x the TTL and are sent 4x less often, and a kill is still seen by both others, its experts
    re-owned in both views."""
    timing = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=1.5, refresh_s=0.25, full_pace_members=1)
    peers = [swarm.add(i, shards=SHARDS, **timing) for i in range(3)]
    victim, rest = peers[2], peers[:2]
    wait_until(lambda: all(p.membership.timing.heartbeat_ttl_s == 6.0 for p in peers), timeout=15)
    assert all(p.membership.timing.refresh_s == 1.0 for p in peers)

    def stretched_record(p) -> bool:  # a heartbeat of the victim sent at 4x: over 1.5 s of life left when read
        view = p.membership.view()
        m = view.members.get(victim.fp)
        return m is not None and m.expires_at - view.read_at > 2.0

    wait_until(lambda: all(stretched_record(p) for p in rest), timeout=15)
    wait_until(lambda: _agreed_and_claimed(peers, gone="nobody"), timeout=15)
    victim.kill()
    victim.membership.abandon(wait=False)
    wait_until(lambda: all(victim.fp not in p.membership.view().alive() for p in rest), timeout=15)
    wait_until(lambda: _agreed_and_claimed(rest, gone=victim.fp), timeout=15)


def test_past_full_pace_heartbeats_live_in_the_members_keys_parts_and_a_record_out_of_its_part_is_skipped(
        swarm: LocalSwarm):
    """With ``full_pace_members`` 1, three peers stretch 4x and read the members key in 4 parts (level 2): each
    heartbeat is in its signer's part and in the whole key (level 0, what joiners and tools read); a signed
    heartbeat written into another identity's part is skipped by a reader of the parts; a leave is seen there."""
    timing = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=1.5, refresh_s=0.25, full_pace_members=1)
    peers = [swarm.add(i, shards=SHARDS, **timing) for i in range(3)]
    fps = {p.fp for p in peers}
    wait_until(lambda: all(p.membership.level == 2 and set(p.membership.view().alive()) == fps for p in peers),
               timeout=15)
    reader = peers[0].dht
    found: dict[str, dict[object, tuple[object, float]]] = {}

    def every_part_holds_its_own() -> bool:
        read = reader.get_dicts([members_key(swarm.run_id), *members_keys(swarm.run_id, 2)], latest=True,
                                timeout_s=5)
        if read is None:
            return False
        found.update(read)
        whole = {fingerprint_of(sub) for sub in read[members_key(swarm.run_id)]}
        parts = {p.fp: [part for part in range(4)
                        if p.fp in {fingerprint_of(sub) for sub in read[members_key(swarm.run_id, 2, part)]}]
                 for p in peers}
        return fps <= whole and parts == {fp: [member_part(fp, 2)] for fp in fps}

    wait_until(every_part_holds_its_own, timeout=15)
    # An identity signs a heartbeat into a part that is not its own: stored (validly signed), never read.
    stray = fixed_identity(50)
    wrong = (member_part(stray.fingerprint, 2) + 1) % 4
    writer = swarm.add_dht(stray)
    beat = heartbeat_value(Heartbeat(peer_id=str(writer.dht.peer_id), addresses=(), role="composer", capacity=1.0,
                                     shards=(), step=0, sent=dht_time()))
    assert writer.dht.store(members_key(swarm.run_id, 2, wrong), owner_subkey(stray.public_key), beat,
                            dht_time() + 30, timeout_s=10)
    raw = reader.get_dicts([members_key(swarm.run_id, 2, wrong)], latest=True, timeout_s=5)
    assert raw is not None and stray.fingerprint in {fingerprint_of(sub) for sub in raw[members_key(swarm.run_id,
                                                                                                       2, wrong)]}
    view = read_view(reader, swarm.run_id, timeout_s=5, level=2)
    assert view is not None and set(view.alive()) == fps
    # A leave is seen by the others through the parts they read.
    leaver, rest = peers[2], peers[:2]
    assert leaver.membership.leave("done")
    wait_until(lambda: all(leaver.fp in p.membership.view().departed for p in rest), timeout=10)


def fingerprint_of(subkey: object) -> str | None:
    public_key = subkey_owner(subkey)
    return None if public_key is None else fingerprint(public_key)


def test_duplicate_identity_is_refused(swarm: LocalSwarm):
    first = swarm.add(0, heartbeat_period_s=0.5, heartbeat_ttl_s=1.5, refresh_s=0.25)
    twin = swarm.add_dht(fixed_identity(0))  # same Ed25519 key, another process and peer id
    m = Membership(twin.dht, twin.identity, Presence(run_id="itest"))
    with pytest.raises(DuplicateIdentityError, match="already alive"):
        m.start()
    assert first.membership.state is PeerState.ONLINE
    # Once the first leaves, the same identity may join again.
    first.membership.leave()
    m2 = Membership(twin.dht, twin.identity, Presence(run_id="itest"))
    twin.membership = m2
    m2.start()
    assert m2.state is PeerState.ONLINE


def test_a_phantom_whose_work_never_arrives_owns_nothing_after_the_grace_period(swarm: LocalSwarm):
    """Three composers heartbeat; the work of two reaches each other (as fetched contributions and applied
    surrogate updates report it), the third's never does: after ``idle_s`` the two own every expert between
    them, in both views, while the phantom's heartbeat stays alive."""
    timing = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=1.5, refresh_s=0.25, idle_s=3.0)
    a, b, phantom = (swarm.add(i, shards=SHARDS, **timing) for i in range(3))
    wait_until(lambda: all(len(p.membership.view().composers()) == 3 for p in (a, b)), timeout=10)
    assert phantom.fp in a.membership.view().assignment().peers  # within its grace period it owns experts

    def honest_only() -> bool:
        a.membership.worked(b.fp)
        b.membership.worked(a.fp)
        return all(set(p.membership.view().assignment().peers) == {a.fp, b.fp} for p in (a, b))

    waited = wait_until(honest_only, timeout=15, interval=0.2)
    assert waited >= 2.0  # not before the grace period
    assert phantom.fp in a.membership.view().alive()
    owners = {o for _, _, o, _ in a.membership.view().assignment().items()}
    assert owners == {a.fp, b.fp}


def test_eight_heartbeats_signed_once_cut_no_composer_off(swarm: LocalSwarm):
    """Three composers whose work reaches each other; eight fresh identities each sign one heartbeat (12 s TTL) and
    never another. Counted by heartbeats, once those expire the three are a minority of the eleven alive at once a
    moment ago and give up their experts within a heartbeat period (0.5 s); the quorum counts composers whose work
    arrived, so none is cut off."""
    timing = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=1.5, refresh_s=0.25, idle_s=120.0)
    honest = _working(swarm, 3, **timing)
    wait_until(lambda: all(len(p.membership.view().composers()) == 3 for p in honest), timeout=10)
    # One DHT peer writes the eight heartbeats in a row, within the TTL, each signed by its identity and naming a
    # peer id of its own.
    sybils = [fixed_identity(100 + i) for i in range(8)]
    writer = SwarmDHT.start(DHTConfig(initial_peers=tuple(honest[0].dht.visible_maddrs())), [ManyKeysValidator(sybils)])
    try:
        beats = {}
        for sybil in sybils:
            peer_id = PeerID(b"\x12\x20" + hashlib.sha256(sybil.public_key).digest())  # a sha2-256 multihash
            beats[sybil] = heartbeat_value(Heartbeat(peer_id=peer_id.to_base58(), addresses=(), role="composer",
                                                     capacity=1.0, shards=(), step=0, sent=dht_time()))
        _write(writer, swarm.run_id, beats, ttl_s=12.0)
        phantoms = {i.fingerprint for i in sybils}
        wait_until(lambda: all(phantoms <= set(p.membership.view().alive()) for p in honest), timeout=60)
        states = set()

        def phantoms_expired() -> bool:
            states.update(p.membership.view().quorum for p in honest)
            return not any(phantoms & set(p.membership.view().alive()) for p in honest)

        wait_until(phantoms_expired, timeout=60, interval=0.05)
        for _ in range(60):  # 3 s: six grace periods after they expired
            states |= {p.membership.view().quorum for p in honest}
            time.sleep(0.05)
        assert states == {QuorumState.HELD}, states
    finally:
        writer.shutdown()


def _working(swarm: LocalSwarm, n: int, **timing: float) -> list[LocalPeer]:
    """``n`` composers, each told of the others' work (as their fetched contributions would tell it)."""
    honest = [swarm.add(i, shards=SHARDS, **timing) for i in range(n)]
    for p in honest:
        for other in honest:
            p.membership.worked(other.fp)
    return honest


def _write(writer: SwarmDHT, run_id: str, beats: dict[Identity, bytes], *, ttl_s: float) -> None:
    """Store each identity's heartbeat in the run's members key, as an attacker would: a store that timed out (a
    loaded machine) is tried again."""
    pending = list(beats)
    for _ in range(3):
        pending = [i for i in pending if not writer.store(members_key(run_id), owner_subkey(i.public_key), beats[i],
                                                          dht_time() + ttl_s, timeout_s=10)]
    assert not pending, f"{len(pending)} of {len(beats)} heartbeats were not stored"


def test_a_flood_of_heartbeats_from_fresh_keys_stretches_no_honest_period_and_is_named(
        swarm: LocalSwarm, caplog: pytest.LogCaptureFixture):
    """Three composers whose work reaches each other and a peer writing 100 signed heartbeats from fresh keys: past
    ``full_pace_members`` (8) every honest node would stretch its periods 16x (the power of two at or above 103 / 8)
    and see a death 16x later. Only members whose work arrived set the pace: the three keep their periods, their
    views stay fresh, and the flood is named."""
    timing = dict(full_pace_members=8)
    honest = _working(swarm, 3, **timing)
    wait_until(lambda: all(len(p.membership.view().composers()) == 3 for p in honest), timeout=10)
    fresh = [Identity.from_seed((1000 + i).to_bytes(4, "big") * 8) for i in range(100)]
    flooder = SwarmDHT.start(DHTConfig(initial_peers=tuple(honest[0].dht.visible_maddrs())), [ManyKeysValidator(fresh)])
    try:
        beat = heartbeat_value(Heartbeat(peer_id=str(flooder.peer_id), addresses=(), role="composer", capacity=1.0,
                                         shards=(), step=0, sent=dht_time()))
        flood = {i.fingerprint for i in fresh}
        with caplog.at_level(logging.WARNING, logger="parallax.dht.membership"):
            _write(flooder, swarm.run_id, dict.fromkeys(fresh, beat), ttl_s=120.0)
            wait_until(lambda: all(flood <= set(p.membership.view().alive()) for p in honest), timeout=30)
            for p in honest:  # a read or two later: still at the pace of three, reading every refresh_s
                before = p.membership.view().read_at
                wait_until(lambda p=p, before=before: p.membership.view().read_at > before + 1.0, timeout=10)
                assert p.membership.stretch == 1 and p.membership.without_work == len(fresh)
                assert dht_time() - p.membership.view().read_at < 3 * p.membership.timing.refresh_s + 1.0
        assert any("composers heartbeat in this node's view without any of their work reaching it" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        flooder.shutdown()


def test_fresh_keys_that_heartbeat_into_a_working_swarm_own_nothing_until_their_work_arrives(swarm: LocalSwarm):
    """Three composers whose work reaches each other; a peer writes 40 signed heartbeats from fresh keys, announcing
    a moving step. Within their grace period they would take most experts (idle_s is 120 s here); first seen after
    work began, they take none: every honest view keeps the three's assignment, read after read. The one fresh key
    whose work then reaches the three counts at once."""
    timing = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=1.5, refresh_s=0.25, idle_s=120.0)
    honest = _working(swarm, 3, **timing)
    names = {p.fp for p in honest}
    wait_until(lambda: all(set(p.membership.view().composers()) == names for p in honest), timeout=10)
    # What each owns once the three settled together (one assignment, every expert claimed by its owners).
    wait_until(lambda: agreed([p.membership.view() for p in honest]), timeout=20)
    owned = [p.membership.owned() for p in honest]
    fresh = [Identity.from_seed((2000 + i).to_bytes(4, "big") * 8) for i in range(40)]
    flooder = SwarmDHT.start(DHTConfig(initial_peers=tuple(honest[0].dht.visible_maddrs())), [ManyKeysValidator(fresh)])
    try:
        flood = {i.fingerprint for i in fresh}
        for step in (50, 60):  # written twice, the second time with a step that moved
            beat = heartbeat_value(Heartbeat(peer_id=str(flooder.peer_id), addresses=(), role="composer",
                                             capacity=1.0, shards=(), step=step, sent=dht_time()))
            _write(flooder, swarm.run_id, dict.fromkeys(fresh, beat), ttl_s=60.0)
        wait_until(lambda: all(flood <= set(p.membership.view().alive()) for p in honest), timeout=30)
        for p in honest:  # two reads later, with the flood alive in them
            before = p.membership.view().read_at
            wait_until(lambda p=p, before=before: p.membership.view().read_at > before + 0.5, timeout=10)
        for p, had in zip(honest, owned, strict=True):
            view = p.membership.view()
            assert flood <= set(view.alive()) and set(view.composers()) == names
            assert set(view.assignment().peers) == names and p.membership.owned() == had
        shown = fresh[0].fingerprint
        for p in honest:
            p.membership.worked(shown)
        wait_until(lambda: all(set(p.membership.view().composers()) == names | {shown} for p in honest), timeout=10)
    finally:
        flooder.shutdown()


FLOOD_TIMING = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=1.5, refresh_s=0.25, idle_s=120.0)


@contextlib.contextmanager
def _three_working_and_a_flood(swarm: LocalSwarm, seed: int) -> Iterator[tuple[list[LocalPeer], set[str]]]:
    """Three composers whose work reaches each other, and 40 signed heartbeats from fresh keys (drawn from ``seed``)
    written once by a peer of their DHT, alive for 120 s: yields the three and the flood's fingerprints."""
    honest = _working(swarm, 3, **FLOOD_TIMING)
    fresh = [Identity.from_seed((seed + i).to_bytes(4, "big") * 8) for i in range(40)]
    flooder = SwarmDHT.start(DHTConfig(initial_peers=tuple(honest[0].dht.visible_maddrs())), [ManyKeysValidator(fresh)])
    try:
        beat = heartbeat_value(Heartbeat(peer_id=str(flooder.peer_id), addresses=(), role="composer", capacity=1.0,
                                         shards=(), step=50, sent=dht_time()))
        _write(flooder, swarm.run_id, dict.fromkeys(fresh, beat), ttl_s=120.0)
        yield honest, {i.fingerprint for i in fresh}
    finally:
        flooder.shutdown()


def test_a_joiner_counts_the_composers_the_records_vouch_for_not_a_flood_written_before_it_came(swarm: LocalSwarm):
    """Three composers whose work reaches each other; a peer writes 40 signed heartbeats from fresh keys; then a
    fourth composer starts. Its first read shows the flood beside the three, no work has reached it, and each
    would count for a grace period (``idle_s``, 120 s here): the flood would own most experts in its view and
    make up most of its round quorum. Once the rounds records of the peers that served it a group's state vouch
    for the three, its view counts them alone and holds its quorum."""
    with _three_working_and_a_flood(swarm, seed=3000) as (honest, flood):
        names = {p.fp for p in honest}
        joiner = swarm.add(3, shards=SHARDS, **FLOOD_TIMING)
        wait_until(lambda: flood | names <= set(joiner.membership.view().composers()), timeout=30)
        views = SwarmViews(joiner.membership, joiner.fp, snapshot_every=10, event=lambda *_, **__: None)
        views.vouched([str(p.dht.peer_id) for p in honest])  # as the rounds records name them: by peer id

        def counts_the_three() -> bool:
            view = joiner.membership.view()
            return flood <= set(view.alive()) and set(view.composers()) - {joiner.fp} == names

        wait_until(counts_the_three, timeout=10)
        view = joiner.membership.view()
        assert view.quorum is QuorumState.HELD and not flood & set(view.assignment().peers)
        joiner.membership.worked(honest[0].fp)
        joiner.membership.vouched(flood)  # once work arrived, the node judges by it, not by the records' word
        before = joiner.membership.view().read_at
        wait_until(lambda: joiner.membership.view().read_at > before + 0.5, timeout=10)
        assert set(joiner.membership.view().composers()) - {joiner.fp} == names


def test_a_node_resuming_its_checkpoint_counts_the_composers_it_names_not_a_flood_written_while_it_was_away(
        swarm: LocalSwarm):
    """Three composers whose work reaches each other; a peer writes 40 signed heartbeats from fresh keys; then a
    fourth composer resumes a checkpoint that names the three as having worked. It downloads no state and reads no
    rounds records, and no work has reached it: without its checkpoint's word every identity in its first read
    would count for a grace period (``idle_s``, 120 s here). It counts the three alone from its first read."""
    with _three_working_and_a_flood(swarm, seed=4000) as (honest, flood):
        names = {p.fp for p in honest}
        resumed = swarm.add(3, shards=SHARDS, remember=names, **FLOOD_TIMING)
        wait_until(lambda: flood | names <= set(resumed.membership.view().alive()), timeout=30)
        view = resumed.membership.view()
        assert set(view.composers()) - {resumed.fp} == names and view.quorum is QuorumState.HELD
        assert not flood & set(view.assignment().peers) and resumed.membership.without_work >= len(flood)


def test_a_composer_this_node_bans_owns_nothing_in_its_view(swarm: LocalSwarm):
    timing = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=1.5, refresh_s=0.25)
    a, b, liar = (swarm.add(i, shards=SHARDS, **timing) for i in range(3))
    wait_until(lambda: all(len(p.membership.view().composers()) == 3 for p in (a, b)), timeout=10)
    liar_peer = str(liar.dht.peer_id)
    a.membership.ignored = lambda fp, view: view.members[fp].heartbeat.peer_id == liar_peer
    wait_until(lambda: set(a.membership.view().assignment().peers) == {a.fp, b.fp}, timeout=5)
    assert liar.fp in b.membership.view().assignment().peers  # bans are each node's own


def test_a_peers_dht_calls_are_counted_with_the_bytes_of_their_records(swarm: LocalSwarm):
    """What ``parallax bench scale`` reads: each read of the members key brings every live heartbeat back."""
    peers = [swarm.add(i, shards=SHARDS) for i in range(3)]
    wait_until(lambda: all(len(p.membership.view().alive()) == 3 for p in peers), timeout=5)
    calls = peers[0].dht.calls
    stores, reads, read = calls.stores, calls.reads, calls.bytes_read
    wait_until(lambda: calls.stores > stores and calls.reads > reads + 4, timeout=10)
    # A signed heartbeat is over 64 bytes (its signature alone), and every read of the view returns three.
    assert calls.bytes_read - read >= 3 * 64 * (calls.reads - reads) // (1 + SHARDS.n_layers)
    assert calls.bytes_stored > 64 * calls.stores


def test_a_read_that_timed_out_goes_on_and_the_next_read_of_its_keys_waits_for_it(swarm: LocalSwarm):
    # A host too loaded to answer within the timeout: the DHT process stopped (SIGSTOP) while readers ask again.
    a, b = (swarm.add(i, shards=SHARDS) for i in range(2))
    wait_until(lambda: len(a.membership.view().alive()) == 2, timeout=10)
    a.membership.abandon()  # its reader would join the reads below
    keys = [members_key(swarm.run_id)]
    calls = a.dht.calls
    reads, joined = calls.reads, calls.joined
    os.kill(a.dht.process_ids[0], signal.SIGSTOP)
    try:
        sent = time.monotonic()
        assert all(a.dht.get_dicts(keys, latest=True, timeout_s=0.2) is None for _ in range(3))
        assert calls.joined - joined == 2  # one read sent, two callers waiting on it
        late: list[tuple[object, float]] = []  # (the answer, when it returned)
        waiting = threading.Thread(target=lambda: late.append((a.dht.get_dicts(keys, latest=True, timeout_s=30),
                                                               time.monotonic())))
        asked = time.monotonic()
        waiting.start()
        wait_until(lambda: calls.joined - joined == 3, timeout=5)
    finally:
        os.kill(a.dht.process_ids[0], signal.SIGCONT)
    waiting.join(30)
    assert late
    answer, returned = late[0]
    assert {fingerprint(subkey_owner(s)) for s in answer[keys[0]]} == {a.fp, b.fp}  # type: ignore[index]
    # The answer is as old as the read it joined, sent before the last caller asked (a view of it is of that time).
    assert returned - asked < answer.age_s <= returned - sent  # type: ignore[attr-defined]
    wait_until(lambda: calls.reads == reads + 1, timeout=10)  # the one read, counted once
    assert not a.dht._running and not a.dht._read_sent


def test_a_heartbeat_that_takes_long_to_land_lives_its_ttl_once_stored(swarm: LocalSwarm):
    timing = dict(heartbeat_period_s=0.5, heartbeat_ttl_s=3.0, refresh_s=0.25)
    slow, reader = (swarm.add(i, **timing) for i in range(2))
    wait_until(lambda: slow.fp in reader.membership.view().alive(), timeout=10)
    os.kill(slow.dht.process_ids[0], signal.SIGSTOP)  # a loaded host: its stores take 1.5 s more
    try:
        time.sleep(1.5)  # the input: how long the DHT process does not answer
    finally:
        os.kill(slow.dht.process_ids[0], signal.SIGCONT)

    def lived() -> float:
        view = reader.membership.view()
        member = view.members.get(slow.fp)
        return view.record_expiry.get(slow.fp, 0.0) - member.heartbeat.sent if member else 0.0

    wait_until(lambda: lived() > 3.0 + 1.0, timeout=10, explain=lambda: f"lived {lived():.2f} s")
    assert slow.membership.store_lag_s <= 3.0
    # Once stores are fast again, the lag decays and heartbeats live their TTL again.
    wait_until(lambda: slow.membership.store_lag_s < 0.5 and lived() < 3.0 + 0.5, timeout=15,
               explain=lambda: f"lag {slow.membership.store_lag_s:.2f} s, lived {lived():.2f} s")


def test_a_store_waits_for_the_previous_one_of_its_record_and_a_forced_one_goes_at_once(swarm: LocalSwarm):
    a, b = (swarm.add(i, shards=SHARDS) for i in range(2))
    a.membership.abandon()
    key, subkey = members_key(swarm.run_id) + "/test", owner_subkey(a.identity.public_key)
    calls = a.dht.calls
    os.kill(a.dht.process_ids[0], signal.SIGSTOP)  # a host too loaded to answer in time
    try:
        stores = calls.stores
        assert not a.dht.store(key, subkey, b"first", dht_time() + 30, timeout_s=0.2)
        assert calls.stores == stores + 1  # sent, still running in the DHT process
        assert not a.dht.store(key, subkey, b"second", dht_time() + 31, timeout_s=0.2)
        assert calls.stores == stores + 1  # not sent: the first has not ended
        assert not a.dht.store(key, subkey, b"last word", dht_time() + 32, timeout_s=0.2, force=True)
        assert calls.stores == stores + 2  # a forced one goes at once
    finally:
        os.kill(a.dht.process_ids[0], signal.SIGCONT)
    assert a.dht.store(key, subkey, b"third", dht_time() + 33, timeout_s=10)  # sent once the first ended
    assert calls.stores == stores + 3
    wait_until(lambda: not a.dht._running, timeout=10)
