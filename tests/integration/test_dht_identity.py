"""A node's libp2p identity: written whole by the start that creates it, and the same peer id at the next."""

from __future__ import annotations

from pathlib import Path

from parallax.dht.adapter import DHTConfig, SwarmDHT, p2p_identity_path


def _peer_id(path: Path) -> str:
    dht = SwarmDHT.start(DHTConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), identity_path=path))
    try:
        return str(dht.peer_id)
    finally:
        dht.shutdown()


def test_a_new_libp2p_identity_is_written_whole_and_names_the_same_peer_next_time(tmp_path: Path) -> None:
    path = p2p_identity_path(tmp_path / "node.key")
    first = _peer_id(path)
    assert [p.name for p in tmp_path.iterdir()] == ["node.key.p2p"]  # no temporary file left beside it
    assert path.stat().st_size > 0
    assert _peer_id(path) == first
