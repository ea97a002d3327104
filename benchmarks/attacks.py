"""The attack benchmark: a local process swarm run clean, then once per attack with its hostile composers.

Each run (``Layout``; 4 composers and one attacker by default): a bootstrap peer; the honest composers and the
attackers' places start together (the attackers' places are honest in the clean runs, and run the attack,
``benchmarks.attacker``, in the others: one process per colluder, ``Attack.colluders``); the last composer, honest,
joins once the others passed ``join_at`` steps and loads the shared groups' state from its peers. Every honest
composer uses the same keys (so the same data order) in every run, and evaluates its own view when it leaves.
Reported per attack, from the honest composers' JSONL metrics and logs:

- ``val_loss_ratio``: the final validation loss of the honest composers that train from the start (their
  mean) over the mean of the clean runs' (target <= 1.02 for every attack on training); the clean runs' own
  ratios and ``clean_spread`` show the noise between runs. The joiner's (``joiner_val_loss_ratio``) is apart:
  its start-up takes about 20 s beside the others on two cores, so in a run of the default 2,000 steps it arrives
  about a third into the others' training (at 500 steps, as they end). In lockstep (``--lockstep``,
  ``node.lockstep``) the composers from the start train the same steps in every clean run, bit for bit, until the
  joiner comes, and when it comes moves by tens of their steps from run to run: there it comes once they passed
  ``steps``, they are judged by their evaluation at ``steps`` and train ``lockstep_window`` steps more beside it
  (``JoinPlan``). In lockstep any change in the swarm early in a run (a composer leaving, an attacker banned at
  step 10 or 30) moves this loss by 0.5-3% at step 500, so an attack whose attacker an honest composer banned is
  judged against departures beside the clean runs (``left_at``: runs without an attacker in which the first
  attacker's place leaves at a step, gracefully, as a banned attacker leaves the honest views at once; an attack of
  one composing attacker banned by the last departure's step): ``within_reference``, its loss at most the largest
  of theirs. ``banned_at_step``: the earliest step of an honest composer from the start at a ban of the attacker
  (the joiner's bans come at its own first steps);
- ``attacker_experts``: experts no measured honest composer owned four fifths into the run (the attackers'
  places' fair share: an unused place, in a run whose attack has fewer colluders than others, is an honest composer
  counted here too, as in the clean runs);
- outer rounds OK per honest composer (median), against the clean runs' (``rounds_ok_ratio``); ``left_out``: the
  contributions their applied rounds left out (median), taken from another anchor than their set's majority's;
  ``behind_streak``: the most applied rounds of one group in a row in which an honest composer's own anchor was apart
  from its set's majority's (``longest_behind``: how long it took to catch up);
- ``time_to_judged_s``: the seconds the honest composers from the start took from their first step to the step
  they are judged at (their median; ``time_ratio`` against the clean runs'). In lockstep an attack that stalls
  rounds costs this, where the asynchronous nodes train on and lose the rounds;
- ``merge_cosine``: how well each merge an honest composer applied points along its honest senders' update h (their
  contributions' mean by the capped weights; an attacker's node that crafts nothing it contributes, ``Attack.crafts``,
  is an honest sender, as its place is in a clean run), the mean over every such merge of the run (``merge_harm``;
  ``merge_progress``: the merges' length along h), against the clean runs' (``merge_cosine_ratio``, with
  ``merge_clean_spread``). A merge is a deterministic function of what arrived, so this judges an attack on the
  merge's content finer than the final loss, which moves with which rounds completed. A partitioned round's merge is
  the shares its honest mergers recorded, put together (``whole_merges``);
- ``honest_owned_share``: the share of expert-time, from the first honest step to the first composer's end of
  training, during which a composer that is not the attack's owned the expert (the unused attackers' places
  included; every composer in a clean run). ``honest_owned_fraction``: that share against the clean runs' share of
  the same places (``honest_owned_clean``: the composers but the attack's colluders, or every composer for an attack
  whose node is not a composer of the run). An attacking composer that trains keeps its fair share, as its place
  does in a clean run, so 1 is a run whose attack cost the honest composers no expert-time; an attacker that takes
  experts, or makes honest composers give theirs up, lowers it; a banned attacker's experts going to honest
  composers raise it past 1;
- ``attacker_named``: a warning in an honest log names one of the attacker's peer ids or fingerprints;
  ``attacker_banned``: an honest composer banned one of its peer ids, and how long after the attacker started;
- ``crashed``: an honest composer exited with an error or did not evaluate, or the run outlasted its 15 minutes
  (``timed_out``: its composers were stopped there and it is measured as far as it went);
- ``honest_bans``: bans of honest peers (every composer is honest in a clean run and a departure; in an attack
  run, any peer id the attacker does not speak with), each with the banning composer and the reasons;
  ``false_bans`` sums them over the clean runs and the departures (target 0: statistical evidence alone must not
  ban an honest peer).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallax.benchmarks.attacker import ATTACKS
from parallax.benchmarks.report import percent, write_report
from parallax.benchmarks.swarm import swarm_changes
from parallax.node.config.train import preset as get_preset
from parallax.node.peer.local_swarm import LocalSwarm, NodeProcess, read_metrics
from parallax.node.peer.timeline import owned_fraction, shard_at

CLEAN_RUNS = 3


@dataclass(frozen=True)
class Layout:
    """Who is who in a run: ``composers`` in all; the last is an honest joiner; the ``attackers`` places before it
    run an attack's colluders (those the attack does not use, and all of them in a clean run, are honest composers
    that are not measured); the others are the honest composers measured from the start (two at least)."""

    composers: int = 4
    attackers: int = 1

    def __post_init__(self) -> None:
        if self.attackers < 1 or not fits(self.attackers, self.composers):
            raise ValueError(f"{self.composers} composers leave fewer than two honest ones from the start beside "
                             f"{self.attackers} attackers and the joiner")

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(range(self.composers))

    @property
    def from_the_start(self) -> tuple[int, ...]:
        return tuple(range(self.composers - 1 - self.attackers))

    @property
    def attacker_places(self) -> tuple[int, ...]:
        return tuple(range(self.composers - 1 - self.attackers, self.composers - 1))

    @property
    def joiner(self) -> int:
        return self.composers - 1

    @property
    def honest(self) -> tuple[int, ...]:
        return (*self.from_the_start, self.joiner)


def fits(colluders: int, composers: int) -> bool:
    """Whether an attack's ``colluders`` fit a run of ``composers`` (``Layout``)."""
    return composers - 1 - colluders >= 2


