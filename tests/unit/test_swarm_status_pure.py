"""``parallax swarm status`` without a network: the view -> rows formatting, and option errors."""

from __future__ import annotations

from typer.testing import CliRunner

from parallax.cli.main import app
from parallax.dht.membership import Member, SwarmView
from parallax.dht.status import (
    PEER_COLUMNS,
    SHARD_COLUMNS,
    SUSPECT_COLUMNS,
    compact_ints,
    experts_text,
    peer_rows,
    shard_rows,
    short_peer_id,
    suspect_rows,
    swarm_status,
    versions_text,
)
from parallax.protocol.identity import Identity
from parallax.protocol.messages import Deathrattle, Heartbeat

PID = "12D3KooWAQJufR1qkp5iYZfUv6bGSLnHSkcsZJ63uJhvVyMz1q8f"
runner = CliRunner(env={"COLUMNS": "400"})  # rich wraps error boxes at the terminal width


def _member(seed: bytes, *, role: str = "composer", shards=(), step: int = 0, loss=None, versions=None,
            expires_at: float = 105.0, suspects=None, banned=()) -> Member:
    ident = Identity.from_seed(seed * 32)
    hb = Heartbeat(peer_id=PID[:-1] + seed.decode(), addresses=("/ip4/127.0.0.1/tcp/1",), role=role, capacity=1.0,
                   shards=tuple(shards), step=step, versions=versions, loss=loss, suspects=suspects, banned=banned)
    return Member(ident.fingerprint, ident.public_key, hb, expires_at)


def test_compact_text_helpers():
    assert compact_ints([7, 0, 1, 2, 3, 5, 8]) == "0-3,5,7,8"
    assert compact_ints([1, 2]) == "1,2" and compact_ints([]) == ""
    assert experts_text({0: (1, 5), 1: (2,)}) == "L0:1,5 L1:2"
    assert experts_text({}) == "-"
    assert versions_text({"held": 12, "max": 40}) == "12/40"
    assert versions_text({"attn": 4, "surrogates": 9, "x": 1}) == "3/9"
    assert versions_text({}) == "-"
    assert short_peer_id(PID) == "12D3…Mz1q8f"
    assert short_peer_id("QmShort") == "QmShort"


def test_rows_from_a_view_mark_unowned_and_contested_experts():
    a = _member(b"a", shards=[(0, 0), (0, 1), (0, 2), (1, 3)], step=120, loss=3.14159,
                versions={"held": 5, "max": 17}, expires_at=104.0)
    b = _member(b"b", shards=[(0, 2), (1, 0)], step=119, expires_at=105.5)  # (0, 2) claimed twice
    w = _member(b"w", role="worker", step=7)
    dead = _member(b"d", shards=[(1, 1)], expires_at=99.0)  # expired: neither listed nor owning
    gone = Identity.from_seed(b"g" * 32).fingerprint
    view = SwarmView(
        run_id="r1", read_at=100.0,
        members={m.fingerprint: m for m in (a, b, w, dead)},
        departed={gone: Deathrattle(peer_id=PID, step=50, reason="done")},
    )
    status = swarm_status(view, heartbeat_ttl_s=6.0, n_experts=4)
    assert [p.fingerprint for p in status.peers] == sorted([a.fingerprint, b.fingerprint]) + [w.fingerprint]
    assert status.n_experts == 4 and status.shape_inferred  # experts given, layers inferred
    assert [d.fingerprint for d in status.departed] == [gone]

    rows = {row[0]: dict(zip(PEER_COLUMNS, row, strict=True)) for row in peer_rows(status)}
    ra = rows[a.fingerprint]
    assert ra["role"] == "composer" and ra["step"] == "120" and ra["loss"] == "3.1416"
    assert ra["owned"] == "4" and ra["experts"] == "L0:0-2 L1:3" and ra["versions"] == "5/17"
    assert ra["age s"] == "2.0"  # expires in 4 s of a 6 s TTL
    assert rows[b.fingerprint]["age s"] == "0.5" and rows[b.fingerprint]["loss"] == "-"
    assert rows[w.fingerprint]["experts"] == "-" and rows[w.fingerprint]["owned"] == "0"
    assert dead.fingerprint not in rows

    layers = [dict(zip(SHARD_COLUMNS, row, strict=True)) for row in shard_rows(status)]
    assert [lo["layer"] for lo in layers] == ["0", "1"]
    assert layers[0]["owned"] == "3/4" and layers[0]["no owner"] == "3"
    pair = "+".join(sorted([a.fingerprint, b.fingerprint]))
    assert layers[0]["too many owners"] == f"2({pair})"
    assert f"{a.fingerprint}: 0-2" in layers[0]["owners (experts)"]
    assert layers[1]["owned"] == "2/4" and layers[1]["no owner"] == "1,2" and layers[1]["too many owners"] == "-"

    data = status.to_json()
    assert data["layers"][0]["contested"] == [2] and data["layers"][1]["unowned"] == [1, 2]
    assert data["layers"][0]["owners"][2] == sorted([a.fingerprint, b.fingerprint])
    peer = next(p for p in data["peers"] if p["fingerprint"] == a.fingerprint)
    assert peer["experts"] == {"0": [0, 1, 2], "1": [3]} and peer["versions"] == {"held": 5, "max": 17}


