"""Worker offload in process: the proxy gradient, the worker's update, error feedback, refusals and
fall-back, private layers, and the simulator's offload run."""

from __future__ import annotations

import copy
import math

import msgpack
import numpy as np
import pytest
import torch

from parallax.node.config import train as config
from parallax.node.config.typed import apply_changes
from parallax.node.model.sketch import Sketch, compress, taylor_proxy
from parallax.node.offload.proxy import (
    LocalWorkers,
    TaylorProxyTrainer,
    apply_result,
    encode_tensors,
    onboard_blobs,
    settings_digest,
)
from parallax.node.sim.simulator import RunSpec, ownership_for, run
from parallax.node.train.composer import Composer
from parallax.node.train.data import load_corpus, shard, split_corpus
from parallax.protocol import codec
from parallax.protocol.errors import RemoteProtocolError


@pytest.fixture(scope="module")
def splits():
    return split_corpus(load_corpus()[:200_000])


def _cfg(steps: int = 8, delay: int = 0, **offload) -> config.TrainConfig:
    return config.TrainConfig(
        model=config.preset("tiny"), steps=steps, batch_size=4, eval_batches=2,
        sync=config.SyncConfig(periods={"router": 2, "latent": 3, "backbone": 4}),
        surrogate=config.SurrogateConfig(refresh_every=3, distill_steps=2, buffer_tokens=64),
        offload=config.OffloadConfig(enabled=True, **offload), sim=config.SimConfig(offload_delay=delay),
    )


def _composers(cfg, train, n=2):
    shards = ownership_for(cfg, n)
    return [Composer(cfg, shards[i], shard(train, i, n), sampler_seed=1 + i) for i in range(n)]


def test_proxy_gradient_at_the_current_weights_is_the_expert_gradient(splits):
    train, _ = splits
    cfg = _cfg(clip_sketches=False)  # g as the loss gives it (the clip's scaling: its own test below)
    owned = ownership_for(cfg, 2)[0]
    direct = Composer(config.replace(cfg, offload=config.OffloadConfig()), owned, train, sampler_seed=5)
    offload = Composer(cfg, owned, train, sampler_seed=5)  # same weights, same batch
    for eid in offload.owned_experts():
        offload.offload_expert(eid, True)
    direct.forward_backward()
    offload.forward_backward()
    sketches = offload.take_offload_sketches()
    assert set(sketches) == set(offload.owned_experts())
    rng = torch.Generator().manual_seed(0)
    for eid, sketch in sketches.items():
        params = offload.model.expert_parameters(*eid)
        assert all(p.grad is None for p in params.values())  # forward only on the composer
        for s in (sketch, compress(sketch, sample_fraction=1.0, generator=rng, wire_codec="raw")):
            module = offload.model.blocks[eid[0]].moe.experts[str(eid[1])]
            module.zero_grad(set_to_none=True)
            taylor_proxy(module, s.x_NL, s.g_NL).backward()
            for name, p in direct.model.expert_parameters(*eid).items():
                assert p.grad is not None and p.grad.abs().sum() > 0
                assert torch.allclose(params[name].grad, p.grad, rtol=1e-5, atol=1e-9), (eid, name)


def _sketch(cfg, n=64, seed=0) -> Sketch:
    g = torch.Generator().manual_seed(seed)
    m = cfg.model
    return Sketch(torch.randn(n, m.d_latent, generator=g), 1e-3 * torch.randn(n, m.d_latent, generator=g), n)


def _trainer(cfg, seed=0) -> TaylorProxyTrainer:
    torch.manual_seed(seed)
    from parallax.node.model.transformer import SwiGLU

    expert = SwiGLU(cfg.model.d_latent, cfg.model.d_expert)
    return TaylorProxyTrainer(cfg, encode_tensors(dict(expert.named_parameters()), "raw"))


def test_worker_steps_decrease_the_proxy_objective():
    cfg = config.replace(_cfg(worker_steps=5, proxy_lambda=1e-3, worker_lr=1e-3),
                         optim=config.OptimConfig(warmup_steps=0, weight_decay=0.0))
    trainer = _trainer(cfg)
    s = _sketch(cfg)
    with torch.no_grad():
        y0 = trainer.expert(s.x_NL)
        before = float(taylor_proxy(trainer.expert, s.x_NL, s.g_NL, y0, 1e-3))
    trainer.update([(1, s)])
    with torch.no_grad():
        after = float(taylor_proxy(trainer.expert, s.x_NL, s.g_NL, y0, 1e-3))
    assert after < before


