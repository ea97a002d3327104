"""Property tests for the expert assignment (dht/shards.py): pure, no network."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax.dht.shards import (
    assign_experts,
    hrw_score,
    layer_quotas,
    max_extra_moves,
    moved_experts,
    replica_quotas,
)

peer_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=12)
capacities = st.floats(min_value=0.25, max_value=8.0, allow_nan=False, allow_infinity=False)
swarms = st.dictionaries(peer_ids, capacities, min_size=1, max_size=12)
shapes = st.tuples(st.integers(1, 4), st.integers(1, 24))  # (layers, experts per layer)


@settings(max_examples=150, deadline=None)
@given(swarms, shapes, st.text(min_size=1, max_size=8))
def test_disjoint_complete_and_quota_balanced(peers, shape, run_id):
    n_layers, n_experts = shape
    a = assign_experts(run_id, n_layers, n_experts, peers)
    total = sum(peers.values())
    for layer in range(n_layers):
        owned = [a.owned_by(p).get(layer, frozenset()) for p in peers]
        assert sum(len(s) for s in owned) == n_experts  # disjoint...
        assert frozenset().union(*owned) == frozenset(range(n_experts))  # ...and complete
        for p, s in zip(peers, owned, strict=True):
            share = n_experts * peers[p] / total
            assert math.floor(share - 1e-9) <= len(s) <= math.ceil(share + 1e-9)  # capacity-weighted
    for _layer, _expert, owner, heir in a.items():
        assert owner in peers
        assert (heir is None) == (len(peers) == 1)
        assert heir != owner


@settings(max_examples=60, deadline=None)
@given(swarms, shapes)
def test_deterministic_whatever_the_order_of_the_view(peers, shape):
    items = list(peers.items())
    random.Random(7).shuffle(items)
    a = assign_experts("run", *shape, peers)
    b = assign_experts("run", *shape, dict(items))
    assert a == b


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(peer_ids, st.just(1.0), min_size=2, max_size=12), shapes, st.data())
def test_heir_is_the_owner_once_the_owner_leaves(peers, shape, data):
    a = assign_experts("run", *shape, peers)
    leaver = data.draw(st.sampled_from(sorted(peers)))
    b = assign_experts("run", *shape, {p: c for p, c in peers.items() if p != leaver})
    for layer, expert, owner, heir in a.items():
        if owner == leaver:
            assert b.owner(layer, expert) == heir


def _extra_moves(before, after, changed_peer, n_experts):
    """Per layer: experts moved beyond those the joiner/leaver itself gains or loses."""
    moved = moved_experts(before, after)
    out = []
    for layer in range(before.n_layers):
        had = len(before.owned_by(changed_peer).get(layer, ()))
        has = len(after.owned_by(changed_peer).get(layer, ()))
        unavoidable = max(had, has)
        n = sum(1 for (l, _) in moved if l == layer)
        assert n >= unavoidable
        out.append((n, unavoidable))
    return out


# Derandomized: the bound is measured, not proven, and CI must not find a new worst case by chance;
# a change to the assignment still meets these examples, and the case below, the worst one known.
@settings(max_examples=120, deadline=None, derandomize=True)
@given(st.dictionaries(peer_ids, st.just(1.0), min_size=1, max_size=14), shapes, st.booleans(), st.data())
def test_minimal_movement_on_one_join_or_leave(peers, shape, joining, data):
    n_layers, n_experts = shape
    if joining or len(peers) == 1:
        changed = "newcomer!"  # cannot collide: "!" is outside the id alphabet
        before, after = peers, {**peers, changed: 1.0}
    else:
        changed = data.draw(st.sampled_from(sorted(peers)))
        before, after = peers, {p: c for p, c in peers.items() if p != changed}
    a = assign_experts("run", n_layers, n_experts, before)
    b = assign_experts("run", n_layers, n_experts, after)
    for n, unavoidable in _extra_moves(a, b, changed, n_experts):
        assert n - unavoidable <= max_extra_moves(n_experts)


def test_the_worst_case_hypothesis_found_stays_within_the_stated_bound():
    """8 peers on 6 experts, one leaves: 5 experts move beyond the leaver's own, a bound of 4 would be too tight."""
    peers = dict.fromkeys(["0", "d9", "if", "tdb", "gr6c", "50000000", "471mo0000g", "prn1stj25q"], 1.0)
    before = assign_experts("run", 3, 6, peers)
    after = assign_experts("run", 3, 6, {p: c for p, c in peers.items() if p != "50000000"})
    extra = [n - unavoidable for n, unavoidable in _extra_moves(before, after, "50000000", 6)]
    assert max(extra) == 5 and max(extra) <= max_extra_moves(6)


