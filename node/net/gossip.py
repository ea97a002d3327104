"""Surrogate gossip: owners announce surrogate versions in the DHT, anyone holding a payload serves it.

DESIGN.md section 4 ("Surrogate refresh") and 5 ("Trust"). The owner of an expert publishes each
refresh as a rank-r delta (``node.lowrank``): the payload (a ``SurrogatePayload`` body) is kept here
and served over a hivemind P2P stream; a small signed announcement (``SurrogateDelta``: version,
digest = sha256 of the payload bytes, size) goes into the DHT under the layer's key and the owner's
subkey (``dht.surrogates``). Receivers poll the announcements, pull missing versions from the owner or
from any peer that already fetched them (every receiver re-serves what it verified and says so in its
own record), check the digest against the *owner's* announcement, decode with tensor limits, and queue
the updates in strict version order per expert. A receiver more than ``max_behind`` versions behind,
or facing a version that no provider delivers, pulls the owner's latest full copy instead.

Trust: an announcement counts only when its DHT subkey (hence its signature, checked by
``Ed25519RecordValidator``) belongs to the expert's current owner (``owner_of``); providers are
untrusted (a payload whose length or sha256 differs is refused and the next provider tried); a payload
that matches the owner's digest but fails decoding (NaN, shapes, norm, rank) is refused and its digest
blacklisted. Every refusal is counted in ``stats.refused`` and logged; none is raised.

Concurrency model (one asyncio loop thread per process):
    Everything networked here runs on one asyncio event loop in a background thread (``parallax-net``,
    started by ``start()`` unless the node passes its own loop): the P2P servicer (``rpc_fetch``), the
    poll task (read records, pull, verify, decode, enqueue) and the announce task (store this node's
    record every ``announce_period_s`` and at once after a change). Blocking ``SwarmDHT`` calls (a pipe
    to hivemind's DHT process, each bounded by its ``timeout_s``) run in the loop's worker threads via
    ``asyncio.to_thread`` so streams keep being served meanwhile. The training thread meets this module
    at one seam and never waits on the network: ``publish()`` encodes and stores a payload and wakes the
    announcer; ``drain()`` takes the ready updates from a thread-safe queue; ``versions()`` and
    ``stats`` are snapshots. The payload store is shared under a lock.

The payload layout, its checks and the store of served payloads are in ``node.surrogate_payload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import random
import statistics
import threading
import time
import typing
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.keys import check_run_id, expert_id, parse_expert_id
from parallax.dht.surrogates import Holding, SurrogateRecord, read_records, store_record
from parallax.node.config.net import GossipConfig
from parallax.node.model.lowrank import Factors, apply_delta, change_of
from parallax.node.net.network import RateLimiter, rate_limited
from parallax.node.net.scores import Evidence
from parallax.node.net.surrogate_payload import (
    ExpertId,
    PayloadStore,
    Shapes,
    decode_delta,
    decode_full,
    encode_delta,
    encode_full,
    payload_digest,
    payload_limits,
)
from parallax.protocol.errors import LocalProtocolError, RemoteProtocolError
from parallax.protocol.identity import Identity
from parallax.protocol.messages import SurrogateDelta, SurrogatePayload
from parallax.protocol.schema import MSGPACK_ERRORS

logger = logging.getLogger(__name__)

MAX_GROWTH = 4.0
"""A surrogate delta making a held tensor more than this many times longer is refused (``SurrogateUpdate.growth``)."""
GROWTH_FLOOR = 0.05
"""Norms are compared from at least this x sqrt(size): a near-zero tensor may grow to ordinary size."""
LAYER_BOUND = 4.0
"""A surrogate update making a tensor longer than this many times the same tensor's lower median across the
layer's other held surrogates is refused (``SurrogateUpdate.layer_ratio``)."""


def _floor(t: torch.Tensor) -> float:
    return GROWTH_FLOOR * math.sqrt(t.numel())