def test_coalesced_parts_train_the_expert_exactly_as_separate_requests():
    """A request carrying several steps (a composer whose worker was behind) is one optimizer step per part at
    that part's learning rate: the worker's weights end where separate requests would have left them."""
    cfg = _cfg(worker_steps=2)
    separate, coalesced = _trainer(cfg), _trainer(cfg)
    parts = [(step, _sketch(cfg, seed=step)) for step in (2, 3, 5)]
    for part in parts:
        separate.update([part])
    coalesced.update(parts)
    for (name, a), b in zip(separate.expert.named_parameters(), coalesced.expert.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert coalesced.rows == separate.rows == sum(s.x_NL.shape[0] for _, s in parts)
    with pytest.raises(ValueError, match="at least one"):
        coalesced.update([])


def test_a_requested_lookahead_replaces_the_workers_own():
    asked, configured = _trainer(_cfg(lookahead=0)), _trainer(_cfg(lookahead=3))
    part = [(5, _sketch(_cfg()))]
    assert asked.update(part, lookahead=3) == configured.update(part)


def test_ternary_results_with_error_feedback_converge_to_the_workers_weights():
    cfg = _cfg(result_codec="ternary", lookahead=0)  # the target is the worker's own weights
    trainer = _trainer(cfg)
    composer_copy = {n: p.detach().clone() for n, p in trainer.expert.named_parameters()}
    shapes = {n: t.shape for n, t in composer_copy.items()}
    from parallax.node.offload.proxy import decode_tensors

    empty = Sketch(torch.zeros(0, cfg.model.d_latent), torch.zeros(0, cfg.model.d_latent), 0)
    gaps = []
    for i in range(20):
        blobs = trainer.update([(30, _sketch(cfg, seed=i) if i == 0 else empty)])
        for name, change in decode_tensors(blobs, shapes).items():
            composer_copy[name] += change
        target = {n: p.detach() for n, p in trainer.expert.named_parameters()}
        moved = math.sqrt(sum(float((target[n] - composer_copy[n]).square().sum()) for n in shapes))
        gaps.append(moved)
        for n in shapes:  # the worker's mirror is exactly what the composer holds
            assert torch.equal(trainer.mirror[n], composer_copy[n])
    assert gaps[0] > 0 and gaps[-1] < 0.05 * gaps[0]


def test_lookahead_sends_the_weights_of_the_next_momentum_only_adamw_step_and_takes_them_back():
    """offload.lookahead=1: the composer's copy runs ahead of the worker's by exactly one AdamW step with a
    zero gradient; the next result replaces that extrapolation with the next one."""
    cfg = _cfg(result_codec="fp16", lookahead=1)
    trainer = _trainer(cfg)
    composer_copy = {n: p.detach().clone() for n, p in trainer.expert.named_parameters()}
    shapes = {n: t.shape for n, t in composer_copy.items()}
    from parallax.node.offload.proxy import decode_tensors

    for step in (5, 6):
        for name, change in decode_tensors(trainer.update([(step, _sketch(cfg, seed=step))]), shapes).items():
            composer_copy[name] += change
        shadow = copy.deepcopy(trainer)  # one more AdamW step with a zero gradient, at the next step's lr
        for group in shadow.optimizer.param_groups:
            group["lr"] = cfg.offload.worker_lr * shadow._schedule(step)
        for p in shadow.expert.parameters():
            p.grad = torch.zeros_like(p)
        shadow.optimizer.step()
        for name, p in shadow.expert.named_parameters():
            worker = dict(trainer.expert.named_parameters())[name].detach()
            assert (p.detach() - worker).abs().max() > 1e-4  # momentum alone moves the weights
            torch.testing.assert_close(composer_copy[name], p.detach(), atol=1e-5, rtol=0)  # fp16 deltas


def test_the_simulators_workers_look_no_further_ahead_than_their_answers_are_late(splits):
    train, _ = splits
    for delay, expected in ((0, 0), (1, 1), (3, 1)):
        cfg = _cfg(delay=delay, lookahead=1)
        workers = LocalWorkers(_composers(cfg, train))
        assert {t.cfg.offload.lookahead for t in workers.trainers.values()} == {expected}


def _nan_blob(shape) -> bytes:
    payload = np.full(shape, np.nan, "<f4").tobytes()
    return msgpack.packb(["raw", "float32", list(shape), [], payload], use_bin_type=True)


def test_bad_results_are_refused_and_leave_the_expert_unchanged(splits):
    train, _ = splits
    cfg = _cfg()
    c = _composers(cfg, train, 1)[0]
    eid = next(iter(c.owned_experts()))
    params = c.model.expert_parameters(*eid)
    before = {n: p.detach().clone() for n, p in params.items()}
    shapes = {n: p.shape for n, p in params.items()}
    huge = encode_tensors({n: 10 * p.detach() for n, p in params.items()}, "fp16")  # 10x the weights' norm
    bad = [
        {n: _nan_blob(s) for n, s in shapes.items()},
        huge,
        dict(list(huge.items())[:1]),  # a weight missing
        {n: b"\x93junk" for n in shapes},
        encode_tensors({n: torch.zeros(s[::-1]) for n, s in shapes.items()}, "fp16"),  # transposed
    ]
    for blobs in bad:
        with pytest.raises(RemoteProtocolError):
            apply_result(c, eid, blobs)
        for n, p in params.items():
            assert torch.equal(p.detach(), before[n])
    apply_result(c, eid, encode_tensors({n: 0.01 * p.detach() for n, p in params.items()}, "fp16"))
    assert not torch.equal(params["w_up.weight"].detach(), before["w_up.weight"])


def test_a_nan_result_drops_the_worker_and_the_composer_updates_locally(splits):
    train, _ = splits
    cfg = _cfg(delay=1)
    composers = _composers(cfg, train)
    victim = (0, next(iter(composers[0].owned_experts())))

    def tamper(i, eid, step, blobs):
        if (i, eid) != victim:
            return blobs
        return {n: _nan_blob(tuple(msgpack.unpackb(b)[2])) for n, b in blobs.items()}  # right shapes, all NaN

    workers = LocalWorkers(composers, tamper=tamper)
    assert victim[1] in composers[0].offloaded_experts()
    module = composers[0].model.blocks[victim[1][0]].moe.experts[str(victim[1][1])]
    for step in range(3):
        for c in composers:
            c.forward_backward()
        workers.exchange()
        if step == 0:  # nothing has arrived yet (delay 1)
            assert not workers.fallbacks
            for c in composers:
                c.optimizer_step()
            continue
        if step == 1:
            assert [(i, e) for i, e, _ in workers.fallbacks] == [victim]
            assert "NaN" in workers.fallbacks[0][2]
            assert victim[1] not in composers[0].offloaded_experts()
            # both unanswered sketches (step 1's, and step 2's still in flight) became a local gradient
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())
            before = module.w_up.weight.detach().clone()
        for c in composers:
            c.optimizer_step()
        if step == 1:
            assert not torch.equal(module.w_up.weight.detach(), before)
    assert torch.isfinite(module.w_up.weight).all() and len(workers.fallbacks) == 1
    assert composers[1].offloaded_experts()  # the other composer's workers carry on


