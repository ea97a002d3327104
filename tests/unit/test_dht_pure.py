"""Pure parts of dht/: initial-peer parsing, keys, claim records and their validity, view parsing."""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest

from parallax.dht import adapter
from parallax.dht.adapter import Answer, DHTConfig, join_command, p2p_identity_path, parse_initial_peers
from parallax.dht.claims import ClaimSet, ShardConfig, build_claim_set, release_all, valid_claims
from parallax.dht.keys import (
    MEMBER_LEVELS,
    claims_key,
    expert_id,
    member_part,
    members_key,
    members_keys,
    parse_expert_id,
    protected_keys,
)
from parallax.dht.manifests import (
    ManifestChoiceError,
    Published,
    choose_manifest,
    manifest_difference,
    settings_difference,
)
from parallax.dht.membership import (
    IDLE_STRETCH,
    Member,
    Membership,
    MembershipConfig,
    Presence,
    Progress,
    Quorum,
    QuorumState,
    SwarmView,
    heartbeat_value,
    majority_heard_until,
    majority_until,
    merge_views,
    parse_members,
    read_view,
    split_by_run,
)
from parallax.dht.records import MAX_RECORD_BYTES, owner_subkey, pack_message, subkey_owner, unpack_message
from parallax.dht.shards import assign_experts
from parallax.errors import DHTError
from parallax.node.config.train import OptimConfig, TrainConfig, run_settings
from parallax.protocol import manifest as manifests
from parallax.protocol.errors import RemoteProtocolError
from parallax.protocol.identity import Identity, fingerprint
from parallax.protocol.messages import Deathrattle, Heartbeat, ShardClaim, ShardRelease

CORPUS = manifests.corpus_digest(b"a corpus")  # the manifests' corpus term

PEER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWAQJufR1qkp5iYZfUv6bGSLnHSkcsZJ63uJhvVyMz1q8f"


def test_initial_peers_are_validated_with_clear_errors():
    assert parse_initial_peers([PEER]) == [PEER]
    assert parse_initial_peers([f"{PEER}, {PEER}"]) == [PEER, PEER]
    cases = {
        "ip4/1.2.3.4/tcp/1": "must start with '/'",
        "/ip4/300.1.1.1/tcp/1/p2p/x": "malformed",
        "/ip4/1.2.3.4/tcpx/1": "unknown protocol: tcpx",
        "/ip4/127.0.0.1/tcp/4001": "lacks the /p2p/<peer id>",
        "/ip4/1.2.3.4/tcp/1/p2p/notapeer": "notapeer",
    }
    for text, message in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            parse_initial_peers([text])
        assert text in str(e.value)
    with pytest.raises(ValueError, match="initial peer"):
        DHTConfig(initial_peers=("/ip4/127.0.0.1/tcp/4001",))


def test_join_line_and_identity_path(tmp_path):
    assert join_command([PEER]) == f"--initial-peers {PEER}"
    assert p2p_identity_path(tmp_path / "node.key") == tmp_path / "node.key.p2p"


def test_keys_are_run_namespaced():
    assert members_key("r1") == "r1/members" and claims_key("r1", 3) == "r1/claims/3"
    keys = protected_keys("r1", 2, ["router"])
    parts = [f"r1/members/{level}/{part}" for level in range(1, MEMBER_LEVELS + 1) for part in range(1 << level)]
    assert keys == ["r1/manifest", "r1/members", *parts, "r1/claims/0", "r1/claims/1", "r1/surrogates/0",
                    "r1/surrogates/1", "r1/outer/router/rounds"]
    assert parse_expert_id(expert_id(3, 7)) == (3, 7)
    for bad in ["", "a/b", "-x", "x" * 65]:
        with pytest.raises(ValueError, match="run id"):
            members_key(bad)
    with pytest.raises(ValueError):
        parse_expert_id("expert.1")


def test_the_members_keys_parts_split_identities_evenly_by_the_prefix_of_their_fingerprint():
    assert members_keys("r1", 0) == ["r1/members"] and members_key("r1", 3, 5) == "r1/members/3/5"
    assert len(members_keys("r1", 2)) == 4
    for level, part in [(-1, 0), (MEMBER_LEVELS + 1, 0), (2, 4), (2, -1)]:
        with pytest.raises(ValueError, match="members part"):
            members_key("r1", level, part)
    fps = [Identity.generate().fingerprint for _ in range(2000)]
    for fp in fps[:50]:  # a part at one level is the half of its part one level up
        assert member_part(fp, 0) == 0
        assert all(member_part(fp, level + 1) >> 1 == member_part(fp, level) for level in range(MEMBER_LEVELS))
    counts = collections.Counter(member_part(fp, 3) for fp in fps)
    assert sorted(counts) == list(range(8)) and max(counts.values()) < 2 * min(counts.values())
    with pytest.raises(ValueError, match="fingerprint"):
        member_part("AB!", 2)


def test_a_node_writes_its_heartbeat_where_every_reader_within_one_and_a_half_times_its_count_reads():
    config = MembershipConfig()
    assert [config.level(n) for n in (1, 32, 33, 64, 65, 1000, 10**6)] == [0, 0, 1, 1, 2, 5, MEMBER_LEVELS]
    assert config.write_levels(21) == {0} and config.write_levels(22) == {0, 1}  # 22 x 1.5 reads in 2 parts
    assert config.write_levels(1000) == {0, 5, 6} and MembershipConfig(full_pace_members=0).write_levels(10**6) == {0}
    for writer in range(1, 3000, 7):
        for reader in range(math.ceil(writer / 1.5), int(writer * 1.5) + 1):
            assert config.level(reader) in config.write_levels(writer), (writer, reader)


