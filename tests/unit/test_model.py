"""The MoE model: owned experts train, surrogates are forward-only, gates still learn, groups are right."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parallax.node.config.train import GROUPS, ModelConfig, preset
from parallax.node.model.transformer import (
    InitialWeights,
    KVCache,
    MoELayer,
    MoETransformer,
    expert_prefix,
    group_of,
    own_all,
)

TINY = preset("tiny")


def _layer(owned, non_owned="surrogate", cfg: ModelConfig = TINY) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(cfg, 0, owned, non_owned)
    for p in layer.parameters():  # non-trivial weights everywhere, surrogates included
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_surrogates_get_no_gradient_and_add_none_to_their_inputs():
    layer = _layer(owned=set())  # every selection is a surrogate
    x = torch.randn(2, 16, TINY.d_model, requires_grad=True)
    y, _ = layer(x)
    y.sum().backward()
    assert all(p.grad is None for p in layer.surrogates.parameters())
    router_grad = layer.router.weight.grad
    assert router_grad is not None and router_grad.abs().sum() > 0, "gates of surrogate selections must learn"
    # latent_down feeds only the experts' inputs: a gradient there would have come through a surrogate.
    assert layer.latent_down.weight.grad is None, "surrogates must not backpropagate into their input"


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("non_owned", ["surrogate", "drop"])
def test_one_token_in_evaluation_gets_the_output_it_gets_among_others(renormalize, non_owned):
    # The generation path (gates from the top logits, experts one after another, no balance loss) against the
    # general one on the same token inside a batch; half the experts owned, the rest stood in for or dropped.
    cfg = dataclasses.replace(TINY, renormalize_gates=renormalize)
    layer = _layer(owned={0, 1}, non_owned=non_owned, cfg=cfg).eval()
    x = torch.randn(1, 5, cfg.d_model)
    with torch.no_grad():
        among, _ = layer(x)
        for t in range(5):
            alone, stats = layer(x[:, t:t + 1])
            torch.testing.assert_close(alone[0, 0], among[0, t], rtol=1e-4, atol=1e-5)  # summed in another order
            assert stats.aux_loss is None and int(stats.tokens_per_expert.sum()) == cfg.top_k


@pytest.mark.parametrize("non_owned", ["surrogate", "frozen_copy"])
def test_stand_in_input_grad_reaches_the_input_not_the_weights(non_owned):
    layer = _layer(owned=set(), non_owned=non_owned)
    layer.stand_in_input_grad = True
    x = torch.randn(2, 16, TINY.d_model, requires_grad=True)
    y, _ = layer(x)
    y.sum().backward()
    frozen = layer.surrogates.parameters() if non_owned == "surrogate" else layer.experts.parameters()
    assert all(p.grad is None for p in frozen)
    assert layer.latent_down.weight.grad is not None and layer.latent_down.weight.grad.abs().sum() > 0


def test_offloaded_experts_with_input_grad_pass_the_direct_input_gradient_and_keep_their_weights():
    """offload.input_grad: the latent interface gets the same gradient as when the expert trains here,
    and the expert's weights get none (a worker updates them)."""
    x = torch.randn(2, 16, TINY.d_model)
    direct = _layer(owned=set(range(TINY.n_experts)))
    direct(x)[0].sum().backward()
    offloaded = _layer(owned=set(range(TINY.n_experts)))
    for e in range(TINY.n_experts):
        offloaded.set_offloaded(e, True)
    offloaded(x)[0].sum().backward()
    assert offloaded.latent_down.weight.grad is None  # forward only by default: nothing reaches the input
    offloaded.zero_grad(set_to_none=True)
    offloaded.offload_input_grad = True
    offloaded(x)[0].sum().backward()
    assert all(p.grad is None for p in offloaded.experts.parameters())
    torch.testing.assert_close(offloaded.latent_down.weight.grad, direct.latent_down.weight.grad)
    torch.testing.assert_close(offloaded.router.weight.grad, direct.router.weight.grad)


