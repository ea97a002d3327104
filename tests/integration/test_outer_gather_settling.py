"""How a gathered round settles its set among peers whose views differ, over real hivemind DHT peers on loopback:
restarts, different round numbers, late comers, sets merged elsewhere, contributions coming off offer, sets nobody
else merges, contributions of other tensors (``node.outer.testing``'s four peers live for the module).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from parallax.dht.testing import wait_until
from parallax.node.net.scores import PeerScores
from parallax.node.outer.averager import GroupAverager, RoundStatus
from parallax.node.outer.testing import (
    CAP,
    SHAPES,
    Peer,
    gather_peers,
    gathered_config,
    noisy_deltas,
    run_all,
    start_averagers,
)
from parallax.node.outer.transport import (
    WITHDRAWN,
    RoundEntry,
    RoundPeers,
    decode_entries,
)

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    with gather_peers() as made:
        yield made


def test_a_restarted_node_skips_the_rounds_its_earlier_process_claimed(peers):
    """The four peers merge round 5, then restart (new averagers: new sessions, the same identities) from a checkpoint
    before it: round 5 again is skipped at once by each, since claiming it again would be a second, different claim
    of it (the others merged the first under the same name); round 6 merges as usual, and nobody holds anything
    against anybody."""
    scores = [PeerScores() for _ in peers]
    with start_averagers(peers, "restarted", scores) as averagers:
        assert all(r is not None for r in run_all(averagers, noisy_deltas(4, seed=60), [CAP] * 4, round_id=5))
    with start_averagers(peers, "restarted", scores) as averagers:
        assert all(r is None for r in run_all(averagers, noisy_deltas(4, seed=61), [CAP] * 4, round_id=5))
        for a in averagers:
            assert a.last_report.status is RoundStatus.CLAIMED_BEFORE and not a.last_report.needs_reload, a.last_report
        results = run_all(averagers, noisy_deltas(4, seed=62), [CAP] * 4, round_id=6)
        assert all(r is not None for r in results), [a.last_report for a in averagers]
    assert all(score.snapshot() == {} for score in scores)


def test_peers_at_different_round_numbers_merge_their_current_contributions(peers):
    # Composers reach a round at their own steps: their round numbers differ, their rounds still meet.
    with start_averagers(peers, "latent") as averagers:
        deltas, tokens = noisy_deltas(4, seed=4), [CAP] * 4
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(a.run_round, d, t, round_id=n) for a, d, t, n in
                       zip(averagers, deltas, tokens, (5, 6, 7, 9), strict=True)]
            results = [f.result(timeout=60) for f in futures]
        assert all(r is not None for r in results), [a.last_report for a in averagers]
        assert all(len(a.last_report.participants) == 4 for a in averagers)
        assert all(torch.equal(r["w"], results[0]["w"]) for r in results)


def test_a_peer_that_comes_after_the_others_merged_skips_the_round(peers):
    # Peer 3 comes late: the others merged without it. Its contribution was never fetched, so it skips this
    # round without reloading (its progress goes into its next round) and the next round includes it again.
    # It waits 3 s for a quorum that is not coming.
    with start_averagers(peers, "latecomer", quorum_waits=[15.0, 15.0, 15.0, 3.0]) as averagers:
        deltas, tokens = noisy_deltas(4, seed=5), [CAP] * 4
        with ThreadPoolExecutor(3) as pool:
            early = [pool.submit(a.run_round, d, t, round_id=5) for a, d, t in
                     zip(averagers[:3], deltas[:3], tokens[:3], strict=True)]
            results = [f.result(timeout=60) for f in early]
        assert all(r is not None for r in results), [a.last_report for a in averagers[:3]]
        assert all(len(a.last_report.participants) == 3 for a in averagers[:3])
        assert averagers[3].run_round(deltas[3], tokens[3], round_id=5) is None
        report = averagers[3].last_report
        assert report.status is RoundStatus.NO_GROUP and not report.needs_reload, report
        results = run_all(averagers, noisy_deltas(4, seed=6), tokens, round_id=6)
        assert all(r is not None for r in results) and len(averagers[3].last_report.participants) == 4


def test_a_peer_whose_set_the_others_merged_elsewhere_ends_its_round_as_soon_as_they_move_on(peers):
    """Peer 3 starts its round while the others, who stopped waiting for it, are merging theirs: it merges their
    contributions with its own, but they verify their set of three and go on to their next round. Nobody can
    apply peer 3's set: once its other senders are past it, peer 3 ends its round (no reload: nobody fetched its
    contribution) instead of waiting out its verification (20 s here), and its next round meets theirs."""
    config = gathered_config(min_matchmaking_time_s=3.0, matchmaking_timeout_s=25.0, verify_timeout_s=20.0)
    ids = [p.dht.peer_id for p in peers]
    merging, go, hold = _held_merges()
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", "superseded", SHAPES, config, p.signer, gather=p.gather,
            peers=RoundPeers(lambda: ids), weight_cap=CAP)) for p in peers]
        deltas, tokens = noisy_deltas(4, seed=7), [CAP] * 4
        with ThreadPoolExecutor(4) as pool:
            first = [pool.submit(a.run_round, d, t, round_id=5, fault=hold)
                     for a, d, t in zip(averagers[:3], deltas[:3], tokens[:3], strict=True)]
            for _ in range(3):
                assert merging.acquire(timeout=60), [a.last_report for a in averagers[:3]]
            late = pool.submit(averagers[3].run_round, deltas[3], tokens[3], round_id=5)
            wait_until(lambda: _merged_round(averagers[3], ids[3], 5), timeout=30)
            go.set()
            assert all(f.result(timeout=60) is not None for f in first), [a.last_report for a in averagers[:3]]
            assert all(len(a.last_report.participants) == 3 for a in averagers[:3])
            nxt = [pool.submit(a.run_round, d, t, round_id=6)
                   for a, d, t in zip(averagers[:3], noisy_deltas(3, seed=8), tokens[:3], strict=True)]
            assert late.result(timeout=60) is None
            report = averagers[3].last_report
            assert report.status is RoundStatus.SUPERSEDED and not report.needs_reload, report
            assert all(f.result(timeout=60) is not None for f in nxt), [a.last_report for a in averagers[:3]]
        results = run_all(averagers, noisy_deltas(4, seed=9), tokens, round_id=7)
        assert all(r is not None for r in results), [a.last_report for a in averagers]
        assert all(len(a.last_report.participants) == 4 for a in averagers)


def test_a_contribution_stays_on_offer_until_its_round_is_told_to_end(peers):
    """Composers of unequal pace: two of four live composers reach their round and find no quorum (three); past
    their give-up time their contributions are still on offer (their rounds were not told to end), so a third that
    comes later merges with both. A waiting round told to end withdraws at once, and with nobody having fetched its
    contribution, nobody can have merged it: no reload."""
    config = gathered_config(min_matchmaking_time_s=1.0, matchmaking_timeout_s=1.5)
    ids = [p.dht.peer_id for p in peers]
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", "offer", SHAPES, config, p.signer, gather=p.gather, peers=RoundPeers(lambda: ids),
            weight_cap=CAP)) for p in peers]
        deltas, dues = noisy_deltas(3, seed=31), [threading.Event() for _ in range(3)]
        with ThreadPoolExecutor(3) as pool:
            try:
                early = [pool.submit(a.run_round, d, CAP, round_id=4, due=due)
                         for a, d, due in zip(averagers[:2], deltas[:2], dues[:2], strict=True)]
                began = time.monotonic()
                wait_until(lambda: time.monotonic() - began > 3 * config.net.matchmaking_timeout_s, timeout=30)
                records = averagers[2].records.read(ids[:2], 2.0)
                assert all(not f.done() for f in early), [a.last_report for a in averagers[:2]]
                assert all(not decode_entries(records[i])[4].fingerprint for i in ids[:2]), records
                late = pool.submit(averagers[2].run_round, deltas[2], CAP, round_id=9, due=dues[2])
                results = [f.result(timeout=60) for f in [*early, late]]
            finally:
                for due in dues:
                    due.set()
        assert all(r is not None for r in results), [a.last_report for a in averagers[:3]]
        assert all(sorted(a.last_report.participants) == sorted(ids[:3]) for a in averagers[:3])
        assert all(torch.equal(r["w"], results[0]["w"]) for r in results)

        due = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            try:
                alone = pool.submit(averagers[0].run_round, deltas[0], CAP, round_id=5, due=due)
                wait_until(lambda: 5 in decode_entries(averagers[1].records.read([ids[0]], 2.0).get(ids[0])),
                           timeout=30)
            finally:
                due.set()
            assert alone.result(timeout=30) is None
        report = averagers[0].last_report
        assert report.status is RoundStatus.NO_GROUP and not report.needs_reload, report


def test_a_set_merged_with_a_contribution_as_it_comes_off_offer_is_taken_by_its_sender(peers):
    """Peers 1 and 2 fetch peer 0's contribution and merge the three; before they publish it, peer 0 (whose view
    wants a larger quorum) is told its next round is due and takes its contribution off offer. It watches the
    records because its contribution was fetched, finds the set naming it (its view now wanting less) and merges
    it too: all three apply one result, none reloads, none applies a merge another does not."""
    config = gathered_config(min_matchmaking_time_s=1.0, verify_timeout_s=20.0)
    ids = [p.dht.peer_id for p in peers]
    strangers = [p.dht.peer_id for p in peers[3:]] + ["QmS1ow1yTo5howUpAtA11aLONGTIMEhere1", "QmNeverC0mes2"]
    seen_by_0 = [*ids[1:3], *strangers]  # peer 0 waits for a quorum of four
    merging, go, hold = _held_merges()
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", "last-call", SHAPES, config, p.signer, gather=p.gather,
            peers=RoundPeers((lambda: list(seen_by_0)) if i == 0 else (lambda: ids[:3])), weight_cap=CAP))
            for i, p in enumerate(peers[:3])]
        deltas, due = noisy_deltas(3, seed=37), threading.Event()
        with ThreadPoolExecutor(3) as pool:
            try:
                first = pool.submit(averagers[0].run_round, deltas[0], CAP, round_id=2, due=due)
                others = [pool.submit(a.run_round, d, CAP, round_id=2, fault=hold)
                          for a, d in zip(averagers[1:], deltas[1:], strict=True)]
                for _ in range(2):
                    assert merging.acquire(timeout=60), [a.last_report for a in averagers]
                due.set()
                wait_until(lambda: decode_entries(averagers[1].records.read([ids[0]], 2.0).get(ids[0])).get(
                    2, RoundEntry(2, b"", 1, 0.0)).fingerprint == WITHDRAWN, timeout=30)
                seen_by_0[:] = ids[1:3]
            finally:
                go.set()
                due.set()
            results = [f.result(timeout=60) for f in [first, *others]]
    assert all(r is not None for r in results), [a.last_report for a in averagers]
    assert all(sorted(a.last_report.participants) == sorted(ids[:3]) for a in averagers)
    assert all(torch.equal(r["w"], results[0]["w"]) for r in results)


def test_a_set_nobody_else_merges_is_taken_back_without_a_reload(peers):
    """Peer 0 counts peer 1 alone as live and merges the two; peer 1 wants a quorum of three and never takes that
    set. Nobody else published a result for peer 0's set, so nobody can have applied it: peer 0 takes its vote and
    contribution back and keeps its delta (no reload, which would take an anchor without its contribution)."""
    config = gathered_config(min_matchmaking_time_s=1.0)
    ids = [p.dht.peer_id for p in peers]
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", "unanswered", SHAPES, config, p.signer, gather=p.gather,
            peers=RoundPeers((lambda: ids[:2]) if i == 0 else (lambda: ids)), weight_cap=CAP))
            for i, p in enumerate(peers[:2])]
        deltas, due = noisy_deltas(2, seed=41), threading.Event()
        with ThreadPoolExecutor(2) as pool:
            try:
                waiting = pool.submit(averagers[1].run_round, deltas[1], CAP, round_id=3, due=due)
                assert averagers[0].run_round(deltas[0], CAP, round_id=3) is None
            finally:
                due.set()
            assert waiting.result(timeout=60) is None
    report = averagers[0].last_report
    assert report.status is RoundStatus.UNANSWERED and not report.needs_reload, report
    entry = decode_entries(averagers[1].records.read([ids[0]], 2.0).get(ids[0])).get(3)
    assert entry is not None and entry.fingerprint == WITHDRAWN, entry


def _held_merges() -> tuple[threading.Semaphore, threading.Event, Callable[[dict[str, torch.Tensor]], None]]:
    """(merging, go, hold): ``hold`` is a ``fault`` hook that stops a peer between its merge and its fingerprint,
    releasing ``merging`` once and waiting (bounded) for ``go``."""
    merging, go = threading.Semaphore(0), threading.Event()

    def hold(_merged: dict[str, torch.Tensor]) -> None:
        merging.release()
        go.wait(timeout=60)

    return merging, go, hold


def _merged_round(averager: GroupAverager, peer: str, n: int) -> bool:
    """Has ``peer`` published a fingerprint for its round ``n`` of ``averager``'s group?"""
    record = averager.records.read([peer], 2.0).get(peer)
    entry = decode_entries(record).get(n) if record is not None else None
    return entry is not None and bool(entry.fingerprint)


