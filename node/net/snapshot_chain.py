"""Heir copies as chains of compressed changes: what an owner sends the heir of an expert each snapshot period.
Pure: no network, no threads.

An heir keeps a copy of every expert it inherits, so that the owner's death costs at most ``snapshot_every`` steps.
A whole copy (weights and both AdamW moments in float32: 12 bytes a parameter) every period costs many times the
training traffic. A chain sends the change since the copy the heir holds instead:

- The owner keeps ``ref``, the weights exactly as its heirs rebuild them. Each period it encodes
  ``weights - ref`` ternary (``protocol.codec``: 1.6 bits a value and a float32 scale per ``LINK_CHUNK``) and adds
  the decoded change to ``ref``: one *link*. What the code leaves out stays in ``weights - ref`` and goes with the
  next link (error feedback), so the copy never drifts: it lags the owner by one link's rounding.
- Version 0 of a chain is the expert's seeded initialisation when the owner had never stepped it (every peer can
  draw that), else the owner's weights then. A chain is named after its version 0 (``chain_id``): an heir that
  holds an exact copy of it continues the chain from there. That is the common hand-over: a new owner starts its
  chain at the seam where it adopted the previous owner's final snapshot, and its heir is then the previous owner
  (the owner in the assignment without the new one), which holds that snapshot. An heir that holds nothing the
  chain can continue gets a *keyframe*: ``ref`` itself, raw.
- The AdamW state travels as the second moment factored into its row and column means (Adafactor's estimate) and
  the step. The first moment does not travel: a copy rebuilt from a chain starts it at zero (AdamW's bias
  correction no longer scales it up, so the first steps after a take-over are shorter).
- Each answer names its chain, the version its links apply to and the one they make, and the sha256 of ``ref`` at
  that version. The heir checks its rebuilt copy against it bit for bit; a copy that does not match is dropped
  (``ChainMismatch``) and the heir asks for a keyframe.

What the chain is for is the owner's death. A hand-over (an expert released to the peer taking it over, a node
leaving) stays an exact ``ExpertSnapshot``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from parallax.protocol.codec import TensorLimits, decode, encode
from parallax.protocol.errors import RemoteProtocolError
from parallax.protocol.messages import ExpertSnapshotLinks

LINK_CODEC = "ternary"
LINK_CHUNK = 256
"""Values per ternary scale: a float32 scale per 256 values adds 0.016 bytes a value to the 0.2 of the trits."""
KEPT_LINKS = 4
"""Links an owner keeps: an heir whose copy is older than that (it missed polls) gets a keyframe."""
MAX_NORM = 1e6
"""Per tensor (weights, moments, a link's change): far above any trained expert or Adam moment, far below an
overflow."""
ADAM_STEP = "adam.step"
_ROWS, _COLS, _LINK = "v.rows.", "v.cols.", "link."

Array = npt.NDArray[np.float32]


class ChainMismatch(RemoteProtocolError):
    """Links that do not apply to the copy this heir holds, or a rebuilt copy whose digest differs: drop the copy and
    ask for a keyframe. ``from_init``: the links started at the initialisation this heir drew."""

    from_init: bool = False


def weights_digest(ref: Mapping[str, Array]) -> bytes:
    """sha256 over the names (sorted) and float32 bytes of ``ref``: equal copies, bit for bit, have equal digests."""
    h = hashlib.sha256()
    for name in sorted(ref):
        h.update(name.encode())
        h.update(np.ascontiguousarray(ref[name], dtype=np.float32).tobytes())
    return h.digest()


def chain_id(digest: bytes) -> int:
    """The name of a chain whose version 0 has ``digest`` (``weights_digest``): a positive 63-bit number. Two chains
    from the same copy share it, and their links from version 0 apply to it alike; an heir that holds a later
    version of the other is caught by the digest check (``ChainMismatch``), drops its place and asks again as an
    heir that holds nothing."""
    return int.from_bytes(digest[:8], "big") >> 1 or 1


def released_copy(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> HeirCopy:
    """An exact copy of an expert's weights (``names`` of ``tensors``) as version 0 of the chain a new owner starts
    from it: what the releaser of an expert holds of its new owner's chain."""
    ref = {name: _array(tensors[name]) for name in names}
    return HeirCopy(chain_id(weights_digest(ref)), 0, ref)


def _array(t: torch.Tensor) -> Array:
    return np.array(t.detach().to("cpu", torch.float32).numpy(), dtype=np.float32)


def _state(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, bytes]:
    """The AdamW state a chain carries: each second moment as the means of its rows and columns, and the step; empty
    before the expert's first step."""
    if ADAM_STEP not in tensors:
        return {}
    out = {ADAM_STEP: encode(np.float32(float(tensors[ADAM_STEP])))}
    for name in names:
        v = _array(tensors[f"adam.exp_avg_sq.{name}"])
        v = v.reshape(v.shape[0], -1)
        out[f"{_ROWS}{name}"] = encode(v.mean(axis=1, dtype=np.float32))
        out[f"{_COLS}{name}"] = encode(v.mean(axis=0, dtype=np.float32))
    return out


def factored_second_moment(rows: Array, cols: Array, shape: tuple[int, ...]) -> Array:
    """Adafactor's estimate of a second moment from the means of its rows and columns: rows x cols / their mean."""
    mean = float(rows.mean()) if rows.size else 0.0
    v = np.outer(rows, cols) / mean if mean > 0 else np.zeros((rows.size, cols.size), dtype=np.float32)
    return v.astype(np.float32).reshape(shape)


@dataclass(frozen=True, slots=True)
class Chain:
    """An owner's chain of one expert at its latest version. Immutable: each period makes a new one."""

    chain: int
    version: int
    step: int
    """The owner's step at ``version``."""
    taken: float
    """When the owner took ``version``, on its monotonic clock."""
    from_init: bool
    """Version 0 is the seeded initialisation (the owner had not stepped the expert)."""
    ref: Mapping[str, Array]
    digest: bytes
    links: tuple[Mapping[str, bytes], ...]
    """The last ``KEPT_LINKS`` links; ``links[-1]`` makes ``version``."""
    state: Mapping[str, bytes]

    @property
    def first_base(self) -> int:
        """The oldest version the kept links apply to."""
        return self.version - len(self.links)

    @classmethod
    def start(cls, step: int, tensors: Mapping[str, torch.Tensor], names: tuple[str, ...], *, taken: float) -> Chain:
        """Version 0 from an owner's snapshot (``tensors``: weights by ``names``, and its AdamW state once stepped)."""
        ref = {name: _array(tensors[name]) for name in names}
        digest = weights_digest(ref)
        return cls(chain_id(digest), 0, step, taken, ADAM_STEP not in tensors, ref, digest, (), _state(tensors, names))

    def advance(self, step: int, tensors: Mapping[str, torch.Tensor], *, taken: float) -> Chain:
        """The next version: a link from ``ref`` towards the weights in ``tensors``."""
        ref, link = {}, {}
        for name, held in self.ref.items():
            change = _array(tensors[name]) - held
            link[name] = encode(change, LINK_CODEC, chunk=LINK_CHUNK)
            ref[name] = held + decode(link[name], _LIMITS).reshape(held.shape)
        return Chain(self.chain, self.version + 1, step, taken, self.from_init, ref, weights_digest(ref),
                     (*self.links, link)[-KEPT_LINKS:], _state(tensors, tuple(self.ref)))

    def base_for(self, held: tuple[int, int] | None, *, init: bool = True) -> int | None:
        """The version the links to an heir that holds version ``held[1]`` of chain ``held[0]`` start from (None: no
        copy; ``init``: it can draw the initialisation), or None for a keyframe."""
        if held is not None and held[0] == self.chain and self.first_base <= held[1] <= self.version:
            return held[1]
        return 0 if init and self.from_init and self.first_base == 0 else None

    def answer(self, base: int | None, layer: int, expert: int) -> ExpertSnapshotLinks:
        """The links from version ``base`` (``base_for``), or a keyframe (None)."""
        if base is None:
            tensors = {name: encode(array) for name, array in self.ref.items()}
            base = self.version
        else:
            tensors = {f"{_LINK}{i}.{name}": blob for i, link in enumerate(self.links[base - self.first_base:])
                       for name, blob in link.items()}
        return ExpertSnapshotLinks(layer=layer, expert=expert, step=self.step, chain=self.chain, base=base,
                                   version=self.version, digest=self.digest, tensors={**tensors, **self.state})


_LIMITS = TensorLimits(max_elements=1 << 31, codecs=frozenset({"ternary"}))  # our own blobs: decoded as heirs do


@dataclass(frozen=True, slots=True)
class HeirCopy:
    """What an heir holds of a chain: the weights at ``version`` exactly as the owner's ``ref``."""

    chain: int
    version: int
    ref: Mapping[str, Array]


def rebuild(msg: ExpertSnapshotLinks, shapes: Mapping[str, tuple[int, ...]], held: HeirCopy | None,
            initial: Callable[[], Mapping[str, torch.Tensor]] | None, *,
            peer: str | None = None) -> tuple[HeirCopy, dict[str, torch.Tensor]]:
    """An heir's new copy from an owner's answer, and its tensors as ``Composer.adopt_expert`` takes them.

    Args:
        msg: the answer, its envelope already checked.
        shapes: name -> shape of the expert's weights.
        held: the copy this heir holds, or None.
        initial: () -> the expert's seeded initial weights (links from version 0 start there); None: not drawable.
        peer: the owner, for error messages.

    Raises:
        ChainMismatch: links that do not apply to ``held``, or a rebuilt copy whose digest is not the one signed.
        RemoteProtocolError: unknown or missing tensors, wrong shapes, bad codes, non-finite values or norms
            above ``MAX_NORM``, a negative second moment, a step that is not a whole number >= 0.
    """
    names = tuple(shapes)
    count = msg.version - msg.base
    if not 0 <= count <= KEPT_LINKS:
        raise RemoteProtocolError(f"expert snapshot links of {(msg.layer, msg.expert)}: versions {msg.base} to "
                                  f"{msg.version}, more than the {KEPT_LINKS} links an owner keeps")
    keyframe = count == 0 and set(names) <= set(msg.tensors)
    expected = set(names) if keyframe else {f"{_LINK}{i}.{n}" for i in range(count) for n in names}
    state_names = {ADAM_STEP} | {f"{p}{n}" for p in (_ROWS, _COLS) for n in names}
    got = set(msg.tensors)
    if expected - got or got - expected - state_names or (got & state_names and state_names - got):
        raise RemoteProtocolError(f"expert snapshot links of {(msg.layer, msg.expert)}: versions {msg.base} to "
                                  f"{msg.version} with tensors {sorted(got)[:12]}")
    biggest = max(int(np.prod(s)) for s in shapes.values())
    limits = TensorLimits(max_elements=biggest, max_ndim=2, dtypes=frozenset({"float32"}),
                          codecs=frozenset({"raw", LINK_CODEC}), max_norm=MAX_NORM)
    arrays = msg.decode_tensors(limits, peer=peer)
    for name, array in arrays.items():
        want = _expected_shape(name, shapes)
        if tuple(array.shape) != want:
            raise RemoteProtocolError(f"expert snapshot links: {name} has shape {array.shape}, expected {want}")
    from_init = False
    if keyframe:
        ref = {n: arrays[n].astype(np.float32) for n in names}
    elif held is not None and held.chain == msg.chain and held.version == msg.base:
        ref = dict(held.ref)
    elif msg.base == 0 and initial is not None:
        from_init = True
        ref = {n: _array(t) for n, t in initial().items()}
    else:
        raise ChainMismatch(f"links of chain {msg.chain} from version {msg.base}, but this heir holds "
                            f"{None if held is None else (held.chain, held.version)}", peer=peer)
    for i in range(count):
        for n in names:
            ref[n] = ref[n] + arrays[f"{_LINK}{i}.{n}"]
    if weights_digest(ref) != msg.digest:
        mismatch = ChainMismatch(f"expert {(msg.layer, msg.expert)} rebuilt at version {msg.version} of chain "
                                 f"{msg.chain} does not match the owner's digest", peer=peer)
        mismatch.from_init = from_init
        raise mismatch
    for n, array in ref.items():
        if not np.isfinite(array).all() or float(np.linalg.norm(array)) > MAX_NORM:
            raise RemoteProtocolError(f"expert snapshot links: {n} rebuilt is not finite or past the norm bound")
    tensors = {n: torch.from_numpy(array.copy()) for n, array in ref.items()}
    if ADAM_STEP in arrays:
        step = float(arrays[ADAM_STEP])
        if not (step >= 0 and step.is_integer()):
            raise RemoteProtocolError(f"expert snapshot links: {ADAM_STEP} is {step}, not a whole number >= 0")
        for n in names:
            rows, cols = arrays[f"{_ROWS}{n}"], arrays[f"{_COLS}{n}"]
            if float(rows.min()) < 0 or float(cols.min()) < 0:
                raise RemoteProtocolError(f"expert snapshot links: a negative second moment of {n}")
            v = factored_second_moment(rows, cols, shapes[n])
            if not np.isfinite(v).all() or float(np.linalg.norm(v)) > MAX_NORM:
                raise RemoteProtocolError(f"expert snapshot links: the second moment of {n} is past the norm bound")
            tensors[f"adam.exp_avg.{n}"] = torch.zeros(shapes[n])
            tensors[f"adam.exp_avg_sq.{n}"] = torch.from_numpy(v)
        tensors[ADAM_STEP] = torch.tensor(step)
    return HeirCopy(msg.chain, msg.version, ref), tensors


def _expected_shape(name: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    if name == ADAM_STEP:
        return ()
    for prefix in (_ROWS, _COLS):
        if name.startswith(prefix):
            shape = shapes[name[len(prefix):]]
            return (shape[0],) if prefix == _ROWS else (int(np.prod(shape[1:])),)
    return shapes[name.split(".", 2)[2] if name.startswith(_LINK) else name]
