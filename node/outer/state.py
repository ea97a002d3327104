"""A shared group's state (anchor and outer momentum) for a joiner, or for a peer whose round went wrong.

hivemind's averager hands its state out by each peer's self-declared priority, so a peer that declares the
highest one serves every joiner and every peer that reloads, whatever it serves. Here the state comes from
several live composers at once (up to ``SOURCES``, chosen at random, those whose contributions others merged
first: ``source_order``; one that does not answer, as a peer that just left, is replaced by the next): each answer
is decoded with the group's names and shapes and checked finite, and the one taken is the nearest to the
coordinate-wise median of the sources' anchors (``candidate_states``): one liar among three is outvoted. A node
with a single live peer takes its state and says so. Of two sources that disagree, nothing here says which is
right: a node that trains hands both to its held-out probe (``background.best_of``), an export takes neither.

Wire (``StateServicer.rpc_state``, request ``uid`` = group): the first message is msgpack metadata (group,
round, step, names, momentum), the rest a msgpack list of raw float32 tensor blobs, in 1 MiB chunks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from parallax.node.net.network import RateLimiter, ServedOnLoop, read_answer
from parallax.protocol.codec import TensorLimits, decode, encode
from parallax.protocol.errors import MalformedMessage, ProtocolError, malformed
from parallax.protocol.schema import MSGPACK_ERRORS

logger = logging.getLogger(__name__)

SOURCES = 3
"""Composers asked at once for a group's state."""
_RETRY_S = 0.5
"""How long a source whose request failed in transit is left before it is asked once more."""
PAIR_AGREEMENT = 0.5
"""Of two sources, the anchors must differ by at most this fraction of their norm: honest composers' anchors
differ by the rounds each took part in (a few percent), a poisoned one by far more."""
CHUNK_BYTES = 1 << 20
_META_MAX_BYTES = 64 * 1024

StateProvider = Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]]
State = tuple[dict[str, Any], list[torch.Tensor]]


class Candidates(typing.NamedTuple):
    """What a download of a group's state found."""

    states: list[State]
    """The states worth taking (``candidate_states``): one, none, or two that disagree."""
    served: frozenset[str]
    """The peers that served a well-formed state (the group's names and shapes, finite), each from its own peer id:
    they run (whether or not their state was the one chosen)."""


class StateServicer(ServicerBase):
    """Streams the state a provider publishes for a group; an empty stream when it serves none, or to a peer
    ``may_fetch`` refuses. Do not rename (protocol id).

    A provider returns the same objects until it publishes anew: their encoding is made once, off the loop that
    serves every stream, and kept until then."""

    def __init__(self, may_fetch: Callable[[str], bool] | None = None) -> None:
        self.providers: dict[str, StateProvider] = {}
        self.may_fetch = may_fetch
        self.bytes_served = 0
        self._packed: dict[str, tuple[object, bytes]] = {}  # group -> (the tensors packed, their encoding)

    async def rpc_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        provider = self.providers.get(request.uid)
        if provider is None or (self.may_fetch is not None and not self.may_fetch(str(context.remote_id))):
            return
        try:
            meta, tensors = provider()
        except RuntimeError:  # nothing published yet
            return
        packed = self._packed.get(request.uid)
        if packed is None or packed[0] is not tensors:
            encoded = await asyncio.get_running_loop().run_in_executor(None, _encode, tensors)
            packed = self._packed[request.uid] = (tensors, encoded)
        body = packed[1]
        yield runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(meta, use_bin_type=True))
        for start in range(0, len(body), CHUNK_BYTES):
            yield runtime_pb2.ExpertInfo(serialized_info=body[start:start + CHUNK_BYTES])
        self.bytes_served += len(body)


def _encode(tensors: Sequence[torch.Tensor]) -> bytes:
    return msgpack.packb([encode(t.detach().cpu().float().numpy(), "raw") for t in tensors],
                         use_bin_type=True)


