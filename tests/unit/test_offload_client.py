"""The composer's offload session with stand-in workers (in-process trainers behind futures): results applied,
a vanished or lying worker dropped with nothing lost, private layers never offloaded."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import pytest
import torch

from parallax.node.config import train as config
from parallax.node.model.sketch import Sketch
from parallax.node.offload.exchange import WorkerLimits, decode_sketch
from parallax.node.offload.proxy import TaylorProxyTrainer, encode_tensors
from parallax.node.offload.session import OffloadSession
from parallax.node.sim.simulator import ownership_for
from parallax.node.train.composer import Composer
from parallax.node.train.data import load_corpus, shard, split_corpus
from parallax.protocol.envelope import Opener, Sealer
from parallax.protocol.identity import Identity


class FakeWorkers:
    """``OffloadClient``'s interface, answered at once by in-process trainers; ``tamper`` corrupts results."""

    def __init__(self, cfg: config.TrainConfig) -> None:
        self.cfg, self.trainers, self.tamper, self.fail = cfg, {}, False, False
        self.hold: list[tuple[concurrent.futures.Future, tuple]] = []  # while ``slow``: answered on release()
        self.slow, self.sent = False, 0
        self.parts: list[tuple[tuple[int, int], list[int], int]] = []  # per answered request: expert, steps, rows
        self.lookaheads: list[int | None] = []  # per answered request: the extrapolation asked for
        self.sealer, self.opener = Sealer(Identity.generate(), "run"), Opener("run")

    def _done(self, value=None, error=None) -> concurrent.futures.Future:
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_exception(error) if error else f.set_result(value)
        return f

    def close(self) -> None:
        self.closed = True

    def onboard(self, worker, eid, step, blobs):
        self.trainers[(worker, eid)] = TaylorProxyTrainer(self.cfg, blobs)
        return self._done(None)

    def update(self, worker, message):
        self.sent += 1
        if self.slow:
            f: concurrent.futures.Future = concurrent.futures.Future()
            self.hold.append((f, (worker, message)))
            return f
        if self.fail:
            return self._done(error=TimeoutError("no answer"))
        body = self.sealer.seal(dataclasses.replace(message, to=worker))  # through the wire's encoding
        _, got, parts, lookahead = decode_sketch(body, self.cfg, WorkerLimits(), self.opener, me=worker)
        self.parts.append((got, [step for step, _ in parts], sum(sk.x_NL.shape[0] for _, sk in parts)))
        self.lookaheads.append(lookahead)
        blobs = self.trainers[(worker, got)].update(parts, lookahead)
        if self.tamper:
            blobs = encode_tensors({n: 1e6 + 0 * p for n, p in self.trainers[(worker, got)].mirror.items()}, "raw")
        return self._done(blobs)


    def release(self):
        held, self.hold, self.slow = self.hold, [], False
        for f, args in held:
            f.set_result(self.update(*args).result())


@pytest.fixture(scope="module")
def train():
    return split_corpus(load_corpus()[:100_000])[0]


def _session(train, workers, session_kw=None, **offload):
    offload = {"wait_s": 0.0, **offload}  # by default these tests drive the non-waiting composer
    cfg = config.TrainConfig(model=config.preset("tiny"), steps=20, batch_size=2,
                             offload=config.OffloadConfig(enabled=True, **offload))
    composer = Composer(cfg, ownership_for(cfg, 1)[0], shard(train, 0, 1), sampler_seed=1)
    fake = FakeWorkers(cfg)
    events = []
    session = OffloadSession(composer, fake, "run", lambda: dict(workers),
                             event=lambda kind, **f: events.append((kind, f)), retry_s=1e9, **(session_kw or {}))
    return composer, fake, session, events


def _steps(composer, session, n):
    for _ in range(n):
        composer.forward_backward()
        session.exchange()
        composer.optimizer_step()


def test_results_are_applied_and_private_layers_stay_home(train) -> None:
    composer, _, session, events = _session(train, {"w1": 1.0, "w2": 2.0}, private_layers=1)
    _steps(composer, session, 4)
    assert session.offloaded and all(eid[0] >= 1 for eid in session.offloaded)
    assert session.applied > 0 and not session.fallbacks
    # answered at once, applied at the next step's exchange: one step late
    assert dict(session.lateness) == {1: session.applied} and session.mean_lateness == 1.0
    assert {w for _, f in events for w in [f["worker"]]} <= {"w1", "w2"}


