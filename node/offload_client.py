"""The composer's side of networked worker offload: assign, onboard, send sketches, apply results, fall back.

DESIGN.md section 4, issue 7. ``OffloadSession.exchange`` is called once a step by the training thread,
between ``Composer.forward_backward`` and ``Composer.optimizer_step`` (the only point where a fall-back's
unanswered sketches can still join a step's gradient). It never waits on the network: every call to a worker
returns a future (``offload_exchange.OffloadClient``) that a later ``exchange`` reads only once it is done, so
the results of step t are applied at step t + (round trip), like outer rounds.

Per call, in this order (why: nothing captured may stay pending, nothing unanswered may be lost):
1. take this step's raw sketches of the offloaded experts;
2. apply every finished result, oldest first per expert (``offload.apply_result`` checks it);
3. drop the worker of every expert whose worker left the live view, whose request failed (refused, timed out,
   dead peer), or whose result was malformed or non-finite: the expert is trained locally again and every
   unanswered sketch, this step's included, becomes local gradient (``offload.fall_back``); a worker that sent
   a bad result is not used again by this composer;
4. send this step's sketches of the experts still offloaded, except to a worker that is ``max_in_flight``
   answers behind on that expert: that step's sample is left out (``skipped``), so a slow worker sees a
   smaller sample of the steps instead of being dropped and onboarded again (which restarts its optimizer;
   measured in ``parallax bench offload-swarm`` at tiny steps: a worker on a shared CPU fell 8 answers
   behind within 12 steps, again and again). A worker that stops answering is dropped by its timeout.
5. onboard offloadable experts (layers >= cfg.offload.private_layers) that have no worker, to the worker
   ``offload_exchange.assign_to_workers`` picks; an expert is offloaded only once its onboarding is answered.
   Assignment is sticky: an expert moves only when its worker goes, so a joining worker takes only new work.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from parallax.node.composer import Composer
from parallax.node.offload import apply_result, fall_back, onboard_blobs
from parallax.node.offload_exchange import OffloadClient, assign_to_workers, sketch_message
from parallax.node.sketch import Sketch, compress
from parallax.protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

ExpertId = tuple[int, int]
Event = Callable[..., None]
"""event(kind, **fields): the node's metrics/event sink."""


@dataclass
class _Offloaded:
    worker: str
    onboard_started: float | None
    """When its onboarding was sent (monotonic clock): the first applied result reports the time to it."""
    in_flight: list[tuple[int, Sketch, concurrent.futures.Future]] = field(default_factory=list)
    """(step, raw sketch, future of the result blobs), oldest first."""


