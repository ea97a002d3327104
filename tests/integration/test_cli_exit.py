"""How the ``parallax`` process ends: the command's exit status and everything it printed, whatever the path out
(``cli/entry.py`` ends the process with ``os._exit`` once the command is done)."""

from __future__ import annotations

import subprocess
import sys
import tomllib


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "parallax.cli", *args], capture_output=True, text=True, timeout=120)


def test_a_finished_command_exits_0_with_all_its_output():
    done = _cli("config", "show", "--preset", "tiny", "--explain")
    assert done.returncode == 0, done.stderr
    settings = tomllib.loads(done.stdout)  # the whole document, flushed: a cut one would not parse
    assert settings["train"]["model"]["n_experts"] == 4 and "membership" in settings["net"]  # the last table


def test_a_failing_command_and_a_usage_error_keep_their_exit_status_and_message():
    failed = _cli("generate", "/nonexistent/model")
    assert failed.returncode == 1 and "not an exported Parallax model" in failed.stderr, failed.stderr
    usage = _cli("swarm", "status", "--run-id", "r", "--initial-peers", "not-a-multiaddr")
    assert usage.returncode == 2 and "is not a multiaddr" in usage.stderr, usage.stderr
    assert "Traceback" not in failed.stderr + usage.stderr