def test_a_swarm_past_full_pace_stretches_every_period_by_a_power_of_two():
    config = MembershipConfig()
    assert [config.stretch(n) for n in (1, 32, 33, 64, 65, 256, 1000)] == [1, 1, 2, 2, 4, 8, 32]
    assert config.paced(32) is config and MembershipConfig(full_pace_members=0).stretch(10**6) == 1
    paced = config.paced(1000)
    assert (paced.refresh_s, paced.heartbeat_period_s, paced.heartbeat_ttl_s) == (16.0, 64.0, 192.0)
    assert (paced.stall_s, paced.quorum_window_s) == (3840.0, 1920.0)
    assert paced.idle_s == 384.0 and config.paced(64).idle_s == 300.0  # work's rule only outgrows the TTL
    assert paced.request_timeout_s == config.request_timeout_s
    # What a node reads per second (members / refresh_s) stays between half and all of a full-paced swarm's.
    full = config.full_pace_members / config.refresh_s
    assert all(full / 2 < n / config.paced(n).refresh_s <= full for n in range(33, 5000))
    # Views that differ by up to 4x in size: a reader re-reads before any writer's heartbeat expires.
    for writer in (1, 33, 65, 129, 1000):
        for reader in range(max(1, writer // 4), writer * 4 + 1):
            w, r = config.paced(writer), config.paced(reader)
            assert r.refresh_s < w.heartbeat_ttl_s - w.heartbeat_period_s, (writer, reader)


def test_config_errors_say_what_to_do():
    with pytest.raises(ValueError, match="heartbeat_period_s < heartbeat_ttl_s"):
        MembershipConfig(heartbeat_period_s=6, heartbeat_ttl_s=6)
    with pytest.raises(ValueError, match="full_pace_members"):
        MembershipConfig(full_pace_members=-1)
    with pytest.raises(ValueError, match="role"):
        Presence(run_id="r", role="boss")


PEERS = {"aaa": 1.0, "bbb": 1.0, "ccc": 1.0}


def test_claim_records_round_trip_and_are_checked():
    a = assign_experts("r", 2, 8, PEERS)
    cs = build_claim_set(a, 0, a.owned_by("aaa")[0], previously_claimed={0, 1, 2, 3, 4, 5, 6, 7}, now=100.0,
                         lease_s=6.0)
    assert {c.expert for c in cs.claims} == a.owned_by("aaa")[0]
    assert {r.expert for r in cs.releases} == set(range(8)) - a.owned_by("aaa")[0]
    assert all(r.heir == a.owner(0, r.expert) for r in cs.releases)
    assert ClaimSet.decode(cs.encode(), layer=0) == cs
    with pytest.raises(RemoteProtocolError, match="another layer"):
        ClaimSet.decode(cs.encode(), layer=1)
    twice = ClaimSet((ShardClaim(layer=0, expert=1, lease_expiry=5.0),) * 2).encode()
    with pytest.raises(RemoteProtocolError, match="twice"):
        ClaimSet.decode(twice, layer=0)
    for junk in [b"", b"\x01", 3]:
        with pytest.raises(RemoteProtocolError):
            ClaimSet.decode(junk, layer=0)


def test_claim_valid_only_while_lease_record_and_heartbeat_are():
    a = assign_experts("r", 1, 8, PEERS)
    records = {0: {}}
    for p in PEERS:
        records[0][p] = (build_claim_set(a, 0, a.owned_by(p).get(0, frozenset()), (), now=100.0, lease_s=6.0), 106.0)
    everyone = valid_claims(records, set(PEERS), 101.0, a)
    holders = {s: tuple(c.holder for c in cs) for s, cs in everyone.items()}
    assert holders == {(0, e): (a.owner(0, e),) for e in range(8)}
    assert valid_claims(records, set(PEERS), 106.5, a) == {}  # lease over
    no_b = valid_claims(records, {"aaa", "ccc"}, 101.0, a)  # bbb's heartbeat died
    assert all(cs[0].holder != "bbb" for cs in no_b.values()) and len(no_b) == 8 - len(a.owned_by("bbb")[0])


def test_handover_conflict_resolved_by_assignment_everywhere():
    a = assign_experts("r", 1, 8, PEERS)
    e = min(a.owned_by("bbb")[0])
    records = {0: {
        "aaa": (ClaimSet((ShardClaim(layer=0, expert=e, lease_expiry=110.0),)), 110.0),
        "bbb": (ClaimSet((ShardClaim(layer=0, expert=e, lease_expiry=110.0),)), 110.0),
    }}
    assert [c.holder for c in valid_claims(records, set(PEERS), 101.0, a)[(0, e)]] == ["bbb"]


def test_an_expert_with_two_owners_has_both_claims_and_a_third_claimant_is_left_out():
    a = assign_experts("r", 1, 8, PEERS, replicas=2)
    records = {0: {p: (build_claim_set(a, 0, a.owned_by(p).get(0, frozenset()), (), now=100.0, lease_s=6.0), 106.0)
                   for p in PEERS}}
    found = valid_claims(records, set(PEERS), 101.0, a)
    assert {s: tuple(c.holder for c in cs) for s, cs in found.items()} == {(0, e): a.owners_of(0, e) for e in range(8)}
    e = next(e for e in range(8) if "aaa" not in a.owners_of(0, e))
    records[0]["aaa"] = (ClaimSet((ShardClaim(layer=0, expert=e, lease_expiry=110.0),)), 110.0)
    assert [c.holder for c in valid_claims(records, set(PEERS), 101.0, a)[(0, e)]] == list(a.owners_of(0, e))
    # One owner dead: its co-owner's claim stays, and the third claimant's counts while the assignment lags.
    dead = a.owner(0, e)
    left = [c.holder for c in valid_claims(records, set(PEERS) - {dead}, 101.0, a)[(0, e)]]
    assert left == [a.owners_of(0, e)[1], "aaa"]


def test_with_two_replicas_the_heir_is_the_live_co_owner_and_nobody_keeps_snapshots():
    a = assign_experts("r", 2, 6, PEERS, replicas=2)
    assert a.replicas == 2
    for layer, e, owner, heir in a.items():
        assert heir == a.owners_of(layer, e)[1] and heir != owner
    assert all(a.inherited_by(p) == {} for p in PEERS)
    assert sum(a.load().values()) == 2 * 2 * 6
    single = assign_experts("r", 2, 6, PEERS)
    assert single.replicas == 1 and all(single.owners_of(layer, e) == (single.owner(layer, e),)
                                        for layer in range(2) for e in range(6))


def test_release_all_names_heirs():
    a = assign_experts("r", 1, 8, PEERS)
    mine = a.owned_by("aaa")
    out = release_all(mine, a, "aaa")
    assert all(isinstance(r, ShardRelease) and r.heir == a.heir(0, r.expert) for r in out[0].releases)


def test_view_parsing_skips_bad_entries_and_tracks_deathrattles():
    alice, bob = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)
    hb = Heartbeat(peer_id="12D3KooWa", addresses=(), role="composer", capacity=2.0, shards=(), step=1)
    raw = {
        owner_subkey(alice.public_key): (pack_message(hb), 200.0),
        owner_subkey(bob.public_key): (pack_message(Deathrattle(peer_id="12D3KooWb", step=9)), 200.0),
        b"junk": (b"x", 200.0),
        owner_subkey(Identity.from_seed(b"c" * 32).public_key): (b"\xff garbage", 200.0),
    }
    members, departed = parse_members(raw)
    assert set(members) == {alice.fingerprint} and set(departed) == {bob.fingerprint}
    view = SwarmView(run_id="r", read_at=100.0, members=members, departed=departed)
    assert view.composers(150.0) == {alice.fingerprint: 2.0}
    assert view.alive(200.0) == {}


def test_a_read_that_misses_a_live_heartbeat_does_not_kill_its_node():
    alice, bob = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)

    def hb(step: int) -> bytes:
        return pack_message(Heartbeat(peer_id="12D3KooWa", addresses=(), role="composer", capacity=1.0, shards=(),
                                      step=step))

    def view(read_at: float, raw: dict) -> SwarmView:
        members, departed = parse_members(raw)
        expiry = {fingerprint(subkey_owner(k)): e for k, (_, e) in raw.items()}
        return SwarmView(run_id="r", read_at=read_at, members=members, departed=departed, record_expiry=expiry)

    a, b = owner_subkey(alice.public_key), owner_subkey(bob.public_key)
    first = view(100.0, {a: (hb(1), 106.0), b: (hb(1), 105.0)})
    second = merge_views(first, view(101.0, {a: (hb(2), 107.0)}))  # this read missed bob's heartbeat
    assert set(second.alive(102.0)) == {alice.fingerprint, bob.fingerprint}
    assert second.members[alice.fingerprint].heartbeat.step == 2  # the newer record wins
    assert set(second.alive(105.5)) == {alice.fingerprint}  # ... and bob's last one still expires on time
    gone = merge_views(second, view(102.0, {a: (hb(2), 107.0),
                                            b: (pack_message(Deathrattle(peer_id="12D3KooWb", step=3)), 108.0)}))
    assert set(gone.alive(103.0)) == {alice.fingerprint} and bob.fingerprint in gone.departed
    later = merge_views(gone, view(103.0, {a: (hb(3), 109.0), b: (hb(1), 105.0)}))  # a stale replica answers
    assert bob.fingerprint in later.departed and bob.fingerprint not in later.alive(104.0)
    assert merge_views(later, view(200.0, {})).members == {}  # expired records are not carried on


class _SlowReads:
    """A DHT whose reads of the members key take ``read_s`` of the test's clock and answer ``answer`` (None: the read
    fails); stores are accepted. Only what ``read_view`` and ``Membership`` ask of a ``SwarmDHT``."""

    peer_id = "12D3KooWreader"

    def __init__(self, clock: list[float], read_s: float) -> None:
        self.clock, self.read_s = clock, read_s
        self.answer: dict | None = {}

    def get_dicts(self, keys, latest: bool, timeout_s: float):
        self.clock[0] += self.read_s
        if self.answer is None:
            return None
        out = Answer({k: dict(self.answer) if k == keys[0] else {} for k in keys})
        out.age_s = self.read_s + self.joined_s
        return out

    joined_s = 0.0
    """How long the read a call joins had been running when the call came (``SwarmDHT.get_dicts``)."""

    stores_ok = True
    """Whether stores succeed (``store_many``: every key stored, or none)."""
    store_s = 0.0
    """How long a store takes, of the test's clock; ``during_store`` is called half-way through it."""
    during_store = None

    def store_many(self, keys, subkey, value, expiration, *, timeout_s: float, **_kwargs):
        self.clock[0] += self.store_s / 2
        if self.during_store is not None:
            self.during_store()
        self.clock[0] += self.store_s / 2
        return {key: self.stores_ok for key in keys}

    def relayed_maddrs(self) -> list[str]:
        return []

    def visible_maddrs(self) -> list[str]:
        return ["/ip4/127.0.0.1/tcp/1"]


