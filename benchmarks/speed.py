"""Speed and memory of one training step: a composer of C against a process that holds the whole MoE.

One process, one device, the same model and batch for every row, timed side by side:
    full             every expert real and trained (the synchronous baseline's process, ``own_all``);
    composer C=c     composer 0 of c: experts e with e % c == 0 real, the others forward-only surrogates;
each with the sorted kernels (``compute.kernel = auto``) and with the reference mixture (a mask and a gather
per expert), both processes built at once and their steps interleaved, so that the machine's drift falls on
both alike. A step is forward, backward and the AdamW step (``Composer.train_step``). One MoE layer's forward
and backward is timed alone as well: the part the kernels change, without the rest of the step's noise.

Memory is counted, not sampled, so that it means the same on a CPU and a GPU: parameters, gradients and AdamW
state (bytes of the tensors), plus activations, the bytes autograd saves for the backward pass (each storage
once, through ``saved_tensors_hooks``). On CUDA ``torch.cuda.max_memory_allocated`` is reported beside it.

The analytic figures it is held to:
    composer speed-up    ``flops.composer_speedup`` with the defaults (stand-ins pass the input gradient),
                         the total, counted from the config: what ``parallax bench flops --preset P`` prints.
    composer memory      the full process's, split by part: parameters, gradients and AdamW state x
                         (backbone + experts / C + surrogates / 4) / (backbone + experts) (a surrogate has no
                         gradient and no AdamW state), plus activations A_b + A_x / C + A_s (1 - 1/C), where A_b
                         is measured with every expert dropped, A_b + A_s with every expert a surrogate, and
                         A_b + A_x is the full process's.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from parallax.benchmarks.report import write_report
from parallax.node.config.train import TrainConfig, replace
from parallax.node.model.flops import composer_speedup, step_flops
from parallax.node.model.transformer import MoELayer, MoETransformer, Ownership, group_of, own_all
from parallax.node.train.composer import Composer
from parallax.node.train.data import load_corpus, split_corpus
from parallax.node.train.device import autocast, compute_dtype

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16 tensor-core peaks for MFU, by a name the device's name contains."""


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    composers: int
    """C (1 for the full process)."""
    kernel: str
    step_s: float
    """Median seconds per training step."""
    tokens_per_s: float
    static_bytes: int
    """Parameters + gradients + AdamW state."""
    activation_bytes: int
    """Saved for the backward pass."""
    cuda_peak_bytes: int | None
    mfu: float | None

    @property
    def memory_bytes(self) -> int:
        return self.static_bytes + self.activation_bytes


def _ownership(cfg: TrainConfig, composers: int) -> Ownership:
    """Composer 0 of ``composers``; 1: every expert (the full process); 0: none (every selection a stand-in)."""
    if composers == 1:
        return own_all(cfg.model)
    return tuple(frozenset(e for e in range(cfg.model.n_experts) if composers and e % composers == 0)
                 for _ in range(cfg.model.n_layers))


