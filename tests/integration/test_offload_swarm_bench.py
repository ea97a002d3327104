"""``parallax bench offload-swarm`` end to end at the smallest size: two real swarms (composer processes, a
bootstrap peer, worker processes), a worker SIGKILLed mid-run; the report's figures come from what crossed
the wire and nothing is left running."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallax.benchmarks.offload_swarm import markdown, run_offload_swarm_bench

pytestmark = pytest.mark.timeout(420)


@pytest.mark.slow
def test_offload_swarm_bench_reports_wire_bytes_onboarding_and_the_fallback(tmp_path: Path) -> None:
    report = run_offload_swarm_bench(nodes=1, workers=2, steps=300, preset="tiny", kill_at=0.5,
                                     periods='{"router": 10, "latent": 20, "backbone": 20}', workdir=tmp_path,
                                     progress=lambda *_: None)
    assert report["exit_codes"] == {"direct": [0], "offload": [0]}
    v, w = report["val_loss"], report["wire"]
    assert v["tokens"]["direct"] == v["tokens"]["offload"] > 0 and v["ratio"] is not None
    assert w["results_applied"] > 0 and w["bytes_per_sketch"] > 0 and w["bytes_per_result"] > 0
    assert w["bytes_per_onboarding"] > 0 and report["onboarding"]["experts"] >= 8  # tiny: 2 layers x 4 experts
    kill = report["kill"]
    assert kill["worker"] and kill["fallbacks"], kill  # the dead worker's experts came home
    assert all(f["expert"] and f["seconds"] >= 0 for f in kill["fallbacks"])
    assert "offload swarm" in markdown(report)