def test_owned_experts_train_and_their_gates_learn():
    layer = _layer(owned={0, 1, 2, 3})
    x = torch.randn(2, 16, TINY.d_model)
    y, _ = layer(x)
    y.pow(2).sum().backward()
    for e in range(TINY.n_experts):
        grads = [p.grad for p in layer.experts[str(e)].parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in grads), f"expert {e} got no gradient"
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.latent_down.weight.grad.abs().sum() > 0


def test_non_owned_experts_are_not_materialised_and_surrogates_are_frozen():
    layer = _layer(owned={1})
    assert set(layer.experts.keys()) == {"1"}
    assert not any(p.requires_grad for p in layer.surrogates.parameters())


def test_frozen_copies_are_forward_only():
    layer = _layer(owned={1}, non_owned="frozen_copy")
    assert set(layer.experts.keys()) == {str(e) for e in range(TINY.n_experts)}
    y, _ = layer(torch.randn(2, 16, TINY.d_model))
    y.sum().backward()
    for e in range(TINY.n_experts):
        grads = [p.grad for p in layer.experts[str(e)].parameters()]
        assert all((g is not None) == (e == 1) for g in grads)


def test_drop_mode_contributes_nothing_for_non_owned():
    layer = _layer(owned=set(), non_owned="drop")
    x = torch.randn(2, 4, TINY.d_model)
    y, _ = layer(x)
    shared_only = layer.shared(x.reshape(-1, TINY.d_model)).view_as(y)
    assert torch.allclose(y, shared_only)


def test_all_owned_layer_matches_a_dense_reference_mixture():
    cfg = ModelConfig(seq_len=8, n_layers=1, d_model=16, n_heads=2, n_experts=4, top_k=2, d_expert=24,
                      d_surrogate=4, d_latent=16)
    layer = _layer(owned={0, 1, 2, 3}, cfg=cfg)
    x_TD = torch.randn(10, cfg.d_model)
    y, _ = layer(x_TD.unsqueeze(0))
    probs = torch.softmax(layer.router(x_TD), -1)
    top_p, top_i = probs.topk(2, -1)
    gates = top_p / top_p.sum(-1, keepdim=True)
    ref = torch.zeros_like(x_TD)
    for t in range(10):
        for k in range(2):
            ref[t] += gates[t, k] * layer.experts[str(int(top_i[t, k]))](x_TD[t : t + 1])[0]
    assert torch.allclose(y[0], ref, atol=1e-5)


def test_load_balancing_loss_is_one_when_uniform():
    layer = _layer(owned={0, 1, 2, 3})
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform probabilities; ties broken to the same experts
    _, stats = layer(torch.randn(1, 32, TINY.d_model))
    # E * sum f_e P_e with P_e = 1/E gives exactly 1 whatever the routing counts.
    assert stats.aux_loss.item() == pytest.approx(1.0)
    assert int(stats.tokens_per_expert.sum()) == 32 * TINY.top_k


def test_initialisation_does_not_depend_on_the_shard():
    full = dict(MoETransformer(TINY, seed=3).named_parameters())
    owned = tuple(frozenset({layer}) for layer in range(TINY.n_layers))
    part = MoETransformer(TINY, owned=owned, seed=3)
    for name, p in part.named_parameters():
        assert torch.equal(p, full[name]), name


def test_every_parameter_has_one_group_and_the_groups_are_complete():
    model = MoETransformer(TINY, seed=0)
    names = {name for name, _ in model.named_parameters()}
    by_group = {g: set(model.group_parameters(g)) for g in GROUPS}
    assert set().union(*by_group.values()) == names
    assert sum(len(v) for v in by_group.values()) == len(names)
    assert all(by_group[g] for g in GROUPS), "tiny exercises every group (latent interface on)"
    assert group_of("blocks.0.moe.shared.w_up.weight") == "backbone"
    assert group_of("tok_emb.weight") == "backbone"


