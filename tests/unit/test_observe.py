"""The status server: /status JSON, /metrics in Prometheus' format, and the HTML page rendered by a real headless
Chromium (Debian's ``chromium``; the page test skips, saying so, where it is not installed).

The view is a hand-made ``SwarmView`` (pure input); the server, the HTTP and the browser are real.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from parallax.dht.membership import Member, SwarmView
from parallax.node.net.observe import Curve, Observer, StatusServer
from parallax.node.peer.telemetry import NodeStatus
from parallax.protocol.identity import Identity
from parallax.protocol.messages import Heartbeat

PID = "12D3KooWAQJufR1qkp5iYZfUv6bGSLnHSkcsZJ63uJhvVyMz1q8f"


def _member(seed: bytes, shards, step: int, loss: float) -> Member:
    ident = Identity.from_seed(seed * 32)
    hb = Heartbeat(peer_id=PID[:-1] + seed.decode(), addresses=("/ip4/127.0.0.1/tcp/1",), role="composer",
                   capacity=1.0, shards=tuple(shards), step=step, loss=loss)
    return Member(ident.fingerprint, ident.public_key, hb, 105.0)


def _views():
    """Two composers sharing a 2 x 4 model, expert 1.3 owned by nobody; their steps move between reads."""
    step = {"n": 0}

    def view() -> SwarmView:
        step["n"] += 10
        n = step["n"]
        members = [_member(b"a", [(0, 0), (0, 1), (1, 0), (1, 1)], n, 3.0 - n / 100),
                   _member(b"b", [(0, 2), (0, 3), (1, 2)], n + 1, 3.1 - n / 100)]
        return SwarmView(run_id="demo", read_at=100.0, members={m.fingerprint: m for m in members})

    return view


@pytest.fixture()
def served():
    observer = Observer(_views(), "demo", n_layers=2, n_experts=4, period_s=0.05)
    status = NodeStatus(fingerprint="self-fp", peer_id=PID, phase="training", step=12, trained=12, loss=2.5,
                        tokens_per_s=1234.0, live_peers=2, owned=4, bytes_sent=4_000_000, rounds_ok={"router": 3})
    import dataclasses
    observer.publish(dataclasses.asdict(status))
    for step in range(1, 13):
        observer.own_point(step, 3.0 - step / 20)
    for _ in range(3):
        observer.sample()
    server = StatusServer(observer, 0).start()
    try:
        yield server
    finally:
        server.close()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def test_status_json_has_the_node_the_peers_the_shards_and_the_curves(served) -> None:
    doc = json.loads(_get(served.url + "status"))
    assert doc["run_id"] == "demo" and doc["node"]["fingerprint"] == "self-fp" and doc["node"]["step"] == 12
    assert len(doc["swarm"]["peers"]) == 2
    assert doc["swarm"]["layers"][1]["unowned"] == [3]
    assert len(doc["history"]["own"]) == 12 and doc["history"]["own"][0] == [1, 2.95]
    assert all(len(points) == 3 for points in doc["history"]["peers"].values())  # one point per step moved


def test_metrics_are_prometheus_text_with_conventional_names(served) -> None:
    families = {f.name: f for f in text_string_to_metric_families(_get(served.url + "metrics").decode())}
    assert families["parallax_step"].samples[0].value == 12
    assert families["parallax_sent_bytes"].type == "counter"  # the parser strips _total from counter names
    assert families["parallax_sent_bytes"].samples[0].value == 4_000_000
    assert families["parallax_tokens_per_second"].samples[0].value == 1234.0
    rounds = {s.labels["group"]: s.value for s in families["parallax_outer_rounds_ok"].samples
              if s.name.endswith("_total")}
    assert rounds == {"router": 3}
    assert families["parallax_node_info"].samples[0].labels["fingerprint"] == "self-fp"


def test_an_unknown_path_is_404_and_a_taken_port_is_a_clear_error(served) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(served.url + "nothing")
    assert e.value.code == 404
    with pytest.raises(OSError, match="choose another --status-port"):
        StatusServer(served.observer, served.port)


def test_a_full_curve_thins_its_old_points_and_keeps_the_newest() -> None:
    curve = Curve(limit=10)
    for i in range(100):
        curve.add(i, float(i))
    assert len(curve.points) <= 10 and curve.points[-1] == [99, 99.0] and curve.points[0] == [0, 0.0]


def test_the_page_renders_peers_the_shard_map_and_loss_curves_in_a_browser(served, render_page) -> None:
    dom = render_page(served.url)
    assert 'data-rendered="1"' in dom, dom[-3000:]
    a, b = (Identity.from_seed(s * 32).fingerprint for s in (b"a", b"b"))
    assert f'data-fingerprint="{a}"' in dom and f'data-fingerprint="{b}"' in dom
    owners = re.findall(r'data-owner="([^"]*)"', dom)
    assert len(owners) == 8 and owners.count("") == 1 and owners.count(a) == 4 and owners.count(b) == 3
    series = re.findall(r'<polyline[^>]*data-series="([^"]*)"', dom)
    assert sorted(series) == sorted(["this node", a, b])
    assert "self-fp" in dom and "Parallax run demo" in dom


def test_a_request_for_another_host_is_refused_and_a_diverged_loss_is_null(served) -> None:
    request = urllib.request.Request(served.url + "status", headers={"Host": "evil.example:80"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 403
    served.observer.publish({"fingerprint": "x", "loss": float("nan"), "val_loss": float("inf")})
    served.observer.own_point(13, float("nan"))
    doc = json.loads(_get(served.url + "status"))  # strict JSON: no NaN token
    assert doc["node"]["loss"] is None and doc["node"]["val_loss"] is None and doc["history"]["own"][-1] == [13, None]


def test_status_serves_a_thinned_curve_with_its_newest_point() -> None:
    observer = Observer(lambda: None, "demo")
    for step in range(1, 3001):
        observer.own_point(step, 1.0)
    own = observer.document()["history"]["own"]
    assert len(own) <= 1001 and own[0][0] == 1 and own[-1][0] == 3000


def test_a_nodes_page_shows_each_step_once_its_metrics_line_is_written(tmp_path) -> None:
    from parallax.node.peer.telemetry import Telemetry

    metrics = tmp_path / "metrics.jsonl"
    telemetry = Telemetry(metrics, None)
    telemetry.observer = Observer(lambda: None, "demo")
    try:
        for step in (1, 2, 3):
            telemetry.status.step, telemetry.status.loss = step, 3.0 - step / 10
            telemetry.step(step=step, loss=telemetry.status.loss)
            written = json.loads(metrics.read_text().splitlines()[-1])["step"]
            node = telemetry.observer.document()["node"]
            assert node["step"] == written == step and node["loss"] == pytest.approx(3.0 - step / 10)
    finally:
        telemetry.close()
