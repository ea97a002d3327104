"""The robust merge against the attacks of the BTARD paper (Gorbunov et al. 2022, section 4) and ours.

Honest peers send noisy copies of one true pseudo-gradient; attackers send what the attack prescribes.
The measure is how far the merged result lands from the honest peers' own merge, against the honest
spread (how far one honest contribution lies from that merge): the plain merge is wrecked by each attack
(checked, so the attack is real); the robust merge lands within about one honest spread of it.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallax.node.train.merge_rules import merge_groups
from parallax.node.train.robust import RobustConfig, cap_weights, centered_clip, robust_merge_groups, span_of

DIM = 512


def _honest(n: int, seed: int = 0, noise: float = 0.5) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(DIM, generator=g)
    return true, [{"w": true + noise * torch.randn(DIM, generator=g)} for _ in range(n)]


def _attacks(honest: list[dict[str, torch.Tensor]], true: torch.Tensor) -> dict[str, torch.Tensor]:
    stack = torch.stack([h["w"] for h in honest])
    mean, std = stack.mean(0), stack.std(0)
    g = torch.Generator().manual_seed(7)
    return {
        "scale x1000": 1000 * honest[0]["w"],
        "sign flip x10": -10 * honest[0]["w"],
        "random 10x norm": torch.randn(DIM, generator=g) * 10 * float(true.norm()) / math.sqrt(DIM),
        "inner product manipulation": -4.0 * mean,  # IPM (Xie et al.): the negated mean, scaled
        "a little is enough": mean - 1.5 * std,  # ALIE (Baruch et al.): inside the spread per coordinate
        "constant direction": torch.full((DIM,), 50.0),
    }


def _error(merged: dict[str, torch.Tensor] | None, reference: torch.Tensor) -> float:
    assert merged is not None
    return float((merged["w"] - reference).norm() / reference.norm())


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("n_honest,n_bad", [(3, 1), (7, 2)])
def test_one_in_four_attackers_move_the_robust_merge_little(method: str, n_honest: int, n_bad: int) -> None:
    true, honest = _honest(n_honest)
    reference = merge_groups(honest, [1.0] * n_honest, method)["w"]
    spread = sum(_error(h, reference) for h in honest) / n_honest
    for name, bad in _attacks(honest, true).items():
        deltas = honest + [{"w": bad.clone()} for _ in range(n_bad)]
        weights = [1.0] * len(deltas)
        plain = _error(merge_groups(deltas, weights, method), reference)
        robust, audit = robust_merge_groups(deltas, weights, method)
        error = _error(robust, reference)
        assert error < 1.2 * spread, f"{name}: robust merge off by {error:.3f}, spread {spread:.3f}, plain {plain:.3f}"
        if name != "a little is enough":  # ALIE is built to pass as honest: it cannot be told apart, only bounded
            assert plain > 2 * error, f"{name}: the attack does not hurt the plain merge ({plain:.3f})"
        flagged = all(audit.contributions[i].suspicious for i in range(n_honest, len(deltas)))
        # The attacks far outside the honest spread are evidence against their sender; the subtle ones are bounded.
        assert flagged == (name not in ("a little is enough", "inner product manipulation")), name


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_nobody_attacking_gives_the_plain_merge_bit_for_bit(method: str) -> None:
    _, honest = _honest(4, seed=3, noise=0.3)
    weights = [3.0, 1.0, 2.0, 2.0]
    robust, audit = robust_merge_groups(honest, weights, method)
    assert robust is not None
    assert torch.equal(robust["w"], merge_groups(honest, weights, method)["w"])
    assert not any(c.suspicious for c in audit.contributions)


def test_non_finite_contributions_are_dropped_and_named() -> None:
    _, honest = _honest(3)
    nan = {"w": torch.full((DIM,), float("nan"))}
    inf = {"w": torch.zeros(DIM).index_fill_(0, torch.tensor([5]), float("inf"))}
    merged, audit = robust_merge_groups([honest[0], nan, honest[1], inf, honest[2]], [1.0] * 5)
    assert merged is not None and bool(torch.isfinite(merged["w"]).all())
    assert [c.dropped for c in audit.contributions] == ["", "non-finite", "", "non-finite", ""]
    assert torch.equal(merged["w"], merge_groups(honest, [1.0] * 3)["w"])


def test_nothing_left_to_merge_is_none() -> None:
    merged, audit = robust_merge_groups([{"w": torch.full((3,), float("nan"))}, {"w": torch.ones(3)}], [1.0, 0.0])
    assert merged is None
    assert [c.dropped for c in audit.contributions] == ["non-finite", "zero weight"]


def test_a_declared_weight_buys_no_more_than_the_cap() -> None:
    true, honest = _honest(3)
    bad = {"w": -true}
    weights = cap_weights([4096, 4096, 4096, 1e12], cap=4096)
    assert weights == [4096, 4096, 4096, 4096]
    assert cap_weights([float("nan"), -1, float("inf"), 10], cap=100) == [0.0, 0.0, 0.0, 10.0]
    merged, _ = robust_merge_groups(honest + [bad], weights)
    assert merged is not None and float(torch.cosine_similarity(merged["w"], true, dim=0)) > 0.8


def test_of_two_contributions_the_longer_is_held_to_twice_the_shorter() -> None:
    _, honest = _honest(2)
    merged, audit = robust_merge_groups(honest, [1.0, 1.0])  # within 2x of each other: the plain merge
    assert merged is not None and torch.equal(merged["w"], merge_groups(honest, [1.0, 1.0])["w"])
    big = [honest[0], {"w": 1000 * honest[1]["w"]}]  # a pair cannot tell who lies: it bounds both
    merged, audit = robust_merge_groups(big, [1.0, 1.0], "mean")
    assert merged is not None
    assert float(merged["w"].norm()) <= 1.5 * float(honest[0]["w"].norm()) * 1.01
    assert audit.contributions[1].norm_scale < 0.01 and audit.contributions[0].norm_scale == 1.0
    # ... and suspects neither: the longer of two may be an honest peer that trained more steps since the last round.
    assert not any(a.suspicious for a in audit.contributions) and not audit.contributions[1].judged
    three = [*big, honest[0]]  # with a majority the outlier is told, and suspected
    _, audit = robust_merge_groups(three, [1.0, 1.0, 1.0], "mean")
    assert [a.suspicious for a in audit.contributions] == [False, True, False]


def test_two_contributions_centre_on_their_mean() -> None:
    a, b = torch.tensor([0.0, 0.0]), torch.tensor([2.0, 0.0])
    centre, factors = centered_clip([a, b], [0.5, 0.5], tau=1.0, iters=5)
    assert torch.allclose(centre, torch.tensor([1.0, 0.0])) and factors == [1.0, 1.0]


def test_config_refuses_values_that_disable_the_defence() -> None:
    for bad in (dict(norm_clip=0.5), dict(tau=0.0), dict(tau=float("inf")), dict(iters=0), dict(min_contributions=2)):
        with pytest.raises(ValueError):
            RobustConfig(**bad)


def test_a_contribution_covering_several_periods_is_judged_per_period() -> None:
    _, honest = _honest(4, noise=0.1)
    carried = {"w": 3 * honest[3]["w"]}  # a peer whose last two rounds failed: three periods of progress
    deltas = [*honest[:3], carried]
    _, flat = robust_merge_groups(deltas, [1.0] * 4)
    _, spanned = robust_merge_groups(deltas, [1.0] * 4, spans=[1.0, 1.0, 1.0, span_of(3000, 1000)])
    assert flat.contributions[3].norm_scale < 1.0 and spanned.contributions[3].norm_scale == 1.0
    assert span_of(1e12, 1000) == 4.0 and span_of(10, 1000) == 1.0 and span_of(float("nan"), 1000) == 1.0


def test_an_honest_contribution_off_on_one_small_tensor_is_no_evidence() -> None:
    """Three peers that agree almost exactly on a small tensor (a final norm's weight early in training) and a
    fourth, honest, whose delta starts from an older anchor: it lies far outside the tiny radius on that tensor
    only. CenteredClip still bounds it there; it is not evidence against its sender."""
    g = torch.Generator().manual_seed(5)
    big, small = torch.randn(4096, generator=g), torch.randn(32, generator=g)

    def peer(spread: float) -> dict[str, torch.Tensor]:
        return {"big": big + 0.5 * torch.randn(4096, generator=g),
                "small": small + spread * torch.randn(32, generator=g)}

    deltas = [peer(1e-3), peer(1e-3), peer(1e-3), peer(0.5)]
    for method in ("rda", "mean"):
        merged, audit = robust_merge_groups(deltas, [1.0] * 4, method)
        assert merged is not None and audit.contributions[3].clip > 0.9
        assert not any(a.suspicious for a in audit.contributions), (method, audit)
    # The same contribution off on every tensor is evidence.
    deltas[3] = {"big": -10 * big, "small": -10 * small}
    _, audit = robust_merge_groups(deltas, [1.0] * 4)
    assert [a.suspicious for a in audit.contributions] == [False, False, False, True]


def test_a_composer_that_missed_the_first_merge_is_not_suspected() -> None:
    """Real composers of the tiny preset: three merge the backbone's first round and train on; the fourth, slower,
    sends its first pseudo-gradient, taken from the initial anchor. Its contribution is honest and must not count
    against it (three such rounds would ban it for ten minutes)."""
    from parallax.node.config.train import train_config
    from parallax.node.sim.simulator import replica_owners, shards_of
    from parallax.node.train.composer import Composer
    from parallax.node.train.data import load_corpus, shard, split_corpus

    cfg = train_config("tiny", steps=500)
    train, _ = split_corpus(load_corpus())
    owners = replica_owners(cfg, 4)
    shards = shards_of(owners, cfg.model.n_layers, 4)
    composers = [Composer(cfg, shards[i], shard(train, i, 4), sampler_seed=cfg.seed + 1 + i) for i in range(4)]
    cap = float(cfg.batch_size * cfg.model.seq_len * 10)

    def merge(indices: list[int]) -> tuple[dict[str, torch.Tensor] | None, list[bool]]:
        tokens = [composers[i].tokens_since_merge["backbone"] for i in indices]
        merged, audit = robust_merge_groups([composers[i].outer["backbone"].pseudo_gradient() for i in indices],
                                            cap_weights(tokens, cap), spans=[span_of(t, cap) for t in tokens])
        return merged, [a.suspicious for a in audit.contributions]

    for _ in range(10):
        for c in composers:
            c.train_step()
    merged, _ = merge([0, 1, 3])
    assert merged is not None
    for i in (0, 1, 3):
        composers[i].apply_outer("backbone", merged)
    for _ in range(20):
        for i in (0, 1, 3):
            composers[i].train_step()
    composers[2].train_step()
    _, suspected = merge([0, 1, 2, 3])
    assert suspected == [False] * 4
