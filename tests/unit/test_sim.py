"""The in-process simulator: shards, surrogate publication, tiered merges, determinism, assembly."""

from __future__ import annotations

import pytest
import torch

from parallax.node.config import train as config
from parallax.node.sim.simulator import RunSpec, assemble, merge_round, ownership_for, publish, run
from parallax.node.train.composer import Composer, evaluate
from parallax.node.train.data import load_corpus, shard, split_corpus, val_batches


@pytest.fixture(scope="module")
def splits():
    return split_corpus(load_corpus()[:200_000])


def _cfg(steps: int = 12, **sync) -> config.TrainConfig:
    periods = {"router": 2, "latent": 3, "backbone": 4} | sync
    return config.TrainConfig(
        model=config.preset("tiny"), steps=steps, batch_size=4, eval_batches=2,
        sync=config.SyncConfig(periods=periods),
        surrogate=config.SurrogateConfig(refresh_every=3, distill_steps=2, buffer_tokens=64),
    )


def test_shards_are_disjoint_and_cover_every_expert():
    cfg = _cfg()
    shards = ownership_for(cfg, 3)
    for layer in range(cfg.model.n_layers):
        owned = [s[layer] for s in shards]
        assert set().union(*owned) == set(range(cfg.model.n_experts))
        assert sum(len(o) for o in owned) == cfg.model.n_experts


def test_publication_mirrors_surrogates_and_merges_equalise_shared_groups(splits):
    train, _ = splits
    cfg = _cfg()
    shards = ownership_for(cfg, 3)
    composers = [Composer(cfg, shards[i], shard(train, i, 3), sampler_seed=i) for i in range(3)]
    for _ in range(3):
        for c in composers:
            c.train_step()
    publish(composers)
    for c in composers:  # every other composer's copy of a surrogate equals what its owner published
        for layer, expert in c.owned_experts():
            published = c.publishers[(layer, expert)].published
            for other in (o for o in composers if o is not c):
                got = other.model.surrogate_parameters(layer, expert)
                for name, tensor in published.items():
                    assert torch.equal(got[name].data, tensor), (layer, expert, name)
    before = [dict(c.model.group_parameters("router")) for c in composers]
    assert not torch.equal(before[0]["blocks.0.moe.router.weight"], before[1]["blocks.0.moe.router.weight"])
    merge_round(composers, "router", "rda")
    after = [c.model.group_parameters("router") for c in composers]
    for name in after[0]:
        assert torch.equal(after[0][name], after[1][name]) and torch.equal(after[0][name], after[2][name])
    assert all(c.tokens_since_merge["router"] == 0 for c in composers)
    assert all(c.tokens_since_merge["backbone"] > 0 for c in composers)


def test_assembled_model_takes_each_expert_from_its_owner(splits):
    train, val = splits
    cfg = _cfg()
    shards = ownership_for(cfg, 2)
    composers = [Composer(cfg, shards[i], shard(train, i, 2), sampler_seed=i) for i in range(2)]
    for c in composers:
        c.train_step()
    model = assemble(composers, cfg)
    for c in composers:
        for layer, expert in c.owned_experts():
            for name, p in c.model.expert_parameters(layer, expert).items():
                assert torch.equal(model.expert_parameters(layer, expert)[name], p)
    assert evaluate(model, val_batches(val, 2, cfg.model.seq_len, 1)) > 0


@pytest.mark.parametrize("kind", ["parallax", "diloco", "baseline"])
def test_runs_are_reproducible_and_learn(splits, kind):
    train, val = splits
    spec = RunSpec(name=kind, kind=kind, cfg=_cfg(steps=12), composers=2)
    a = run(spec, train, val)
    b = run(spec, train, val)
    assert a.composer_val_losses == b.composer_val_losses
    assert a.assembled_val_loss == b.assembled_val_loss
    assert a.loss_history[-1][1] < 5.3 < torch.log(torch.tensor(256.0)).item()
    assert a.tokens == 12 * 4 * 2 * cfg_seq()
    if kind == "parallax":
        assert 0 < a.owned_fraction < 1
        # After the final merge and publication, the composers' views differ only in which experts are real.
        assert a.assembled_val_loss == pytest.approx(a.val_loss, abs=0.05)
        assert [step for step, _, _ in a.stand_in_error] == [3, 6, 9, 12]
        assert a.stand_in_error == b.stand_in_error


