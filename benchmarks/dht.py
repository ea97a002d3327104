"""DHT benchmark: signed store/get latency for N loopback peers, and failure-detection latency.

Compare with hivemind's published numbers (1024 peers: store 14.9 ms, get 6.6 ms). Ours go through
Parallax's path: Ed25519-signed records under the peer's own subkey, through ``SwarmDHT`` (the pipe to
hivemind's DHT process included). Failure detection runs at the default timings (heartbeat every
2 s, TTL 6 s, refresh 0.5 s): a peer is SIGKILLed at a random phase of its heartbeat period and we
time until every survivor's view drops it, and until every view agrees on the new owners of its
experts with valid claims; a graceful leave times the deathrattle.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from parallax.benchmarks.report import write_report
from parallax.dht.adapter import dht_time
from parallax.dht.claims import ShardConfig
from parallax.dht.keys import members_key
from parallax.dht.membership import Membership
from parallax.dht.records import owner_subkey
from parallax.dht.testing import LocalPeer, LocalSwarm, agreed, fixed_identity, wait_until

HIVEMIND_PUBLISHED = {"peers": 1024, "store_ms": 14.9, "get_ms": 6.6}
RUN = "bench"
SHARDS = ShardConfig(n_layers=2, n_experts=8)

Progress = Callable[[str], None]


def _stats(samples_s: Sequence[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in samples_s)
    if not ms:
        return {}
    return {
        "n": len(ms),
        "median_ms": statistics.median(ms),
        "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
        "max_ms": ms[-1],
        "mean_ms": statistics.fmean(ms),
    }


def latency(n_peers: int, ops: int, progress: Progress = print) -> dict[str, Any]:
    """Start ``n_peers`` on loopback; time signed stores and latest/cached gets from random peers."""
    rng = random.Random(n_peers)
    key = members_key(RUN)
    with LocalSwarm(run_id=RUN, n_layers=0) as swarm:
        t0 = time.monotonic()
        joins = []
        for i in range(n_peers):
            t = time.monotonic()
            swarm.add_dht(fixed_identity(1000 + i))
            joins.append(time.monotonic() - t)
        progress(f"  {n_peers} peers up in {time.monotonic() - t0:.1f} s")
        peers = swarm.peers
        for p in peers:  # warm up routing tables and the key
            _store(p, key, b"warm")
        stores, gets_latest, gets_cached, failures = [], [], [], 0
        for i in range(ops):
            p, q = rng.choice(peers), rng.choice(peers)
            t = time.monotonic()
            ok = _store(p, key, f"op {i}".encode())
            stores.append(time.monotonic() - t)
            failures += not ok
            t = time.monotonic()
            got = q.dht.get_dicts([key], latest=True, timeout_s=10)
            gets_latest.append(time.monotonic() - t)
            failures += got is None or len(got[key]) < n_peers
            t = time.monotonic()
            q.dht.get_dicts([key], latest=False, timeout_s=10)
            gets_cached.append(time.monotonic() - t)
    return {
        "peers": n_peers,
        "join": _stats(joins),
        "store": _stats(stores),
        "get_latest": _stats(gets_latest),
        "get_cached": _stats(gets_cached),
        "failures": failures,
    }


def _store(p: LocalPeer, key: str, value: bytes) -> bool:
    return p.dht.store(key, owner_subkey(p.identity.public_key), value, dht_time() + 30, timeout_s=10)


def detection(n_peers: int, trials: int, rattles: int, progress: Progress = print) -> dict[str, Any]:
    """Kill (SIGKILL, no deathrattle) one peer per trial at default timings; time detection everywhere."""
    rng = random.Random(7)
    detect: list[float] = []  # seconds until every peer saw the kill
    reassign: list[float] = []
    rattle: list[float] = []
    next_id = 0

    def add(swarm: LocalSwarm) -> LocalPeer:
        nonlocal next_id
        next_id += 1
        return swarm.add(2000 + next_id, shards=SHARDS)

    with LocalSwarm(run_id=RUN, n_layers=SHARDS.n_layers) as swarm:
        live = [add(swarm) for _ in range(n_peers)]
        wait_until(partial(_all_see, live, n_peers), timeout=20)
        for trial in range(trials + rattles):
            time.sleep(rng.uniform(0.0, 2.0))  # a random phase of the victim's heartbeat period
            victim = live.pop(rng.randrange(1, len(live)))  # never the bootstrap peer
            graceful = trial >= trials
            if graceful:
                _m(victim).leave("bench")
            else:
                victim.kill()
            t = time.monotonic()
            if not graceful:
                _m(victim).abandon(wait=False)
            wait_until(partial(_gone_everywhere, live, victim.fp), timeout=15)
            (rattle if graceful else detect).append(time.monotonic() - t)
            wait_until(partial(_agreed, live, victim.fp), timeout=15)
            if not graceful:
                reassign.append(time.monotonic() - t)
            progress(f"  trial {trial + 1}: {'deathrattle' if graceful else 'kill'} seen by all after "
                     f"{(rattle if graceful else detect)[-1]:.2f} s")
            live.append(add(swarm))
            wait_until(partial(_all_see, live, n_peers), timeout=20)
    return {
        "peers": n_peers,
        "heartbeat_period_s": 2.0,
        "heartbeat_ttl_s": 6.0,
        "refresh_s": 0.5,
        "kill_detected_by_all": _stats(detect),
        "reassigned_and_claimed_in_all_views": _stats(reassign),
        "deathrattle_seen_by_all": _stats(rattle),
        "samples_s": {"detect": detect, "reassign": reassign, "deathrattle": rattle},
    }


def _m(p: LocalPeer) -> Membership:
    assert p.membership is not None
    return p.membership


def _all_see(peers: Sequence[LocalPeer], n: int) -> bool:
    return all(len(_m(p).view().alive()) == n for p in peers)


def _gone_everywhere(peers: Sequence[LocalPeer], fp: str) -> bool:
    return all(fp not in _m(p).view().alive() for p in peers)


def _agreed(peers: Sequence[LocalPeer], gone: str) -> bool:
    return agreed([_m(p).view() for p in peers], gone)


def run_dht_bench(
    sizes: Sequence[int] = (2, 8, 32),
    ops: int = 100,
    detect_peers: int = 4,
    trials: int = 5,
    rattles: int = 3,
    progress: Progress = print,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "hivemind_published": HIVEMIND_PUBLISHED,
        "latency": [],
    }
    for n in sizes:
        progress(f"store/get latency with {n} peers ({ops} ops)")
        t = time.monotonic()
        report["latency"].append(latency(n, ops, progress))
        report["latency"][-1]["wall_s"] = time.monotonic() - t
    if trials or rattles:
        progress(f"failure detection with {detect_peers} peers ({trials} kills, {rattles} deathrattles)")
        report["detection"] = detection(detect_peers, trials, rattles, progress)
    return report


def markdown(report: dict[str, Any]) -> str:
    pub = report["hivemind_published"]
    lines = [
        "| peers | join median ms | signed store median / p90 ms | get latest median / p90 ms "
        "| get cached median ms | failures |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["latency"]:
        lines.append(
            f"| {r['peers']} | {r['join']['median_ms']:.0f} | {r['store']['median_ms']:.1f} / "
            f"{r['store']['p90_ms']:.1f} | {r['get_latest']['median_ms']:.1f} / {r['get_latest']['p90_ms']:.1f} "
            f"| {r['get_cached']['median_ms']:.1f} | {r['failures']} |"
        )
    lines.append(f"| {pub['peers']} (hivemind, published) | | {pub['store_ms']} | {pub['get_ms']} | | |")
    d = report.get("detection")
    if d:
        lines += ["", f"Failure detection, {d['peers']} peers, heartbeat {d['heartbeat_period_s']:g} s, "
                  f"TTL {d['heartbeat_ttl_s']:g} s:", "", "| event | n | median s | max s |", "|---|---|---|---|"]
        for name, key in (("killed, seen dead by all", "kill_detected_by_all"),
                          ("killed, experts reassigned + claimed in all views", "reassigned_and_claimed_in_all_views"),
                          ("deathrattle seen by all", "deathrattle_seen_by_all")):
            s = d[key]
            if s:
                lines.append(f"| {name} | {s['n']} | {s['median_ms'] / 1000:.2f} | {s['max_ms'] / 1000:.2f} |")
    return "\n".join(lines)


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)