def test_movement_on_average_is_close_to_the_unavoidable():
    """The measured claim in shards.py: on average < 2x the experts that must move."""
    total = unavoidable_total = 0
    for trial in range(150):
        rnd = random.Random(trial)
        peers = {f"peer{rnd.randrange(10**9)}": 1.0 for _ in range(rnd.randint(2, 12))}
        n_experts = rnd.choice([4, 8, 16, 32])
        a = assign_experts(f"run{trial}", 2, n_experts, peers)
        b = assign_experts(f"run{trial}", 2, n_experts, {**peers, "joiner": 1.0})
        for n, u in _extra_moves(a, b, "joiner", n_experts):
            total += n
            unavoidable_total += u
    assert unavoidable_total > 0
    assert total / unavoidable_total < 2.0


def test_small_swarm_is_balanced_where_plain_hrw_is_not():
    peers = {f"peer{i}": 1.0 for i in range(4)}
    a = assign_experts("run-balanced", 16, 8, peers)
    for p in peers:
        assert all(len(s) == 2 for s in a.owned_by(p).values())
        assert len(a.owned_by(p)) == 16


def test_capacity_weighting():
    a = assign_experts("run", 10, 8, {"big": 3.0, "small": 1.0})
    assert a.load() == {"big": 60, "small": 20}


def test_quotas_rotate_extra_experts_across_layers():
    peers = {f"p{i}": 1.0 for i in range(3)}  # 8 experts / 3 peers: two get 3, one gets 2
    got_two = set()
    for layer in range(30):
        quotas = layer_quotas("run", layer, 8, peers)
        got_two.add(min(quotas, key=quotas.__getitem__))
    assert len(got_two) == 3


def test_runs_hash_differently():
    peers = {f"p{i}": 1.0 for i in range(4)}
    assert assign_experts("run-a", 4, 8, peers).owners != assign_experts("run-b", 4, 8, peers).owners


@pytest.mark.parametrize(
    "peers, match",
    [
        ({}, "no live peers"),
        ({"a": 0.0}, "capacity"),
        ({"a": float("nan")}, "capacity"),
        ({"": 1.0}, "non-empty"),
    ],
)
def test_bad_input_is_a_value_error(peers, match):
    with pytest.raises(ValueError, match=match):
        assign_experts("run", 1, 8, peers)


@settings(max_examples=150, deadline=None)
@given(swarms, shapes, st.data())
def test_replicas_are_distinct_complete_and_loaded_exactly_to_their_quotas(peers, shape, data):
    n_layers, n_experts = shape
    replicas = data.draw(st.integers(1, len(peers)))
    r = assign_experts("run", n_layers, n_experts, peers, replicas=replicas)
    single = assign_experts("run", n_layers, n_experts, peers)
    total = sum(peers.values())
    for layer in range(n_layers):
        quotas = replica_quotas("run", layer, n_experts, peers, replicas)
        assert sum(quotas.values()) == replicas * n_experts and max(quotas.values()) <= n_experts
        if max(peers.values()) * replicas <= total:  # nobody capped: the plain capacity share
            for p, q in quotas.items():
                share = replicas * n_experts * peers[p] / total
                assert math.floor(share - 1e-9) <= q <= math.ceil(share + 1e-9)
        for expert in range(n_experts):
            owners = r.owners_of(layer, expert)
            assert len(set(owners)) == replicas and set(owners) <= set(peers)
            scores = [hrw_score("run", layer, expert, p, peers[p]) for p in owners]
            assert scores == sorted(scores, reverse=True)  # best rank first
            if replicas == 1:
                assert owners == (single.owner(layer, expert),)
        for p in peers:
            assert len(r.owned_by(p).get(layer, ())) == quotas[p]


def test_every_peer_owning_every_expert_and_too_few_peers():
    peers = {"a": 1.0, "b": 3.0, "c": 0.5}
    r = assign_experts("run", 2, 6, peers, replicas=3)
    assert all(set(r.owners_of(layer, e)) == set(peers) for layer in range(2) for e in range(6))
    assert r.load() == {"a": 12, "b": 12, "c": 12}
    capped = assign_experts("run", 2, 6, {"big": 10.0, "x": 1.0, "y": 1.0}, replicas=2)
    assert capped.load()["big"] == 12  # capped at every expert; the others share the rest equally
    assert capped.load()["x"] == capped.load()["y"] == 6
    with pytest.raises(ValueError, match="at least 4 live peers"):
        assign_experts("run", 1, 4, peers, replicas=4)
