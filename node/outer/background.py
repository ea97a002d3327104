"""Outer rounds off the step path: the node's training loop submits a round and goes on training; the
merge lands a few steps later and is applied with the progress made meanwhile kept (``step_late``).

``TieredOuterSync.run_round`` blocks for seconds (matchmaking, all-reduce, verification). The node runs
it in a worker thread per group, at most one round per group in flight. A gathered round without a quorum keeps
its contribution on offer while the group's next rounds come due (they are skipped: what the node trains meanwhile
goes into its next contribution), for up to ``OFFER_PERIODS`` of them, until the node is alone for good, or until
it leaves; then it is told to end (``_InFlight.due``: it merges with the quorum it has, or withdraws) and the round
then due starts at the first seam after it ended, with the delta and tokens of both (``owed``). At the seam the
loop calls
``collect``, which applies every finished round (never half of one: a round that failed or did not
verify applies nothing) and, when a round may have left this node behind the others, downloads the
group's anchor from peers (``GroupAverager.load_state_from_peers``, the joiner's path). A node whose anchor an
applied round found apart from the majority's downloads theirs while its rounds go on, and applies the merges of
those rounds again on the state it gets (``replay``).

The same class serves this node's outer state to joiners: after every applied round the training
thread publishes an immutable copy of each group's anchor and momentum (``publish_state``), which the
state exchange (``state``: several sources at once, one liar outvoted) hands out without touching live
tensors.

Metadata served with the state: {"v": 1, "group", "round", "step", "names", "momentum"}. While a group has never
been merged (round 0: its anchor is the initial parameters), the node also serves its current weights of it under
``{group}/live`` (``publish_live``): what an export takes for that group instead of an untrained anchor.

A group's state is never taken blindly: a downloaded state that would raise this node's loss on a few held-out
batches by more than ``RELOAD_LOSS_BOUND`` is refused and its source named (``take_state``), so a peer serving an
untrained or poisoned anchor cannot throw away what this node trained.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from parallax.node.outer.averager import RoundReport, RoundResult, RoundStatus, TieredOuterSync
from parallax.node.outer.records import RoundDue
from parallax.node.outer.state import State, StateExchange
from parallax.node.outer.transport import error_feedback, keep_unsent
from parallax.node.outer.wire import ANCHOR_TOLERANCE, anchor_fingerprint, fingerprints_agree
from parallax.node.train import own_data
from parallax.node.train.outer import OuterOptimizer, to_send
from parallax.node.train.robust import MAX_SPAN

if TYPE_CHECKING:
    from parallax.node.train.composer import Composer

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
_PROOFS_WAIT_S = 10.0  # before a download of a group's state, the most it waits for the proofs its peers show
OFFER_PERIODS = 4
"""A contribution without a quorum stays on offer for at most this many of its group's periods (the due rounds
between are skipped); the next carries all the node trained since its anchor. The robust merge counts at most
``robust.MAX_SPAN`` (4) periods of a contribution's progress, so an older one would be clipped; and composers of
unequal pace meet within it."""
RELOAD_LOSS_BOUND = 1.10
"""A downloaded group state is refused when it would make this node's held-out loss more than this many times what
it is now (an honest reload after a half-applied round moves it by a few percent at most)."""
LIVE = "live"


@dataclass
class _InFlight:
    round_id: int
    submitted: dict[str, torch.Tensor]
    pending: dict[str, torch.Tensor]  # what the round sends (``train.outer.to_send``)
    tokens: int
    future: concurrent.futures.Future[RoundResult]
    due: RoundDue
    """Set to end a round still waiting for a quorum (``OFFER_PERIODS`` dues passed, alone for good, or leaving);
    withdrawn by ``rebase``."""
    passed: int = 0
    """The group's due rounds skipped while this one waited."""


@dataclass
class RoundCounts:
    submitted: int = 0
    applied: int = 0
    failed: int = 0
    skipped_busy: int = 0
    """Due rounds not started: the previous round of the group still waited (its contribution on offer), or a
    reload of the group was running."""
    ended_waiting: int = 0
    """Rounds told to end while they waited for a quorum (``OFFER_PERIODS`` dues passed, or alone for good)."""
    reloads: int = 0
    refused: int = 0
    """Downloaded states refused (they would have raised the loss, or did not check out)."""


def live_uid(group: str) -> str:
    """The name a group's current weights are served under (``publish_live``)."""
    return f"{group}/{LIVE}"