class StateExchange(ServedOnLoop):
    """Serves this node's published group states and downloads a group's state from several peers.

    Args:
        p2p, loop: this node's P2P replica and network loop.
        run_id: namespaces the handler.
        peers: () -> libp2p peer ids of the live composers (sources are drawn from them, this node excluded).
        own_peer_id: this node's peer id.
        may_fetch: peer id -> whether it may download this node's states (None: anyone).
    """

    def __init__(self, p2p: P2P, loop: asyncio.AbstractEventLoop, run_id: str,
                 peers: Callable[[], Sequence[str]], *, own_peer_id: str,
                 may_fetch: Callable[[str], bool] | None = None) -> None:
        super().__init__(p2p, loop, f"parallax.{run_id}.state", StateServicer(may_fetch),
                         RateLimiter(per_s=2.0, burst=20.0))
        self.peers, self.own_peer_id = peers, own_peer_id
        self._lock = threading.Lock()

    def serve(self, group: str, provider: StateProvider | None) -> None:
        """Serve ``provider()`` for ``group`` (None: stop serving it)."""
        assert isinstance(self.servicer, StateServicer)
        with self._lock:
            if provider is None:
                self.servicer.providers.pop(group, None)
            else:
                self.servicer.providers[group] = provider

    def download(self, group: str, shapes: Mapping[str, Sequence[int]], timeout_s: float, *,
                 sources: Sequence[str] | None = None, first: Collection[str] = ()) -> State | None:
        """The group's state as at least two sources agree on it (or the only source's); None when nobody served
        one that checks out, or two sources disagree. Sources are drawn at random from the live composers (those of
        them in ``sources``, when given), those in ``first`` before the others (``source_order``); one that fails
        is replaced by the next (``_fetch_all``). Blocks the calling thread (not the loop) for at most
        ``timeout_s``."""
        found = self.candidates(group, shapes, timeout_s, sources=sources, first=first).states
        return found[0] if len(found) == 1 else None

    def candidates(self, group: str, shapes: Mapping[str, Sequence[int]], timeout_s: float, *,
                   sources: Sequence[str] | None = None, first: Collection[str] = ()) -> Candidates:
        """As ``download``, but two sources that disagree are both returned (``candidate_states``), with the peers
        that served a well-formed state (``Candidates.served``)."""
        peers = source_order(self.peers(), own=self.own_peer_id, sources=sources, first=first)
        if not peers:
            return Candidates([], frozenset())
        vouched = {p for p in peers if p in first}
        future = asyncio.run_coroutine_threadsafe(self._fetch_all(group, peers, shapes, timeout_s, vouched=vouched),
                                                  self.loop)
        try:
            states, asked = future.result(timeout_s + 2)
        except Exception as e:
            logger.info("downloading the state of %s failed: %r", group, e)
            return Candidates([], frozenset())
        return Candidates(candidate_states(group, states, shapes, asked=asked), frozenset(states))

    async def _fetch_all(self, group: str, candidates: Sequence[str], shapes: Mapping[str, Sequence[int]],
                         timeout_s: float, *, vouched: Collection[str] = ()) -> tuple[dict[str, State], int]:
        """The states of up to ``SOURCES`` of ``candidates``, asked in order, ``SOURCES`` at once: one that does not
        answer with a usable state (a peer that just left, one that serves none) is replaced by the next candidate
        while time is left, so that a view with departed peers in it still yields three sources to compare.

        Past the ``vouched`` candidates (first in order: ``source_order``), at most ``SOURCES`` of the others are
        asked while one of those has not answered yet, or once two states are in hand (a third is sought among them):
        the rest may be identities nobody runs, each costing a dial that fails. When the vouched-for candidates ended
        with fewer than two states, the rest are asked in turn until ``SOURCES`` states are in hand.

        A source whose request failed in transit (a stream reset or a dial that failed on a loaded host; not one
        whose bytes were refused, nor one that answered it serves nothing) is asked once more: a vouched-for one
        before any candidate not asked yet, the others after all of them, while time is left. Returns the states and
        how many candidates were asked."""
        deadline = self.loop.time() + timeout_s
        queue = iter(candidates)
        again: list[str] = []  # failed in transit, to be asked once more
        retried: set[str] = set()
        pending: set[asyncio.Task[tuple[str, State | None]]] = set()
        states: dict[str, State] = {}
        asked = 0
        first = set(vouched)
        ended: set[str] = set()  # asked, and answered or failed

        async def one(peer: str) -> tuple[str, State | None]:
            if peer in retried:
                await asyncio.sleep(_RETRY_S)
            try:
                return peer, await asyncio.wait_for(self._fetch(peer, group, shapes), deadline - self.loop.time())
            except ProtocolError as e:  # its bytes were refused: evidence, not luck
                logger.info("no usable state of %s from peer %s: %r", group, peer, e)
            except Exception as e:  # unreachable or slow this time
                logger.info("no state of %s from peer %s this time: %r", group, peer, e)
                if peer not in retried:
                    again.append(peer)
            return peer, None

        def next_peer() -> tuple[str, bool] | None:
            """The next source to ask and whether it is asked again; None when none may be asked now."""
            vouched_again = next((p for p in again if p in first), None)
            if vouched_again is not None:
                again.remove(vouched_again)
                return vouched_again, True
            if first and asked >= len(first) + SOURCES and (len(states) >= 2 or not first <= ended):
                return None
            peer = next(queue, None)
            if peer is not None:
                return peer, False
            return (again.pop(0), True) if again else None

        def ask_next() -> bool:
            nonlocal asked
            found = None if self.loop.time() >= deadline else next_peer()
            if found is None:
                return False
            peer, retry = found
            if retry:
                retried.add(peer)
            else:
                asked += 1
            pending.add(asyncio.ensure_future(one(peer)))
            return True

        def fill() -> None:
            while len(states) + len(pending) < SOURCES and ask_next():
                pass

        fill()
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                peer, state = task.result()
                if peer not in again:  # one to be asked again has not ended
                    ended.add(peer)
                if state is not None:
                    states[peer] = state
            fill()
        return states, asked

    async def _fetch(self, peer: str, group: str, shapes: Mapping[str, Sequence[int]]) -> State | None:
        stub = StateServicer.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        stream = await stub.rpc_state(runtime_pb2.ExpertRequest(uid=group))
        parts = await read_answer(stream, cap=_META_MAX_BYTES + state_bytes_cap(shapes), peer=peer,
                                  what=f"state of {group}")
        if not parts:
            return None
        meta_bytes, body = parts[0], b"".join(parts[1:])
        return decode_state(group, meta_bytes, body, shapes, peer=peer)


