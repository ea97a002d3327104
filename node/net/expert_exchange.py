"""Expert snapshots over P2P streams: heirs keep a recent copy of the experts they inherit, and a node
that takes an expert over fetches its latest state from the peer that trained it.

DESIGN.md section 4 ("Shard ownership", "Joining mid-run"). A snapshot is one expert's weights and its
AdamW state (``Composer.expert_snapshot``) encoded as an ``ExpertSnapshot`` message (raw float32). Each
node serves, from a thread-safe ``SnapshotStore``:

- a *periodic* snapshot of every expert it owns, replaced by the training loop every few steps;
- a *final* snapshot of every expert it just released (a joiner took it over), kept for ``keep_s``;
- the *heir copy* it holds of an expert it does not own, when that is newer than its own final one.

and pulls, in the background every ``poll_s``, the periodic snapshot of every expert it is the *heir* of (the node
that owns the expert if its owner leaves), whenever the owner's step advanced. The heir asks with the place of its
copy on the owner's chain (``snapshot_chain``): the owner answers with ternary links from there (an
``ExpertSnapshotLinks``), or a keyframe; a leaving owner answers with its exact final snapshot. A node that released
the expert and holds no place on a chain of it asks from its final snapshot: the new owner's chain starts at the
copy it adopted, most often that one, and the releaser is most often its heir. When the owner dies, the heir already
holds its expert and loses at most the steps since that snapshot. A node that is no longer an expert's heir (a
joiner took that role in its view) keeps its copy ``keep_s`` longer and serves it: under churn the new heir may not
have pulled a copy yet (the owner's view may not have it), may leave before it does, or the views may name another
new owner, which then finds the copy by asking the live composers.

Trust: a snapshot is a signed envelope (``protocol.envelope``), sealed once when the owner takes it, and is
asked for by peer id from the node the signed membership names as the expert's owner (or previous owner, or
from any live composer when that owner is dead); the asker accepts it only when it is signed by the key the
membership names for that peer, so a copy can come from no one else even if it travels further some day. An heir
serves a copy it checked under its own signature: it vouches for it as for an expert it trained (a composer
could serve anything as its own final snapshot). Its sequence number is not checked (the same
snapshot is served again and again; its ``step`` is what orders copies) and its timestamp may be up to
``SNAPSHOT_WINDOW_S`` old. Its tensors are still checked (names, shapes, finite, a norm bound) before use —
a bad one is refused and logged, never raised into the training loop. The stream's first message (step,
final, age) is unsigned metadata from that authenticated peer; the step is checked against the signed one.

Concurrency: the servicer and the pulls run on the node's network loop (``loop``, shared with the
surrogate gossip); the training thread calls ``put``/``release`` (never blocks on the network),
``heir_copy`` (a dict read under a lock) and ``fetch`` (returns a future it polls at its seam).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
import typing
from collections.abc import Callable, Iterable, Mapping

import msgpack
import numpy as np
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from parallax.dht.keys import ExpertId, expert_id, parse_expert_id
from parallax.node.config.net import ExchangeConfig
from parallax.node.net.network import RateLimiter, rate_limited, read_answer
from parallax.node.net.snapshot_chain import MAX_NORM, Chain, ChainMismatch, HeirCopy, rebuild, released_copy
from parallax.protocol.codec import TensorLimits, encode
from parallax.protocol.envelope import Opener, Sealer
from parallax.protocol.errors import ProtocolError, RemoteProtocolError
from parallax.protocol.identity import Identity
from parallax.protocol.messages import ExpertSnapshot, ExpertSnapshotLinks
from parallax.protocol.schema import MSGPACK_ERRORS

logger = logging.getLogger(__name__)

Shapes = Mapping[str, tuple[int, ...]]

CHUNK_BYTES = 1 << 20  # hivemind caps one stream message at 4 MiB
SNAPSHOT_WINDOW_S = 3600.0
"""How old a snapshot's signature may be: a periodic one is replaced every ``snapshot_every`` steps and a final
one served ``keep_s``; a slow owner's can be minutes old. Older copies cannot harm: steps order them."""


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """A decoded, checked snapshot: ``tensors`` as ``Composer.adopt_expert`` takes them."""

    layer: int
    expert: int
    step: int
    final: bool
    tensors: dict[str, torch.Tensor]
    age_s: float = 0.0
    """How long before it was served the holder took it (a final one: when the holder released the expert)."""
    taken_at: float = 0.0
    """When the holder took it, on this node's monotonic clock (received less ``age_s``): copies from different
    nodes are ordered by this, never by their steps (each node counts its own)."""
    source: str = ""
    """The peer it came from (an heir's copies)."""