def test_model_forward_and_loss_shapes():
    model = MoETransformer(TINY, owned=tuple(frozenset({0}) for _ in range(TINY.n_layers)), seed=0)
    idx = torch.randint(0, 256, (3, TINY.seq_len), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 256, (3, TINY.seq_len), generator=torch.Generator().manual_seed(1))
    out = model(idx, targets)
    assert out.logits.shape == (3, TINY.seq_len, 256)
    assert out.tokens_per_expert.shape == (TINY.n_layers, TINY.n_experts)
    assert out.ce_loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)


def test_ownership_must_cover_every_layer():
    with pytest.raises(ValueError, match="layers"):
        MoETransformer(TINY, owned=(frozenset(),), seed=0)
    with pytest.raises(ValueError, match="outside"):
        MoELayer(TINY, 0, {TINY.n_experts}, "surrogate")


def test_config_validation_says_what_to_change():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig(n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")
    assert own_all(TINY) == tuple(frozenset(range(4)) for _ in range(TINY.n_layers))


def test_rotary_angles_first_computed_for_generation_still_train() -> None:
    """The rotary table is computed once per shape; generation (under ``torch.inference_mode``) may be the first to
    ask for it, and training then uses the same table."""
    from parallax.node.model.transformer import _rotary, _rotary_table

    _rotary_table.cache_clear()
    with torch.inference_mode():
        first = _rotary(torch.randn(1, 2, 5, 8), 500.0)
    x = torch.randn(1, 2, 5, 8, requires_grad=True)
    again = _rotary(x, 500.0)
    again.sum().backward()
    assert x.grad is not None and not first.requires_grad


@pytest.mark.parametrize("non_owned", ["surrogate", "drop", "frozen_copy"])
def test_decoding_a_token_gives_the_logits_of_the_whole_context_at_its_position(non_owned):
    # Half the experts held in every layer, the rest stood in for, dropped or held as copies; the tiny preset has a
    # latent interface and a shared expert.
    torch.manual_seed(3)
    half = tuple(frozenset({0, 1}) for _ in range(TINY.n_layers))
    model = MoETransformer(TINY, half, non_owned=non_owned, seed=5).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.randint(0, TINY.vocab_size, (1, 12))
    cache = model.new_cache()
    with torch.no_grad():
        whole = model(ids).logits[0]
        model(ids[:, :5], cache=cache)
        decoded = [model.decode(int(t), cache) for t in ids[0, 5:]]
    torch.testing.assert_close(torch.stack(decoded), whole[5:], rtol=1e-4, atol=1e-4)
    assert cache[0].length == 12
    with pytest.raises(RuntimeError, match="eval"):
        model.train().decode(0, model.new_cache())


def test_a_key_value_cache_grows_past_its_capacity_and_returns_every_position_in_order():
    k_BHTDh, v_BHTDh = torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    cache = KVCache(capacity=2)
    for i, j in ((0, 1), (1, 4), (4, 5), (5, 7)):  # within the buffer, past it (doubled), past it again
        k, v = cache.extend(k_BHTDh[..., i:j, :], v_BHTDh[..., i:j, :])
        assert cache.length == j and torch.equal(k, k_BHTDh[..., :j, :]) and torch.equal(v, v_BHTDh[..., :j, :])


def test_any_experts_initial_weights_are_drawn_alike_in_any_order_without_a_model() -> None:
    cfg = preset("tiny")
    held = MoETransformer(cfg, tuple(frozenset({0, 3}) for _ in range(cfg.n_layers)), seed=11)
    # The plan of a composer that holds no expert: an heir's, drawing on a worker thread.
    initial = InitialWeights(MoETransformer(cfg, tuple(frozenset() for _ in range(cfg.n_layers)), seed=11).init_plan(),
                             11)
    for layer, expert in [(1, 3), (0, 0), (1, 0), (0, 3), (1, 3)]:  # forwards, back, and again
        drawn = initial(expert_prefix(layer, expert))
        params = held.expert_parameters(layer, expert)
        assert set(drawn) == set(params) and all(torch.equal(drawn[n], p.detach()) for n, p in params.items())
        assert all(torch.equal(drawn[n], v) for n, v in held.initial_expert_weights(layer, expert, 11).items())
    assert initial("no such prefix.") == {}
