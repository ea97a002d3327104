"""Worker offload over P2P streams: the worker's service (onboard, update) and the composer's calls.

DESIGN.md section 4 ("Worker offload"). Two unary RPCs under the namespace
``parallax.<run_id>.offload``:

- ``rpc_onboard``: request = an ``ExpertSnapshot`` envelope (layer, expert, the composer's step, the
  expert's weights as ``offload.encode_tensors`` blobs, addressed ``to`` the worker); the worker builds a
  ``TaylorProxyTrainer`` for it. The answer is empty (what it acknowledges is checked by the first result).
- ``rpc_update``: request = a ``Sketch`` envelope (exactly ``x`` and ``g``, rows x d_latent, float codecs,
  addressed ``to`` the worker; one step's sample, or several steps' in ``parts`` when the composer's earlier
  requests were still unanswered); the answer is a ``WorkerResult`` envelope signed by the worker, holding the
  weight change blobs (``TaylorProxyTrainer.update``: one optimizer step per part, one change for all).

What the worker sees: latent activations and gradients of one expert, never token ids or text (the
``Sketch`` kind admits exactly x and g, the decoder only float dtypes of the latent width).

Bounds, checked in this order on every request: envelope size (``max_request_bytes``, below hivemind's
4 MiB unary cap) before any decoding; the envelope's checks (``protocol.envelope.Opener``: kind, header,
run, Ed25519 signature, timestamp window, sequence number); the addressee; the message kind's own checks;
expert inside the model's grid; tensor names, codecs, float dtypes, shapes and element counts; then the
update itself runs on one training thread under ``update_timeout_s``. A refused request raises
``RemoteProtocolError`` to the caller (it arrives as ``P2PHandlerError``) and is logged at debug level: a
malformed request never ends the worker.

Trust: every request and every result is a signed envelope (DESIGN.md section 5). A worker keys its trainers
by (the signer's public key, expert), so one composer can neither read nor overwrite another's expert; a
replayed request is refused by its sequence number (a window of ``REPLAY_WINDOW``, since concurrent calls
overtake each other) and a request recorded by one worker cannot be played to another (``to``). The
composer accepts a result only when it is signed by the key the live membership names for the worker it
called, and checks its tensors (``offload.apply_result``) before using them. libp2p authenticates and
encrypts the stream underneath as well.

Concurrency: the servicer and the client coroutines run on the process's network loop; the Taylor-proxy
steps run on a one-thread executor, so the loop keeps answering while a worker trains and updates of one
worker never race on a trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from parallax.dht.keys import ExpertId
from parallax.dht.shards import hrw_score
from parallax.node.config.peer import UNARY_CAP, WorkerLimits
from parallax.node.config.train import TrainConfig
from parallax.node.model.sketch import Sketch
from parallax.node.model.transformer import SwiGLU
from parallax.node.net.network import RateLimiter, rate_limited
from parallax.node.offload.proxy import Blobs, TaylorProxyTrainer, encode_tensors
from parallax.protocol import codec
from parallax.protocol.envelope import Envelope, Opener, Sealer, Signed
from parallax.protocol.errors import BadTimestamp, ProtocolError, RemoteProtocolError
from parallax.protocol.identity import Identity
from parallax.protocol.messages import ExpertSnapshot, Message, WorkerResult
from parallax.protocol.messages import Sketch as SketchMessage

logger = logging.getLogger(__name__)

REPLAY_WINDOW = 1 << 14
"""Sequence numbers a request or answer may trail the highest one seen from its sender and still pass once
(``ReplayGuard``): calls run concurrently and overtake each other. Above any realistic number in flight
(max_in_flight 4 per expert x the experts one composer offloads)."""
M = TypeVar("M", bound=Message)
WIRE_CODECS = frozenset({"raw", "fp16", "int8", "int4"})



# --- the messages, both ways (pure) ----------------------------------------------------------------


def check_size(body: bytes, limits: WorkerLimits, *, peer: str | None = None) -> None:
    """Refuse a body over the cap before anything decodes it.

    Raises:
        RemoteProtocolError: ``body`` is longer than ``limits.max_request_bytes``.
    """
    if len(body) > limits.max_request_bytes:
        raise RemoteProtocolError(f"request of {len(body)} bytes, cap {limits.max_request_bytes}", peer=peer)


def _check_expert(cfg: TrainConfig, layer: int, expert: int, peer: str | None) -> ExpertId:
    m = cfg.model
    if not (cfg.offload.private_layers <= layer < m.n_layers and 0 <= expert < m.n_experts):
        raise RemoteProtocolError(f"expert {(layer, expert)} is not an offloadable expert of this run", peer=peer)
    return layer, expert


def sketch_message(eid: ExpertId, parts: Sequence[tuple[int, Sketch]], wire_codec: str, *,
                   lookahead: int | None = None) -> SketchMessage:
    """The ``Sketch`` message of one expert's sub-sampled (x, g) of one step or several (``parts``: (step,
    sketch), oldest first, each with at least one row), x and g quantised, asking for ``lookahead`` (None: the
    worker's own); the client addresses and signs it."""
    if not parts or any(sketch.x_NL.shape[0] == 0 for _, sketch in parts):
        raise ValueError("a sketch message needs at least one part, each with at least one row")
    x = torch.cat([sketch.x_NL for _, sketch in parts]).detach().cpu().float().numpy()
    g = torch.cat([sketch.g_NL for _, sketch in parts]).detach().cpu().float().numpy()
    tokens = [max(1, sketch.tokens) for _, sketch in parts]
    coalesced = tuple((step, sketch.x_NL.shape[0], t) for (step, sketch), t in zip(parts, tokens, strict=True))
    return SketchMessage(layer=eid[0], expert=eid[1], step=parts[-1][0], tokens=sum(tokens),
                         tensors={"x": codec.encode(x, wire_codec), "g": codec.encode(g, wire_codec)},
                         parts=coalesced if len(parts) > 1 else (), lookahead=lookahead)


def row_budget(cfg: TrainConfig) -> int:
    """Sketch rows that fit half a request under hivemind's unary cap at cfg.offload.wire_codec (x and g, a
    byte per element for int4 too: an upper bound), so a composer's requests stay far below every worker's
    ``max_request_bytes``."""
    per_element = {"raw": 4, "fp16": 2}.get(cfg.offload.wire_codec, 1)
    return max(1, (UNARY_CAP // 2) // (2 * cfg.model.d_latent * per_element))


def open_request(data: bytes, expect: type[M], opener: Opener, limits: WorkerLimits, *, me: str,
                 peer: str | None = None) -> Signed[M]:
    """Verify a request's envelope: size before anything decodes it, then every envelope check but the replay
    check (signature, run, time window), then that it is addressed to this peer (``me``: our libp2p peer id).
    The caller records the sequence number (``Opener.accept``) only once the request is one it will serve, so that
    keys nobody onboarded cannot fill the replay cache.

    Raises:
        RemoteProtocolError: any refusal, naming the sender when it is known.
    """
    check_size(data, limits, peer=peer)
    signed = opener.open(data, expect, check_replay=False)
    to = getattr(signed.message, "to", None)  # Sketch and ExpertSnapshot carry their addressee
    if to != me:
        raise RemoteProtocolError(f"{expect.KIND} addressed to {to!r:.60}, not to this peer", peer=signed.envelope.peer)
    return signed


class UpdateRequest(NamedTuple):
    """A checked update request: ``envelope.sender`` is the signer's public key; ``parts`` are (step, sketch),
    oldest first (one unless the composer coalesced several steps), x and g float32, rows x d_latent;
    ``lookahead``: the extrapolation the composer asks for (None: the worker's own)."""

    envelope: Envelope
    expert: ExpertId
    parts: list[tuple[int, Sketch]]
    lookahead: int | None


def decode_sketch(data: bytes, cfg: TrainConfig, limits: WorkerLimits, opener: Opener, *, me: str,
                  peer: str | None = None) -> UpdateRequest:
    """Open and check an update request (its sequence number is not recorded yet: ``Opener.accept``).

    Raises:
        RemoteProtocolError: oversized, a failed envelope check (forged, replayed, stale, another run or
            addressee), undecodable, another kind or extra tensors, an expert outside the offloadable grid, a
            non-float dtype, a wrong width or row count (also against the parts' rows), non-finite values.
    """
    signed = open_request(data, SketchMessage, opener, limits, me=me, peer=peer)
    msg, peer = signed.message, signed.envelope.peer
    eid = _check_expert(cfg, msg.layer, msg.expert, peer)
    width = cfg.model.d_latent
    tensor_limits = codec.TensorLimits(max_elements=limits.max_rows * width, max_ndim=2, codecs=WIRE_CODECS)
    arrays = msg.decode_tensors(tensor_limits, peer=peer)
    x, g = arrays["x"], arrays["g"]
    if x.ndim != 2 or x.shape != g.shape or x.shape[1] != width:
        raise RemoteProtocolError(f"sketch x {x.shape} and g {g.shape}, expected equal (rows, {width})", peer=peer)
    if not (np.isfinite(x).all() and np.isfinite(g).all()):
        raise RemoteProtocolError("sketch is not finite", peer=peer)
    layout = msg.parts or ((msg.step, x.shape[0], msg.tokens),)
    if sum(rows for _, rows, _ in layout) != x.shape[0]:
        raise RemoteProtocolError(f"sketch parts hold {sum(r for _, r, _ in layout)} rows, x and g {x.shape[0]}",
                                  peer=peer)
    x_t, g_t = torch.from_numpy(np.array(x, dtype=np.float32)), torch.from_numpy(np.array(g, dtype=np.float32))
    parts, start = [], 0
    for step, rows, tokens in layout:
        parts.append((step, Sketch(x_t[start:start + rows], g_t[start:start + rows], tokens, len(data))))
        start += rows
    return UpdateRequest(signed.envelope, eid, parts, msg.lookahead)


def decode_onboard(data: bytes, cfg: TrainConfig, limits: WorkerLimits, opener: Opener, *, me: str,
                   peer: str | None = None) -> tuple[Envelope, ExpertId, int, Blobs]:
    """Open an onboarding request to (the verified envelope, expert, the composer's step, weight blobs); the
    trainer checks the blobs' shapes. Its sequence number is not recorded yet (``Opener.accept``).

    Raises:
        RemoteProtocolError: oversized, a failed envelope check, undecodable, or an expert outside the
            offloadable grid.
    """
    signed = open_request(data, ExpertSnapshot, opener, limits, me=me, peer=peer)
    msg = signed.message
    return signed.envelope, _check_expert(cfg, msg.layer, msg.expert, signed.envelope.peer), msg.step, dict(msg.tensors)


def assign_to_workers(run_id: str, experts: list[ExpertId], workers: Mapping[str, float]) -> dict[ExpertId, str]:
    """Each expert to the worker with the highest capacity-weighted rendezvous score (``shards.hrw_score``).

    A worker that leaves moves only its own experts; one that joins takes about its capacity's share.

    Args:
        run_id: the run (salts the hash).
        experts: the offloadable experts of one composer.
        workers: worker peer id -> capacity (> 0); empty: nothing is offloaded.

    Returns:
        expert -> worker peer id.
    """
    live = {w: c for w, c in workers.items() if c > 0}
    if not live:
        return {}
    return {eid: max(sorted(live), key=lambda w: hrw_score(run_id, eid[0], eid[1], w, live[w])) for eid in experts}


# --- the worker's side -----------------------------------------------------------------------------


class OffloadServicer(ServicerBase):
    """Serves onboard and update requests from composers. Do not rename (it is part of the protocol id).

    Args:
        cfg: the run's config (model shapes, cfg.offload).
        limits: request bounds.
        device: where the experts' copies are trained (``--gpu N``: cuda:N).
        clock: monotonic seconds, for the idle eviction (injected for tests).
    """

    def __init__(self, cfg: TrainConfig, limits: WorkerLimits, identity: Identity, run_id: str,
                 device: str = "cpu", *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.limits, self.device, self._clock = cfg, limits, device, clock
        self.sealer = Sealer(identity, run_id)
        self.opener = Opener(run_id, replay_window=REPLAY_WINDOW)
        self.trainers: dict[tuple[bytes, ExpertId], TaylorProxyTrainer] = {}
        """Keyed by (the composer's public key, expert): one composer can neither read nor overwrite another's."""
        self.refused = 0
        self.updates = 0
        self.seen: list[tuple[bytes, ExpertId, dict[str, tuple[str, tuple[int, ...]]]]] = []
        """Per decoded step's part of an update (kept only when ``record`` is set, for tests): the signer's key,
        expert, and every tensor's dtype and shape exactly as it arrived."""
        self.record = False
        self._used: dict[tuple[bytes, ExpertId], float] = {}  # (composer key, expert) -> last onboarding or update
        self._reserved: set[tuple[bytes, ExpertId]] = set()  # onboardings whose weights are still loading
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="parallax-offload")
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _make_room(self, caller: bytes, eid: ExpertId, peer: str) -> None:
        """Before onboarding (caller, eid), under the lock: refuse a composer past its share of the slots, and
        when the worker is full evict the expert idle longest if it has been idle ``idle_s``, else refuse."""
        key, limits = (caller, eid), self.limits
        if key in self.trainers:
            return
        if key in self._reserved:
            raise RemoteProtocolError(f"expert {eid} is already being onboarded by this composer", peer=peer)
        held = set(self.trainers) | self._reserved
        if sum(1 for c, _ in held if c == caller) >= limits.max_experts_per_composer:
            raise RemoteProtocolError(f"this composer already has {limits.max_experts_per_composer} experts on this "
                                      "worker", peer=peer)
        if len(held) < limits.max_experts:
            return
        if not self.trainers:  # every slot is an onboarding still loading
            raise RemoteProtocolError(f"this worker is full ({limits.max_experts} experts)", peer=peer)
        idle = min(self.trainers, key=lambda k: self._used.get(k, 0.0))
        idle_for = self._clock() - self._used.get(idle, 0.0)
        if idle_for < limits.idle_s:
            raise RemoteProtocolError(f"this worker is full ({limits.max_experts} experts, none idle for "
                                      f"{limits.idle_s:.0f} s)", peer=peer)
        del self.trainers[idle]
        self._used.pop(idle, None)
        logger.info("evicted expert %s of composer %s, idle for %.0f s, to onboard %s", idle[1], idle[0].hex()[:12],
                    idle_for, eid)

    def warm_up(self) -> float:
        """One throwaway onboarding and update on the device, in the thread that serves them: CUDA's
        context, its matmul handles and the optimizer's kernels start here (seconds on a GPU), not inside a
        composer's first requests, which would time out. Returns the seconds it took."""
        def work() -> float:
            started = time.perf_counter()
            m = self.cfg.model
            expert = SwiGLU(m.d_latent, m.d_expert)
            trainer = TaylorProxyTrainer(self.cfg, encode_tensors(dict(expert.named_parameters()), "fp16"),
                                         self.device)
            rows = torch.randn(8, m.d_latent)
            trainer.update([(1, Sketch(rows, 1e-3 * rows, 8))])
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
            return time.perf_counter() - started
        return self._executor.submit(work).result()

    async def rpc_onboard(self, request: runtime_pb2.ExpertInfo, context: P2PContext) -> runtime_pb2.ExpertInfo:
        peer = context.remote_id.to_base58()
        try:
            envelope, eid, onboard_step, blobs = decode_onboard(request.serialized_info, self.cfg, self.limits,
                                                                self.opener, me=context.local_id.to_base58(), peer=peer)
            caller = envelope.sender
            with self._lock:
                self._make_room(caller, eid, peer)
                self._reserved.add((caller, eid))  # counted while its weights load: concurrent onboardings see it
            try:
                self.opener.accept(envelope)
                trainer = await asyncio.get_running_loop().run_in_executor(
                    self._executor, TaylorProxyTrainer, self.cfg, blobs, self.device)
            finally:
                with self._lock:
                    self._reserved.discard((caller, eid))
        except (ProtocolError, ValueError) as e:
            self.refused += 1
            logger.debug("refused onboarding from %s: %s", peer, e)
            raise RemoteProtocolError(str(e), peer=peer) from None
        trainer.onboard_step = onboard_step
        with self._lock:
            self.trainers[(caller, eid)] = trainer  # a repeated onboarding restarts the expert from these weights
            self._used[(caller, eid)] = self._clock()
        logger.info("onboarded expert %s for %s", eid, peer)
        return runtime_pb2.ExpertInfo(serialized_info=b"")

    async def rpc_update(self, request: runtime_pb2.ExpertInfo, context: P2PContext) -> runtime_pb2.ExpertInfo:
        peer = context.remote_id.to_base58()
        try:
            envelope, eid, parts, lookahead = decode_sketch(request.serialized_info, self.cfg, self.limits,
                                                            self.opener, me=context.local_id.to_base58(), peer=peer)
            caller = envelope.sender
            with self._lock:
                trainer = self.trainers.get((caller, eid))
                if trainer is not None:
                    self._used[(caller, eid)] = self._clock()
            if trainer is None:
                raise RemoteProtocolError(f"expert {eid} was not onboarded by this composer", peer=peer)
            if parts[0][0] < trainer.onboard_step:  # sent before the composer took it back and onboarded it
                # again: answering it would move our mirror past the copy the composer now holds
                raise RemoteProtocolError(f"sketch of expert {eid} from step {parts[0][0]}, before its onboarding "
                                          f"at step {trainer.onboard_step}", peer=peer)
            self.opener.accept(envelope)
        except (ProtocolError, ValueError) as e:
            self.refused += 1
            logger.debug("refused an update from %s: %s", peer, e)
            raise RemoteProtocolError(str(e), peer=peer) from None
        if self.record:
            for _, sketch in parts:
                self.seen.append((caller, eid, {"x": (str(sketch.x_NL.dtype), tuple(sketch.x_NL.shape)),
                                                "g": (str(sketch.g_NL.dtype), tuple(sketch.g_NL.shape))}))
        step = parts[-1][0]
        job = asyncio.get_running_loop().run_in_executor(self._executor, trainer.update, parts, lookahead)
        # On timeout the thread finishes its step anyway; the caller treats the missing answer as a failure.
        blobs = await asyncio.wait_for(job, self.limits.update_timeout_s)
        self.updates += 1
        result = WorkerResult(layer=eid[0], expert=eid[1], step=step, tensors=blobs)
        return runtime_pb2.ExpertInfo(serialized_info=self.sealer.seal(result))


# --- the composer's side ---------------------------------------------------------------------------


class OffloadClient:
    """A composer's calls to workers; every call returns a future and never blocks the training thread.

    Requests are signed envelopes addressed to the worker (``to``); answers must be envelopes signed by the key
    the live membership names for the worker called.

    Args:
        p2p: this process's P2P replica (on ``loop``).
        loop: the network loop, running in a background thread.
        run_id: namespaces the handler; envelopes are for this run.
        identity: this composer's key: it signs the requests.
        key_of: worker peer id -> its identity's public key from the live membership, or None (then its
            answers are refused); called on the network loop, so a cheap read.
        onboard_timeout_s: one onboarding round trip (seconds).
        update_timeout_s: one update round trip (seconds), including the worker's Taylor-proxy steps.
    """

    def __init__(self, p2p: P2P, loop: asyncio.AbstractEventLoop, run_id: str, identity: Identity,
                 key_of: Callable[[str], bytes | None], *, onboard_timeout_s: float = 30.0,
                 update_timeout_s: float = 30.0) -> None:
        self.p2p, self.loop, self.key_of = p2p, loop, key_of
        self.namespace = f"parallax.{run_id}.offload"
        self.sealer = Sealer(identity, run_id)
        self.opener = Opener(run_id, replay_window=REPLAY_WINDOW)
        self.onboard_timeout_s, self.update_timeout_s = onboard_timeout_s, update_timeout_s
        self.bytes_sent = {"rpc_onboard": 0, "rpc_update": 0}
        """Request envelopes handed to the P2P layer, by call (onboarding weights; sketches)."""
        self.bytes_received = {"rpc_onboard": 0, "rpc_update": 0}
        """Answers received, by call (acknowledgements; worker results)."""
        self.requests = {"rpc_onboard": 0, "rpc_update": 0}
        self.replies = {"rpc_onboard": 0, "rpc_update": 0}
        self._closing = False
        self._abandoned: set[asyncio.Future[Any]] = set()
        """Calls past their timeout (or given up by the caller) still waiting for hivemind's reply."""

    def close(self) -> None:
        """From now on cancel calls outright, and cancel the abandoned ones (the peer is leaving: hivemind's
        reader no longer matters). Thread-safe; call before cancelling the outstanding futures."""
        self._closing = True

        def cancel_all() -> None:
            for call in list(self._abandoned):
                call.cancel()
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing is left to cancel
            self.loop.call_soon_threadsafe(cancel_all)

    def _settled(self, call: asyncio.Future[Any]) -> None:
        """An abandoned call ended: forget it, and retrieve its outcome (no "never retrieved" warning)."""
        self._abandoned.discard(call)
        if not call.cancelled():
            call.exception()

    def onboard(self, worker: str, eid: ExpertId, step: int,
                blobs: Mapping[str, bytes]) -> concurrent.futures.Future[bytes | None]:
        """Send expert ``eid``'s weights to ``worker``; the future raises on refusal, timeout or a dead peer."""
        body = self.sealer.seal(ExpertSnapshot(layer=eid[0], expert=eid[1], step=step, tensors=dict(blobs), to=worker))
        return asyncio.run_coroutine_threadsafe(self._call("rpc_onboard", worker, body, self.onboard_timeout_s),
                                                self.loop)

    def update(self, worker: str, sketch: SketchMessage) -> concurrent.futures.Future[Blobs]:
        """Send one sketch (``sketch_message``) to ``worker``; the future gives the result blobs of its expert for
        its step. The answer's envelope, expert and step are checked here; its tensors by ``offload.apply_result``.
        """
        body = self.sealer.seal(dataclasses.replace(sketch, to=worker))
        return asyncio.run_coroutine_threadsafe(self._update(worker, (sketch.layer, sketch.expert), sketch.step, body),
                                                self.loop)

    async def _update(self, worker: str, eid: ExpertId, step: int, body: bytes) -> Blobs:
        answer = await self._call("rpc_update", worker, body, self.update_timeout_s)
        result = self.open_answer(answer or b"", WorkerResult, worker).message
        if (result.layer, result.expert, result.step) != (eid[0], eid[1], step):
            raise RemoteProtocolError(f"asked for {eid} at step {step}, got {(result.layer, result.expert)} at "
                                      f"step {result.step}", peer=worker)
        return dict(result.tensors)

    def open_answer(self, data: bytes, expect: type[M], worker: str) -> Signed[M]:
        """Verify a worker's answer: every envelope check, then that its signer is the key the membership names
        for ``worker``.

        Raises:
            RemoteProtocolError: a failed check, or the signer is not ``worker``'s key.
            ConnectionError: the membership names no key for ``worker`` (it left the live view), or the answer's
                timestamp is outside the window (a clock is off).
        """
        key = self.key_of(worker)
        if key is None:  # not the worker's fault: the caller drops it without banning it
            raise ConnectionError(f"worker {worker} is not in the live membership, its answer cannot be checked")
        try:
            signed = self.opener.open(data, expect, check_replay=False, signer=key)
        except BadTimestamp as e:  # a clock that is off, not a lie: drop the worker, do not ban it
            raise ConnectionError(f"worker {worker}'s answer: {e} (are both clocks right?)") from None
        self.opener.accept(signed.envelope)  # only the workers we call get entries in the replay cache
        return signed

    async def _call(self, method: str, worker: str, body: bytes, timeout_s: float) -> bytes | None:
        stub = OffloadServicer.get_stub(self.p2p, PeerID.from_base58(worker), namespace=self.namespace)
        self.requests[method] += 1  # counted on the loop thread only
        self.bytes_sent[method] += len(body)
        call = asyncio.ensure_future(getattr(stub, method)(runtime_pb2.ExpertInfo(serialized_info=body)))
        try:
            # Shielded: hivemind 1.1.12 cancels a unary call's future before it forgets it, and a reply that
            # lands in between is set on the cancelled future, which kills the daemon connection's reader;
            # every later unary call of this peer then hangs (seen on a GPU: all offload requests timed out
            # from then on). A call we stop waiting for runs on until its reply or error, and is dropped.
            reply = await asyncio.wait_for(asyncio.shield(call), timeout_s)
        except BaseException:
            if self._closing:
                call.cancel()
            else:  # a late reply lands on a live future; past ten timeouts none is expected any more
                self._abandoned.add(call)
                call.add_done_callback(self._settled)
                asyncio.get_running_loop().call_later(10 * timeout_s, call.cancel)
            raise
        self.replies[method] += 1
        self.bytes_received[method] += len(reply.serialized_info)
        return reply.serialized_info


async def serve(servicer: OffloadServicer, p2p: P2P, run_id: str) -> None:
    """Register ``servicer`` on ``p2p`` (call on the network loop)."""
    # One update per offloaded expert per composer step: a composer with 16 experts here at 10 steps a second.
    limiter = RateLimiter(per_s=200.0, burst=400.0)
    await servicer.add_p2p_handlers(p2p, rate_limited(servicer, limiter), namespace=f"parallax.{run_id}.offload")


async def unserve(servicer: OffloadServicer, p2p: P2P, run_id: str) -> None:
    """Remove the handlers again; the daemon may already be gone."""
    with contextlib.suppress(Exception):
        await servicer.remove_p2p_handlers(p2p, namespace=f"parallax.{run_id}.offload")
    servicer.shutdown()
