"""DHT benchmark: signed store/get latency for N loopback peers, and the membership of N peers without training.

Compare with hivemind's published numbers (1024 peers: store 14.9 ms, get 6.6 ms). Ours go through
Parallax's path: Ed25519-signed records under the peer's own subkey, through ``SwarmDHT`` (the pipe to
hivemind's DHT process included). The membership runs at the default timings (heartbeat every 2 s, TTL 6 s, every
view re-read every 0.5 s, each stretched past ``full_pace_members`` live members), one ``Membership`` per peer in
this process, each with its own DHT process and p2pd:
first its steady load (the members key's read size and storers, the CPU of every peer's DHT process and p2pd, the
storers' apart, the age of every view), then a peer is SIGKILLed at a random phase of its heartbeat period and we
time until every survivor's view drops it, and until every view agrees on the new owners of its experts with valid
claims; a graceful leave times the deathrattle.
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from parallax.benchmarks.report import write_report
from parallax.dht.adapter import dht_time
from parallax.dht.claims import ShardConfig
from parallax.dht.keys import claims_key, members_key, members_keys
from parallax.dht.membership import Membership, MembershipConfig
from parallax.dht.records import owner_subkey
from parallax.dht.testing import LocalPeer, LocalSwarm, agreed, fixed_identity, wait_until
from parallax.errors import DHTError

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


def detection(n_peers: int, trials: int, rattles: int, progress: Progress = print,
              window_s: float = 20.0, full_pace_members: int = MembershipConfig().full_pace_members) -> dict[str, Any]:
    """``n_peers`` peers that only heartbeat, claim and watch (the real membership, each with its own DHT process and
    p2pd): their steady load over ``window_s``, then one peer SIGKILLed (no deathrattle) per trial and one leaving
    gracefully per rattle, at the default timings paced to ``full_pace_members``; times until every survivor saw
    it. A wait that runs out is counted (``timeouts``), not raised: on a crowded machine that is the finding."""
    rng = random.Random(7)
    detect: list[float] = []  # seconds until every peer saw the kill
    reassign: list[float] = []
    rattle: list[float] = []
    timeouts = 0
    next_id = 0
    base = MembershipConfig(full_pace_members=full_pace_members)
    timing = base.paced(n_peers)
    patience = 20.0 + n_peers + timing.heartbeat_ttl_s  # starting a DHT process takes about a second idle

    failed_starts = 0

    def add(swarm: LocalSwarm) -> LocalPeer:
        """A new peer; one whose first heartbeat the crowded DHT did not take within 30 s is counted and another
        started in its place (``LocalSwarm.add`` stops the failed one's DHT process and p2pd)."""
        nonlocal next_id, failed_starts
        while True:
            next_id += 1
            try:  # they train nothing: no work is asked for
                return swarm.add(2000 + next_id, shards=SHARDS, idle_s=0.0, full_pace_members=full_pace_members)
            except DHTError as e:
                failed_starts += 1
                progress(f"  a peer did not start ({e}); starting another")
                if failed_starts > n_peers:
                    raise

    def timed(condition: Callable[[], bool], timeout: float) -> float | None:
        nonlocal timeouts
        try:
            return wait_until(condition, timeout=timeout)
        except TimeoutError:
            timeouts += 1
            return None

    with LocalSwarm(run_id=RUN, n_layers=SHARDS.n_layers) as swarm:
        t0 = time.monotonic()
        live = [add(swarm) for _ in range(n_peers)]
        seen = timed(partial(_all_see, live, n_peers), patience)
        up_s = time.monotonic() - t0
        progress(f"  {n_peers} membership peers up in {up_s:.1f} s"
                 f"{'' if seen is not None else ' (not every view had them all)'}")
        steady = steady_load(live, window_s)
        progress(f"  steady: view age median {steady['view_age_s']['median']:.2f} s, members key read "
                 f"{steady['members_read_bytes']} B, on {steady['members_storers']} storers")
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
            gone = timed(partial(_gone_everywhere, live, victim.fp), patience)
            if gone is not None:
                (rattle if graceful else detect).append(gone)
            settled = timed(partial(_agreed, live, victim.fp), patience)
            if not graceful and settled is not None:
                reassign.append(time.monotonic() - t)
            progress(f"  trial {trial + 1}: {'deathrattle' if graceful else 'kill'} seen by all after "
                     f"{'-' if gone is None else f'{gone:.2f}'} s, views agreed "
                     f"{'never' if settled is None else f'after {time.monotonic() - t:.2f} s'}")
            live.append(add(swarm))
            timed(partial(_all_see, live, n_peers), patience)
    return {
        "peers": n_peers,
        "full_pace_members": full_pace_members,
        "stretch": base.stretch(n_peers),
        "heartbeat_period_s": timing.heartbeat_period_s,
        "heartbeat_ttl_s": timing.heartbeat_ttl_s,
        "refresh_s": timing.refresh_s,
        "up_s": round(up_s, 1),
        "steady": steady,
        "kill_detected_by_all": _stats(detect),
        "reassigned_and_claimed_in_all_views": _stats(reassign),
        "deathrattle_seen_by_all": _stats(rattle),
        "timeouts": timeouts,
        "failed_starts": failed_starts,
        "samples_s": {"detect": detect, "reassign": reassign, "deathrattle": rattle},
    }


def _cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` used so far; a gone one counts nothing."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def steady_load(live: Sequence[LocalPeer], window_s: float) -> dict[str, Any]:
    """What the run's hot keys cost while nothing happens: the size of one read of the members key (the parts of the
    level the peers read, and the whole key at level 0, which only joiners and tools read past ``full_pace_members``),
    which peers store them and the claims keys (hivemind keeps a key on the peers nearest its id), the most members
    bytes one peer stores of the level read (what a read of its part takes from it), and over ``window_s`` the CPU
    each peer's DHT process and p2pd used (in cores), the storers' apart, with the age of every view."""
    level = statistics.median_low([_m(p).level for p in live])
    whole, parts = members_key(RUN), members_keys(RUN, level)
    read = live[0].dht.get_dicts(sorted({whole, *parts}), latest=True, timeout_s=10) or {}

    def size(items: dict[Any, tuple[Any, float]] | None) -> int:
        return sum(len(v) for v, _ in (items or {}).values() if isinstance(v, bytes | bytearray))

    claims = [claims_key(RUN, layer) for layer in range(SHARDS.n_layers)]
    stored = {key: {i: size(p.dht.local_dict(key)) for i, p in enumerate(live)} for key in {whole, *parts, *claims}}
    storers = {key: [i for i, n in held.items() if n] for key, held in stored.items()}
    held_of_level = [sum(stored[key][i] for key in parts) for i in range(len(live))]
    pids = [p.dht.process_ids for p in live]
    before, mine, started = [_cpu_s(x) for x in pids], _cpu_s([os.getpid()]), time.monotonic()
    ages: list[float] = []
    while time.monotonic() - started < window_s:
        now = dht_time()
        ages += [now - _m(p).view().read_at for p in live]
        time.sleep(0.5)
    wall = time.monotonic() - started
    cores = [(_cpu_s(x) - b) / wall for x, b in zip(pids, before, strict=True)]
    storing = set().union(*storers.values())
    ages.sort()
    return {
        "window_s": round(wall, 1),
        "members_level": level,
        "members_parts": len(parts),
        "members_read_bytes": sum(size(read.get(key)) for key in parts),
        "members_part_bytes_max": max(size(read.get(key)) for key in parts),
        "members_whole_bytes": size(read.get(whole)),
        "members_storers": len(set().union(*(storers[key] for key in parts))),
        "members_storers_per_part": sorted({len(storers[key]) for key in parts}),
        "members_whole_storers": len(storers[whole]),
        "members_held_by_one_peer_max_bytes": max(held_of_level),
        "members_held_by_one_peer_whole_bytes": max(stored[whole].values()),
        "claims_storers": sorted({len(storers[key]) for key in claims}),
        "view_age_s": {"median": statistics.median(ages), "p90": ages[int(0.9 * (len(ages) - 1))], "max": ages[-1]},
        "dht_cores_per_peer_median": statistics.median(cores),
        "dht_cores_storers_median": statistics.median([cores[i] for i in storing]) if storing else None,
        "dht_cores_others_median": statistics.median(others) if (others := [c for i, c in enumerate(cores)
                                                                              if i not in storing]) else None,
        "dht_cores_total": sum(cores),
        "membership_cores": (_cpu_s([os.getpid()]) - mine) / wall,
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
    detect_peers: Sequence[int] = (4,),
    trials: int = 5,
    rattles: int = 3,
    progress: Progress = print,
    window_s: float = 20.0,
    full_pace_members: int = MembershipConfig().full_pace_members,
    json_path: str | Path | None = None,
) -> dict[str, Any]:
    """The latency table for each of ``sizes``, then a membership swarm of each of ``detect_peers``; the report
    (JSON-able) is written to ``json_path`` after each membership swarm."""
    report: dict[str, Any] = {
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)},
        "hivemind_published": HIVEMIND_PUBLISHED,
        "latency": [],
        "detection": [],
    }
    for n in sizes:
        progress(f"store/get latency with {n} peers ({ops} ops)")
        t = time.monotonic()
        report["latency"].append(latency(n, ops, progress))
        report["latency"][-1]["wall_s"] = time.monotonic() - t
    for n in detect_peers if trials or rattles else ():
        progress(f"membership of {n} peers: steady load ({window_s:g} s), {trials} kills, {rattles} deathrattles")
        t = time.monotonic()
        report["detection"].append(detection(n, trials, rattles, progress, window_s, full_pace_members))
        report["detection"][-1]["wall_s"] = time.monotonic() - t
        write(report, json_path)
    return report


def _s(stats: dict[str, float], key: str = "median_ms") -> str:
    return f"{stats[key] / 1000:.2f}" if stats else "-"


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
    rows = report.get("detection") or []
    if rows:
        d = rows[0]
        k = d.get("stretch", 1)
        lines += ["", "Membership without training (at full pace a heartbeat every "
                  f"{d['heartbeat_period_s'] / k:g} s, TTL {d['heartbeat_ttl_s'] / k:g} s, every view re-read every "
                  f"{d['refresh_s'] / k:g} s; 'periods' is the factor the nodes stretched them by past "
                  "`full_pace_members` live members); times in seconds, median / max; CPU in cores over the steady "
                  "window:", "",
                  "| peers | periods | up | view age median / p90 | members key read in parts, B (largest part) "
                  "| storers of the parts (of the whole key) | members bytes one peer holds, most: of the parts read "
                  "(of the whole key) | DHT + p2pd CPU per peer / on the storers | all memberships' CPU | kill seen "
                  "by all | kill: experts re-claimed in all views | deathrattle seen by all | waits run out |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in rows:
            st = d["steady"]
            storers = "-" if st["dht_cores_storers_median"] is None else f"{st['dht_cores_storers_median']:.3f}"
            events = [d[k] for k in ("kill_detected_by_all", "reassigned_and_claimed_in_all_views",
                                     "deathrattle_seen_by_all")]
            lines.append(
                f"| {d['peers']} | x{d.get('stretch', 1)} | {d['up_s']:.0f} | {st['view_age_s']['median']:.2f} / "
                f"{st['view_age_s']['p90']:.2f} "
                f"| {_members_read(st)} | {st['members_storers']} ({st.get('members_whole_storers', '-')}) | "
                f"{_members_held(st)} | "
                f"{st['dht_cores_per_peer_median']:.3f} / {storers} | {st['membership_cores']:.2f} | "
                + " | ".join(f"{_s(e)} / {_s(e, 'max_ms')} ({e.get('n', 0)})" if e else "-" for e in events)
                + f" | {d['timeouts']}{_failed_starts(d)} |")
    return "\n".join(lines)


def _members_read(steady: dict[str, Any]) -> str:
    parts = steady.get("members_parts", 1)
    read = f"{steady['members_read_bytes']:,}"
    return read if parts == 1 else f"{parts} x: {read} ({steady['members_part_bytes_max']:,})"


def _members_held(steady: dict[str, Any]) -> str:
    if "members_held_by_one_peer_max_bytes" not in steady:
        return "-"
    return f"{steady['members_held_by_one_peer_max_bytes']:,} ({steady['members_held_by_one_peer_whole_bytes']:,})"


def _failed_starts(row: dict[str, Any]) -> str:
    failed = row.get("failed_starts", 0)
    return f" ({failed} peers did not start)" if failed else ""


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)
