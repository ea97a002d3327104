"""Message kinds: canonical bytes, round trips, forward compatibility, and refusals of bad bodies."""

from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax.protocol import codec
from parallax.protocol.errors import (
    BadTensor,
    LocalProtocolError,
    MalformedMessage,
    OversizedMessage,
    RemoteProtocolError,
    UnknownKind,
)
from parallax.protocol.manifest import MemberCert, RunManifest
from parallax.protocol.messages import (
    KINDS,
    Deathrattle,
    ExpertSnapshot,
    ExpertSnapshotLinks,
    Heartbeat,
    Message,
    OuterRound,
    ShardClaim,
    ShardRelease,
    Sketch,
    StateOffer,
    StatePart,
    StateRequest,
    SurrogateDelta,
    SurrogatePayload,
    WorkerResult,
    message_class,
)

BLOB = codec.encode(np.arange(6, dtype=np.float32).reshape(2, 3))

EXAMPLES: dict[str, Message] = {
    m.KIND: m
    for m in [
        Heartbeat(
            peer_id="QmPeer",
            addresses=("/ip4/10.0.0.1/tcp/31337",),
            role="composer",
            capacity=1.5,
            shards=((0, 3), (1, 5)),
            step=120,
            versions={"attn": 4},
            loss=2.5,
            run=b"\x07" * 16,
            sent=1.7e9,
            suspects={"QmLiar": 3.0},
            banned=("QmLiar",),
        ),
        RunManifest(run_id="r", settings='{"seed":0}', tokenizer="bytes", corpus="c" * 64, admission="allowlist",
                    creator=b"\x03" * 32, created=1.7e9, signature=b"\x04" * 64),
        MemberCert(run=b"\x07" * 16, member=b"\x05" * 32, not_after=1.8e9, signature=b"\x06" * 64),
        Deathrattle(peer_id="QmPeer", step=7, reason="shutdown"),
        ShardClaim(layer=2, expert=7, lease_expiry=1700000030.0, step=9),
        ShardRelease(layer=2, expert=7, heir="QmHeir"),
        SurrogateDelta(layer=1, expert=2, version=3, base_version=2, rank=8, digest=b"\x01" * 32, size=4096),
        SurrogatePayload(layer=1, expert=2, version=3, tensors={"left": BLOB, "right": BLOB}),
        ExpertSnapshot(layer=0, expert=1, step=50, tensors={"w1": BLOB}),
        ExpertSnapshotLinks(layer=0, expert=1, step=50, chain=7, base=2, version=3, digest=bytes(32),
                            tensors={"link.0.w1": BLOB}),
        OuterRound(group="attn", round=4, step=400, tokens=10**6, num_peers=3, fingerprint=b"\x02" * 32),
        StateRequest(groups=("attn", "embed"), experts=((0, 1),)),
        StateOffer(peer_id="QmPeer", step=400, versions={"attn": 4}, size=10**8),
        StatePart(group="attn", version=4, index=0, total=2, tensors={"wq": BLOB}),
        Sketch(layer=0, expert=1, step=3, tokens=2, tensors={"x": BLOB, "g": BLOB}),
        WorkerResult(layer=0, expert=1, step=3, tensors={"w1": BLOB}, loss=0.5),
    ]
}

# Golden bodies: these bytes are the wire format. Changing them breaks every deployed node.
GOLDEN = {
    "heartbeat": (  # "probation": false (c2) among the fields; a reader ignores keys it does not know
        "8da961646472657373657391b72f6970342f31302e302e302e312f7463702f3331333337a662616e6e656491a6516d4c696172a8"
        "6361706163697479cb3ff8000000000000a46c6f7373cb4004000000000000a7706565725f6964a6516d50656572a970726f6261"
        "74696f6ec2a4726f6c65a8636f6d706f736572a372756ec41007070707070707070707070707070707a473656e74cb41d954fc40"
        "000000a673686172647392920003920105a47374657078a8737573706563747381a6516d4c696172cb4008000000000000a87665"
        "7273696f6e7381a46174746e04"
    ),
    "shard_claim": (
        "84a665787065727407a56c6179657202ac6c656173655f657870697279cb41d954fc47800000a47374657009"
    ),
}


def test_every_registered_kind_has_an_example():
    assert set(EXAMPLES) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip_is_exact_and_canonical(kind):
    msg = EXAMPLES[kind]
    body = msg.encode()
    back = type(msg).decode(body)
    assert back == msg
    assert back.encode() == body
    assert message_class(kind) is type(msg)


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_golden_bodies(kind):
    assert EXAMPLES[kind].encode().hex() == GOLDEN[kind]


def test_encoding_does_not_depend_on_construction_order_or_containers():
    a = Heartbeat(
        peer_id="p", addresses=["a"], role="worker", capacity=1, shards=[[1, 2]], step=0, versions={"b": 1, "a": 2}
    )
    b = Heartbeat(
        peer_id="p", addresses=("a",), role="worker", capacity=1.0, shards=((1, 2),), step=0, versions={"a": 2, "b": 1}
    )
    assert a == b and a.encode() == b.encode()
    assert isinstance(a.capacity, float)  # 1 and 1.0 must not encode differently


def test_messages_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EXAMPLES["heartbeat"].step = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        EXAMPLES["heartbeat"].versions["attn"] = 5  # type: ignore[index]


