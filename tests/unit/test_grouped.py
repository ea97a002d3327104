"""The sorted, grouped expert kernels give the reference mixture's outputs, gradients, recorded rows and
sketches, for owned, surrogate, offloaded, frozen-copy and dropped selections."""

from __future__ import annotations

import copy

import pytest
import torch

from parallax.node.config.train import ModelConfig
from parallax.node.model.grouped import grouped_mm_works, grouped_swiglu_parts
from parallax.node.model.sketch import SketchRecorder
from parallax.node.model.transformer import MoELayer, MoETransformer

CFG = ModelConfig(seq_len=16, n_layers=2, d_model=32, n_heads=2, n_experts=8, top_k=3, d_expert=48,
                  d_surrogate=8, d_latent=24, d_shared=16)
OWNED = {0, 2, 5, 6}
OFFLOADED = {2}
KERNELS = ("slices", "grouped_mm", "auto")


def _layer(non_owned: str, *, stand_in_grad: bool, offload_grad: bool) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(CFG, 1, OWNED, non_owned)
    for p in layer.parameters():  # surrogates and frozen copies differ from zero and from each other
        with torch.no_grad():
            p.normal_(0, 0.2)
    for e in OFFLOADED:
        layer.set_offloaded(e, True)
    layer.stand_in_input_grad, layer.offload_input_grad = stand_in_grad, offload_grad
    return layer


def _run(layer: MoELayer, kernel: str, x_BTD: torch.Tensor, upstream: torch.Tensor) -> dict:
    recorded: dict[int, list[torch.Tensor]] = {}
    layer.recorder = lambda _layer, e, x: recorded.setdefault(e, []).append(x.clone())
    sketches = SketchRecorder()
    layer.sketcher = sketches.attach
    layer.kernel = kernel
    x = x_BTD.clone().requires_grad_(True)
    y, stats = layer(x)
    ((y * upstream).sum() + stats.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"y": y.detach(), "x_grad": x.grad, "grads": grads, "counts": stats.tokens_per_expert,
            "recorded": {e: torch.cat(v) for e, v in recorded.items()},
            "sketches": {eid: (s.x_NL, s.g_NL) for eid, s in sketches.take().items()}}


