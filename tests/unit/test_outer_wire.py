"""The pure parts of the network outer sync: packing the RDA components, rebuilding, fingerprints, config."""

from __future__ import annotations

import pytest
import torch

from parallax.dht.keys import outer_prefix, outer_rounds_key, protected_keys
from parallax.node.outer.wire import (
    FP_SLOTS,
    ROUNDS_KEPT,
    SMALL_TENSOR_NUMEL,
    OuterSyncConfig,
    _hash_signs,
    anchor_fingerprint,
    anchor_majority,
    component_shapes,
    component_tensors,
    decode_fingerprint,
    encode_fingerprint,
    encode_round_record,
    fingerprint,
    fingerprints_agree,
    majority_agrees,
    merged_from_components,
    payload_bytes,
    round_fingerprint,
    round_tag,
    set_anchor,
    wire_roundtrip,
)
from parallax.node.train.merge_rules import merge_groups

SHAPES = {"w": (6, 5), "b": (5,), "c": (7,), "z": (3,)}


def _deltas(k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(k)]
    d = torch.randn(SHAPES["c"], generator=g)
    for i, delta in enumerate(out):
        delta["c"] = d * (1.0 if i % 2 == 0 else -1.0)  # cancels with equal weights on an even k
        delta["z"] = torch.zeros(SHAPES["z"])  # nobody moved: zero direction, zero norm
    return out


def _weighted_means(parts: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    """What hivemind's averager leaves in every buffer: sum_i w_i x_i / sum_i w_i."""
    total = sum(weights)
    return [sum(w * p[j] for w, p in zip(weights, parts, strict=True)) / total for j in range(len(parts[0]))]


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("weights", [[1.0, 1.0], [1.0, 3.0, 0.5], [2.0, 2.0, 5.0, 0.0]])
def test_pack_mean_rebuild_equals_merge_groups(method, weights):
    deltas = _deltas(len(weights))
    parts = [component_tensors(d, method) for d in deltas]
    assert [p.shape for p in parts[0]] == component_shapes(SHAPES, method)
    merged = merged_from_components(_weighted_means(parts, weights), SHAPES, method)
    reference = merge_groups(deltas, weights, method=method)
    assert list(merged) == list(reference)
    for name in SHAPES:
        assert merged[name].dtype == torch.float32
        torch.testing.assert_close(merged[name], reference[name], rtol=1e-5, atol=1e-6)


def test_rda_layout_directions_scaled_then_norms_then_deltas():
    delta = {"a": torch.tensor([3.0, 4.0, 0.0, 0.0]), "b": torch.zeros(2)}
    dir_a, dir_b, norms, raw_a, raw_b = component_tensors(delta, "rda")
    torch.testing.assert_close(dir_a, torch.tensor([0.6, 0.8, 0.0, 0.0]) * 2.0)  # unit direction * sqrt(4)
    assert torch.equal(dir_b, torch.zeros(2))
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.0]))
    assert torch.equal(raw_a, delta["a"]) and torch.equal(raw_b, delta["b"])
    assert component_shapes({"a": (4,), "b": (2,)}, "mean") == [torch.Size([4]), torch.Size([2])]


def test_rebuild_refuses_wrong_buffers_and_does_not_alias():
    means = component_tensors({"a": torch.ones(3)}, "mean")
    merged = merged_from_components(means, {"a": (3,)}, "mean")
    merged["a"].add_(1)
    assert torch.equal(means[0], torch.ones(3))
    with pytest.raises(ValueError, match="shapes"):
        merged_from_components(means, {"a": (3,)}, "rda")
    with pytest.raises(ValueError, match="merge rule"):
        component_tensors({"a": torch.ones(3)}, "median")


def test_compression_aware_eps_falls_back_to_mean_when_directions_nearly_cancel():
    d = torch.randn(100)
    near = [{"a": d}, {"a": -d + 1e-3 * torch.randn(100)}]
    means = _weighted_means([component_tensors(x, "rda") for x in near], [1.0, 1.0])
    mean_delta = (near[0]["a"] + near[1]["a"]) / 2
    torch.testing.assert_close(merged_from_components(means, {"a": (100,)}, "rda", eps=0.05)["a"], mean_delta)
    exact = merged_from_components(means, {"a": (100,)}, "rda", eps=1e-9)["a"]
    assert not torch.allclose(exact, mean_delta)


