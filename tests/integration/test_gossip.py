"""Surrogate gossip with real hivemind DHT peers on loopback: ordered deltas, re-serving when the owner is
gone, catch-up with the full copy, and refusal of forged or poisoned payloads."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import torch

from parallax.dht.surrogates import read_records
from parallax.dht.testing import LocalPeer, LocalSwarm, fixed_identity, wait_until
from parallax.node.config.net import GossipConfig
from parallax.node.model.lowrank import ErrorFeedbackPublisher
from parallax.node.net.gossip import SurrogateGossip, SurrogateUpdate
from parallax.node.net.surrogate_payload import encode_delta, payload_digest
from parallax.protocol.messages import SurrogateDelta, SurrogatePayload

RUN = "gossip"
SHAPES = {"w_gate.weight": (8, 128), "w_up.weight": (8, 128), "w_down.weight": (128, 8)}  # the small preset
E0, E1 = (0, 0), (0, 1)
FAST = dict(poll_s=0.3, announce_period_s=1.0, announce_ttl_s=30.0, max_behind=2, chunk_bytes=4096,
            request_timeout_s=3.0, chunk_timeout_s=3.0, fetch_timeout_s=10.0)
WAIT_S = 15.0


def initial() -> dict[str, torch.Tensor]:
    """The surrogate every node builds from the run's seed (version 0)."""
    g = torch.Generator().manual_seed(1234)
    return {n: torch.randn(s, generator=g) * 0.1 for n, s in SHAPES.items()}


def target(version: int) -> dict[str, torch.Tensor]:
    """What the owner's distillation produced at ``version`` (any new values will do)."""
    g = torch.Generator().manual_seed(version)
    return {n: t + 0.05 * version * torch.randn(t.shape, generator=g) for n, t in initial().items()}


@dataclass
class Node:
    peer: LocalPeer
    gossip: SurrogateGossip
    held: dict = field(default_factory=dict)
    applied: list = field(default_factory=list)  # (eid, version, full) in the order applied
    steps: dict = field(default_factory=dict)  # (eid, version) -> the owner's step it was published at

    def pump(self) -> None:
        """What the training loop does between steps: drain and apply."""
        for u in self.gossip.drain():
            eid = (u.layer, u.expert)
            u.apply(self.held.setdefault(eid, initial()))
            self.applied.append((eid, u.version, u.is_full))
            self.steps[(eid, u.version)] = u.step

    def version(self, eid) -> int:
        self.pump()
        return max([v for e, v, _ in self.applied if e == eid], default=0)


class Owner:
    """An owner's side of one expert: the error-feedback publisher and the gossip it publishes through."""

    def __init__(self, node: Node, eid) -> None:
        self.node, self.eid = node, eid
        self.publisher = ErrorFeedbackPublisher(initial(), rank=8)
        self.version = 0

    def publish(self) -> SurrogateDelta:
        self.version += 1
        factors = self.publisher.delta(target(self.version))
        return self.node.gossip.publish(*self.eid, self.version, factors, full=self.publisher.full(),
                                        step=10 * self.version)


@pytest.fixture
def world() -> Iterator[Callable[..., Node]]:
    swarm = LocalSwarm(run_id=RUN, n_layers=1)
    gossips: list[SurrogateGossip] = []
    owners: dict = {}

    def make(i: int, *, owns=(), provider_order=None, **cfg) -> Node:
        peer = swarm.add_dht(fixed_identity(i))
        for eid in owns:
            owners[eid] = peer.identity.public_key
        gossip = SurrogateGossip(peer.dht, peer.identity, GossipConfig(**{**FAST, **cfg}), run_id=RUN,
                                 n_layers=1, shapes=SHAPES, owner_of=owners.get, provider_order=provider_order)
        gossips.append(gossip)
        return Node(peer, gossip.start())

    try:
        yield make
    finally:
        for g in gossips:
            g.close()
        swarm.close()


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_deltas_arrive_in_order_and_match_the_owner_mirror(world):
    a = world(0, owns=[E0])
    b, c = world(1), world(2)
    owner = Owner(a, E0)
    ann = owner.publish()
    wait_until(lambda: b.version(E0) == 1 and c.version(E0) == 1, WAIT_S)
    owner.publish()
    owner.publish()
    wait_until(lambda: b.version(E0) == 3 and c.version(E0) == 3, WAIT_S)
    for n in (b, c):
        assert n.applied == [(E0, 1, False), (E0, 2, False), (E0, 3, False)]
        assert same(n.held[E0], owner.publisher.published)
        assert n.gossip.stats.sources[a.peer.dht.peer_id] >= 1 and not n.gossip.stats.refused
    s = b.gossip.stats
    print(f"\ndelta payload {ann.size} B (sha256 {ann.digest.hex()[:12]}), {s.deltas} deltas in "
          f"{s.fetch_s * 1e3 / s.deltas:.1f} ms each (pull + verify), {s.bytes_fetched} B fetched by one receiver")