def source_order(live: Iterable[str], *, own: str, sources: Collection[str] | None = None,
                 first: Collection[str] = ()) -> list[str]:
    """The order in which a download asks ``live`` composers (``own`` left out; only those in ``sources`` when
    given) for a group's state: those in ``first`` before the others, each part in random order. Any identity that
    heartbeats is a live composer, so a few hundred of them made up by one attacker, each naming a peer id nobody
    runs, would take every turn of a download drawn from all alike (each failing only once its dial does);
    ``first`` names the peers with something to show for themselves (contributions two other peers merged:
    ``transport.vouched``), and ``StateExchange._fetch_all`` asks few of the rest while those answer."""
    peers = [p for p in live if p != own and (sources is None or p in sources)]
    random.shuffle(peers)
    peers.sort(key=lambda p: p not in first)  # stable: each part stays in its random order
    return peers


def state_bytes_cap(shapes: Mapping[str, Sequence[int]]) -> int:
    per_copy = sum(TensorLimits(max_elements=math.prod(s), max_ndim=max(len(s), 1)).max_blob_bytes
                   for s in shapes.values())
    return 2 * per_copy + 64 * (2 * len(shapes) + 1)


def decode_state(group: str, meta_bytes: bytes, body: bytes, shapes: Mapping[str, Sequence[int]], *,
                 peer: str) -> State:
    """A peer's answer back to (metadata, tensors): the anchor of exactly ``shapes`` (in order), then the momentum
    buffers when the metadata says so; finite float32.

    Raises:
        MalformedMessage: anything else.
    """
    names = list(shapes)
    try:
        meta = msgpack.unpackb(meta_bytes, raw=False, max_str_len=256, max_array_len=len(names) + 8,
                               max_map_len=16, max_bin_len=0) if len(meta_bytes) <= _META_MAX_BYTES else None
        blobs = msgpack.unpackb(body, raw=False, max_array_len=2 * len(names), max_bin_len=len(body),
                                max_str_len=0, max_map_len=0)
    except MSGPACK_ERRORS:
        raise MalformedMessage(f"undecodable state of {group}", peer=peer) from None
    if not (isinstance(meta, dict) and meta.get("group") == group and meta.get("names") == names
            and isinstance(meta.get("momentum"), bool) and isinstance(blobs, list)
            and type(meta.get("round")) is int and meta["round"] >= 0):
        raise MalformedMessage(f"state of {group} with other names or metadata", peer=peer)
    expected = [shapes[n] for n in names] * (2 if meta["momentum"] else 1)
    if len(blobs) != len(expected):
        raise MalformedMessage(f"state of {group} has {len(blobs)} tensors, not {len(expected)}", peer=peer)
    tensors = []
    for blob, shape in zip(blobs, expected, strict=True):
        limits = TensorLimits(max_elements=math.prod(shape), max_ndim=max(len(shape), 1), codecs=frozenset({"raw"}),
                              dtypes=frozenset({"float32"}))
        try:
            array = decode(blob, limits, peer=peer, what=f"state of {group}")
        except ProtocolError as e:
            raise malformed(e, peer) from None
        if tuple(array.shape) != tuple(shape):
            raise MalformedMessage(f"state of {group}: a tensor of shape {array.shape}, not {tuple(shape)}", peer=peer)
        tensors.append(torch.from_numpy(np.ascontiguousarray(array)))
    return meta, tensors


