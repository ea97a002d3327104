"""What a node tells about itself: the live status (``NodeStatus``), the JSONL metrics file and its events.

One ``Telemetry`` per node; the training loop and the start-up write to it, the CLI's live table reads the
status it hands to ``on_status``. Every line carries the DHT clock (``t``) so lines of several nodes line up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from parallax.dht.adapter import dht_time
from parallax.node.peer.sinks import Sink, scalars

if TYPE_CHECKING:
    from parallax.node.net.observe import Observer

logger = logging.getLogger(__name__)

RECENT_ROUNDS = 20


@dataclass
class NodeStatus:
    """What the live display shows, refreshed after every step (a plain value: safe to hand to the UI)."""

    fingerprint: str = ""
    peer_id: str = ""
    join_command: str = ""
    """``--initial-peers ...`` line others join through (printed once at start)."""
    run_digest: str = ""
    """The digest of the run manifest this node trains by (hex)."""
    phase: str = "starting"
    step: int = 0
    trained: int = 0
    schedule: str = ""
    """Where the node stands in the run's learning-rate schedule (the run's ``steps``, fixed by its manifest)."""
    loss: float | None = None
    tokens_per_s: float = 0.0
    time_left_s: float | None = None
    """Seconds until this node's ``--steps`` end (without them, the run's schedule) at its recent pace; None
    before a pace is known or past the end."""
    live_peers: int = 0
    without_work: int = 0
    """Live composers in this node's view none of whose work has reached it while others' has: joiners in their
    first round, or a flood of identities that only sign heartbeats (``Membership.without_work``)."""
    view_age_s: float = 0.0
    """Seconds since this node last read the swarm's members (grows while its DHT reads fail)."""
    owned: int = 0
    surrogates_held: int = 0
    surrogate_version_max: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    gossip_bytes: int = 0
    """Surrogate payloads fetched + served."""
    snapshot_bytes: int = 0
    """Heirs' copies of experts (chains' links and keyframes), fetched + served: what durability costs a step."""
    handover_bytes: int = 0
    """Exact expert snapshots fetched + served: hand-overs to a new owner or at a leave, copies for a co-owner or an
    export (a cost of joins and leaves, not of steps)."""
    outer_bytes: int = 0
    """Outer-round contributions and group states fetched + served."""
    dht_requests: int = 0
    """Records this node stored in the DHT and keys it read (``SwarmDHT.calls``)."""
    dht_bytes: int = 0
    """Bytes of those records, stored and read back (hivemind's replication and routing not counted)."""
    offload_bytes: int = 0
    """Offload traffic with workers, both ways (weights, sketches, results)."""
    heir_copies: list[list[int]] = field(default_factory=list)
    """[layer, expert] of other owners' experts this node holds a snapshot of, as their heir."""
    rounds_ok: dict[str, int] = field(default_factory=dict)
    next_round: dict[str, int] = field(default_factory=dict)
    adoptions: int = 0
    releases: int = 0
    cut_off: bool = False
    """This node's side of a partition holds no quorum: it trains no expert (``dht.membership.Quorum``)."""
    paused: bool = False
    """No read confirms this node's side holds half of the swarm: it holds its experts without training them
    (``Membership.confirmed``)."""
    val_loss: float | None = None
    owned_experts: list[list[int]] = field(default_factory=list)
    """[layer, expert] of every expert this node owns."""
    surrogate_versions: dict[str, int] = field(default_factory=dict)
    """"layer.expert" -> the surrogate version this node holds."""
    recent_rounds: list[dict[str, Any]] = field(default_factory=list)
    """The last ``RECENT_ROUNDS`` outer-round events (group, status, participants, times)."""
    workers: list[str] = field(default_factory=list)
    """Peer ids of the offload workers this node can use."""


class Telemetry:
    """The status, its listener and the metrics file of one node. ``close`` is safe twice.

    Args:
        metrics_path: JSONL file appended to (None: no file).
        on_status: called with the status whenever it changes (the CLI's live table).

    ``observer`` (set when the node serves a status page) gets a copy of the status at every change and a loss
    point per step.
    """

    def __init__(self, metrics_path: Path | None, on_status: Callable[[NodeStatus], None] | None) -> None:
        self.status = NodeStatus()
        self.on_status = on_status
        self.observer: Observer | None = None
        self.sinks: list[Sink] = []
        """Experiment trackers (``--log-to``) that get every step line's numbers and the final evaluation."""
        self._file: IO[str] | None = None
        if metrics_path is not None:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = metrics_path.open("a", encoding="utf-8")

    def phase(self, phase: str) -> None:
        self.status.phase = phase
        self.publish()

    def publish(self) -> None:
        """Hand the status to the listener and the observer."""
        if self.on_status is not None:
            self.on_status(self.status)
        if self.observer is not None:
            self.observer.publish(dataclasses.asdict(self.status))

    def event(self, kind: str, **fields: Any) -> None:
        """Log an event and write it as one metrics line."""
        logger.info("%s %s", kind, fields)
        line = {"t": round(dht_time(), 3), "kind": kind, **fields}
        if kind == "round":
            self.status.recent_rounds = [*self.status.recent_rounds[-(RECENT_ROUNDS - 1):], line]
        if kind in ("eval", "final_eval"):
            self._to_sinks(int(fields.get("step", 0)), {"val_loss": float(fields["val_loss"])})
        self._write(line)

    def counters(self) -> dict[str, Any]:
        """The status's counters as metrics fields: every step line and the ``left`` event carry them, and every
        table of a run (the live one, ``swarm local``'s summary, the status page) shows these."""
        s = self.status
        return {"peers": s.live_peers, "view_age_s": round(s.view_age_s, 2), "owned": s.owned,
                "surrogates_held": s.surrogates_held, "surrogate_version_max": s.surrogate_version_max,
                "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received, "gossip_bytes": s.gossip_bytes,
                "snapshot_bytes": s.snapshot_bytes, "handover_bytes": s.handover_bytes, "outer_bytes": s.outer_bytes,
                "offload_bytes": s.offload_bytes,
                "dht_requests": s.dht_requests, "dht_bytes": s.dht_bytes,
                "heir_copies": s.heir_copies, "rounds_ok": s.rounds_ok, "tokens_per_s": round(s.tokens_per_s, 1)}

    def step(self, **fields: Any) -> None:
        """One metrics line per step: ``fields`` and the status's counters. Then the status (its step and loss
        just set) goes to the listener and the observer: a status page shows the step the metrics file has just
        reached, never one it has not."""
        if self.observer is not None and fields.get("loss") is not None:
            self.observer.own_point(int(fields.get("step", 0)), float(fields["loss"]))
        if self._file is not None or self.sinks:
            line = {"t": round(dht_time(), 3), "kind": "step", **fields, **self.counters()}
            self._to_sinks(int(fields.get("step", 0)), scalars(line))
            self._write(line)
        self.publish()

    def _to_sinks(self, step: int, values: dict[str, float]) -> None:
        """Log to the trackers; one that fails is named once and dropped (training goes on)."""
        for sink in list(self.sinks):
            try:
                sink.log(step, values)
            except Exception as e:
                logger.warning("an experiment tracker failed (%r): no longer logging to it", e)
                self.sinks.remove(sink)
                with contextlib.suppress(Exception):
                    sink.close()

    def _write(self, line: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # a tracker that cannot flush must not stop the leave
                logger.warning("closing an experiment tracker failed: %r", e)
        self.sinks = []
        if self._file is not None:
            self._file.close()
            self._file = None
