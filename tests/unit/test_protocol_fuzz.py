"""The short fuzz run (the 100,000-input one is ``parallax bench fuzz``), and protocol/'s import purity."""

from __future__ import annotations

import subprocess
import sys

from parallax.benchmarks.fuzz_protocol import TARGETS, mutate, run_fuzz


def test_short_fuzz_run_raises_only_remote_protocol_errors():
    report = run_fuzz(count=6000, seed=1)
    assert report.unexpected == 0, report.examples
    assert sum(report.per_target.values()) == 6000
    assert set(report.per_target) == set(TARGETS)
    # The signed target must get past the signature to the body decoders, or it tests nothing.
    assert report.accepted["signed"] > 0 and report.refusals.get("MalformedMessage", 0) > 0


def test_fuzzing_is_deterministic():
    a, b = run_fuzz(count=400, seed=7), run_fuzz(count=400, seed=7)
    assert (a.accepted, a.refusals) == (b.accepted, b.refusals)


def test_mutate_changes_its_input():
    import random

    rnd = random.Random(0)
    seed = bytes(range(64))
    assert sum(mutate(seed, rnd) != seed for _ in range(100)) > 90


def test_protocol_imports_neither_torch_nor_hivemind_nor_sockets():
    # A fresh interpreter: other tests' imports must not hide a stray import here.
    code = (
        "import sys\n"
        "import parallax.protocol, parallax.protocol.messages, parallax.protocol.envelope\n"
        "import parallax.protocol.codec, parallax.protocol.identity, parallax.protocol.schema\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hivemind', 'socket'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(out.stdout.strip().split(",")) - {""}
    assert not loaded, f"parallax.protocol imported {loaded}: it must stay pure (no torch, hivemind, sockets)"
