"""A peer's way onto the network, shared by the composer (``runner.Node``) and the worker (``worker.Worker``).

``start_dht`` starts the run's DHT node with the record validator that protects the run's signed keys.
``cap_stream_messages`` bounds what one P2P stream message may announce: hivemind reads a message whose
8-byte length prefix says 256 MiB until 256 MiB have arrived, so a peer could make every handler of ours hold
as much as it cares to send; no message of Parallax's protocols is over 4 MiB (chunks are 1 MiB).
``NetworkLoop`` is the one asyncio loop of a peer's network side, in a thread of its own, with a replica of
the DHT's libp2p daemon handle: P2P services and clients are scheduled on it from other threads, and
``close`` shuts the replica down and stops the loop, each step bounded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import threading
import time
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Self

from hivemind.p2p import P2P, ServicerBase

from parallax.dht.adapter import DHTConfig, SwarmDHT, parse_initial_peers
from parallax.dht.keys import protected_keys, replica_groups
from parallax.dht.records import Admission, Ed25519RecordValidator
from parallax.node.config.peer import PeerConfig
from parallax.node.config.train import SHARED_GROUPS, TrainConfig
from parallax.protocol.errors import OversizedMessage, RemoteProtocolError, StalledStream
from parallax.protocol.identity import Identity

logger = logging.getLogger(__name__)


MAX_STREAM_MESSAGE_BYTES = 8 * 2**20
"""The largest P2P stream message read (hivemind's own cap on a daemon message is 4 MiB)."""


class StreamMessageTooLarge(ValueError):
    """A peer announced a P2P stream message longer than ``MAX_STREAM_MESSAGE_BYTES``: the stream is dropped."""


async def _capped_receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > MAX_STREAM_MESSAGE_BYTES:
        raise StreamMessageTooLarge(f"a P2P stream message announced {length} bytes, over the cap of "
                                    f"{MAX_STREAM_MESSAGE_BYTES}: the stream is dropped")
    return await reader.readexactly(length)


def cap_stream_messages() -> None:
    """Make hivemind's P2P refuse stream messages over ``MAX_STREAM_MESSAGE_BYTES`` before reading them, in this
    process and the ones it forks later (hivemind reads them through this one static method)."""
    P2P.receive_raw_data = staticmethod(_capped_receive_raw_data)



def start_dht(identity: Identity, peer: PeerConfig, *, identity_path: Path, n_layers: int,
              admission: Admission | None = None, while_starting: Callable[[], object] | None = None,
              extra_groups: Sequence[str] = ()) -> SwarmDHT:
    """The run's DHT node for ``peer``'s addresses: its libp2p key beside ``identity_path`` (``.p2p``), records
    of the run's protected keys (the shared groups' rounds, and ``extra_groups``': a run's replicated experts',
    ``run_replica_groups``) signed and checked with ``identity`` (and, in an allowlist run,
    ``admission``'s certificates).

    Raises:
        DHTError: as ``SwarmDHT.start``.
    """
    cap_stream_messages()
    initial = tuple(parse_initial_peers(peer.initial_peers))
    config = DHTConfig(initial_peers=initial, host_maddrs=peer.listen, announce_maddrs=peer.announce,
                       identity_path=identity_path.with_name(identity_path.name + ".p2p"),
                       relays=initial if peer.relayed else (), relay_always=peer.relay == "always")
    # A node names every key of its run, so it learns none: a hostile signed record under one of hivemind's own
    # keys (the averager's matchmaking) must not make it refuse hivemind's unsigned records there.
    validator = Ed25519RecordValidator(identity, protected_keys=protected_keys(
        peer.run_id, n_layers, [*SHARED_GROUPS, *extra_groups]), learn_protected=False, admission=admission)
    return SwarmDHT.start(config, [validator], while_starting=while_starting)


def run_replica_groups(cfg: TrainConfig) -> list[str]:
    """The outer-round groups of a run's replicated experts (none with one owner per expert)."""
    return replica_groups(cfg.model.n_layers, cfg.model.n_experts) if cfg.ownership.replicas > 1 else []


class RateLimiter:
    """Token buckets per (remote peer, handler): ``per_s`` requests a second on average, ``burst`` at once.
    Memory is bounded: the least recently seen peers are forgotten first."""

    def __init__(self, per_s: float, burst: float, *, max_peers: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (per_s > 0 and burst >= 1):
            raise ValueError("a rate limit needs per_s > 0 and burst >= 1")
        self.per_s, self.burst, self.max_peers, self._clock = per_s, burst, max_peers, clock
        self._buckets: collections.OrderedDict[tuple[str, str], tuple[float, float]] = collections.OrderedDict()
        self.refused = 0

    def allow(self, peer: str, handler: str) -> bool:
        now, key = self._clock(), (peer, handler)
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.per_s)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        if not allowed:
            self.refused += 1
        return allowed


def rate_limited(servicer: ServicerBase, limiter: RateLimiter) -> Any:
    """An object with ``servicer``'s handlers, each first asking ``limiter`` for the calling peer: a unary call
    over the limit gets an error, a stream over the limit ends at once (hivemind's ``wrapper`` argument)."""
    wrapper = types.SimpleNamespace()
    for name in dir(type(servicer)):
        if not name.startswith("rpc_"):
            continue
        handler = getattr(servicer, name)
        if inspect.isasyncgenfunction(handler):
            async def stream(request: Any, context: Any, handler: Any = handler, name: str = name) -> Any:
                if not limiter.allow(str(context.remote_id), name):
                    logger.debug("rate-limited %s from %s", name, context.remote_id)
                    return
                async for item in handler(request, context):
                    yield item
            setattr(wrapper, name, stream)
        else:
            async def unary(request: Any, context: Any, handler: Any = handler, name: str = name) -> Any:
                if not limiter.allow(str(context.remote_id), name):
                    raise RemoteProtocolError(f"too many {name} requests; slow down", peer=str(context.remote_id))
                return await handler(request, context)
            setattr(wrapper, name, unary)
    return wrapper


async def read_answer(stream: AsyncIterator[Any], *, cap: int, peer: str, what: str,
                      chunk_timeout_s: float | None = None) -> list[bytes]:
    """The payloads (``serialized_info``) of a peer's answer ``stream``, which is closed after, whatever happens.

    Args:
        cap: the most bytes the payloads may hold together.
        peer: the answering peer, named in the errors.
        what: what the answer is, for the errors ("outer contribution router/7").
        chunk_timeout_s: the longest wait for each message, the first included (None: no bound of its own;
            the caller's overall timeout bounds the read).

    Raises:
        OversizedMessage: more than ``cap`` bytes.
        StalledStream: no message within ``chunk_timeout_s``.
    """
    parts: list[bytes] = []
    size = 0
    messages = aiter(stream)
    try:
        while True:
            try:
                msg = await asyncio.wait_for(anext(messages), chunk_timeout_s)
            except StopAsyncIteration:
                return parts
            except TimeoutError:
                raise StalledStream(f"{what}: nothing for {chunk_timeout_s:g} s after {len(parts)} message(s)",
                                    peer=peer) from None
            size += len(msg.serialized_info)
            if size > cap:
                raise OversizedMessage(f"{what} longer than {cap} bytes", peer=peer)
            parts.append(msg.serialized_info)
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]


