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
