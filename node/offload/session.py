"""The composer's side of networked worker offload: assign, onboard, send sketches, apply results, fall back.

DESIGN.md section 4. ``OffloadSession.exchange`` is called once a step by the training thread,
between ``Composer.forward_backward`` and ``Composer.optimizer_step`` (the only point where a fall-back's
unanswered sketches can still join a step's gradient). Every call to a worker returns a future
(``offload_exchange.OffloadClient``) that an ``exchange`` reads only once it is done. By default
(``offload.wait_s``, 10 s) it waits up to that long at the end of the call for every request in flight (step
4b), so a worker that answers within it is no step late, at the price of the composer idling for the round
trip; with ``offload.wait_s = 0`` it never waits on the network, and the results of step t are applied at step
t + (round trip), like outer rounds.

Per call, in this order (why: nothing captured may stay pending, nothing unanswered may be lost):
1. take this step's raw sketches of the offloaded experts;
2. apply every finished result, oldest first per expert (``offload.apply_result`` checks it);
3. drop the worker of every expert whose worker left the live view, whose request failed (refused, timed out,
   dead peer), or whose result was malformed or non-finite: the expert is trained locally again and every
   unanswered sketch, this step's included, becomes local gradient (``offload.fall_back``); a worker that sent
   a bad result is not used again by this composer;
4. queue this step's sub-sampled sketch of each expert still offloaded, and send what is queued for an expert
   while it has fewer than ``max_in_flight`` requests and ``max_parts`` optimizer steps (parts) unanswered:
   what is queued goes out as one request (``Sketch.parts``), and the worker trains on each step's part in
   turn, as on separate requests. So a worker that falls behind gets the same data in fewer, larger requests,
   and at most ``max_parts`` optimizer steps of one expert wait on it, whatever its speed (leaving sketches
   out would lose their tokens; an unbounded queue would outlast the request timeout). Past ``max_parts`` the
   neighbouring queued pair that stands for the fewest steps merges into their mean (one optimizer step fewer,
   no data lost); no part grows past ``max_rows`` rows (more are sub-sampled, g scaled up so the sum stays
   unbiased), which bounds a request's size; and a worker with ``max_held`` steps unanswered is dropped (step
   3's fall-back), which bounds the raw sketches the composer keeps for it.
4b. with ``offload.wait_s``: wait for the requests in flight, apply what finished, drop what failed (as in 2-3);
5. onboard offloadable experts (layers >= cfg.offload.private_layers) that have no worker, to the worker
   ``offload_exchange.assign_to_workers`` picks; an expert is offloaded only once its onboarding is answered.
   Assignment is sticky: an expert moves only when its worker goes, so a joining worker takes only new work.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from parallax.dht.keys import ExpertId
from parallax.node.model.sketch import Sketch, compress, concat, subsample
from parallax.node.offload.exchange import OffloadClient, assign_to_workers, row_budget, sketch_message
from parallax.node.offload.proxy import apply_result, fall_back, onboard_blobs
from parallax.node.train.composer import Composer
from parallax.protocol.errors import ProtocolError
from parallax.protocol.messages import MAX_LOOKAHEAD, MAX_SKETCH_PARTS

logger = logging.getLogger(__name__)

Event = Callable[..., None]
"""event(kind, **fields): the node's metrics/event sink."""
LATENESS_WEIGHT = 0.2
"""Weight of the newest result in an expert's lateness average (cfg.offload.lookahead_measured)."""


@dataclass
class _Part:
    """One step's sample of an expert waiting to be answered (or several steps' once merged)."""

    step: int
    wire: Sketch
    """The sub-sampled rows that go out (a merged part: the mean of its steps', each step's g scaled by its
    share, so one optimizer step on it is one step's worth)."""
    raw: list[Sketch]
    """The whole sketches it stands for: what a fall-back turns into local gradient."""
    steps: int = 1
    """Composer steps it stands for."""


