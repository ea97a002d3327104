"""The in-process simulator: shards, surrogate publication, tiered merges, determinism, assembly."""

from __future__ import annotations

import pytest
import torch

from parallax.dht.shards import expert_bundles
from parallax.node.config import train as config
from parallax.node.outer.transport import encode_contribution
from parallax.node.outer.wire import SMALL_TENSOR_NUMEL, OuterSyncConfig
from parallax.node.sim.simulator import (
    LateMerges,
    RunSpec,
    assemble,
    bundle_outer,
    merge_outer,
    merge_round,
    ownership_for,
    publish,
    replica_owners,
    round_groups,
    run,
)
from parallax.node.train.composer import Composer, evaluate
from parallax.node.train.data import load_corpus, shard, split_corpus, val_batches
from parallax.node.train.outer import OuterOptimizer


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


def _three_trained(cfg: config.TrainConfig, train) -> list[Composer]:
    """Three composers of ``cfg`` on their shards of ``train``, three steps each."""
    shards = ownership_for(cfg, 3)
    composers = [Composer(cfg, shards[i], shard(train, i, 3), sampler_seed=i) for i in range(3)]
    for _ in range(3):
        for c in composers:
            c.train_step()
    return composers


def test_publication_mirrors_surrogates_and_merges_equalise_shared_groups(splits):
    cfg = _cfg()
    composers = _three_trained(cfg, splits[0])
    publish(composers, replica_owners(cfg, 3))
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