TARGET = 1.02
RUN_BOUND_S = 900.0
"""A run's bound: one still going then is stopped and reported as it went (``timed_out``)."""
PERIODS = '{"router": 10, "latent": 20, "backbone": 30}'
IDLE_S = 10
"""``net.membership.idle_s`` of every composer: a run lasts about a minute and an honest composer's work arrives every
two seconds; identities that train nothing lose their experts 10 s after they appear (300 s by default, for
runs of hours, 60 s on loopback)."""
OWN_OPTIONS = {"steps": "--steps", "sync.periods": "10/20/30, reported", "surrogate.refresh_every": "10",
               "net.membership.idle_s": f"{IDLE_S} s, reported", "net.outer.record_merges": "on: the report reads them",
               "node.lockstep": "--lockstep", "train.eval_every": "--lockstep: the judged step",
               "node.steps": "--steps, the joiner's and the departures'",
               "node.final_eval": "on: the runs are judged by it",
               "node.snapshot_every": "20", "node.min_peers": "the composers from the start begin together",
               "node.device": "cpu"}
"""Settings the benchmark sets itself: ``--set`` may not change them behind its back (nor any ``peer.`` setting: the
local swarm sets each node's identity, addresses and files)."""


def clean_names(runs: int) -> list[str]:
    """The names of ``runs`` clean runs: clean, clean-2, clean-3, ..."""
    return ["clean", *(f"clean-{i}" for i in range(2, runs + 1))][:runs]


def is_clean(name: str) -> bool:
    return name == "clean" or (name.startswith("clean-") and name[6:].isdigit())


def departure_name(step: int) -> str:
    """The name of the run in which the first attacker's place, honest, leaves at ``step``."""
    return f"left-{step}"


def departs_at(name: str) -> int | None:
    """The step at which the first attacker's place leaves in run ``name`` (``departure_name``), None in others."""
    return int(name[5:]) if name.startswith("left-") and name[5:].isdigit() else None


def without_attacker(name: str) -> bool:
    """A clean run or a departure: every composer honest."""
    return is_clean(name) or departs_at(name) is not None


