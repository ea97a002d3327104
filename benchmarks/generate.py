"""``parallax bench generate``: tokens per second of ``parallax generate`` with the key-value cache and without it
(every token rerunning its context), side by side on one model of a preset, greedy, after one untimed warm-up;
beside them the cache with the process's threads for every token (``token_threads=None``; the default runs each
cached token on one thread). The ways alternate ``REPEATS`` times and each gives its median (a shared machine's
pace drifts within a run)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from parallax.benchmarks.report import write_report
from parallax.node.config.train import preset as get_preset
from parallax.node.export.use import generate
from parallax.node.model.transformer import MoETransformer

PROMPT = b"ROMEO:"
REPEATS = 5


def run_generate(preset: str, new_tokens: int, device: torch.device) -> dict[str, Any]:
    """A freshly initialised model of ``preset`` (speed does not depend on training) on ``device``."""
    cfg = get_preset(preset)
    model = MoETransformer(cfg, seed=0).to(device).eval()
    ways: dict[str, dict[str, Any]] = {"cache": {}, "no_cache": {"use_cache": False},
                                       "cache_process_threads": {"token_threads": None}}
    for way in ways.values():
        generate(model, PROMPT, max_new_tokens=4, temperature=0, **way)  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(REPEATS):
        for name, way in ways.items():
            started = time.perf_counter()
            generate(model, PROMPT, max_new_tokens=new_tokens, temperature=0, **way)
            runs[name].append(new_tokens / (time.perf_counter() - started))
    rates = {name: statistics.median(r) for name, r in runs.items()}
    return {"preset": preset, "new_tokens": new_tokens, "seq_len": cfg.seq_len, "device": str(device),
            "threads": torch.get_num_threads(), "tokens_per_s": rates, "runs": runs,
            "cache_speedup": rates["cache"] / rates["no_cache"],
            "one_thread_speedup": rates["cache"] / rates["cache_process_threads"]}


def markdown(report: dict[str, Any]) -> str:
    rates = report["tokens_per_s"]
    return "\n".join([
        f"{report['new_tokens']} new tokens, preset {report['preset']} (context {report['seq_len']}), "
        f"{report['device']}, {report['threads']} threads; medians of {len(report['runs']['cache'])} alternating runs",
        "",
        "| | tokens/s |", "|---|---|",
        f"| key-value cache (one thread a cached token) | {rates['cache']:.1f} |",
        f"| context rerun per token | {rates['no_cache']:.1f} |",
        f"| cache speed-up | {report['cache_speedup']:.2f}x |",
        f"| key-value cache, {report['threads']} threads a cached token | {rates['cache_process_threads']:.1f} |",
        f"| one thread against {report['threads']} | {report['one_thread_speedup']:.2f}x |"])


def write(report: dict[str, Any], json_path: Any) -> None:
    write_report(report, markdown(report), json_path)
