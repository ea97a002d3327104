"""torch's shared-memory manager outlives a Ctrl+C to the process group: started by
``start_shared_memory_manager`` it has SIGINT and SIGTERM blocked, and the caller's own mask is restored."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = """
import os, signal
import psutil
from parallax.dht.adapter import start_shared_memory_manager  # imports hivemind: the file_system strategy
start_shared_memory_manager()
assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(), "the caller's mask is restored"
manager = next(c for c in psutil.Process().children(recursive=True) if c.name() == "torch_shm_manager")
blocked = int(next(line for line in open(f"/proc/{manager.pid}/status") if line.startswith("SigBlk:")).split()[1], 16)
print(blocked >> (signal.SIGINT - 1) & 1, blocked >> (signal.SIGTERM - 1) & 1)
os.kill(manager.pid, signal.SIGINT)  # what a terminal's Ctrl+C to the group does to it
os.kill(manager.pid, signal.SIGTERM)
try:
    manager.wait(2)  # a signal is delivered at once: a manager it kills is gone well within this bound
    print(False)
except psutil.TimeoutExpired:
    print(True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_shared_memory_manager_ignores_the_groups_ctrl_c() -> None:
    # A fresh interpreter: in this one an earlier test may have started the manager already.
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "1", "True"], out.stdout