def run_attacks(*, attacks: list[str] | None = None, preset: str = "tiny", steps: int = 2000, join_at: int = 10,
                workdir: Path | None = None, progress: Any = print, clean_runs: int = CLEAN_RUNS,
                composers: int = 4, lockstep: bool = False, left_at: tuple[int, ...] = (),
                settings: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``clean_runs`` clean runs (their spread is the noise a ratio is judged against, their bans the false
    positives; with none, no ratio), one departure run per step of ``left_at`` (module docstring: the reference of
    a banned attacker's run) and one run per attack among ``composers``, with as many attackers' places as the
    attacks' most colluders, every node given ``settings`` (``PATH=VALUE``, after the bench's own); returns the
    report (JSON-able)."""
    swarm_changes(list(settings), OWN_OPTIONS)  # refuses what the benchmark sets itself, before any process starts
    if clean_runs < 0:
        raise ValueError(f"clean_runs must be >= 0, got {clean_runs}")
    if any(not 0 < step < steps for step in left_at):
        raise ValueError(f"a departure must come between the first step and step {steps}, got {list(left_at)}")
    departures = [departure_name(step) for step in sorted(set(left_at))]
    clean = clean_names(clean_runs)
    names = [n for n, a in ATTACKS.items() if fits(a.colluders, composers)] if attacks is None else attacks
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attack {unknown[0]!r}; choose from {', '.join(ATTACKS)}")
    crowded = [n for n in names if not fits(ATTACKS[n].colluders, composers)]
    if crowded:
        raise ValueError(f"attack {crowded[0]!r} has {ATTACKS[crowded[0]].colluders} colluders: it needs --composers "
                         f"{ATTACKS[crowded[0]].colluders + 3} or more (two honest composers from the start and a "
                         f"joiner beside them)")
    layout = Layout(composers, max((ATTACKS[n].colluders for n in names), default=1))
    if join_at >= steps:
        raise ValueError(f"the joiner must come before the end: join_at {join_at} >= steps {steps}")
    plan = JoinPlan.lockstep(steps) if lockstep else JoinPlan(steps, join_at, steps - join_at)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="parallax-bench-attacks-"))
    model = get_preset(preset)
    total = model.n_layers * model.n_experts
    args = ["--preset", preset, "--set", f"sync.periods={PERIODS}", "--set", "surrogate.refresh_every=10",
            "--set", f"net.membership.idle_s={IDLE_S}", "--set", "net.outer.record_merges=true", "--final-eval",
            "--snapshot-every", "20",
            *(["--set", "node.lockstep=true", "--set", f"train.eval_every={steps}"] if lockstep else []),
            *(arg for setting in settings for arg in ("--set", setting))]
    started = time.monotonic()
    runs = []
    keys = workdir / "keys"
    for name in [*clean, *departures, *names]:
        progress(f"{name}: starting ({time.monotonic() - started:.0f} s into the benchmark)")
        run = _run(name, workdir / name, keys, args, layout, plan, total=total)
        runs.append(run)
        progress(f"{name}: honest val loss {run['val_losses']}, attacker held {run['attacker_experts']} experts, "
                 f"{run['wall_s']:.0f} s" + (f" (stopped: not finished within {RUN_BOUND_S:.0f} s; see "
                                             f"{workdir / name})" if run["timed_out"] else ""))
    clean_loss, clean_joiner, clean_kept = (_mean([r[key] for r in runs[:clean_runs]])
                                            for key in ("val_loss", "joiner_val_loss", "merge_cosine"))
    references = {"clean": [r["val_loss"] for r in runs[:clean_runs]],
                  "departures": [r["val_loss"] for r in runs[:clean_runs + len(departures)]]}
    rows = []
    for run in runs:
        ratio = run["val_loss"] / clean_loss if run["val_loss"] and clean_loss else None
        joiner = run["joiner_val_loss"] / clean_joiner if run["joiner_val_loss"] and clean_joiner else None
        rounds_clean = statistics.median(r["rounds_ok"] for r in runs[:clean_runs]) if clean_runs else None
        time_clean = _median([r.get("time_to_judged_s") for r in runs[:clean_runs]])
        kept = run["merge_cosine"] / clean_kept if run["merge_cosine"] is not None and clean_kept else None
        owned_clean = honest_places_owned(run["name"], layout, runs[:clean_runs])
        owned = run["honest_owned_share"] / owned_clean if run["honest_owned_share"] is not None and owned_clean \
            else None
        rows.append({**run, "val_loss_ratio": ratio, "joiner_val_loss_ratio": joiner, "rounds_ok_clean": rounds_clean,
                     "merge_cosine_ratio": kept, "honest_owned_clean": owned_clean, "honest_owned_fraction": owned,
                     "rounds_ok_ratio": run["rounds_ok"] / rounds_clean if rounds_clean else None,
                     "time_ratio": run["time_to_judged_s"] / time_clean
                     if run.get("time_to_judged_s") is not None and time_clean else None,
                     **_against_references(run, references, max(left_at, default=0)),
                     "within_target": ratio is not None and ratio <= TARGET and not run["crashed"]})
    return {"preset": preset, "steps": steps, "join_at": plan.join_at, "judged_at": plan.judged_at,
            "founders_steps": plan.steps, "joiner_steps": plan.joiner_steps, "periods": json.loads(PERIODS),
            "idle_s": IDLE_S, "lockstep": lockstep, "settings": list(settings),
            "clean_val_loss": clean_loss, "clean_joiner_val_loss": clean_joiner,
            "clean_spread": _spread([r["val_loss"] for r in runs[:clean_runs]]),
            "clean_merge_cosine": clean_kept,
            "merge_clean_spread": _spread([r["merge_cosine"] for r in runs[:clean_runs]]),
            "false_bans": sum(len(r["honest_bans"]) for r in runs[:clean_runs + len(departures)]),
            "composers": layout.composers, "attackers": layout.attackers, "target": TARGET,
            "wall_s": time.monotonic() - started,
            "departed_val_loss": _mean([r["val_loss"] for r in rows if r["name"] in departures]),
            "reference_spread": _spread(references["departures"]) if departures else None,
            "clean": [r for r in rows if r["name"] in clean],
            "departures": [r for r in rows if r["name"] in departures],
            "attacks": [r for r in rows if not without_attacker(r["name"])],
            "workdir": str(workdir)}


def _against_references(run: dict[str, Any], references: dict[str, list[float | None]],
                        last_departure: int) -> dict[str, Any]:
    """Which runs without an attacker judge ``run``'s honest loss: the clean runs', and the departures' beside them
    for an attack of one composing attacker that the honest composers from the start banned at or before
    ``last_departure`` (``banned_at_step``; the last step a departure left at, 0: none): the swarm lost one
    composer early there too. Whether the loss is at most the largest of theirs (``within_reference``: False for a
    run with a crash, None without an attack or a known loss)."""
    if without_attacker(run["name"]):
        return {}
    attack = ATTACKS[run["name"]]
    # a departure stands for one composer leaving the honest views, before the last departure's step
    lost_one = attack.composes and attack.colluders == 1 and run["banned_at_step"] is not None \
        and run["banned_at_step"] <= last_departure
    reference = "departures" if lost_one else "clean"
    known = [v for v in references[reference] if v is not None]
    within = run["val_loss"] <= max(known) if run["val_loss"] is not None and known else None
    return {"reference": reference, "within_reference": False if run["crashed"] else within}


def _median(values: list[float | None]) -> float | None:
    known = _all_known(values)
    return statistics.median(known) if known else None


def time_to_step(records: dict[int, list[dict[str, Any]]], step: int) -> float | None:
    """Seconds the composers of ``records`` took from their first step to ``step`` (their median; None when one did
    not reach it): where every node waits for the rounds it started (``node.lockstep``), an attack that stalls them
    costs this time, not rounds."""
    took = []
    for rs in records.values():
        first = next((r["t"] for r in rs if r.get("kind") == "first_step"), None)
        reached = next((r["t"] for r in rs if r.get("kind") == "step" and r["step"] >= step), None)
        if first is None or reached is None:
            return None
        took.append(reached - first)
    return statistics.median(took) if took else None


def _all_known(values: list[float | None]) -> list[float] | None:
    """``values`` when there are some and none is None (a run that did not measure it), else None."""
    known = [v for v in values if v is not None]
    return known if known and len(known) == len(values) else None


def _mean(values: list[float | None]) -> float | None:
    known = _all_known(values)
    return statistics.mean(known) if known else None


def _spread(values: list[float | None]) -> float | None:
    """(largest - smallest) / mean: how far apart runs of one configuration end."""
    known = [v for v in values if v is not None]
    mean = _mean(values)
    return (max(known) - min(known)) / mean if mean else None


@dataclass(frozen=True)
class JoinPlan:
    """When the joiner comes and what the composers from the start are judged by: they train ``steps``; the joiner
    starts once they passed ``join_at`` and trains ``joiner_steps``; their val loss is their final evaluation, or with
    ``judged_at`` their evaluation at that step."""

    steps: int
    join_at: int
    joiner_steps: int
    judged_at: int | None = None

    @classmethod
    def lockstep(cls, steps: int) -> JoinPlan:
        """In lockstep the composers from the start train the same steps in every run until a joiner comes, and when
        it comes differs by tens of steps from run to run (its start-up takes seconds). So it comes once they passed
        ``steps``, where they are judged (``judged_at``), and they train ``lockstep_window(steps)`` more beside it."""
        window = lockstep_window(steps)
        return cls(steps + window, steps, window, judged_at=steps)


def lockstep_window(steps: int) -> int:
    """Steps the composers from the start train past ``steps`` in lockstep: the joiner's start-up (about 100 of their
    steps on 2 cores) and its training beside them."""
    return max(300, steps // 4)


def _run(name: str, folder: Path, keys: Path, args: list[str], layout: Layout, plan: JoinPlan, *,
         total: int) -> dict[str, Any]:
    # One run id for every run: experts go to composers by a hash of it (``dht.shards``), so the same identities own
    # the same experts in every run. Each run has a bootstrap peer of its own.
    swarm = LocalSwarm(folder, run_id="attack", node_args=[*args, "--steps", str(plan.steps)])
    for i in layout.nodes:  # the same identities (the attackers' too), so the same data order and shards, every run
        if (keys / f"node-{i}").exists():
            shutil.copytree(keys / f"node-{i}", folder / f"node-{i}", dirs_exist_ok=True)
    hostile = hostile_places(name, layout)
    ids_paths = [folder / f"attacker-{i}.json" for i in hostile]
    started = time.monotonic()
    attacker_spawned = time.time()
    try:
        swarm.start_bootstrap()
        # Those that start together wait for each other (an attacker whose node is not a composer of the run
        # aside): each takes its first shard from the whole assignment, not from the part of it its first read showed.
        together = str(len(layout.nodes) - 1 - (0 if not hostile or ATTACKS[name].composes else len(hostile)))
        for i in layout.nodes[:-1]:
            if i in hostile:
                swarm.add_node("--min-peers", together, launcher=(
                    "-m", "parallax.benchmarks.attacker", name, str(folder / f"attacker-{i}.json")))
            elif i == layout.attacker_places[0] and departs_at(name) is not None:
                swarm.add_node("--min-peers", together, "--steps", str(departs_at(name)))
            else:
                swarm.add_node("--min-peers", together)
        deadline = time.monotonic() + RUN_BOUND_S
        first = [swarm.nodes[i] for i in layout.from_the_start]
        while time.monotonic() < deadline and not _past(first, plan.join_at):
            if any(not n.alive for n in first):
                break
            time.sleep(0.5)
        swarm.add_node("--steps", str(plan.joiner_steps))
        # a run that outlasts the bound is stopped and reported (crashed, timed out), and the benchmark goes on
        finished = _wait(swarm, layout.honest, deadline)
    finally:
        swarm.close()
    for i in layout.nodes:
        saved = keys / f"node-{i}"
        if not saved.exists():
            saved.mkdir(parents=True)
            for key in (folder / f"node-{i}").glob("node.key*"):
                shutil.copy2(key, saved / key.name)
    run = _measure(name, swarm.nodes, layout, ids_paths, attacker_spawned, time.monotonic() - started, total,
                   judged_at=plan.judged_at, until=plan.judged_at or plan.steps)
    return {**run, "timed_out": not finished, "crashed": run["crashed"] or not finished}


def hostile_places(name: str, layout: Layout) -> tuple[int, ...]:
    """The places that run run ``name``'s attack: none in a clean run, the first of the attackers' places for each of
    its colluders otherwise."""
    return () if without_attacker(name) else layout.attacker_places[:ATTACKS[name].colluders]


def honest_places_owned(name: str, layout: Layout, clean_runs: list[dict[str, Any]]) -> float | None:
    """``honest_owned_clean`` for run ``name``: the clean runs' mean share of expert-time owned by the places that
    are honest in it (every composer for a clean run or an attack whose node is not a composer of the run)."""
    colluders = 0 if without_attacker(name) or not ATTACKS[name].composes else len(hostile_places(name, layout))
    return _mean([(r["owned_without_places"] or [None] * (colluders + 1))[colluders] for r in clean_runs]) \
        if clean_runs else None


def _past(nodes: list[NodeProcess], step: int) -> bool:
    return all(n.step >= step for n in nodes)


def _wait(swarm: LocalSwarm, indices: tuple[int, ...], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if all(not swarm.nodes[i].alive for i in indices):
            return True
        time.sleep(0.5)
    return False


def _measure(name: str, nodes: list[NodeProcess], layout: Layout, ids_paths: list[Path], attacker_spawned: float,
             wall_s: float, total: int, *, judged_at: int | None = None, until: int | None = None) -> dict[str, Any]:
    records = {n.index: read_metrics(n.metrics) for n in nodes}
    founders = {i: records[i] for i in layout.from_the_start}  # the honest composers from the start
    honest = [n for n in nodes if n.index in layout.honest]
    evals = {n.index: [r for r in records[n.index] if r.get("kind") == "final_eval"] for n in honest}
    judged = evals if judged_at is None else {
        n.index: [r for r in records[n.index] if r.get("kind") == "eval" and r.get("step") == judged_at]
        for n in honest}
    losses = [judged[i][-1]["val_loss"] for i in layout.from_the_start if judged[i]]
    crashed = any(n.process.returncode != 0 or not evals[n.index]
                  or (n.index in layout.from_the_start and not judged[n.index]) for n in honest)
    ids: dict[str, list[str]] = {"peer_ids": [], "fingerprints": []}
    for path in ids_paths:  # each colluder's
        said = json.loads(path.read_text()) if path.exists() else {}
        for key in ids:
            ids[key] += said.get(key, [])
    clean = without_attacker(name)
    hostile = hostile_places(name, layout)
    # a departing place's end is not the run's: the window runs to the first end of the others
    window = _window(records, honest, leaving=layout.attacker_places[:1] if departs_at(name) is not None else ())
    attackers = frozenset() if clean or not ATTACKS[name].crafts else frozenset(ids["peer_ids"])
    events = [r for n in honest for r in records[n.index] if r.get("kind") == "merge"]
    merges = [harm for r in whole_merges(events) if (harm := merge_harm(r, lambda peer: peer not in attackers))
              is not None]
    # In a clean run every ban is of an honest peer; in an attack run, an honest composer's of a peer id no attacker
    # speaks with.
    honest_bans = [{"by": n.index, "peer": r.get("peer"), "reasons": r.get("reasons")}
                   for n in nodes for r in records[n.index] if r.get("kind") == "banned"
                   and (clean or (n.index in layout.honest and r.get("peer") not in ids["peer_ids"]))]
    if clean:  # the same measures for the honest composers in the attackers' places
        ids = {"peer_ids": [_peer_id(records[i]) for i in layout.attacker_places], "fingerprints": []}
    bans = [r for n in honest for r in records[n.index]
            if r.get("kind") == "banned" and r.get("peer") in ids["peer_ids"]]
    words = [w for w in (*ids["peer_ids"], *ids["fingerprints"]) if w]
    warnings = [line for n in honest if n.log.exists() for line in n.log.read_text(errors="replace").splitlines()
                if " WARN" in line or " ERROR" in line]
    named = any(w in line for line in warnings for w in words)
    ok = [[r for r in records[n.index] if r.get("kind") == "round" and r.get("status") == "ok"] for n in honest]
    rounds_ok = [len(rounds) for rounds in ok]
    return {
        "name": name, "description": _description(name),
        "banned_at_step": _step_at(founders, bans),
        "val_loss": statistics.mean(losses) if len(losses) == len(layout.from_the_start) else None,
        "val_losses": losses, "attackers": len(ids_paths),
        "joiner_val_loss": evals[layout.joiner][-1]["val_loss"] if evals[layout.joiner] else None,
        "attacker_experts": _attacker_experts(records, honest, total, window), "experts": total,
        "honest_owned_share": _owned(records, [i for i in layout.nodes if i not in hostile], total, window),
        # In a clean run, the same share for the places each attack leaves honest: every composer but the first k
        # attackers' places, for k from 0 to all of them.
        "owned_without_places": [_owned(records, [i for i in layout.nodes if i not in layout.attacker_places[:k]],
                                        total, window) for k in range(len(layout.attacker_places) + 1)]
        if clean else None,
        "rounds_ok": statistics.median(rounds_ok),
        "left_out": statistics.median(sum(r.get("left_out", 0) for r in rounds) for rounds in ok),
        "behind_streak": max((longest_behind(rounds) for rounds in ok), default=0),
        "time_to_judged_s": None if until is None else time_to_step(founders, until),
        "merges": len(merges),
        "merge_cosine": statistics.mean(c for c, _ in merges) if merges else None,
        "merge_progress": statistics.mean(p for _, p in merges) if merges else None,
        "attacker_named": named, "attacker_banned": bool(bans),
        "banned_after_s": round(min(r["t"] for r in bans) - attacker_spawned, 1) if bans else None,
        "banned_by": sorted({i for i, rs in records.items() for r in rs if r in bans}),
        "honest_bans": honest_bans,
        "surrogates_refused": sum(1 for n in honest for r in records[n.index] if r.get("kind") == "surrogate_refused"),
        "own_data": own_data_audits(records, honest, frozenset(ids["peer_ids"])),
        "crashed": crashed, "exit_codes": {n.index: n.process.returncode for n in nodes}, "wall_s": round(wall_s, 1),
    }


def own_data_audits(records: dict[int, list[dict[str, Any]]], honest: list[NodeProcess],
                    places: frozenset[str]) -> dict[str, dict[str, Any]] | None:
    """What the honest composers' own-data audits (``net.outer.own_data_audits``) made of the peers in the
    attackers' places (in a clean run, the honest composers there) and of the others: audits, and the shares that
    pass (``own_data.FAILS_BELOW``), that gain more on the sender's batches than on the control's (``specific``),
    and that do so by more than the merge (``beyond_merge``); a claim that failed without an evaluation (no draws, or
    a draw count audited before) counts as none of them. None when nobody audited."""
    from parallax.node.train import own_data

    audits = [r for n in honest for r in records[n.index] if r.get("kind") == "own_data_audit"]
    if not audits:
        return None

    def evaluated(r: dict[str, Any]) -> bool:  # a claim that failed without an evaluation is neither
        return r.get("own") is not None and r.get("own_control") is not None

    out = {}
    for side, rows in (("places", [r for r in audits if r["peer"] in places]),
                       ("others", [r for r in audits if r["peer"] not in places])):
        n = len(rows)
        out[side] = {
            "audits": n,
            "passed": sum(r["margin"] > own_data.FAILS_BELOW for r in rows) / n if n else None,
            "specific": sum(evaluated(r) and r["own"] > r["own_control"] for r in rows) / n if n else None,
            "beyond_merge": sum(evaluated(r) and own_data.beyond_merge(r["own"], r["merged"], r["own_control"],
                                                                       r["merged_control"]) > 0 for r in rows) / n
            if n else None,
        }
    return out


def longest_behind(rounds: list[dict[str, Any]]) -> int:
    """The most applied rounds of one group in a row (``rounds``: one composer's ``round`` records) in which its anchor
    was apart from the one its set's majority held (``behind``): how long it took to catch up with the others."""
    run: dict[str, int] = {}
    longest = 0
    for r in rounds:
        group = str(r.get("group"))
        run[group] = run.get(group, 0) + 1 if r.get("behind") else 0
        longest = max(longest, run[group])
    return longest


def _description(name: str) -> str:
    if is_clean(name):
        return "no attacker"
    step = departs_at(name)
    return f"no attacker; the first attacker's place leaves at step {step}" if step is not None \
        else ATTACKS[name].description


def _step_at(records: dict[int, list[dict[str, Any]]], events: list[dict[str, Any]]) -> int | None:
    """The earliest step at which a composer recorded one of ``events`` (its last step before the event's time)."""
    steps = [max((r["step"] for r in records[i] if r.get("kind") == "step" and r["t"] <= e["t"]), default=0)
             for i, rs in records.items() for e in events if any(e is r for r in rs)]
    return min(steps, default=None)


def whole_merges(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The merges that ``merge`` events record, each whole as far as the events reach: a gathered round's event is its
    merge; a partitioned round's events, one from each merger of a share of its blocks, are summed per set (inner
    products add up over disjoint blocks), so a set stands for the shares its recorded mergers merged."""
    whole: list[dict[str, Any]] = []
    sets: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for e in events:
        if "blocks" not in e:
            whole.append(e)
            continue
        key = (e["group"], tuple(e["contributions"]))
        if key not in sets:
            sets[key] = {**e, "blocks": set(e["blocks"])}
            continue
        merge = sets[key]
        if merge["blocks"] & set(e["blocks"]):
            continue  # these blocks are counted already
        merge["blocks"] |= set(e["blocks"])
        merge["gram"] = [[_sum(a, b) for a, b in zip(x, y, strict=True)]
                         for x, y in zip(merge["gram"], e["gram"], strict=True)]
        merge["dots"] = [_sum(a, b) for a, b in zip(merge["dots"], e["dots"], strict=True)]
        merge["square"] += e["square"]
    return whole + list(sets.values())


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def merge_harm(event: dict[str, Any], honest: Callable[[str], bool]) -> tuple[float, float] | None:
    """What one merge (a ``merge`` event: ``train.robust.merge_geometry`` with its senders and capped weights) kept
    of its ``honest`` senders' update h, their contributions' mean by those weights: (cosine, progress) of the result
    m, cosine = m.h / (|m| |h|) (how well it points along h) and progress = m.h / |h|^2 (its length along h, in h's
    lengths: the RDA merge, averaging norms and directions apart, makes it 1-2 when nobody attacks). Computed from
    the inner products alone. None when no honest sender had a finite contribution with weight, or h or m is zero."""
    senders, gram, dots, weights = event["senders"], event["gram"], event["dots"], event["weights"]
    used = [i for i, peer in enumerate(senders) if honest(peer) and dots[i] is not None and weights[i] > 0]
    total = sum(weights[i] for i in used)
    if not used or not total > 0:
        return None
    share = {i: weights[i] / total for i in used}
    along = sum(share[i] * dots[i] for i in used)
    square = sum(share[i] * share[j] * gram[i][j] for i in used for j in used)
    if not (square > 0 and event["square"] > 0):
        return None
    return along / math.sqrt(square * event["square"]), along / square


def _peer_id(records: list[dict[str, Any]]) -> str:
    for r in records:
        if r.get("kind") == "dht_started" and "/p2p/" in str(r.get("join", "")):
            return str(r["join"]).rsplit("/p2p/", 1)[1].split()[0].split(",")[0]
    return ""


def _attacker_experts(records: dict[int, list[dict[str, Any]]], honest: list[NodeProcess], total: int,
                      window: tuple[float, float] | None) -> int | None:
    """Experts no honest composer owned four fifths into ``window`` (``_window``: late enough for the defences to
    act, before departures move experts around)."""
    if window is None:
        return None
    start, end = window
    cut = start + 0.8 * (end - start)
    owned: set[tuple[int, int]] = set()
    for n in honest:
        owned |= shard_at(records[n.index], cut)
    return total - len(owned)


def _owned(records: dict[int, list[dict[str, Any]]], places: list[int], total: int,
           window: tuple[float, float] | None) -> float | None:
    """The share of the ``total`` experts' time over ``window`` (``_window``) during which one of ``places`` owned
    the expert (None without a window)."""
    return None if window is None else owned_fraction([records[i] for i in places], total, *window)


def _window(records: dict[int, list[dict[str, Any]]], honest: list[NodeProcess],
            leaving: tuple[int, ...] = ()) -> tuple[float, float] | None:
    """From the first honest step to the first end of training of a composer but those ``leaving`` early (None
    before either)."""
    ends = [r["t"] for i, rs in records.items() if i not in leaving for r in rs
            if r.get("kind") in ("final_eval", "left")]
    starts = [r["t"] for n in honest for r in records[n.index] if r.get("kind") == "first_step"]
    return (min(starts), min(ends)) if ends and starts else None


def _lockstep_words(report: dict[str, Any]) -> str:
    if not report.get("lockstep"):
        return ""
    return (f", in lockstep (node.lockstep): the composers from the start are judged by their val loss at step "
            f"{report.get('judged_at')}, before the joiner comes, and train {report.get('founders_steps')} steps")


def markdown(report: dict[str, Any]) -> str:
    spread = report["clean_spread"]
    lines = [
        f"Attacks: {report['composers']} composers (up to {report.get('attackers', 1)} of them attackers, one an "
        f"honest joiner once the others passed step {report['join_at']}), preset {report['preset']}, "
        f"{report['steps']} steps, periods {report['periods']}, net.membership.idle_s {report['idle_s']}"
        f"{_lockstep_words(report)} "
        f"({report['wall_s'] / 60:.1f} min). Val loss: the honest composers that train from the start, against the "
        f"clean runs' mean "
        f"{_opt(report['clean_val_loss'])} "
        f"(the clean runs end {_percent(spread)} apart); target <= "
        f"{report['target']}. Bans of honest peers: {report.get('false_bans', 0)} in "
        f"{len(report['clean']) + len(report.get('departures', []))} runs without an attacker, "
        f"{sum(len(r.get('honest_bans', [])) for r in report['attacks'])} in the attack runs. Merge cosine: how "
        f"well the merges the honest composers applied point along their honest senders' mean update, against the "
        f"clean runs' {_opt(report.get('clean_merge_cosine'))} (they are {_percent(report.get('merge_clean_spread'))} "
        f"apart).{_departure_words(report)}",
        "",
        "| run | attackers | what each does | honest val loss / clean | joiner's / clean | merge cosine / clean "
        "| experts the attackers held | honest-owned expert-time (/ clean) | rounds OK (clean) | named "
        "| banned (after, step) | surrogates refused | crashed | loss at most the reference's "
        "| time to the judged step (/ clean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in [*report["clean"], *report.get("departures", []), *report["attacks"]]:
        ratio = "-" if r["val_loss_ratio"] is None else f"{r['val_loss_ratio']:.3f}"
        if not without_attacker(r["name"]) and not r["within_target"]:
            ratio = f"**{ratio}**"
        joiner = "-" if r.get("joiner_val_loss_ratio") is None else f"{r['joiner_val_loss_ratio']:.3f}"
        banned = f"yes ({r['banned_after_s']:.0f} s, {_opt(r.get('banned_at_step'))})" if r["attacker_banned"] \
            else "no"
        within = "-" if r.get("within_reference") is None else \
            f"{'yes' if r['within_reference'] else '**no**'} ({r['reference']})"
        clean_ok = "-" if r["rounds_ok_clean"] is None else f"{r['rounds_ok_clean']:g}"
        owned = "-" if r.get("honest_owned_share") is None else f"{100 * r['honest_owned_share']:.0f}%"
        if r.get("honest_owned_fraction") is not None:
            owned += f" ({r['honest_owned_fraction']:.2f})"
        attackers = r.get("attackers", 0 if without_attacker(r["name"]) else 1)
        kept = "-" if r.get("merge_cosine_ratio") is None else f"{r['merge_cosine_ratio']:.4f}"
        lines.append(f"| {r['name']} | {attackers} | {r['description']} | {ratio} | {joiner} | {kept} | "
                     f"{_opt(r['attacker_experts'])} | "
                     f"{owned} | {r['rounds_ok']:g} ({clean_ok}) | {'yes' if r['attacker_named'] else 'no'} | "
                     f"{banned} | {r['surrogates_refused']} | {'yes' if r['crashed'] else 'no'} | {within} | "
                     f"{_seconds(r.get('time_to_judged_s'), r.get('time_ratio'))} |")
    audited = [r for r in [*report["clean"], *report.get("departures", []), *report["attacks"]] if r.get("own_data")]
    if audited:
        lines += ["", "Own-data audits (net.outer.own_data_audits) by the honest composers, of the attackers' "
                  "places (in a run without an attacker, the honest composers there) / of the others: the share that "
                  "passed, that gained more on the sender's batches than on the control's (specific), and by more "
                  "than the merge did (beyond the merge).", "",
                  "| run | audits | passed | specific | beyond the merge |", "|---|---|---|---|---|"]
        for r in audited:
            a, o = r["own_data"]["places"], r["own_data"]["others"]
            shares = (f"{percent(a[k])} / {percent(o[k])}" for k in ("passed", "specific", "beyond_merge"))
            lines.append(f"| {r['name']} | {a['audits']} / {o['audits']} | {' | '.join(shares)} |")
    return "\n".join(lines)


def _departure_words(report: dict[str, Any]) -> str:
    if not report.get("departures"):
        return ""
    steps = ", ".join(str(departs_at(r["name"])) for r in report["departures"])
    return (f" Departures: runs without an attacker in which the first attacker's place leaves at step {steps} "
            f"(mean honest val loss {_opt(report.get('departed_val_loss'))}); with the clean runs they end "
            f"{_percent(report.get('reference_spread'))} apart, and an attack of one composing attacker banned by step "
            f"{departs_at(report['departures'][-1]['name'])} is judged against the largest of their losses, the "
            f"others against the clean runs'.")


def _seconds(took: float | None, ratio: float | None) -> str:
    if took is None:
        return "-"
    return f"{took:.0f} s" + ("" if ratio is None else f" ({ratio:.2f})")


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _opt(x: Any) -> str:
    return "-" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def write(report: dict[str, Any], json_path: str | Path | None) -> None:
    write_report(report, markdown(report), json_path)


if __name__ == "__main__":
    report = run_attacks(attacks=sys.argv[1:] or None)
    print(markdown(report))
