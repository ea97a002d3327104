"""A started node's training loop, its one seam with the network, and its graceful leave (``runner.py`` wires it).

A step does no network I/O. Between two steps, and only there, ``seam`` applies the surrogate updates that
arrived, follows the live assignment (``Experts.reconcile``), applies finished outer rounds and starts due ones,
publishes surrogate refreshes and expert snapshots, and updates the heartbeat. It never waits on the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Literal

import torch

from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.membership import Membership, QuorumState
from parallax.node.config.peer import NodeConfig
from parallax.node.net.expert_exchange import ExpertExchange
from parallax.node.net.gossip import SurrogateGossip, SurrogateUpdate
from parallax.node.net.scores import PeerScores
from parallax.node.offload.session import OffloadSession
from parallax.node.outer.averager import RoundReport, RoundStatus, TieredOuterSync
from parallax.node.outer.background import BackgroundRounds, next_round_in
from parallax.node.outer.replicas import ReplicaRounds
from parallax.node.outer.wire import payload_bytes
from parallax.node.peer.experts import Experts
from parallax.node.peer.processes import lower_thread_priority
from parallax.node.peer.refits import RefitGate
from parallax.node.peer.telemetry import Telemetry
from parallax.node.peer.views import SwarmViews
from parallax.node.train.checkpoint import save_checkpoint, state_hash
from parallax.node.train.composer import Composer, schedule_position
from parallax.node.train.data import CorpusInfo
from parallax.node.train.outer import TierSchedule
from parallax.protocol.messages import MAX_SUSPECTS

logger = logging.getLogger(__name__)

TOKENS_WINDOW_S = 2.0
"""tokens/s is measured over windows of about this long."""


class Training:
    """The running node's loop (module docstring); every part it holds is started."""

    def __init__(self, config: NodeConfig, composer: Composer, dht: SwarmDHT, membership: Membership,
                 views: SwarmViews, gossip: SurrogateGossip, exchange: ExpertExchange, sync: TieredOuterSync,
                 rounds: BackgroundRounds, experts: Experts, gate: RefitGate, telemetry: Telemetry,
                 stop_event: threading.Event, *, offload: OffloadSession | None, scores: PeerScores | None = None,
                 val: list[tuple[torch.Tensor, torch.Tensor]], started: float,
                 outer_traffic: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 replicas: ReplicaRounds | None = None, data: CorpusInfo | None = None) -> None:
        self.config, self.composer, self.dht, self.membership, self.views = config, composer, dht, membership, views
        self.gossip, self.exchange, self.sync, self.rounds = gossip, exchange, sync, rounds
        self.experts, self.gate, self.telemetry, self.stop_event = experts, gate, telemetry, stop_event
        self.offload, self.val, self.started = offload, val, started
        self.outer_traffic = outer_traffic
        """() -> (bytes served, bytes fetched) of outer-round contributions and group states."""
        self.replicas = replicas
        """The outer rounds among the owners of replicated experts (``ownership.replicas`` > 1), on the backbone's
        cadence."""
        self.data = data
        """What this node trains on (its checkpoints name it)."""
        self.schedule = TierSchedule(config.train.sync.periods)
        self.scores = scores
        self._applied: set[tuple[int, int]] = set()  # experts whose surrogate came from an owner (not at init)
        self._frozen: set[tuple[int, int]] = set()  # experts whose owner sent a refused delta
        self.join_to_first_step_s: float | None = None
        self._refit_took = 0.0  # seconds of surrogate refits in the current seam
        self._past_schedule = False  # warned that the run's learning-rate schedule has ended
        self._rebase_due = False  # cut off and back: the shared groups take the others' state once its side holds

    # --- the loop ---

    def run(self) -> None:
        """Train until ``node.steps`` or a stop, the seam between every two steps."""
        composer, status, settings = self.composer, self.telemetry.status, self.config.node
        self.telemetry.phase("training")
        self.experts.shard_event()
        self.dht.forbidden_thread = threading.get_ident()  # counts any DHT call from this loop (none expected)
        lower_thread_priority(settings.train_nice)  # the DHT process and p2pd were forked at the node's priority
        trained, tokens_window, window_started = 0, 0, time.monotonic()
        # The training thread's time at the network seam, its only contact with the network; refits are
        # counted apart: distilling the surrogates is training compute that happens to be scheduled there.
        seam_s, seam_max_s, refit_s = 0.0, 0.0, 0.0
        while not self.stop_event.is_set() and (settings.steps is None or trained < settings.steps):
            began, self._refit_took = time.perf_counter(), 0.0
            self.seam()
            took = time.perf_counter() - began - self._refit_took
            seam_s, seam_max_s, refit_s = seam_s + took, max(seam_max_s, took), refit_s + self._refit_took
            if self.offload is None:
                stats = composer.train_step()
            else:  # the offload exchange must sit between backward and the optimizer step (offload/session.py)
                stats = composer.forward_backward()
                self.offload.exchange()
                composer.optimizer_step()
            trained += 1
            if self.join_to_first_step_s is None:
                self.join_to_first_step_s = time.monotonic() - self.started
                self.telemetry.event("first_step", seconds=round(self.join_to_first_step_s, 3))
            tokens_window += stats.tokens
            elapsed = time.monotonic() - window_started
            if elapsed >= TOKENS_WINDOW_S:
                status.tokens_per_s = tokens_window / elapsed
                tokens_window, window_started = 0, time.monotonic()
            status.step, status.trained, status.loss = composer.step, trained, stats.loss
            self.telemetry.step(step=composer.step, loss=round(stats.loss, 5), ce=round(stats.ce_loss, 5),
                                tokens=composer.tokens_seen,
                                **({} if self.offload is None else self.offload.metrics()))
            if settings.checkpoint_dir is not None and composer.step % settings.checkpoint_every == 0:
                self.checkpoint()
            every = self.config.train.eval_every
            if every and composer.step % every == 0:
                self.evaluate("eval")
        self.seam()  # apply what arrived during the last step before leaving
        self.dht.forbidden_thread = None
        self.telemetry.event("step_path", dht_calls=self.dht.forbidden_calls, steps=trained,
                             seam_s=round(seam_s, 4), seam_max_s=round(seam_max_s, 4), refit_s=round(refit_s, 4))

    def _apply_surrogate(self, update: SurrogateUpdate, eid: tuple[int, int], typical: Mapping[str, float]) -> None:
        """Apply one surrogate update unless ``SurrogateUpdate.verdict`` refuses it (past ``MAX_GROWTH``, or past
        ``LAYER_BOUND`` x ``typical``, the layer's held surrogates' norms): then its owner is named (and scored
        where the refusal is evidence), and the expert's later deltas skipped (they build on the refused one)
        until a full copy replaces the surrogate. An owner this node bans is not listened to in the same way."""
        model = self.composer.model
        held = {n: p.data for n, p in model.surrogate_parameters(*eid).items()}
        if update.is_full:
            self._frozen.discard(eid)
        elif eid in self._frozen:
            return
        owner = self.views.owner_peer(eid)
        if owner is not None and self.views.banned(owner):
            self._frozen.add(eid)  # ignored while banned; its later deltas would build on what was skipped
            return
        refusal = update.verdict(held, typical)
        if refusal is not None:
            self._frozen.add(eid)
            logger.warning("refused surrogate version %d of expert %s from its owner %s: it would %s; the previous "
                           "version is kept", update.version, eid, owner, refusal.why)
            self.telemetry.event("surrogate_refused", layer=eid[0], expert=eid[1], version=update.version,
                                 owner=owner, growth=round(refusal.growth, 3),
                                 layer_ratio=round(refusal.layer_ratio, 3), evidence=refusal.evidence is not None)
            if owner is not None and self.scores is not None and refusal.evidence is not None:
                self.scores.record(owner, refusal.evidence)
            return
        update.apply(held)
        self._applied.add(eid)
        if owner is not None:
            self.views.worked(owner)

    def seam(self) -> None:
        """The one place the training loop meets the network (module docstring). Never waits on it, but with
        ``node.lockstep`` for the rounds in flight and, at refresh steps, the surrogate updates due."""
        composer, rounds = self.composer, self.rounds
        owned_now = set(composer.owned_experts())
        typical: dict[int, dict[str, float]] = {}  # per layer, once a seam
        for update in self._surrogate_updates():
            eid = (update.layer, update.expert)
            if eid not in self.experts.led:  # a co-owner follows the lead's surrogate as any receiver does
                if eid[0] not in typical:  # only surrogates received from owners: a joiner's are still at init
                    received = [{n: p.data for n, p in composer.model.surrogate_parameters(eid[0], e).items()}
                                for e in range(self.config.train.model.n_experts)
                                if (eid[0], e) not in owned_now and (eid[0], e) in self._applied]
                    typical[eid[0]] = SurrogateUpdate.layer_norms(received) if len(received) >= 2 else {}
                self._apply_surrogate(update, eid, typical[eid[0]])
        was_cut_off = self.telemetry.status.cut_off
        self.experts.reconcile()
        if was_cut_off and not self.telemetry.status.cut_off:
            self._rebase_due = True  # once its side holds the majority (an even split keeps what each side trains)
        if self._rebase_due and not self.telemetry.status.cut_off:
            view = self.views.fresh()
            if view is not None and view.quorum is QuorumState.HELD:
                self._rebase_due = False
                rounds.rebase()  # what it trained of the shared groups alone goes, as its own experts' copies did
        if self.config.node.lockstep:
            rounds.settle(self.stop_event, self.config.net.outer.matchmaking_timeout_s)
        for report in rounds.collect():
            self._round_event(report)
            self.gate.round_done(report.group, report.status is RoundStatus.OK, composer.step)
        if self.replicas is not None:
            self._collect_replicas()
        step = composer.step
        if step > 0:
            self._outer_rounds(step)
            if step % self.config.train.surrogate.refresh_every == 0:
                self._publish_refresh()
            if step % self.config.node.snapshot_every == 0:
                self.experts.serve_snapshots()
                rounds.publish_live()
        unchained = self.exchange.unchained(composer.owned_experts())
        if unchained:  # an expert's first snapshot starts its heir's chain (before its first step: at the init)
            self.experts.serve_snapshots(experts=unchained)
        run_step = self.views.run_step()
        if run_step is not None and self.experts.lockstep is None:  # lockstep: each composer at its own point
            composer.follow_schedule(run_step)  # a composer slower than the others trains at their point
        versions = self.experts.surrogate_versions()
        suspects, banned = self.scores.suspects(MAX_SUSPECTS) if self.scores is not None else ({}, ())
        self.membership.update(step=step, loss=self.telemetry.status.loss, suspects=suspects, banned=banned,
                               versions={"max": max(versions.values(), default=0), "held": len(versions)})
        self._refresh_status()

    def _surrogate_updates(self) -> list[SurrogateUpdate]:
        """The surrogate updates to apply now: every one that arrived; in lockstep, those due at this step
        (``LockstepSurrogates``), after a wait, at a refresh step, for those the owners published one refresh
        before (bounded by ``net.outer.matchmaking_timeout_s``, as the rounds' wait)."""
        updates, lockstep = self.gossip.drain(), self.experts.lockstep
        if lockstep is None:
            return updates
        step = self.composer.step
        lockstep.add(updates, step)
        missing = lockstep.missing(step, lockstep.expect(step, self._followed))
        ends = time.monotonic() + self.config.net.outer.matchmaking_timeout_s
        while missing and not self.stop_event.is_set() and time.monotonic() < ends:
            self.stop_event.wait(0.05)
            lockstep.add(self.gossip.drain(), step)
            missing = lockstep.missing(step, missing)
        if missing and not self.stop_event.is_set():
            logger.info("lockstep: no surrogate update published at step %d arrived for %s; not waited for again "
                        "until one as recent does", step - lockstep.lag, sorted(missing))
            lockstep.late(missing, step)
        return lockstep.due(step)

    def _followed(self) -> dict[tuple[int, int], str]:
        """Expert -> its owner in the live assignment, where that is another node, not banned: the surrogates this
        node follows."""
        owned = set(self.composer.owned_experts())
        model = self.config.train.model
        out = {}
        for eid in ((layer, e) for layer in range(model.n_layers) for e in range(model.n_experts)):
            owner = self.views.owner_peer(eid) if eid not in owned else None
            if owner is not None and owner != self.dht.peer_id and not self.views.banned(owner):
                out[eid] = owner
        return out

    def _collect_replicas(self) -> None:
        """Apply the replicated experts' finished rounds and serve the merged experts' snapshots at once: an owner
        that joins one of them takes it with the anchor its other owners hold."""
        assert self.replicas is not None
        for report in self.replicas.collect():
            self._round_event(report)
            if report.status is RoundStatus.OK:
                self.experts.serve_snapshots(experts=self.replicas.last_applied)

    def _outer_rounds(self, step: int) -> None:
        """Start the outer rounds due at ``step``; alone, apply the outer step with our own pseudo-gradient."""
        composer, rounds = self.composer, self.rounds
        alone = self.views.composers() < 2
        for_good = alone and self.views.alone()  # not a view that lost the others (or this node) for a moment
        if self.replicas is not None and "backbone" in self.schedule.due(step):
            view = self.views.fresh()
            assignment = view.assignment() if view is not None else None
            if assignment is not None and self.experts.fingerprint in assignment.peers:
                self.replicas.submit(assignment, round_id=step // self.schedule.periods["backbone"])
        # The rounds due now, and those due once a waiting round they ended was over (it is now).
        due = {group: step // self.schedule.periods[group] for group in self.schedule.due(step)}
        for group, round_id in (rounds.owed() | due).items():
            if group not in composer.outer:
                continue
            if for_good and rounds.busy(group):
                rounds.end_waiting(group, round_id)  # nobody is left to merge with: merged among one once it ends
            elif for_good:
                # A merge among one: the outer step with our own delta. Alone for a moment, nothing is merged: the
                # delta goes into the next round.
                rounds.merge_alone(group, round_id=round_id)
                self.gate.merged_alone(group, step)
            elif not alone:
                rounds.submit(group, round_id=round_id)

    def _publish_refresh(self) -> None:
        """Distil the owned experts and publish the deltas, unless the refit gate is closed (refits.py)."""
        composer = self.composer
        if composer.recorder is None:
            return
        if not self.gate.open:
            self.telemetry.event("refit_deferred", step=composer.step, until=self.gate.waits_for)
            return
        began = time.perf_counter()
        published = composer.refresh_surrogates(sorted(self.experts.led))
        self._refit_took += time.perf_counter() - began
        for (layer, expert), factors in published.items():
            self.experts.publish(layer, expert, factors)
        self.telemetry.event("refit", step=composer.step, experts=len(published))

    def _round_event(self, report: RoundReport) -> None:
        # The others merged our contribution: they count us (``Progress``), and our probation ends.
        merged_ours = (report.status is RoundStatus.OK and self.dht.peer_id in report.participants
                       and len(report.participants) > 1 and not report.ours_left_out)
        if merged_ours and self.membership.shown_work():
            self.telemetry.event("probation_over", group=report.group, round_id=report.round_id)
        self.telemetry.event("round", group=report.group, status=report.status.value, round_id=report.round_id,
                             participants=len(report.participants), left_out=len(report.left_out),
                             behind=bool(report.apart_from) or report.ours_left_out,
                             allreduce_s=round(report.allreduce_s, 4),
                             waited_s=round(report.waited_s, 4), merge_s=round(report.merge_s, 4),
                             verify_s=round(report.verify_s, 4), total_s=round(report.total_s, 4),
                             bytes_est=self._round_bytes(report))
        if report.status is RoundStatus.OK and report.geometry is not None:
            self.telemetry.event("merge", group=report.group, round_id=report.round_id,
                                 senders=list(report.participants), **report.geometry)

    def _round_bytes(self, report: RoundReport) -> int:
        """Bytes this node sent in an all-reduce: a butterfly all-reduce sends (n-1)/n of the payload to the
        others and receives as much back."""
        n = len(report.participants)
        if n < 2 or not report.began_allreduce or report.group not in self.sync.groups:
            return 0  # replicated experts' rounds are gathered: their bytes are in outer_traffic's counters
        averager = self.sync.groups[report.group]
        return int(payload_bytes(averager.shapes, averager.config) * (n - 1) / n)

    # --- leaving ---

    def leave(self) -> None:
        """Rounds in flight end (bounded), final snapshots to the heirs, checkpoint, final eval, deathrattle."""
        composer, settings = self.composer, self.config.node
        self.telemetry.phase("leaving")
        started = time.monotonic()
        self.exchange.stop_pulling()  # what this node inherits is for whoever stays
        if self.views.composers() > 1:  # alone, a round in flight can only time out
            for report in self.rounds.wait(timeout_s=min(settings.leave_timeout_s, 20.0)):
                self._round_event(report)  # the last rounds count in the metrics too
            if self.replicas is not None:
                for report in self.replicas.wait(timeout_s=min(settings.leave_timeout_s, 20.0)):
                    self._round_event(report)
        self.experts.serve_snapshots(final=True)
        self.rounds.publish_live()
        self.experts.push_final_snapshots(deadline=started + settings.leave_timeout_s)
        if settings.checkpoint_dir is not None:
            self.checkpoint()
        if settings.final_eval:
            self.evaluate("final_eval")
        rattle = self.membership.leave("leaving after training" if not self.stop_event.is_set()
                                       else "stopped by the user")
        self._refresh_status()  # the rounds and snapshots of the leave count too
        self.telemetry.event("left", step=composer.step, seconds=round(time.monotonic() - started, 3),
                             deathrattle=rattle, dht_by_kind=self.dht.calls.kinds(),
                             **self.telemetry.counters())

    def evaluate(self, kind: Literal["eval", "final_eval"]) -> None:
        """This node's own view on the validation windows: the status's val loss and a metrics event ``kind``
        ("eval" every ``train.eval_every`` steps, "final_eval" when leaving)."""
        composer = self.composer
        self.telemetry.status.val_loss = val_loss = composer.evaluate(self.val)
        self.telemetry.event(kind, step=composer.step, val_loss=round(val_loss, 5), tokens=composer.tokens_seen)

    def checkpoint(self) -> None:
        settings = self.config.node
        assert settings.checkpoint_dir is not None
        path = save_checkpoint(settings.checkpoint_dir, self.composer, run_id=self.config.peer.run_id,
                               keep_last=settings.keep_checkpoints,
                               versions=self.experts.surrogate_versions(), data=self.data,
                               workers=self.membership.workers())
        self.telemetry.event("checkpoint", step=self.composer.step, path=str(path),
                             state_hash=state_hash(self.composer))

    # --- status ---

    def _refresh_status(self) -> None:
        s = self.telemetry.status
        view = self.membership.view()
        s.live_peers = self.views.composers()  # joiners in probation too
        s.without_work = self.membership.without_work
        s.view_age_s = max(0.0, dht_time() - view.read_at)
        s.owned = sum(len(es) for es in self.composer.owned)
        versions = self.experts.surrogate_versions()
        s.surrogates_held = len(versions)
        s.surrogate_version_max = max(versions.values(), default=0)
        st = self.gossip.stats
        snap_in, snap_out = self.exchange.bytes_fetched, self.exchange.servicer.bytes_served
        outer_out, outer_in = self.outer_traffic()
        client = self.offload.client if self.offload is not None else None
        off_out = sum(client.bytes_sent.values()) if client is not None else 0
        off_in = sum(client.bytes_received.values()) if client is not None else 0
        s.bytes_received = st.bytes_fetched + snap_in + outer_in + off_in
        s.bytes_sent = st.bytes_served + snap_out + outer_out + off_out
        s.gossip_bytes = st.bytes_fetched + st.bytes_served
        s.heir_copies = [list(eid) for eid in sorted(self.exchange.heir_copies())]
        s.snapshot_bytes = self.exchange.chain_bytes_fetched + self.exchange.servicer.chain_bytes_served
        s.handover_bytes = snap_in + snap_out - s.snapshot_bytes
        s.outer_bytes = outer_in + outer_out
        s.offload_bytes = off_in + off_out
        calls = self.dht.calls
        s.dht_requests, s.dht_bytes = calls.stores + calls.reads, calls.bytes_stored + calls.bytes_read
        s.rounds_ok = dict(self.rounds.rounds_ok)
        if self.replicas is not None:
            s.rounds_ok["experts"] = self.replicas.counts.applied
        s.owned_experts = [list(eid) for eid in sorted(self.composer.owned_experts())]
        s.surrogate_versions = {f"{layer}.{expert}": v for (layer, expert), v in sorted(versions.items())}
        s.workers = sorted(self.views.live_workers() or {}) if self.offload is not None else []
        s.next_round = next_round_in(dict(self.schedule.periods), self.composer.step)
        optim, steps, position = self.config.train.optim, self.config.train.steps, self.composer.schedule_step
        s.schedule = schedule_position(position, steps, optim.min_lr_ratio)
        left = steps - position if self.config.node.steps is None else self.config.node.steps - s.trained
        pace = s.tokens_per_s / self.config.train.tokens_per_step  # steps per second
        s.time_left_s = left / pace if pace > 0 and left > 0 else None
        if position >= steps and not self._past_schedule:
            self._past_schedule = True
            logger.warning("the run's learning-rate schedule ended at step %d (its steps setting, in its manifest): "
                           "this node trains on at the minimum learning rate, %.0f%% of the peak. A longer run is a "
                           "new run with a larger steps setting (parallax run create --set steps=N)", steps,
                           100 * optim.min_lr_ratio)
            self.telemetry.event("schedule_ended", step=self.composer.step, schedule_step=position, steps=steps)
        self.telemetry.publish()


__all__ = ["Training"]