def live_state(outer: OuterOptimizer, *, group: str, step: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(metadata, tensors) of a group's current weights, for an export (no momentum)."""
    names = list(outer.anchor)
    live = outer.live_copy()
    meta = {"v": _STATE_VERSION, "group": live_uid(group), "round": outer.round, "step": step, "names": names,
            "momentum": False}
    return meta, [live[n] for n in names]


def group_state(outer: OuterOptimizer, *, group: str, round_id: int, step: int) -> tuple[dict[str, Any],
                                                                                        list[torch.Tensor]]:
    """(metadata, tensors) a joiner needs for one group: the anchor, then the momentum buffers if any."""
    names = list(outer.anchor)
    tensors = [outer.anchor[n].clone() for n in names]
    buffers = [outer.optimizer.state.get(outer.anchor[n], {}).get("momentum_buffer") for n in names]
    momentum = all(b is not None for b in buffers)
    if momentum:
        tensors += [b.clone() for b in buffers]
    meta = {"v": _STATE_VERSION, "group": group, "round": round_id, "step": step, "names": names,
            "momentum": momentum}
    return meta, tensors


@torch.no_grad()
def load_group_state(outer: OuterOptimizer, group: str, meta: Any, tensors: Sequence[torch.Tensor],
                     since: dict[str, torch.Tensor] | None = None, then: Callable[[], object] | None = None) -> int:
    """Take a peer's anchor (and momentum) for one group; keep our progress since our own anchor, or since
    ``since`` (the parameters we submitted to a round whose merge the peer's anchor already holds: what we
    trained before it is in there once, weighted like everyone's, and must not be added a second time).
    ``then``: called once the state is loaded (``replay``).

    Returns:
        The round number the state was taken at.

    Raises:
        ValueError: the state is for another group, has other names or shapes, or is not finite.
    """
    names = list(outer.anchor)
    if not isinstance(meta, dict) or meta.get("v") != _STATE_VERSION or meta.get("group") != group:
        raise ValueError(f"outer state metadata {meta!r} is not version {_STATE_VERSION} of group {group!r}")
    if meta.get("names") != names:
        raise ValueError(f"outer state of {group!r} has tensors {meta.get('names')}, this node has {names}")
    expected = 2 * len(names) if meta.get("momentum") else len(names)
    if len(tensors) != expected:
        raise ValueError(f"outer state of {group!r} has {len(tensors)} tensors, expected {expected}")
    for i, t in enumerate(tensors):
        shape = outer.anchor[names[i % len(names)]].shape
        if t.shape != shape or not bool(torch.isfinite(t).all()):
            raise ValueError(f"outer state of {group!r}: tensor {i} has shape {tuple(t.shape)} (expected "
                             f"{tuple(shape)}) or non-finite values")
    round_id = meta.get("round")
    if not isinstance(round_id, int) or round_id < 0:
        raise ValueError(f"outer state of {group!r} has round {round_id!r}")
    live = outer.live_copy()
    base = since if since is not None else outer.anchor
    progress = {n: live[n] - base[n] for n in names}
    for i, n in enumerate(names):
        outer.anchor[n].copy_(tensors[i])
        outer.params[n].copy_((outer.anchor[n] + progress[n]).to(outer.params[n].device, outer.params[n].dtype))
    outer.optimizer.state.clear()
    if meta.get("momentum"):
        for i, n in enumerate(names):
            outer.optimizer.state[outer.anchor[n]] = {"momentum_buffer": tensors[len(names) + i].to(torch.float32)
                                                      .clone()}
    outer.round = round_id
    if then is not None:
        then()
    return round_id


def take_state(outer: OuterOptimizer, group: str, meta: Any, tensors: Sequence[torch.Tensor], *,
               since: dict[str, torch.Tensor] | None = None, probe: Callable[[], float] | None = None,
               against_anchor: bool = False, then: Callable[[], object] | None = None) -> int | None:
    """``load_group_state``, unless the state makes ``probe()`` (this node's loss on fixed held-out batches) more
    than ``RELOAD_LOSS_BOUND`` times what it was: then everything is put back as it was, the source (``meta``'s
    ``source``) is named in the log, and None is returned. ``against_anchor``: what it was is the loss at this node's
    own anchor of the group, not at its live weights (a node that drops what it trained alone, ``rebase``, compares
    the state with where it last agreed with the swarm: its own lone progress fits its held-out batches better than
    any merged state does). ``then``: called once the state is loaded, before it is judged (``replay``).

    Raises:
        ValueError: as ``load_group_state`` (nothing changed).
    """
    if probe is None:
        return load_group_state(outer, group, meta, tensors, since, then)
    saved, live = outer.state_dict(), outer.live_copy()
    if against_anchor:
        outer.load_live(outer.anchor)
        before = probe()
        outer.load_live(live)
    else:
        before = probe()
    round_id = load_group_state(outer, group, meta, tensors, since, then)
    after = probe()
    if after <= RELOAD_LOSS_BOUND * before:
        return round_id
    outer.load_state_dict(saved)
    outer.load_live(live)
    logger.warning("refused the state of %s (round %s) from peer %s: it raises this node's held-out loss from %.4f "
                   "to %.4f; this node keeps its own", group, round_id, meta.get("source", "?"), before, after)
    return None


def best_of(outer: OuterOptimizer, group: str, candidates: Sequence[State], *,
            since: dict[str, torch.Tensor] | None = None, probe: Callable[[], float] | None = None) -> State | None:
    """The state of ``candidates`` (``StateExchange.candidates``) to take: the only one; of two sources that
    disagree, the one that gives the lower loss on this node's held-out batches (``probe``), each loaded as
    ``load_group_state`` would and everything put back after (neither without a probe, or when neither gives a
    finite loss); None when there is none. When only two composers answer, no vote tells a poisoned or stale state
    from the swarm's, and a node that takes neither trains on alone from what it has (a joiner: the seeded init);
    its own held-out batches, which no source chooses, tell them apart. ``take_state`` still bounds the one chosen
    against what this node has."""
    if len(candidates) <= 1 or probe is None:
        return candidates[0] if len(candidates) == 1 else None
    saved, live = outer.state_dict(), outer.live_copy()
    losses = []
    for meta, tensors in candidates:
        try:
            load_group_state(outer, group, meta, tensors, since)
            loss = probe()
            losses.append(loss if math.isfinite(loss) else math.inf)  # a NaN would not sort
        except ValueError as e:
            logger.warning("outer group %s: the state peer %s serves does not fit: %s", group, meta.get("source", "?"),
                           e)
            losses.append(math.inf)
        finally:
            outer.load_state_dict(saved)
            outer.load_live(live)
    ranked = sorted(range(len(candidates)), key=losses.__getitem__)
    best, other = ranked[0], ranked[1]
    if not math.isfinite(losses[best]):
        return None
    logger.warning("outer group %s: of two states that disagree, peer %s's gives held-out loss %.4f, peer %s's %.4f: "
                   "taking the first", group, candidates[best][0].get("source", "?"), losses[best],
                   candidates[other][0].get("source", "?"), losses[other])
    return candidates[best]


@torch.no_grad()
def take_anchor(outer: OuterOptimizer, group: str, meta: Any, tensors: Sequence[torch.Tensor], *,
                bound: float, then: Callable[[], object] | None = None) -> int | None:
    """A peer's anchor and momentum for ``group``, this node's live weights kept as they are, when the two anchors are
    at most ``bound`` apart: its next pseudo-gradient then carries their difference (a round one side applied and
    the other did not) into the merge, so neither side's progress is lost, and the anchors agree again. For a node
    whose anchor is apart from the one a majority of a round holds, when ``take_state`` refused theirs (it lacks a
    round this node applied). ``then``: called once the state is loaded, before the anchors are compared (``replay``:
    it moves the anchor; the weights are put back after). Returns the state's round, or None (nothing changed).

    Raises:
        ValueError: as ``load_group_state`` (nothing changed).
    """
    saved, live = outer.state_dict(), outer.live_copy()
    round_id = load_group_state(outer, group, meta, tensors, then=then)
    apart = math.sqrt(sum(float((outer.anchor[n] - a).square().sum()) for n, a in saved["anchor"].items()))
    if not apart <= bound:
        outer.load_state_dict(saved)
    outer.load_live(live)
    if not apart <= bound:
        logger.warning("outer group %s: the anchor peer %s serves is %.3g from this node's, past the %.3g a few missed "
                       "rounds move it: kept its own", group, meta.get("source", "?"), apart, bound)
        return None
    logger.warning("outer group %s: took the anchor peer %s serves (%.3g from this node's) and kept this node's "
                   "weights: its next pseudo-gradient carries the difference", group, meta.get("source", "?"), apart)
    return round_id


class Replayed(NamedTuple):
    """A merge this node applied while it downloaded its group's state from the holders of the majority's anchor."""

    base: tuple[float, ...]
    """The anchor the merge is a step from (``RoundReport.base``)."""
    round_id: int
    merged: dict[str, torch.Tensor]


REPLAY_KEPT = 3
"""The merges ``replay`` may apply again (the latest): the round whose result started a download and the few that
merge while it runs. Each is the size of the group."""


@torch.no_grad()
def replay(outer: OuterOptimizer, group: str, order: Sequence[str], applied: Sequence[Replayed]) -> int:
    """Apply again, on the anchor just downloaded, the merges this node applied while downloading it that the anchor
    does not hold yet: from the first that is a step from that anchor (its ``base``; names in ``order``, the
    group's wire order) on, each as ``step_kept`` (what this node trained since its anchor stays on top), while each is
    a step from where the one before left the anchor (one missing between them: the rest are steps from elsewhere).

    A node whose anchor drifted from the majority's downloads theirs while the group's rounds go on: the state it
    gets was served before those rounds merged, or before the one that started the download did at its source. Taken
    as it is, it leaves the node a round or two behind the others, its next contribution is left out again, and a
    download longer than the group's period keeps it there. The merges it applied meanwhile are the others' (their
    results verified by a majority of their sets); stepped again from the anchor they were meant for, with the
    momentum downloaded beside it, they bring it where the others are. Returns how many were applied."""
    def here() -> tuple[float, ...]:
        return anchor_fingerprint([outer.anchor[n] for n in order])

    downloaded = here()
    start = next((i for i, r in enumerate(applied) if fingerprints_agree(downloaded, r.base, ANCHOR_TOLERANCE)), None)
    done: list[int] = []
    for r in applied[start:] if start is not None else ():
        # A merge between them missing here: the rest are steps from elsewhere.
        if done and not fingerprints_agree(here(), r.base, ANCHOR_TOLERANCE):
            break
        outer.step_kept(r.merged)
        outer.round = r.round_id
        done.append(r.round_id)
    if done:
        logger.info("outer group %s: applied again on the state downloaded the %d merge(s) it lacked (rounds %s)",
                    group, len(done), ", ".join(map(str, done)))
    return len(done)


class BackgroundRounds:
    """Runs the outer rounds of every shared group of one node in worker threads (module docstring).

    Args:
        sync: the node's averagers, one per group.
        composer: the composer whose groups are merged (read and written only by the training thread,
            in ``submit``/``collect``/``publish_state``).
        serve: serve every group's state to joiners from the start (a node of a new swarm: its seeded
            init is the swarm's). A joiner passes False: it serves a group only once it holds the swarm's
            state of it (downloaded, or a round applied), never its own init to the next joiner, and it
            contributes to no round of a group before that (a due round downloads the state instead).
        states: where group states are served and downloaded (None: hivemind's averager state sharing).
        probe: () -> this node's loss on fixed held-out batches (``take_state``'s guard); None: no guard.
        audit: audits a contribution of a round for work on its sender's own data (``train.own_data.Auditor``), at
            the seam that applies the round, before the group's anchor moves; None: no audits.
    """

    def __init__(self, sync: TieredOuterSync, composer: Composer, *, serve: bool = True,
                 states: StateExchange | None = None, probe: Callable[[], float] | None = None,
                 audit: Callable[[str, own_data.Case], object] | None = None) -> None:
        self.sync = sync
        self.composer = composer
        self.states = states
        self.probe = probe
        self.audit = audit
        self.counts = RoundCounts()
        self.reports: list[RoundReport] = []
        self.rounds_ok: dict[str, int] = dict.fromkeys(sync.groups, 0)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, 2 * len(sync.groups)),
                                                           thread_name_prefix="parallax-outer")
        self._in_flight: dict[str, _InFlight] = {}
        self._owed: dict[str, int] = {}  # group -> a round due once the waiting round it ended is over (``owed``)
        self._reloads: dict[str, concurrent.futures.Future[list[State]]] = {}
        # group -> (parameters, tokens) submitted to the round whose failure started the reload
        self._reload_since: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
        self._resync: dict[str, float] = {}  # group -> how far the anchor it reloads may be from ours (``take_anchor``)
        # group -> the merges applied since its download from the peers holding the majority's anchor began
        # (``replay``): its rounds go on meanwhile
        self._replayable: dict[str, list[Replayed]] = {}
        self._rebase: set[str] = set()  # groups whose state is taken from the others once their round ends (``rebase``)
        self._rebasing: set[str] = set()  # groups whose download runs for a rebase
        self._leaving = False  # set by ``wait``: no download starts that nobody would wait for
        self._served: dict[str, tuple[dict[str, Any], list[torch.Tensor]]] = {}
        self._served_lock = threading.Lock()
        self._serving: set[str] = set()
        if serve:
            for group in sync.groups:
                self._start_serving(group)

    # --- training thread ---

    def busy(self, group: str) -> bool:
        return group in self._in_flight

    def settle(self, stop: threading.Event, quorum_wait_s: float) -> None:
        """Wait until every round in flight has ended, and every download of a group's state, or until ``stop`` is
        set (``node.lockstep``); ``collect`` then applies them. A round still waiting for a quorum after
        ``quorum_wait_s`` is told to end, as when its offer runs out (no due round passes while the node waits:
        ``OFFER_PERIODS``); every other wait ends within its own bounds."""
        ends = time.monotonic() + quorum_wait_s
        while not stop.is_set():
            futures = self._running()
            if all(f.done() for f in futures):
                return
            if time.monotonic() >= ends:
                self._end_all()
            concurrent.futures.wait(futures, timeout=0.2)

    def _running(self) -> list[concurrent.futures.Future[Any]]:
        """The rounds in flight and the downloads of group states, ended or not (``collect`` takes the ended)."""
        return [*(f.future for f in self._in_flight.values()), *self._reloads.values()]

    def submit(self, group: str, round_id: int) -> bool:
        """Start a round of ``group`` with the composer's current pseudo-gradient; False when one is running (its
        contribution stays on offer: this round is skipped, or, the ``OFFER_PERIODS``-th skipped, it is told to end and
        ``round_id`` is owed), when a reload of the group runs (but one from the holders of the majority's anchor:
        ``replay``), or when this node does not hold the swarm's state of the group yet (it downloads it instead)."""
        flight = self._in_flight.get(group)
        if flight is not None:
            flight.passed += 1
            if flight.passed < OFFER_PERIODS and group not in self._owed:
                self.counts.skipped_busy += 1
                logger.info("outer round %s/%d skipped: round %d still waits for a quorum, its contribution on offer",
                            group, round_id, flight.round_id)
            else:
                self.end_waiting(group, round_id)
            return False
        self._owed.pop(group, None)
        if (group in self._reloads and group not in self._replayable) or group in self._rebase:
            self.counts.skipped_busy += 1
            logger.info("outer round %s/%d skipped: the group's state is being downloaded", group, round_id)
            return False
        if group not in self._serving:  # a joiner whose download failed: its delta is from the seeded init
            logger.info("outer round %s/%d skipped: this node does not hold the swarm's state of the group yet; "
                        "downloading it", group, round_id)
            self._start_reload(group)
            return False
        outer = self.composer.outer[group]
        delta, submitted = to_send(outer, error_feedback(self.sync.config.compression)), outer.live_copy()
        tokens = self.composer.tokens_since_merge[group]
        self.composer.tokens_since_merge[group] = 0
        averager = self.sync.groups[group]
        anchor = [outer.anchor[name] for name in averager.shapes]  # left alone until the round is collected
        due = RoundDue()
        future = self._pool.submit(averager.round, delta, tokens, round_id, anchor, due,
                                   drawn=self.composer.sampler.step)
        self._in_flight[group] = _InFlight(round_id, submitted, delta, tokens, future, due)
        self.counts.submitted += 1
        return True

    def end_waiting(self, group: str, round_id: int) -> None:
        """Tell the round of ``group`` in flight to end if it still waits for a quorum (it merges with the quorum it
        has, or withdraws); round ``round_id`` starts once it has ended (``owed``)."""
        flight = self._in_flight.get(group)
        if flight is not None and not flight.due.is_set():
            self.counts.ended_waiting += 1
            logger.info("outer round %s/%d ends its wait for a quorum (merging with the quorum it has, or withdrawn); "
                        "round %d starts after it", group, flight.round_id, round_id)
            flight.due.set()
        self._owed[group] = round_id

    def owed(self) -> dict[str, int]:
        """group -> round number of the rounds due once the waiting round they ended was over, that can start now
        (it is): the training thread starts them at the seam as if due."""
        return {g: n for g, n in self._owed.items() if g not in self._in_flight}

    def merge_alone(self, group: str, round_id: int) -> None:
        """A merge among one (no other composer is live): the outer step with this node's own pseudo-gradient, so
        its anchor follows its training and what a joiner downloads is trained. Served like any merged state."""
        self._owed.pop(group, None)
        outer = self.composer.outer[group]
        logger.info("outer round %s/%d merged among one: no other composer is live", group, round_id)
        outer.step_alone()
        self.composer.tokens_since_merge[group] = 0
        outer.round = round_id
        self.publish_state(group)
        self._start_serving(group)

    def collect(self) -> list[RoundReport]:
        """Apply every finished round and every finished reload (the seam; never blocks)."""
        done = []
        for group in [g for g, f in self._in_flight.items() if f.future.done()]:
            flight = self._in_flight.pop(group)
            try:
                merged, report, sent, case = flight.future.result()
            except Exception as e:  # a bug or a dead averager: count it, skip the round, keep training
                logger.warning("outer round %s/%d raised %r; skipped", group, flight.round_id, e)
                merged, report, sent, case = RoundResult(None, RoundReport(group, RoundStatus.FAILED, flight.round_id,
                                                                        detail=repr(e)), None)
            if merged is not None:
                outer = self.composer.outer[group]
                # Audited from the anchor the set's contributions were taken from: ours, unless it drifted from theirs.
                if case is not None and self.audit is not None and not report.ours_left_out and not report.apart_from:
                    try:
                        self.audit(group, case)
                    except Exception as e:  # an audit is evidence about a peer, never a reason to lose a round
                        logger.warning("outer round %s/%d: the audit of peer %s's contribution failed: %r", group,
                                       flight.round_id, case.peer, e)
                if report.ours_left_out:  # the merge holds nothing of ours: all this node trained stays its own
                    outer.step_kept(merged)
                    self.composer.tokens_since_merge[group] += flight.tokens
                else:
                    keep_unsent(outer, flight.pending, sent, self.sync.config.compression)
                    outer.step_late(merged, flight.submitted)
                outer.round = report.round_id if report.round_id is not None else flight.round_id
                self.counts.applied += 1
                self.rounds_ok[group] += 1
                self.publish_state(group)
                self._start_serving(group)
                # Our anchor drifted from theirs (our contribution, taken from it, was left out as well): take theirs,
                # keep our progress since it.
                holders = report.apart_from
                if not holders and report.ours_left_out:
                    holders = tuple(p for p in report.participants if p not in report.left_out)
                if holders:
                    # A few rounds' steps at most: what missed rounds move an anchor by (``take_anchor``).
                    sync = self.composer.cfg.sync
                    self._resync[group] = MAX_SPAN * sync.outer_lr / (1 - sync.outer_momentum) * math.sqrt(
                        sum(float(t.square().sum()) for t in merged.values()))
                    self._start_reload(group, sources=holders)
                kept = self._replayable.get(group)
                if kept is not None and report.base is not None:  # this one's download runs: it may predate it
                    kept.append(Replayed(report.base, outer.round, merged))
                    del kept[:-REPLAY_KEPT]
            else:
                self.counts.failed += 1
                if group in self._replayable:
                    # Taken from an anchor apart from the majority's while their state downloads: a set whose strict
                    # majority names another anchor left it out. Its tokens count in the next round; the download
                    # goes on (docs/decisions.md: a set without one may have merged it, and it is sent again).
                    self.composer.tokens_since_merge[group] += flight.tokens
                elif report.needs_reload and report.ours_left_out:  # what peers may have applied holds none of ours
                    self.composer.tokens_since_merge[group] += flight.tokens
                    self._start_reload(group)
                elif report.needs_reload:  # the all-reduce ran: peers may have applied our delta and tokens already
                    self._start_reload(group, since=(flight.submitted, flight.tokens))
                else:  # no merge happened anywhere: our delta and its tokens go into the next round
                    self.composer.tokens_since_merge[group] += flight.tokens
            self.reports.append(report)
            done.append(report)
        # A group's state is taken once no round of it runs (``replay``: the rounds go on while it downloads).
        for group in [g for g, f in self._reloads.items() if f.done() and g not in self._in_flight]:
            future = self._reloads.pop(group)
            submitted, tokens = self._reload_since.pop(group, (None, 0))
            bound = self._resync.pop(group, None)
            kept = self._replayable.pop(group, [])
            rebasing = group in self._rebasing
            self._rebasing.discard(group)
            try:
                found = best_of(self.composer.outer[group], group,
                                future.result() if future.exception() is None else [], since=submitted,
                                probe=self.probe)
            except Exception as e:  # the probe failed: this node keeps what it has, its delta still its own
                logger.warning("outer group %s: judging the states its peers serve failed: %r", group, e)
                found = None
            if found is None:
                logger.warning("outer group %s: no peer served its state; it stays as it is until the next round",
                               group)
                self.composer.tokens_since_merge[group] += tokens  # our delta is still ours to send
                continue
            outer = self.composer.outer[group]
            then = functools.partial(replay, outer, group, list(self.sync.groups[group].shapes), kept) if kept \
                else None
            try:
                taken = take_state(outer, group, *found, since=submitted, probe=self.probe, against_anchor=rebasing,
                                   then=then)
                if taken is None and bound is not None:
                    taken = take_anchor(outer, group, *found, bound=bound, then=then)
            except ValueError as e:
                logger.warning("outer group %s: refused a peer's state: %s", group, e)
                taken = None
            if taken is None:
                self.composer.tokens_since_merge[group] += tokens
                self.counts.refused += 1
                continue
            self.counts.reloads += 1
            self.publish_state(group)
            self._start_serving(group)
        self._start_rebases()
        return done

    def rebase(self) -> None:
        """This node is back in the swarm's majority after it was cut off from it: what it trained of the shared
        groups alone is dropped, and each group's state is downloaded from the others, as its experts are taken back
        from those who trained them meanwhile. Sent as it is, the pseudo-gradient of a whole partition would span
        many periods from an anchor the others moved on from: every merge would clip it, and each would count it as
        evidence against this node. A round still waiting for a quorum is withdrawn first (``RoundDue.withdraw``: it
        merges no set of its own making); a group contributes again once its download ended (a download that fails
        or is refused keeps what the node trained; the held-out probe compares the state with this node's anchor,
        ``take_state``'s ``against_anchor``)."""
        for group in self.sync.groups.keys() & self.composer.outer.keys():
            self._rebase.add(group)
            flight = self._in_flight.get(group)
            if flight is not None:
                flight.due.withdraw()
        self._start_rebases()

    def _start_rebases(self) -> None:
        if self._leaving:
            return
        for group in sorted(self._rebase - self._in_flight.keys() - self._reloads.keys()):
            self._rebase.discard(group)
            tokens = self.composer.tokens_since_merge[group]
            self.composer.tokens_since_merge[group] = 0
            logger.warning("outer group %s: back in the swarm's majority; taking the others' state of it and dropping "
                           "the %d tokens this node trained of it since its last merge", group, tokens)
            self._reload_since[group] = (self.composer.outer[group].live_copy(), tokens)
            self._rebasing.add(group)
            self._reloads[group] = self._pool.submit(self._download, group, 30.0)

    def _start_reload(self, group: str, since: tuple[dict[str, torch.Tensor], int] | None = None,
                      sources: Sequence[str] | None = None) -> None:
        """Download the group's state in the background (``collect`` takes it); ``sources``: from these peers only,
        the holders of the anchor an applied round found the majority's: the group's rounds go on meanwhile and
        their merges are applied again on the state downloaded (``replay``). None: any live composers, and the
        group's rounds are skipped until it lands."""
        if group not in self._reloads:
            if since is not None:
                self._reload_since[group] = since
                logger.warning("outer group %s: reloading its state from peers after a round others may have "
                               "applied", group)
            if sources is not None:
                self._replayable[group] = []
            self._reloads[group] = self._pool.submit(self._download, group, 30.0, sources)

    def _download(self, group: str, timeout_s: float, sources: Sequence[str] | None = None) -> list[State]:
        """The states worth taking of ``group`` (``StateExchange.candidates``; ``best_of`` chooses among them)."""
        if self.states is None:
            state = self.sync.groups[group].load_state_from_peers(timeout_s)
            return [] if state is None else [state]
        shapes = {name: tuple(t.shape) for name, t in self.composer.outer[group].anchor.items()}
        started = time.monotonic()
        vouched: set[str] = set()
        try:  # no state from a proven liar; the peers whose work others merged asked first
            vouched = self.sync.groups[group].hear_proofs(min(_PROOFS_WAIT_S, timeout_s / 3))
        except Exception as e:  # the download goes on without: proofs are heard in rounds too
            logger.warning("outer group %s: reading the proofs its peers show before downloading its state failed: %r",
                           group, e)
        left = max(timeout_s - (time.monotonic() - started), 2 * timeout_s / 3)
        found = self.states.candidates(group, shapes, left, sources=sources, first=vouched)
        try:  # whom the records of the peers that served it vouch for (a joiner counts them as working)
            self.sync.groups[group].vouch(found.served)
        except Exception as e:  # the states stand: work that arrives is counted anyway
            logger.warning("outer group %s: reading the records of the peers that served its state failed: %r", group,
                           e)
        return found.states

    def _start_serving(self, group: str) -> None:
        if group not in self._serving:
            self._serving.add(group)
            provider = functools.partial(self._serve, group)
            if self.states is not None:
                self.states.serve(group, provider)
            else:
                self.sync.groups[group].serve_state(provider)

    def publish_state(self, group: str | None = None) -> None:
        """Make the current anchor (and momentum) of ``group`` (default: all) what joiners download."""
        for g in [group] if group is not None else list(self.sync.groups):
            outer = self.composer.outer[g]
            state = group_state(outer, group=g, round_id=outer.round, step=self.composer.step)
            with self._served_lock:
                self._served[g] = state
                if outer.round > 0:
                    self._served.pop(live_uid(g), None)  # merged: an export takes the anchor now

    def publish_live(self) -> None:
        """Serve the current weights of every group never merged yet (``live_uid``): an export takes them instead
        of an untrained anchor. A copy of the groups, so the training thread calls it now and then (snapshots)."""
        for g, outer in self.composer.outer.items():
            if g not in self.sync.groups or outer.round > 0:
                continue
            uid = live_uid(g)
            with self._served_lock:
                self._served[uid] = live_state(outer, group=g, step=self.composer.step)
            if uid not in self._serving:
                self._serving.add(uid)
                if self.states is not None:
                    self.states.serve(uid, functools.partial(self._serve, uid))

    def _serve(self, group: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
        with self._served_lock:
            state = self._served.get(group)
        if state is None:
            raise RuntimeError(f"no outer state of {group} published yet")
        return state

    def wait(self, timeout_s: float) -> list[RoundReport]:
        """Wait (bounded) for the rounds in flight to end, then apply them (a graceful leave: nothing starts after it);
        returns the reports of the rounds that ended, as ``collect``. A round waiting for a quorum ends once its first
        wait is over. The downloads of a group's state that their results start (an anchor apart from the others', a
        round others may have applied) are waited for within the same bound: what the node leaves with (its final
        evaluation and snapshots, an export) holds them."""
        self._leaving = True
        self._end_all()
        deadline = time.monotonic() + timeout_s
        done: list[RoundReport] = []
        for _ in range(2):  # the rounds and downloads in flight, then the downloads their results started
            concurrent.futures.wait(self._running(), timeout=max(0.0, deadline - time.monotonic()))
            done += self.collect()
            if not self._reloads:
                break
        return done

    def load_from_peers(self, timeout_s: float) -> dict[str, int]:
        """A joiner's start: download every group's anchor and momentum from a live peer (blocking).

        Returns:
            group -> round number of the state taken (groups nobody served are left at the seeded init).
        """
        futures = {g: self._pool.submit(self._download, g, timeout_s) for g in self.sync.groups}
        downloaded: dict[str, list[State]] = {}
        for group, future in futures.items():
            try:
                downloaded[group] = future.result(timeout=timeout_s + 5)
            except Exception as e:
                logger.warning("outer group %s: state download failed: %r", group, e)
        # Groups whose sources agree are taken first, and of those whose sources disagree the backbone first: each pair
        # is judged by the held-out loss of a model whose other groups are already the swarm's where they can be.
        taken = {}
        for group in sorted(downloaded, key=lambda g: (len(downloaded[g]) > 1, g != "backbone")):
            try:
                found = best_of(self.composer.outer[group], group, downloaded[group], probe=self.probe)
            except Exception as e:
                logger.warning("outer group %s: judging the states its peers serve failed: %r", group, e)
                continue
            if found is None:
                logger.info("outer group %s: no peer served its state (a new swarm?)", group)
                continue
            try:
                round_id = take_state(self.composer.outer[group], group, *found, probe=self.probe)
            except ValueError as e:
                logger.warning("outer group %s: refused a peer's state: %s", group, e)
                continue
            if round_id is None:
                continue
            taken[group] = round_id
            self._start_serving(group)
        self.publish_state()
        return taken

    def _end_all(self) -> None:
        """Tell every round in flight to end its wait for a quorum (the node leaves)."""
        for flight in self._in_flight.values():
            flight.due.set()

    def shutdown(self) -> None:
        self._end_all()
        for group, averager in self.sync.groups.items():
            averager.serve_state(None)
            if self.states is not None:
                self.states.serve(group, None)
                self.states.serve(live_uid(group), None)
        self._pool.shutdown(wait=False, cancel_futures=True)


def next_round_in(schedule_periods: dict[str, int], step: int) -> dict[str, int]:
    """Steps until each group's next round (for the live display)."""
    return {g: p - step % p if step % p else p for g, p in schedule_periods.items() if p > 0 and math.isfinite(p)}
