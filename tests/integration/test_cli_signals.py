"""Ctrl+C and SIGTERM end a command that is inside one long native call (a large matrix product), within seconds,
with one line saying why; a command whose main thread is in Python code is interrupted as before and given all
the time its cleanup takes. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

STUCK = """
import os, sys, threading, time
import numpy as np
from parallax.cli.entry import Interrupted, guard_signals

def announce(main):  # says "computing" once the main thread is a second of CPU into the product
    while sys._current_frames()[main].f_code.co_name != "product":
        time.sleep(0.01)
    start = os.times().user
    while os.times().user < start + 1.0:
        time.sleep(0.01)
    print("computing", flush=True)

def product(a):
    return a @ a  # one native call of tens of seconds on one thread (2 TFLOP)

guard_signals()
a = np.ones((10_000, 10_000), dtype=np.float32)
threading.Thread(target=announce, args=(threading.get_ident(),), daemon=True).start()
try:
    product(a)
    print("returned", flush=True)
except Interrupted:
    print("interrupted after it returned", flush=True)
"""

CLEANUP = """
import time
from parallax.cli.entry import STUCK_S, Interrupted, guard_signals
guard_signals()
try:
    print("waiting", flush=True)
    time.sleep(600)
except Interrupted:
    time.sleep(STUCK_S + 2)  # a cleanup longer than the watchdog's wait: it must not be cut short
    print("cleaned up", flush=True)
"""


def _start(program: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_a_command_stuck_in_a_native_call(signum: int) -> None:
    process = _start(STUCK)
    try:
        assert process.stdout is not None and process.stdout.readline() == "computing\n"
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 130, (out, err)
    assert "inside a computation or an import that does not return" in err and "returned" not in out, (out, err)


def test_a_command_in_python_code_gets_its_cleanup() -> None:
    process = _start(CLEANUP)
    try:
        assert process.stdout is not None and process.stdout.readline() == "waiting\n"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0 and out == "cleaned up\n", (out, err)



FORKED = """
import multiprocessing, os, signal, time
from parallax.cli.entry import STUCK_S, guard_signals

def child(ready):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # a Python handler: the signal passes through Python
    ready.set()
    time.sleep(600)

guard_signals()
ready = multiprocessing.get_context("fork").Event()
process = multiprocessing.get_context("fork").Process(target=child, args=(ready,))
process.start()
ready.wait(60)
process.terminate()  # SIGTERM to the child only
process.join(60)
time.sleep(STUCK_S + 2)  # longer than the watchdog waits: it must not take the child's signal for ours
print("alive", flush=True)
"""


def _run(program: str, timeout_s: float) -> tuple[int, str, str]:
    """Run ``program`` to its end: its exit status, stdout and stderr (killed if it outlives ``timeout_s``)."""
    process = _start(program)
    try:
        out, err = process.communicate(timeout=timeout_s)
    finally:
        process.kill()
        process.wait()
    return process.returncode, out, err


def test_a_signal_to_a_forked_child_does_not_end_the_parent() -> None:
    code, out, err = _run(FORKED, 120)
    assert code == 0 and out == "alive\n", (out, err)


INTERRUPTED_IMPORT = """
import os, signal, sys, time
import typer
import parallax.cli.main
from parallax.cli.entry import run

app = typer.Typer()

@app.command()
def start() -> None:  # a command interrupted inside a C extension's import, which turns the signal into its own error
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
    except BaseException:
        raise ImportError("numpy._core.multiarray failed to import") from None

parallax.cli.main.app = app
sys.argv = ["parallax"]
run()
"""


def test_an_error_that_a_signal_caused_ends_the_command_as_the_signal_does() -> None:
    code, out, err = _run(INTERRUPTED_IMPORT, 60)
    assert code == 130 and err == "stopped by signal 2\n", (out, err)