@dataclass
class _Offloaded:
    worker: str
    onboard_started: float | None
    """When its onboarding was sent (monotonic clock): the first applied result reports the time to it."""
    pending: list[_Part] = field(default_factory=list)
    """Parts not sent yet (the expert has ``max_in_flight`` requests unanswered), oldest first."""
    in_flight: list[tuple[list[_Part], concurrent.futures.Future[Any]]] = field(default_factory=list)
    """(the parts of one request, future of the result blobs), oldest first."""
    lateness: float | None = None
    """Moving average of the steps its results arrive late (``LATENESS_WEIGHT`` on the newest)."""

    @property
    def parts_in_flight(self) -> int:
        return sum(len(batch) for batch, _ in self.in_flight)

    @property
    def held(self) -> int:
        """Raw sketches unanswered (in flight and queued): what a fall-back would apply."""
        return sum(len(part.raw) for batch, _ in self.in_flight for part in batch) + sum(
            len(part.raw) for part in self.pending)


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
        max_in_flight: requests unanswered per expert beyond which its sketches wait and go out together.
        max_parts: optimizer steps (parts) one expert may have waiting on its worker, in flight and queued; past
            it queued parts merge (<= ``MAX_SKETCH_PARTS``).
        max_rows: rows one part may hold (None: what fits half a request under hivemind's unary cap).
        max_held: unanswered steps (raw sketches, kept for a fall-back) past which the worker is dropped
            (None: 2 x max_parts); bounds the composer's memory whatever the worker does.
        retry_s: wait before onboarding an expert again after its onboarding failed (seconds).
    """

    def __init__(self, composer: Composer, client: OffloadClient, run_id: str,
                 workers: Callable[[], Mapping[str, float] | None], *, event: Event | None = None,
                 max_in_flight: int = 4, max_parts: int = 16, max_rows: int | None = None,
                 max_held: int | None = None, retry_s: float = 5.0) -> None:
        if not (max_in_flight >= 1 and 1 <= max_parts <= MAX_SKETCH_PARTS):
            raise ValueError(f"OffloadSession needs max_in_flight >= 1 and 1 <= max_parts <= {MAX_SKETCH_PARTS}")
        self.composer, self.client, self.run_id = composer, client, run_id
        self.workers, self.event = workers, event or (lambda kind, **fields: None)
        self.max_in_flight, self.max_parts, self.retry_s = max_in_flight, max_parts, retry_s
        self.max_rows = max_rows or row_budget(composer.cfg)
        self.max_held = max_held or 2 * max_parts
        self.offloaded: dict[ExpertId, _Offloaded] = {}
        self.onboarding: dict[ExpertId, tuple[str, concurrent.futures.Future[Any], float]] = {}
        self.banned: set[str] = set()
        self.applied = 0
        self.coalesced = 0
        """Steps' sketches that went out in a request with an older one, because their worker was behind."""
        self.merged = 0
        """Steps' sketches merged into an older one's part (the worker takes one optimizer step fewer)."""
        self.lateness: collections.Counter[int] = collections.Counter()
        """Steps from a request's newest sketch to the step its result was applied at -> results (in process,
        ``sim.offload_delay``; on the wire, the round trip in steps)."""
        self.fallbacks: list[tuple[ExpertId, str, str]] = []
        """(expert, worker, reason) of every drop."""
        self.waited_s = 0.0
        """Seconds the training thread spent waiting for answers (cfg.offload.wait_s)."""
        self._retry_at: dict[ExpertId, float] = {}

    def exchange(self) -> None:
        """One step's offload work (module docstring); call between forward_backward and optimizer_step."""
        c = self.composer
        raw = c.take_offload_sketches()
        live = self.workers()
        self._apply_finished(live, raw)
        off = c.cfg.offload
        for eid, sketch in raw.items():
            entry = self.offloaded.get(eid)
            if entry is None:
                continue
            if entry.held >= self.max_held:  # its worker is hopelessly behind: train the expert here again
                self.drop(eid, f"{entry.held} steps of sketches unanswered", extra=[sketch])
                continue
            wire = compress(sketch, sample_fraction=off.sample_fraction, generator=c.sketch_rng, wire_codec="raw")
            if wire.x_NL.shape[0] == 0:  # nothing sampled this step: a fall-back still applies its sketch
                newest = entry.pending or (entry.in_flight[-1][0] if entry.in_flight else [])
                if newest:
                    newest[-1].raw.append(sketch)
                continue
            entry.pending.append(_Part(c.step, self._fit(wire), [sketch]))
            self._merge(entry)
        for eid, entry in self.offloaded.items():
            self._send(eid, entry)
        if off.wait_s > 0:
            self._settle(off.wait_s)
        self._onboard(live)

    def _settle(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` seconds for every request in flight (this step's included), then apply what
        finished and drop the workers whose requests failed (still before the optimizer step)."""
        futures = [future for entry in self.offloaded.values() for _, future in entry.in_flight]
        if futures:
            started = time.monotonic()
            concurrent.futures.wait(futures, timeout=wait_s)
            self.waited_s += time.monotonic() - started
        self._apply_finished()

    def _apply_finished(self, live: Mapping[str, float] | None = None,
                        raw: dict[ExpertId, Sketch] | None = None) -> None:
        """Apply every finished result; drop the worker of an expert whose request failed, whose result was bad,
        or (given the ``live`` view) that left it: this step's ``raw`` sketch of the expert goes with the drop."""
        for eid, entry in list(self.offloaded.items()):
            reason = self._apply_done(eid, entry)
            if reason is None and live is not None and entry.worker not in live:
                reason = "worker left the live view"
            if reason is not None:
                self.drop(eid, reason, extra=[raw.pop(eid)] if raw and eid in raw else [])

    def _merge(self, entry: _Offloaded) -> None:
        """Keep the optimizer steps waiting on the worker for this expert (parts in flight and queued) at most
        ``max_parts``: merge the neighbouring queued pair that stands for the fewest steps (the oldest of
        equals) into their mean."""
        while len(entry.pending) >= 2 and entry.parts_in_flight + len(entry.pending) > self.max_parts:
            pending = entry.pending
            i = min(range(len(pending) - 1), key=lambda j: pending[j].steps + pending[j + 1].steps)
            a, b = pending[i], pending[i + 1]
            n = a.steps + b.steps
            mean = concat(Sketch(a.wire.x_NL, a.wire.g_NL * (a.steps / n), a.wire.tokens, a.wire.wire_bytes),
                          Sketch(b.wire.x_NL, b.wire.g_NL * (b.steps / n), b.wire.tokens, b.wire.wire_bytes))
            pending[i:i + 2] = [_Part(b.step, self._fit(mean), a.raw + b.raw, n)]
            self.merged += 1

    @property
    def mean_lateness(self) -> float | None:
        """Mean steps from sketch to applied result over the run so far (None before the first result)."""
        n = sum(self.lateness.values())
        return sum(k * v for k, v in self.lateness.items()) / n if n else None

    def _fit(self, wire: Sketch) -> Sketch:
        """``wire`` with at most ``max_rows`` rows (a uniform sample, g scaled by rows / kept)."""
        return subsample(wire, self.max_rows, self.composer.sketch_rng)

    def _send(self, eid: ExpertId, entry: _Offloaded) -> None:
        """Send what is queued for ``eid``, as few requests as the parts' count and rows allow, while its
        worker has fewer than ``max_in_flight`` of them unanswered."""
        off = self.composer.cfg.offload
        while (entry.pending and len(entry.in_flight) < self.max_in_flight
               and entry.parts_in_flight < self.max_parts):
            room, count, rows = self.max_parts - entry.parts_in_flight, 1, entry.pending[0].wire.x_NL.shape[0]
            while (count < min(room, len(entry.pending))
                   and rows + entry.pending[count].wire.x_NL.shape[0] <= self.max_rows):
                rows += entry.pending[count].wire.x_NL.shape[0]
                count += 1
            batch = entry.pending[:count]
            lookahead = None  # the worker's default, offload.lookahead
            if off.wait_s > 0 or (off.lookahead_measured and entry.lateness is not None):
                lookahead = min(MAX_LOOKAHEAD, round(entry.lateness or 0))  # waiting: on time until seen late
            # Built before the parts leave the queue: a refusal here loses nothing.
            message = sketch_message(eid, [(part.step, part.wire) for part in batch], off.wire_codec,
                                     lookahead=lookahead)
            entry.in_flight.append((batch, self.client.update(entry.worker, message)))
            del entry.pending[:count]
            self.coalesced += count - 1

    def _apply_done(self, eid: ExpertId, entry: _Offloaded) -> str | None:
        """Apply the finished results at the head of ``entry``'s queue; a reason to drop the worker, or None."""
        while entry.in_flight and entry.in_flight[0][1].done():
            batch, future = entry.in_flight[0]
            step = batch[-1].step
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
            late = self.composer.step - step
            self.lateness[late] += 1
            entry.lateness = late if entry.lateness is None else (
                (1 - LATENESS_WEIGHT) * entry.lateness + LATENESS_WEIGHT * late)
            if entry.onboard_started is not None:
                self.event("offload_first_update", step=self.composer.step, expert=list(eid), worker=entry.worker,
                           seconds=round(time.monotonic() - entry.onboard_started, 3))
                entry.onboard_started = None
        return None

    def drop(self, eid: ExpertId, reason: str, extra: list[Sketch] | None = None) -> None:
        """Take ``eid`` back from its worker: trained here again, unanswered sketches (and ``extra``) applied
        as local gradient for the coming optimizer step."""
        entry = self.offloaded.pop(eid)
        for _, future in entry.in_flight:
            future.cancel()
        parts = [part for batch, _ in entry.in_flight for part in batch] + entry.pending
        unanswered = [sketch for part in parts for sketch in part.raw] + list(extra or [])
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

    def metrics(self) -> dict[str, int | float | None]:
        """This session's counters as a node's per-step metrics fields."""
        client = self.client
        sent, received = client.bytes_sent, client.bytes_received
        return {"offload_applied": self.applied, "offloaded": len(self.offloaded),
                "offload_coalesced": self.coalesced, "offload_merged": self.merged,
                "offload_lateness": None if self.mean_lateness is None else round(self.mean_lateness, 3),
                "offload_waited_s": round(self.waited_s, 3),
                "offload_sketches": client.requests["rpc_update"], "offload_sketch_bytes": sent["rpc_update"],
                "offload_results": client.replies["rpc_update"], "offload_result_bytes": received["rpc_update"],
                "offload_onboards": client.requests["rpc_onboard"], "offload_onboard_bytes": sent["rpc_onboard"]}

    def release(self, eid: ExpertId) -> None:
        """The composer is handing ``eid`` over: stop offloading it (call before the hand-over)."""
        if eid in self.offloaded:
            self.drop(eid, "expert handed over")
        self.onboarding.pop(eid, None)

    def close(self) -> None:
        """Cancel every outstanding request (the composer is leaving; unanswered work is not needed)."""
        self.client.close()
        for entry in self.offloaded.values():
            for _, future in entry.in_flight:
                future.cancel()
        for _, future, _ in self.onboarding.values():
            future.cancel()