def test_a_member_whose_heartbeat_falls_due_while_a_slow_read_runs_stays_alive_in_its_view():
    """A view is what the swarm held when its read began: a heartbeat that expires during a read of 3 s (a loaded
    host) was current then, and only the next read can tell a newer one from none."""
    alice = Identity.from_seed(b"a" * 32)
    hb = Heartbeat(peer_id="12D3KooWa", addresses=(), role="composer", capacity=1.0, shards=(), step=1)
    clock = [100.0]
    dht = _SlowReads(clock, read_s=3.0)
    dht.answer = {owner_subkey(alice.public_key): (heartbeat_value(hb), 101.5)}
    view = read_view(dht, "r", timeout_s=5.0, clock=lambda: clock[0])
    assert view is not None and view.read_at == 100.0 and clock[0] == 103.0
    assert set(view.alive()) == {alice.fingerprint}
    assert view.alive(103.0) == {}  # judged at the read's end, it would have dropped a live member
    dht.joined_s = 2.0  # a call that joins a read sent 2 s before it: the view is of that read's start
    view = read_view(dht, "r", timeout_s=5.0, clock=lambda: clock[0])
    assert view is not None and view.read_at == 101.0 and clock[0] == 106.0


def test_a_node_whose_reads_fail_keeps_its_view_judged_at_most_a_ttl_ago():
    """While reads fail (or the reader stalls), the last view stands, but not for ever: a member whose last heartbeat
    expired more than a TTL ago drops out of it; one that expired since is kept."""
    me, alice, bob = (Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3))
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    m = Membership(dht, me, Presence(run_id="r"), clock=lambda: clock[0])  # type: ignore[arg-type]
    hb = Heartbeat(peer_id="12D3KooWa", addresses=(), role="composer", capacity=1.0, shards=(), step=1)
    dht.answer = {owner_subkey(alice.public_key): (heartbeat_value(hb), 103.0),
                  owner_subkey(bob.public_key): (heartbeat_value(hb), 110.0)}
    assert m._refresh() and m.view().read_at == 100.0 and m.read_s >= 0.0
    dht.answer = None
    clock[0] = 104.0  # 3.9 s later, under a TTL: the view is kept as read
    assert not m._refresh() and m.view().read_at == 100.0 and len(m.view().alive()) == 2
    clock[0] = 111.0  # reads failed for over a TTL (6 s): judged at 111.1 - 6, the read's time kept
    assert not m._refresh() and m.view().read_at == 100.0 and m.view().judged_at == pytest.approx(105.1)
    assert set(m.view().alive()) == {bob.fingerprint}


def test_a_node_is_cut_off_a_grace_after_the_heartbeats_that_kept_its_side_half_of_the_swarm_expired(caplog):
    """A side cut off by a partition learns it from reads that then wait out their timeouts. Its quorum's grace is
    counted from the expiry that left it short, as the heartbeats it read give it, not from the read that showed it,
    and it is cut off when it looks past that, not at its next read's end. Reads that fail prove nothing: the view
    stands. A read that shows the others again brings it back."""
    me, *others = (Identity.from_seed(bytes([c]) * 32) for c in b"mabc")
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    m = Membership(dht, me, Presence(run_id="r"), clock=lambda: clock[0])  # type: ignore[arg-type]
    beats = {owner_subkey(i.public_key): (_beat(1), 106.0 + k) for k, i in enumerate([me, *others])}
    dht.answer = dict(beats)
    assert m._refresh() and m.view().quorum is QuorumState.HELD and m.view().short_since == math.inf
    dht.answer = None
    clock[0] = 112.0  # the others' heartbeats all expired (the last at 109), but no read says so
    assert not m._refresh() and m.view().quorum is QuorumState.HELD
    dht.answer = {owner_subkey(me.public_key): (_beat(1), 118.0)}  # a read that finds this node's own alone
    assert m._refresh() and m.view().short_since == 109.0  # two of four (this node and the last other) until then
    with caplog.at_level("WARNING", logger="parallax.dht.membership"):
        assert m.view().quorum is QuorumState.LOST and m.view().quorum is QuorumState.LOST  # 3 s past: > the 2 s grace
    assert caplog.text.count("cut off from the swarm") == 1, caplog.text  # said once
    dht.answer = {key: (value, 125.0) for key, (value, _) in beats.items()}
    with caplog.at_level("WARNING", logger="parallax.dht.membership"):
        assert m._refresh() and m.view().quorum is QuorumState.HELD and m.view().short_since == math.inf
    assert "back in the swarm's majority" in caplog.text
    # Short again: within the grace of the expiry the side doubts, past it it is cut off without another read.
    dht.answer = {owner_subkey(me.public_key): (_beat(1), 135.0)}
    clock[0] = 126.0
    assert m._refresh() and m.view().quorum is QuorumState.DOUBT and m.view().short_since == 125.0
    clock[0] = 127.5
    assert m.view().quorum is QuorumState.LOST


def test_a_node_whose_reads_fail_is_unconfirmed_once_the_heartbeats_that_kept_its_side_half_expired():
    """Failed reads decide nothing about the quorum, but they stop confirming it: once the heartbeats that kept its
    side half of the swarm expired, the node cannot tell a cut from slow reads (the others may have taken its
    experts), until a read tells."""
    me, *others = (Identity.from_seed(bytes([c]) * 32) for c in b"mabc")
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    m = Membership(dht, me, Presence(run_id="r"), clock=lambda: clock[0])  # type: ignore[arg-type]
    assert m.confirmed()  # nothing read yet: nothing to doubt
    beats = {owner_subkey(i.public_key): (_beat(1), 106.0 + k) for k, i in enumerate([me, *others])}
    dht.answer = dict(beats)
    assert m._refresh() and m.confirmed()
    dht.answer = None
    clock[0] = 108.9  # half of four (this node and the last other) until 109
    assert not m._refresh() and m.confirmed()
    clock[0] = 109.1
    assert not m._refresh() and not m.confirmed() and m.view().quorum is QuorumState.HELD
    dht.answer = {key: (value, 120.0) for key, (value, _) in beats.items()}
    assert m._refresh() and m.confirmed()


def test_answers_from_half_of_the_swarm_confirm_a_node_whose_reads_are_slow_while_its_heartbeat_keeps_it_alive():
    """On a loaded host reads come late, and holding the experts until one does loses their training. Answers that
    came from half of the swarm themselves (contributions fetched from their senders, rounds records they answered)
    show which side of any cut the node was on then; the others count it alive until its last heartbeat stored
    before them expires. So it trains on until that expiry, and holds its experts past it like a node without
    answers. Work that any holder may relay (surrogate updates) confirms nothing, nor do answers from composers a read
    that showed its side short counted out."""
    me, *others = (Identity.from_seed(bytes([c]) * 32) for c in b"mabc")
    a, b, c = (i.fingerprint for i in others)
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    m = Membership(dht, me, Presence(run_id="r"), clock=lambda: clock[0])  # type: ignore[arg-type]
    for fp in (a, b, c):
        m.worked(fp)  # the quorum counts the composers whose work arrived
    beats = {owner_subkey(i.public_key): (_beat(1), 106.0) for i in [me, *others]}
    dht.answer = dict(beats)
    assert m._refresh() and m.confirmed()
    assert m._send_heartbeat()  # sent at 100.1 (TTL 6 s): the others count this node alive until 106.1
    dht.answer = None
    clock[0] = 103.0
    m.worked(b)  # a surrogate update: any holder may have served it
    m.heard(a)  # this node and one other: half of four
    clock[0] = 107.0  # the heartbeats of the last read expired at 106
    assert not m._refresh() and not m.confirmed()  # its heartbeat stored before 103 expired at 106.1
    dht.store_s, dht.during_store = 0.4, lambda: m.heard(c)
    assert m._send_heartbeat()  # sent at 107.1, its store returned at 107.5; c answered at 107.3, meanwhile
    dht.store_s, dht.during_store = 0.0, None
    clock[0] = 108.0
    assert not m.confirmed()  # an answer before its store returned shows nothing of it: c's counts the one of 100.1
    m.worked(c)
    assert not m.confirmed()  # work that arrived is not an answer from its author
    m.heard(b)
    assert m.confirmed()  # b answered at 108, after the heartbeat whose store returned at 107.5
    clock[0] = 113.0
    assert m.confirmed()  # that heartbeat, sent at 107.1, lives until 113.1
    clock[0] = 113.2  # past 107.1 + 6
    assert not m.confirmed()
    dht.stores_ok = False
    assert not m._send_heartbeat()  # a heartbeat that did not store keeps nobody's view of this node alive
    m.heard(c)
    assert not m.confirmed()
    dht.stores_ok = True
    dht.answer = {owner_subkey(me.public_key): (_beat(1), 125.0)}  # a read that finds this node's own alone
    assert m._send_heartbeat() and m._refresh() and not m.confirmed()
    clock[0] = 114.0
    m.heard(a)
    assert not m.confirmed()  # the read counted the others out: their answers make no half of it
    dht.answer = {key: (value, 125.0) for key, (value, _) in beats.items()}
    assert m._refresh() and m.confirmed()  # a read that shows the others