def test_receivers_surrogates_follow_their_experts_closer_with_a_longer_fit(splits):
    train, val = splits
    errors = {}
    for steps, weight in ((2, 0.0), (64, 0.0), (64, 1.0)):
        cfg = _cfg(steps=6)
        cfg = config.replace(cfg, surrogate=config.replace(cfg.surrogate, distill_steps=steps, jacobian_weight=weight))
        errors[steps, weight] = run(RunSpec(name="p", kind="parallax", cfg=cfg, composers=2), train, val).stand_in_error
    (_, short_out, short_back), (_, long_out, long_back), (_, jac_out, jac_back) = (
        errors[k][-1] for k in ((2, 0.0), (64, 0.0), (64, 1.0)))
    assert long_out < 0.5 * short_out
    assert jac_back < long_back  # the input-gradient term teaches the backward pass too


def cfg_seq() -> int:
    return config.preset("tiny").seq_len


def test_ablations_run(splits):
    train, val = splits
    for mode in ("drop", "frozen_copy"):
        cfg = _cfg(steps=6)
        cfg = config.replace(cfg, surrogate=config.replace(cfg.surrogate, non_owned=mode))
        result = run(RunSpec(name=mode, kind="parallax", cfg=cfg, composers=2), train, val)
        assert result.val_loss < 5.6


def test_dense_start_up_splits_the_merged_experts_into_the_shards(splits):
    """sim.dense_steps: every composer trains every expert until the split; then each keeps its shard of
    the experts as they were right after their last merge, and surrogates for the rest."""
    train, _ = splits
    cfg = _cfg()
    shards = ownership_for(cfg, 2)
    everything = tuple(frozenset(range(cfg.model.n_experts)) for _ in range(cfg.model.n_layers))
    composers = [Composer(cfg, everything, shard(train, i, 2), sampler_seed=i,
                          merged_groups=(*config.SHARED_GROUPS, "expert")) for i in range(2)]
    for _ in range(3):
        for c in composers:
            c.train_step()
    for group in (*config.SHARED_GROUPS, "expert"):
        merge_round(composers, group, "rda")
    merged = {eid: composers[0].expert_state(eid) for eid in composers[0].owned_experts()}
    for c, owned in zip(composers, shards, strict=True):
        c.split_experts(owned)
        assert c.owned == owned and "expert" not in c.outer and c.owned_fraction == 0.0
        for eid in c.owned_experts():
            for name, t in c.expert_state(eid).items():
                torch.testing.assert_close(t, merged[eid][name], atol=1e-5, rtol=0)  # the merged copy, kept
        trained = {id(p) for g in c.optimizer.param_groups for p in g["params"]}
        assert all(id(p) in trained for eid in c.owned_experts() for p in c.model.expert_parameters(*eid).values())
        assert {id(p) for p in c.optimizer.state} <= trained  # released experts' AdamW state is gone
        c.train_step()  # and training goes on with the shard
    with pytest.raises(ValueError, match="expert"):
        composers[0].split_experts(shards[0])  # only once


def test_a_run_with_a_dense_start_up_pays_for_it_in_memory_traffic_and_flops(splits):
    train, val = splits
    cfg = _cfg(steps=10)
    dense = config.replace(cfg, sim=config.replace(cfg.sim, dense_steps=4))
    split, start_dense = (run(RunSpec(name=n, kind="parallax", cfg=c, composers=2), train, val)
                          for n, c in (("split", cfg), ("dense", dense)))
    assert start_dense.val_loss < 5.6 and start_dense.tokens == split.tokens
    assert 0 < start_dense.owned_fraction < 1  # measured over the sharded phase
    assert start_dense.params_per_composer > split.params_per_composer
    assert start_dense.network_bytes["outer"] > split.network_bytes["outer"]  # the experts' merges
    assert start_dense.train_flops > split.train_flops
    with pytest.raises(ValueError, match="dense_steps"):
        never = config.replace(cfg, sim=config.replace(cfg.sim, dense_steps=10))
        run(RunSpec(name="never", kind="parallax", cfg=never, composers=2), train, val)
    with pytest.raises(ValueError, match="dense_steps"):
        config.SimConfig(dense_steps=-1)