@pytest.mark.parametrize("non_owned", ["surrogate", "drop", "frozen_copy"])
@pytest.mark.parametrize("input_grads", [(True, True), (False, False)], ids=["input-grads", "forward-only"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_match_the_reference_mixture(non_owned, input_grads, kernel):
    reference_layer = _layer(non_owned, stand_in_grad=input_grads[0], offload_grad=input_grads[1])
    layer = copy.deepcopy(reference_layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, CFG.seq_len, CFG.d_model, generator=g)
    upstream = torch.randn(x.shape, generator=g)
    want = _run(reference_layer, "reference", x, upstream)
    got = _run(layer, kernel, x, upstream)
    torch.testing.assert_close(got["y"], want["y"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["x_grad"], want["x_grad"], rtol=1e-5, atol=1e-5)
    assert got["grads"].keys() == want["grads"].keys()
    # Gradients reach owned trained experts, router, latent and shared; never surrogates or offloaded weights.
    assert any(n.startswith("experts.0.") for n in got["grads"]) and not any("surrogates" in n for n in got["grads"])
    assert not any(n.startswith("experts.2.") for n in got["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert got["recorded"].keys() == want["recorded"].keys() == OWNED & {e for e, c in enumerate(got["counts"]) if c}
    for e, rows in want["recorded"].items():
        torch.testing.assert_close(got["recorded"][e], rows)  # the same rows, in the same (token) order
    assert got["sketches"].keys() == want["sketches"].keys() and got["sketches"]
    for eid, (sx, sg) in want["sketches"].items():
        torch.testing.assert_close(got["sketches"][eid][0], sx)
        torch.testing.assert_close(got["sketches"][eid][1], sg, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_model_trains_the_same_with_every_kernel(kernel):
    reference = MoETransformer(CFG, (frozenset({0, 1}), frozenset({3, 4, 7})), seed=3)
    model = copy.deepcopy(reference)
    reference.set_kernel("reference")
    model.set_kernel(kernel)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (reference, model):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            out = m(idx[:, :-1], idx[:, 1:])
            out.loss.backward()
            opt.step()
        losses.append(out.loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


def test_unknown_kernels_and_bad_counts_are_refused():
    with pytest.raises(ValueError, match="kernel must be one of"):
        MoETransformer(CFG).set_kernel("fast")
    w = [torch.zeros(4, 4)]
    with pytest.raises(ValueError, match="sum to the 3 rows"):
        grouped_swiglu_parts(torch.zeros(3, 4), [2], (w, w, w), "slices")
    with pytest.raises(ValueError, match="method must be one of"):
        grouped_swiglu_parts(torch.zeros(3, 4), [3], (w, w, w), "magic")


def test_grouped_gemm_is_probed_not_assumed():
    # The CPU build runs it in float32; a CUDA device without bf16 grouped GEMM falls back to slices.
    assert grouped_mm_works(torch.device("cpu"), torch.float32) == hasattr(torch.nn.functional, "grouped_mm")


def test_activation_checkpointing_gives_the_same_step_and_records_each_row_once():
    plain = MoETransformer(CFG, (frozenset({0, 1}), frozenset({3, 4, 7})), seed=3)
    recomputed = copy.deepcopy(plain)
    recomputed.checkpoint_blocks = True
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    for model in (plain, recomputed):
        recorded: list[tuple[int, int, int]] = []
        model.set_recorder(lambda layer, e, x, out=recorded: out.append((layer, e, x.shape[0])))
        model(idx[:, :-1], idx[:, 1:]).loss.backward()
        rows.append(recorded)
    assert rows[0] == rows[1] and rows[0]  # the recomputation records nothing more
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_autocast_keeps_float32_weights_and_stays_close():
    from parallax.node.train.device import autocast, compute_dtype

    cpu = torch.device("cpu")
    assert compute_dtype(cpu, "auto") == torch.float32 and compute_dtype(cpu, "bf16") == torch.bfloat16
    model = MoETransformer(CFG, seed=1)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))
    full = model(idx[:, :-1], idx[:, 1:]).ce_loss
    with autocast(cpu, torch.bfloat16):
        half = model(idx[:, :-1], idx[:, 1:])
    half.loss.backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    assert half.ce_loss.item() == pytest.approx(full.item(), rel=2e-2)


def test_grouped_gemm_falls_back_where_a_width_is_not_16_byte_aligned():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 24, generator=g)
    weights = ([torch.randn(6, 24, generator=g) for _ in range(2)], [torch.randn(6, 24, generator=g) for _ in range(2)],
               [torch.randn(24, 6, generator=g) for _ in range(2)])  # hidden width 6: 24-byte rows
    want = torch.cat(grouped_swiglu_parts(x, [4, 6], weights, "slices"))
    for method in ("grouped_mm", "padded"):
        got = torch.cat(grouped_swiglu_parts(x, [4, 6], weights, method))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_attention_trains_the_same_steps():
    # torch.compile of each block's attention (compute.compile): about 20 s of compilation on a CPU.
    from parallax.node.config.train import replace, train_config
    from parallax.node.model.transformer import own_all
    from parallax.node.train.composer import Composer
    from parallax.node.train.data import load_corpus, split_corpus

    cfg = train_config("tiny")
    train, _ = split_corpus(load_corpus(None), seq_len=cfg.model.seq_len)
    losses = []
    for compiled in (False, True):
        composer = Composer(replace(cfg, compute=replace(cfg.compute, compile=compiled)), own_all(cfg.model), train,
                            sampler_seed=0)
        losses.append([composer.train_step().loss for _ in range(3)])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
