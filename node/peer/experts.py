"""A node's owned experts moving in and out: hand-overs, releases, snapshots for heirs, surrogate publication.

The live assignment (``Membership.owned``) decides what this node trains. ``reconcile`` runs at every seam:
an expert it lost is released (its final snapshot served for the peer taking it over, its surrogate back to
what every receiver holds); an expert it gained is taken over through a ``Handover`` (``handover.py``) and
adopted from the snapshot that wins, or from this node's heir copy, or from the seeded initialisation (logged).
The new owner then publishes the surrogate as a full copy at a version that makes every receiver catch up.

With ``ownership.replicas`` = R > 1 an expert has R owners, all training it. Only the first by rank, its lead
(``led``), publishes its surrogate; the others apply the lead's updates to their copy of the surrogate like any
receiver, so that whichever of them leads next continues from what receivers hold. An owner that gains an
expert while another owner keeps it takes it over from that live replica: its first snapshot (weights, AdamW
state, outer anchor and momentum) ends the hand-over, and the replica it came from never stopped training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from parallax.dht.keys import ExpertId
from parallax.dht.membership import Membership
from parallax.dht.shards import Assignment
from parallax.node.config.peer import NodeSettings
from parallax.node.net.expert_exchange import SURROGATE_PREFIX, SURROGATE_VERSION, ExpertExchange, Snapshot
from parallax.node.net.gossip import SurrogateGossip
from parallax.node.offload.session import OffloadSession
from parallax.node.peer.handover import STALL_S, Ask, Finish, Handover, Served
from parallax.node.peer.lockstep import LockstepSurrogates
from parallax.node.peer.ownership import Side, leads, owners_of, plan_ownership, previous_owner
from parallax.node.peer.telemetry import Telemetry
from parallax.node.peer.views import LEAVING, SwarmViews
from parallax.node.train.composer import ADAM_PREFIX, BadOptimizerState, Composer

logger = logging.getLogger(__name__)


@dataclass
class Taking:
    """One expert being taken over: its hand-over, the requests in flight by peer, and why each peer that answered
    served no snapshot (what the log says of a hand-over that ends without one)."""

    handover: Handover
    asked: dict[str, Future[Snapshot | str]] = field(default_factory=dict)
    unserved: dict[str, str] = field(default_factory=dict)


class Experts:
    """The experts of one running node (module docstring). Called from the training loop's thread only.

    Args:
        composer, gossip, exchange, membership, views, telemetry: the node's running parts.
        settings: the node's own settings (adoption wait, hand-over window, snapshot period).
        fingerprint: this node's identity fingerprint.
        online_at: when this node's first heartbeat was stored (monotonic clock).
        owners: expert -> its owners' fingerprints as the node last saw them (the previous owners of a joiner's
            experts), best rank first.
        offload: the offload session, when this node offloads.
        clock: the monotonic clock (injected in tests).
    """

    def __init__(self, composer: Composer, gossip: SurrogateGossip, exchange: ExpertExchange, membership: Membership,
                 views: SwarmViews, telemetry: Telemetry, settings: NodeSettings, *, fingerprint: str,
                 online_at: float, owners: dict[ExpertId, tuple[str, ...]], offload: OffloadSession | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.composer, self.gossip, self.exchange, self.membership = composer, gossip, exchange, membership
        self.views, self.telemetry, self.settings = views, telemetry, settings
        self.fingerprint, self.online_at, self.owners, self.offload = fingerprint, online_at, owners, offload
        self.clock = clock
        self.handovers: dict[ExpertId, Taking] = {}
        self._adopted: set[ExpertId] = set()  # taken over since start: the next publication jumps versions
        self.led: set[ExpertId] = {eid for eid in composer.owned_experts() if not composer.replica_outers
                                   or owners.get(eid, (fingerprint,))[0] == fingerprint}
        """The owned experts whose surrogate this node publishes (all of them with one owner per expert)."""
        self._assignment: Assignment | None = None  # as of the last reconcile
        self._resyncs: dict[ExpertId, Future[Snapshot | str]] = {}  # lead copies asked for (``resync``)
        self.lockstep = LockstepSurrogates(composer.cfg.surrogate.refresh_every) if settings.lockstep else None
        """With ``node.lockstep``: the surrogate updates drained from gossip and held until due (``Training`` applies
        them); a snapshot's surrogate passes those it holds already."""

    # --- ownership changes ---

    def reconcile(self) -> None:
        """Follow the live assignment: release what we lost, take over what we gained, progress hand-overs."""
        self._hold(not self.membership.confirmed())
        view = self.views.fresh()
        # As of the read, like its quorum: a view aging while the next read is slow (a peer that stopped
        # answering) loses members one expiry at a time, and each would move experts.
        assignment = view.assignment() if view is not None else None
        if view is None or assignment is None or self.fingerprint not in assignment.peers:
            return  # no fresh view that has us in it (a transient DHT miss): change nothing
        self._assignment = assignment
        self._finish_resyncs()
        current = set(self.composer.owned_experts())
        plan = plan_ownership(assignment, self.fingerprint, view.quorum, current, set(self.handovers))
        cut_off = plan.side is Side.CUT_OFF
        if cut_off != self.telemetry.status.cut_off:
            self.telemetry.status.cut_off = cut_off
            self.telemetry.event("cut_off" if cut_off else "rejoined", step=self.composer.step,
                                 peers=len(view.alive()))
            away = None if cut_off else view.assignment(leaving_out=self.fingerprint)
            if away is not None:
                # The others trained our experts while we were away: their final snapshots are the ones to wait
                # for, not our own copies from before the partition.
                self.owners = owners_of(away)
        if plan.side is Side.DOUBT:
            return
        for eid in plan.release:
            self.release(eid)
        for eid in plan.forget:
            del self.handovers[eid]  # cut off, or it moved on before we took it
        if cut_off:
            # The other side takes our experts; we take none of theirs, and keep the owners we knew for the
            # hand-overs back.
            if current:
                self.shard_event()
            return
        now = self.clock()
        alive = view.alive()
        composers = [m.heartbeat.peer_id for fp, m in sorted(alive.items())
                     if m.heartbeat.role == "composer" and fp != self.fingerprint and fp not in view.stalled]
        for eid in plan.take:
            previous, live = previous_owner(eid, assignment, self.owners.get(eid, ()), self.fingerprint, alive,
                                            view.stalled)
            # Under churn the previous owner in our view may not be the node that trained the expert last:
            # after it, every other live composer that shows work is asked (a releaser serves its final snapshot
            # for minutes), those later views show included (``Handover.meet``).
            handover = Handover(
                source=alive[previous].heartbeat.peer_id if previous is not None else None,
                others=list(composers),
                started=now, online_since=self.online_at - self.membership.timing.heartbeat_ttl_s,
                # A previous owner sees the new assignment at its next read: both bounds stretch with the pace.
                wait_s=self.settings.adopt_wait_s * self.membership.stretch,
                handover_window_s=self.settings.handover_window_s * self.membership.stretch,
                has_own_copy=self.exchange.inherits_copy(eid), live_source=live,
                stall_s=STALL_S * self.membership.stretch)
            self.handovers[eid] = Taking(handover)
            self._carry_out(eid, handover.start())
        for eid in list(self.handovers):
            taking = self.handovers[eid]
            taking.handover.meet(composers)
            for peer, future in [(p, f) for p, f in taking.asked.items() if f.done()]:
                del taking.asked[peer]
                answer = _answer(future)
                if isinstance(answer, str):
                    taking.unserved[peer] = answer
                self._carry_out(eid, taking.handover.answered(None if isinstance(answer, str) else answer,
                                                              self.clock(), peer=peer))
                if eid not in self.handovers:
                    break
            else:
                self._carry_out(eid, taking.handover.tick(self.clock()))
        self.owners = owners_of(assignment)
        owned = set(self.composer.owned_experts())
        lead = leads(assignment, self.fingerprint, owned)
        for eid in sorted(lead - self.led):
            self._take_lead(eid)
        for eid in sorted((self.led & owned) - lead):  # still an owner, no longer the one that publishes
            self.led.discard(eid)
            self.gossip.disown(*eid)
        if owned != current:
            self.shard_event()

    def _take_lead(self, eid: ExpertId) -> None:
        """Publish the surrogate of an expert this node trains already (a co-owner whose lead left): from the
        surrogate receivers hold, which it applied like them, as a full copy past the versions it may have missed."""
        self.composer.reset_publisher(eid)
        self._adopted.add(eid)
        self.led.add(eid)
        self.publish(eid[0], eid[1], self.composer.publishers[eid].delta(
            {n: p.data for n, p in self.composer.model.surrogate_parameters(*eid).items()}))
        self.telemetry.event("lead", layer=eid[0], expert=eid[1], step=self.composer.step)

    def _carry_out(self, eid: ExpertId, actions: list[Ask | Finish]) -> None:
        for action in actions:
            if isinstance(action, Ask):
                self.handovers[eid].asked[action.peer] = self.exchange.fetch(action.peer, eid)
            else:
                taking = self.handovers.pop(eid)
                best = action.best
                assert best is None or isinstance(best, Snapshot)
                for peer, future in taking.asked.items():  # requests the hand-over did not hear the answer of
                    answer = _answer(future) if future.done() else "no answer by the end of the wait"
                    if isinstance(answer, str):
                        taking.unserved[peer] = answer
                    elif best is None or answer.taken_at > best.taken_at:  # it came with another that ended the wait
                        best = answer
                self._finish(eid, best, taking.unserved)

    def _finish(self, eid: ExpertId, best: Served | None, unserved: dict[str, str]) -> None:
        assert best is None or isinstance(best, Snapshot)
        local = self.exchange.take_local_copy(eid)
        why = "; ".join(f"{peer}: {reason}" for peer, reason in sorted(unserved.items())) if best is None else ""
        if why and local is not None:
            logger.warning("expert %s: no live peer served a snapshot of it within the adoption wait (%s); it resumes "
                           "from its %s of step %d", eid, why, local[1], local[0].step)
        if best is not None and local is not None and local[0].taken_at > best.taken_at:
            best = None  # our own copy was taken after anything a live peer served (steps are per node)
        if best is not None:
            self.adopt(eid, best, source="previous owner")
        else:
            self.adopt(eid, local[0] if local else None, source=local[1] if local else "init", why=why)

    def _hold(self, paused: bool) -> None:
        """Pause the owned experts' training while nothing confirms this node's side holds half of the swarm
        (``Membership.confirmed``: a read, or answers from half of it), and resume it once something does."""
        composer = self.composer
        if paused == composer.paused:
            return
        composer.pause(paused)
        held = len(list(composer.owned_experts()))
        if paused:
            logger.warning("neither a DHT read nor answers from half of the swarm show this node's side holding half "
                           "of it any longer: it holds its %d experts without training them until one does (cut off, "
                           "the others train them; its reads and stores slow, it trains them again)", held)
        else:
            logger.info("a DHT read or answers from half of the swarm show this node's side holding half of it again: "
                        "it trains its %d experts again", held)
        self.telemetry.status.paused = paused
        self.telemetry.event("paused" if paused else "resumed", step=composer.step, experts=held)
        self.shard_event()

    def shard_event(self) -> None:
        """The experts this node owns now, and whether it holds them without training them (``_hold``)."""
        self.telemetry.event("shard", step=self.composer.step,
                             experts=[list(eid) for eid in self.composer.owned_experts()], paused=self.composer.paused)

    def adopt(self, eid: ExpertId, snapshot: Snapshot | None, *, source: str, why: str = "") -> None:
        """Train ``eid`` from ``snapshot`` (None: from the initialisation); a snapshot the composer refuses is
        logged with its source and the expert restarts from the initialisation instead. ``why``: what each peer asked
        answered, for the log of a restart from the initialisation."""
        composer = self.composer
        if snapshot is not None and not self._adopt_snapshot(eid, snapshot, source):
            snapshot = None
        if snapshot is None:
            logger.warning("expert %s: no live peer served a usable snapshot of it within the adoption wait%s; "
                           "restarting it from init", eid, f" ({why})" if why else "")
            source = "init"
            composer.adopt_expert(eid, None)
        self.telemetry.status.adoptions += 1
        taken = snapshot.taken_at if snapshot is not None and snapshot.taken_at > 0 else None
        self.telemetry.event("adopted", layer=eid[0], expert=eid[1], source=source,
                             snapshot_step=snapshot.step if snapshot else None,
                             snapshot_age_s=None if taken is None else round(time.monotonic() - taken, 3),
                             surrogate_version=self.surrogate_versions().get(eid, 0))
        if self._assignment is not None and self._assignment.owner(*eid) != self.fingerprint:
            return  # a co-owner: the lead publishes the surrogate; this node follows its updates
        # Publish at once: every receiver switches to this node's copy of the surrogate (a full copy at a
        # version past anything the previous owner may have published).
        self._adopted.add(eid)
        self.led.add(eid)
        self.publish(eid[0], eid[1], composer.publishers[eid].delta(
            {n: p.data for n, p in composer.model.surrogate_parameters(*eid).items()}))

    def _adopt_snapshot(self, eid: ExpertId, snapshot: Snapshot, source: str) -> bool:
        composer = self.composer
        expert = {k: v for k, v in snapshot.tensors.items() if not k.startswith(SURROGATE_PREFIX)}
        surrogate = {k[len(SURROGATE_PREFIX):]: v for k, v in snapshot.tensors.items()
                     if k.startswith(SURROGATE_PREFIX) and k != SURROGATE_VERSION}
        try:
            try:
                composer.adopt_expert(eid, expert)
            except BadOptimizerState as e:  # usable weights: keep them, start AdamW afresh
                logger.warning("expert %s: the %s's snapshot has an unusable AdamW state (%s); adopting its "
                               "weights with a fresh optimizer state", eid, source, e)
                composer.adopt_expert(eid, {k: v for k, v in expert.items() if not k.startswith(ADAM_PREFIX)})
        except ValueError as e:  # a peer's snapshot the composer refuses: never raised into the loop
            logger.warning("expert %s: refused the snapshot from the %s (%s); trying without it", eid, source, e)
            return False
        if surrogate:
            with torch.no_grad():
                for n, p in composer.model.surrogate_parameters(*eid).items():
                    p.copy_(surrogate[n])
            composer.reset_publisher(eid)
            version = int(snapshot.tensors[SURROGATE_VERSION])
            self.gossip.hold(eid, version)
            if self.lockstep is not None:
                self.lockstep.replaced(eid, version)
        return True

    def release(self, eid: ExpertId) -> None:
        """Stop training ``eid``: serve its final snapshot, and fall back to the surrogate receivers hold."""
        composer = self.composer
        if self.offload is not None:  # trained here again before its snapshot (unanswered sketches are dropped)
            self.offload.release(eid)
        # A co-owner's surrogate is already what receivers hold: it applied the lead's updates like them.
        mirror = composer.publishers[eid].full() if eid in composer.publishers and eid in self.led else None
        snapshot = self.snapshot(eid)
        composer.release_expert(eid)
        self.exchange.put(eid, composer.step, snapshot, final=True)
        self.gossip.disown(*eid)
        self.led.discard(eid)
        if mirror is not None:  # back to the surrogate every receiver holds
            with torch.no_grad():
                for n, p in composer.model.surrogate_parameters(*eid).items():
                    p.copy_(mirror[n])
        self.telemetry.status.releases += 1
        self.telemetry.event("released", layer=eid[0], expert=eid[1], step=composer.step)

    # --- snapshots and publication ---

    def snapshot(self, eid: ExpertId) -> dict[str, torch.Tensor]:
        """An owned expert's snapshot: weights + AdamW state, and the surrogate every receiver holds with its
        version, so whoever takes the expert over continues the surrogate's versions from the same base."""
        tensors = self.composer.expert_snapshot(eid)
        held = (self.composer.publishers[eid].full() if eid in self.led else
                {n: p.detach().clone() for n, p in self.composer.model.surrogate_parameters(*eid).items()})
        for name, t in held.items():
            tensors[f"{SURROGATE_PREFIX}{name}"] = t
        tensors[SURROGATE_VERSION] = torch.tensor(float(self.surrogate_versions().get(eid, 0)))
        return tensors

    def serve_snapshots(self, *, final: bool = False, experts: Iterable[ExpertId] | None = None) -> None:
        """Serve a snapshot of every owned expert (or of those of ``experts`` owned) at the current step (for heirs,
        for an owner that joins a replicated expert, or final when leaving)."""
        owned = set(self.composer.owned_experts())
        for eid in sorted(owned if experts is None else owned & set(experts)):
            self.exchange.put(eid, self.composer.step, self.snapshot(eid), final=final)

    def resync(self, eid: ExpertId, lead: str) -> None:
        """Ask for the lead's copy of an expert this node co-owns (after an outer round of its owners this node may
        have left half-applied); it replaces this node's copy at a later seam (``reconcile``). Until then, and if
        the lead serves none, this node trains its own copy on."""
        member = self.membership.view().alive().get(lead)
        if eid not in set(self.composer.owned_experts()) or member is None or eid in self._resyncs:
            return
        logger.warning("expert %s: its owners' last outer round may have left their copies apart; asking its lead %s "
                       "for its copy", eid, member.heartbeat.peer_id)
        self._resyncs[eid] = self.exchange.fetch(member.heartbeat.peer_id, eid)

    def _finish_resyncs(self) -> None:
        """Take every lead's copy that arrived (weights, AdamW state, outer anchor and momentum, surrogate); a copy
        that did not come or that the composer refuses leaves this node's own in place."""
        owned = set(self.composer.owned_experts())
        for eid, future in list(self._resyncs.items()):
            if not future.done():
                continue
            del self._resyncs[eid]
            snapshot = _answer(future)
            if isinstance(snapshot, str) or eid not in owned:
                logger.info("expert %s: no copy from its lead (%s); this node trains its own on", eid,
                            snapshot if isinstance(snapshot, str) else "it no longer co-owns it")
                continue
            own = self.composer.release_expert(eid)
            if not self._adopt_snapshot(eid, snapshot, "lead"):
                self.composer.adopt_expert(eid, own)
                continue
            self.telemetry.event("resync", layer=eid[0], expert=eid[1], snapshot_step=snapshot.step,
                                 step=self.composer.step)

    def surrogate_versions(self) -> dict[ExpertId, int]:
        """The version of each followed surrogate as this node's model holds it (in lockstep, updates held back are
        not in it yet): what checkpoints, snapshots and heartbeats name."""
        versions = self.gossip.versions()
        return versions if self.lockstep is None else self.lockstep.applied(versions)

    def publish(self, layer: int, expert: int, factors: Any) -> None:
        """Publish a surrogate change of an owned expert (the first after a take-over jumps versions)."""
        eid = (layer, expert)
        version = self.gossip.next_version(layer, expert, adopted=eid in self._adopted)
        self.gossip.publish(layer, expert, version, factors, full=self.composer.publishers[eid].full(),
                            step=self.composer.step)
        self._adopted.discard(eid)

    def push_final_snapshots(self, deadline: float) -> None:
        """Hand our experts' final state to their heirs before the deathrattle.

        Heirs pull the owner's snapshot whenever its heartbeat shows a newer step; we announce our last
        step and wait (bounded) until each owned expert's snapshot at that step was served to its heir. The heirs
        are read from the view at every check: one that leaves meanwhile (a swarm stopped together) is waited for
        no longer."""
        experts = list(self.composer.owned_experts())
        if not self.views.heirs_of(experts):
            return
        versions = self.surrogate_versions()
        self.membership.update(step=self.composer.step, versions={"max": max(versions.values(), default=0),
                                                                   "held": len(versions), LEAVING: 1})
        while self.clock() < deadline:
            served = self.exchange.servicer.served_steps
            if all(served.get(eid, -1) >= self.composer.step for eid in self.views.heirs_of(experts)):
                return
            time.sleep(0.2)
        logger.info("leaving before every heir pulled its final snapshot (heirs keep their last periodic copy)")


def _answer(future: Future[Snapshot | str]) -> Snapshot | str:
    """A finished snapshot request's answer: the snapshot, or why none came (a request that was cancelled or raised
    included)."""
    if future.cancelled():
        return "the request was cancelled"
    error = future.exception()
    return f"the request raised {error!r}"[:200] if error is not None else future.result()
