"""The redialer's choice of whom to dial and at which addresses (the daemon replaced by a recorder)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from parallax.node.peer.redial import Redialer

A = "12D3KooWQMeeqkDeMWWHRcouSnN8REbEvXLVTux8BdjBfgdf7NX9"
B = "12D3KooWHJkHfUh4rHKQjy7sWM5cQenwUbdDi8ten4YBcM9j6JDm"
C = "12D3KooWL4k43mZtNYK7meCwatgerMQZWUkjCg7uESkWrxA7KnMZ"
RELAY = "12D3KooWMRJrHV7saXz7u2SuW5tJqnUrD8aFg11mjcVTNSpCPToU"


class _Daemon:
    def __init__(self, connected: list[str], fail: set[str] = frozenset()) -> None:
        self.connected, self.fail, self.dials = connected, fail, []
        self._client = SimpleNamespace(connect=self._connect)

    async def list_peers(self):  # type: ignore[no-untyped-def]
        return [SimpleNamespace(peer_id=p) for p in self.connected]

    async def _connect(self, peer_id, maddrs):  # type: ignore[no-untyped-def]
        self.dials.append((peer_id.to_base58(), [str(m) for m in maddrs]))
        if peer_id.to_base58() in self.fail:
            raise ConnectionError("all dials failed")


def test_only_live_peers_not_connected_are_dialed_at_their_own_addresses():
    relayed = f"/ip4/10.77.0.2/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{B}"
    peers = {A: (f"/ip4/10.0.0.1/tcp/1/p2p/{A}",),
             B: (f"/ip4/172.16.0.2/tcp/2/p2p/{B}", relayed, f"/ip4/10.0.0.9/tcp/9/p2p/{C}", "not a multiaddr"),
             C: (), "me": (f"/ip4/10.0.0.3/tcp/3/p2p/{C}",)}
    daemon = _Daemon(connected=[A], fail={B})
    loop = asyncio.new_event_loop()  # start() would schedule on it; run_once is driven here
    redial = Redialer(daemon, loop, "me", lambda: peers)
    loop.run_until_complete(redial.run_once())
    loop.close()
    # A is connected, "me" is this node, C names no address of its own: only B, at its two addresses.
    assert daemon.dials == [(B, ["/ip4/172.16.0.2/tcp/2", f"/ip4/10.77.0.2/tcp/4001/p2p/{RELAY}/p2p-circuit"])]
    assert redial.failed == 1 and redial.dialed == 0


def test_a_pass_dials_a_bounded_number_in_turn():
    peers = {p: (f"/ip4/10.0.0.1/tcp/1/p2p/{p}",) for p in (A, B, C)}
    daemon = _Daemon(connected=[])
    loop = asyncio.new_event_loop()
    redial = Redialer(daemon, loop, "me", lambda: peers, per_pass=2)
    loop.run_until_complete(redial.run_once())
    loop.run_until_complete(redial.run_once())
    loop.close()
    dialed = [p for p, _ in daemon.dials]
    assert len(dialed) == 4 and set(dialed) == {A, B, C} and redial.dialed == 4
