"""Which experts the owners of replicated experts merge together: pure functions of the assignment."""

from __future__ import annotations

from parallax.dht.keys import replica_group, replica_groups
from parallax.dht.shards import assign_experts
from parallax.node.outer.replicas import bundles

PEERS = {f"peer-{i}": 1.0 for i in range(4)}


def test_every_owner_of_a_bundle_names_the_same_experts_and_the_same_round_key():
    a = assign_experts("run", 3, 8, PEERS, replicas=2)
    found = {p: bundles(a, p) for p in PEERS}
    for p, mine in found.items():
        assert {eid for experts in mine.values() for eid in experts} == {
            (layer, e) for layer, es in a.owned_by(p).items() for e in es}
        for owners, experts in mine.items():
            assert p in owners and len(owners) == 2 and list(experts) == sorted(experts)
            for other in owners:
                assert found[other][owners] == experts  # the same bundle, so the same round key
                assert replica_group(experts[0]) in replica_groups(3, 8)
    keys = [replica_group(experts[0]) for mine in found.values() for experts in mine.values()]
    bundles_seen = {owners for mine in found.values() for owners in mine}
    assert len(set(keys)) == len(bundles_seen)  # no two bundles share a key


def test_one_owner_per_expert_has_no_bundle():
    a = assign_experts("run", 2, 4, PEERS)
    assert all(bundles(a, p) == {} for p in PEERS)
