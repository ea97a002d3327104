"""Worker offload's wire, pure parts: request bounds and signatures, what a sketch request may carry, worker
assignment."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
import torch

from parallax.node.config import train as config
from parallax.node.model.sketch import Sketch
from parallax.node.offload.exchange import (
    OffloadClient,
    OffloadServicer,
    WorkerLimits,
    assign_to_workers,
    check_size,
    decode_onboard,
    decode_sketch,
    sketch_message,
)
from parallax.protocol import codec
from parallax.protocol.envelope import Opener, Sealer, seal
from parallax.protocol.errors import BadSignature, LocalProtocolError, RemoteProtocolError, ReplayedMessage, WrongRun
from parallax.protocol.identity import Identity
from parallax.protocol.messages import ExpertSnapshot, WorkerResult
from parallax.protocol.messages import Sketch as SketchMessage

CFG = config.TrainConfig(model=config.preset("tiny"), offload=config.OffloadConfig(enabled=True, private_layers=1))
L = CFG.model.d_latent
LIMITS = WorkerLimits(max_rows=16)
RUN = "offx"
WORKER = "QmWorker"
COMPOSER, MALLORY, WORKER_KEY = Identity.generate(), Identity.generate(), Identity.generate()


def _sealed(message, *, to: str | None = WORKER, sealer: Sealer | None = None) -> bytes:
    """A request envelope as a composer sends it: addressed ``to`` the worker, signed by COMPOSER."""
    return (sealer or Sealer(COMPOSER, RUN)).seal(dataclasses.replace(message, to=to))


def _decode_sketch(data: bytes, opener: Opener | None = None):
    """What the worker does with an update request before training on it: open, check, record its number."""
    opener = opener or Opener(RUN, replay_window=64)
    got = decode_sketch(data, CFG, LIMITS, opener, me=WORKER)
    opener.accept(got[0])
    return got


def _sketch(rows: int = 5, width: int = L) -> Sketch:
    gen = torch.Generator().manual_seed(0)
    return Sketch(torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen), tokens=rows)


def test_a_sketch_round_trips_at_the_latent_width() -> None:
    envelope, eid, [(step, got)], _ = _decode_sketch(_sealed(sketch_message((1, 2), [(7, _sketch())], "int8")))
    assert (envelope.sender, eid, step) == (COMPOSER.public_key, (1, 2), 7)
    assert got.x_NL.shape == (5, L) and got.x_NL.dtype == torch.float32
    assert torch.allclose(got.g_NL, _sketch().g_NL, atol=0.05)


def test_coalesced_steps_come_apart_as_they_were_sent() -> None:
    a, b = _sketch(rows=3), Sketch(torch.ones(2, L), -torch.ones(2, L), tokens=9)
    message = sketch_message((1, 2), [(7, a), (9, b)], "raw")
    assert message.parts == ((7, 3, 3), (9, 2, 9)) and (message.step, message.tokens) == (9, 12)
    _, _, parts, _ = _decode_sketch(_sealed(message))
    assert [(step, s.tokens) for step, s in parts] == [(7, 3), (9, 9)]
    assert torch.equal(parts[0][1].x_NL, a.x_NL) and torch.equal(parts[1][1].g_NL, b.g_NL)
    # parts that do not add up to the rows sent are refused
    lying = dataclasses.replace(message, parts=((7, 3, 3), (9, 3, 9)))
    with pytest.raises(RemoteProtocolError, match="parts hold 6 rows"):
        _decode_sketch(_sealed(lying))


@pytest.mark.parametrize("parts, step, tokens", [
    (((9, 3, 3), (7, 2, 9)), 7, 12),  # steps out of order
    (((7, 3, 3), (7, 2, 9)), 7, 12),  # a step twice
    (((7, 3, 3), (9, 2, 9)), 10, 12),  # the last part is not the sketch's step
    (((7, 3, 3), (9, 2, 9)), 9, 13),  # tokens do not add up
])
def test_inconsistent_parts_do_not_make_a_message(parts, step, tokens) -> None:
    message = sketch_message((1, 2), [(1, _sketch())], "raw")
    with pytest.raises(LocalProtocolError):
        dataclasses.replace(message, parts=parts, step=step, tokens=tokens)


def test_the_lookahead_asked_for_travels_and_is_bounded() -> None:
    *_, lookahead = _decode_sketch(_sealed(sketch_message((1, 2), [(7, _sketch())], "int8", lookahead=3)))
    assert lookahead == 3
    with pytest.raises(LocalProtocolError):
        sketch_message((1, 2), [(7, _sketch())], "int8", lookahead=17)


def test_the_size_cap_comes_before_decoding() -> None:
    with pytest.raises(RemoteProtocolError, match="cap"):
        check_size(b"\x00" * (LIMITS.max_request_bytes + 1), LIMITS)
    with pytest.raises(RemoteProtocolError, match="cap"):
        _decode_sketch(b"\xff" * (LIMITS.max_request_bytes + 1))


@pytest.mark.parametrize("bad", [
    lambda: _sealed(sketch_message((0, 1), [(1, _sketch())], "int8")),  # a private layer
    lambda: _sealed(sketch_message((1, CFG.model.n_experts), [(1, _sketch())], "int8")),  # outside the grid
    lambda: _sealed(sketch_message((1, 0), [(1, _sketch(rows=17))], "raw")),  # more rows than the worker takes
    lambda: _sealed(sketch_message((1, 0), [(1, _sketch(width=CFG.model.d_model + 1))], "raw")),  # not the latent width
    lambda: _sealed(SketchMessage(layer=1, expert=0, step=1, tokens=3, tensors={  # token ids where x should be
        "x": codec.encode(np.arange(3 * L, dtype=np.int64).reshape(3, L), "raw"),
        "g": codec.encode(np.zeros((3, L), np.float32), "raw")})),
    lambda: _sealed(SketchMessage(layer=1, expert=0, step=1, tokens=3, tensors={  # x and g of different rows
        "x": codec.encode(np.zeros((2, L), np.float32), "raw"),
        "g": codec.encode(np.zeros((3, L), np.float32), "raw")})),
    lambda: b"\x93garbage",
    lambda: sketch_message((1, 0), [(1, _sketch())], "int8").encode(),  # a bare body: not an envelope
    lambda: _sealed(ExpertSnapshot(layer=1, expert=0, step=1, tensors={})),  # another kind
    lambda: _sealed(sketch_message((1, 0), [(1, _sketch())], "int8"), to="QmOtherWorker"),  # for another worker
    lambda: _sealed(sketch_message((1, 0), [(1, _sketch())], "int8"), to=None),  # addressed to nobody
    lambda: _sealed(sketch_message((1, 0), [(1, _sketch())], "int8"), sealer=Sealer(COMPOSER, "another-run")),
])
def test_malformed_update_requests_are_refused(bad) -> None:
    with pytest.raises(RemoteProtocolError):
        _decode_sketch(bad())


def test_a_forged_or_replayed_sketch_is_refused_and_concurrent_ones_pass_once() -> None:
    opener, sealer = Opener(RUN, replay_window=64), Sealer(COMPOSER, RUN)
    first, second = (_sealed(sketch_message((1, 0), [(step, _sketch())], "int8"), sealer=sealer) for step in (1, 2))
    _decode_sketch(second, opener)  # calls overtake each other on the wire: the older one still passes...
    _decode_sketch(first, opener)
    with pytest.raises(ReplayedMessage):  # ...once
        _decode_sketch(first, opener)
    body = dataclasses.replace(sketch_message((1, 0), [(3, _sketch())], "int8"), to=WORKER).encode()
    forged = seal(MALLORY, dataclasses.replace(sketch_message((1, 0), [(3, _sketch())], "int8"), to=WORKER),
                  run_id=RUN, seq=10**17, timestamp=time.time())
    claimed = forged.replace(MALLORY.public_key, COMPOSER.public_key)  # Mallory's signature, Alice's name
    with pytest.raises(BadSignature):
        _decode_sketch(claimed, opener)
    # Signed by Mallory: it counts as Mallory's, and reaches only trainers Mallory onboarded.
    assert _decode_sketch(forged, opener)[0].sender == MALLORY.public_key
    assert len(body) < len(forged) < len(body) + 256  # what signing costs on the wire
    with pytest.raises(WrongRun):
        other_run = Sealer(COMPOSER, "other")
        _decode_sketch(_sealed(sketch_message((1, 0), [(4, _sketch())], "int8"), sealer=other_run), opener)


def test_onboarding_is_bounded_to_offloadable_experts() -> None:
    weights = {"w": codec.encode(np.zeros(4, np.float32))}
    got = decode_onboard(_sealed(ExpertSnapshot(layer=1, expert=3, step=0, tensors=weights)), CFG, LIMITS,
                         Opener(RUN), me=WORKER)
    assert (got[0].sender, got[1]) == (COMPOSER.public_key, (1, 3))
    with pytest.raises(RemoteProtocolError, match="offloadable"):
        decode_onboard(_sealed(ExpertSnapshot(layer=0, expert=3, step=0, tensors={})), CFG, LIMITS, Opener(RUN),
                       me=WORKER)


def test_an_answer_counts_only_when_signed_by_the_key_the_membership_names() -> None:
    keys = {"QmWorker": WORKER_KEY.public_key}
    client = OffloadClient(None, None, RUN, COMPOSER, keys.get)  # type: ignore[arg-type]
    result = WorkerResult(layer=1, expert=0, step=3, tensors={})
    assert client.open_answer(Sealer(WORKER_KEY, RUN).seal(result), WorkerResult, "QmWorker").message == result
    with pytest.raises(RemoteProtocolError, match="another key than"):  # another peer's valid signature
        client.open_answer(Sealer(MALLORY, RUN).seal(result), WorkerResult, "QmWorker")
    with pytest.raises(ConnectionError, match="live membership"):  # a worker that left: dropped, not banned
        client.open_answer(Sealer(WORKER_KEY, RUN).seal(result), WorkerResult, "QmGone")
    with pytest.raises(RemoteProtocolError):  # the unsigned body
        client.open_answer(result.encode(), WorkerResult, "QmWorker")


def test_worker_limits_refuse_a_cap_above_the_unary_message_limit() -> None:
    with pytest.raises(ValueError, match="max_request_bytes"):
        WorkerLimits(max_request_bytes=5 * 2**20)


def test_assignment_is_capacity_weighted_and_moves_only_a_dead_workers_experts() -> None:
    experts = [(layer, e) for layer in range(4) for e in range(64)]
    workers = {"big": 3.0, "small": 1.0}
    got = assign_to_workers("run", experts, workers)
    share = sum(w == "big" for w in got.values()) / len(experts)
    assert 0.6 < share < 0.9  # about 3/4
    assert assign_to_workers("run", experts, workers) == got  # deterministic
    with_third = assign_to_workers("run", experts, {**workers, "third": 1.0})
    after = assign_to_workers("run", experts, workers)  # "third" died: back to exactly the old map
    assert after == got and all(with_third[e] == got[e] for e in experts if with_third[e] != "third")
    assert assign_to_workers("run", experts, {}) == {}


def test_the_worker_warms_its_device_up_and_keeps_nothing_of_it() -> None:
    servicer = OffloadServicer(CFG, LIMITS, WORKER_KEY, RUN, "cpu")
    try:
        assert servicer.warm_up() > 0
        assert servicer.trainers == {} and servicer.updates == 0 and servicer.refused == 0
    finally:
        servicer.shutdown()


def test_a_call_past_its_timeout_is_abandoned_not_cancelled(monkeypatch) -> None:
    """hivemind 1.1.12 kills a peer's unary path when a reply lands on a cancelled call: never cancel one."""
    async def scenario() -> None:
        reply = asyncio.get_running_loop().create_future()
        calls = []

        class Stub:
            async def rpc_update(self, request):  # type: ignore[no-untyped-def]
                calls.append(asyncio.current_task())
                return await reply

        monkeypatch.setattr(OffloadServicer, "get_stub", classmethod(lambda cls, *a, **k: Stub()))
        client = OffloadClient(None, asyncio.get_running_loop(), RUN, COMPOSER, {}.get,  # type: ignore[arg-type]
                               update_timeout_s=0.05)
        worker = "QmXcfVXn6BcEonj4xq4XjzKHC1AgVmQVA3uTGKexNHrgAR"
        with pytest.raises(asyncio.TimeoutError):
            await client._call("rpc_update", worker, b"x", 0.05)
        assert not calls[0].done()  # still waiting for its reply, as hivemind needs
        reply.set_result(type("Reply", (), {"serialized_info": b"late"})())
        await asyncio.sleep(0.01)
        assert calls[0].done() and not calls[0].cancelled()
        assert client.replies["rpc_update"] == 0  # a late reply counts for nothing
        assert not client._abandoned

        reply = asyncio.get_running_loop().create_future()  # never answered: given up after ten timeouts
        with pytest.raises(asyncio.TimeoutError):
            await client._call("rpc_update", worker, b"x", 0.05)
        await asyncio.sleep(0.3)
        assert not calls[1].done()
        await asyncio.sleep(0.4)
        assert calls[1].cancelled() and not client._abandoned
        caller = asyncio.ensure_future(client._call("rpc_update", worker, b"x", 10.0))  # then the peer leaves
        await asyncio.sleep(0.01)
        client.close()
        caller.cancel()
        await asyncio.sleep(0.01)
        assert calls[2].cancelled()  # nothing left pending when the loop closes

    asyncio.run(scenario())