def test_unknown_fields_are_ignored_and_optional_fields_default():
    obj = msgpack.unpackb(EXAMPLES["shard_claim"].encode())
    obj["from_the_future"] = {"nested": [1, 2, 3]}
    del obj["step"]
    claim = ShardClaim.decode(msgpack.packb(obj, use_bin_type=True))
    assert claim == ShardClaim(layer=2, expert=7, lease_expiry=1700000030.0, step=0)


@pytest.mark.parametrize(
    "patch, reason",
    [
        ({"role": "king"}, "role"),
        ({"capacity": 0.0}, "capacity"),
        ({"capacity": float("nan")}, "capacity"),
        ({"capacity": True}, "capacity"),
        ({"step": -1}, "step"),
        ({"step": 2**64 - 1}, "step"),
        ({"step": "5"}, "step"),
        ({"peer_id": ""}, "peer_id"),
        ({"peer_id": b"bytes"}, "peer_id"),
        ({"shards": [[0, 1], [0, 1]]}, "twice"),
        ({"shards": [[0, 70000]]}, "shards"),
        ({"shards": [[0]]}, "shards"),
        ({"addresses": ["x"] * 17}, "addresses"),
        ({"versions": {"a": -1}}, "versions"),
        ({"versions": [1, 2]}, "versions"),
        ({"loss": float("inf")}, "loss"),
    ],
)
def test_bad_fields_are_refused_with_the_field_named(patch, reason):
    obj = {**msgpack.unpackb(EXAMPLES["heartbeat"].encode()), **patch}
    with pytest.raises(MalformedMessage, match=reason):
        Heartbeat.decode(msgpack.packb(obj, use_bin_type=True), peer="abc")


def test_missing_field_and_non_map_bodies_are_refused():
    obj = msgpack.unpackb(EXAMPLES["shard_claim"].encode())
    del obj["layer"]
    with pytest.raises(MalformedMessage, match="missing field 'layer'"):
        ShardClaim.decode(msgpack.packb(obj))
    for junk in (msgpack.packb([1, 2]), msgpack.packb(None), b"", b"\xc1", msgpack.packb({1: 2})):
        with pytest.raises(MalformedMessage):
            ShardClaim.decode(junk)


def test_truncated_bodies_are_refused():
    body = EXAMPLES["heartbeat"].encode()
    for n in range(len(body)):
        with pytest.raises(MalformedMessage):
            Heartbeat.decode(body[:n])


def test_oversized_body_is_refused_before_decoding():
    with pytest.raises(OversizedMessage):
        ShardClaim.decode(b"\x80" * (ShardClaim.MAX_BYTES + 1))


def test_cross_field_checks():
    with pytest.raises(LocalProtocolError, match="base_version"):
        SurrogateDelta(layer=1, expert=2, version=3, base_version=3, rank=8, digest=b"\x01" * 32, size=1)
    with pytest.raises(LocalProtocolError, match="index"):
        StatePart(group="g", version=1, index=2, total=2, tensors={})
    with pytest.raises(LocalProtocolError, match="expected exactly"):
        Sketch(layer=0, expert=0, step=0, tokens=1, tensors={"x": BLOB})
    with pytest.raises(LocalProtocolError, match="expected exactly"):  # no third tensor rides along
        Sketch(layer=0, expert=0, step=0, tokens=1, tensors={"x": BLOB, "g": BLOB, "gate": BLOB})


def test_building_an_invalid_message_is_a_local_error():
    with pytest.raises(LocalProtocolError, match="shard_claim.layer"):
        ShardClaim(layer=-1, expert=0, lease_expiry=1.0)
    with pytest.raises(LocalProtocolError) as info:
        ShardClaim(layer=0, expert=0, lease_expiry=float("inf"))
    assert not isinstance(info.value, RemoteProtocolError)


def test_unknown_kind():
    with pytest.raises(UnknownKind):
        message_class("no_such_kind")


def test_decode_tensors_checks_each_blob_against_the_kinds_limits():
    snap = EXAMPLES["expert_snapshot"]
    assert isinstance(snap, ExpertSnapshot)
    np.testing.assert_array_equal(snap.decode_tensors()["w1"], np.arange(6, dtype=np.float32).reshape(2, 3))
    int8 = ExpertSnapshot(layer=0, expert=1, step=0, tensors={"w1": codec.encode(np.ones(4, np.float32), "int8")})
    with pytest.raises(BadTensor, match="codec"):
        int8.decode_tensors()  # snapshots travel uncompressed or fp16 only


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(KINDS)), st.binary(max_size=256))
def test_random_bytes_raise_only_remote_errors(kind, data):
    with contextlib.suppress(RemoteProtocolError):
        KINDS[kind].decode(data)


_wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(KINDS)), st.data())
def test_structured_random_bodies_raise_only_remote_errors(kind, data):
    cls = KINDS[kind]
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    good = msgpack.unpackb(EXAMPLES[kind].encode())
    obj = {n: data.draw(_wire_values) if data.draw(st.booleans()) else good[n] for n in names}
    try:
        back = cls.decode(msgpack.packb(obj, use_bin_type=True))
    except RemoteProtocolError:
        return
    assert type(back).decode(back.encode()) == back