_MIN_EXPIRY_STEP_S = 1e-3  # hivemind keeps a subkey's record only if its expiration is strictly later
_REFUSAL_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a surrogate update is refused (``SurrogateUpdate.verdict``)."""

    why: str
    """What it would do, for the log."""
    growth: float
    layer_ratio: float
    evidence: Evidence | None
    """What it holds against the owner (None: nothing; the update is refused all the same)."""


@dataclass(frozen=True, slots=True)
class SurrogateUpdate:
    """One ready-to-apply update: a delta (``factors``) or a full copy (``state``) at ``version``, published at the
    owner's ``step`` (``SurrogateDelta.step``)."""

    layer: int
    expert: int
    version: int
    factors: Mapping[str, Factors] | None = None
    state: Mapping[str, torch.Tensor] | None = None
    step: int = 0

    @property
    def is_full(self) -> bool:
        return self.state is not None

    def growth(self, target: Mapping[str, torch.Tensor]) -> float:
        """How many times longer than now (or than ``GROWTH_FLOOR`` x sqrt(size), if larger) this delta would
        make the longest-growing tensor of the held surrogate ``target``; 1.0 for a full copy (checked when
        decoded). Honest refreshes change a surrogate by a fraction of itself; a poisoned delta that stays
        under the decoder's absolute norm cap still multiplies it."""
        if self.factors is None:
            return 1.0
        worst = 0.0
        for name, new in self.updated(target).items():
            old = target[name].detach().float().cpu()
            worst = max(worst, float(new.norm()) / max(float(old.norm()), _floor(old)))
        return worst

    def layer_ratio(self, target: Mapping[str, torch.Tensor], typical: Mapping[str, float]) -> float:
        """How many times ``typical[name]`` (``layer_norms``: the lower median of that tensor's norms across the
        layer's held surrogates; at least ``GROWTH_FLOOR`` x sqrt(size)) the updated surrogate's longest tensor
        would be; 0.0 without any. Bounds what deltas that each stay under ``MAX_GROWTH`` reach by compounding:
        the layer's other surrogates are mostly other owners'."""
        if not typical:
            return 0.0
        return max(float(new.norm()) / max(typical[name], _floor(new)) for name, new in self.updated(target).items())

    @staticmethod
    def layer_norms(held: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """Tensor name -> the lower median of its norm across ``held`` (a layer's surrogates this node holds); {}
        for none. One device sync for all of them."""
        if not held:
            return {}
        names = list(held[0])
        norms = torch.stack([torch.linalg.vector_norm(h[n].detach().float()) for h in held for n in names]).tolist()
        return {n: statistics.median_low(norms[i::len(names)]) for i, n in enumerate(names)}

    def updated(self, target: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The held surrogate ``target`` after this update (float32 copies on the CPU; ``target`` unchanged)."""
        if self.state is not None:
            return {name: t.detach().float().cpu() for name, t in self.state.items()}
        assert self.factors is not None
        return {name: target[name].detach().float().cpu() + change_of(f).float().reshape(target[name].shape)
                for name, f in self.factors.items()}

    def verdict(self, target: Mapping[str, torch.Tensor], typical: Mapping[str, float]) -> Refusal | None:
        """Whether to refuse this update of the held surrogate ``target`` (None: apply it), and what the refusal
        holds against the owner.

        A delta past ``MAX_GROWTH`` multiplies the surrogate in one refresh, which an honest refit does not: it
        is evidence (``Evidence.SURROGATE_GROWTH``). An update past ``LAYER_BOUND`` x ``typical`` is refused
        too, but is no evidence: honest surrogates cross that bound (a receiver cut off for 30 s holds stale
        copies of the layer's others and measured honest updates at 4-6x them), and a ban for it leaves an honest
        owner out of this node's view while it owns its experts in the others': two owners of an expert."""
        growth = self.growth(target)
        if growth > MAX_GROWTH:
            return Refusal(f"make the surrogate {growth:.3g} times longer", growth, 0.0, Evidence.SURROGATE_GROWTH)
        ratio = self.layer_ratio(target, typical)
        if ratio > LAYER_BOUND:
            return Refusal(f"make the surrogate {ratio:.3g} times longer than the layer's other surrogates", growth,
                           ratio, None)
        return None

    def apply(self, target: Mapping[str, torch.Tensor]) -> None:
        """Apply to the held surrogate ``target`` (name -> tensor, updated in place under no_grad)."""
        if self.factors is not None:
            apply_delta(target, self.factors)
            return
        assert self.state is not None
        with torch.no_grad():
            for name, t in self.state.items():
                target[name].copy_(t)


@dataclass
class GossipStats:
    """Counters, written by the loop thread only."""

    deltas: int = 0
    fulls: int = 0
    bytes_fetched: int = 0
    bytes_served: int = 0
    fetch_s: float = 0.0
    refused: Counter[str] = field(default_factory=Counter)
    sources: Counter[str] = field(default_factory=Counter)
    """peer id -> payloads fetched from it"""


# --- what the swarm offers, and what to pull (pure) -------------------------------------------------------


@dataclass
class Offer:
    """What the latest records offer for one expert: its owner's announcements and who serves what."""

    owner_peer: str | None = None
    deltas: dict[int, SurrogateDelta] = field(default_factory=dict)
    full: SurrogateDelta | None = None
    holds: list[tuple[str, Holding]] = field(default_factory=list)

    def providers(self, version: int, *, full: bool) -> list[str]:
        """Peers that say they serve this payload (sorted; ``provider_order`` decides the order of tries)."""
        return sorted({p for p, h in self.holds if (h.has_full(version) if full else h.has_delta(version))})


def collect_offers(
    records: Mapping[int, Mapping[bytes, SurrogateRecord]],
    owner_of: Callable[[ExpertId], bytes | None],
    me: bytes,
    my_peer_id: str,
) -> dict[ExpertId, Offer]:
    """Per expert owned by someone else: the owner's announcements and every provider's holdings.

    Announcements signed by anyone but ``owner_of(expert)`` are ignored (counted by nobody: a node
    may legitimately still list versions of an expert it no longer owns).
    """
    offers: dict[ExpertId, Offer] = {}
    for layer, by_signer in records.items():
        for signer, rec in by_signer.items():
            for ann, is_full in [(a, False) for a in rec.deltas] + [(a, True) for a in rec.fulls]:
                eid = (layer, ann.expert)
                owner = owner_of(eid)
                if owner is None or owner != signer or owner == me:
                    continue
                offer = offers.setdefault(eid, Offer())
                offer.owner_peer = rec.peer_id
                if not is_full:
                    offer.deltas[ann.version] = ann
                elif offer.full is None or ann.version > offer.full.version:
                    offer.full = ann
        for rec in by_signer.values():
            if rec.peer_id == my_peer_id:
                continue
            for h in rec.holds:
                held = offers.get((layer, h.expert))
                if held is not None:
                    held.holds.append((rec.peer_id, h))
    return offers


@dataclass(frozen=True, slots=True)
class Step:
    """What to pull next for one expert: one ``full`` copy, or ``deltas`` in order."""

    full: SurrogateDelta | None = None
    deltas: tuple[SurrogateDelta, ...] = ()


def plan(held: int, offer: Offer, max_behind: int, bad: frozenset[bytes] | set[bytes] = frozenset()) -> Step:
    """Decide the next pulls for an expert at version ``held``.

    Deltas held+1, held+2, ... while they are announced (and not blacklisted); the full copy instead
    when the owner's latest announced version is more than ``max_behind`` ahead (and the full copy is
    within ``max_behind`` of it), or when the full copy gets further than the unbroken chain of deltas.
    """
    latest = max([*offer.deltas, offer.full.version if offer.full else 0])
    if latest <= held:
        return Step()
    chain = []
    v = held + 1
    while v in offer.deltas and offer.deltas[v].digest not in bad:
        chain.append(offer.deltas[v])
        v += 1
    full = offer.full if offer.full and offer.full.digest not in bad and offer.full.version > held else None
    reach = held + len(chain)
    # The full copy when the deltas cannot get as far, or when we are far behind and it lands within
    # max_behind of the latest (a stale full copy is not worth more than the deltas already announced).
    if full is not None and (full.version > reach or (latest - held > max_behind
                                                      and full.version >= latest - max_behind)):
        return Step(full=full)
    return Step(deltas=tuple(chain))


# --- serving ---------------------------------------------------------------------------------------------


def _request_meta(metadata: bytes) -> tuple[int, bool]:
    try:
        obj = msgpack.unpackb(metadata, raw=False, max_array_len=2, max_str_len=0, max_bin_len=0,
                              max_map_len=0, max_ext_len=0)
    except MSGPACK_ERRORS:
        raise ValueError("undecodable request") from None
    if not (isinstance(obj, list) and len(obj) == 2 and type(obj[0]) is int and type(obj[1]) is bool
            and obj[0] >= 1):
        raise ValueError("request metadata is not [version >= 1, full]")
    return obj[0], obj[1]


class SurrogateServicer(ServicerBase):
    """Streams a stored payload in chunks: request ``uid`` = expert id, ``metadata`` = [version, full].

    The class name is part of the P2P protocol id: do not rename it.
    """

    def __init__(self, store: PayloadStore, chunk_bytes: int, stats: GossipStats) -> None:
        self._store = store
        self._chunk = chunk_bytes
        self._stats = stats

    async def rpc_fetch(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertInfo]:  # noqa: UP006 - hivemind reads typing's AsyncIterator
        try:
            eid = parse_expert_id(request.uid)
            version, full = _request_meta(request.metadata)
        except ValueError as e:
            logger.debug("bad surrogate request from %s: %s", context.remote_id, e)
            return
        body = self._store.get(eid, version, full=full)
        if body is None:
            return  # an empty stream: "not held here"
        for start in range(0, len(body), self._chunk):
            yield runtime_pb2.ExpertInfo(serialized_info=body[start : start + self._chunk])
        self._stats.bytes_served += len(body)


# --- the node's gossip service ---------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(detail)


class SurrogateGossip:
    """Publishes, serves, fetches and verifies surrogate updates for one node (see the module docstring).

    Args:
        dht: this node's running DHT (shut down by its owner, after ``close()``).
        identity: this node's key; its records are signed with it (the DHT's validator must hold it).
        config: timings and limits (the section ``net.gossip``).
        run_id: the training run (namespaces DHT keys and the P2P handler).
        n_layers: MoE layers whose surrogate keys are polled and announced.
        shapes: name -> shape of one surrogate's tensors (``model.surrogate_parameters``).
        owner_of: (layer, expert) -> the owner's Ed25519 public key, or None when unknown; called on the
            loop thread, so it must be thread-safe (e.g. read an immutable membership view).
        start_versions: the version of each surrogate held at start (default 0: the seeded init).
        provider_order: ``(providers, owner peer id or None) -> providers in the order to try``
            (default: the owner first, the rest shuffled).
        loop: an event loop already running in a background thread to share (default: start our own).
    """

    def __init__(
        self,
        dht: SwarmDHT,
        identity: Identity,
        config: GossipConfig,
        *,
        run_id: str,
        n_layers: int,
        shapes: Shapes,
        owner_of: Callable[[ExpertId], bytes | None],
        start_versions: Mapping[ExpertId, int] | None = None,
        provider_order: Callable[[list[str], str | None], list[str]] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.dht = dht
        self.identity = identity
        self.config = config
        check_run_id(run_id)
        if n_layers < 1:
            raise ValueError("n_layers must be >= 1")
        self.run_id, self.n_layers = run_id, n_layers
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.owner_of = owner_of
        self.stats = GossipStats()
        self.store = PayloadStore(config.window)
        self.namespace = f"parallax.{run_id}.surrogates"
        self._limits = payload_limits(self.shapes, config.max_norm)
        self._held: dict[ExpertId, int] = dict(start_versions or {})
        self._bad: set[bytes] = set()
        self._ready: queue.SimpleQueue[SurrogateUpdate] = queue.SimpleQueue()
        self._order = provider_order or owner_first_then_random
        self._loop = loop
        self._own_loop = loop is None
        self._thread: threading.Thread | None = None
        self._p2p: P2P | None = None
        self._servicer = SurrogateServicer(self.store, config.chunk_bytes, self.stats)
        self._tasks: list[asyncio.Task[None]] = []
        self._wake: asyncio.Event | None = None
        self._dht_lock: asyncio.Lock | None = None
        self._expiry: dict[int, float] = {}
        self._last_log: dict[str, float] = {}
        self._closed = False

    # --- lifecycle (any thread) ---

    def start(self, *, timeout_s: float = 30.0) -> SurrogateGossip:
        """Start the loop thread (if ours), register the P2P handler, start polling and announcing."""
        if self._own_loop:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="parallax-net", daemon=True)
            self._thread.start()
        self._call(self._setup(), timeout_s)
        return self

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Stop polling and announcing, unregister the handler, stop our loop. Safe to call twice.

        With its own loop, this also shuts down the P2P replica that ``replicate_p2p()`` made (it lives on
        that loop); hivemind caches it per DHT object, so run at most one gossip per DHT and process, or
        pass a shared ``loop``.
        """
        if self._closed or self._loop is None:
            self._closed = True
            return
        self._closed = True
        try:
            self._call(self._teardown(), timeout_s)
        except Exception as e:  # the DHT may already be gone: nothing left to unregister
            logger.debug("gossip teardown: %s", e)
        if self._own_loop:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout_s)
            self._loop.close()

    def __enter__(self) -> SurrogateGossip:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the training thread's seam ---

    def publish(
        self,
        layer: int,
        expert: int,
        version: int,
        factors: Mapping[str, Factors],
        full: Mapping[str, torch.Tensor] | None = None,
        *,
        step: int = 0,
    ) -> SurrogateDelta:
        """Owner side: serve this delta (and the full copy after it, if given) and announce it.

        Args:
            layer, expert: the owned expert.
            version: must be exactly one above the last published (the first is 1).
            factors: from ``ErrorFeedbackPublisher.delta`` (CPU float32).
            full: the state receivers hold after this delta, ``ErrorFeedbackPublisher.full()``; lets
                late joiners catch up. Without it the latest full copy given stays announced.
            step: the owner's step now (``SurrogateDelta.step``).

        Returns:
            The announcement (what goes into the DHT record).

        Raises:
            ValueError: version out of order, or tensors that do not match ``shapes``.
        """
        eid = (layer, expert)
        last = max(self.store.latest_owned(eid), self._held.get(eid, 0))
        if version <= last:
            raise ValueError(f"surrogate {eid}: publish a version above {last}, not {version}")
        if version != last + 1 and full is None:
            raise ValueError(f"surrogate {eid}: v{version} skips versions after v{last}; a jump needs the full copy")
        if set(factors) != set(self.shapes) or (full is not None and set(full) != set(self.shapes)):
            raise ValueError(f"surrogate tensors must be exactly {sorted(self.shapes)}")
        try:
            body = encode_delta(layer, expert, version, factors)
            full_body = encode_full(layer, expert, version, full) if full is not None else None
        except LocalProtocolError as e:
            raise ValueError(f"surrogate {eid} v{version} cannot be encoded: {e}") from e
        rank = max([u.shape[-1] for u, v in factors.values() if v.numel()] + [1])
        return self._publish_bodies(eid, version, rank, body, full_body, step=step)

    def _publish_bodies(self, eid: ExpertId, version: int, rank: int, body: bytes,
                        full_body: bytes | None, *, step: int = 0) -> SurrogateDelta:
        # Split from publish() so tests can serve deliberately bad payloads under a valid announcement.
        ann = SurrogateDelta(layer=eid[0], expert=eid[1], version=version, base_version=version - 1,
                             rank=min(rank, 4096), digest=payload_digest(body), size=len(body), step=step)
        self.store.put(ann, body, full=False, owned=True)
        self._held[eid] = version  # the owner holds what it publishes (if it stops owning, it follows from here)
        if full_body is not None:
            fann = SurrogateDelta(layer=eid[0], expert=eid[1], version=version, base_version=0,
                                  rank=ann.rank, digest=payload_digest(full_body), size=len(full_body), step=step)
            self.store.put(fann, full_body, full=True, owned=True)
        self._poke()
        return ann

    def next_version(self, layer: int, expert: int, *, adopted: bool = False) -> int:
        """The version to publish next for an owned expert.

        A node that has just taken an expert over (``adopted``) jumps ``max_behind`` + 1 versions past
        what it holds: the previous owner may have published versions this node never received, and
        the jump makes every receiver, whatever it holds, catch up with the full copy published with it
        (``plan``) instead of applying deltas to a base it may not share.
        """
        eid = (layer, expert)
        last = max(self.store.latest_owned(eid), self._held.get(eid, 0))
        return last + (self.config.max_behind + 1 if adopted else 1)

    def hold(self, eid: ExpertId, version: int) -> None:
        """Record that this node holds ``version`` of a surrogate it got outside the gossip (a snapshot)."""
        self._held[eid] = max(self._held.get(eid, 0), version)

    def disown(self, layer: int, expert: int) -> None:
        """Stop announcing an expert as owned (it moved to another node); its payloads stay served."""
        self.store.disown((layer, expert))

    def drain(self) -> list[SurrogateUpdate]:
        """Every update ready to apply, oldest first (per expert in strict version order). Never blocks."""
        out = []
        while True:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                return out

    def versions(self) -> dict[ExpertId, int]:
        """The version of each followed surrogate once every update queued so far is applied."""
        return dict(self._held)

    # --- loop thread ---

    def _call(self, coro: Coroutine[Any, Any, None], timeout_s: float) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None and not self._closed:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._wake.set)

    async def _setup(self) -> None:
        self._wake = asyncio.Event()
        # hivemind's DHT writes each call to its process over a pipe without a lock: one call at a time.
        self._dht_lock = asyncio.Lock()
        self._p2p = await self.dht.hivemind_dht.replicate_p2p()
        # A receiver pulls each expert's payload once per version (a full copy of every expert after a join).
        limiter = RateLimiter(per_s=50.0, burst=400.0)
        await self._servicer.add_p2p_handlers(self._p2p, rate_limited(self._servicer, limiter),
                                              namespace=self.namespace)
        self._tasks = [asyncio.create_task(self._forever(self._poll_once, self.config.poll_s, None)),
                       asyncio.create_task(self._forever(self._announce_once, self.config.announce_period_s,
                                                         self._wake))]

    async def _teardown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._p2p is None:
            return
        with contextlib.suppress(Exception):
            await self._servicer.remove_p2p_handlers(self._p2p, namespace=self.namespace)
        if self._own_loop:
            # The replica's reader tasks live on our loop, which is about to stop: end them with it.
            with contextlib.suppress(Exception):
                await self._p2p.shutdown()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            await asyncio.get_running_loop().shutdown_asyncgens()

    async def _forever(self, once: Callable[[], Coroutine[Any, Any, None]], period_s: float,
                       wake: asyncio.Event | None) -> None:
        while True:
            if wake is not None:
                wake.clear()
            try:
                await once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or an unexpected hivemind error: log it, keep the node alive
                logger.warning("surrogate gossip: %s failed", once.__name__, exc_info=True)
            if wake is None:
                await asyncio.sleep(period_s)
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), period_s)

    async def _announce_once(self) -> None:
        cfg = self.config
        for layer in sorted(self.store.layers()):
            if layer >= self.n_layers:
                continue
            record = self.store.record(self.dht.peer_id, layer)
            expiry = max(dht_time() + cfg.announce_ttl_s, self._expiry.get(layer, 0.0) + _MIN_EXPIRY_STEP_S)
            self._expiry[layer] = expiry
            assert self._dht_lock is not None
            async with self._dht_lock:
                ok = await asyncio.to_thread(store_record, self.dht, self.identity, self.run_id, layer, record,
                                             expiry, timeout_s=cfg.request_timeout_s)
            if not ok:
                logger.debug("surrogate record of layer %d was not stored; retrying next period", layer)

    async def _poll_once(self) -> None:
        cfg = self.config
        assert self._dht_lock is not None
        async with self._dht_lock:
            records = await asyncio.to_thread(read_records, self.dht, self.run_id, range(self.n_layers),
                                              timeout_s=cfg.request_timeout_s)
        if records is None:
            return
        offers = collect_offers(records, self.owner_of, self.identity.public_key, self.dht.peer_id)
        limit = asyncio.Semaphore(cfg.max_parallel)

        async def sync(eid: ExpertId, offer: Offer) -> None:
            async with limit:
                await self._sync_expert(eid, offer)

        await asyncio.gather(*(sync(eid, offer) for eid, offer in sorted(offers.items())))

    async def _sync_expert(self, eid: ExpertId, offer: Offer) -> None:
        """Pull and queue what ``plan`` says, in order; a delta nobody delivers falls back to the full copy."""
        for _ in range(3):  # full copy, then the deltas after it, then a last fallback: bounded
            held = self._held.get(eid, 0)
            step = plan(held, offer, self.config.max_behind, self._bad)
            if step.full is not None:
                if not await self._pull_full(eid, step.full, offer):
                    return
                continue
            for ann in step.deltas:
                if not await self._pull_delta(eid, ann, offer):
                    full = offer.full
                    if full is not None and full.version > self._held.get(eid, 0) and full.digest not in self._bad:
                        await self._pull_full(eid, full, offer)
                    return
            return

    async def _pull_delta(self, eid: ExpertId, ann: SurrogateDelta, offer: Offer) -> bool:
        return await self._pull_payload(eid, ann, offer, full=False)

    async def _pull_full(self, eid: ExpertId, ann: SurrogateDelta, offer: Offer) -> bool:
        return await self._pull_payload(eid, ann, offer, full=True)

    async def _pull_payload(self, eid: ExpertId, ann: SurrogateDelta, offer: Offer, *, full: bool) -> bool:
        """Fetch, verify and decode a delta (or a full copy), then queue it for the training loop."""
        body = await self._fetch_verified(eid, ann, offer, full=full)
        if body is None:
            return False
        what = "copy" if full else "delta"
        try:
            if full:
                update = SurrogateUpdate(eid[0], eid[1], ann.version, state=decode_full(
                    body, eid, ann.version, self.shapes, self._limits, peer=offer.owner_peer), step=ann.step)
            else:
                update = SurrogateUpdate(eid[0], eid[1], ann.version, factors=decode_delta(
                    body, eid, ann.version, self.shapes, self._limits, peer=offer.owner_peer), step=ann.step)
        except RemoteProtocolError as e:
            self._bad.add(ann.digest)
            self._refuse("bad_payload", "refused surrogate %s %s v%d signed by its owner: %s",
                         what, eid, ann.version, e)
            return False
        self.store.put(ann, body, full=full)
        self._held[eid] = ann.version
        self._ready.put(update)
        if full:
            self.stats.fulls += 1
        else:
            self.stats.deltas += 1
        self._poke()
        return True

    async def _fetch_verified(self, eid: ExpertId, ann: SurrogateDelta, offer: Offer, *, full: bool) -> bytes | None:
        """The payload from the first provider whose bytes match the announcement, or None."""
        if ann.size > SurrogatePayload.MAX_BYTES:
            self._refuse("oversized", "surrogate %s v%d announced at %d bytes: over the cap",
                         eid, ann.version, ann.size)
            self._bad.add(ann.digest)
            return None
        providers = [p for p in offer.providers(ann.version, full=full) if p != self.dht.peer_id]
        for peer in self._order(providers, offer.owner_peer):
            started = time.monotonic()
            try:
                body = await self._pull(peer, eid, ann.version, full, ann.size)
            except _Refused as e:
                self._refuse(e.reason, "surrogate %s v%d from %s refused: %s", eid, ann.version, peer, e)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # provider gone, stream broken, handler error: try the next one
                logger.debug("surrogate %s v%d: provider %s failed: %r", eid, ann.version, peer, e)
                continue
            if not body:
                continue  # the provider no longer holds it
            if len(body) != ann.size or payload_digest(body) != ann.digest:
                self._refuse("digest", "surrogate %s v%d from %s does not match its owner's digest",
                             eid, ann.version, peer)
                continue
            self.stats.fetch_s += time.monotonic() - started
            self.stats.bytes_fetched += len(body)
            self.stats.sources[peer] += 1
            return body
        logger.debug("surrogate %s v%d (%s): no provider delivered it", eid, ann.version, "full" if full else "delta")
        return None

    async def _pull(self, peer: str, eid: ExpertId, version: int, full: bool, size: int) -> bytes:
        assert self._p2p is not None
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.fetch_timeout_s
        stub = SurrogateServicer.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.namespace)
        request = runtime_pb2.ExpertRequest(uid=expert_id(*eid), metadata=msgpack.packb([version, full]))
        stream = await asyncio.wait_for(stub.rpc_fetch(request), timeout=cfg.chunk_timeout_s)
        buf = bytearray()
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise _Refused("timeout", f"payload not complete within {cfg.fetch_timeout_s} s")
                try:
                    msg = await asyncio.wait_for(stream.__anext__(), timeout=min(cfg.chunk_timeout_s, remaining))
                except StopAsyncIteration:
                    break
                buf += msg.serialized_info
                if len(buf) > size:
                    raise _Refused("oversized", f"sent more than the announced {size} bytes")
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
        return bytes(buf)

    def _refuse(self, reason: str, msg: str, *args: object) -> None:
        self.stats.refused[reason] += 1
        now = time.monotonic()
        if now - self._last_log.get(reason, -_REFUSAL_LOG_INTERVAL_S) >= _REFUSAL_LOG_INTERVAL_S:
            self._last_log[reason] = now
            logger.warning(msg + " (%d %s refusals so far)", *args, self.stats.refused[reason], reason)
        else:
            logger.debug(msg, *args)


def owner_first_then_random(providers: list[str], owner_peer: str | None) -> list[str]:
    """The default order of tries: the owner (when it serves the payload), then the others at random."""
    rest = [p for p in providers if p != owner_peer]
    random.shuffle(rest)
    return ([owner_peer] if owner_peer in providers else []) + rest


__all__ = [
    "GossipStats",
    "Offer",
    "Step",
    "SurrogateGossip",
    "SurrogateServicer",
    "SurrogateUpdate",
    "collect_offers",
    "owner_first_then_random",
    "plan",
]
