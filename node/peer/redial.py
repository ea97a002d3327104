"""Keep this node dialable-to: connect to live peers at the addresses their heartbeats name.

libp2p dials a peer at the addresses its own peerstore holds, which it learns from the peers it has talked to
(identify). A peer behind NAT is known there only by its private address; the addresses that reach it, through
a circuit relay, are in its heartbeat (``Membership``, ``SwarmDHT.relayed_maddrs``). Every ``period_s`` this
connects to the live peers the daemon is not connected to, at their heartbeat's addresses, so that the daemon
knows those addresses and holds a connection when gossip, the snapshot exchange or an outer round calls the
peer. A peer that cannot be reached at any of them is tried again at the next pass, and said so at debug level.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import multiaddr
from hivemind.p2p import PeerID

from parallax.dht.adapter import split_peer_address

logger = logging.getLogger(__name__)


class Redialer:
    """Connects ``p2p``'s daemon to the peers ``peers()`` names (peer id -> addresses) that it is not connected to.

    Args:
        p2p, loop: this node's P2P replica and network loop.
        own_peer_id: this node's (never dialed).
        peers: the live peers' addresses, from the membership view.
        period_s: between passes; timeout_s: one dial; per_pass: at most this many dials a pass (bounded work in
            a large swarm; the rest come at later passes).
    """

    def __init__(self, p2p: Any, loop: asyncio.AbstractEventLoop, own_peer_id: str,
                 peers: Callable[[], Mapping[str, Sequence[str]]], *, period_s: float = 15.0, timeout_s: float = 10.0,
                 per_pass: int = 16) -> None:
        self.p2p, self.loop, self.own_peer_id, self.peers = p2p, loop, own_peer_id, peers
        self.period_s, self.timeout_s, self.per_pass = period_s, timeout_s, per_pass
        self.dialed = 0
        self.failed = 0
        self._task: concurrent.futures.Future[None] | None = None
        self._next = 0

    def start(self) -> Self:
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        return self

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.run_once()
            except Exception as e:  # a pass that fails (the daemon restarting) is retried at the next
                logger.debug("redial pass failed: %r", e)

    async def run_once(self) -> None:
        """One pass: dial the live peers the daemon has no connection to (at most ``per_pass``, in turn)."""
        connected = {str(info.peer_id) for info in await self.p2p.list_peers()}
        missing = sorted(p for p in self.peers() if p != self.own_peer_id and p not in connected)
        if not missing:
            return
        start = self._next % len(missing)
        chosen = (missing[start:] + missing[:start])[:self.per_pass]
        self._next = start + len(chosen)
        known = self.peers()
        await asyncio.gather(*(self._dial(p, known.get(p, ())) for p in chosen))

    async def _dial(self, peer_id: str, addresses: Sequence[str]) -> None:
        maddrs = []
        for address in addresses:
            with contextlib.suppress(ValueError, multiaddr.exceptions.Error):  # a malformed one is skipped
                where, owner = split_peer_address(address)
                if owner == peer_id:
                    maddrs.append(where)
        if not maddrs:
            return
        try:
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id), maddrs), self.timeout_s)
            self.dialed += 1
        except Exception as e:  # unreachable at every address now: tried again at the next pass
            self.failed += 1
            logger.debug("could not reach peer %s at %s: %s", peer_id, [str(m) for m in maddrs], e)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


__all__ = ["Redialer"]