def candidate_states(group: str, states: Mapping[str, State], shapes: Mapping[str, Sequence[int]], *,
                     asked: int) -> list[State]:
    """The downloaded states worth taking, each with its ``source`` in its metadata: one chosen, none, or the two of
    a pair that disagree (in their sources' order), for the caller to judge on data of its own.

    Honest composers' anchors differ by the rounds each took part in, so states are compared robustly, not for
    equality: of three or more, the one nearest the coordinate-wise median of all the anchors (one liar cannot
    move the median far); of two, one of them when their anchors agree within ``PAIR_AGREEMENT`` of their scale,
    both when they do not (a poisoned state, or an honest source whose rounds stopped: a stale one; no vote
    tells them apart); a lone answer only when it came from the only live composer asked.
    """
    if not states:
        return []
    states = {peer: ({**meta, "source": peer}, tensors) for peer, (meta, tensors) in states.items()}
    peers = sorted(states)
    if len(peers) == 1:
        peer = peers[0]
        if asked == 1:
            logger.info("state of %s from the only live composer, peer %s (nothing to compare it with)", group, peer)
            return [states[peer]]
        logger.warning("only peer %s of %d asked served a state of %s: nobody vouches for it, none taken", peer,
                       asked, group)
        return []
    n = len(shapes)
    anchors = {p: torch.cat([t.reshape(-1) for t in states[p][1][:n]]) for p in peers}
    if len(peers) == 2:
        a, b = (anchors[p] for p in peers)
        apart = float((a - b).norm()) / max(0.5 * float(a.norm() + b.norm()), 1e-30)
        if apart > PAIR_AGREEMENT:
            logger.warning("the two sources of the state of %s disagree (%s: %.0f%% of their norm apart, rounds %s; "
                           "at most %.0f%% agree)", group, ", ".join(peers), 100 * apart,
                           "/".join(str(states[p][0].get("round")) for p in peers), 100 * PAIR_AGREEMENT)
            return [states[p] for p in peers]
        return [states[peers[0]]]  # either: they agree (a self-declared round number must not choose)
    median = torch.stack([anchors[p] for p in peers]).median(dim=0).values
    distance = {p: float((anchors[p] - median).norm()) for p in peers}
    best = min(peers, key=lambda p: (distance[p], p))
    for p in peers:
        if distance[p] > 10 * max(distance[best], 1e-12 * float(median.norm()) + 1e-30):
            logger.warning("peer %s served a state of %s far from the other sources' (%.3g against %.3g)", p, group,
                           distance[p], distance[best])
    return [states[best]]