# --- the message, both ways (pure) ----------------------------------------------------------------


SURROGATE_PREFIX = "surrogate."
SURROGATE_VERSION = "surrogate.version"


def snapshot_shapes(expert_shapes: Shapes, surrogate_shapes: Shapes | None = None) -> dict[str, tuple[int, ...]]:
    """Every name a snapshot may carry: weights, their two Adam moments, the Adam step, a replicated expert's
    outer anchor and momentum, and the surrogate receivers hold with its version (what a new owner continues
    from)."""
    out = dict(expert_shapes)
    for name, shape in expert_shapes.items():
        out[f"adam.exp_avg.{name}"] = shape
        out[f"adam.exp_avg_sq.{name}"] = shape
        out[f"outer.anchor.{name}"] = shape
        out[f"outer.momentum.{name}"] = shape
    out["adam.step"] = ()
    for name, shape in (surrogate_shapes or {}).items():
        out[f"{SURROGATE_PREFIX}{name}"] = shape
    out[SURROGATE_VERSION] = ()
    return out


def encode_snapshot(layer: int, expert: int, step: int, tensors: Mapping[str, torch.Tensor]) -> ExpertSnapshot:
    blobs = {name: encode(t.detach().cpu().to(torch.float32).contiguous().numpy()) for name, t in tensors.items()}
    return ExpertSnapshot(layer=layer, expert=expert, step=step, tensors=blobs)


def snapshot_opener(run_id: str) -> Opener:
    """The checks a received snapshot's envelope gets (no sequence numbers: see the module docstring)."""
    return Opener(run_id, window_s=SNAPSHOT_WINDOW_S)


def decode_snapshot(data: bytes, eid: ExpertId, expert_shapes: Shapes, *, final: bool, opener: Opener,
                    signer: bytes, peer: str | None = None,
                    surrogate_shapes: Shapes | None = None) -> Snapshot:
    """Open and check a snapshot of expert ``eid`` that ``signer`` (a public key) must have signed.

    Raises:
        ProtocolError: a failed envelope check, another signer, undecodable, another expert,
            an unknown or missing weight, a wrong shape, a non-finite value or a norm above ``MAX_NORM``.
    """
    msg = opener.open(data, ExpertSnapshot, check_replay=False, signer=signer).message
    if (msg.layer, msg.expert) != eid:
        raise RemoteProtocolError(f"asked for expert {eid}, got a snapshot of {(msg.layer, msg.expert)}")
    allowed = snapshot_shapes(expert_shapes, surrogate_shapes)
    unknown = set(msg.tensors) - set(allowed)
    missing = set(expert_shapes) - set(msg.tensors)
    if unknown or missing:
        raise RemoteProtocolError(f"snapshot of {eid}: unknown tensors {sorted(unknown)}, missing {sorted(missing)}")
    biggest = max(int(np.prod(s)) for s in expert_shapes.values())
    arrays = msg.decode_tensors(TensorLimits(max_elements=biggest, max_ndim=2, dtypes=frozenset({"float32"}),
                                             codecs=frozenset({"raw"}), max_norm=MAX_NORM), peer=peer)
    tensors = {}
    for name, array in arrays.items():
        if tuple(array.shape) != tuple(allowed[name]):
            raise RemoteProtocolError(f"snapshot of {eid}: {name} has shape {array.shape}, expected {allowed[name]}")
        if not np.isfinite(array).all():
            raise RemoteProtocolError(f"snapshot of {eid}: {name} is not finite")
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32))
    for name in ("adam.step", SURROGATE_VERSION):
        if name in tensors and not (float(tensors[name]) >= 0 and float(tensors[name]).is_integer()):
            raise RemoteProtocolError(f"snapshot of {eid}: {name} is {float(tensors[name])}, not a whole number >= 0")
    if any(float(t.min()) < 0 for n, t in tensors.items() if n.startswith("adam.exp_avg_sq.")):
        raise RemoteProtocolError(f"snapshot of {eid}: a negative second moment")
    return Snapshot(msg.layer, msg.expert, msg.step, final, tensors)


# --- what this node serves ------------------------------------------------------------------------