class OffloadSession:
    """One composer's offloaded experts and their workers.

    Args:
        composer: the composer (built with cfg.offload.enabled).
        client: the calls to workers (or a stand-in with ``onboard`` and ``update``).
        run_id: salts the assignment hash.
        workers: () -> {worker peer id: capacity} from the live membership view, or None when there is no
            fresh view (then no worker is dropped for being absent); called on the training thread, so it
            must be a cheap read.
        event: the node's event sink (``offload_onboarded`` with the seconds from sending the weights to the
            answer, ``offload_first_update`` with the seconds from sending them to the first applied result,
            ``offload_fallback``).
        max_in_flight: answers outstanding per expert beyond which its sketches are left out (backpressure).
        retry_s: wait before onboarding an expert again after its onboarding failed (seconds).
    """

    def __init__(self, composer: Composer, client: OffloadClient, run_id: str,
                 workers: Callable[[], Mapping[str, float] | None], *, event: Event | None = None,
                 max_in_flight: int = 8, retry_s: float = 5.0) -> None:
        self.composer, self.client, self.run_id = composer, client, run_id
        self.workers, self.event = workers, event or (lambda kind, **fields: None)
        self.max_in_flight, self.retry_s = max_in_flight, retry_s
        self.offloaded: dict[ExpertId, _Offloaded] = {}
        self.onboarding: dict[ExpertId, tuple[str, concurrent.futures.Future, float]] = {}
        self.banned: set[str] = set()
        self.applied = 0
        self.skipped = 0
        """Sketches left out because their worker was ``max_in_flight`` answers behind."""
        self.fallbacks: list[tuple[ExpertId, str, str]] = []
        """(expert, worker, reason) of every drop."""
        self._retry_at: dict[ExpertId, float] = {}

    def exchange(self) -> None:
        """One step's offload work (module docstring); call between forward_backward and optimizer_step."""
        c = self.composer
        raw = c.take_offload_sketches()
        live = self.workers()
        for eid, entry in list(self.offloaded.items()):
            reason = self._apply_done(eid, entry)
            if reason is None and live is not None and entry.worker not in live:
                reason = "worker left the live view"
            if reason is not None:
                self.drop(eid, reason, extra=[raw.pop(eid)] if eid in raw else [])
        off = c.cfg.offload
        for eid, sketch in raw.items():
            entry = self.offloaded.get(eid)
            if entry is None:
                continue
            wire = compress(sketch, sample_fraction=off.sample_fraction, generator=c.sketch_rng, wire_codec="raw")
            if wire.x_NL.shape[0] == 0:
                continue  # nothing sampled this step
            if len(entry.in_flight) >= self.max_in_flight:
                self.skipped += 1  # the worker is behind on this expert: leave this step's sample out
                continue
            message = sketch_message(eid, c.step, wire, off.wire_codec)
            entry.in_flight.append((c.step, sketch, self.client.update(entry.worker, message)))
        self._onboard(live)

    def _apply_done(self, eid: ExpertId, entry: _Offloaded) -> str | None:
        """Apply the finished results at the head of ``entry``'s queue; a reason to drop the worker, or None."""
        while entry.in_flight and entry.in_flight[0][2].done():
            step, _, future = entry.in_flight[0]
            try:
                blobs = future.result()
                apply_result(self.composer, eid, blobs, peer=entry.worker)
            except ProtocolError as e:
                self.banned.add(entry.worker)
                return f"bad result for step {step}: {e}"
            except Exception as e:  # timeout, refused request, dead peer, cancelled
                return f"request for step {step} failed: {e!r}"
            entry.in_flight.pop(0)
            self.applied += 1
            if entry.onboard_started is not None:
                self.event("offload_first_update", step=self.composer.step, expert=list(eid), worker=entry.worker,
                           seconds=round(time.monotonic() - entry.onboard_started, 3))
                entry.onboard_started = None
        return None

    def drop(self, eid: ExpertId, reason: str, extra: list[Sketch] | None = None) -> None:
        """Take ``eid`` back from its worker: trained here again, unanswered sketches (and ``extra``) applied
        as local gradient for the coming optimizer step."""
        entry = self.offloaded.pop(eid)
        for _, _, future in entry.in_flight:
            future.cancel()
        unanswered = [sketch for _, sketch, _ in entry.in_flight] + list(extra or [])
        fall_back(self.composer, eid, unanswered)
        self.fallbacks.append((eid, entry.worker, reason))
        self._retry_at[eid] = time.monotonic() + self.retry_s
        logger.warning("expert %s: dropped worker %s (%s); training it locally", eid, entry.worker, reason)
        self.event("offload_fallback", step=self.composer.step, expert=list(eid), worker=entry.worker,
                   reason=reason, unanswered=len(unanswered))

    def _onboard(self, live: Mapping[str, float] | None) -> None:
        c = self.composer
        for eid, (worker, future, sent) in list(self.onboarding.items()):
            if not future.done():
                continue
            del self.onboarding[eid]
            if eid not in set(c.owned_experts()):
                continue  # handed over meanwhile
            try:
                future.result()
            except Exception as e:  # refused, timed out, dead peer
                logger.info("onboarding expert %s on %s failed: %r", eid, worker, e)
                self._retry_at[eid] = time.monotonic() + self.retry_s
                continue
            c.offload_expert(eid, True)
            self.offloaded[eid] = _Offloaded(worker, sent)
            self.event("offload_onboarded", step=c.step, expert=list(eid), worker=worker,
                       seconds=round(time.monotonic() - sent, 3))
        if not live:
            return
        usable = {w: cap for w, cap in live.items() if w not in self.banned}
        now = time.monotonic()
        todo = [eid for eid in c.owned_experts() if eid[0] >= c.cfg.offload.private_layers
                and eid not in self.offloaded and eid not in self.onboarding and self._retry_at.get(eid, 0) <= now]
        for eid, worker in assign_to_workers(self.run_id, todo, usable).items():
            self.onboarding[eid] = (worker, self.client.onboard(worker, eid, c.step, onboard_blobs(c, eid)), now)

    def release(self, eid: ExpertId) -> None:
        """The composer is handing ``eid`` over: stop offloading it (call before the hand-over)."""
        if eid in self.offloaded:
            self.drop(eid, "expert handed over")
        self.onboarding.pop(eid, None)

    def close(self) -> None:
        """Cancel every outstanding request (the composer is leaving; unanswered work is not needed)."""
        self.client.close()
        for entry in self.offloaded.values():
            for _, _, future in entry.in_flight:
                future.cancel()
        for _, future, _ in self.onboarding.values():
            future.cancel()