def test_a_vanished_worker_is_dropped_and_its_experts_train_locally(train) -> None:
    workers = {"w1": 1.0}
    composer, _, session, events = _session(train, workers)
    _steps(composer, session, 3)
    assert composer.offloaded_experts()
    workers.clear()
    _steps(composer, session, 1)
    assert not composer.offloaded_experts() and not session.offloaded
    assert [k for k, _ in events].count("offload_fallback") == len(session.fallbacks) > 0


@pytest.mark.parametrize("fault", ["tamper", "fail"])
def test_a_bad_or_silent_worker_is_dropped(train, fault) -> None:
    composer, fake, session, _ = _session(train, {"w1": 1.0})
    _steps(composer, session, 2)
    setattr(fake, fault, True)
    eid = next(iter(session.offloaded))
    _steps(composer, session, 2)
    assert not session.offloaded and session.fallbacks
    assert ("w1" in session.banned) == (fault == "tamper")
    # The refused change never reached the weights.
    assert all(float(p.abs().max()) < 1e3 for p in composer.model.expert_parameters(*eid).values())


def _steps_sent(fake, eid):
    return [step for got, steps, _ in fake.parts if got == eid for step in steps]


def test_a_slow_worker_gets_the_same_steps_in_fewer_requests(train) -> None:
    composer, fake, session, _ = _session(train, {"w1": 1.0})
    _steps(composer, session, 3)
    offloaded = set(session.offloaded)
    first = {eid: _steps_sent(fake, eid)[0] for eid in offloaded}
    fake.slow = True  # answers nothing until released: the composer must neither wait nor drop it
    before = fake.sent
    _steps(composer, session, session.max_in_flight + 3)
    assert set(session.offloaded) == offloaded and not session.fallbacks
    assert fake.sent - before == session.max_in_flight * len(offloaded)  # at most max_in_flight outstanding each
    assert all(len(entry.pending) == 3 for entry in session.offloaded.values())  # the rest waits, none dropped
    fake.release()
    _steps(composer, session, 1)
    assert max(session.lateness) == session.max_in_flight + 3  # the oldest held answer, applied now
    # The held answers are applied; the three waiting steps and this one go out as one request per expert.
    assert [len(steps) for _, steps, _ in fake.parts[-len(offloaded):]] == [4] * len(offloaded)
    assert session.coalesced == 3 * len(offloaded) and session.merged == 0
    for eid in offloaded:  # every step's sample reached the worker exactly once, in order
        assert _steps_sent(fake, eid) == list(range(first[eid], composer.step + 1))


def test_a_queue_past_max_parts_merges_its_smallest_neighbours_and_rows_stay_capped(train) -> None:
    composer, fake, session, _ = _session(train, {"w1": 1.0}, session_kw={"max_in_flight": 1, "max_parts": 3,
                                                                         "max_rows": 6, "max_held": 100})
    _steps(composer, session, 3)
    fake.slow = True
    _steps(composer, session, 8)  # one request in flight, then up to eight steps' samples
    entries = list(session.offloaded.values())
    queued = [part for entry in entries for part in entry.pending]
    # at most max_parts optimizer steps wait on the worker per expert, in flight and queued
    assert all(entry.parts_in_flight + len(entry.pending) <= 3 for entry in entries)
    assert session.merged > 0 and session.merged == sum(part.steps - 1 for part in queued)  # no step lost
    assert all(part.steps == len(part.raw) for part in queued)
    assert all(part.wire.x_NL.shape[0] <= 6 for part in queued)
    fake.release()
    _steps(composer, session, 2)
    assert all(rows <= 6 or len(steps) == 1 for _, steps, rows in fake.parts)  # requests stay under the row cap
    assert not session.fallbacks


def test_a_merged_part_is_the_mean_of_its_steps(train) -> None:
    from parallax.node.offload.session import _Offloaded, _Part

    _, _, session, _ = _session(train, {}, session_kw={"max_parts": 2, "max_rows": 10**6})
    gen = torch.Generator().manual_seed(0)
    parts = []
    for step, steps in ((1, 3), (2, 1), (3, 1)):  # an earlier merge of three steps, then two single steps
        x, g = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
        parts.append(_Part(step, Sketch(x, g, 4), [Sketch(x, g, 4)] * steps, steps))
    entry = _Offloaded("w1", None, pending=list(parts))
    session._merge(entry)
    # the pair standing for the fewest steps (the two singles) became one part worth one step: their mean
    assert [(p.step, p.steps, len(p.raw)) for p in entry.pending] == [(1, 3, 3), (3, 2, 2)]
    merged, (b, c) = entry.pending[1].wire, parts[1:]
    assert torch.allclose(merged.g_NL.T @ merged.x_NL, (b.wire.g_NL.T @ b.wire.x_NL + c.wire.g_NL.T @ c.wire.x_NL) / 2)