def test_the_answers_that_confirm_a_side_come_from_half_of_the_most_composers_seen():
    me, stored = "m", [(100.0, 106.0), (102.0, 108.0), (104.0, 116.0)]
    heard = {"a": 101.0, "b": 103.0, "c": 105.0}
    alive = ["m", "a", "b", "c"]
    assert majority_heard_until(heard, alive, me, 4, stored) == 116.0  # half of four: me and c, at 105: 104's
    assert majority_heard_until(heard, alive, me, 6, stored) == 108.0  # three of six: at 103, the one of 102
    assert majority_heard_until(heard, alive, me, 8, stored) == 106.0  # four of eight: at 101, the one of 100
    assert majority_heard_until(heard, alive, me, 9, stored) == -math.inf  # five of nine: four counted
    assert majority_heard_until({"a": 99.0}, ["m", "a"], me, 4, stored) == -math.inf  # no heartbeat stored by then
    assert majority_heard_until(heard, ["m", "x"], me, 4, stored) == -math.inf  # none of the others counted answered
    assert majority_heard_until({"x": 105.0}, ["m", "a"], me, 4, stored) == -math.inf  # x is not counted
    # the latest expiry of those stored by then, whatever their order: a stretched heartbeat outlives a later one
    assert majority_heard_until(heard, alive, me, 4, [(104.0, 110.0), (100.0, 130.0)]) == 130.0
    assert majority_heard_until({}, ["m"], me, 1, stored) == math.inf  # this node alone is half of one
    assert majority_heard_until(heard, [], me, 4, stored) == math.inf  # nothing counted


def test_a_majority_lasts_until_half_of_the_most_composers_seen_are_past_their_expiry():
    me = "m"
    members = dict(_composer(i) for i in range(4))
    fps = sorted(members)
    ends = dict(zip(fps, (110.0, 120.0, 130.0, 140.0), strict=True))
    members = {fp: dataclasses.replace(m, expires_at=ends[fp]) for fp, m in members.items()}
    view = SwarmView(run_id="r", read_at=100.0, members=members, grace_s=1.5)
    assert majority_until(view, [*fps, me], me, 5, 6.0) == 131.5  # three of five: this node and the two latest
    assert majority_until(view, [*fps, me], me, 4, 6.0) == 141.5  # two of four
    assert majority_until(view, [fps[0], me], me, 6, 6.0) == -math.inf  # short now
    assert majority_until(view, [], me, 4, 6.0) == math.inf and majority_until(view, [me], me, 1, 6.0) == math.inf
    assert majority_until(view, ["unknown", me], me, 4, 6.0) == -math.inf  # a composer the view has no heartbeat of
    # A peer whose periods are stretched (a TTL of 12 s, sent at 100) counts for 8 s here, where a TTL is 6 s: the
    # others see this node's own heartbeat expire 6 s after its last one reached them.
    stretched = {fp: dataclasses.replace(m, expires_at=112.0, heartbeat=dataclasses.replace(m.heartbeat, sent=100.0))
                 for fp, m in members.items()}
    view = SwarmView(run_id="r", read_at=100.0, members=stretched)
    assert majority_until(view, [fps[0], me], me, 4, 6.0) == 108.0
    assert majority_until(view, [fps[0], me], me, 4, 12.0) == 112.0  # no longer than this node's own TTL


def test_a_node_whose_reads_are_slow_stretches_its_periods_and_keeps_full_pace_peers_in_its_view():
    """Reads slower than the refresh period double a node's periods (up to ``slow_read_stretch``), one median of
    eight reads at a time; quick reads halve them again. Stretched, a heartbeat counts for as long past its expiry as
    the node's reads come later than at full pace, so a peer announcing every 2 s with a 6 s TTL stays in view."""
    me, alice = Identity.from_seed(b"m" * 32), Identity.from_seed(b"a" * 32)
    clock = [100.0]
    dht = _SlowReads(clock, read_s=3.0)
    m = Membership(dht, me, Presence(run_id="r"), clock=lambda: clock[0])  # type: ignore[arg-type]
    hb = Heartbeat(peer_id="12D3KooWa", addresses=(), role="composer", capacity=1.0, shards=(), step=1)
    stretches = []
    for _ in range(40):
        dht.answer = {owner_subkey(alice.public_key): (heartbeat_value(hb), clock[0] + 6.0)}
        assert m._refresh()
        stretches.append(m.stretch)
    assert stretches[:7] == [1] * 7 and stretches[7:15] == [2] * 8 and stretches[15:23] == [4] * 8
    assert set(stretches[23:]) == {8}  # capped at slow_read_stretch
    assert m.timing.heartbeat_ttl_s == 48.0 and m.timing.refresh_s == 4.0 and m.view().grace_s == 3.5
    # The last heartbeat read expired 1 s before this read began: still alive, as the read came 3.5 s late.
    dht.answer = {}
    clock[0] += 4.0  # (the last read took 3 s of it)
    assert m._refresh() and alice.fingerprint in m.view().alive()
    # The next read begins as that one ends, 3 s later: 4 s after the expiry, past the grace: gone.
    assert m._refresh() and alice.fingerprint not in m.view().alive()
    dht.read_s = 0.1
    for _ in range(8 * 3):
        assert m._refresh()
    assert m.stretch == 1 and m.view().grace_s == 0.0 and m.timing == MembershipConfig()


def test_composers_of_another_manifest_are_left_out_and_the_difference_named():
    mine = run_settings(TrainConfig())
    theirs = run_settings(dataclasses.replace(TrainConfig(), optim=dataclasses.replace(OptimConfig(), lr=1e-3)))
    keys = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(5)]
    ours, other = (manifests.create(keys[0], "r", mine, corpus=CORPUS),
                   manifests.create(keys[1], "r", theirs, corpus=CORPUS))
    # Open runs: a manifest of the same settings signed by another composer has the same digest.
    assert manifests.create(keys[4], "r", mine, corpus=CORPUS).digest == ours.digest != other.digest

    def member(identity: Identity, role: str, run: bytes) -> tuple[str, Member]:
        hb = Heartbeat(peer_id="12D3KooWa", addresses=(), role=role, capacity=1.0, shards=(), step=0, run=run)
        return identity.fingerprint, Member(identity.fingerprint, identity.public_key, hb, 200.0)

    members = dict([member(keys[0], "composer", ours.digest), member(keys[1], "composer", other.digest),
                    member(keys[2], "worker", b""), member(keys[3], "composer", b"")])
    view, foreign = split_by_run(SwarmView(run_id="r", read_at=100.0, members=members), ours.digest)
    assert set(view.composers(150.0)) == {keys[0].fingerprint}  # the bare composer announces no manifest either
    assert set(foreign) == {keys[1].fingerprint, keys[3].fingerprint} and keys[2].fingerprint in view.members
    assert split_by_run(view, b"")[1] == {}  # a tool that only looks keeps everyone
    assert manifest_difference(ours, other) == "optim.lr = 0.003 here, 0.001 there"
    private = manifests.create(keys[0], "r", mine, admission="allowlist", corpus=CORPUS)
    assert manifest_difference(ours, private) == "admission open here, allowlist there"
    assert "allowlist of creator" in manifest_difference(private, manifests.create(
        keys[1], "r", mine, admission="allowlist", corpus=CORPUS))
    elsewhere = manifests.create(keys[1], "r", mine, corpus=manifests.corpus_digest(b"another corpus"))
    assert manifest_difference(ours, elsewhere) == f"corpus {CORPUS[:16]} here, {elsewhere.corpus[:16]} there (--data)"
    assert settings_difference(mine, theirs) == "optim.lr = 0.003 here, 0.001 there"
    assert settings_difference(mine, "{not json") == "settings that do not parse"
    assert settings_difference(mine, run_settings(TrainConfig(seed=1))) == "seed = 0 here, 1 there"
    # What each composer may choose alone does not split the run.
    assert run_settings(TrainConfig(eval_every=7)) == mine


