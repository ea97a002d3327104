"""Surrogate payloads: the wire layout of a delta or a full copy, its checks, and the store a node serves.

A payload is the canonical body of a ``SurrogatePayload`` message; its sha256 is what the owner signs
into its DHT announcement (``dht.surrogates``), so a payload pulled from any peer can be checked. The
tensors are float32 codec blobs, sent as float16 when that is lossless (an owner publishing with
``half`` rounds its deltas so), so a receiver's arithmetic is bit-identical to the owner's mirror
(``node.lowrank``):

    delta      ``<name>#u`` [m, r] and ``<name>#v`` [r, n] for each 2-D tensor (U @ V is the change),
               ``<name>#d`` for any other tensor (a dense change)
    full copy  ``<name>``: the state after the announced version

Everything here is pure (no network); ``node.gossip`` moves the bytes.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch

from parallax.dht.keys import ExpertId
from parallax.dht.surrogates import Holding, SurrogateRecord, fit_record
from parallax.node.model.lowrank import Factors, is_half_exact
from parallax.protocol.codec import TensorLimits, encode
from parallax.protocol.errors import RemoteProtocolError
from parallax.protocol.messages import SurrogateDelta, SurrogatePayload

"""(layer, expert)"""
Shapes = Mapping[str, tuple[int, ...]]
"""name -> shape of every tensor of one surrogate (the same for all experts)"""

MAX_RANK = 64

# --- codec --------------------------------------------------------------------------------


def payload_digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def encode_delta(layer: int, expert: int, version: int, factors: Mapping[str, Factors]) -> bytes:
    """The canonical ``SurrogatePayload`` body of a delta (see the module docstring for the layout)."""
    tensors = {}
    for name, (u, v) in factors.items():
        if v.numel() == 0:
            tensors[f"{name}#d"] = _encode_exact(u)
        else:
            tensors[f"{name}#u"] = _encode_exact(u)
            tensors[f"{name}#v"] = _encode_exact(v)
    return SurrogatePayload(layer=layer, expert=expert, version=version, tensors=tensors).encode()


def encode_full(layer: int, expert: int, version: int, state: Mapping[str, torch.Tensor]) -> bytes:
    """The canonical ``SurrogatePayload`` body of a full copy."""
    tensors = {name: _encode_exact(t) for name, t in state.items()}
    return SurrogatePayload(layer=layer, expert=expert, version=version, tensors=tensors).encode()


def _encode_exact(t: torch.Tensor) -> bytes:
    # float16 on the wire whenever that is lossless (a publisher with ``half`` rounded it so): half the
    # bytes, and the receiver decodes the very float32 values the owner's mirror added.
    return encode(_numpy(t), "fp16" if is_half_exact(t) else "raw")


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().float().contiguous().numpy()


def payload_limits(shapes: Shapes, max_norm: float | None) -> TensorLimits:
    """What a receiver accepts in a payload for surrogates of ``shapes``."""
    biggest = max((int(np.prod(s)) for s in shapes.values()), default=1)
    return TensorLimits(max_elements=max(biggest, 1), max_ndim=2, dtypes=frozenset({"float32"}),
                        codecs=frozenset({"raw", "fp16"}), max_rank=MAX_RANK, max_norm=max_norm)


def _open_payload(body: bytes, eid: ExpertId, version: int, limits: TensorLimits,
                  peer: str | None) -> dict[str, np.ndarray]:
    msg = SurrogatePayload.decode(body, peer=peer)
    if (msg.layer, msg.expert, msg.version) != (*eid, version):
        raise RemoteProtocolError(
            f"payload is for {(msg.layer, msg.expert)} v{msg.version}, expected {eid} v{version}", peer=peer)
    return msg.decode_tensors(limits, peer=peer)


def decode_delta(body: bytes, eid: ExpertId, version: int, shapes: Shapes, limits: TensorLimits,
                 *, peer: str | None = None) -> dict[str, Factors]:
    """Check and decode a delta payload into factors for ``apply_delta``.

    Raises:
        RemoteProtocolError: malformed body, wrong expert or version, a missing, extra or misshapen
            tensor, a rank above the cap, or a tensor failing ``limits`` (NaN, Inf, norm).
    """

    def bad(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"surrogate delta {eid} v{version}: {why}", peer=peer)

    arrays = _open_payload(body, eid, version, limits, peer)
    out: dict[str, Factors] = {}
    for name, shape in shapes.items():
        if len(shape) == 2 and f"{name}#d" not in arrays:
            u, v = arrays.pop(f"{name}#u", None), arrays.pop(f"{name}#v", None)
            if u is None or v is None:
                raise bad(f"lacks the factors of {name}")
            (m, n), r = shape, u.shape[-1]
            if u.shape != (m, r) or v.shape != (r, n) or not 1 <= r <= min(m, n, MAX_RANK):
                raise bad(f"factors {u.shape} @ {v.shape} do not make {shape} at rank <= {MAX_RANK}")
            out[name] = (torch.from_numpy(u), torch.from_numpy(v))
        else:
            d = arrays.pop(f"{name}#d", None)
            if d is None or d.shape != tuple(shape):
                raise bad(f"lacks a dense change of shape {shape} for {name}")
            out[name] = (torch.from_numpy(d), torch.empty(0))
    if arrays:
        raise bad(f"has unexpected tensors {sorted(arrays)[:4]}")
    return out


def decode_full(body: bytes, eid: ExpertId, version: int, shapes: Shapes, limits: TensorLimits,
                *, peer: str | None = None) -> dict[str, torch.Tensor]:
    """Check and decode a full-copy payload. Raises ``RemoteProtocolError`` like ``decode_delta``."""
    arrays = _open_payload(body, eid, version, limits, peer)
    if set(arrays) != set(shapes) or any(arrays[n].shape != tuple(s) for n, s in shapes.items()):
        raise RemoteProtocolError(f"surrogate copy {eid} v{version}: tensors or shapes differ", peer=peer)
    return {name: torch.from_numpy(a) for name, a in arrays.items()}


# --- the payloads this node serves -----------------------------------------------------------------------


class PayloadStore:
    """Verified payload bodies this node serves, with the owner's announcements; thread-safe, bounded.

    Per expert: the last ``window`` delta versions and the latest full copy. ``owned`` experts are the
    ones this node publishes (and so announces).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._deltas: dict[ExpertId, OrderedDict[int, tuple[SurrogateDelta, bytes]]] = {}
        self._fulls: dict[ExpertId, tuple[SurrogateDelta, bytes]] = {}
        self._owned: set[ExpertId] = set()
        self._lock = threading.Lock()

    def put(self, ann: SurrogateDelta, body: bytes, *, full: bool, owned: bool = False) -> None:
        eid = (ann.layer, ann.expert)
        with self._lock:
            if owned:
                self._owned.add(eid)
            if full:
                old = self._fulls.get(eid)
                if old is None or ann.version >= old[0].version:
                    self._fulls[eid] = (ann, body)
                return
            versions = self._deltas.setdefault(eid, OrderedDict())
            versions[ann.version] = (ann, body)
            for v in sorted(versions)[: -self.window]:
                del versions[v]

    def get(self, eid: ExpertId, version: int, *, full: bool) -> bytes | None:
        with self._lock:
            if full:
                entry = self._fulls.get(eid)
                return entry[1] if entry is not None and entry[0].version == version else None
            versions = self._deltas.get(eid)
            found = versions.get(version) if versions is not None else None
            return found[1] if found is not None else None

    def disown(self, eid: ExpertId) -> None:
        with self._lock:
            self._owned.discard(eid)

    def latest_owned(self, eid: ExpertId) -> int:
        with self._lock:
            versions = [*self._deltas.get(eid, {}), self._fulls[eid][0].version if eid in self._fulls else 0]
            return max(versions) if eid in self._owned else 0

    def layers(self) -> set[int]:
        with self._lock:
            return {layer for layer, _ in self._deltas} | {layer for layer, _ in self._fulls}

    def record(self, peer_id: str, layer: int) -> SurrogateRecord:
        """This node's record for ``layer``: announcements of what it owns, holdings of what it serves."""
        with self._lock:
            deltas, fulls, holds = [], [], []
            experts = sorted({e for (lay, e) in [*self._deltas, *self._fulls] if lay == layer})
            for e in experts:
                eid = (layer, e)
                versions = self._deltas.get(eid, OrderedDict())
                first = last = 0
                if versions:
                    last = max(versions)
                    first = last
                    while first - 1 in versions:
                        first -= 1
                full = self._fulls.get(eid)
                holds.append(Holding(e, first, last, full[0].version if full else 0))
                if eid in self._owned:
                    deltas += [versions[v][0] for v in sorted(versions)]
                    if full is not None:
                        fulls.append(full[0])
        return fit_record(peer_id, deltas, fulls, holds)


__all__ = [
    "MAX_RANK",
    "ExpertId",
    "PayloadStore",
    "Shapes",
    "decode_delta",
    "decode_full",
    "encode_delta",
    "encode_full",
    "payload_digest",
    "payload_limits",
]
