"""Outer rounds among the owners of replicated experts (``ownership.replicas`` = R > 1), off the step path.

Every expert has R owners, each training it on its own tokens. The experts one set of owners shares form a
*bundle* (``bundles``); on the backbone's cadence each bundle is merged in one outer round among its owners,
through the experts' own outer optimizers (``Composer(replica_outers=True)``) stepped as one (``OuterBundle``):
the DiLoCo merge of the shared groups, among R peers instead of all.

The rounds are gathered rounds (``GroupAverager`` with ``aggregation = "gather"``, whatever the run's shared
groups use): bundles come and go with the assignment, and a gathered round starts no process. Its participants
are the bundle's live owners (``RoundPeers``); the same robust merge and majority verification as the shared
groups' apply, over them. A round's DHT key is named after the bundle's first expert (``keys.replica_group``),
so every key a round can use is known in advance and protected by every node's record validator. Owners whose
views disagree for a moment may name the same key for other experts: such a contribution carries other tensors,
is left out of the round, and counts against nobody.

An expert with no other owner in the current assignment (fewer composers than R) takes the outer step with its
own pseudo-gradient on the same cadence, as a lone node does with the shared groups, so that its anchor never
lags: an owner that joins later starts from an anchor both hold.

A round that failed applies nothing: the pseudo-gradient goes into the next one. A round others may have applied
but this node did not (``RoundReport.needs_reload``) leaves the owners' copies apart: the owners that are not the
expert's lead then take the lead's copy (``Experts.resync``), as the expert's state and its outer state are in
every snapshot.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from parallax.dht.adapter import SwarmDHT
from parallax.dht.keys import ExpertId, replica_group
from parallax.dht.shards import Assignment, expert_bundles
from parallax.node.net.scores import PeerScores
from parallax.node.outer.averager import GroupAverager, RoundReport, RoundResult
from parallax.node.outer.records import RoundStatus
from parallax.node.outer.transport import OuterGather, RoundPeers, error_feedback, keep_unsent
from parallax.node.outer.wire import FingerprintSigner, OuterSyncConfig
from parallax.node.train.composer import Composer, expert_group
from parallax.node.train.outer import OuterBundle, to_send

logger = logging.getLogger(__name__)

Owners = tuple[str, ...]
"""A set of owners, as sorted identity fingerprints."""


def bundles(assignment: Assignment, me: str) -> dict[Owners, tuple[ExpertId, ...]]:
    """The experts ``me`` owns with others, by their set of owners (sorted fingerprints), each in model order."""
    return expert_bundles({(layer, e): assignment.owners_of(layer, e)
                           for layer, experts in assignment.owned_by(me).items() for e in experts})


@dataclass
class _InFlight:
    owners: Owners
    experts: tuple[ExpertId, ...]
    bundle: OuterBundle
    submitted: dict[str, torch.Tensor]
    pending: dict[str, torch.Tensor]  # what the round sends (``train.outer.to_send``)
    tokens: int
    future: concurrent.futures.Future[RoundResult]


@dataclass
class ReplicaCounts:
    submitted: int = 0
    applied: int = 0
    failed: int = 0
    alone: int = 0
    resyncs: int = 0


class ReplicaRounds:
    """The replicated experts' outer rounds of one node (module docstring). ``submit`` and ``collect`` run on the
    training thread; the rounds run in worker threads.

    Args:
        dht: this node's DHT.
        run_id: the run.
        composer: the node's composer (built with ``replica_outers=True``).
        config: the run's outer-sync settings; the rounds are gathered whatever its ``aggregation``.
        me: this node's identity fingerprint.
        peers_of: fingerprints -> the libp2p peer ids of those alive and of those of them that show work.
        signer, gather, scores, worked: as for the shared groups' gathered rounds (``GroupAverager``).
        weight_cap: the most tokens one owner can have trained an expert on in a backbone period.
        resync: (expert, the lead's fingerprint) -> take the lead's copy of an owned expert, after a round
            this node may have left half-applied among the owners.
    """

    def __init__(self, dht: SwarmDHT, run_id: str, composer: Composer, config: OuterSyncConfig, *, me: str,
                 peers_of: Callable[[Owners], tuple[list[str], list[str]]], signer: FingerprintSigner | None,
                 gather: OuterGather, scores: PeerScores | None, worked: Callable[[str], None] | None,
                 weight_cap: float | None, resync: Callable[[ExpertId, str], None]) -> None:
        self.dht, self.run_id, self.composer, self.me = dht, run_id, composer, me
        self.config = dataclasses.replace(config, sync=dataclasses.replace(config.sync, aggregation="gather"))
        self.peers_of, self.signer, self.gather, self.scores = peers_of, signer, gather, scores
        self.worked, self.weight_cap, self.resync = worked, weight_cap, resync
        self.counts = ReplicaCounts()
        self._averagers: dict[tuple[str, tuple[ExpertId, ...]], GroupAverager] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="parallax-replicas")
        self._leads: dict[ExpertId, str] = {}
        self.last_applied: list[ExpertId] = []
        """The experts of the rounds the last ``collect`` applied."""

    # --- training thread ---

    def submit(self, assignment: Assignment, round_id: int) -> int:
        """Start the round of every bundle this node shares in ``assignment`` (those whose experts it all holds
        and whose previous round has ended); step alone the replicated experts nobody else owns now. Returns
        the rounds started."""
        held = set(self.composer.replicated_experts())
        found = bundles(assignment, self.me)
        shared = {eid for experts in found.values() for eid in experts}
        for eid in sorted(held - shared):  # no other owner now: a merge among one, as a lone node's
            group = expert_group(eid)
            self.composer.outer[group].step_alone()
            self.composer.tokens_since_merge[group] = 0
            self.counts.alone += 1
        self._leads = {eid: assignment.owner(*eid) for experts in found.values() for eid in experts}
        started = 0
        for owners, experts in found.items():
            group = replica_group(experts[0])
            if group in self._in_flight or not set(experts) <= held:
                continue  # still merging, or an expert not taken over yet: this bundle's owners go on without us
            bundle = OuterBundle([self.composer.outer[expert_group(eid)] for eid in experts])
            delta, submitted = to_send(bundle, error_feedback(self.config.compression)), bundle.live_copy()
            tokens = min(self.composer.tokens_since_merge[expert_group(eid)] for eid in experts)
            for eid in experts:
                self.composer.tokens_since_merge[expert_group(eid)] = 0
            averager = self._averager(group, owners, experts)
            future = self._pool.submit(averager.round, delta, tokens, round_id)
            self._in_flight[group] = _InFlight(owners, experts, bundle, submitted, delta, tokens, future)
            self.counts.submitted += 1
            started += 1
        self._forget(found)
        return started

    def collect(self) -> list[RoundReport]:
        """Apply every finished round (never blocks); returns their reports."""
        done = []
        self.last_applied = []
        for group in [g for g, f in self._in_flight.items() if f.future.done()]:
            flight = self._in_flight.pop(group)
            try:
                merged, report, sent, _ = flight.future.result()  # replicated experts' rounds audit nothing
            except Exception as e:  # a bug: count it, skip the round, keep training
                logger.warning("replica round %s raised %r; skipped", group, e)
                merged, report, sent, _ = RoundResult(None, RoundReport(group, RoundStatus.FAILED, detail=repr(e)),
                                                      None)
            held = set(self.composer.replicated_experts())
            # The optimizers the round was taken from, still the composer's (not released or taken over since).
            same = all(self.composer.outer.get(expert_group(eid)) is part
                       for eid, part in zip(flight.experts, flight.bundle.parts, strict=True))
            if merged is not None and same:
                keep_unsent(flight.bundle, flight.pending, sent, self.config.compression)
                flight.bundle.step_late(merged, flight.submitted)
                self.counts.applied += 1
                self.last_applied += flight.experts
                done.append(report)
                continue
            self.counts.failed += 1
            if merged is None and report.needs_reload:  # others may have applied it: take the lead's copy
                for eid in flight.experts:
                    lead = self._leads.get(eid)
                    if eid in held and lead is not None and lead != self.me:
                        self.counts.resyncs += 1
                        self.resync(eid, lead)
            elif merged is None and same:  # merged nowhere: the tokens go into the next round
                for eid in flight.experts:
                    self.composer.tokens_since_merge[expert_group(eid)] += flight.tokens
            done.append(report)
        return done

    def wait(self, timeout_s: float) -> list[RoundReport]:
        """Wait (bounded) for the rounds in flight to end, then apply them (a graceful leave)."""
        concurrent.futures.wait([f.future for f in self._in_flight.values()], timeout=timeout_s)
        return self.collect()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for averager in self._averagers.values():
            averager.shutdown()
        self._averagers.clear()

    # --- helpers ---

    def _averager(self, group: str, owners: Owners, experts: tuple[ExpertId, ...]) -> GroupAverager:
        key = (group, experts)
        averager = self._averagers.get(key)
        if averager is None:
            shapes = {name: tuple(a.shape) for eid in experts
                      for name, a in self.composer.outer[expert_group(eid)].anchor.items()}
            live = functools.partial(self._owners_live, owners, 0)
            working = functools.partial(self._owners_live, owners, 1)
            averager = GroupAverager(self.dht, self.run_id, group, shapes, self.config, self.signer,
                                     gather=self.gather, peers=RoundPeers(live, working, self.worked),
                                     weight_cap=self.weight_cap, scores=self.scores, other_tensors_blameless=True)
            self._averagers[key] = averager
        return averager

    def _owners_live(self, owners: Owners, which: int) -> Sequence[str]:
        return self.peers_of(owners)[which]

    def _forget(self, current: dict[Owners, tuple[ExpertId, ...]]) -> None:
        """Drop the averagers of bundles the assignment no longer has (and no round uses)."""
        keep = {(replica_group(experts[0]), experts) for experts in current.values()}
        keep |= {(g, f.experts) for g, f in self._in_flight.items()}
        for key in [k for k in self._averagers if k not in keep]:
            self._averagers.pop(key).shutdown()