def test_a_newcomer_takes_the_manifest_working_composers_announce_not_the_one_most_keys_publish():
    mine = run_settings(TrainConfig())
    keys = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(3)]
    run = manifests.create(keys[0], "r", mine, admission="allowlist", corpus=CORPUS)
    # The same settings, another creator:
    forged = manifests.create(keys[1], "r", mine, admission="allowlist", corpus=CORPUS)
    other = manifests.create(keys[2], "r", run_settings(TrainConfig(seed=1)), corpus=CORPUS)
    published = {run.digest: Published(run, publishers=2, working=2),
                 forged.digest: Published(forged, publishers=5, working=0)}
    took, line = choose_manifest(published)
    assert took is run and line.startswith(f"took {run.digest_hex} (allowlist of creator {keys[0].fingerprint}")
    assert f"left out: {forged.digest_hex}" in line and "published by 5 key(s)" in line
    # As many working composers on both sides: refused, each listed, until the newcomer names one.
    published[forged.digest] = Published(forged, publishers=5, working=2)
    with pytest.raises(ManifestChoiceError, match="2 manifests are announced by as many working composers") as e:
        choose_manifest(published)
    assert run.digest_hex in str(e.value) and forged.digest_hex in str(e.value) and "--creator" in str(e.value)
    assert choose_manifest(published, creator=keys[0].fingerprint)[0] is run
    assert choose_manifest(published, digest=forged.digest_hex.upper())[0] is forged
    # An open run has no creator to pin (any key signs its digest): only --digest narrows it.
    published[other.digest] = Published(other, publishers=1, working=9)
    assert choose_manifest(published)[0] is other
    with pytest.raises(ManifestChoiceError, match="no manifest of that creator"):
        choose_manifest({other.digest: published[other.digest]}, creator=keys[2].fingerprint)
    only, said = choose_manifest({forged.digest: Published(forged, publishers=1, working=0)})
    assert only is forged and "no live composer announces it yet" in said
    with pytest.raises(ManifestChoiceError, match="check --run-id and --initial-peers"):
        choose_manifest({})


def _composer(i: int, capacity: float = 1.0, step: int = 0) -> tuple[str, Member]:
    identity = Identity.from_seed(bytes([i + 1]) * 32)
    hb = Heartbeat(peer_id=f"12D3KooW{i}", addresses=(), role="composer", capacity=capacity, shards=(), step=step)
    return identity.fingerprint, Member(identity.fingerprint, identity.public_key, hb, 200.0)


def test_a_composer_in_probation_is_in_nobody_s_assignment_its_own_included():
    members = dict([_composer(0, step=5), _composer(1, step=5)])
    joiner = Identity.from_seed(b"j" * 32)
    hb = Heartbeat(peer_id="12D3KooWj", addresses=(), role="composer", capacity=1.0, shards=(), step=0, probation=True)
    members[joiner.fingerprint] = Member(joiner.fingerprint, joiner.public_key, hb, 200.0)
    view = SwarmView(run_id="r", read_at=100.0, members=members, shards=ShardConfig(n_layers=2, n_experts=8))
    assert joiner.fingerprint in view.alive(150.0) and joiner.fingerprint not in view.composers(150.0)
    assignment = view.assignment(150.0)
    assert assignment is not None and joiner.fingerprint not in assignment.peers
    assert Heartbeat.decode(hb.encode()).probation  # it travels


def _beat(step: int, *, probation: bool = False, peer_id: str = "12D3KooWa") -> bytes:
    return heartbeat_value(Heartbeat(peer_id=peer_id, addresses=(), role="composer", capacity=1.0, shards=(),
                                     step=step, probation=probation))


def test_a_composer_joining_a_training_swarm_is_in_probation_until_a_round_merges_its_work():
    """Its first read shows composers that trained: its heartbeat says probation (it gives itself no experts, as the
    others give it none before its work reaches them) until ``shown_work``. One that resumes as an identity that
    worked takes none, nor does a worker."""
    me, alice, bob = (Identity.from_seed(bytes([c]) * 32) for c in b"mab")
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    shards = ShardConfig(n_layers=1, n_experts=4)
    m = Membership(dht, me, Presence(run_id="r"), shards=shards, clock=lambda: clock[0])  # type: ignore[arg-type]
    dht.answer = {owner_subkey(alice.public_key): (_beat(40), 106.0), owner_subkey(bob.public_key): (_beat(40), 106.0)}
    assert m._refresh() and m.joins_training(m.view())
    assert m.enter_probation() and m.probation
    dht.answer[owner_subkey(me.public_key)] = (_beat(0, probation=True, peer_id=dht.peer_id), 106.0)
    assert m._refresh() and m.probation and set(m.view().composers()) == {alice.fingerprint, bob.fingerprint}
    assert m.view().joining == {me.fingerprint}  # a round must merge its contribution: it counts for that
    assert m.shown_work() and not m.probation
    assert not m.enter_probation() and not m.probation  # once its work was shown, never again in this process
    restarted = Membership(dht, me, Presence(run_id="r"), shards=shards, clock=lambda: clock[0])  # type: ignore[arg-type]
    assert not restarted.shown_work()  # it resumes its own checkpoint: the others saw its work
    assert not restarted.enter_probation()
    worker = Membership(dht, Identity.from_seed(b"w" * 32), Presence(run_id="r", role="worker"),  # type: ignore[arg-type]
                        clock=lambda: clock[0])
    assert not worker.enter_probation()


def test_one_identity_announcing_steps_puts_no_starting_composer_in_probation_and_a_probation_ends_without_others():
    """A starting swarm of two with one identity that announces step 100 is not a training one (the higher median of
    the others' steps decides). A probation ends after three fresh reads in which no other composer counts, or once
    ``idle_s`` passed without anyone's work reaching the node (the others announced steps, never work)."""
    me, alice, bob, liar = (Identity.from_seed(bytes([c]) * 32) for c in b"mabl")
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    shards = ShardConfig(n_layers=1, n_experts=4)
    m = Membership(dht, me, Presence(run_id="r"), shards=shards, clock=lambda: clock[0])  # type: ignore[arg-type]
    dht.answer = {owner_subkey(alice.public_key): (_beat(0), 106.0), owner_subkey(bob.public_key): (_beat(0), 106.0),
                  owner_subkey(liar.public_key): (_beat(100), 106.0)}
    assert m._refresh() and not m.joins_training(m.view())
    dht.answer[owner_subkey(alice.public_key)] = (_beat(30), 106.0)
    assert m._refresh() and m.joins_training(m.view())
    assert m.enter_probation()
    for _ in range(5):  # both count (nobody's work reached this node yet): it stays
        assert m._refresh() and m.probation
    m._probation_since -= m.config.idle_s  # idle_s in probation, and no work arrived from anyone
    assert m._refresh() and not m.probation
    alone = Membership(dht, Identity.from_seed(b"n" * 32), Presence(run_id="r"), shards=shards,  # type: ignore[arg-type]
                       clock=lambda: clock[0])
    assert alone._refresh() and alone.enter_probation()
    dht.answer, clock[0] = {}, 107.0  # the others are gone (their heartbeats expired): nobody else would train
    assert alone._refresh() and alone._refresh() and alone.probation  # two reads may be a loaded host's
    assert alone._refresh() and not alone.probation


def test_a_composer_that_says_probation_for_longer_than_idle_s_is_no_joiner_to_hold_rounds_for():
    me, liar = Identity.from_seed(b"m" * 32), Identity.from_seed(b"l" * 32)
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    m = Membership(dht, me, Presence(run_id="r"), shards=ShardConfig(n_layers=1, n_experts=4),  # type: ignore[arg-type]
                   clock=lambda: clock[0])
    dht.answer = {owner_subkey(liar.public_key): (_beat(5, probation=True), 106.0)}
    assert m._refresh() and m.view().joining == {liar.fingerprint} and liar.fingerprint not in m.view().composers()
    m._progress._first[liar.fingerprint] -= m.config.idle_s
    assert m._refresh() and m.view().joining == frozenset()