def test_a_worker_too_far_behind_is_dropped_before_the_composer_holds_too_much(train) -> None:
    composer, fake, session, events = _session(train, {"w1": 1.0}, session_kw={"max_held": 6})
    _steps(composer, session, 3)
    fake.slow = True
    _steps(composer, session, 8)
    drops = [f for kind, f in events if kind == "offload_fallback"]
    assert drops and all("unanswered" in f["reason"] and f["unanswered"] == 7 for f in drops)
    assert not session.offloaded


def test_a_dropped_worker_leaves_nothing_unapplied(train) -> None:
    workers = {"w1": 1.0}
    composer, fake, session, events = _session(train, workers)
    _steps(composer, session, 2)
    fake.slow = True
    _steps(composer, session, session.max_in_flight + 3)
    workers.clear()
    _steps(composer, session, 1)
    # Every unanswered step's whole sketch becomes local gradient: those in flight, those queued, this step's.
    drops = [f for kind, f in events if kind == "offload_fallback"]
    assert drops and all(f["unanswered"] == session.max_in_flight + 3 + 1 for f in drops)


def test_measured_lateness_sets_the_lookahead_asked_for(train) -> None:
    composer, fake, session, _ = _session(train, {"w1": 1.0}, lookahead_measured=True)
    _steps(composer, session, 4)
    assert fake.lookaheads[0] is None and fake.lookaheads[-1] == 1  # nothing measured yet, then one step late
    fake.slow = True
    _steps(composer, session, 6)
    fake.release()
    _steps(composer, session, 2)  # answers 6, 5, 4, 3 steps late pull the averages up
    assert max(entry.lateness for entry in session.offloaded.values()) > 2
    assert fake.lookaheads[-1] == round(session.offloaded[fake.parts[-1][0]].lateness) > 1
    default, _, plain, _ = _session(train, {"w1": 1.0})
    _steps(default, plain, 4)
    assert set(plain.client.lookaheads) == {None}  # off: the worker's own offload.lookahead


def test_waiting_applies_answers_in_their_own_step(train) -> None:
    composer, fake, session, _ = _session(train, {"w1": 1.0}, wait_s=30.0)
    _steps(composer, session, 3)
    assert session.applied and dict(session.lateness) == {0: session.applied}  # no step late
    assert set(fake.lookaheads) == {0}  # on time: nothing to extrapolate
    fake.slow = True  # a worker that answers from its own thread a moment later: still in time
    timer = threading.Timer(0.2, fake.release)
    timer.start()
    try:
        applied = session.applied
        _steps(composer, session, 1)
    finally:
        timer.cancel()
    assert session.applied > applied and set(session.lateness) == {0} and session.waited_s < 30.0


def test_waiting_is_bounded_and_a_late_answer_is_applied_later(train) -> None:
    composer, fake, session, _ = _session(train, {"w1": 1.0}, wait_s=0.05)
    _steps(composer, session, 2)
    fake.slow = True
    applied, waited = session.applied, session.waited_s
    _steps(composer, session, 2)  # nothing answers: each exchange gives up after wait_s
    assert session.applied == applied and session.waited_s - waited >= 2 * 0.05 * 0.9
    fake.release()
    _steps(composer, session, 1)
    assert session.applied > applied and max(session.lateness) >= 1 and not session.fallbacks


def test_waiting_drops_a_failing_worker_in_the_same_step(train) -> None:
    composer, fake, session, events = _session(train, {"w1": 1.0}, wait_s=30.0)
    _steps(composer, session, 2)
    fake.fail = True
    _steps(composer, session, 1)
    assert not session.offloaded and not composer.offloaded_experts()
    drops = [f for kind, f in events if kind == "offload_fallback"]
    assert drops and all(f["unanswered"] == 1 and f["step"] == composer.step for f in drops)