def test_private_layers_never_produce_sketches(splits):
    train, _ = splits
    cfg = _cfg(private_layers=1)
    composers = _composers(cfg, train)
    workers = LocalWorkers(composers)
    assert all(eid[0] >= 1 for _, eid in workers.trainers)
    with pytest.raises(ValueError, match="private_layers"):
        composers[0].offload_expert(next(e for e in composers[0].owned_experts() if e[0] == 0), True)
    for _ in range(2):
        for c in composers:
            c.forward_backward()
            captured = c.sketcher.take()  # everything captured this step, not only what offload takes
            assert captured and all(layer >= 1 for layer, _ in captured)
            assert all(p.grad is not None for eid in c.owned_experts() if eid[0] == 0
                       for p in c.model.expert_parameters(*eid).values())  # trained here, as without offload
            c.optimizer_step()


def test_the_simulators_offload_run_trains_every_expert_through_workers(splits):
    train, val = splits
    cfg = _cfg(steps=6)
    result = run(RunSpec(name="offload", kind="offload", cfg=cfg, composers=2), train, val)
    assert math.isfinite(result.val_loss) and math.isfinite(result.assembled_val_loss)
    experts = 2 * cfg.model.n_experts  # every expert of both layers has a worker
    assert result.offload_messages["onboarding"] == experts
    assert result.offload_messages["offload_results"] > 0 and result.worker_flops > 0
    assert all(result.network_bytes[k] > 0 for k in ("onboarding", "offload_sketches", "offload_results"))
    direct = run(RunSpec(name="direct", kind="parallax", cfg=cfg, composers=2), train, val)
    assert result.train_flops < direct.train_flops  # owned experts ran forward only
    assert result.tokens == direct.tokens