def test_a_declared_capacity_counts_up_to_twice_the_median():
    members = dict([_composer(0), _composer(1), _composer(2, capacity=1.5), _composer(3, capacity=1e6)])
    view = SwarmView(run_id="r", read_at=100.0, members=members, shards=ShardConfig(n_layers=2, n_experts=8))
    capacities = view.composers(150.0)
    assert sorted(capacities.values()) == [1.0, 1.0, 1.5, 2.0]  # median_low of (1, 1, 1.5, 1e6) is 1
    owned = [sum(1 for _, _, owner, _ in view.assignment(150.0).items() if owner == fp) for fp in capacities]
    assert max(owned) <= 6  # of 16 experts (2 / 5.5 of them is 5.8): a 1e6 declaration does not take them all


def test_composers_whose_step_does_not_move_own_nothing_after_the_grace_period():
    progress = Progress(stall_s=60.0)
    assert progress.stalled({"a": 0, "b": 0, "phantom": 0}, now=0.0) == frozenset()
    assert progress.stalled({"a": 0, "b": 0, "phantom": 0}, now=100.0) == frozenset()  # nobody trains yet
    assert progress.stalled({"a": 5, "b": 4, "phantom": 0}, now=110.0) == {"phantom"}
    assert progress.stalled({"a": 9, "b": 4, "phantom": 0}, now=169.0) == {"phantom"}
    assert progress.stalled({"a": 12, "b": 4, "phantom": 1}, now=171.0) == {"b"}  # b stopped; the phantom moved
    members = dict([_composer(0, step=5), _composer(1, step=4)])
    slow = next(iter(members))
    view = SwarmView(run_id="r", read_at=100.0, members=members, stalled=frozenset({slow}))
    assert slow not in view.composers(150.0) and len(view.composers(150.0)) == 1


def test_a_newcomer_to_a_swarm_whose_steps_do_not_move_makes_nobody_stalled():
    """Peers that only heartbeat (a swarm paused, or ``bench dht``'s membership swarms) all announce one step; a
    replacement just seen is in its grace period, but it does not show that training goes on."""
    progress = Progress(stall_s=60.0)
    assert progress.stalled({"a": 0, "b": 0}, now=0.0) == frozenset()
    assert progress.stalled({"a": 0, "b": 0, "new": 0}, now=100.0) == frozenset()
    assert progress.stalled({"a": 0, "b": 0, "new": 1}, now=101.0) == {"a", "b"}  # once it trains, they stalled


def test_composers_whose_work_never_arrives_own_nothing_after_the_grace_period():
    progress = Progress(stall_s=1e9, idle_s=60.0)
    steps = {"a": 1, "b": 1, "phantom": 1}
    assert progress.stalled(steps, now=0.0) == frozenset()
    progress.worked("a", 30.0)  # work begins to flow: the grace periods run from here
    progress.worked("b", 40.0)
    progress.worked("a", 88.0)
    assert progress.stalled(steps, now=89.0) == frozenset()  # within the grace period everyone counts
    assert progress.stalled(steps, now=91.0) == {"phantom"}  # a heartbeat's step is not work
    progress.worked("phantom", 93.0)
    progress.worked("a", 93.0)
    assert progress.stalled(steps, now=95.0) == frozenset()  # its work arrived: it counts again
    assert progress.stalled(steps, now=101.0) == {"b"}  # b's last work is 61 s old
    progress.worked("b", 102.0)
    assert progress.stalled(steps, now=103.0) == frozenset()


def test_a_composer_whose_work_comes_further_apart_than_idle_s_is_not_judged_idle_between_arrivals():
    """Work that arrives every 15 s against an idle_s of 10 s (late rounds, a slow link): judged idle once, then
    given twice its longest recent gap, so its experts are not handed over and back at each arrival; one that stops
    is idle within ``IDLE_STRETCH`` idle periods however far apart its work came."""
    progress = Progress(stall_s=1e9, idle_s=10.0)
    steps = {"fast": 1, "slow": 1}
    progress.stalled(steps, now=0.0)
    idle_at = []
    for t in range(1, 200):
        progress.worked("fast", float(t))
        if t % 15 == 0 and t <= 60 or t == 120:
            for burst in range(20):  # the experts of one refresh, each an arrival: one burst
                progress.worked("slow", t + burst / 100)
        if progress.stalled(steps, now=t + 0.5) == {"slow"}:
            idle_at.append(t)
    # Idle past its grace period before its first work, and 10 s after its first arrival (no gap seen yet); counted
    # from its second on while its arrivals come 15 s apart; idle again 30 s after it stopped at 60 s; back at 120 s
    # and idle 30 s on (the minute's absence is no gap it may take).
    assert idle_at == [*range(11, 15), *range(25, 30), *range(90, 120), *range(150, 200)]
    assert progress.idle_after("slow") == pytest.approx(2 * 14.81) and progress.idle_after("fast") == 10.0
    progress.worked("slow", 200.0)
    progress.worked("slow", 225.0)  # 25 s apart: twice that is past the stretch
    assert progress.idle_after("slow") == IDLE_STRETCH * 10.0
    assert Progress(stall_s=1e9, idle_s=0.0).idle_after("x") == 0.0


def test_a_composer_first_seen_after_work_began_counts_only_once_its_work_arrives():
    """Fresh keys earn nothing until they show work, however many and however often replaced; composers seen before
    work began keep their grace period, and one that worked before and comes back (a restart) gets one."""
    progress = Progress(stall_s=1e9, idle_s=60.0)
    progress.stalled({"a": 1, "b": 1, "founder": 1}, now=0.0)
    progress.worked("a", 10.0)
    progress.worked("b", 10.0)
    fresh = {f"key{i}": 1 for i in range(300)}
    assert progress.stalled({"a": 1, "b": 1, "founder": 1, "joiner": 1, **fresh}, now=11.0) == {"joiner", *fresh}
    assert progress.unproven("joiner") and not progress.unproven("founder") and not progress.unproven("a")
    progress.worked("joiner", 20.0)  # its first contribution arrived
    assert progress.stalled({"a": 1, "b": 1, "founder": 1, "joiner": 1}, now=21.0) == frozenset()
    assert progress.stalled({"a": 1, "founder": 1, "joiner": 1}, now=30.0) == frozenset()  # b went away
    assert progress.stalled({"a": 1, "b": 1, "founder": 1, "joiner": 1}, now=40.0) == frozenset()  # b is back
    # At 71 s: a's and the founder's grace are over (last work at 10 s, none), b's return began one at 40 s.
    assert progress.stalled({"a": 1, "b": 1, "founder": 1, "joiner": 1}, now=71.0) == {"a", "founder"}


def test_fresh_keys_stay_unproven_while_nobodys_work_is_recent():
    """Rounds that slow past ``idle_s`` leave no composer's work recent, and the idle rule names nobody then (a
    paused swarm); identities that never worked still count for nothing, or their number would hold every round's
    quorum out of reach and no work would arrive again."""
    progress = Progress(stall_s=1e9, idle_s=10.0)
    progress.stalled({"a": 1, "b": 1}, now=0.0)
    progress.worked("a", 1.0)
    progress.worked("b", 1.0)
    flood = {f"key{i}": 1 for i in range(300)}
    assert progress.stalled({"a": 1, "b": 1, **flood}, now=5.0) == set(flood)
    assert progress.stalled({"a": 1, "b": 1, **flood}, now=30.0) == set(flood)  # a's and b's work 29 s old
    progress.worked("key7", 31.0)  # one of them shows work: it counts
    assert progress.stalled({"a": 1, "b": 1, **flood}, now=32.0) == set(flood) - {"key7"} | {"a", "b"}


def test_a_node_whose_working_peers_all_left_counts_a_newcomer_whose_work_has_not_reached_it():
    """Every composer whose work reached this node left: it would merge alone and fetch nothing, so a newcomer it did
    not count would never prove itself here, while in the newcomer's view the two share the experts."""
    progress = Progress(stall_s=1e9, idle_s=10.0)
    progress.stalled({"a": 1}, now=0.0)
    progress.worked("a", 1.0)
    assert progress.stalled({"a": 1, "new": 1}, now=5.0) == {"new"}  # a works: the newcomer must show work
    assert progress.stalled({"a": 1, "new": 1}, now=30.0) == {"new"}  # a alive, its work not recent: still
    assert progress.stalled({"new": 1}, now=40.0) == frozenset()  # a left


