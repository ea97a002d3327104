"""Surrogate announcements in the DHT: who announces which versions, and who serves which payloads.

One key per layer (``keys.surrogates_key``), one subkey per node (``records.owner_subkey``: the record
is signed by that node's Ed25519 key through ``Ed25519RecordValidator``). The value is a
``SurrogateRecord``:

    peer_id   the libp2p peer id to pull payloads from (a liar only wastes a caller's timeout:
              every payload is checked against an owner-signed digest)
    deltas    owner announcements (``SurrogateDelta``: version, base_version = version - 1, digest, size)
              for the last few versions of each expert the node owns in this layer
    fulls     owner announcements of full copies: ``SurrogateDelta`` with base_version 0 (the state
              after ``version``, not a change), at most one per expert
    holds     ``Holding(expert, first, last, full)``: the delta versions first..last and the full copy at
              ``full`` that the node serves (0: none), whether it owns the expert or fetched them

Receivers trust an announcement only when its signer (the subkey) is the expert's current owner;
``holds`` from anyone just name places to pull from. The payloads themselves travel over P2P streams
(``node.gossip``); a record stays well under ``records.MAX_RECORD_BYTES`` (HIVEMIND.md trap 2).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack

from parallax.dht.adapter import SwarmDHT
from parallax.dht.keys import surrogates_key
from parallax.dht.records import MAX_RECORD_BYTES, owner_subkey, subkey_owner
from parallax.protocol.errors import LocalProtocolError, RemoteProtocolError
from parallax.protocol.identity import Identity, fingerprint
from parallax.protocol.messages import MAX_EXPERT, SurrogateDelta
from parallax.protocol.schema import MSGPACK_ERRORS

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_ENTRIES = 256  # per list in one record; the byte cap bites first


@dataclass(frozen=True, slots=True)
class Holding:
    """What a node serves for one expert: delta versions ``first..last`` and the full copy at ``full``."""

    expert: int
    first: int = 0
    last: int = 0
    full: int = 0

    def has_delta(self, version: int) -> bool:
        return self.first >= 1 and self.first <= version <= self.last

    def has_full(self, version: int) -> bool:
        return self.full >= 1 and self.full == version


@dataclass(frozen=True, slots=True)
class SurrogateRecord:
    """One node's surrogate entry for one layer (see the module docstring)."""

    peer_id: str
    deltas: tuple[SurrogateDelta, ...] = ()
    fulls: tuple[SurrogateDelta, ...] = ()
    holds: tuple[Holding, ...] = ()

    def encode(self) -> bytes:
        """Canonical bytes: ``msgpack([1, peer_id, [delta bodies], [full bodies], [[e, first, last, full]]])``.

        Raises:
            LocalProtocolError: the record exceeds ``MAX_RECORD_BYTES`` (announce fewer versions).
        """
        data: bytes = msgpack.packb(
            [
                RECORD_VERSION,
                self.peer_id,
                [d.encode() for d in self.deltas],
                [f.encode() for f in self.fulls],
                [[h.expert, h.first, h.last, h.full] for h in self.holds],
            ],
            use_bin_type=True,
        )
        if len(data) > MAX_RECORD_BYTES:
            raise LocalProtocolError(f"surrogate record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
        return data

    @classmethod
    def decode(cls, data: object, *, layer: int, peer: str | None = None) -> SurrogateRecord:
        """Parse a peer's record for ``layer``; entries for another layer or inconsistent ones refuse it all.

        Raises:
            RemoteProtocolError: anything malformed (the caller logs and skips the record).
        """

        def bad(why: str) -> RemoteProtocolError:
            return RemoteProtocolError(f"surrogate record: {why}", peer=peer)

        if not isinstance(data, bytes) or len(data) > MAX_RECORD_BYTES:
            raise bad("not a bounded byte string")
        try:
            obj = msgpack.unpackb(data, raw=False, max_bin_len=MAX_RECORD_BYTES, max_str_len=256,
                                  max_array_len=MAX_ENTRIES, max_map_len=0, max_ext_len=0)
        except MSGPACK_ERRORS as e:
            raise bad(f"undecodable ({type(e).__name__})") from None
        if not (isinstance(obj, list) and len(obj) >= 5 and obj[0] == RECORD_VERSION):
            raise bad("not [1, peer_id, deltas, fulls, holds]")
        _, peer_id, deltas, fulls, holds = obj[:5]  # later versions may append fields
        if not (isinstance(peer_id, str) and 1 <= len(peer_id) <= 128):
            raise bad("peer_id is not a short string")
        if not (isinstance(deltas, list) and isinstance(fulls, list) and isinstance(holds, list)):
            raise bad("deltas, fulls and holds must be arrays")

        def announcements(items: list[object], full: bool) -> tuple[SurrogateDelta, ...]:
            out = []
            for body in items:
                if not isinstance(body, bytes):
                    raise bad("an announcement is not bytes")
                ann = SurrogateDelta.decode(body, peer=peer)
                if ann.layer != layer:
                    raise bad(f"announcement for layer {ann.layer} under the key of layer {layer}")
                if full and ann.base_version != 0:
                    raise bad("a full-copy announcement must have base_version 0")
                if not full and ann.base_version != ann.version - 1:
                    raise bad("a delta announcement must have base_version = version - 1")
                out.append(ann)
            return tuple(out)

        parsed_holds = []
        for h in holds:
            if not (isinstance(h, list) and len(h) == 4 and all(type(x) is int and x >= 0 for x in h)):
                raise bad("a holding is not [expert, first, last, full] of non-negative ints")
            if h[0] > MAX_EXPERT or h[1] > h[2]:
                raise bad(f"holding {h} is out of range")
            parsed_holds.append(Holding(*h))
        return cls(peer_id, announcements(deltas, False), announcements(fulls, True), tuple(parsed_holds))


def store_record(
    dht: SwarmDHT,
    identity: Identity,
    run_id: str,
    layer: int,
    record: SurrogateRecord,
    expiration_time: float,
    *,
    timeout_s: float,
) -> bool:
    """Store ``record`` under this node's subkey of the layer's key; False when no peer accepted it."""
    return dht.store(surrogates_key(run_id, layer), owner_subkey(identity.public_key), record.encode(),
                     expiration_time, timeout_s=timeout_s)


def read_records(
    dht: SwarmDHT, run_id: str, layers: Sequence[int], *, timeout_s: float
) -> dict[int, dict[bytes, SurrogateRecord]] | None:
    """Every valid record of ``layers``: ``{layer: {signer public key: record}}``.

    Records under foreign (unsigned) subkeys and malformed ones are logged at debug level and skipped.
    Returns ``None`` when the DHT call failed or timed out (the caller keeps its previous view).
    """
    keys = {surrogates_key(run_id, layer): layer for layer in layers}
    found = dht.get_dicts(list(keys), latest=True, timeout_s=timeout_s)
    if found is None:
        return None
    out: dict[int, dict[bytes, SurrogateRecord]] = {}
    for key, layer in keys.items():
        records: dict[bytes, SurrogateRecord] = {}
        for subkey, (value, _expiration) in found.get(key, {}).items():
            signer = subkey_owner(subkey)
            if signer is None or value is None:
                continue
            try:
                records[signer] = SurrogateRecord.decode(value, layer=layer, peer=fingerprint(signer))
            except RemoteProtocolError as e:
                logger.debug("skipping a surrogate record: %s", e)
        out[layer] = records
    return out


def fit_record(peer_id: str, deltas: Iterable[SurrogateDelta], fulls: Iterable[SurrogateDelta],
               holds: Iterable[Holding]) -> SurrogateRecord:
    """The largest record that fits the byte cap: drops the oldest delta announcements first.

    The newest delta and the full copy of every expert always stay; if even those do not fit, experts
    beyond the cap are left out (and logged): a layer with that many owned experts needs more keys.
    """
    deltas, fulls, holds = list(deltas), list(fulls), list(holds)
    while True:
        record = SurrogateRecord(peer_id, tuple(deltas), tuple(fulls), tuple(holds))
        try:
            record.encode()
            return record
        except LocalProtocolError:
            pass
        newest: dict[int, int] = {}
        for d in deltas:
            if d.version > newest.get(d.expert, 0):
                newest[d.expert] = d.version
        droppable = [d for d in deltas if d.version != newest[d.expert]]
        if droppable:
            deltas.remove(min(droppable, key=lambda d: d.version))
            continue
        experts = [d.expert for d in deltas] + [f.expert for f in fulls] + [h.expert for h in holds]
        if not experts:
            return SurrogateRecord(peer_id)
        dropped = max(experts)
        logger.warning("surrogate record too large: leaving out expert %d of layer announcements", dropped)
        deltas = [d for d in deltas if d.expert != dropped]
        fulls = [f for f in fulls if f.expert != dropped]
        holds = [h for h in holds if h.expert != dropped]


__all__ = ["Holding", "SurrogateRecord", "fit_record", "read_records", "store_record"]
