"""Tiered outer sync over the network: one ``GroupAverager`` per shared group.

Two ways to merge (``OuterSyncConfig.aggregation``, the run setting ``sync.aggregation``):

- "parts" (default) and "gather": gathered rounds (``gathered.GatheredRounds``, transport in ``transport``), the
  robust merge shared among the set's senders block by block (``partitioned``), or each participant fetching every
  contribution and merging them all itself;
- "allreduce": hivemind's butterfly all-reduce, described below: fewer bytes, every peer trusted.

Both verify a merged round against the participants' signed fingerprints (``records``), and both serve
and download a group's state through the hivemind averager's state sharing (``serve_state``).

DESIGN.md section 4. Every H_G inner steps the composers of a run merge the pseudo-gradients of
shared group G and each applies the same Nesterov outer step (``Composer.apply_outer``). This module
does the merge between processes, computing what ``parallax.node.train.rda.merge_groups`` computes in one.

One all-reduce round of a group (``GroupAverager.run_round``):

1. Pack (``component_tensors``). RDA needs three weighted means, so the averaged buffers are, per
   tensor, the unit direction scaled by sqrt(numel) (entries of order 1, so fp16 keeps its digits),
   one tensor holding every tensor's norm, and per tensor the raw delta (the fallback when the
   directions cancel). "mean" averages only the raw deltas.
2. All-reduce. hivemind forms a group under the prefix ``{run_id}/outer/{group}`` (at once when
   ``target_group_size`` peers are looking, else with whoever came within ``min_matchmaking_time``)
   and replaces every buffer in place by the token-weighted mean sum_i w_i x_i / sum_i w_i.
   ``gather`` carries each peer's round number and token count, so every participant learns the
   same participant list.
3. Rebuild (``merged_from_components``): ``rda_rebuild`` per tensor.
4. Verify (HIVEMIND.md trap 3: a peer dying mid-all-reduce leaves the survivors with different
   tensors while ``step()`` reports success). Each participant stores a fingerprint of its merged
   tensors (``fingerprint``: seeded random projections and norms, about 260 bytes, tagged with the round
   and its participants) in the DHT under the group's protected key ``{run_id}/outer/{group}/rounds``,
   in its own signed subkey beside its last few rounds' (others read it under the subkey of the key the
   membership names for that peer id), and keeps its result only when
   a strict majority of the round's participants (its own fingerprint included) agree with it
   within the compression's tolerance. Peers never agree bit for bit: hivemind returns to each peer
   ``local + compress(mean - local)``, so each peer's rounding differs; hence a tolerance, not a hash.

Any failure returns ``None`` (the caller skips the outer step; nothing was applied) and
``GroupAverager.last_report`` says why. A peer whose report is ``DIVERGED`` or ``UNVERIFIED`` did
not apply a round that others may have applied: its shared group now differs from theirs and it
should reload the group from peers (``load_state_from_peers``, the joiner's path) before the next
round. ``background.BackgroundRounds.collect`` starts that reload; ``serve_state`` is the serving half.

Concurrency: ``run_round`` blocks the calling thread (the node's outer-sync thread; the training
loop meets it at one seam) for at most ``OuterSyncConfig.round_budget_s``. With
``aggregation = "allreduce"`` each averager is a hivemind child process forked at construction (gathered
rounds start none); it shares the buffers with us through shared
memory, guarded by its lock. Construct in the main thread when you can: hivemind's averager sets
SIGINT to "ignore" around its fork (trap 4): we fork it ourselves with signals deferred (``parallax.signals``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from hivemind.averaging import DecentralizedAverager

from parallax.dht.adapter import SwarmDHT, recover_hivemind_locks
from parallax.dht.keys import outer_prefix
from parallax.errors import NodeError
from parallax.node.net.scores import PeerScores
from parallax.node.outer.gathered import GatheredRounds
from parallax.node.outer.records import RoundRecords, RoundReport, RoundStatus
from parallax.node.outer.transport import OuterGather, RoundPeers
from parallax.node.outer.wire import (
    BUFFER_LOCK_TIMEOUT_S,
    MIN_WEIGHT,
    ROUNDS_KEPT,
    FingerprintSigner,
    OuterSyncConfig,
    component_shapes,
    component_tensors,
    encode_fingerprint,
    encode_round_record,
    fingerprint,
    merged_from_components,
    round_fingerprint,
    round_tag,
)
from parallax.node.train import own_data
from parallax.node.train.device import threads
from parallax.signals import signals_deferred

if TYPE_CHECKING:
    from parallax.node.train.composer import Composer

logger = logging.getLogger(__name__)

__all__ = [
    "GroupAverager",
    "ParallaxOuterAverager",
    "RoundReport",
    "RoundStatus",
    "TieredOuterSync",
]

_GATHER_VERSION = 1

# ---- the averager --------------------------------------------------------------------------------


StateProvider = Callable[[], tuple[Any, Sequence[torch.Tensor]]]


class ParallaxOuterAverager(DecentralizedAverager):
    """hivemind's averager under a stable class name: the name is part of the RPC protocol id (trap 9),
    so renaming this class splits the swarm. Serves joiners what ``state_provider`` returns."""

    state_provider: StateProvider | None = None

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], None]:
        # Runs in a background thread of the host process when a peer calls load_state_from_peers.
        provider = self.state_provider
        if provider is None:
            raise RuntimeError("this peer serves no outer state")  # hivemind logs it; the joiner tries another
        metadata, tensors = provider()
        return metadata, list(tensors), None


def _start_with_signals_deferred(averager: DecentralizedAverager, timeout_s: float) -> None:
    """Fork the averager with Ctrl+C and SIGTERM deferred (``parallax.signals``): the child ignores Ctrl+C to the
    group, and a signal that came during the fork reaches our handler afterwards: none is lost.

    hivemind's ``run_in_background`` sets SIGINT to ignore and never restores it (trap 4), which would swallow a
    Ctrl+C sent during the fork: the averager is started without it.
    """
    # The child's main thread inherits this thread's OpenMP team without its threads: once this process has run a
    # parallel torch op (any training step), a parallel op there (a uint8 quantization) would wait forever. Forked
    # with one intra-op thread, the child never enters OpenMP, and calls nothing to get there.
    recover_hivemind_locks()  # inherited by the process forked below
    with threads(1), signals_deferred():
        averager.start()
    averager.wait_until_ready(timeout_s)


class RoundResult(NamedTuple):
    """One round of a group as the training thread applies it."""

    merged: dict[str, torch.Tensor] | None  # None: skip the outer step (``report`` says why)
    report: RoundReport
    sent: dict[str, torch.Tensor] | None  # this node's pseudo-gradient as its peers decode it (gathered rounds)
    case: own_data.Case | None = None  # a contribution of the set to audit (``GatheredRounds.last_case``)


class GroupAverager:
    """The network merge of one shared group of one node.

    Args:
        dht: this node's DHT (the averager runs on its P2P daemon; fingerprints go through it).
        run_id: the run; the averager prefix is ``{run_id}/outer/{group}``.
        group: the shared group's name.
        shapes: name -> shape of the group's tensors, in a fixed order (every peer the same).
        config: timings, compression, merge method.
        signer: this node's identity, under whose subkey its fingerprints are stored (signed by the DHT's
            record validator), and whose key to expect for each peer (``wire.FingerprintSigner``);
            None keeps fingerprints under peer-id subkeys, unsigned (tests of the averaging alone).
        gather: serves and fetches contributions (``config.aggregation`` "gather" or "parts").
        peers: the live and working composers of a gathered round (``transport.RoundPeers``).
        weight_cap: the most tokens one peer can have processed since the last round (batch x sequence x
            period): a declared weight above it counts as the cap. None: no cap (tests).
        scores: where a gathered round records evidence against peers, and whose bans it honours.
        other_tensors_blameless: a gathered round leaves out a contribution naming other tensors without counting
            it against its sender (replicated experts: owners may name one key for other experts a moment).

    Raises:
        ValueError: bad names or an empty group.
        NodeError: the averager process did not start.
    """

    def __init__(self, dht: SwarmDHT, run_id: str, group: str, shapes: Mapping[str, Sequence[int]],
                 config: OuterSyncConfig, signer: FingerprintSigner | None = None, *,
                 gather: OuterGather | None = None, peers: RoundPeers | None = None,
                 weight_cap: float | None = None, scores: PeerScores | None = None,
                 other_tensors_blameless: bool = False) -> None:
        self.prefix = outer_prefix(run_id, group)
        if not shapes:
            raise ValueError(f"group {group!r} has no tensors")
        self.run_id, self.group, self.config, self.signer = run_id, group, config, signer
        self.shapes = {name: torch.Size(s) for name, s in shapes.items()}
        self.peer_id = dht.peer_id
        self.last_report: RoundReport | None = None
        self.records = RoundRecords(dht, run_id, group, config, signer)
        self._gathered: GatheredRounds | None = None
        if config.aggregation in ("gather", "parts"):
            if gather is None or peers is None:
                raise ValueError("a gathered outer round needs the node's OuterGather and its live composers")
            self._gathered = GatheredRounds(self.records, self.shapes, config, gather, peers, weight_cap=weight_cap,
                                            scores=scores, report=self._report,
                                            other_tensors_blameless=other_tensors_blameless)
        self._worked = peers.worked if peers is not None else None
        self._rounds = 0
        self._recent: list[bytes] = []  # this node's latest encoded fingerprints, newest last (all-reduce)
        self._round_lock = threading.Lock()  # one round at a time per group
        self._closed = False
        self._averager: ParallaxOuterAverager | None = None
        if self._gathered is not None:
            return  # no hivemind averager process: gathered rounds and StateExchange need none
        self._buffers = [torch.zeros(s, dtype=torch.float32) for s in component_shapes(self.shapes, config.method)]
        self._averager = ParallaxOuterAverager(
            self._buffers, dht.hivemind_dht, start=False, prefix=self.prefix,
            target_group_size=config.net.target_group_size, min_group_size=config.net.min_group_size,
            min_matchmaking_time=config.net.min_matchmaking_time_s, request_timeout=config.net.request_timeout_s,
            allreduce_timeout=config.net.allreduce_timeout_s, next_chunk_timeout=config.net.next_chunk_timeout_s,
            compression=config.hivemind_compression(), allow_state_sharing=False,
            shutdown_timeout=config.net.shutdown_timeout_s,
        )
        try:
            _start_with_signals_deferred(self._averager, config.net.startup_timeout_s)
        except BaseException as e:  # a signal during the start too: the process just forked must not outlive us
            self.shutdown()
            if not isinstance(e, Exception):
                raise
            raise NodeError(f"the outer-sync averager of group {group!r} did not start within "
                            f"{config.net.startup_timeout_s} s: {e!r}") from e

    # ---- one round ----

    def round(self, delta: Mapping[str, torch.Tensor], tokens: float, round_id: int,
              anchor: Sequence[torch.Tensor] | None = None, due: threading.Event | None = None, *,
              drawn: int = 0) -> RoundResult:
        """``run_round``, with its report and what it sent (a node's rounds run it in their pool)."""
        merged = self.run_round(delta, tokens, round_id=round_id, anchor=anchor, due=due, drawn=drawn)
        assert self.last_report is not None
        sent = self._gathered.last_sent if self._gathered is not None else None
        case = self._gathered.last_case if self._gathered is not None and merged is not None else None
        return RoundResult(merged, self.last_report, sent, case)

    def run_round(
        self, delta: Mapping[str, torch.Tensor], tokens: float, *, round_id: int | None = None,
        fault: Callable[[dict[str, torch.Tensor]], None] | None = None,
        anchor: Sequence[torch.Tensor] | None = None, due: threading.Event | None = None, drawn: int = 0,
    ) -> dict[str, torch.Tensor] | None:
        """Merge ``delta`` with the pseudo-gradients of the peers present; block for at most ``round_budget_s``
        (a gathered round given ``due``: until ``due`` is set, then at most that).

        Args:
            delta: this peer's pseudo-gradient, name -> tensor (``Composer.pseudo_gradient(group)``).
            tokens: tokens this peer processed since the last merge (its averaging weight; floored at
                MIN_WEIGHT so a peer that processed none may still join).
            round_id: the round's number, the same on every peer (e.g. step // H_G); None counts rounds
                locally. The DHT key uses the largest number among the participants.
            fault: test hook, applied in place to the merged tensors before fingerprinting (a broken round).
            anchor: gathered rounds: the group's anchor the merge is for, in ``shapes``' order (``GatheredRounds.run``).
            due: gathered rounds: set when this node's next round of the group is due; until then a contribution
                without a quorum stays on offer (``GatheredRounds.run``).
            drawn: gathered rounds: the batches this peer's data stream had handed out when ``delta`` was taken
                (``RoundEntry.drawn``).

        Returns:
            name -> merged pseudo-gradient (CPU float32), the same (within the tolerance) on every peer
            that returns one; None when the round did not complete or did not verify: then skip the outer
            step. ``last_report`` says why.

        Raises:
            ValueError: names or shapes differ from the group's, or tokens is negative or not finite.
        """
        started = time.monotonic()
        self._check(delta, tokens)
        if not self._round_lock.acquire(blocking=False):
            self._report(RoundStatus.BUSY, started, round_id=round_id, detail="another round of this group is running")
            return None
        try:
            if self._gathered is not None:
                n = self._rounds if round_id is None else int(round_id)
                self._rounds = n + 1
                return self._gathered.run(delta, tokens, n, fault, started, anchor, due, drawn=drawn)
            return self._run_round(delta, tokens, round_id, fault, started)
        finally:
            self._round_lock.release()

    def _run_round(self, delta: Mapping[str, torch.Tensor], tokens: float, round_id: int | None,
                   fault: Callable[[dict[str, torch.Tensor]], None] | None, started: float,
                   ) -> dict[str, torch.Tensor] | None:
        n = self._rounds if round_id is None else int(round_id)
        if not all(bool(torch.isfinite(d).all()) for d in delta.values()):
            self._report(RoundStatus.BAD_INPUT, started, round_id=n, detail="non-finite pseudo-gradient")
            return None
        local_norms = [float(torch.linalg.vector_norm(delta[name].detach(), dtype=torch.float64))
                       for name in self.shapes]
        if not self._fill(component_tensors({name: delta[name] for name in self.shapes}, self.config.method)):
            self._report(RoundStatus.BUSY, started, round_id=n, detail="averaged buffers still locked")
            return None

        pack_s = time.monotonic() - started
        gathered, failure, began, detail = self._all_reduce(max(float(tokens), MIN_WEIGHT), float(tokens), n)
        allreduce_s = time.monotonic() - started - pack_s
        if gathered is None:
            self._report(failure, started, round_id=n, pack_s=pack_s, allreduce_s=allreduce_s, began_allreduce=began,
                         detail=detail)
            return None
        rounds, token_counts = _parse_gathered(gathered, n)
        n = max(rounds)
        self._rounds = n + 1
        participants = tuple(sorted(token_counts))
        common: dict[str, Any] = dict(round_id=n, participants=participants, tokens=token_counts, pack_s=pack_s,
                                      allreduce_s=allreduce_s, began_allreduce=True)
        if sum(token_counts.values()) <= 0:
            self._report(RoundStatus.NO_TOKENS, started, **common)
            return None

        means = self._read()
        if means is None:
            self._report(RoundStatus.BUSY, started, detail="could not read the averaged buffers", **common)
            return None
        merged = merged_from_components(means, self.shapes, self.config.method, eps=self.config.rda_eps)
        del means
        if fault is not None:
            fault(merged)
        fp = fingerprint([merged[name] for name in self.shapes], local_norms)
        verify_started = time.monotonic()
        status, agreeing, answered = self._verify(n, fp, participants)
        common.update(agreeing=agreeing, verify_s=time.monotonic() - verify_started)
        if status is not RoundStatus.OK:
            detail = f"{agreeing} of {len(participants)} participants agree, {answered} fingerprints found"
            self._report(status, started, detail=detail, **common)
            return None
        if self._worked is not None:  # a majority got the result their data made: the work of each of them
            for peer in participants:
                if peer != self.peer_id and token_counts[peer] > 0:
                    self._worked(peer)
        self._report(RoundStatus.OK, started, **common)
        return merged

    def _check(self, delta: Mapping[str, torch.Tensor], tokens: float) -> None:
        if set(delta) != set(self.shapes):
            raise ValueError(f"group {self.group!r} has tensors {sorted(self.shapes)}, got {sorted(delta)}")
        for name, shape in self.shapes.items():
            if delta[name].shape != shape:
                raise ValueError(f"{self.group}/{name} has shape {tuple(shape)}, got {tuple(delta[name].shape)}")
        if not (math.isfinite(float(tokens)) and float(tokens) >= 0):
            raise ValueError(f"tokens is the averaging weight and must be finite and >= 0, got {tokens}")

    def _hivemind(self) -> ParallaxOuterAverager:
        """The all-reduce's averager process (``aggregation = "allreduce"`` only)."""
        if self._averager is None:
            raise RuntimeError(f"group {self.group!r} runs gathered rounds: it has no hivemind averager")
        return self._averager

    def _fill(self, components: Sequence[torch.Tensor]) -> bool:
        lock = self._hivemind().lock_averaged_tensors
        if not lock.acquire(timeout=BUFFER_LOCK_TIMEOUT_S):
            return False
        try:
            for buffer, value in zip(self._buffers, components, strict=True):
                buffer.copy_(value)
        finally:
            lock.release()
        return True

    def _read(self) -> list[torch.Tensor] | None:
        # Copies: the averager may write these buffers again in the next round.
        lock = self._hivemind().lock_averaged_tensors
        if not lock.acquire(timeout=BUFFER_LOCK_TIMEOUT_S):
            return None
        try:
            return [b.clone() for b in self._buffers]
        finally:
            lock.release()

    def _all_reduce(self, weight: float, tokens: float, n: int) -> tuple[dict[Any, Any] | None, RoundStatus, bool, str]:
        """One hivemind step. Returns (gathered metadata or None, failure status, whether the all-reduce began,
        detail)."""
        cfg, averager = self.config, self._hivemind()
        if not averager.is_alive():
            return None, RoundStatus.FAILED, False, "the averager process is not running"
        # hivemind's step() blocks, with no timeout, until the averager process acknowledges the request
        # (even with wait=False): if that process dies in between, the call never returns. So it runs
        # in a daemon thread that we stop waiting for once the process is gone or the deadline passes.
        started: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def start_step() -> None:
            try:
                started.set_result(averager.step(
                    gather={"v": _GATHER_VERSION, "round": n, "tokens": tokens}, weight=weight,
                    timeout=cfg.net.matchmaking_timeout_s, allow_retries=False, wait=False,
                ))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread below
                started.set_exception(e)

        threading.Thread(target=start_step, name=f"outer-step-{self.group}", daemon=True).start()
        start_deadline = time.monotonic() + cfg.net.matchmaking_timeout_s + 2.0
        while True:
            try:
                control = started.result(timeout=0.5)
                break
            except concurrent.futures.TimeoutError:
                if not averager.is_alive():
                    return None, RoundStatus.FAILED, False, "the averager process died"
                if time.monotonic() >= start_deadline:
                    return None, RoundStatus.TIMEOUT, False, "the averager did not accept the round"
            except Exception as e:  # hivemind refused the request outright
                return None, RoundStatus.FAILED, False, repr(e)
        # One attempt (allow_retries=False): a retry after a half-finished all-reduce would average
        # half-averaged buffers. Wait in slices so that a crashed averager process is noticed at once.
        deadline = time.monotonic() + cfg.net.matchmaking_timeout_s + cfg.net.allreduce_timeout_s + 2.0
        while True:
            try:
                gathered = control.result(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                break
            except TimeoutError:
                if not averager.is_alive():
                    return None, RoundStatus.FAILED, control.began_allreduce, "the averager process died"
                if time.monotonic() >= deadline:
                    control.cancel()
                    return (None, RoundStatus.TIMEOUT, control.began_allreduce,
                            "no result within matchmaking_timeout_s + allreduce_timeout_s")
            except Exception as e:  # hivemind raises AllreduceException, MatchmakingException, CancelledError, ...
                status = RoundStatus.NO_GROUP if "could not find a group" in str(e) else RoundStatus.FAILED
                return None, status, control.began_allreduce, repr(e)
        if not isinstance(gathered, dict) or not gathered:
            return None, RoundStatus.FAILED, True, f"averager returned {gathered!r}"
        return gathered, RoundStatus.OK, True, ""

    def _verify(self, n: int, fp: tuple[float, ...], participants: Sequence[str]) -> tuple[RoundStatus, int, int]:
        """Publish our fingerprint of an all-reduce round, then wait for a majority verdict (``await_majority``)."""
        tag = round_tag(n, participants)
        self._recent = [*self._recent, encode_fingerprint(fp, tag)][-ROUNDS_KEPT:]
        if not self.records.store(encode_round_record(self._recent)):
            logger.debug("could not store the fingerprint of %s round %d", self.group, n)
        status, agreeing, answered, _ = self.records.await_majority(
            fp, participants, lambda _peer, record: round_fingerprint(record, tag))
        return status, agreeing, answered

    def _report(self, status: RoundStatus, started: float, **fields: Any) -> None:
        report = RoundReport(group=self.group, status=status, total_s=time.monotonic() - started, **fields)
        self.last_report = report
        if status is RoundStatus.OK:
            logger.debug("outer round %s/%s: %d peers, %.2f s", self.group, report.round_id,
                         len(report.participants), report.total_s)
        elif report.needs_reload:
            logger.warning("outer round %s/%s %s (%s): skipped; this peer should reload the group from peers",
                           self.group, report.round_id, status.value, report.detail)
        else:
            logger.info("outer round %s/%s skipped: %s %s", self.group, report.round_id, status.value, report.detail)

    # ---- state for joiners (hook; the reload itself is a later step) ----

    def serve_state(self, provider: StateProvider | None) -> None:
        """Serve ``provider()`` -> (small metadata, tensors) to peers calling ``load_state_from_peers``.

        For a composer: the group's anchor and outer-optimizer momenta (``OuterOptimizer.state_dict``),
        flattened to a tensor list, with the round number in the metadata. ``provider`` runs in a
        background thread of this process and must not race with ``apply_outer``. None stops serving.
        """
        if self._averager is None:
            if provider is not None:
                raise RuntimeError(f"group {self.group!r} runs gathered rounds: serve its state with StateExchange")
            return
        self._averager.state_provider = provider
        self._averager.allow_state_sharing = provider is not None

    def hear_proofs(self, timeout_s: float) -> set[str]:
        """Read the group's rounds records once and wait up to ``timeout_s`` for the proofs they refer to
        (``witness``): a node about to take the group's state from peers, a joiner above all, has run no round yet
        in which it could have heard that one of them is proven a liar. Returns the live peers whose contributions
        the records show merged by others (``transport.vouched``; none without gathered rounds)."""
        return set() if self._gathered is None else self._gathered.hear_proofs(timeout_s)

    def vouch(self, served: Collection[str]) -> set[str]:
        """After a download of the group's state: the live peers that the rounds records of the peers in ``served``
        (those that served it) vouch for (``GatheredRounds.vouch``; none without gathered rounds)."""
        return set() if self._gathered is None else self._gathered.vouch(served)

    def load_state_from_peers(self, timeout_s: float = 60.0) -> tuple[Any, list[torch.Tensor]] | None:
        """Download the state another peer serves (``serve_state``); None when nobody answered in time."""
        try:
            found = self._hivemind().load_state_from_peers(wait=True, timeout=timeout_s)
        except Exception as e:  # TimeoutError, or a peer that failed mid-stream
            logger.info("loading outer state of %s from peers failed: %r", self.group, e)
            return None
        if found is None:
            return None
        metadata, tensors = found
        return metadata, list(tensors)

    # ---- lifecycle ----

    def shutdown(self) -> None:
        """Stop the averager process. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._gathered is not None:
            self._gathered.close()
        averager = getattr(self, "_averager", None)
        if averager is not None and averager.is_alive():
            try:
                averager.shutdown()
            except Exception as e:  # already dying: nothing left to stop
                logger.debug("averager shutdown of %s: %r", self.group, e)

    def __enter__(self) -> GroupAverager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _parse_gathered(gathered: Mapping[Any, Any], n: int) -> tuple[list[int], dict[str, float]]:
    """Participants' round numbers and token counts from the all-gather; bad entries are logged and zeroed."""
    rounds, tokens = [n], {}
    for peer, meta in gathered.items():
        peer_id = str(peer)
        if not isinstance(meta, dict) or meta.get("v") != _GATHER_VERSION:
            logger.debug("participant %s sent unreadable round metadata %r", peer_id, meta)
            tokens[peer_id] = 0.0
            continue
        r, t = meta.get("round"), meta.get("tokens")
        if isinstance(r, int) and 0 <= r < 2**62:
            rounds.append(r)
        tokens[peer_id] = float(t) if isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 else 0.0
    return rounds, tokens


class TieredOuterSync:
    """The outer sync of every shared group of one node: one ``GroupAverager`` per group.

    Args:
        dht: this node's DHT.
        run_id: the run.
        groups: group -> (name -> shape), in the composer's anchors' order (``node.runner.model_shapes(cfg).groups``).
        config: shared by every group.
        signer, gather, peers, scores: see ``GroupAverager``.
        weight_caps: group -> ``GroupAverager``'s weight_cap.

    Raises:
        NodeError: an averager did not start (those already started are shut down).
    """

    def __init__(self, dht: SwarmDHT, run_id: str, groups: Mapping[str, Mapping[str, Sequence[int]]],
                 config: OuterSyncConfig | None = None, signer: FingerprintSigner | None = None, *,
                 gather: OuterGather | None = None, peers: RoundPeers | None = None,
                 weight_caps: Mapping[str, float] | None = None, scores: PeerScores | None = None) -> None:
        self.config = config or OuterSyncConfig()
        self.groups: dict[str, GroupAverager] = {}
        try:
            for group, shapes in groups.items():
                self.groups[group] = GroupAverager(dht, run_id, group, shapes, self.config, signer, gather=gather,
                                                   peers=peers, weight_cap=(weight_caps or {}).get(group),
                                                   scores=scores)
        except BaseException:
            self.shutdown()
            raise

    def run_round(self, group: str, delta: Mapping[str, torch.Tensor], tokens: float, *,
                  round_id: int | None = None) -> dict[str, torch.Tensor] | None:
        """``GroupAverager.run_round`` of ``group``."""
        return self.groups[group].run_round(delta, tokens, round_id=round_id)

    def sync(self, composer: Composer, group: str, *, round_id: int | None = None) -> RoundReport:
        """One outer round of ``group`` for ``composer``: merge its pseudo-gradient, apply the Nesterov step
        only when the round completed and verified (never half an update). The pseudo-gradient goes as it is:
        a sparse wire's error feedback is the node's rounds' (``background``)."""
        merged = self.run_round(group, composer.pseudo_gradient(group), composer.tokens_since_merge[group],
                                round_id=round_id)
        if merged is not None:
            composer.apply_outer(group, merged)
        report = self.groups[group].last_report
        assert report is not None
        return report

    def shutdown(self) -> None:
        for averager in self.groups.values():
            with contextlib.suppress(Exception):
                averager.shutdown()

    def __enter__(self) -> TieredOuterSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

