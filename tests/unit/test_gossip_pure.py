"""The pure parts of surrogate gossip: payload codec and checks, DHT record codec, offers, the pull plan,
the payload store."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from parallax.dht.records import MAX_RECORD_BYTES
from parallax.dht.surrogates import Holding, SurrogateRecord, fit_record
from parallax.node.config.net import GossipConfig
from parallax.node.model.lowrank import ErrorFeedbackPublisher, apply_delta
from parallax.node.net.gossip import (
    LAYER_BOUND,
    MAX_GROWTH,
    Offer,
    SurrogateUpdate,
    _request_meta,
    collect_offers,
    owner_first_then_random,
    plan,
)
from parallax.node.net.surrogate_payload import (
    PayloadStore,
    decode_delta,
    decode_full,
    encode_delta,
    encode_full,
    payload_digest,
    payload_limits,
)
from parallax.protocol.errors import RemoteProtocolError
from parallax.protocol.messages import SurrogateDelta, SurrogatePayload

SHAPES = {"w_gate.weight": (8, 32), "w_down.weight": (32, 8), "norm": (8,)}
EID = (1, 3)
LIMITS = payload_limits(SHAPES, max_norm=1e3)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _ann(version: int, *, expert: int = 3, full: bool = False, digest: bytes = b"d" * 32) -> SurrogateDelta:
    return SurrogateDelta(layer=1, expert=expert, version=version, base_version=0 if full else version - 1,
                          rank=8, digest=digest, size=100)


# --- payloads ---


def test_delta_roundtrip_is_bit_identical_to_the_owner_mirror():
    pub = ErrorFeedbackPublisher(_state(0), rank=4)
    held = _state(0)
    for v in (1, 2, 3):
        factors = pub.delta(_state(v))
        body = encode_delta(*EID, v, factors)
        assert body == encode_delta(*EID, v, factors)  # canonical
        apply_delta(held, decode_delta(body, EID, v, SHAPES, LIMITS))
    assert all(torch.equal(held[n], pub.published[n]) for n in SHAPES)


def test_half_delta_travels_as_float16_and_decodes_to_the_mirror_bits():
    pub, wide = ErrorFeedbackPublisher(_state(0), rank=4, half=True), ErrorFeedbackPublisher(_state(0), rank=4)
    held = _state(0)
    for v in (1, 2, 3):
        factors = pub.delta(_state(v))
        body = encode_delta(*EID, v, factors)
        assert len(body) < 0.6 * len(encode_delta(*EID, v, wide.delta(_state(v))))
        apply_delta(held, decode_delta(body, EID, v, SHAPES, LIMITS))
    assert all(torch.equal(held[n], pub.published[n]) for n in SHAPES)


def test_full_roundtrip_and_update_apply():
    state = _state(5)
    body = encode_full(*EID, 7, state)
    got = decode_full(body, EID, 7, SHAPES, LIMITS)
    target = _state(0)
    SurrogateUpdate(*EID, 7, state=got).apply(target)
    assert all(torch.equal(target[n], state[n]) for n in SHAPES)


def _payload(tensors: dict[str, bytes], version: int = 1) -> bytes:
    return SurrogatePayload(layer=EID[0], expert=EID[1], version=version, tensors=tensors).encode()


def _raw_blob(a: np.ndarray) -> bytes:
    # Bypasses the encoder (which refuses NaN) the way a hostile peer would.
    a = np.ascontiguousarray(a, dtype="<f4")
    return msgpack.packb(["raw", "float32", list(a.shape), [], a.tobytes()], use_bin_type=True)


def _good_tensors() -> dict[str, bytes]:
    return {"w_gate.weight#u": _raw_blob(np.ones((8, 2))), "w_gate.weight#v": _raw_blob(np.ones((2, 32))),
            "w_down.weight#u": _raw_blob(np.ones((32, 2))), "w_down.weight#v": _raw_blob(np.ones((2, 8))),
            "norm#d": _raw_blob(np.ones(8))}


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t.update({"norm#d": _raw_blob(np.full(8, np.nan))}),  # NaN
        lambda t: t.update({"norm#d": _raw_blob(np.full(8, 1e6))}),  # norm bound
        lambda t: t.update({"norm#d": _raw_blob(np.ones(9))}),  # wrong shape
        lambda t: t.update({"w_gate.weight#u": _raw_blob(np.ones((8, 3)))}),  # ranks disagree
        lambda t: t.pop("w_down.weight#v"),  # missing factor
        lambda t: t.update({"extra#d": _raw_blob(np.ones(2))}),  # unexpected tensor
        lambda t: t.update({"norm#d": b"\x93junk"}),  # undecodable blob
        lambda t: t.update({"norm#d": msgpack.packb(["int8", "float32", [8], [1024], b"x" * 12])}),  # codec
    ],
)
def test_bad_delta_payloads_are_refused(mutate):
    tensors = _good_tensors()
    decode_delta(_payload(tensors), EID, 1, SHAPES, LIMITS)  # the baseline decodes
    mutate(tensors)
    with pytest.raises(RemoteProtocolError):
        decode_delta(_payload(tensors), EID, 1, SHAPES, LIMITS)


def test_payload_for_another_expert_or_version_or_garbage_is_refused():
    body = _payload(_good_tensors(), version=2)
    with pytest.raises(RemoteProtocolError):
        decode_delta(body, EID, 3, SHAPES, LIMITS)
    with pytest.raises(RemoteProtocolError):
        decode_delta(body, (1, 4), 2, SHAPES, LIMITS)
    with pytest.raises(RemoteProtocolError):
        decode_delta(b"\x00" * 40, EID, 2, SHAPES, LIMITS)
    with pytest.raises(RemoteProtocolError):
        decode_full(body, EID, 2, SHAPES, LIMITS)


def test_request_metadata_is_strict():
    assert _request_meta(msgpack.packb([3, True])) == (3, True)
    for bad in (b"", b"\xc1", msgpack.packb([0, False]), msgpack.packb([1, 1]), msgpack.packb([1, False, 2]),
                msgpack.packb({"v": 1})):
        with pytest.raises(ValueError):
            _request_meta(bad)


# --- DHT records ---


def test_record_roundtrip_and_checks():
    rec = SurrogateRecord("12D3KooWpeer", (_ann(4), _ann(5)), (_ann(5, full=True),), (Holding(3, 4, 5, 5),))
    assert SurrogateRecord.decode(rec.encode(), layer=1) == rec
    with pytest.raises(RemoteProtocolError):
        SurrogateRecord.decode(rec.encode(), layer=0)  # announcement under another layer's key
    for bad in (b"junk", msgpack.packb([1, "p", [], [], [[3, 5, 4, 0]]]), msgpack.packb([2, "p", [], [], []]),
                msgpack.packb([1, "p", [_ann(3, full=True).encode()], [], []]), 7):
        with pytest.raises(RemoteProtocolError):
            SurrogateRecord.decode(bad, layer=1)


def test_fit_record_drops_oldest_deltas_then_experts():
    deltas = [_ann(v, expert=e) for e in range(8) for v in range(1, 9)]
    fulls = [_ann(8, expert=e, full=True) for e in range(8)]
    rec = fit_record("p", deltas, fulls, [Holding(e, 1, 8, 8) for e in range(8)])
    assert len(rec.encode()) <= MAX_RECORD_BYTES
    newest = {(d.expert, d.version) for d in rec.deltas}
    assert all((e, 8) in newest for e in range(8)) and len(rec.fulls) == 8
    assert len(rec.deltas) < len(deltas)
    huge = fit_record("p", [_ann(1, expert=e) for e in range(200)], [], [])
    assert 0 < len(huge.deltas) < 200


# --- offers and plans ---

OWNER, OTHER, ME = b"o" * 32, b"x" * 32, b"m" * 32


def test_collect_offers_trusts_only_the_owner_and_lists_providers():
    records = {1: {
        OWNER: SurrogateRecord("owner", (_ann(1), _ann(2)), (_ann(2, full=True),), (Holding(3, 1, 2, 2),)),
        OTHER: SurrogateRecord("other", (_ann(9, digest=b"f" * 32),), (), (Holding(3, 1, 1, 0),)),
        ME: SurrogateRecord("me", (), (), (Holding(3, 1, 2, 0),)),
    }}
    offers = collect_offers(records, lambda eid: OWNER, ME, "me")
    offer = offers[(1, 3)]
    assert sorted(offer.deltas) == [1, 2] and offer.full.version == 2 and offer.owner_peer == "owner"
    assert offer.providers(1, full=False) == ["other", "owner"]
    assert offer.providers(2, full=False) == ["owner"] and offer.providers(2, full=True) == ["owner"]
    assert collect_offers(records, lambda eid: ME, ME, "me") == {}  # our own experts are not followed
    assert collect_offers(records, lambda eid: None, ME, "me") == {}  # unknown owner: nothing trusted
    assert owner_first_then_random(["a", "owner", "b"], "owner")[0] == "owner"
    assert sorted(owner_first_then_random(["a", "b"], "owner")) == ["a", "b"]


def _offer(deltas, full=None) -> Offer:
    return Offer("owner", {v: _ann(v, digest=bytes([v]) * 32) for v in deltas},
                 _ann(full, full=True, digest=b"F" * 32) if full else None)


def test_plan():
    assert plan(3, _offer([2, 3], full=3), max_behind=4) == plan(0, _offer([]), 4)  # nothing to do
    assert [a.version for a in plan(1, _offer([1, 2, 3], full=3), 4).deltas] == [2, 3]
    assert plan(0, _offer([4, 5, 6], full=6), 4).full.version == 6  # too far behind
    assert plan(3, _offer([3, 5], full=5), 4).full.version == 5  # 4 missing: the full copy goes further
    assert [a.version for a in plan(3, _offer([4, 6]), 4).deltas] == [4]  # no full copy: what chain there is
    assert plan(3, _offer([4, 5], full=5), 4, bad={bytes([4]) * 32}).full.version == 5  # a poisoned delta
    assert plan(3, _offer([4], full=4), 4, bad={bytes([4]) * 32, b"F" * 32}).deltas == ()
    assert [a.version for a in plan(3, _offer([4, 5, 6, 7, 8], full=2), 4).deltas] == [4, 5, 6, 7, 8]
    assert len(plan(0, _offer(range(1, 11), full=2), 4).deltas) == 10  # a stale full copy: the deltas
    assert plan(0, _offer(range(1, 11), full=7), 4).full.version == 7
    assert plan(0, _offer(range(5, 11), full=8), 4).full.version == 8  # deltas 1-4 left the window


def test_store_keeps_a_window_and_describes_its_holdings():
    store = PayloadStore(window=2)
    for v in (1, 2, 3):
        store.put(_ann(v, digest=payload_digest(b"%d" % v)), b"%d" % v, full=False, owned=True)
    store.put(_ann(3, full=True), b"full3", full=True, owned=True)
    store.put(_ann(1, full=True), b"full1", full=True)  # older: ignored
    assert store.get(EID, 1, full=False) is None and store.get(EID, 3, full=False) == b"3"
    assert store.get(EID, 3, full=True) == b"full3" and store.get(EID, 1, full=True) is None
    assert store.latest_owned(EID) == 3 and store.latest_owned((1, 4)) == 0
    rec = store.record("me", 1)
    assert rec.holds == (Holding(3, 2, 3, 3),)
    assert [a.version for a in rec.deltas] == [2, 3] and [a.version for a in rec.fulls] == [3]
    store.put(_ann(1, expert=5), b"x", full=False)  # fetched, not owned: held, not announced
    rec = store.record("me", 1)
    assert Holding(5, 1, 1, 0) in rec.holds and all(a.expert == 3 for a in rec.deltas)
    assert store.layers() == {1}


def test_config_checks():
    GossipConfig()
    for bad in (dict(poll_s=0), dict(announce_ttl_s=5, announce_period_s=10), dict(window=0),
                dict(chunk_bytes=8 * 2**20)):
        with pytest.raises(ValueError):
            GossipConfig(**bad)


def test_a_delta_that_multiplies_the_surrogate_is_measured_by_its_growth() -> None:
    g = torch.Generator().manual_seed(0)
    held = {"w": torch.randn(8, 128, generator=g) * 0.05}
    small = (torch.randn(8, 2, generator=g) * 0.01, torch.randn(2, 128, generator=g) * 0.01)
    honest = SurrogateUpdate(layer=0, expert=1, version=2, factors={"w": small})
    assert honest.growth(held) < 1.1
    u, v = small
    poisoned = SurrogateUpdate(layer=0, expert=1, version=2, factors={"w": (u * 3000, v)})  # norm ~ 1e3, under caps
    assert poisoned.growth(held) > MAX_GROWTH
    assert SurrogateUpdate(layer=0, expert=1, version=3, state={"w": held["w"] * 100}).growth(held) == 1.0
    # A near-zero tensor may grow to an ordinary size in one refresh.
    zero = {"w": torch.zeros(8, 128)}
    factors = (torch.full((8, 1), 0.1), torch.full((1, 128), 0.5))
    first = SurrogateUpdate(layer=0, expert=1, version=1, factors={"w": factors})
    assert first.growth(zero) < MAX_GROWTH


def test_deltas_each_under_the_growth_bound_cannot_compound_past_the_layer_s_other_surrogates() -> None:
    g = torch.Generator().manual_seed(1)
    others = [{"w": torch.randn(8, 128, generator=g) * 0.05} for _ in range(3)]
    held = {"w": torch.randn(8, 128, generator=g) * 0.05}
    refusals = []
    for _ in range(4):  # an owner making its surrogate 3.8x longer every refresh
        change = held["w"] * 2.8
        u, s, vh = torch.linalg.svd(change, full_matrices=False)
        update = SurrogateUpdate(layer=0, expert=1, version=2, factors={"w": (u * s, vh)})
        assert update.growth(held) < MAX_GROWTH
        refusals.append(update.layer_ratio(held, SurrogateUpdate.layer_norms(others)) > LAYER_BOUND)
        held = update.updated(held)
    assert refusals == [False, True, True, True]  # 3.8x passes once; 14x the layer's others does not
    honest = SurrogateUpdate(layer=0, expert=1, version=2, state={"w": others[0]["w"] * 1.5})
    assert honest.layer_ratio(held, SurrogateUpdate.layer_norms(others)) < 2.0  # a full copy is measured as well
    assert honest.layer_ratio(held, SurrogateUpdate.layer_norms([])) == 0.0  # nothing held to compare with
    norms = SurrogateUpdate.layer_norms([{"w": torch.full((2, 2), v)} for v in (1.0, 3.0, 2.0, 5.0)])
    assert norms == {"w": pytest.approx(4.0)}  # the lower median of the norms 2, 6, 4, 10


def test_a_refusal_for_the_layer_bound_holds_nothing_against_the_owner() -> None:
    """A receiver whose copies of the layer's other surrogates are stale (cut off for a while) measures an honest,
    fresh surrogate at several times them: the update is refused, but that is no evidence. Scored, it would ban
    honest owners, who would then own nothing in that node's view while keeping their experts in the others'."""
    from parallax.node.net.scores import Evidence

    g = torch.Generator().manual_seed(2)
    stale = [{"w": torch.randn(8, 128, generator=g) * 0.05} for _ in range(3)]
    held = {"w": torch.randn(8, 128, generator=g) * 0.05}
    fresh = SurrogateUpdate(layer=0, expert=1, version=9, state={"w": held["w"] * 6})  # grown while it was away
    refusal = fresh.verdict(held, SurrogateUpdate.layer_norms(stale))
    assert refusal is not None and refusal.layer_ratio > LAYER_BOUND and refusal.evidence is None
    u, v = torch.randn(8, 2, generator=g), torch.randn(2, 128, generator=g)
    poisoned = SurrogateUpdate(layer=0, expert=1, version=9, factors={"w": (u * 30, v)})
    refusal = poisoned.verdict(held, SurrogateUpdate.layer_norms(stale))
    assert refusal is not None and refusal.growth > MAX_GROWTH and refusal.evidence is Evidence.SURROGATE_GROWTH
    honest = SurrogateUpdate(layer=0, expert=1, version=9, state={"w": held["w"] * 1.2})
    assert honest.verdict(held, SurrogateUpdate.layer_norms(stale)) is None
