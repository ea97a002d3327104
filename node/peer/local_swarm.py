"""A swarm of real processes on loopback: one bootstrap peer and N ``parallax node join`` composers.

Used by ``parallax swarm local`` and by the swarm tests. Every child runs in its own session (process
group), so that a node can be killed the hard way together with its daemons (``kill``: a machine that
dies), and so that nothing outlives ``close()``: children are asked to leave with SIGINT, then
SIGTERM, then their whole group is SIGKILLed, each step bounded.

Each node writes a JSONL metrics file (``node-<i>.jsonl``); ``read_metrics`` parses it and the live
table and the summary are built from those files alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from parallax.errors import NodeError
from parallax.node.peer.netlab import Host
from parallax.node.peer.processes import kill_group, send, spawn, stop

logger = logging.getLogger(__name__)

_JOIN_RE = re.compile(r"--initial-peers\s+(\S+)")


@dataclass
class NodeProcess:
    index: int
    process: subprocess.Popen[bytes]
    metrics: Path
    log: Path
    args: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def step(self) -> int:
        """The step of the node's latest step record, read from its metrics file (0 before its first step)."""
        last = latest(read_metrics(self.metrics))
        return int(last["step"]) if last else 0


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of a node's metrics file (a line being written is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):  # a line of another file's making is not a record
            out.append(record)
    return out


def latest(records: Sequence[dict[str, Any]], kind: str = "step") -> dict[str, Any] | None:
    for r in reversed(records):
        if r.get("kind") == kind:
            return r
    return None