def test_onboarding_blobs_carry_the_weights_and_nothing_else(splits):
    train, _ = splits
    cfg = _cfg(onboard_codec="raw")
    c = _composers(cfg, train, 1)[0]
    eid = next(iter(c.owned_experts()))
    trainer = TaylorProxyTrainer(cfg, onboard_blobs(c, eid))
    for name, p in c.model.expert_parameters(*eid).items():
        assert torch.equal(dict(trainer.expert.named_parameters())[name].detach(), p.detach())


def _adam(optimizer, params):
    return {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in params.items()}


def test_the_workers_adamw_state_comes_back_and_goes_on_to_the_next_worker(splits):
    """Every state_every-th result carries the worker's AdamW state; the composer keeps it as the expert's
    optimizer state (a fall-back trains on with it), and onboarding the next worker hands it on."""
    train, _ = splits
    cfg = _cfg(state_every=2, onboard_codec="raw")
    c = _composers(cfg, train, 1)[0]
    eid = next(iter(c.owned_experts()))
    params = c.model.expert_parameters(*eid)
    first = TaylorProxyTrainer(cfg, onboard_blobs(c, eid))
    assert not first.optimizer.state  # a composer that never trained the expert has no state to hand on
    one = first.update([(1, _sketch(cfg, seed=1))])
    assert not any(n.startswith("adam.") for n in one)
    apply_result(c, eid, one)
    assert all(p not in c.optimizer.state for p in params.values())
    two = first.update([(2, _sketch(cfg, seed=2))])
    apply_result(c, eid, two)
    worker = _adam(first.optimizer, dict(first.expert.named_parameters()))
    composer = _adam(c.optimizer, params)
    for name in params:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(composer[name][key].float(), worker[name][key].float()), (name, key)
    assert int(composer[next(iter(params))]["step"]) == 2
    second = TaylorProxyTrainer(cfg, onboard_blobs(c, eid))  # the next worker goes on from that state
    handed = _adam(second.optimizer, dict(second.expert.named_parameters()))
    for name in params:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(handed[name][key].float(), worker[name][key].float()), (name, key)


def test_an_impossible_adamw_state_in_a_result_is_refused_and_nothing_changes(splits):
    train, _ = splits
    cfg = _cfg(state_every=1)
    c = _composers(cfg, train, 1)[0]
    eid = next(iter(c.owned_experts()))
    trainer = TaylorProxyTrainer(cfg, onboard_blobs(c, eid))
    blobs = trainer.update([(1, _sketch(cfg))])
    name = next(n for n in blobs if n.startswith("adam.exp_avg_sq."))
    sq = codec.decode(blobs[name], codec.TensorLimits(max_elements=10**7))
    blobs[name.replace("exp_avg_sq", "exp_avg")] = codec.encode(100 * np.sqrt(sq) + 1e-3)  # no AdamW makes this
    before = {n: p.detach().clone() for n, p in c.model.expert_parameters(*eid).items()}
    with pytest.raises(RemoteProtocolError, match="not a state AdamW makes"):
        apply_result(c, eid, blobs)
    assert all(torch.equal(p, before[n]) for n, p in c.model.expert_parameters(*eid).items())
    assert all(p not in c.optimizer.state for p in c.model.expert_parameters(*eid).values())


def test_a_state_too_big_for_a_message_is_left_out(splits, monkeypatch, caplog):
    from parallax.node.offload import proxy as offload

    monkeypatch.setattr(offload, "STATE_BUDGET", 1000)
    train, _ = splits
    cfg = _cfg(state_every=1)
    c = _composers(cfg, train, 1)[0]
    eid = next(iter(c.owned_experts()))
    trainer = TaylorProxyTrainer(cfg, onboard_blobs(c, eid))
    for step in (1, 2):
        assert not any(n.startswith("adam.") for n in trainer.update([(step, _sketch(cfg))]))
    assert sum("does not fit a result" in r.message for r in caplog.records) == 1  # said once