def test_a_node_joining_a_training_swarm_counts_whom_the_records_vouch_for_and_no_identity_beside_them():
    """A joiner's first read shows the swarm's composers beside 300 identities written before it came: no work has
    reached it, so each would count for a grace period. The records vouch for the composers whose work others
    merged: they count, each until one idle period passes without work of its own, and the rest count once theirs
    arrives."""
    progress = Progress(stall_s=1e9, idle_s=60.0)
    flood = {f"key{i}": 7 for i in range(300)}
    steps = {"a": 7, "b": 7, "c": 7, "d": 7, **flood}  # d trains too, and no record vouches for it yet
    assert progress.stalled(steps, now=0.0) == frozenset()  # nobody is judged before evidence
    assert not progress.vouched([], now=4.0) and not progress.work_began
    assert progress.vouched(["a", "b", "c"], now=5.0)
    assert progress.work_began and not progress.work_arrived  # the records' word, not work that arrived
    assert progress.stalled(steps, now=6.0) == {"d", *flood}
    assert progress.unproven("d") and progress.unproven("key0") and not progress.unproven("a")
    assert progress.counted([*steps, "me"], "me") == {"me", "a", "b", "c"}
    progress.worked("d", 20.0)  # its contribution arrived
    assert progress.work_arrived and progress.stalled(steps, now=21.0) == set(flood)
    progress.worked("a", 30.0)
    assert not progress.vouched(["key0"], now=31.0)  # work arrived: the node judges by it
    assert progress.stalled(steps, now=66.0) == {"b", "c", *flood}  # no work of their own one idle period on


def test_the_composers_the_records_vouch_for_are_a_joiners_working_set_at_once_not_from_its_next_read():
    """A joiner's first rounds begin as its download ends, and the records are counted then: the composers they vouch
    for, and no identity beside them, are whom its view shows working from that moment."""
    me, alice, bob, *flood = (Identity.from_seed(bytes([c]) * 32) for c in b"mabxyz")
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    m = Membership(dht, me, Presence(run_id="r"), clock=lambda: clock[0])  # type: ignore[arg-type]
    dht.answer = {owner_subkey(i.public_key): (_beat(40), 130.0) for i in (alice, bob, *flood)}
    assert m._refresh() and len(m.view().composers()) == 5  # no work has reached it: each has a grace period
    m.vouched({alice.fingerprint, bob.fingerprint})
    assert set(m.view().composers()) == {alice.fingerprint, bob.fingerprint}


def test_a_node_resuming_its_checkpoint_counts_the_composers_it_names_not_a_flood_written_while_it_was_away():
    """A resumed node's first read shows the swarm's composers beside identities that only heartbeat: its checkpoint
    names the composers whose work had reached it, and those alive count at once, the rest once their work arrives.
    While none it names is alive (a swarm that turned over), every composer counts, as at a start."""
    me, alice, bob, carol, *flood = (Identity.from_seed(bytes([c]) * 32) for c in b"mabcxyz")
    clock = [100.0]
    dht = _SlowReads(clock, read_s=0.1)
    m = Membership(dht, me, Presence(run_id="r"), clock=lambda: clock[0])  # type: ignore[arg-type]
    m.remember({alice.fingerprint, carol.fingerprint, me.fingerprint})
    dht.answer = {owner_subkey(i.public_key): (_beat(40), 130.0) for i in (bob, *flood)}
    assert m._refresh() and len(m.view().composers()) == 4  # nobody it names is alive: each has a grace period
    dht.answer[owner_subkey(alice.public_key)] = (_beat(40), 130.0)
    assert m._refresh() and set(m.view().composers()) == {alice.fingerprint}
    dht.answer[owner_subkey(carol.public_key)] = (_beat(40), 130.0)  # back before any work arrived: it counts
    assert m._refresh() and set(m.view().composers()) == {alice.fingerprint, carol.fingerprint}
    m.worked(bob.fingerprint)
    assert m._refresh() and set(m.view().composers()) == {alice.fingerprint, bob.fingerprint, carol.fingerprint}
    assert m.workers() == {bob.fingerprint}  # the checkpoint's word is no work: saved again, it is not carried on
    m.worked(alice.fingerprint)
    assert m.workers() == {alice.fingerprint, bob.fingerprint}


def test_the_working_set_a_checkpoint_keeps_is_whose_work_arrived_within_one_idle_period():
    progress = Progress(stall_s=1e9, idle_s=60.0)
    progress.worked("a", 10.0)
    progress.worked("b", 50.0)
    assert progress.working(65.0) == {"a", "b"} and progress.working(80.0) == {"b"}
    assert Progress(stall_s=1e9).working(1e6) == frozenset()
    progress = Progress(stall_s=1e9)  # no idle rule: every composer whose work arrived
    progress.vouched(["b"], 5.0)
    progress.worked("a", 10.0)
    assert progress.working(1e6) == {"a"}  # not one the records only vouched for


def test_nobody_is_idle_while_nobody_s_work_arrives_nor_at_once_when_it_begins():
    progress = Progress(stall_s=1e9, idle_s=60.0)
    steps = {"a": 1, "b": 1}
    progress.stalled(steps, now=0.0)
    assert progress.stalled(steps, now=500.0) == frozenset()  # no rounds, no surrogates yet: a quiet swarm
    progress.worked("a", 500.0)
    assert progress.stalled(steps, now=501.0) == frozenset()  # the first contribution fetched idles no one
    progress.worked("a", 560.0)
    assert progress.stalled(steps, now=561.0) == {"b"}


def test_leaving_and_coming_back_starts_no_new_grace_period():
    progress = Progress(stall_s=1e9, idle_s=60.0)
    progress.stalled({"a": 1, "phantom": 1}, now=0.0)
    progress.worked("a", 10.0)
    progress.stalled({"a": 1}, now=50.0)  # the phantom's heartbeat expired
    progress.worked("a", 70.0)
    assert progress.stalled({"a": 2, "phantom": 1}, now=71.0) == {"phantom"}


def test_a_heartbeat_too_large_for_a_record_drops_its_suspects_first():
    # 1024 shards, eight long addresses and eight long suspects
    addresses = tuple(f"/dns4/{'a' * 180}{i}.example/tcp/31337" for i in range(8))
    shards = tuple((layer, e) for layer in range(16) for e in range(64))
    liars = {f"12D3KooW{'z' * 100}{i:02d}": 9.0 for i in range(8)}
    hb = Heartbeat(peer_id="12D3KooWme", addresses=addresses, role="composer", capacity=1.0, shards=shards, step=1,
                   run=bytes(16), suspects=liars, banned=tuple(liars))
    assert len(pack_message(hb)) > MAX_RECORD_BYTES
    value = heartbeat_value(hb)
    assert len(value) <= MAX_RECORD_BYTES
    back = unpack_message(value, (Heartbeat,))
    assert back.shards == shards and back.suspects == {} and back.banned == ()
    small = Heartbeat(peer_id="12D3KooWme", addresses=(), role="composer", capacity=1.0, shards=(), step=1,
                      suspects={"12D3KooWliar": 3.0}, banned=("12D3KooWliar",))
    assert unpack_message(heartbeat_value(small), (Heartbeat,)).banned == ("12D3KooWliar",)


def test_quorum_is_the_side_holding_most_composers_seen_recently():
    held, doubt, lost = QuorumState.HELD, QuorumState.DOUBT, QuorumState.LOST
    q = Quorum(window_s=60.0, grace_s=3.0)
    assert q.check({"a", "b", "c", "d"}, (), now=0.0) is held
    assert q.check({"a", "b", "c"}, (), now=10.0) is held  # one died or is cut off: the other three go on
    cut = Quorum(window_s=60.0, grace_s=3.0)
    cut.check({"a", "b", "c", "d"}, (), now=0.0)
    assert cut.check({"d"}, (), now=10.0) is doubt  # one read without the others is not yet a partition ...
    assert cut.check({"a", "b", "c", "d"}, (), now=11.0) is held
    assert cut.check({"d"}, (), now=12.0) is doubt
    assert cut.check({"d"}, (), now=15.0) is lost  # ... the others missing for the grace period is: it owns nothing
    assert cut.check({"d"}, (), now=70.0) is lost
    assert cut.check({"d"}, (), now=76.0) is held  # the window forgot them: the others left for good
    assert cut.check({"a", "b", "c", "d"}, (), now=77.0) is held  # healed