class SnapshotStore:
    """Encoded snapshots this node serves, by expert: the latest periodic one of each owned expert and
    the final one of each expert it released (dropped ``keep_s`` after release). Thread-safe."""

    def __init__(self, keep_s: float = 120.0) -> None:
        self.keep_s = keep_s
        self._bodies: dict[ExpertId, tuple[int, bool, bytes, float]] = {}
        self._lock = threading.Lock()

    def put(self, eid: ExpertId, step: int, body: bytes, *, final: bool = False) -> None:
        with self._lock:
            self._bodies[eid] = (step, final, body, time.monotonic())

    def get(self, eid: ExpertId) -> tuple[int, bool, bytes, float] | None:
        """(step, final, body, age in seconds) of the snapshot of ``eid`` held, or None."""
        with self._lock:
            entry = self._bodies.get(eid)
            if entry is None:
                return None
            step, final, body, stamp = entry
            if final and time.monotonic() - stamp > self.keep_s:
                del self._bodies[eid]
                return None
            return step, final, body, time.monotonic() - stamp

    def drop(self, eid: ExpertId) -> None:
        with self._lock:
            self._bodies.pop(eid, None)


HeirAsk = tuple[int, int, bool]
"""An heir's request: (chain, version) of the copy it holds ((0, 0): none), and whether it can draw the expert's
initialisation (``snapshot_chain``)."""
Served = tuple[int, bool, bytes, float, bool]
"""(step, final, sealed body, age in seconds, links: the body is an ``ExpertSnapshotLinks``)."""


def heir_ask(metadata: bytes) -> HeirAsk | None:
    """A request's metadata: empty (None: the exact snapshot), or msgpack [chain, version, init].

    Raises:
        RemoteProtocolError: anything else.
    """
    if not metadata:
        return None
    try:
        obj = msgpack.unpackb(metadata, raw=False, max_array_len=3, max_str_len=0, max_bin_len=0, max_map_len=0,
                              max_ext_len=0)
    except MSGPACK_ERRORS:
        raise RemoteProtocolError("undecodable snapshot request") from None
    if not (isinstance(obj, list) and len(obj) == 3 and all(type(x) is int and 0 <= x < 2**63 for x in obj[:2])
            and type(obj[2]) is bool):
        raise RemoteProtocolError("snapshot request metadata is not [chain, version, init]")
    return obj[0], obj[1], obj[2]


class ExpertServicer(ServicerBase):
    """Streams a held snapshot: request ``uid`` = expert id, ``metadata`` empty for the exact snapshot or an heir's
    ``HeirAsk``; the first message is msgpack [step, final, age in seconds] (and links, to an heir's ask), the rest the
    body in chunks; an empty stream means "not held here" (also to a peer that is not a live composer of the run: an
    expert's weights and optimizer state are for the run's composers only). Do not rename (protocol id)."""

    def __init__(self, held: Callable[[ExpertId, HeirAsk | None], Served | None],
                 may_fetch: Callable[[str], bool] = lambda _peer: True) -> None:
        self._held = held  # (expert, heir's ask or None) -> what is served, or None
        self._may_fetch = may_fetch
        self.bytes_served = 0
        self.chain_bytes_served = 0  # of which chains' links and keyframes (durability; the rest are exact copies)
        self.refused_peers = 0
        self.served_steps: dict[ExpertId, int] = {}  # expert -> newest snapshot step served

    async def rpc_snapshot(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        try:
            eid = parse_expert_id(request.uid)
            ask = heir_ask(request.metadata)
        except (ValueError, ProtocolError) as e:
            logger.debug("bad snapshot request from %s: %s", context.remote_id, e)
            return
        peer = str(context.remote_id)
        if not self._may_fetch(peer):
            self.refused_peers += 1
            logger.info("refused a snapshot of %s to peer %s: not a live composer of this run, or banned here",
                        request.uid[:40], peer)
            return
        held = self._held(eid, ask)
        if held is None:
            return
        step, final, body, age_s, links = held
        header = [step, final, round(age_s, 3)] + ([links] if ask is not None else [])  # a plain ask: 3 fields
        yield runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(header))
        for start in range(0, len(body), CHUNK_BYTES):
            yield runtime_pb2.ExpertInfo(serialized_info=body[start : start + CHUNK_BYTES])
        self.bytes_served += len(body)
        if links:
            self.chain_bytes_served += len(body)
        else:  # a leaving owner waits for its exact copies to be served, not for links
            self.served_steps[eid] = max(step, self.served_steps.get(eid, -1))


