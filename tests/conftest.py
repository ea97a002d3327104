"""Suite-wide fixtures: reap any child process a test leaked (p2pd daemons included)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

# The models under test are tiny: one thread per process is faster than two fighting over 2 cores, and
# it keeps runs with several peers per machine from oversubscribing the CPU.
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many test processes ``-n auto`` (pyproject.toml) starts. The default suite's integration tests wait on
    peers, daemons and timeouts as much as they compute (two workers leave a quarter of two cores idle): one more
    worker than cores, at most four. The slow swarm runs load every core themselves and run one at a time, and so
    does a run of named files or tests (no workers to start for them)."""
    if "not slow" not in (config.option.markexpr or "not slow") or any(".py" in a for a in config.args):
        return 0
    return min(4, len(os.sched_getaffinity(0)) + 1)


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


@pytest.fixture(scope="session")
def render_page() -> Callable[..., str]:
    """A page's DOM after its scripts ran, from a real headless Chromium (Debian's ``chromium``, which .ci/run
    installs); tests that need it skip, saying so, where it is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium); .ci/run installs it")

    def render(url: str, screenshot: Path | None = None) -> str:
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--virtual-time-budget=8000", "--hide-scrollbars"]
        done = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        if screenshot is not None:
            shot = subprocess.run([*flags, "--window-size=1000,1300", f"--screenshot={screenshot}", url],
                                  capture_output=True, text=True, timeout=120)
            assert shot.returncode == 0 and screenshot.read_bytes()[:4] == b"\x89PNG", shot.stderr[-2000:]
        return done.stdout

    return render


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""
