"""Settings of the networked processes: what ``parallax node join`` and ``parallax worker join`` run with.

Both share ``PeerConfig`` (run, identity, addresses). A node adds ``NodeSettings`` (its run of steps, checkpoints,
hand-over waits) and ``NetConfig`` (``config/net.py``: one section per component of its network side, with the
internet and loopback timing profiles); a worker adds ``WorkerSettings``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from parallax.dht.adapter import parse_initial_peers
from parallax.dht.keys import check_run_id
from parallax.node.config.net import UNARY_CAP, NetConfig
from parallax.node.config.train import SimConfig, TrainConfig

LOOPBACK_HOST = ("/ip4/127.0.0.1/tcp/0",)
ALL_INTERFACES = ("/ip4/0.0.0.0/tcp/0",)
RelayMode = Literal["auto", "always", "off"]
RELAY_MODES: tuple[str, ...] = get_args(RelayMode)

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(device: str) -> str:
    """``auto`` (CUDA device 0 when present, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: anything else, saying what to write.
    """
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"device {device!r}: write auto, cpu, cuda or cuda:N (or pass --gpu N / --cpu)")
    return device


TRACKERS = ("tensorboard", "wandb")
"""Experiment trackers a node can also log to (``PeerConfig.log_to``, ``node.peer.sinks``)."""


def parse_sink(spec: str) -> tuple[str, str]:
    """``KIND:TARGET`` -> (kind, target): ``tensorboard:DIR`` or ``wandb:PROJECT``.

    Raises:
        ValueError: another form, saying the accepted ones.
    """
    kind, sep, target = spec.partition(":")
    if kind not in TRACKERS or not sep or not target:
        raise ValueError(f"--log-to {spec!r}: write tensorboard:DIR or wandb:PROJECT")
    return kind, target


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerConfig:
    """Who this peer is and where it listens: the same for composers and workers."""

    run_id: str = "parallax"
    """The training run: namespaces every DHT key and P2P handler; every peer of a run uses the same."""
    identity: Path | None = None
    """Ed25519 key file, created on first run (the libp2p key lives beside it). None: ~/.parallax/<role>.key."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of live peers, each ending in /p2p/<peer id>. Empty: start a new swarm."""
    host: tuple[str, ...] = ()
    """Multiaddrs to listen on. Empty: every interface (``/ip4/0.0.0.0/tcp/0``), or 127.0.0.1 with ``loopback``
    (``listen``)."""
    announce: tuple[str, ...] = ()
    """Public multiaddrs other peers dial (behind a port forward, say). Empty: what libp2p reports."""
    loopback: bool = False
    """Every peer on one machine (tests, ``swarm local``): the loopback timing profile."""
    relay: RelayMode = "auto"
    """Circuit relays through the initial peers, for a peer others cannot dial (behind NAT): ``auto`` reserves a
    relay slot when libp2p's AutoNAT finds this peer unreachable, ``always`` reserves one in any case (a peer that
    knows it is behind NAT), ``off`` never. With ``auto`` and ``always`` the heartbeat also names the relayed
    addresses, after the direct ones. ``auto`` is off under ``loopback``: peers on one machine dial each other."""
    metrics: Path | None = None
    """JSONL file: one line per step and per event."""
    manifest: Path | None = None
    """The run's manifest file (``parallax run create``, ``parallax run fetch``): it sets the run's shared
    settings, and composers of another manifest are ignored. None: a composer signs one of its own settings
    (an open run)."""
    member_cert: Path | None = None
    """This peer's member certificate for an ``allowlist`` run (``parallax run admit``)."""
    status_port: int | None = None
    """Serve the status page, ``/status`` (JSON) and ``/metrics`` (Prometheus) on this TCP port (0: any free one).
    None: no status server."""
    status_host: str = "127.0.0.1"
    """The address the status server listens on: this machine only, unless a scraper elsewhere needs it."""
    log_to: tuple[str, ...] = ()
    """Experiment trackers the node also logs to: ``tensorboard:DIR``, ``wandb:PROJECT`` (extras)."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        for spec in self.log_to:
            parse_sink(spec)
        if self.status_port is not None and not 0 <= self.status_port <= 65535:
            raise ValueError(f"peer.status_port (--status-port) is a TCP port, 0-65535, not {self.status_port}")
        parse_initial_peers(self.initial_peers)  # a malformed multiaddr fails here, with what to write
        if self.relay not in RELAY_MODES:
            raise ValueError(f"peer.relay (--relay) is one of {', '.join(RELAY_MODES)}, not {self.relay!r}")

    @property
    def relayed(self) -> bool:
        """Whether this peer uses its initial peers as circuit relays (``relay``)."""
        return bool(self.initial_peers) and (self.relay == "always" or (self.relay == "auto" and not self.loopback))

    @property
    def listen(self) -> tuple[str, ...]:
        """Where this peer listens: ``host``, or its default for the timing profile."""
        return self.host or (LOOPBACK_HOST if self.loopback else ALL_INTERFACES)

    def identity_path(self, role: str) -> Path:
        """The key file: ``identity`` or the default for ``role`` (node, worker)."""
        return (self.identity or Path.home() / ".parallax" / f"{role}.key").expanduser()


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSettings:
    """A composer node's own run: how long, where it keeps state, how it waits. Times in seconds."""

    data: str | None = None
    """Corpus: a text file, a folder or a glob. None: the built-in tinyshakespeare."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N (``--gpu N``, ``--cpu``)."""
    steps: int | None = None
    """Train this many steps, then leave gracefully. None: until Ctrl+C or SIGTERM."""
    checkpoint_dir: Path | None = None
    """Folder of this node's checkpoints. None: no checkpoints."""
    checkpoint_every: int = 100
    """Steps between checkpoints."""
    keep_checkpoints: int = 3
    """Checkpoints kept in checkpoint_dir, the newest; older ones are deleted as new ones are written."""
    resume: str | None = None
    """Resume from a checkpoint: ``latest`` (the one ``checkpoint_dir/latest`` names) or the path of a checkpoint
    (a ``step-N`` folder, e.g. an older one when the latest is corrupt: ``parallax checkpoints list DIR``)."""
    min_peers: int = 1
    """Wait until this many composers are alive (this one included) before the first step."""
    start_timeout_s: float = 120.0
    """Give up when the swarm offers this node no shard within this long."""
    snapshot_every: int = 50
    """Steps between snapshots of every owned expert served to its heir: an owner's death loses at most this
    many steps of its experts; each snapshot is weights + AdamW moments (12 bytes per expert parameter)."""
    adopt_wait_s: float = 10.0
    """How long a new owner waits for the previous owner's final snapshot before taking the best one it has
    (stretched with the membership's periods past ``net.membership.full_pace_members``)."""
    handover_window_s: float = 30.0
    """A released expert's final snapshot counts as the hand-over only when released at most this long before
    the adoption began: a releaser serves its final snapshot for minutes, and under churn the expert may have
    been trained elsewhere since (stretched like ``adopt_wait_s``)."""
    leave_timeout_s: float = 30.0
    """Bound on the graceful leave (outer rounds in flight, final snapshots to the heirs)."""
    final_eval: bool = False
    """Evaluate this node's own view on the validation split when it leaves (metrics event final_eval)."""
    lockstep: bool = False
    """At each step, wait for the shared groups' outer rounds started at the step before to end, and apply them: every
    node applies each merge one step after it was due (``parallax bench attacks --lockstep``: runs that differ in an
    attack, not in when their rounds landed). Surrogate updates land a refresh period after their owner published them
    (``node.peer.lockstep``), and each composer trains at its own point of the learning-rate schedule. False: training
    goes on while a round runs and its merge lands a few steps later (``node.outer.background``), and updates land when
    gossip brings them; lockstep is slower by every round's time."""
    train_nice: int = 10
    """How much lower (Linux nice steps, 0-19) the training thread runs than the node's network threads, its DHT
    process and p2pd, from its first step on: on a crowded CPU the bulk compute yields to heartbeats, rounds and
    snapshots (and to the user's own programs), never the other way round. 0: the same priority."""

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.steps is not None and self.steps < 1:
            raise ValueError("node.steps (--steps) must be >= 1")
        for name in ("checkpoint_every", "keep_checkpoints", "snapshot_every", "min_peers"):
            if getattr(self, name) < 1:
                raise ValueError(f"node.{name} must be >= 1")
        if not 0 <= self.train_nice <= 19:
            raise ValueError(f"node.train_nice must be 0-19 nice steps, got {self.train_nice}")
        for name in ("start_timeout_s", "adopt_wait_s", "handover_window_s", "leave_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"node.{name} must be > 0 seconds")
        if self.resume is not None and (not self.resume or self.resume.startswith("-")):
            raise ValueError(f"node.resume (--resume) is latest or a checkpoint's path, not {self.resume!r}")
        if self.resume == "latest" and self.checkpoint_dir is None:
            raise ValueError("node.resume (--resume latest) needs node.checkpoint_dir (--checkpoint-dir): where the "
                             "checkpoints are; or give a checkpoint's path: --resume DIR/step-N")


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything ``parallax node join`` runs with (``parallax config show`` prints it)."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Model, optimizers, sync cadences, surrogates, offload: every peer of a run uses the same."""
    peer: PeerConfig = field(default_factory=PeerConfig)
    node: NodeSettings = field(default_factory=NodeSettings)
    net: NetConfig = field(default_factory=NetConfig)

    def __post_init__(self) -> None:
        if self.train.sim != SimConfig():
            raise ValueError("the [train.sim] levers (sketches to owners, a dense start-up phase, an offload delay) "
                             "run in `parallax sim` only: leave them out of a node's configuration")
        if self.train.ownership.replicas > 1 and self.train.offload.enabled:
            raise ValueError(f"ownership.replicas={self.train.ownership.replicas} cannot go with offload: replicated "
                             "experts are trained and merged by their owners; set ownership.replicas=1 to offload")
        if self.train.optim.inner != "adamw":
            raise ValueError(f"optim.inner={self.train.optim.inner!r} runs in `parallax sim` only: a node hands "
                             "experts over with their AdamW state; leave optim.inner at 'adamw'")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerLimits:
    """What one offload worker accepts."""

    max_request_bytes: int = UNARY_CAP - 64 * 1024
    """Cap on a request body, checked before decoding, bytes (< 4 MiB, hivemind's unary cap)."""
    max_rows: int = 65536
    """Cap on sketch rows per update request."""
    max_experts: int = 64
    """Experts one worker trains at once (its memory), over all composers."""
    max_experts_per_composer: int = 16
    """Experts one composer (one signing key) may have here at once: fresh keys cannot fill every slot alone."""
    idle_s: float = 120.0
    """When the worker is full, an expert that has had no update for this long makes room for a new one."""
    update_timeout_s: float = 30.0
    """One update's Taylor-proxy steps; past it the caller gets an error."""

    def __post_init__(self) -> None:
        if not 0 < self.max_request_bytes < UNARY_CAP:
            raise ValueError(f"worker.limits.max_request_bytes must be in (0, {UNARY_CAP}) bytes")
        if self.max_rows < 1 or self.max_experts < 1 or self.update_timeout_s <= 0:
            raise ValueError("worker.limits needs max_rows >= 1, max_experts >= 1 and update_timeout_s > 0")
        if not 1 <= self.max_experts_per_composer <= self.max_experts or self.idle_s <= 0:
            raise ValueError("worker.limits needs 1 <= max_experts_per_composer <= max_experts and idle_s > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSettings:
    """An offload worker's own settings."""

    capacity: float = 1.0
    """Relative capacity (> 0; 1.0 = a reference worker): composers give this worker experts in proportion."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N: where the experts' copies and their optimizer state live."""
    limits: WorkerLimits = field(default_factory=WorkerLimits)
    leave_when_idle_s: float | None = None
    """Leave once no composer of the run has been alive for this long, after one was (a worker started for one
    run: ``swarm local``). None: serve until stopped (a volunteer's worker waits for the next composers)."""

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.leave_when_idle_s is not None and not self.leave_when_idle_s > 0:
            raise ValueError("worker.leave_when_idle_s (--leave-when-idle) must be > 0 seconds")
        if not self.capacity > 0:
            raise ValueError("worker.capacity (--capacity) must be > 0 (a relative weight; 1.0 = a reference worker)")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything ``parallax worker join`` runs with."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """The run's settings: model shapes and ``offload`` must match the composers'."""
    peer: PeerConfig = field(default_factory=PeerConfig)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