def test_a_sketch_from_before_a_re_onboarding_is_refused() -> None:
    """Answering it would move the worker's mirror past the copy the composer re-onboarded it with."""
    from hivemind.proto import runtime_pb2

    from parallax.node.model.transformer import SwiGLU
    from parallax.node.offload.proxy import encode_tensors

    class Context:
        remote_id = type("Peer", (), {"to_base58": staticmethod(lambda: "QmComposer")})()
        local_id = type("Peer", (), {"to_base58": staticmethod(lambda: WORKER)})()

    weights = encode_tensors(dict(SwiGLU(L, CFG.model.d_expert).named_parameters()), "fp16")
    sealer = Sealer(COMPOSER, RUN)
    onboard = _sealed(ExpertSnapshot(layer=1, expert=2, step=10, tensors=weights), sealer=sealer)
    servicer = OffloadServicer(CFG, LIMITS, WORKER_KEY, RUN, "cpu")

    async def scenario() -> None:
        await servicer.rpc_onboard(runtime_pb2.ExpertInfo(serialized_info=onboard), Context())
        for step, fresh in ((9, False), (10, True)):
            request = runtime_pb2.ExpertInfo(
                serialized_info=_sealed(sketch_message((1, 2), [(step, _sketch())], "int8"), sealer=sealer))
            if fresh:
                answer = (await servicer.rpc_update(request, Context())).serialized_info
                assert Opener(RUN).open(answer, WorkerResult).sender == WORKER_KEY.public_key
            else:
                with pytest.raises(RemoteProtocolError, match="before its onboarding"):
                    await servicer.rpc_update(request, Context())
        with pytest.raises(RemoteProtocolError, match="not onboarded"):  # another composer's key: not its trainer
            await servicer.rpc_update(runtime_pb2.ExpertInfo(serialized_info=_sealed(
                sketch_message((1, 2), [(11, _sketch())], "int8"), sealer=Sealer(MALLORY, RUN))), Context())

    try:
        asyncio.run(scenario())
        assert servicer.updates == 1 and servicer.refused == 2
        assert len(servicer.opener.replay) == 2  # the composer's onboarding and sketches; nothing of Mallory's
    finally:
        servicer.shutdown()


