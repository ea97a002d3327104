"""``parallax node join`` in a terminal: Ctrl+C reaches its whole process group, yet the node leaves
gracefully (deathrattle stored, checkpoint written) and nothing it started outlives it; a supervisor
killed the hard way still gets its node to leave."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path

import pytest

from parallax.node.peer.local_swarm import read_metrics


def _sessions_of(marker: str) -> dict[int, int]:
    """pid -> session id of every process whose command line holds ``marker``, and of everything else in
    those sessions (p2pd's command line does not name our folder)."""
    rows = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            sid = os.getsid(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
        rows.append((int(entry.name), sid, cmdline))
    sessions = {sid for _, sid, cmd in rows if marker in cmd}
    return {pid: sid for pid, sid, _ in rows if sid in sessions}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _events(path: Path) -> list[dict]:
    return read_metrics(path)  # a line the node is writing is skipped


def _join_and_train(folder: Path, *flags: str, steps: int) -> subprocess.Popen[bytes]:
    """``node join`` on loopback in a session of its own (output in ``out.log``, metrics in ``m.jsonl``), returned
    once it trained ``steps`` steps (at most 120 s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "parallax.cli", "node", "join", "--cpu", "--quiet", "--loopback", *flags,
           "--identity", str(folder / "k"), "--metrics", str(folder / "m.jsonl")]
    with (folder / "out.log").open("wb") as out:
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(e["kind"] == "step" for e in _events(folder / "m.jsonl")) < steps:
        assert proc.poll() is None, (folder / "out.log").read_text()[-3000:]
        time.sleep(0.2)
    return proc


def _until_gone(pids: Collection[int], timeout_s: float, interval_s: float = 0.2) -> list[int]:
    """Wait (bounded) until none of ``pids`` runs; those still running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(interval_s)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["ctrl-c to the group", "supervisor SIGKILLed"])
def test_node_leaves_gracefully_and_leaves_nothing_behind(tmp_path: Path, how: str) -> None:
    metrics = tmp_path / "m.jsonl"
    started: dict[int, int] = {}
    supervisor = _join_and_train(tmp_path, "--checkpoint-dir", str(tmp_path / "ck"), steps=3)
    try:
        started = _sessions_of(str(tmp_path))
        assert len(set(started.values())) == 2, started  # the supervisor's session and the node's own
        if how == "ctrl-c to the group":
            os.killpg(supervisor.pid, signal.SIGINT)  # what a terminal does: every process of the foreground group
            assert supervisor.wait(60) == 0, (tmp_path / "out.log").read_text()[-3000:]
        else:
            supervisor.kill()
            supervisor.wait(10)
        assert not _until_gone(started, 60)
        left = [e for e in _events(metrics) if e["kind"] == "left"]
        assert left and left[-1]["deathrattle"] is True
        assert any(e["kind"] == "checkpoint" and e["step"] == left[-1]["step"] for e in _events(metrics))
    finally:
        for sid in set(started.values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(sid, signal.SIGKILL)  # only sessions led by processes this test started
        with contextlib.suppress(ProcessLookupError):
            supervisor.kill()
        supervisor.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("command", ["node join", "dht bootstrap"])
def test_ctrl_c_at_any_moment_of_start_up_ends_the_process_and_everything_it_started(tmp_path: Path,
                                                                                   command: str) -> None:
    # Signalled while importing, while starting p2pd and the DHT, and while waiting for peers or serving: four
    # processes started together, each signalled at its own moment.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args = {"node join": ["node", "join", "--cpu", "--quiet", "--loopback", "--min-peers", "2"],
            "dht bootstrap": ["dht", "bootstrap", "--host", "/ip4/127.0.0.1/tcp/0"]}[command]
    delays = (0.5, 2.0, 4.0, 8.0)
    procs: list[subprocess.Popen[bytes]] = []
    started: list[dict[int, int]] = [{} for _ in delays]
    try:
        for i in range(len(delays)):
            folder = tmp_path / str(i)
            folder.mkdir()
            with (folder / "out.log").open("wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "parallax.cli", *args, "--identity", str(folder / "k")],
                    start_new_session=True, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
        t0 = time.monotonic()
        signalled = []
        for i, (proc, delay) in enumerate(zip(procs, delays, strict=True)):
            # The moment of start-up under test: this wait is the input, not a synchronisation.
            time.sleep(max(0.0, t0 + delay - time.monotonic()))
            started[i] = _sessions_of(str(tmp_path / str(i)))
            os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl+C: the whole foreground group
            signalled.append(time.monotonic())
        for i, (proc, delay) in enumerate(zip(procs, delays, strict=True)):
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running 30 s after Ctrl+C at {delay} s: "
                            f"{(tmp_path / str(i) / 'out.log').read_text()[-3000:]}")
            left = _until_gone(started[i], 30, interval_s=0.1)
            took = time.monotonic() - signalled[i]
            # 0 or 130 from our handlers. Before they exist, CPython's own: it dies by the signal itself (-SIGINT,
            # a shell's 130), or, interrupted while it imports its site module, exits 1 with a fatal error.
            said = (tmp_path / str(i) / "out.log").read_text()
            in_python_init = code == 1 and "Fatal Python error: init_import_site" in said
            assert code in (0, 130, -signal.SIGINT) or in_python_init, (delay, code, said[-2000:])
            assert not left, f"left running after Ctrl+C at {delay} s"
            print(f"{command}: Ctrl+C at {delay} s, everything gone at most {took:.2f} s later (exit {code})")
    finally:
        for proc, sessions in zip(procs, started, strict=False):
            for sid in set(sessions.values()) | {proc.pid}:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(sid, signal.SIGKILL)  # only sessions led by processes this test started
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_node_killed_alone_takes_its_dht_process_and_p2pd_along(tmp_path: Path) -> None:
    # Without a supervisor (a process manager that signals by pid), a SIGKILL of the node's own process leaves no
    # one to stop what it started: its DHT process notices it is gone and ends itself and p2pd.
    node = _join_and_train(tmp_path, "--no-supervise", steps=1)
    try:
        started = _sessions_of(str(tmp_path))
        assert len(started) >= 3, started  # the node, its DHT process, p2pd
        node.kill()
        node.wait(10)
        assert not _until_gone(started, 30), _sessions_of(str(tmp_path))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