def test_bench_offload_command_writes_the_promised_numbers(tmp_path):
    import json

    from typer.testing import CliRunner

    from parallax.cli.main import app

    out = tmp_path / "offload.json"
    result = CliRunner().invoke(app, ["bench", "offload", "--preset", "tiny", "--composers", "2", "--steps", "3",
                                      "--set", "offload.input_grad=true", "--quiet", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"direct", "offload"}
    assert report["runs"]["offload"]["bytes_per_sketch"] > 0 and report["runs"]["offload"]["bytes_per_result"] > 0
    flops = report["flops"]
    assert flops["measured_routed_speedup"] > 1 and abs(flops["relative_difference"]) < 0.05
    tiny, big = report["onboarding"]
    assert tiny["bytes"] < tiny["fp32_bytes"] / 4 and big["preset"] == "report"
    assert out.with_suffix(".md").read_text().startswith("| run |")


@pytest.mark.parametrize("change, message", [
    ({"result_codec": "int8"}, "result_codec"), ({"onboard_codec": "lowrank"}, "onboard_codec"),
    ({"worker_steps": 0}, "worker_steps"), ({"sample_fraction": 0.0}, "sample_fraction"),
    ({"result_rank": 65}, "result_rank"), ({"wait_s": -1.0}, "wait_s"),
    ({"wait_s": 61.0}, "wait_s"),
])
def test_offload_config_says_what_to_fix(change, message):
    with pytest.raises(ValueError, match=message):
        config.OffloadConfig(**change)
    with pytest.raises(ValueError, match="private_layers"):
        config.TrainConfig(model=config.preset("tiny"), offload=config.OffloadConfig(enabled=True, private_layers=3))


def test_the_settings_digest_follows_exactly_what_a_worker_trains_with() -> None:
    base = config.TrainConfig(model=config.preset("tiny"), offload=config.OffloadConfig(enabled=True))
    digest = settings_digest(base)
    assert 0 <= digest < 2**62 and settings_digest(apply_changes(base, {})) == digest
    # Written as an int on one command line and left at the float default on the other: the same settings.
    assert settings_digest(apply_changes(base, {"offload.proxy_lambda": 0, "optim.weight_decay": 0.1})) == digest
    for key, value in [("offload.worker_lr", 1e-2), ("offload.lookahead", 0), ("offload.result_codec", "fp16"),
                       ("offload.private_layers", 1), ("offload.state_every", 0), ("optim.weight_decay", 0.0),
                       ("steps", 99)]:
        assert settings_digest(apply_changes(base, {key: value})) != digest, key
    base_small = config.TrainConfig(model=config.preset("small"), offload=base.offload)
    assert settings_digest(base_small) != digest
    # Composer-side settings leave it alone: a worker serves composers that sample or wait differently.
    for key, value in [("offload.sample_fraction", 0.5), ("sim.offload_delay", 2), ("offload.max_change", 0.1),
                       ("offload.input_grad", False), ("offload.wire_codec", "fp16"), ("seed", 7)]:
        assert settings_digest(apply_changes(base, {key: value})) == digest, key


@pytest.mark.parametrize("clip, expect_scaled", [(1e-3, True), (1e6, False), (0.0, False)])
def test_sketches_are_clipped_with_the_composers_step(splits, clip, expect_scaled):
    train, _ = splits
    cfgs = [config.replace(_cfg(clip_sketches=on), optim=config.replace(config.OptimConfig(), grad_clip=clip))
            for on in (True, False)]
    clipped, plain = (_composers(cfg, train, 1)[0] for cfg in cfgs)
    plain.model.load_state_dict(clipped.model.state_dict())
    for c in (clipped, plain):
        for eid in c.owned_experts():
            c.offload_expert(eid, True)
        torch.manual_seed(0)
        c.forward_backward()
    coefficient = clipped.clip_coefficient()
    got, raw = clipped.take_offload_sketches(), plain.take_offload_sketches()
    assert got and set(got) == set(raw)
    for eid in got:
        torch.testing.assert_close(got[eid].x_NL, raw[eid].x_NL)
        torch.testing.assert_close(got[eid].g_NL, raw[eid].g_NL * coefficient)
    params = [p for g in clipped.optimizer.param_groups for p in g["params"] if p.grad is not None]
    if expect_scaled:  # the coefficient is the one the optimizer step's clip then applies
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        assert coefficient == pytest.approx(clip / (norm + 1e-6), rel=1e-5) and coefficient < 1e-2
    else:
        assert coefficient == 1.0