def _static_bytes(composer: Composer) -> int:
    params = sum(p.numel() * p.element_size() for p in composer.model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in composer.model.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for s in composer.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    return params + grads + state


def _activation_bytes(composer: Composer) -> int:
    """Bytes autograd keeps for the backward pass of one step (each storage counted once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):  # weights are counted as parameters
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        composer.forward_backward()
    composer.optimizer.zero_grad(set_to_none=False)
    params = {p.untyped_storage().data_ptr() for p in composer.model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def _peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def measure(cfg: TrainConfig, train: torch.Tensor, composers: int, kernels: tuple[str, ...], device: torch.device,
            steps: int, warmup: int) -> list[Row]:
    """Composer 0 of ``composers`` (1: the full MoE) once per kernel, their ``steps`` timed steps interleaved
    (after ``warmup`` each), so that a machine's drift falls on every kernel alike."""
    built = [(k, Composer(replace(cfg, compute=replace(cfg.compute, kernel=k)), _ownership(cfg, composers), train,
                          sampler_seed=cfg.seed, device=device)) for k in kernels]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _, composer in built:
        for _ in range(warmup):
            composer.train_step()
    activations = {k: _activation_bytes(c) for k, c in built}
    static = {k: _static_bytes(c) for k, c in built}
    times: dict[str, list[float]] = {k: [] for k in kernels}
    peaks: dict[str, int] = {}
    for _ in range(steps):
        for k, composer in built:
            sync()
            if device.type == "cuda":  # its own peak: what the others hold is resident throughout
                others = torch.cuda.memory_allocated(device) - static[k]
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            composer.train_step()
            sync()
            times[k].append(time.perf_counter() - started)
            if device.type == "cuda":
                peaks[k] = max(peaks.get(k, 0), torch.cuda.max_memory_allocated(device) - others)
    tokens = cfg.batch_size * cfg.model.seq_len
    peak = _peak_tflops(device)
    flops = step_flops(cfg.model, 1.0 / composers, stand_in_input_grad=cfg.surrogate.input_grad).total * tokens
    rows = []
    for k in kernels:
        step_s = statistics.median(times[k])
        rows.append(Row(name="full MoE" if composers == 1 else f"composer C={composers}", composers=composers,
                        kernel=k, step_s=step_s, tokens_per_s=tokens / step_s, static_bytes=static[k],
                        activation_bytes=activations[k], cuda_peak_bytes=peaks.get(k),
                        mfu=flops / step_s / (peak * 1e12) if peak else None))
    return rows


def stand_in_activations(cfg: TrainConfig, train: torch.Tensor, device: torch.device, non_owned: str,
                         kernel: str) -> int:
    """Activation bytes of a step that owns no expert, each selection a ``non_owned`` stand-in ("drop": the
    backbone's alone)."""
    cfg = replace(cfg, surrogate=replace(cfg.surrogate, non_owned=non_owned),
                  compute=replace(cfg.compute, kernel=kernel))
    composer = Composer(cfg, _ownership(cfg, 0), train, sampler_seed=cfg.seed, device=device)
    return _activation_bytes(composer)


def analytic_memory(cfg: TrainConfig, composers: int, full: Row, backbone_activations: int,
                    surrogate_activations: int) -> float:
    """Bytes a composer of C would hold at the full process's costs, part by part (the module docstring)."""
    experts = full.activation_bytes - backbone_activations
    surrogates = surrogate_activations - backbone_activations
    activations = backbone_activations + experts / composers + surrogates * (1 - 1 / composers)
    return full.static_bytes * memory_share(cfg, composers) + activations


def layer_seconds(cfg: TrainConfig, composers: int, kernel: str, device: torch.device, repeats: int = 9) -> float:
    """Median seconds of one MoE layer's forward and backward on a step's tokens: the part the kernels change,
    without the rest of the step's noise."""
    torch.manual_seed(cfg.seed)
    layer = MoELayer(cfg.model, 0, _ownership(cfg, composers)[0]).to(device)
    layer.stand_in_input_grad, layer.kernel = cfg.surrogate.input_grad, kernel
    x = torch.randn(cfg.batch_size, cfg.model.seq_len, cfg.model.d_model, device=device)
    upstream = torch.randn_like(x)
    dtype = compute_dtype(device, cfg.compute.precision)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        inp = x.clone().requires_grad_(True)
        sync()
        started = time.perf_counter()
        with autocast(device, dtype):
            y, _ = layer(inp)
        (y.float() * upstream).sum().backward()
        sync()
        times.append(time.perf_counter() - started)
        layer.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def memory_share(cfg: TrainConfig, composers: int) -> float:
    """(backbone + experts / C + surrogates / 4) / (backbone + experts), in parameters: what a composer holds at
    the full process's bytes per trained parameter (a surrogate has no gradient and no AdamW state)."""
    counts: dict[str, int] = {}
    with torch.device("meta"):
        model = MoETransformer(cfg.model, seed=cfg.seed)
    for name, p in model.named_parameters():
        counts[group_of(name)] = counts.get(group_of(name), 0) + p.numel()
    rest = sum(v for k, v in counts.items() if k not in ("expert", "surrogate"))
    return (rest + counts["expert"] / composers + counts["surrogate"] / 4) / (rest + counts["expert"])


def run_speed(cfg: TrainConfig, *, device: torch.device, composers: tuple[int, ...] = (4, 8), steps: int = 3,
              warmup: int = 1, kernels: tuple[str, ...] = ("auto", "reference"), data: str | None = None,
              progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every (process, kernel) row, then the ratios the targets are stated in, per C: the first kernel (the
    sorted one) against the full process, against the analytic figures and against "reference" if measured."""
    train, _ = split_corpus(load_corpus(data), seq_len=cfg.model.seq_len)
    rows: list[Row] = []
    for c in (1, *composers):
        progress(f"{'full MoE' if c == 1 else f'composer C={c}'}, kernels {', '.join(kernels)}: {warmup} + {steps} "
                 "steps each, interleaved ...")
        rows += measure(cfg, train, c, kernels, device, steps, warmup)
        for r in rows[-len(kernels):]:
            progress(f"  {r.kernel}: {r.step_s:.3f} s a step, {r.memory_bytes / 2**20:.0f} MiB")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    progress("activations with every expert dropped, and with every expert a surrogate ...")
    kernel = kernels[0]
    backbone = stand_in_activations(cfg, train, device, "drop", kernel)
    surrogates = stand_in_activations(cfg, train, device, "surrogate", kernel)
    by = {(r.composers, r.kernel): r for r in rows}
    progress("one MoE layer's forward and backward, per kernel ...")
    layers = {f"{c}/{k}": layer_seconds(cfg, c, k, device) for c in (1, *composers) for k in kernels}
    full = by[(1, kernel)]
    loop = "reference" if "reference" in kernels else kernel
    ratios = {}
    for c in composers:
        mine = by[(c, kernel)]
        analytic = composer_speedup(cfg.model, c, stand_in_input_grad=cfg.surrogate.input_grad)[1]
        memory = analytic_memory(cfg, c, full, backbone, surrogates)
        ratios[str(c)] = {
            "composer_over_full": full.step_s / mine.step_s,
            "analytic_speedup": analytic,
            "speedup_over_analytic": full.step_s / mine.step_s / analytic,
            "grouped_over_loop": by[(c, loop)].step_s / mine.step_s,
            "grouped_over_loop_layer": layers[f"{c}/{loop}"] / layers[f"{c}/{kernel}"],
            "memory_bytes": mine.memory_bytes,
            "analytic_memory_bytes": memory,
            "memory_over_analytic": mine.memory_bytes / memory,
        }
    head = ratios[str(composers[0])]
    return {
        "model": asdict(cfg.model), "batch_size": cfg.batch_size, "device": _device_name(device),
        "dtype": str(compute_dtype(device, cfg.compute.precision)), "steps": steps, "warmup": warmup,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform(),
        "rows": [_row_dict(r) for r in rows],
        "per_composers": ratios,
        "grouped_over_loop": head["grouped_over_loop"],
        "grouped_over_loop_full": by[(1, loop)].step_s / full.step_s,
        "grouped_over_loop_layer": head["grouped_over_loop_layer"],
        "grouped_over_loop_layer_full": layers[f"1/{loop}"] / layers[f"1/{kernel}"],
        "layer_seconds": layers,
        "kernel": kernel, "backbone_activation_bytes": backbone, "surrogate_activation_bytes": surrogates,
        "composer_over_full": head["composer_over_full"],
        "analytic_speedup": head["analytic_speedup"],
        "memory_over_analytic": head["memory_over_analytic"],
    }


def _row_dict(r: Row) -> dict[str, Any]:
    return {"name": r.name, "composers": r.composers, "kernel": r.kernel, "step_s": r.step_s,
            "tokens_per_s": r.tokens_per_s, "static_bytes": r.static_bytes, "activation_bytes": r.activation_bytes,
            "memory_bytes": r.memory_bytes, "cuda_peak_bytes": r.cuda_peak_bytes, "mfu": r.mfu}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def markdown(report: dict[str, Any], command: str) -> str:
    mib = 2**20
    lines = [f"`{command}`: {report['device']}, {report['dtype']}, batch {report['batch_size']} x "
             f"{report['model']['seq_len']} tokens, median of {report['steps']} steps after {report['warmup']}.", "",
             "| process | kernel | s / step | tokens/s | params+grads+AdamW MiB | activations MiB | total MiB |"
             + (" MFU |" if any(r["mfu"] for r in report["rows"]) else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if any(r["mfu"] for r in report["rows"]) else "")]
    for r in report["rows"]:
        mfu = f" {r['mfu']:.1%} |" if r["mfu"] else ""
        lines.append(f"| {r['name']} | {r['kernel']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['static_bytes'] / mib:.0f} | {r['activation_bytes'] / mib:.0f} | "
                     f"{r['memory_bytes'] / mib:.0f} |{mfu}")
    lines += ["", "| C | composer / full (speed) | analytic (bench flops) | measured / analytic | "
              f"{report['kernel']} / reference, step | {report['kernel']} / reference, one MoE layer | "
              "memory / analytic share |", "|---|---|---|---|---|---|---|"]
    for c, v in report["per_composers"].items():
        lines.append(f"| {c} | {v['composer_over_full']:.2f}x | {v['analytic_speedup']:.2f}x | "
                     f"{v['speedup_over_analytic']:.2f} | {v['grouped_over_loop']:.2f}x | "
                     f"{v['grouped_over_loop_layer']:.2f}x | {v['memory_over_analytic']:.3f} |")
    lines.append(f"\nFull MoE, {report['kernel']} over the reference: {report['grouped_over_loop_full']:.2f}x a step, "
                 f"{report['grouped_over_loop_layer_full']:.2f}x a layer.")
    return "\n".join(lines)


def write(report: dict[str, Any], json_path: str | Path | None, command: str) -> None:
    write_report({**report, "command": command}, markdown(report, command), json_path)
