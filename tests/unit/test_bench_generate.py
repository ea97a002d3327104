"""``parallax bench generate``: every way timed on one model, the report's shape (speed is in docs/benchmarks.md)."""

from __future__ import annotations

import torch

from parallax.benchmarks.generate import markdown, run_generate


def test_every_way_is_timed_and_reported() -> None:
    report = run_generate("tiny", 8, torch.device("cpu"))
    assert set(report["tokens_per_s"]) == {"cache", "no_cache", "cache_process_threads"}
    assert all(v > 0 for v in report["tokens_per_s"].values())
    assert report["cache_speedup"] == report["tokens_per_s"]["cache"] / report["tokens_per_s"]["no_cache"]
    assert "| cache speed-up |" in markdown(report)