def final_counters(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """A node's counters as it last wrote them: its ``left`` event once it has left (the rounds and snapshots of
    the leave included), else its last step line; with the last step's loss."""
    for r in reversed(records):
        if r.get("kind") == "left" and "rounds_ok" in r:
            step = latest(records) or {}
            return {**r, "loss": step.get("loss")} if "loss" in step else dict(r)
        if r.get("kind") == "step":
            return r
    return None


def composer_bytes(records: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """One node's bytes per step it trained, from its metrics: training (outer rounds in and out, surrogate gossip,
    offloaded work), durability (heirs' copies of experts) and hand-overs (exact experts for a new owner, at a join
    or a leave: a cost of those, not of steps) apart; None before its first step."""
    final = final_counters(records) or {}
    steps = sum(1 for r in records if r.get("kind") == "step")
    if not steps:
        return {"train_bytes_per_step": None, "durability_bytes_per_step": None, "handover_bytes_per_step": None}
    train = sum(final.get(k, 0) for k in ("outer_bytes", "gossip_bytes", "offload_bytes"))
    return {"train_bytes_per_step": train / steps, "durability_bytes_per_step": final.get("snapshot_bytes", 0) / steps,
            "handover_bytes_per_step": final.get("handover_bytes", 0) / steps}


class LocalSwarm:
    """Start and stop a local swarm (module docstring).

    Args:
        workdir: where keys, metrics, logs and checkpoints go (one sub-folder per node).
        run_id: the run.
        node_args: extra ``parallax node join`` arguments for every node (preset, --set, --steps...).
        python: the interpreter to run ``-m parallax.cli`` with.
        threads_per_node: torch threads of each node (OMP_NUM_THREADS), 1 by default.
        hosts: hosts of a network lab (``netlab.NetLab``) to run on instead of this machine's loopback: the
            bootstrap peer on the first, node i on host i modulo their number, each listening on its host's address.
    """

    def __init__(self, workdir: Path, *, run_id: str = "local", node_args: Sequence[str] = (),
                 python: str = sys.executable, threads_per_node: int = 1, hosts: Sequence[Host] = ()) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.node_args = list(node_args)
        self.python = python
        # Several nodes on one machine: torch's default (a thread per core in every process) oversubscribes
        # the cores and its spinning threads slow every step many times over (measured: seconds per step).
        self.threads_per_node = threads_per_node
        self.hosts = list(hosts)
        self.bootstrap: subprocess.Popen[bytes] | None = None
        self.initial_peers: str = ""
        self.nodes: list[NodeProcess] = []
        self.workers: list[NodeProcess] = []
        self._written: set[Path] = set()  # logs and metrics this swarm has started (a restart appends to them)

    def host(self, index: int | None) -> Host | None:
        """The lab host of node ``index`` (``None``: the bootstrap peer's), or ``None`` on loopback."""
        if not self.hosts:
            return None
        return self.hosts[0 if index is None else index % len(self.hosts)]

    def listen(self, index: int | None) -> str:
        host = self.host(index)
        return host.maddr() if host is not None else "/ip4/127.0.0.1/tcp/0"

    def _spawn(self, args: list[str], log: Path, launcher: Sequence[str] = ("-m", "parallax.cli"),
               host: Host | None = None) -> subprocess.Popen[bytes]:
        threads = str(self.threads_per_node)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        argv = [self.python, *launcher, *args]
        with log.open("ab" if log in self._written else "wb") as out:  # a previous run's lines are not ours
            self._written.add(log)
            return spawn(host.argv(*argv) if host is not None else argv, env=env, stdout=out)

    def _fresh(self, metrics: Path) -> Path:
        """``metrics``, emptied the first time this swarm starts a process that writes it (nodes append to their
        metrics file, and a previous run's lines in the same folder would read as this run's)."""
        if metrics not in self._written:
            metrics.unlink(missing_ok=True)
            self._written.add(metrics)
        return metrics

    def start_bootstrap(self, *extra: str, timeout_s: float = 60.0) -> str:
        """Start the bootstrap peer (``extra``: more ``dht bootstrap`` arguments); returns the multiaddr others join
        through."""
        log = self.workdir / "bootstrap.log"
        self.bootstrap = self._spawn(["dht", "bootstrap", "--host", self.listen(None), "--identity",
                                      str(self.workdir / "bootstrap.key"), *extra], log, host=self.host(None))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = _JOIN_RE.search(log.read_text(errors="replace")) if log.exists() else None
            if found:
                self.initial_peers = found.group(1)
                return self.initial_peers
            if self.bootstrap.poll() is not None:
                raise NodeError(f"the bootstrap peer exited with {self.bootstrap.returncode}; see {log}")
            time.sleep(0.1)
        raise NodeError(f"the bootstrap peer printed no join address within {timeout_s:.0f} s; see {log}")

    def add_node(self, *extra: str, index: int | None = None,
                 launcher: Sequence[str] = ("-m", "parallax.cli")) -> NodeProcess:
        """Start composer ``index`` (default: the next one) joining through the bootstrap peer; ``launcher``: the
        interpreter's arguments before the command's (another module that runs the command)."""
        if not self.initial_peers:
            raise NodeError("start_bootstrap() first")
        i = len(self.nodes) if index is None else index
        folder = self.workdir / f"node-{i}"
        folder.mkdir(exist_ok=True)
        metrics = self._fresh(folder / "metrics.jsonl")
        # Each node already has a session of its own here and is signalled by pid: no supervisor in between.
        args = ["node", "join", "--cpu", "--quiet", "--loopback", "--no-supervise", "--run-id", self.run_id,
                "--identity", str(folder / "node.key"), "--initial-peers", self.initial_peers, "--host", self.listen(i),
                "--metrics", str(metrics), *self.node_args, *extra]
        node = NodeProcess(i, self._spawn(args, folder / "node.log", launcher, self.host(i)), metrics,
                           folder / "node.log", args)
        if index is not None and index < len(self.nodes):
            self.nodes[index] = node
        else:
            self.nodes.append(node)
        return node

    def add_worker(self, *extra: str) -> NodeProcess:
        """Start an offload worker (``parallax worker join``) joining through the bootstrap peer; it is stopped
        and killed like a node (``self.workers``, closed in ``close``)."""
        if not self.initial_peers:
            raise NodeError("start_bootstrap() first")
        i = len(self.workers)
        folder = self.workdir / f"worker-{i}"
        folder.mkdir(exist_ok=True)
        metrics = self._fresh(folder / "metrics.jsonl")
        args = ["worker", "join", "--cpu", "--quiet", "--no-supervise", "--run-id", self.run_id, "--identity",
                str(folder / "worker.key"), "--initial-peers", self.initial_peers, "--host", self.listen(i),
                "--metrics", str(metrics), *extra]
        worker = NodeProcess(i, self._spawn(args, folder / "worker.log", host=self.host(i)), metrics,
                             folder / "worker.log", args)
        self.workers.append(worker)
        return worker

    def metrics(self) -> list[list[dict[str, Any]]]:
        return [read_metrics(n.metrics) for n in self.nodes]

    def describe(self, log_lines: int = 15) -> str:
        """Each node's last step record and the end of its log: what a failed wait on the swarm prints."""
        parts = []
        for n in self.nodes + self.workers:
            tail = n.log.read_text(errors="replace").splitlines()[-log_lines:] if n.log.exists() else []
            state = "alive" if n.alive else f"exited {n.process.returncode}"
            parts.append(f"--- {n.log.parent.name} ({state}), last step: {latest(read_metrics(n.metrics))}\n"
                         + "\n".join(tail))
        return "\n".join(parts)

    def wait(self, timeout_s: float) -> bool:
        """Wait until every node process has exited; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(not n.alive for n in self.nodes):
                return True
            time.sleep(0.2)
        return False

    def kill(self, index: int) -> None:
        """SIGKILL a node and every process of its group (its DHT, p2pd and averagers): a machine dying."""
        kill_group(self.nodes[index].process, signal.SIGKILL)
        self.nodes[index].process.wait(10)

    def stop_node(self, index: int, timeout_s: float = 60.0) -> int | None:
        """Ask one node to leave (SIGINT) and wait; returns its exit code."""
        return stop(self.nodes[index].process, timeout_s)

    def stop_nodes(self, indices: Sequence[int] | None = None, timeout_s: float = 60.0) -> list[int | None]:
        """Ask several nodes (default: every node) to leave at once, as a Ctrl+C of ``swarm local`` does, and wait
        for them all; returns their exit codes in the order asked. Leaving together, none waits for the others'
        hand-over (an heir that announces it is leaving is no heir)."""
        chosen = [self.nodes[i] for i in (range(len(self.nodes)) if indices is None else indices)]
        return self._stop_together(chosen, timeout_s)

    def _stop_together(self, chosen: Sequence[NodeProcess], timeout_s: float) -> list[int | None]:
        for n in chosen:
            if n.alive:
                send(n.process, signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        return [stop(n.process, max(1.0, deadline - time.monotonic()), interrupt=False) for n in chosen]

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop every node (SIGINT, then SIGTERM, then SIGKILL of the group), then the bootstrap peer."""
        everyone = self.nodes + self.workers
        self._stop_together(everyone, timeout_s)
        if self.bootstrap is not None:
            stop(self.bootstrap, 15.0)
        for p in [n.process for n in everyone] + ([self.bootstrap] if self.bootstrap else []):
            kill_group(p, signal.SIGKILL)  # leftovers of a child that died without cleaning up

    def leftovers(self) -> list[psutil.Process]:
        """Processes still alive in the sessions this swarm's children led (their daemons included): none, once
        ``close`` returned."""
        sessions = {n.process.pid for n in self.nodes + self.workers} | (
            {self.bootstrap.pid} if self.bootstrap else set())
        found = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) in sessions and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (ProcessLookupError, psutil.Error, PermissionError):
                continue
        return found

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