def test_a_receiver_pulls_from_a_non_owner_provider_when_the_owner_is_gone(world):
    b = world(1)  # the first peer is everyone's bootstrap: not the one that leaves
    a = world(0, owns=[E0])
    owner = Owner(a, E0)
    owner.publish()
    wait_until(lambda: b.version(E0) == 1, WAIT_S)
    wait_until(lambda: _holds(b, E0, 1), WAIT_S)  # b re-serves what it fetched and says so
    a.gossip.close()
    a.peer.dht.shutdown()
    c = world(2)
    wait_until(lambda: c.version(E0) == 1, WAIT_S)
    assert same(c.held[E0], owner.publisher.published)
    assert dict(c.gossip.stats.sources) == {b.peer.dht.peer_id: 1}
    assert b.gossip.stats.bytes_served >= c.gossip.stats.bytes_fetched > 0


def _holds(node: Node, eid, version: int) -> bool:
    records = read_records(node.peer.dht, RUN, [eid[0]], timeout_s=3)
    rec = (records or {}).get(eid[0], {}).get(node.peer.identity.public_key)
    return rec is not None and any(h.expert == eid[1] and h.has_delta(version) for h in rec.holds)


def test_a_late_joiner_catches_up_with_the_full_copy_then_follows_deltas(world):
    a = world(0, owns=[E0])
    owner = Owner(a, E0)
    for _ in range(5):
        owner.publish()
    late = world(1)  # 5 versions behind, max_behind 2
    wait_until(lambda: late.version(E0) == 5, WAIT_S)
    assert late.applied == [(E0, 5, True)]
    assert same(late.held[E0], owner.publisher.published)
    owner.publish()
    wait_until(lambda: late.version(E0) == 6, WAIT_S)
    assert late.applied[-1] == (E0, 6, False)
    assert same(late.held[E0], owner.publisher.published)
    assert late.steps == {(E0, 5): 50, (E0, 6): 60}  # the owner's steps travel with the full copy and the delta


def _nan_payload(eid, version: int) -> bytes:
    def blob(shape) -> bytes:
        a = np.full(shape, np.nan, dtype="<f4")
        return msgpack.packb(["raw", "float32", list(shape), [], a.tobytes()], use_bin_type=True)

    tensors = {}
    for name, (m, n) in SHAPES.items():
        tensors[f"{name}#u"], tensors[f"{name}#v"] = blob((m, 1)), blob((1, n))
    return SurrogatePayload(layer=eid[0], expert=eid[1], version=version, tensors=tensors).encode()


def test_forged_and_poisoned_payloads_are_refused_and_the_receiver_keeps_working(world):
    a = world(0, owns=[E0])
    m = world(1, owns=[E1], provider_order=lambda providers, owner_peer: [])  # owns E1, is hostile, never fetches
    owner = Owner(a, E0)
    # m, as E1's owner, announces a NaN delta under a correct digest.
    m.gossip._publish_bodies(E1, 1, 1, _nan_payload(E1, 1), None)
    # m claims E0 versions it does not own (signed by itself, not by E0's owner) ...
    forger = ErrorFeedbackPublisher(initial(), rank=8)
    for v in (1, 2, 3):
        fake = encode_delta(*E0, v, forger.delta(target(100 + v)))
        fake_ann = SurrogateDelta(layer=0, expert=0, version=v, base_version=v - 1, rank=8,
                                  digest=payload_digest(fake), size=len(fake))
        m.gossip.store.put(fake_ann, fake, full=False, owned=True)
    ann = owner.publish()
    # ... and serves its own bytes for them (its holdings say so); the receiver tries m first.
    wait_until(lambda: _holds(m, E0, 1) and _holds(a, E0, 1), WAIT_S)
    mid = m.peer.dht.peer_id
    r = world(2, provider_order=lambda providers, owner_peer: sorted(providers, key=lambda p: p != mid))
    wait_until(lambda: r.version(E0) == 1 and r.gossip.stats.refused["bad_payload"] >= 1, WAIT_S)
    stats = r.gossip.stats
    assert stats.refused["digest"] >= 1  # m's bytes for E0 v1 did not match the owner's digest
    # From m, only E1's payload passed the digest check (it is what its owner signed: then NaN refused it).
    assert stats.sources[a.peer.dht.peer_id] == 1 and stats.sources[mid] == 1
    assert same(r.held[E0], owner.publisher.published) and ann.version == 1
    assert r.gossip.versions().get(E1, 0) == 0 and E1 not in r.held  # the NaN delta never reached the loop
    # m must still be listed as a provider of v2 when the owner announces it, or r would never try it.
    wait_until(lambda: _holds(m, E0, 2), WAIT_S)
    owner.publish()  # the receiver keeps working
    wait_until(lambda: r.version(E0) == 2, WAIT_S)
    time.sleep(3 * FAST["poll_s"])  # a few more polls: m's (self-signed) version 3 of E0 must stay ignored
    assert r.version(E0) == 2 and same(r.held[E0], owner.publisher.published)
    assert stats.refused["digest"] >= 2 and stats.sources[mid] == 1
    assert all(isinstance(u, SurrogateUpdate) for u in r.gossip.drain())
