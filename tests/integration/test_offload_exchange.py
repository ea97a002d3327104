"""Worker offload's P2P service between real hivemind peers on loopback: onboard, update, refusals, and
what crosses the wire to the worker."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator

import pytest
import torch
from hivemind.p2p import P2PHandlerError

from parallax.dht.testing import LocalSwarm, fixed_identity
from parallax.node.config import train as config
from parallax.node.model.sketch import Sketch
from parallax.node.model.transformer import SwiGLU
from parallax.node.offload.exchange import OffloadClient, OffloadServicer, WorkerLimits, serve, sketch_message, unserve
from parallax.node.offload.proxy import decode_tensors, encode_tensors
from parallax.node.offload.session import OffloadSession
from parallax.node.sim.simulator import ownership_for
from parallax.node.train.composer import Composer
from parallax.node.train.data import load_corpus, split_corpus

CFG = config.TrainConfig(model=config.preset("tiny"), offload=config.OffloadConfig(enabled=True, onboard_codec="raw"))
EID = (1, 2)


@pytest.fixture
def pair() -> Iterator[tuple[OffloadClient, OffloadServicer, str]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    replicas = []
    servicer = OffloadServicer(CFG, WorkerLimits(max_rows=64, update_timeout_s=10.0), fixed_identity(0), "offx")
    servicer.record = True
    servicer.wire_log = _log_requests(servicer)  # every request body exactly as the worker received it
    with LocalSwarm("offx") as swarm:
        try:
            worker = swarm.add_dht(fixed_identity(0))
            composer = swarm.add_dht(fixed_identity(1))
            for peer in (worker, composer):
                replica = asyncio.run_coroutine_threadsafe(peer.dht.hivemind_dht.replicate_p2p(), loop)
                replicas.append(replica.result(30))
            asyncio.run_coroutine_threadsafe(serve(servicer, replicas[0], "offx"), loop).result(10)
            keys = {worker.dht.peer_id: fixed_identity(0).public_key}  # what the live membership would say
            client = OffloadClient(replicas[1], loop, "offx", fixed_identity(1), keys.get, onboard_timeout_s=10.0,
                                   update_timeout_s=10.0)
            yield client, servicer, worker.dht.peer_id
        finally:
            if replicas:
                asyncio.run_coroutine_threadsafe(unserve(servicer, replicas[0], "offx"), loop).result(10)
            for p2p in replicas:
                asyncio.run_coroutine_threadsafe(p2p.shutdown(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def _log_requests(servicer: OffloadServicer) -> list[bytes]:
    """Wrap the servicer's handlers (before they are registered) so that each request's bytes are kept."""
    log: list[bytes] = []
    for name in ("rpc_onboard", "rpc_update"):
        handler = getattr(servicer, name)

        async def logged(request, context, handler=handler):
            log.append(bytes(request.serialized_info))
            return await handler(request, context)

        setattr(servicer, name, logged)
    return log


def _windows(values: torch.Tensor, width: int = 8) -> set[bytes]:
    """Every run of ``width`` consecutive values of each row, as the bytes an array of it would hold on the wire
    (uint8, int16, int32, int64, float16 and float32, little-endian)."""
    out = set()
    for row in values.reshape(-1, values.shape[-1]).tolist():
        for i in range(len(row) - width + 1):
            run = torch.tensor(row[i:i + width])
            for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32):
                out.add(run.to(dtype).numpy().tobytes())
    return out


def test_a_worker_receives_no_token_no_text_no_position_and_nothing_of_private_layers(pair) -> None:
    client, servicer, worker = pair
    offload = dataclasses.replace(CFG.offload, private_layers=1, wait_s=5.0)
    cfg = dataclasses.replace(CFG, steps=20, batch_size=2, offload=offload)
    tokens = split_corpus(load_corpus()[:50_000])[0]
    composer = Composer(cfg, ownership_for(cfg, 1)[0], tokens, sampler_seed=1)
    batches: list[torch.Tensor] = []
    sample = composer.sampler.next_batch

    def recorded():
        batch = sample()
        batches.append(batch[0])
        return batch

    composer.sampler.next_batch = recorded
    session = OffloadSession(composer, client, "offx", lambda: {worker: 1.0}, retry_s=1e9)
    for _ in range(6):
        composer.forward_backward()
        session.exchange()
        composer.optimizer_step()
    assert session.applied > 0 and servicer.wire_log, "the worker trained nothing: the test would prove nothing"
    assert session.offloaded and all(layer >= 1 for layer, _ in session.offloaded)  # layer 0 stays home
    assert all(eid[1][0] >= 1 for eid in servicer.trainers)  # the worker never held a private layer's expert
    received = b"".join(servicer.wire_log)
    text = {window for x in batches for window in _windows(x)}  # token ids: the text's bytes (byte tokenizer)
    positions = _windows(torch.arange(cfg.model.seq_len).unsqueeze(0))
    assert not [w for w in text if w in received], "a window of the batch's tokens reached the worker"
    assert not [w for w in positions if w in received], "token positions reached the worker"
    session.close()


def _expert() -> SwiGLU:
    torch.manual_seed(0)
    return SwiGLU(CFG.model.d_latent, CFG.model.d_expert)


def _sketch(rows: int = 12) -> Sketch:
    gen = torch.Generator().manual_seed(1)
    L = CFG.model.d_latent
    return Sketch(torch.randn(rows, L, generator=gen), 0.01 * torch.randn(rows, L, generator=gen), tokens=rows)


def _send(client: OffloadClient, worker: str, body: bytes) -> bytes | None:
    """One update request of exactly these bytes (not sealed by the client)."""
    return asyncio.run_coroutine_threadsafe(client._call("rpc_update", worker, body, 10.0), client.loop).result(20)


def test_onboard_then_update_returns_a_checked_weight_change(pair) -> None:
    client, servicer, worker = pair
    expert = _expert()
    weights = {n: p.detach() for n, p in expert.named_parameters()}
    client.onboard(worker, EID, 0, encode_tensors(weights, "raw")).result(20)
    blobs = client.update(worker, sketch_message(EID, [(1, _sketch())], "int8")).result(20)
    delta = decode_tensors(blobs, {n: w.shape for n, w in weights.items()})
    assert servicer.updates == 1 and any(float(d.abs().sum()) > 0 for d in delta.values())
    # What crossed to the worker: exactly x and g, float, at the latent width; no integer (token-like) arrays.
    assert [(caller, eid, names) for caller, eid, names in servicer.seen] == [
        (fixed_identity(1).public_key, EID,
         {"x": ("torch.float32", (12, CFG.model.d_latent)), "g": ("torch.float32", (12, CFG.model.d_latent))})]


def test_malformed_or_unknown_requests_are_refused_and_the_worker_keeps_serving(pair) -> None:
    client, servicer, worker = pair
    with pytest.raises(P2PHandlerError, match="not onboarded"):  # an update before onboarding
        client.update(worker, sketch_message(EID, [(1, _sketch())], "int8")).result(20)
    with pytest.raises(P2PHandlerError):  # garbage
        _send(client, worker, b"\x93garbage")
    with pytest.raises(P2PHandlerError, match="shape|expected"):  # weights of the wrong shape
        wrong = {"w_gate.weight": encode_tensors({"w": torch.zeros(3, 3)}, "raw")["w"]}
        client.onboard(worker, EID, 0, wrong).result(20)
    assert servicer.refused == 3 and servicer.trainers == {}
    weights = {n: p.detach() for n, p in _expert().named_parameters()}
    client.onboard(worker, EID, 0, encode_tensors(weights, "raw")).result(20)
    assert client.update(worker, sketch_message(EID, [(1, _sketch())], "int8")).result(20)


def test_a_replayed_or_misaddressed_sketch_is_refused_over_the_wire(pair) -> None:
    client, servicer, worker = pair
    weights = {n: p.detach() for n, p in _expert().named_parameters()}
    client.onboard(worker, EID, 0, encode_tensors(weights, "raw")).result(20)
    sealed = client.sealer.seal(dataclasses.replace(sketch_message(EID, [(1, _sketch())], "int8"), to=worker))
    assert _send(client, worker, sealed)
    with pytest.raises(P2PHandlerError, match="accepted before"):  # the same bytes again
        _send(client, worker, sealed)
    elsewhere = client.sealer.seal(dataclasses.replace(sketch_message(EID, [(2, _sketch())], "int8"), to="QmElsewhere"))
    with pytest.raises(P2PHandlerError, match="addressed to"):  # recorded by another worker, played to this one
        _send(client, worker, elsewhere)
    assert servicer.updates == 1 and servicer.refused == 2