def test_round_groups_cover_every_composer_once_in_groups_of_at_most_the_bound_and_change_each_round():
    assert round_groups(5, 0, seed=1) == round_groups(5, 8, seed=1) == [[0, 1, 2, 3, 4]]
    for n, bound in ((16, 4), (10, 4), (7, 2), (3, 2)):
        groups = round_groups(n, bound, seed=7)
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert len(groups) == -(-n // bound) and all(len(g) <= bound for g in groups)
        assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert round_groups(16, 4, seed=7) == round_groups(16, 4, seed=7) != round_groups(16, 4, seed=8)
    with pytest.raises(ValueError, match="outer_group_size"):
        config.SimConfig(outer_group_size=1)


def test_a_round_in_groups_equalises_each_group_and_leaves_the_groups_apart(splits):
    cfg = _cfg()
    composers = _three_trained(cfg, splits[0])
    pair, alone = round_groups(3, 2, seed=3)
    merge_round(composers, "router", "rda", groups_of=2, seed=3)
    after = [c.model.group_parameters("router") for c in composers]
    name = "blocks.0.moe.router.weight"
    assert torch.equal(after[pair[0]][name], after[pair[1]][name])
    assert not torch.equal(after[pair[0]][name], after[alone[0]][name])
    assert all(c.tokens_since_merge["router"] == 0 for c in composers)  # the one alone applied its own


def test_a_sparse_gathered_round_sends_a_few_percent_and_each_sender_keeps_the_rest(splits):
    cfg = _cfg()
    composers = _three_trained(cfg, splits[0])
    before = [c.outer["backbone"].pseudo_gradient() for c in composers]
    uint8 = 2 * sum(len(encode_contribution(d, "uint8")) for d in before)  # each body to the 2 others
    topk = merge_round(composers, "backbone", "rda", "topk", "gather")
    assert 0 < topk < uint8, (topk, uint8)  # tensors under SMALL_TENSOR_NUMEL go raw either way: most of tiny's
    big = {n: t for n, t in before[0].items() if t.numel() >= SMALL_TENSOR_NUMEL}
    assert big and len(encode_contribution(big, "topk")) < len(encode_contribution(big, "uint8")) / 20
    after = [c.model.group_parameters("backbone") for c in composers]
    assert all(torch.equal(after[0][n], other[n]) for other in after[1:] for n in after[0])
    for c, delta in zip(composers, before, strict=True):  # what was not sent waits for the next round
        unsent = c.outer["backbone"].unsent
        assert unsent.keys() == delta.keys() and any(float(u.abs().max()) > 0 for u in unsent.values())


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


def test_with_two_replicas_each_expert_has_two_owners_who_merge_it_and_the_first_publishes(splits):
    train, val = splits
    cfg = config.replace(_cfg(), ownership=config.OwnershipConfig(replicas=2))
    owners = replica_owners(cfg, 3)
    assert all(len(set(who)) == 2 for who in owners.values())
    shards = ownership_for(cfg, 3)
    # 8 owner slots per layer among 3: 3, 3 and 2, the extra one rotating over the 2 layers
    assert sorted(sum(len(s) for s in shard_) for shard_ in shards) == [5, 5, 6]
    bundles = expert_bundles(owners)
    assert sorted(e for experts in bundles.values() for e in experts) == sorted(owners)
    composers = [Composer(cfg, shards[i], shard(train, i, 3), sampler_seed=i, replica_outers=True) for i in range(3)]
    outers = {members: [bundle_outer(composers[i], experts) for i in members] for members, experts in bundles.items()}
    for _ in range(2):
        for c in composers:
            c.train_step()
    eid, who = next(iter(owners.items()))
    first, second = (composers[i] for i in who)
    assert not torch.equal(first.model.expert_parameters(*eid)["w_up.weight"],
                           second.model.expert_parameters(*eid)["w_up.weight"])
    for members, held in outers.items():
        merge_outer(held, [1.0] * len(members), OuterSyncConfig(sync=cfg.sync))
    assert torch.equal(first.model.expert_parameters(*eid)["w_up.weight"],
                       second.model.expert_parameters(*eid)["w_up.weight"])
    publish(composers, owners)
    receiver = next(c for i, c in enumerate(composers) if i not in who)
    published = first.publishers[eid].published
    for name, tensor in published.items():
        assert torch.equal(receiver.model.surrogate_parameters(*eid)[name].data, tensor)
    assert second.publishers[eid].published is not published  # the second owner published nothing of it


def test_a_replicated_run_trains_and_refuses_what_assumes_one_owner(splits):
    train, val = splits
    cfg = config.replace(_cfg(steps=8), ownership=config.OwnershipConfig(replicas=2))
    result = run(RunSpec(name="r2", kind="parallax", cfg=cfg, composers=3), train, val)
    assert result.val_loss < 5.6
    assert 0 < result.owned_fraction < 1
    with pytest.raises(ValueError, match="at least that many composers"):
        run(RunSpec(name="r4", kind="parallax", cfg=config.replace(cfg, ownership=config.OwnershipConfig(replicas=4)),
                    composers=3), train, val)
    with pytest.raises(ValueError, match="offload"):
        run(RunSpec(name="r2", kind="offload", cfg=cfg, composers=3), train, val)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(splits):
    train, _ = splits
    cfg = config.replace(_cfg(), optim=config.OptimConfig(inner="muon"))
    composer = Composer(cfg, ownership_for(cfg, 2)[0], shard(train, 0, 2), sampler_seed=0)
    assert composer.matrix_optimizer is not None
    names = {id(p): n for n, p in composer.model.named_parameters()}
    muon = {names[id(p)] for p in composer.matrix_optimizer.param_groups[0]["params"]}
    adamw = {names[id(p)] for g in composer.optimizer.param_groups for p in g["params"]}
    assert "tok_emb.weight" in adamw and "tok_emb.weight" not in muon
    assert any(".moe.experts." in n for n in muon) and any(".attn.qkv." in n for n in muon)
    assert all(".moe.surrogates." not in n for n in muon | adamw)  # stand-ins are not trained
    assert not muon & adamw and all(composer.model.get_parameter(n).dim() == 2 for n in muon)
    before = {n: p.detach().clone() for n, p in composer.model.named_parameters() if n in muon | adamw}
    state = composer.optimizer_state_bytes()
    composer.train_step()
    assert all(not torch.equal(before[n], composer.model.get_parameter(n)) for n in before)
    assert composer.optimizer_state_bytes() > state  # Muon's momentum is counted


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


@pytest.mark.parametrize("how", ["progress", "drop", "freeze"])
def test_a_late_merge_lands_its_lag_later_on_what_the_group_did_meanwhile(how):
    weight = torch.nn.Parameter(torch.zeros(3))
    outer = OuterOptimizer({"w": weight}, lr=1.0, momentum=0.0)
    late = LateMerges(2, how)
    with torch.no_grad():
        weight.add_(torch.tensor([1.0, 2.0, 3.0]))  # trained since the anchor: the round's pseudo-gradient is -that
    late.send(10, outer, {"w": torch.tensor([-2.0, -2.0, -2.0])})
    with torch.no_grad():
        weight.add_(torch.tensor([0.5, 0.0, -0.5]))  # step 11, while the round is on its way
    late.land(11)
    held = [1.0, 2.0, 3.0] if how == "freeze" else [1.5, 2.0, 2.5]
    assert torch.equal(weight.detach(), torch.tensor(held))  # not landed yet
    assert torch.equal(outer.anchor["w"], torch.zeros(3))
    with torch.no_grad():
        weight.add_(torch.tensor([0.5, 0.0, -0.5]))  # step 12
    late.land(12)
    assert torch.equal(outer.anchor["w"], torch.tensor([2.0, 2.0, 2.0]))
    progress = torch.tensor([1.0, 0.0, -1.0]) if how == "progress" else torch.zeros(3)
    assert torch.equal(weight.detach(), torch.tensor([2.0, 2.0, 2.0]) + progress)
    late.land(40)
    assert torch.equal(weight.detach(), torch.tensor([2.0, 2.0, 2.0]) + progress)  # once only


def test_without_a_lag_a_merge_lands_at_once():
    weight = torch.nn.Parameter(torch.ones(2))
    outer = OuterOptimizer({"w": weight}, lr=1.0, momentum=0.0)
    LateMerges(0).send(5, outer, {"w": torch.tensor([0.5, -0.5])})
    assert torch.equal(weight.detach(), torch.tensor([0.5, 1.5]))


def test_a_run_whose_merges_land_late_trains_otherwise_and_ends_with_consistent_views(splits):
    train, val = splits
    cfg = _cfg(steps=12)
    lagged = config.replace(cfg, sim=config.SimConfig(merge_lag=1))
    on_time = run(RunSpec(name="on-time", kind="parallax", cfg=cfg, composers=2), train, val)
    late = run(RunSpec(name="late", kind="parallax", cfg=lagged, composers=2), train, val)
    assert late.composer_val_losses != on_time.composer_val_losses
    assert late.loss_history[-1][1] < 5.3
    # the last merges land at once after every one on its way: the views differ only in which experts are real
    assert late.assembled_val_loss == pytest.approx(late.val_loss, abs=0.05)


@pytest.mark.parametrize(("kind", "dense_steps", "replicas"), [
    ("diloco", 0, 1),  # the experts merge with the backbone, late as well
    ("parallax", 6, 1),  # every merge on its way lands at the split
    ("parallax", 0, 2),  # the replicated experts' rounds land late too
])
@pytest.mark.parametrize("how", ["progress", "drop", "freeze"])
def test_every_kind_of_round_lands_late_and_the_run_ends_with_every_merge_landed(splits, kind, dense_steps, replicas,
                                                                                 how):
    train, val = splits
    cfg = config.replace(_cfg(steps=12), sim=config.SimConfig(merge_lag=1, late_merge=how, dense_steps=dense_steps),
                         ownership=config.OwnershipConfig(replicas=replicas))
    late = run(RunSpec(name="late", kind=kind, cfg=cfg, composers=3), train, val)
    on_time = run(RunSpec(name="on-time", kind=kind, cfg=config.replace(cfg, sim=config.replace(cfg.sim, merge_lag=0)),
                          composers=3), train, val)
    assert late.composer_val_losses != on_time.composer_val_losses
    assert late.loss_history[-1][1] < 5.3
    assert late.assembled_val_loss == pytest.approx(late.val_loss, abs=0.05)


def test_a_merge_lag_of_a_whole_period_is_refused():
    with pytest.raises(ValueError, match="sim.merge_lag=2 must be below the shortest"):
        config.replace(_cfg(), sim=config.SimConfig(merge_lag=2))
    with pytest.raises(ValueError, match="one of"):
        LateMerges(1, "later")  # type: ignore[arg-type]