# --- the node's side ------------------------------------------------------------------------------


class ExpertExchange:
    """Serves this node's snapshots, keeps heir copies fresh, fetches experts it takes over.

    Args:
        p2p: this node's P2P replica (``await dht.replicate_p2p()`` on ``loop``).
        loop: the node's network loop, running in a background thread.
        run_id: namespaces the P2P handler; snapshots are envelopes of this run.
        expert_shapes: name -> shape of one expert's weights (``model.expert_shapes``).
        identity: this node's key: it signs the snapshots it serves.
        key_of: peer id -> the public key the live membership names for it, or None (its snapshots are then
            refused); called on the loop thread, so thread-safe and cheap.
        heir_targets: () -> {expert: (owner peer id, owner step)} for every expert this node is the heir
            of, and {expert: None} for every expert it owns (its copy is kept until the training thread
            takes it over), or None when it has no fresh view (then nothing changes); called on the loop
            thread, so it must be thread-safe (read an immutable view).
        snapshot_every: the owners' snapshot period in steps (a copy is refetched once the owner is this
            many steps past it).
        config: how often heir copies are refreshed, and the bound on one whole snapshot fetch (``net.exchange``).
        may_fetch: peer id -> whether this node serves it snapshots (a live composer of the run it does not ban);
            called on the loop thread, so thread-safe and cheap.
        keep_s: how long released experts' final snapshots stay served.
        initial_weights: expert -> its seeded initial weights (a pure function: it runs on a worker thread); heirs
            rebuild chains that start there. None: heirs ask for keyframes instead.
        chains: keep a chain (``snapshot_chain``) of each owned expert for its heir; False where heirs pull nothing
            (replicated experts: the heir is a co-owner).
    """

    def __init__(self, p2p: P2P, loop: asyncio.AbstractEventLoop, run_id: str, expert_shapes: Shapes, *,
                 identity: Identity, key_of: Callable[[str], bytes | None],
                 surrogate_shapes: Shapes | None = None,
                 heir_targets: Callable[[], Mapping[ExpertId, tuple[str, int] | None] | None],
                 snapshot_every: int = 10,
                 may_fetch: Callable[[str], bool] = lambda _peer: True, config: ExchangeConfig | None = None,
                 keep_s: float = 120.0,
                 initial_weights: Callable[[ExpertId], Mapping[str, torch.Tensor]] | None = None,
                 chains: bool = True) -> None:
        self.p2p, self.loop, self.key_of = p2p, loop, key_of
        self.namespace = f"parallax.{run_id}.experts"
        self.sealer, self.opener = Sealer(identity, run_id), snapshot_opener(run_id)
        self.expert_shapes = {n: tuple(s) for n, s in expert_shapes.items()}
        self.surrogate_shapes = {n: tuple(s) for n, s in (surrogate_shapes or {}).items()}
        self.heir_targets = heir_targets
        self.snapshot_every = snapshot_every
        self.config = config if config is not None else ExchangeConfig()
        self.store = SnapshotStore(keep_s)
        self.servicer = ExpertServicer(self.served, may_fetch)
        self.initial_weights, self.chains = initial_weights, chains
        self.bytes_fetched = 0
        self.chain_bytes_fetched = 0  # of which chains' links and keyframes (durability)
        self.refused = 0
        self._heirs: dict[ExpertId, Snapshot] = {}
        self._positions: dict[ExpertId, HeirCopy] = {}  # where each heir copy stands on its owner's chain
        self._keyframes_only: set[ExpertId] = set()  # a chain from the initialisation did not rebuild here
        self._released: dict[ExpertId, tuple[bytes, HeirCopy]] = {}  # ``_released_position``, by final snapshot
        self._chains: dict[ExpertId, Chain] = {}  # owned experts' chains (training thread writes, loop reads)
        # Sealed chain answers of each expert's latest version, by the base they start from (-1: a keyframe).
        self._answers: dict[ExpertId, tuple[tuple[int, int], dict[int, bytes]]] = {}
        self._epochs: dict[ExpertId, int] = {}  # bumped when the training thread takes an heir copy
        self._pulling = True
        # Links are encoded off the training thread, one expert after another in the order they were put.
        self._chain_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="parallax-chains")
        self._chained: set[ExpertId] = set()  # experts whose chain exists or is on its way (training thread)
        self._former: dict[ExpertId, float] = {}  # heir copies of experts no longer inherited: since when
        self._sealed: dict[ExpertId, tuple[float, bytes]] = {}  # heir copy (by ``taken_at``) sealed by this node
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None

    def start(self, timeout_s: float = 10.0) -> ExpertExchange:
        asyncio.run_coroutine_threadsafe(self._setup(), self.loop).result(timeout_s)
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        self._chain_worker.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):  # the loop or the daemon may already be gone
            asyncio.run_coroutine_threadsafe(self._teardown(), self.loop).result(timeout_s)

    async def _setup(self) -> None:
        # An heir fetches each expert it inherits once per snapshot period: far under 20 a second per peer.
        limiter = RateLimiter(per_s=20.0, burst=100.0)
        await self.servicer.add_p2p_handlers(self.p2p, rate_limited(self.servicer, limiter), namespace=self.namespace)
        self._task = asyncio.create_task(self._heir_loop())

    async def _teardown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.servicer.remove_p2p_handlers(self.p2p, namespace=self.namespace)

    # --- the training thread's side ---

    def put(self, eid: ExpertId, step: int, tensors: Mapping[str, torch.Tensor], *, final: bool = False) -> int:
        """Serve this snapshot of an owned (or, ``final``, just released) expert; returns its size in bytes. A
        periodic one also takes the expert's chain a link further (its heir pulls that link, once the chain worker
        has made it), a final one ends the chain. ``tensors`` must not change afterwards (``Experts.snapshot``
        makes fresh copies)."""
        body = self.sealer.seal(encode_snapshot(eid[0], eid[1], step, tensors))
        if self.chains:
            (self._chained.discard if final else self._chained.add)(eid)
            self._chain_worker.submit(self._link, eid, step, tensors, final, time.monotonic())
        self.store.put(eid, step, body, final=final)
        return len(body)

    def _link(self, eid: ExpertId, step: int, tensors: Mapping[str, torch.Tensor], final: bool, taken: float) -> None:
        """On the chain worker: take the chain of ``eid`` a link further from ``tensors``, or end it."""
        with self._lock:
            held = self._chains.get(eid)
        try:
            chain = (None if final else Chain.start(step, tensors, tuple(self.expert_shapes), taken=taken)
                     if held is None else held.advance(step, tensors, taken=taken))
        except Exception:  # our own tensors: a bug; the heirs' copies restart from the next snapshot's keyframe
            logger.exception("expert %s: its heirs' chain did not advance; it starts again at the next snapshot", eid)
            chain = None
        with self._lock:
            if chain is None:
                self._chains.pop(eid, None)
                self._answers.pop(eid, None)
            else:
                self._chains[eid] = chain

    def stop_pulling(self) -> None:
        """Pull no more heir copies (this node is leaving: it takes nothing over); those held are still served. Its
        heirs get links still, and no keyframe: its exact final snapshots follow within the leave."""
        self._pulling = False

    def unchained(self, owned: Iterable[ExpertId]) -> list[ExpertId]:
        """Those of ``owned`` without a chain yet: their first snapshot starts one (from the initialisation when
        it comes before their first step, so that heirs need no keyframe)."""
        return sorted(set(owned) - self._chained) if self.chains else []

    def heir_copy(self, eid: ExpertId) -> Snapshot | None:
        """The latest snapshot pulled as the heir of ``eid`` (None if none)."""
        with self._lock:
            return self._heirs.get(eid)

    def heir_copies(self) -> dict[ExpertId, int]:
        """expert -> step of the heir copy held (metrics)."""
        with self._lock:
            return {eid: snap.step for eid, snap in self._heirs.items()}

    def take_heir_copy(self, eid: ExpertId) -> Snapshot | None:
        """Remove and return the heir copy of ``eid`` (the training thread takes the expert over)."""
        with self._lock:
            self._former.pop(eid, None)
            self._sealed.pop(eid, None)
            self._positions.pop(eid, None)
            self._epochs[eid] = self._epochs.get(eid, 0) + 1  # a pull in flight stores nothing now
            return self._heirs.pop(eid, None)

    def inherits_copy(self, eid: ExpertId) -> bool:
        """Whether this node holds a copy of ``eid`` pulled as its heir and is its heir still (the copy it pulled
        while the owner trained): adopting ``eid`` from it needs nobody else."""
        with self._lock:
            return eid in self._heirs and eid not in self._former

    def take_local_copy(self, eid: ExpertId) -> tuple[Snapshot, str] | None:
        """The newest copy of ``eid`` this node holds itself (by when it was taken), with where it came from
        ("heir copy" or "own release"); the heir copy is taken. An expert that comes back to the node that
        released it resumes from that node's own final snapshot rather than from init (for example when a joiner
        leaves before it took its experts over)."""
        found = []
        heir = self.take_heir_copy(eid)
        if heir is not None:
            found.append((heir, "heir copy"))
        entry = self.store.get(eid)
        own = None if entry is None or not entry[1] else self._own_release(eid, entry)
        if own is not None:
            found.append((own, "own release"))
        return max(found, key=lambda f: f[0].taken_at, default=None)

    def _own_release(self, eid: ExpertId, entry: tuple[int, bool, bytes, float]) -> Snapshot | None:
        """This node's final snapshot of ``eid`` (``entry``, its store's), decoded; None if it does not decode."""
        try:
            own = decode_snapshot(entry[2], eid, self.expert_shapes, final=True, opener=self.opener,
                                  signer=self.sealer.identity.public_key, surrogate_shapes=self.surrogate_shapes)
        except ProtocolError as e:  # our own encoding: only a bug gets here
            logger.warning("own final snapshot of %s does not decode: %s", eid, e)
            return None
        return dataclasses.replace(own, age_s=entry[3], taken_at=time.monotonic() - entry[3])

    def _released_position(self, eid: ExpertId) -> HeirCopy | None:
        """Where this node stands on the chain of ``eid``'s new owner when it released the expert and holds no place
        on a chain of it: version 0 of the chain its final snapshot starts (``snapshot_chain.released_copy``), made
        once per final snapshot."""
        entry = self.store.get(eid)
        if entry is None or not entry[1]:
            return None
        with self._lock:
            cached = self._released.get(eid)
        if cached is not None and cached[0] is entry[2]:
            return cached[1]
        own = self._own_release(eid, entry)
        position = None if own is None else released_copy(own.tensors, tuple(self.expert_shapes))
        if position is not None:
            with self._lock:
                self._released[eid] = entry[2], position
        return position

    def forget_heir_copies(self, keep: set[ExpertId]) -> None:
        """``keep``: the experts this node inherits now; a copy of another is dropped ``keep_s`` after it was
        inherited last (served meanwhile: module docstring)."""
        now = time.monotonic()
        with self._lock:
            for eid in keep:
                self._former.pop(eid, None)
            for eid in set(self._heirs) - keep:
                if now - self._former.setdefault(eid, now) > self.store.keep_s:
                    del self._heirs[eid], self._former[eid]
                    self._sealed.pop(eid, None)
                    self._positions.pop(eid, None)
            released = dict(self._released)
        gone = [eid for eid, (body, _) in released.items()
                if eid not in keep or (entry := self.store.get(eid)) is None or entry[2] is not body]
        with self._lock:
            for eid in gone:
                self._released.pop(eid, None)

    def served(self, eid: ExpertId, ask: HeirAsk | None = None) -> Served | None:
        """What this node serves of ``eid``: to its heir (``ask``) the links of its chain from the copy the heir
        holds; else its periodic snapshot when it owns ``eid``, else the newer of its final snapshot and its heir
        copy, or None. Called on the loop thread; each answer is sealed once."""
        own = self.store.get(eid)
        if own is not None and not own[1]:
            if ask is None or not self.chains:
                return (*own, False)
            with self._lock:
                chain = self._chains.get(eid)
            if chain is None:  # its first link is still being made: the heir asks again at its next poll
                return None
            base = chain.base_for(None if ask[0] == 0 else (ask[0], ask[1]), init=ask[2])
            if base is None and not self._pulling:
                return None  # leaving: its exact final snapshot follows within the leave, a keyframe now is waste
            return chain.step, False, self._chain_answer(eid, chain, base), time.monotonic() - chain.taken, True
        with self._lock:
            heir = self._heirs.get(eid)
            sealed = self._sealed.get(eid)
        if heir is None:
            return None if own is None else (*own, False)
        age_s = time.monotonic() - heir.taken_at
        if own is not None and own[3] <= age_s:
            return (*own, False)
        if sealed is None or sealed[0] != heir.taken_at:
            sealed = heir.taken_at, self.sealer.seal(encode_snapshot(eid[0], eid[1], heir.step, heir.tensors))
            with self._lock:
                if self._heirs.get(eid) is heir:
                    self._sealed[eid] = sealed
        return heir.step, False, sealed[1], age_s, False

    def _chain_answer(self, eid: ExpertId, chain: Chain, base: int | None) -> bytes:
        """The sealed answer from version ``base`` (None: a keyframe, ``Chain.base_for``); each kind (a keyframe,
        the links from each base) is encoded and sealed once per version, whoever asks how often."""
        key = -1 if base is None else base
        with self._lock:
            version, bodies = self._answers.get(eid, (None, {}))
            if version != (chain.chain, chain.version):
                bodies = {}
                self._answers[eid] = (chain.chain, chain.version), bodies
            body = bodies.get(key)
        if body is None:
            body = self.sealer.seal(chain.answer(base, eid[0], eid[1]))
            with self._lock:
                bodies[key] = body
        return body

    def fetch(self, peer: str, eid: ExpertId) -> concurrent.futures.Future[Snapshot | str]:
        """Ask ``peer`` for its snapshot of ``eid``; the future gives it, or why none came (for the logs)."""
        return asyncio.run_coroutine_threadsafe(self._fetch_checked(peer, eid), self.loop)

    # --- loop thread ---

    async def _heir_loop(self) -> None:
        while True:
            try:
                found_targets = self.heir_targets() if self._pulling else None
                if found_targets is None:  # no fresh view of the swarm, or leaving: keep every copy, fetch nothing
                    await asyncio.sleep(self.config.poll_s)
                    continue
                wanted = dict(found_targets)
                self.forget_heir_copies(set(wanted))
                targets = {eid: t for eid, t in wanted.items() if t is not None}
                # Fetch when the owner has passed the step of our copy by a snapshot period (a leaving owner's
                # step comes a period ahead: its final copy, once pulled from it, is the last).
                stale = [(eid, owner) for eid, (owner, owner_step) in sorted(targets.items())
                         if (held := self.heir_copy(eid)) is None or owner_step - held.step >= self.snapshot_every
                         + (self.snapshot_every if held.final and held.source == owner else 0)]
                # Concurrently: one slow or vanished owner must not hold back the other copies.
                with self._lock:
                    epochs = {eid: self._epochs.get(eid, 0) for eid, _ in stale}
                found = await asyncio.gather(*(self._pull(owner, eid) for eid, owner in stale),
                                             return_exceptions=True)
                with self._lock:
                    for (eid, owner), got in zip(stale, found, strict=True):
                        if isinstance(got, BaseException):
                            logger.warning("heir copy of %s from %s failed: %r", eid, owner, got)
                        elif got is not None and eid in targets and self._epochs.get(eid, 0) == epochs[eid]:
                            snap, position = got
                            self._heirs[eid] = snap
                            if position is None:
                                self._positions.pop(eid, None)
                            else:
                                self._positions[eid] = position
                                self._released.pop(eid, None)  # a place on the chain: the released copy is past
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad view or a dying daemon must not end the heir loop
                logger.exception("heir snapshot poll failed; retrying")
            await asyncio.sleep(self.config.poll_s)

    async def _pull(self, peer: str, eid: ExpertId) -> tuple[Snapshot, HeirCopy | None] | None:
        """As the heir of ``eid``: the owner's chain from the copy held here (or its final snapshot, when it left),
        with the copy's new place on the chain (None: an exact copy, on no chain)."""
        with self._lock:
            held = self._positions.get(eid)
        if held is None and self.store.get(eid) is not None:
            held = await asyncio.to_thread(self._released_position, eid)
        init = self.initial_weights is not None and eid not in self._keyframes_only
        ask = msgpack.packb([0, 0, init] if held is None else [held.chain, held.version, init])
        got = await self._fetch_or_why(peer, eid, ask)
        if isinstance(got, str):
            return None
        step, final, age_s, body, links = got
        if not links:
            snap = self._checked(peer, eid, step, final, age_s, body)
            return None if isinstance(snap, str) else (dataclasses.replace(snap, source=peer), None)
        signer = self.key_of(peer)
        if signer is None:
            return None
        initial = None if not init or self.initial_weights is None else functools.partial(self.initial_weights, eid)
        try:
            msg = self.opener.open(body, ExpertSnapshotLinks, check_replay=False, signer=signer).message
            if (msg.layer, msg.expert) != eid or msg.step != step:
                raise RemoteProtocolError(f"asked for expert {eid} at step {step}, got links of "
                                          f"{(msg.layer, msg.expert)} at step {msg.step}")
            try:
                position, tensors = await asyncio.to_thread(rebuild, msg, self.expert_shapes, held, initial, peer=peer)
            except ChainMismatch as e:
                logger.warning("expert %s: dropped this heir's place on the chain of %s (%s); asking for a keyframe",
                               eid, peer, e)
                with self._lock:
                    self._positions.pop(eid, None)
                    if e.from_init:  # the initialisation drawn here is not the one the owner started from
                        self._keyframes_only.add(eid)
                return None
        except ProtocolError as e:
            self.refused += 1
            logger.warning("refused the snapshot links of expert %s from %s: %s", eid, peer, e)
            return None
        return Snapshot(eid[0], eid[1], step, False, tensors, age_s=age_s, taken_at=time.monotonic() - age_s,
                        source=peer), position

    async def _fetch_checked(self, peer: str, eid: ExpertId) -> Snapshot | str:
        got = await self._fetch_or_why(peer, eid)
        return got if isinstance(got, str) else self._checked(peer, eid, *got[:4])

    async def _fetch_or_why(self, peer: str, eid: ExpertId,
                            ask: bytes = b"") -> tuple[int, bool, float, bytes, bool] | str:
        """``peer``'s answer (header fields and body), or why none came."""
        try:
            got = await asyncio.wait_for(self._fetch(peer, eid, ask), self.config.timeout_s)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return f"no whole answer in time (the bound is {self.config.timeout_s:g} s)"
        except Exception as e:  # peer gone, stream broken
            logger.debug("snapshot of %s from %s failed: %r", eid, peer, e)
            return f"the request failed: {e!r}"[:200]
        return "it holds none, or serves none to this node" if got is None else got

    def _checked(self, peer: str, eid: ExpertId, step: int, final: bool, age_s: float, body: bytes) -> Snapshot | str:
        """An exact snapshot's body opened and checked, or why it was refused (logged)."""
        signer = self.key_of(peer)
        if signer is None:  # it left our view meanwhile (or never was in it): nothing to check it against
            logger.debug("snapshot of %s from %s: the membership names no key for that peer", eid, peer)
            return "this node's view of the swarm names no key for that peer"
        try:
            snap = decode_snapshot(body, eid, self.expert_shapes, final=final, opener=self.opener,
                                   signer=signer, peer=peer, surrogate_shapes=self.surrogate_shapes)
            if snap.step != step:
                raise RemoteProtocolError(f"snapshot of {eid} announced as step {step}, signed as {snap.step}")
        except ProtocolError as e:
            self.refused += 1
            logger.warning("refused the snapshot of expert %s from %s: %s", eid, peer, e)
            return f"refused: {e}"
        return dataclasses.replace(snap, age_s=age_s, taken_at=time.monotonic() - age_s)

    async def _fetch(self, peer: str, eid: ExpertId, ask: bytes = b"") -> tuple[int, bool, float, bytes, bool] | None:
        stub = ExpertServicer.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        stream = await stub.rpc_snapshot(runtime_pb2.ExpertRequest(uid=expert_id(*eid), metadata=ask))
        parts = await read_answer(stream, cap=_HEADER_MAX_BYTES + ExpertSnapshot.MAX_BYTES, peer=peer,
                                  what=f"snapshot of {expert_id(*eid)}")
        if not parts:
            return None
        step, final, age_s, links = _header(parts[0])
        body = b"".join(parts[1:])
        self.bytes_fetched += len(body)
        if links:
            self.chain_bytes_fetched += len(body)
        return step, final, age_s, body, links


_HEADER_MAX_BYTES = 32
"""A snapshot answer's first message, msgpack [step, final, age] and, to an heir's ask, links: at most 21 bytes."""


def _header(data: bytes) -> tuple[int, bool, float, bool]:
    try:
        obj = msgpack.unpackb(data, raw=False, max_array_len=4, max_str_len=0, max_bin_len=0, max_map_len=0,
                              max_ext_len=0)
    except MSGPACK_ERRORS:
        raise RemoteProtocolError("undecodable snapshot header") from None
    if not (isinstance(obj, list) and len(obj) in (3, 4) and type(obj[0]) is int and type(obj[1]) is bool
            and obj[0] >= 0 and type(obj[2]) in (int, float) and math.isfinite(obj[2]) and obj[2] >= 0
            and (len(obj) == 3 or type(obj[3]) is bool)):
        raise RemoteProtocolError("snapshot header is not [step >= 0, final, age >= 0] or [..., links]")
    return obj[0], obj[1], float(obj[2]), len(obj) == 4 and obj[3]
