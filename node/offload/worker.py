"""``parallax worker join``'s process: announce as a worker, serve onboard/update requests, leave cleanly.

DESIGN.md section 4 ("Worker offload"). A worker holds no data and no model: it starts the swarm DHT (as a
composer does), announces itself with role "worker" and its capacity (heartbeats; a deathrattle on leave),
and serves ``offload_exchange.OffloadServicer`` on a background asyncio loop ("parallax-worker-net"). The
main thread only waits for a stop (SIGINT/SIGTERM set ``stop_event``) and reports status.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.membership import Membership, PeerState, Presence
from parallax.node.config.peer import WorkerConfig
from parallax.node.net.admission import peer_admission, peer_manifest
from parallax.node.net.network import NetworkLoop, run_replica_groups, start_dht
from parallax.node.net.observe import Observer, serve_status
from parallax.node.offload.exchange import OffloadServicer, serve, unserve
from parallax.node.offload.proxy import SETTINGS_KEY, settings_digest
from parallax.node.train.device import device_of
from parallax.protocol.identity import Identity

logger = logging.getLogger(__name__)


class Worker:
    """One worker peer. ``run`` blocks until ``stop``; ``close`` undoes everything (safe twice).

    Args:
        config: what to run.
    """

    def __init__(self, config: WorkerConfig, *, on_status: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.on_status = on_status
        """Called with the worker's status (``status()``) after every poll: the CLI's live table."""
        self.identity = Identity.load_or_create(config.peer.identity_path("worker"))
        self.stop_event = threading.Event()
        self.dht: SwarmDHT | None = None
        self.membership: Membership | None = None
        self.servicer = OffloadServicer(config.train, config.worker.limits, self.identity, config.peer.run_id,
                                        str(device_of(config.worker.device)))
        self.peer_id: str | None = None
        self._net: NetworkLoop | None = None
        self._metrics: Any = None
        self._stack = contextlib.ExitStack()  # the status server, when there is one
        self._observer: Observer | None = None

    def stop(self) -> None:
        self.stop_event.set()

    @property
    def starting(self) -> bool:
        """True until the worker announces itself: a signal then stops it at once."""
        return self.membership is None

    def run(self, poll_s: float = 0.5) -> None:
        """Start, serve until ``stop``, then leave (deathrattle) and close."""
        try:
            self._start()
            last: tuple[int, int, int] | None = None
            idle = self.config.worker.leave_when_idle_s
            seen_composers, last_composer = False, time.monotonic()
            while not self.stop_event.wait(poll_s):
                now = (len(self.servicer.trainers), self.servicer.updates, self.servicer.refused)
                if now != last:  # a line per change, not per poll
                    self._event("status", onboarded=now[0], updates=now[1], refused=now[2])
                    self._publish("serving", now)
                    last = now
                composers = self.live_composers()
                if composers:
                    seen_composers, last_composer = True, time.monotonic()
                if self.on_status is not None:
                    self.on_status(self.status(composers))
                if idle is not None and seen_composers and time.monotonic() - last_composer > idle:
                    logger.info("no composer of run %s for %.0f s: leaving", self.config.peer.run_id, idle)
                    self._event("idle_leave", seconds=idle)
                    break
        finally:
            self.close()

    def live_composers(self) -> int:
        """Composers of the run alive in this worker's view."""
        if self.membership is None:
            return 0
        return sum(m.heartbeat.role == "composer" for m in self.membership.view().alive().values())

    def status(self, composers: int | None = None) -> dict[str, Any]:
        """What the live table shows: the counters of the metrics file's status lines, and the live composers."""
        s = self.servicer
        return {"peer_id": self.peer_id or "", "fingerprint": self.identity.fingerprint, "device": s.device,
                "composers": self.live_composers() if composers is None else composers,
                "experts": len(s.trainers), "updates": s.updates, "refused": s.refused}

    def _publish(self, phase: str, counters: tuple[int, int, int] = (0, 0, 0)) -> None:
        if self._observer is not None:
            self._observer.publish({"fingerprint": self.identity.fingerprint, "peer_id": self.peer_id or "",
                                    "phase": phase, "counters": dict(zip(("onboarded", "updates", "refused"),
                                                                         counters, strict=True))})

    def _start(self) -> None:
        c = self.config
        if c.peer.status_port is not None:  # first: a port already taken fails before anything else starts
            self._observer = serve_status(c.peer, self._stack, "worker", n_layers=c.train.model.n_layers,
                                          n_experts=c.train.model.n_experts)
            self._publish("starting")
        if c.peer.metrics is not None:
            c.peer.metrics.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = c.peer.metrics.open("a", encoding="utf-8")
        # The device first (CUDA starts in seconds): composers onboard as soon as they see our heartbeat.
        self._event("device_ready", device=self.servicer.device, seconds=round(self.servicer.warm_up(), 3))
        # An allowlist run's worker needs its certificate: without one it would serve nobody.
        admission = peer_admission(c.peer, self.identity, peer_manifest(c.peer, self.identity, None))
        self.dht = start_dht(self.identity, c.peer, identity_path=c.peer.identity_path("worker"),
                             n_layers=c.train.model.n_layers, admission=admission,
                             extra_groups=run_replica_groups(c.train))
        self.peer_id = self.dht.peer_id
        self._net = NetworkLoop(self.dht, "parallax-worker-net")
        # Serve before announcing: a composer that sees the heartbeat may onboard at once.
        self._net.run(serve(self.servicer, self._net.p2p, c.peer.run_id), 10.0)
        self.membership = Membership(self.dht, self.identity,
                                     Presence(run_id=c.peer.run_id, role="worker", capacity=c.worker.capacity))
        # Composers use only workers that announce their own settings (offload.worker_settings).
        self.membership.update(versions={SETTINGS_KEY: settings_digest(c.train)})
        self.membership.start()
        if self._observer is not None:
            self._observer.view_source = self.membership.view
            self._publish("serving")
        self._event("worker_started", peer_id=self.peer_id, join=self.dht.join_command())
        logger.info("worker %s serving run %s", self.peer_id, c.peer.run_id)

    def close(self) -> None:
        """Leave (deathrattle), stop serving, stop the loop and the DHT; safe to call twice."""
        if self.membership is not None and self.membership.state is not PeerState.STOPPED:
            try:
                self.membership.leave("shutting down")
            except Exception as e:
                logger.debug("leave during close: %r", e)
        self.membership = None
        if self._net is not None:
            self._net.close(unserve(self.servicer, self._net.p2p, self.config.peer.run_id))
            self._net = None
        self.servicer.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._stack.close()

    def _event(self, kind: str, **fields: Any) -> None:
        if self._metrics is not None:
            # The nodes' format ({"t": DHT clock, "kind": ...}): one reader for both (local_swarm.read_metrics).
            self._metrics.write(json.dumps({"t": round(dht_time(), 3), "kind": kind, **fields}) + "\n")
            self._metrics.flush()