def _splitmix_sign(index: int, seed: int) -> float:
    mask = (1 << 64) - 1
    z = (index + (seed * 0x9E3779B97F4A7C15 & mask) + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return -1.0 if z >> 63 else 1.0


def test_projection_signs_are_fixed_across_machines_and_versions():
    assert _hash_signs(12, 1).tolist() == [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
    assert _hash_signs(50, 12345).tolist() == [_splitmix_sign(i, 12345) for i in range(50)]


def _fp16_roundtrip_noise(avg: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """What one peer gets back from an fp16 all-reduce: its own value plus the fp16 delta to the mean."""
    return local + (avg - local.half().float()).half().float()


def test_fingerprints_tolerate_fp16_rounding_but_not_a_broken_round():
    g = torch.Generator().manual_seed(3)
    locals_ = [torch.randn(10_000, generator=g) * 0.01 for _ in range(3)]
    avg = sum(locals_) / 3
    results = [_fp16_roundtrip_noise(avg, x) for x in locals_]
    assert not torch.equal(results[0], results[1])  # peers never agree bit for bit
    fps = [fingerprint([r, r[:7].clone()], [float(x.norm()), float(x[:7].norm())])
           for r, x in zip(results, locals_, strict=True)]
    tol = OuterSyncConfig.of(compression="fp16").tolerance
    assert all(fingerprints_agree(fps[0], fp, tol) for fp in fps)

    def broken(change) -> tuple[float, ...]:
        r = results[1].clone()
        change(r)
        return fingerprint([r, r[:7].clone()], [float(locals_[1].norm()), float(locals_[1][:7].norm())])

    for change in (lambda r: r[:100].mul_(3.0),  # part of the tensor left un-averaged
                   lambda r: r.copy_(locals_[1]),  # nothing averaged
                   lambda r: r.neg_(),
                   lambda r: r[5].add_(1.0),  # one entry
                   lambda r: r[0].fill_(float("nan"))):
        assert not fingerprints_agree(fps[0], broken(change), tol)


def test_fingerprint_is_small_and_round_trips():
    tensors = [torch.randn(s) for s in [(50, 3)] * 40]
    fp = fingerprint(tensors, [1.0] * 40)
    assert len(fp) == 4 * FP_SLOTS  # 40 tensors share 16 slots
    value = encode_fingerprint(fp)
    assert len(value) <= 300
    decoded = decode_fingerprint(value)
    assert decoded is not None and fingerprints_agree(fp, decoded, 1e-6)
    assert fingerprint(tensors, [1.0] * 40) == fp  # deterministic
    for junk in (b"", b"PXF1", value[:-1], b"XXXX" + value[4:], "text", None, value + b"\0\0\0\0"):
        assert decode_fingerprint(junk) is None
    assert not fingerprints_agree(fp, fp[:4], 1.0)
    with pytest.raises(ValueError, match="local norms"):
        fingerprint(tensors, [1.0])


def test_zero_merge_agrees_with_itself():
    fp = fingerprint([torch.zeros(5)], [0.0])
    assert fingerprints_agree(fp, fp, 1e-5)
    assert majority_agrees(fp, {"b": fp}, 2, 1e-5) == (True, 2)


def test_an_anchor_apart_from_the_majoritys_is_named_with_the_peers_that_hold_theirs():
    g = torch.Generator().manual_seed(0)
    swarm = [torch.randn(300, 40, generator=g), torch.randn(40, generator=g)]
    same = anchor_fingerprint(swarm)
    rounding = anchor_fingerprint([t * (1 + 1e-6) for t in swarm])  # float rounding across kinds of hardware
    drifted = anchor_fingerprint([swarm[0] + 0.02 * torch.randn(300, 40, generator=g), swarm[1]])  # a missed round
    assert anchor_majority(drifted, {"a": same, "b": rounding, "c": same}, 4) == ("a", "b", "c")
    assert anchor_majority(drifted, {"a": same, "b": rounding, "c": drifted}, 5) == ()  # 2 of 5
    assert anchor_majority(drifted, {"a": same, "b": same}, 3) == ("a", "b")
    assert anchor_majority(same, {"a": same, "b": drifted}, 3) == ()  # ours is the majority's
    assert anchor_majority(drifted, {"a": same}, 3) == ()  # one of three is no majority
    assert anchor_majority(drifted, {"a": same, "b": drifted}, 4) == ()  # two anchors, two each: nobody to follow
    assert len(anchor_fingerprint(swarm * 5)) == 16  # four slots at most: it travels in every round entry


def test_a_merge_leaves_out_the_contributions_taken_from_another_anchor_than_its_sets_majoritys():
    g = torch.Generator().manual_seed(1)
    swarm = [torch.randn(300, 40, generator=g), torch.randn(40, generator=g)]
    same, rounding = anchor_fingerprint(swarm), anchor_fingerprint([t * (1 + 1e-6) for t in swarm])
    stale = anchor_fingerprint([swarm[0] + 0.02 * torch.randn(300, 40, generator=g), swarm[1]])
    assert set_anchor({"a@1": same, "b@2": rounding, "c@1": stale})[1] == {"c@1"}
    assert set_anchor({"a@1": stale, "b@2": same, "c@1": rounding, "d@4": None, "e@2": same})[1] == {"a@1", "d@4"}
    assert set_anchor({"a@1": stale, "b@2": same, "c@1": rounding, "d@4": None})[1] == set()  # 2 of 4: no majority
    assert set_anchor({"a@1": same, "b@2": same, "c@1": stale, "d@4": stale})[1] == set()  # no majority: merged whole
    assert set_anchor({"a@1": same, "b@2": None, "c@1": None})[1] == set()  # one of three names an anchor
    assert set_anchor({"a@1": None, "b@2": None})[1] == set()  # rounds that name none (replicated experts)
    assert set_anchor({"a@1": same, "b@2": same})[1] == set()
    # The anchor the merge is a step from: the majority's, or none.
    anchor, left_out = set_anchor({"a@1": stale, "b@2": same, "c@1": rounding})
    assert anchor in (same, rounding) and left_out == {"a@1"}
    assert set_anchor({"a@1": same, "b@2": same, "c@1": stale, "d@4": stale}) == (None, set())
    assert set_anchor({"a@1": None, "b@2": None}) == (None, set())


def test_majority_counts_absent_and_disagreeing_participants_against_me():
    good = fingerprint([torch.ones(10)], [1.0])
    bad = fingerprint([torch.ones(10) * 2], [1.0])
    assert majority_agrees(good, {"b": good, "c": bad}, 3, 1e-3) == (True, 2)
    assert majority_agrees(bad, {"a": good, "b": good}, 3, 1e-3) == (False, 1)
    assert majority_agrees(good, {"b": good}, 4, 1e-3) == (False, 2)  # 2 of 4 is no majority
    assert majority_agrees(good, {}, 2, 1e-3) == (False, 1)  # the other never answered
    nan = (float("nan"),) + good[1:]
    assert majority_agrees(nan, {"b": nan}, 2, 1e-3) == (False, 0)


def test_config_defaults_and_validation():
    internet, loopback = OuterSyncConfig.of(compression="fp16"), OuterSyncConfig.loopback()
    assert internet.net.request_timeout_s < internet.net.min_matchmaking_time_s < internet.net.matchmaking_timeout_s
    assert loopback.round_budget_s < 60 < internet.round_budget_s
    assert OuterSyncConfig.of(compression="none").tolerance < internet.tolerance
    assert OuterSyncConfig.of(compression="none").rda_eps == 1e-6 and internet.rda_eps == 0.05
    assert internet.tolerance < OuterSyncConfig.of(compression="uint8").tolerance < 0.5
    for bad in (dict(merge="median"), dict(compression="int8"), dict(min_group_size=1),
                dict(target_group_size=1), dict(request_timeout_s=20.0),
                dict(matchmaking_timeout_s=10.0), dict(verify_timeout_s=0), dict(fingerprint_tolerance=2.0),
                dict(next_chunk_timeout_s=300.0),
                dict(compression="topk", aggregation="allreduce"), dict(compression="int4", aggregation="allreduce")):
        with pytest.raises(ValueError, match="SyncConfig|net.outer"):
            OuterSyncConfig.of(**bad)


def test_names():
    assert outer_prefix("run-1", "router") == "run-1/outer/router"
    assert outer_rounds_key("run-1", "backbone") == "run-1/outer/backbone/rounds"
    assert "run-1/outer/backbone/rounds" in protected_keys("run-1", 2, ["router", "backbone"])
    for run_id, group in (("run.1", "router"), ("run", "a.b"), ("run", ""), ("run", "a/b"), ("bad run", "x")):
        with pytest.raises(ValueError):
            outer_prefix(run_id, group)


def test_a_fingerprint_counts_only_for_the_round_it_was_made_in():
    fp = (1.0, 2.0, 3.0, 4.0)
    tag = round_tag(10, ["b", "a"])
    assert tag == round_tag(10, ["a", "b"])  # the participants' order does not matter
    value = encode_fingerprint(fp, tag)
    assert decode_fingerprint(value, tag) == fp
    # the same round number among other peers (peers at other steps meet under the largest number)
    assert decode_fingerprint(value, round_tag(10, ["a", "c"])) is None
    assert decode_fingerprint(value, round_tag(11, ["a", "b"])) is None


@pytest.mark.parametrize(("compression", "bytes_per_entry", "max_err"), [("none", 4, 0.0), ("fp16", 2, 1e-3),
                                                                         ("uint8", 1, 0.08)])
def test_wire_rounding_and_bytes_by_compression(compression, bytes_per_entry, max_err):
    g = torch.Generator().manual_seed(3)
    big = torch.randn(64, 128, generator=g) * 1e-3
    small = torch.randn(SMALL_TENSOR_NUMEL - 1, generator=g)
    back = wire_roundtrip(big, compression)
    assert back.shape == big.shape and back.dtype == torch.float32
    assert float((back - big).norm() / big.norm()) <= max_err
    assert torch.equal(wire_roundtrip(small, compression), small)  # small tensors always go exact
    config = OuterSyncConfig.of(merge="mean", compression=compression)
    codebook = 8 + 256 * 4 if compression == "uint8" else 0
    assert payload_bytes({"big": big.shape, "small": small.shape}, config) == (
        bytes_per_entry * big.numel() + codebook + 4 * small.numel())
    rda = OuterSyncConfig.of(merge="rda", compression=compression)  # directions + norms + raw deltas
    assert payload_bytes({"big": big.shape}, rda) == 2 * (bytes_per_entry * big.numel() + codebook) + 4


def test_uint8_rounding_stays_within_its_fingerprint_tolerance():
    # Two peers of a uint8 round hold local + round(mean - local): their fingerprints must still agree,
    # and a result merged from a subset of the peers must not.
    deltas = _deltas(3, seed=5)
    deltas = [{n: t.repeat(1000) if t.dim() == 1 else t.repeat(100, 100) for n, t in d.items()} for d in deltas]
    merged = merge_groups(deltas, [1.0, 1.0, 1.0], method="mean")
    local_norms = [float(t.norm()) for t in deltas[0].values()]
    tol = OuterSyncConfig.of(compression="uint8").tolerance
    views = [[d[n] + wire_roundtrip(merged[n] - d[n], "uint8") for n in merged] for d in deltas]
    fps = [fingerprint(v, local_norms) for v in views]
    assert fingerprints_agree(fps[0], fps[1], tol) and fingerprints_agree(fps[1], fps[2], tol)
    subset = merge_groups(deltas[:2], [1.0, 1.0], method="mean")
    assert not fingerprints_agree(fps[0], fingerprint(list(subset.values()), local_norms), tol)


def test_a_round_record_keeps_the_latest_rounds_and_yields_only_the_one_asked_for() -> None:
    fps = {n: (float(n), 2.0, 3.0, 4.0) for n in range(ROUNDS_KEPT + 2)}
    tags = {n: round_tag(n, ["p1", "p2"]) for n in fps}
    record = encode_round_record([encode_fingerprint(fp, tags[n]) for n, fp in fps.items()])
    newest = sorted(fps)[-ROUNDS_KEPT:]
    for n in fps:
        assert round_fingerprint(record, tags[n]) == (fps[n] if n in newest else None)
    assert round_fingerprint(record, round_tag(newest[-1], ["p1", "p3"])) is None  # other participants
    for junk in (b"", b"\xc1", b"x" * 5000, 7, None, encode_round_record([b"junk"])):
        assert round_fingerprint(junk, tags[newest[-1]]) is None