def test_shape_is_inferred_without_one_and_empty_without_owners():
    view = SwarmView(run_id="r1", read_at=100.0, members={m.fingerprint: m for m in [_member(b"w", role="worker")]})
    status = swarm_status(view)
    assert status.layers == () and status.n_experts == 0 and status.shape_inferred
    assert swarm_status(SwarmView(run_id="r1", read_at=1.0)).peers == ()


def test_cli_refuses_a_malformed_multiaddr_before_starting_anything():
    for bad, why in [("/ip4/127.0.0.1/tcp/4001", "lacks the /p2p/<peer id>"),
                     ("127.0.0.1:4001", "is not a multiaddr"),
                     (f"/ip4/1.2.3.4/tcpx/1/p2p/{PID}", "malformed")]:
        result = runner.invoke(app, ["swarm", "status", "--run-id", "r1", "--initial-peers", bad])
        assert result.exit_code == 2, result.output
        assert why in result.output and "--initial-peers" in result.output


def test_cli_needs_a_peer_and_a_valid_run_id():
    none = runner.invoke(app, ["swarm", "status", "--run-id", "r1"])
    assert none.exit_code == 2 and "at least one peer" in none.output
    peer = f"/ip4/1.2.3.4/tcp/1/p2p/{PID}"
    bad = runner.invoke(app, ["swarm", "status", "--run-id", "no spaces", "--initial-peers", peer])
    assert bad.exit_code == 2 and "run id" in bad.output


def test_suspects_gather_what_every_live_composer_reports():
    liar = PID[:-1] + "z"
    c = _member(b"c")
    a = _member(b"a", suspects={liar: 4.0, c.heartbeat.peer_id: 0.6}, banned=(liar,))
    b = _member(b"b", suspects={liar: 2.0})
    view = SwarmView(run_id="r", read_at=100.0, members={m.fingerprint: m for m in (a, b, c)})
    status = swarm_status(view)
    first, second = status.suspects()
    assert (first.peer_id, first.fingerprint, first.highest_score) == (liar, None, 4.0)
    assert first.banned_by == (a.fingerprint,)
    assert sorted(first.suspected_by) == sorted([a.fingerprint, b.fingerprint])
    assert second.fingerprint == c.fingerprint and second.banned_by == ()
    rows = suspect_rows(status)
    assert len(rows[0]) == len(SUSPECT_COLUMNS) and rows[0][1] == "-" and rows[1][1] == c.fingerprint
    assert status.to_json()["suspects"][0]["banned_by"] == [a.fingerprint]