class ServedOnLoop:
    """A P2P service of this node on its network loop: ``servicer``'s handlers under ``namespace``, rate-limited
    per calling peer (default 20 a second, 50 at once), added by ``start`` and removed by ``close`` (each
    bounded; closing never raises)."""

    def __init__(self, p2p: Any, loop: asyncio.AbstractEventLoop, namespace: str, servicer: ServicerBase,
                 limiter: RateLimiter | None = None) -> None:
        self.p2p, self.loop, self.namespace, self.servicer = p2p, loop, namespace, servicer
        self.limiter = limiter or RateLimiter(per_s=20.0, burst=50.0)

    def start(self, timeout_s: float = 10.0) -> Self:
        asyncio.run_coroutine_threadsafe(self.servicer.add_p2p_handlers(
            self.p2p, rate_limited(self.servicer, self.limiter), namespace=self.namespace), self.loop).result(timeout_s)
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(Exception):  # the loop or the daemon may already be gone
            asyncio.run_coroutine_threadsafe(
                self.servicer.remove_p2p_handlers(self.p2p, namespace=self.namespace), self.loop).result(timeout_s)


async def _end_tasks() -> None:
    """Cancel every other task of the running loop and wait for them, then close its async generators."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


class NetworkLoop:
    """An asyncio loop in a daemon thread and a replica of ``dht``'s P2P daemon handle (``p2p``).

    Raises:
        TimeoutError and hivemind's errors: the replica did not come up within ``timeout_s`` (the loop is
            stopped again).
    """

    def __init__(self, dht: SwarmDHT, name: str, timeout_s: float = 30.0) -> None:
        cap_stream_messages()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.p2p: Any = None
        try:
            self.p2p = self.run(dht.hivemind_dht.replicate_p2p(), timeout_s)
        except BaseException:
            self.close()
            raise

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """Run ``coro`` on the loop from another thread and wait for it, at most ``timeout_s``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self, *first: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> None:
        """Run ``first`` (e.g. removing handlers), shut the P2P replica down, end the tasks still running (streams
        being answered or read: cancelled, their ``finally`` blocks run here, not whenever the garbage collector
        finds them in another thread), stop the loop; each step bounded, failures logged (shutting down must not
        raise)."""
        steps = [*first, *([self.p2p.shutdown()] if self.p2p is not None else []), _end_tasks()]
        for coro in steps:
            try:
                self.run(coro, timeout_s)
            except Exception as e:
                logger.debug("network loop shutdown step: %r", e)
        self.p2p = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


__all__ = ["MAX_STREAM_MESSAGE_BYTES", "NetworkLoop", "RateLimiter", "ServedOnLoop", "StreamMessageTooLarge",
           "cap_stream_messages", "rate_limited", "start_dht"]
