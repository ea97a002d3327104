"""Suite-wide fixtures: reap any child process a test leaked (p2pd daemons included)."""

from __future__ import annotations

import os

import psutil
import pytest


@pytest.fixture(scope="session", autouse=True)
def reap_children():
    """After the session, end only processes this test process started (its descendants), by PID."""
    yield
    me = psutil.Process(os.getpid())
    children = me.children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