@pytest.mark.parametrize("blameless", [False, True])
def test_a_contribution_of_other_tensors_is_left_out_and_blamed_only_where_views_may_differ(peers, blameless):
    """Two peers name one round key for different tensors. In a shared group that is a forgery, counted against
    its sender; in a replicated experts' round (``other_tensors_blameless``) the owners' views differ for a moment:
    the contribution is left out and nobody is blamed. The second peer's tensors are larger too: the first refuses
    its body by the announced size alone (never fetched), the second by its tensors."""
    config = gathered_config(matchmaking_timeout_s=3.0)  # no quorum comes: 3 s, not 15
    ids = [p.dht.peer_id for p in peers[:2]]
    scores = [PeerScores() for _ in range(2)]
    shapes = [SHAPES, {"w": SHAPES["w"], "other": (32768,)}]
    with contextlib.ExitStack() as stack:
        averagers = [stack.enter_context(GroupAverager(
            p.dht, "gather", f"experts-0-{int(blameless)}", s, config, p.signer, gather=p.gather,
            peers=RoundPeers(lambda: ids), weight_cap=CAP, scores=score, other_tensors_blameless=blameless))
            for p, s, score in zip(peers[:2], shapes, scores, strict=True)]
        g = torch.Generator().manual_seed(3)
        deltas = [{n: torch.randn(shape, generator=g) * 0.01 for n, shape in s.items()} for s in shapes]
        results = run_all(averagers, deltas, [CAP, CAP], round_id=1)
    assert results == [None, None]  # neither merges the other's: no quorum of two
    for i, score in enumerate(scores):
        other = ids[1 - i]
        reasons = score.snapshot().get(other, {}).get("reasons", {})
        assert ("forged or malformed outer contribution" in reasons) is not blameless, (i, reasons)
