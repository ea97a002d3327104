"""Radial-directional averaging: length kept, direction averaged, plain-mean fallback, one implementation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax.node.train.merge_rules import merge_groups
from parallax.node.train.rda import mean_merge, rda_components, rda_merge, rda_rebuild


def test_orthogonal_deltas_keep_their_norm():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    merged = rda_merge([a, b], [1.0, 1.0])
    assert torch.linalg.vector_norm(merged).item() == pytest.approx(2.0)
    assert torch.allclose(merged, torch.tensor([math.sqrt(2), math.sqrt(2)]))
    assert torch.linalg.vector_norm(mean_merge([a, b], [1, 1])).item() == pytest.approx(math.sqrt(2))


def test_single_learner_gets_its_own_delta():
    d = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(rda_merge([d], [123.0]), d, atol=1e-6)
    assert torch.allclose(mean_merge([d], [123.0]), d)


def test_opposite_deltas_fall_back_to_mean_without_nan():
    d = torch.tensor([1.0, -3.0, 2.0])
    merged = rda_merge([d, -d], [5, 5])
    assert torch.isfinite(merged).all()
    assert torch.equal(merged, torch.zeros(3))


def test_zero_deltas_give_no_nan():
    z = torch.zeros(4)
    assert torch.equal(rda_merge([z, z], [1, 1]), z)
    direction, norm = rda_components(z)
    assert torch.equal(direction, z) and norm.shape == (1,) and norm.item() == 0
    # One composer that did not move: half the length, the mover's direction.
    merged = rda_merge([torch.tensor([0.0, 4.0, 0.0, 0.0]), z], [1, 1])
    assert torch.allclose(merged, torch.tensor([0.0, 2.0, 0.0, 0.0]))


def test_weights_respected():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    merged = rda_merge([a, b], [3, 1])
    # norm = (3*1 + 1*3)/4 = 1.5; direction ~ (0.75, 0.25) normalised.
    expected = 1.5 * torch.tensor([0.75, 0.25]) / math.hypot(0.75, 0.25)
    assert torch.allclose(merged, expected)
    assert torch.allclose(mean_merge([a, b], [3, 1]), torch.tensor([0.75, 0.75]))
    # A zero weight drops the delta entirely.
    assert torch.allclose(rda_merge([a, b], [0, 2]), b)


@pytest.mark.parametrize("weights", [[0, 0], [-1, 2], [float("nan"), 1], [1]])
def test_bad_weights_refused(weights):
    with pytest.raises(ValueError):
        rda_merge([torch.ones(2), torch.ones(2)], weights)


def test_shape_mismatch_refused():
    with pytest.raises(ValueError, match="shape"):
        mean_merge([torch.ones(2), torch.ones(3)], [1, 1])


def test_low_precision_inputs_computed_in_float32():
    d = torch.full((1000,), 300.0, dtype=torch.float16)  # norm 9487 is fine, its square overflows fp16
    merged = rda_merge([d, d], [1, 1])
    assert merged.dtype == torch.float32 and torch.allclose(merged, d.float())


def _decompose_mean_rebuild(deltas, weights):
    """What the network does: each peer decomposes, the averager takes weighted means, all rebuild."""
    total = sum(weights)
    parts = [(*rda_components(d), d) for d in deltas]
    means = [sum(w / total * p[i] for w, p in zip(weights, parts, strict=True)) for i in range(3)]
    return rda_rebuild(*means)


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 5),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_decompose_mean_rebuild_equals_rda_merge(k, n, seed, data):
    g = torch.Generator().manual_seed(seed)
    deltas = [torch.randn(n, generator=g) * float(torch.rand(1, generator=g) * 10) for _ in range(k)]
    weights = data.draw(st.lists(st.floats(0.1, 1000), min_size=k, max_size=k))
    expected = rda_merge(deltas, weights)
    assert torch.allclose(_decompose_mean_rebuild(deltas, weights), expected, atol=1e-5, rtol=1e-4)
    pairs = list(zip(weights, deltas, strict=True))
    mean_direction = sum(w * rda_components(d)[0] for w, d in pairs) / sum(weights)
    if torch.linalg.vector_norm(mean_direction) < 1e-6:  # cancelled: the fallback is the plain mean
        assert torch.allclose(expected, mean_merge(deltas, weights))
        return
    # RDA never shrinks below the mean's norm and its norm is the weighted mean of the norms.
    mean_norm = sum(w * torch.linalg.vector_norm(d) for w, d in pairs) / sum(weights)
    assert torch.linalg.vector_norm(expected).item() == pytest.approx(mean_norm.item(), rel=1e-4)
    assert torch.linalg.vector_norm(expected) >= torch.linalg.vector_norm(mean_merge(deltas, weights)) - 1e-5


def test_merge_groups_per_tensor():
    g = torch.Generator().manual_seed(1)
    groups = [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)} for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    out = merge_groups(groups, weights)
    assert list(out) == ["w", "b"]
    for name in ("w", "b"):
        assert torch.equal(out[name], rda_merge([d[name] for d in groups], weights))
    means = merge_groups(groups, weights, method="mean")
    assert torch.allclose(means["b"], mean_merge([d["b"] for d in groups], weights))
    with pytest.raises(ValueError, match="merge rule"):
        merge_groups(groups, weights, method="median")
    with pytest.raises(ValueError, match="tensors"):
        merge_groups([groups[0], {"w": groups[1]["w"]}], [1, 1])


def test_the_merge_setting_names_exactly_the_registered_rules() -> None:
    import typing

    from parallax.node.config.train import MergeName
    from parallax.node.train.merge_rules import MERGE_RULES, merge_rule

    assert set(typing.get_args(MergeName)) == set(MERGE_RULES)
    with pytest.raises(ValueError, match="rda, mean"):
        merge_rule("median")