def test_a_worker_gives_one_composer_its_share_and_makes_room_from_idle_experts() -> None:
    """Fresh keys cannot fill every slot: each composer has a share, and an idle expert makes room."""
    from hivemind.proto import runtime_pb2

    from parallax.node.model.transformer import SwiGLU
    from parallax.node.offload.proxy import encode_tensors

    class Context:
        remote_id = type("Peer", (), {"to_base58": staticmethod(lambda: "QmComposer")})()
        local_id = type("Peer", (), {"to_base58": staticmethod(lambda: WORKER)})()

    now = [0.0]
    limits = WorkerLimits(max_rows=16, max_experts=2, max_experts_per_composer=1, idle_s=60.0)
    servicer = OffloadServicer(CFG, limits, WORKER_KEY, RUN, "cpu", clock=lambda: now[0])
    weights = encode_tensors(dict(SwiGLU(L, CFG.model.d_expert).named_parameters()), "fp16")
    sybils, honest = [Identity.generate() for _ in range(2)], Identity.generate()

    def onboard(identity: Identity, expert: int) -> runtime_pb2.ExpertInfo:
        message = ExpertSnapshot(layer=1, expert=expert, step=1, tensors=weights)
        return runtime_pb2.ExpertInfo(serialized_info=_sealed(message, sealer=Sealer(identity, RUN)))

    async def scenario() -> None:
        await servicer.rpc_onboard(onboard(sybils[0], 0), Context())
        with pytest.raises(RemoteProtocolError, match="already has 1 experts"):
            await servicer.rpc_onboard(onboard(sybils[0], 1), Context())
        await servicer.rpc_onboard(onboard(sybils[1], 1), Context())
        with pytest.raises(RemoteProtocolError, match="full"):  # two fresh keys hold both slots, both busy
            await servicer.rpc_onboard(onboard(honest, 2), Context())
        now[0] = 61.0  # the Sybils onboarded and never sent a sketch since
        await servicer.rpc_onboard(onboard(honest, 2), Context())
        assert (honest.public_key, (1, 2)) in servicer.trainers and len(servicer.trainers) == 2

    try:
        asyncio.run(scenario())
    finally:
        servicer.shutdown()
