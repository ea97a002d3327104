"""Watching a run: ``--status-port`` on a node or worker, and ``parallax swarm status --serve``.

One HTTP server (the standard library's threading server, in a daemon thread) answers three paths:

- ``/status``: JSON. ``node`` (this process's own counters, absent for ``swarm status --serve``), ``swarm``
  (``dht.status.SwarmStatus.to_json()``: the live peers and who owns which expert, from their heartbeats), and
  ``history``: this node's (step, loss) per step and each peer's (time, step, loss) from its heartbeats.
- ``/metrics``: the same counters in Prometheus' text format, rendered by ``prometheus_client`` from a collector
  that reads them at scrape time (nothing is counted twice: the metrics file, the live table and these come from
  one status object).
- ``/``: one HTML page with no external assets (it works offline) that polls ``/status`` and draws the peers,
  the shard map and the loss curves.

Nothing here touches the network of the run or blocks the training loop: the training thread hands the server a
finished dictionary (``Observer.publish``), and a sampler thread reads the membership view, which is immutable.
It listens on 127.0.0.1 unless told otherwise: a status page is for its owner, and a scraper on another machine
is a choice (``--status-host``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from parallax.dht.membership import SwarmView
from parallax.dht.status import DEFAULT_HEARTBEAT_TTL_S, swarm_status
from parallax.node.config.peer import PeerConfig

logger = logging.getLogger(__name__)

HISTORY_POINTS = 4000
"""Points kept per curve: the newest, older ones thinned by half whenever the buffer fills."""
SERVED_POINTS = 1000
"""Points per curve in ``/status`` (every k-th, the newest always): the page redraws every two seconds."""
MAX_PEER_CURVES = 256
PAGE = Path(__file__).with_name("status_page.html")
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})

# name, help, kind, key in the node document; counters end in _total (Prometheus' naming rules)
NODE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("parallax_step", "Optimizer steps of this composer (its position in the run).", "gauge", "step"),
    ("parallax_steps_trained_total", "Steps trained by this process.", "counter", "trained"),
    ("parallax_loss", "Training loss of the last step (nats per token).", "gauge", "loss"),
    ("parallax_val_loss", "Validation loss of the last evaluation (nats per token).", "gauge", "val_loss"),
    ("parallax_tokens_per_second", "Training tokens per second over the last window.", "gauge", "tokens_per_s"),
    ("parallax_live_composers", "Live composers in this node's view, itself included.", "gauge", "live_peers"),
    ("parallax_composers_without_work", "Live composers in this node's view whose work never reached it (a flood of "
     "identities, or joiners in their first round).", "gauge", "without_work"),
    ("parallax_view_age_seconds", "Seconds since this node last read the swarm's members.", "gauge", "view_age_s"),
    ("parallax_owned_experts", "Routed experts this node owns and trains.", "gauge", "owned"),
    ("parallax_surrogates_held", "Surrogates of other owners' experts this node follows.", "gauge", "surrogates_held"),
    ("parallax_surrogate_version_max", "Newest surrogate version this node holds.", "gauge", "surrogate_version_max"),
    ("parallax_sent_bytes_total", "Bytes this node sent: surrogates, snapshots, outer rounds, offload.", "counter",
     "bytes_sent"),
    ("parallax_received_bytes_total", "Bytes this node received: surrogates, snapshots, outer rounds, offload.",
     "counter", "bytes_received"),
    ("parallax_gossip_bytes_total", "Surrogate payload bytes fetched and served.", "counter", "gossip_bytes"),
    ("parallax_snapshot_bytes_total", "Heirs' expert copies (chain links and keyframes), fetched and served.",
     "counter", "snapshot_bytes"),
    ("parallax_handover_bytes_total", "Exact expert snapshots (hand-overs, leaves, exports), fetched and served.",
     "counter", "handover_bytes"),
    ("parallax_dht_requests_total", "DHT records stored and keys read by this node.", "counter", "dht_requests"),
    ("parallax_dht_bytes_total", "Bytes of the DHT records this node stored and read.", "counter", "dht_bytes"),
    ("parallax_expert_adoptions_total", "Experts this node took over.", "counter", "adoptions"),
    ("parallax_expert_releases_total", "Experts this node handed over.", "counter", "releases"),
    ("parallax_cut_off", "1 while this node's side of a partition holds no quorum.", "gauge", "cut_off"),
    ("parallax_experts_paused", "1 while no read confirms this node's side holds half of the swarm: its experts "
     "are held without training.", "gauge", "paused"),
)


class Curve:
    """A bounded series of points: when full, every other old point goes (the curve keeps its shape)."""

    def __init__(self, limit: int = HISTORY_POINTS) -> None:
        self.limit = limit
        self.points: list[list[float]] = []

    def add(self, *point: float) -> None:
        self.points.append(list(point))
        if len(self.points) > self.limit:
            half = self.limit // 2
            self.points = self.points[:half:2] + self.points[half:]


class Observer:
    """What the status server shows, kept current by the node (``publish``, ``own_point``) and a sampler thread
    that reads the swarm view every ``period_s`` (``view_source``).

    Args:
        view_source: the latest membership view, or None while there is none; called on the sampler thread only
            (a node's returns its membership's last view at once; ``swarm status --serve`` reads the DHT).
        run_id: shown on the page.
        n_layers, n_experts: the model's shape, so experts nobody owns show in the shard map.
        period_s: how often the sampler reads the view.
        replicas: owners per expert (more announcing one is contested); default: the view's shards', else 1.
    """

    def __init__(self, view_source: Callable[[], SwarmView | None], run_id: str, *, n_layers: int | None = None,
                 n_experts: int | None = None, period_s: float = 2.0,
                 heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S, replicas: int | None = None) -> None:
        self.view_source = view_source
        self.replicas = replicas
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.run_id = run_id
        self.shape = (n_layers, n_experts)
        self.period_s = period_s
        self._node: dict[str, Any] | None = None
        self._swarm: dict[str, Any] | None = None
        self._own = Curve()
        self._peers: collections.OrderedDict[str, Curve] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- writers ---

    def publish(self, node: Mapping[str, Any]) -> None:
        """This process's counters (a finished dict: the server never reads a half-updated object)."""
        self._node = dict(node)

    def own_point(self, step: int, loss: float) -> None:
        with self._lock:
            self._own.add(step, round(loss, 5))

    def sample(self) -> None:
        """Read the view once: the swarm section and a point per peer whose step moved."""
        view = self.view_source()
        if view is None:
            return
        status = swarm_status(view, n_layers=self.shape[0], n_experts=self.shape[1],
                              heartbeat_ttl_s=self.heartbeat_ttl_s, replicas=self.replicas)
        with self._lock:
            for p in status.peers:
                if p.loss is None:
                    continue
                curve = self._peers.pop(p.fingerprint, None) or Curve()
                if not curve.points or curve.points[-1][1] != p.step:
                    curve.add(round(status.read_at, 2), p.step, round(p.loss, 5))
                self._peers[p.fingerprint] = curve
                while len(self._peers) > MAX_PEER_CURVES:
                    self._peers.popitem(last=False)
            self._swarm = status.to_json()

    def start(self) -> Observer:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.sample()
                except Exception:  # a bad view must not end the sampler
                    logger.exception("status sampler: reading the swarm view failed")
                self._stop.wait(self.period_s)

        self._thread = threading.Thread(target=run, name="parallax-status-sampler", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    # --- readers ---

    def document(self) -> dict[str, Any]:
        """``/status``."""
        with self._lock:
            history = {"own": _thin(self._own.points), "peers": {fp: _thin(c.points) for fp, c in self._peers.items()}}
            swarm = self._swarm
        doc = {"run_id": self.run_id, "time": round(time.time(), 3), "node": self._node, "swarm": swarm,
               "history": history}
        return _finite(doc)


def _thin(points: list[list[float]], most: int = SERVED_POINTS) -> list[list[float]]:
    if len(points) <= most:
        return list(points)
    k = -(-len(points) // most)
    return [*points[:-1:k], points[-1]]


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None: JSON has no such numbers (a diverged loss must not break the page)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class NodeCollector(Collector):
    """Prometheus families read from an ``Observer``'s node document at scrape time."""

    def __init__(self, observer: Observer, role: str) -> None:
        self.observer = observer
        self.role = role

    def collect(self) -> Iterator[Metric]:
        node = self.observer._node or {}
        info = InfoMetricFamily("parallax_node", "Who this process is.")
        info.add_metric([], {"role": self.role, "run_id": self.observer.run_id,
                             "fingerprint": str(node.get("fingerprint", "")), "peer_id": str(node.get("peer_id", "")),
                             "phase": str(node.get("phase", ""))})
        yield info
        for name, help_text, kind, key in NODE_METRICS:
            value = node.get(key)
            if value is None or isinstance(value, dict | list | str):
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=float(value))
        rounds = CounterMetricFamily("parallax_outer_rounds_ok", "Outer rounds completed, per shared group.",
                                     labels=["group"])
        for group, n in (node.get("rounds_ok") or {}).items():
            rounds.add_metric([group], float(n))
        yield rounds
        extra = node.get("counters") or {}
        for key, value in sorted(extra.items()):  # a worker's own counters: onboarded, updates, refused
            yield CounterMetricFamily(f"parallax_worker_{key}_total", f"Worker counter: {key}.", value=float(value))


def serve_status(peer: PeerConfig, stack: contextlib.ExitStack, role: str, *, n_layers: int | None = None,
                 n_experts: int | None = None) -> Observer:
    """Start an observer and its server on ``peer.status_port`` (the view is attached later, once the membership
    runs); both are closed by ``stack``.

    Raises:
        OSError: the port cannot be bound.
    """
    assert peer.status_port is not None
    observer = Observer(lambda: None, peer.run_id, n_layers=n_layers, n_experts=n_experts)
    server = StatusServer(observer, peer.status_port, peer.status_host, role=role).start()
    stack.callback(server.close)
    observer.start()
    stack.callback(observer.close)
    return observer


class StatusServer:
    """The HTTP server of an ``Observer``: ``/status``, ``/metrics``, ``/`` on ``host:port`` (0: any free port).

    Raises:
        OSError: the port is taken or the address cannot be bound (the message names it).
    """

    def __init__(self, observer: Observer, port: int, host: str = "127.0.0.1", role: str = "composer") -> None:
        self.observer = observer
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(observer, role))
        page = PAGE.read_bytes()
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                path = self.path.split("?", 1)[0]
                if not self._host_allowed():
                    self.send_error(HTTPStatus.FORBIDDEN, "this status page answers requests for its own address")
                elif path == "/status":
                    self._send(json.dumps(observer.document(), allow_nan=False).encode(), "application/json")
                elif path == "/metrics":
                    self._send(generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8")
                elif path in ("/", "/index.html"):
                    self._send(page, "text/html; charset=utf-8")
                else:
                    self.send_error(HTTPStatus.NOT_FOUND, "try /, /status or /metrics")

            def _host_allowed(self) -> bool:
                """A page bound to this machine answers only requests addressed to it: a web page elsewhere
                cannot read it through a name it points at 127.0.0.1 (DNS rebinding)."""
                if host not in LOOPBACK_NAMES:
                    return True  # listening on a chosen address: its owner exposes it on purpose
                name = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
                return name in LOOPBACK_NAMES

            def _send(self, body: bytes, content_type: str) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the standard library's name)
                logger.debug("status server: " + format, *args)

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve the status page on {host}:{port} ({e.strerror}); choose another "
                                   "--status-port") from None
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.host = host
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="parallax-status-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self) -> StatusServer:
        self._thread.start()
        logger.info("status page on %s (JSON at /status, Prometheus at /metrics)", self.url)
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5.0)
