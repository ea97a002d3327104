"""Suite-wide fixtures: reap any child process a test leaked (p2pd daemons included)."""

from __future__ import annotations

import contextlib
import os

import psutil
import pytest
import torch

# The models under test are tiny: one thread per process is faster than two fighting over 2 cores, and
# it keeps runs with several peers per machine from oversubscribing the CPU.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def reap_children():
    """After the session, end only processes this test process started (its descendants), by PID."""
    yield
    me = psutil.Process(os.getpid())
    # torch_shm_manager is torch's own helper: it exits when this process does, and killing it first
    # makes torch abort at interpreter exit ("std::system_error: Broken pipe", exit code 134).
    children = [c for c in me.children(recursive=True) if _name(c) != "torch_shm_manager"]
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""