def test_quorum_an_even_split_keeps_its_own_experts_and_a_leaver_is_forgotten():
    left, right = Quorum(60.0, grace_s=0.0), Quorum(60.0, grace_s=0.0)
    for q in (left, right):
        q.check({"a", "b", "c", "d"}, (), now=0.0)
    assert left.check({"a", "b"}, (), now=5.0) is QuorumState.DOUBT  # neither half takes the other's experts
    assert right.check({"c", "d"}, (), now=5.0) is QuorumState.DOUBT
    assert left.check({"a", "b"}, (), now=61.0) is QuorumState.HELD  # the window forgot the other half
    pair = Quorum(60.0, grace_s=0.0)
    pair.check({"a", "b"}, (), now=0.0)
    assert pair.check({"b"}, departed={"a"}, now=5.0) is QuorumState.HELD  # a left with a deathrattle
    assert Quorum(60.0, grace_s=0.0).check((), (), now=0.0) is QuorumState.HELD  # its own heartbeat not read yet


def test_quorum_holds_under_churn_where_the_dead_and_their_replacements_outnumber_the_swarm():
    """Four composers, one killed (no deathrattle) and replaced every 10 s: in a minute ten were seen, never more
    than five alive at once. The swarm is whole: it keeps its experts. A cut still takes them away."""
    q = Quorum(60.0, grace_s=3.0)
    alive = ["a", "b", "c", "d"]
    assert q.check(alive, (), now=0.0) is QuorumState.HELD
    for i in range(12):
        t = 10.0 * (i + 1)
        alive = [*alive, f"new{i}"]  # the replacement joins while the dead one's heartbeat has not expired yet
        assert q.check(alive, (), now=t) is QuorumState.HELD
        alive = alive[1:]  # its heartbeat expired
        assert q.check(alive, (), now=t + 6.0) is QuorumState.HELD, (t, alive)
    assert q.seen() == 5
    me = alive[-1]
    assert q.check([me], (), now=130.0) is QuorumState.DOUBT
    assert q.check([me], (), now=134.0) is QuorumState.LOST  # alone of five: cut off


def test_heartbeats_alone_neither_cut_a_node_off_nor_count_toward_its_side():
    """Four composers whose work reaches each other; eight identities sign a heartbeat each, once, and train
    nothing. Counted by heartbeats the four are a third of the most alive at once and cut off; counted by work
    they keep their experts, and a cut still takes them away."""
    progress, by_work, by_heartbeat = Progress(stall_s=120.0, idle_s=60.0), Quorum(60.0, 3.0), Quorum(60.0, 3.0)
    honest, phantoms = ["me", "a", "b", "c"], [f"sybil{i}" for i in range(8)]
    assert progress.counted(honest + phantoms, "me") == frozenset(honest + phantoms)  # no work yet: heartbeats
    for fp in ["a", "b", "c"]:
        progress.worked(fp, now=0.0)
    assert progress.work_began and progress.counted(honest + phantoms, "me") == frozenset(honest)
    by_work.check(progress.counted(honest, "me"), (), now=1.0)
    by_heartbeat.check(honest, (), now=1.0)
    for t in (2.0, 3.0):  # the phantoms' heartbeats live a TTL
        assert by_work.check(progress.counted(honest + phantoms, "me"), (), now=t) is QuorumState.HELD
        by_heartbeat.check(honest + phantoms, (), now=t)
    for t in (9.0, 13.0):
        assert by_work.check(progress.counted(honest, "me"), (), now=t) is QuorumState.HELD
    assert by_heartbeat.check(honest, (), now=9.0) is QuorumState.DOUBT
    assert by_heartbeat.check(honest, (), now=13.0) is QuorumState.LOST
    assert by_work.check(progress.counted(["me"], "me"), (), now=20.0) is QuorumState.DOUBT
    assert by_work.check(progress.counted(["me"], "me"), (), now=24.0) is QuorumState.LOST  # alone of four
    by_work.restart()
    assert by_work.seen() == 0 and by_work.check(["me"], (), now=25.0) is QuorumState.HELD


def test_relayed_nodes_use_their_static_relays_at_once_and_every_node_caps_what_it_relays():
    from hivemind.p2p import P2P

    from parallax.dht.adapter import RELAY_SERVICE, DHTConfig, _relay_options, p2pd_flags

    options, flags = _relay_options(DHTConfig())
    assert options == {} and flags == RELAY_SERVICE
    relay = "/ip4/10.0.0.1/tcp/4001/p2p/QmdHHq4mfJjPxH9b2NFVGSqdwFHrv4P2THVoFHnqLLCaQ8"
    options, flags = _relay_options(DHTConfig(relays=(relay,), relay_always=True))
    assert options == {"use_auto_relay": True, "trusted_relays": [relay], "force_reachability": "private"}
    assert flags["relayDiscovery"] == 0  # else p2pd's autorelay waits minutes for more candidates
    before = P2P.DHT_MODE_MAPPING
    with p2pd_flags(flags):
        assert all(args["relayDiscovery"] == 0 and args["relayMaxCircuits"] == 16
                   for args in P2P.DHT_MODE_MAPPING.values())
        args = P2P._make_process_args("p2pd", **P2P.DHT_MODE_MAPPING["client"])
        assert "-relayDiscovery=0" in args and "-relayTimeLimit=30m" in args
    assert P2P.DHT_MODE_MAPPING is before


def test_the_tracebacks_of_orphaned_requests_are_dropped_and_others_kept():
    import logging
    from concurrent.futures import InvalidStateError

    from parallax.dht.adapter import OrphanedRequests

    def record(name, func, error):
        r = logging.LogRecord(name, logging.ERROR, "x.py", 1, "msg", None, (type(error), error, None), func=func)
        return r

    f = OrphanedRequests()
    assert not f.filter(record("hivemind.dht.dht", "_run", FileNotFoundError(2, "No such file or directory")))
    assert not f.filter(record("asyncio", "default_exception_handler",
                               InvalidStateError("Can't set_result to a future that is CANCELLED (1)")))
    assert not f.filter(record("hivemind.dht.dht", "_run_coroutine",
                               InvalidStateError("Can't set_result to a future that is CANCELLED (2)")))
    assert not f.filter(record("hivemind.utils.mpfuture", "_process_updates_in_background",
                               InvalidStateError("CANCELLED: <MPFuture at 0x7f36 state=cancelled>")))
    assert f.filter(record("hivemind.dht.dht", "_run", ValueError("a real failure")))
    assert f.filter(record("hivemind.dht.dht", "get", FileNotFoundError(2, "elsewhere")))
    assert f.filter(record("asyncio", "x", InvalidStateError("Can't set_result to a future that is FINISHED (1)")))
    assert f.filter(logging.LogRecord("asyncio", logging.ERROR, "x.py", 1, "no exception", None, None))


class _Starting:
    """A DHT process as a start waits for it: ready after ``ready_after`` polls, or never; alive or ended."""

    def __init__(self, *, ready_after: int | None = None, alive: bool = True, error: BaseException | None = None):
        self.polls, self.ready_after, self.alive, self.error, self.exitcode = 0, ready_after, alive, error, 1

    def wait_until_ready(self, timeout: float) -> None:
        self.polls += 1
        if self.error is not None:
            raise self.error
        if self.ready_after is None or self.polls <= self.ready_after:
            raise TimeoutError()

    def is_alive(self) -> bool:
        return self.alive


def test_a_start_waits_for_a_dht_process_that_gets_ready_and_gives_up_on_one_that_stalls_or_ends() -> None:
    ready = _Starting(ready_after=2)
    adapter._wait_ready(ready, within_s=60.0)  # type: ignore[arg-type]
    assert ready.polls == 3
    with pytest.raises(DHTError, match="not ready within 0 s"):
        adapter._wait_ready(_Starting(), within_s=0.0)  # type: ignore[arg-type]
    with pytest.raises(DHTError, match="ended .exit code 1. before it was ready"):
        adapter._wait_ready(_Starting(alive=False), within_s=60.0)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match="daemon"):  # the process's own error, as it raised it
        adapter._wait_ready(_Starting(error=TimeoutError("the p2p daemon did not start")), within_s=60.0)  # type: ignore[arg-type]
