"""The machinery under every wire message: field specs, the ``Message`` base class, the kind registry.

A message is a frozen, slotted dataclass whose fields each carry a *spec* (``wire(Int(0, 9))``). The
spec both normalises and validates a value, so one check serves two paths:

- building a message locally: a bad value raises ``LocalProtocolError`` (our bug);
- decoding a peer's bytes: the same failure raises ``MalformedMessage`` naming the peer.

Canonical encoding: a msgpack map from field name to value, keys in sorted order, ``use_bin_type``
(``bytes`` stay binary, ``str`` stay text), integers in msgpack's shortest form, floats always float64,
tuples as arrays. Decoding ignores keys it does not know, so a newer node may add optional fields
without breaking older ones (petals' ``ServerInfo``); a field an older node does not send must have a
default.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from parallax.protocol.errors import LocalProtocolError, MalformedMessage, OversizedMessage, UnknownKind

M = TypeVar("M", bound="Message")

INT64_MAX = 2**63 - 1
Buffer = bytes | bytearray | memoryview  # what decoders accept: a received message or a view into one
# Every exception msgpack can raise on hostile bytes (its own are ValueError subclasses, except
# OutOfData/BufferFull, which derive from UnpackException).
MSGPACK_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, msgpack.UnpackException)


class Spec:
    """Validates and normalises one field value. ``check`` raises ``ValueError`` with the reason."""

    def check(self, value: object) -> Any:
        raise NotImplementedError

    def to_wire(self, value: Any) -> Any:
        return value


class Int(Spec):
    """An ``int`` (not ``bool``) in ``[lo, hi]``."""

    def __init__(self, lo: int = 0, hi: int = INT64_MAX) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"expected an integer, got {type(value).__name__}")
        if not self.lo <= value <= self.hi:
            raise ValueError(f"{value} is outside [{self.lo}, {self.hi}]")
        return value


class Float(Spec):
    """A finite float in ``[lo, hi]`` (``lo_open`` makes the lower bound strict). Ints are accepted."""

    def __init__(self, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False) -> None:
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def check(self, value: object) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"expected a number, got {type(value).__name__}")
        try:
            x = float(value)
        except OverflowError:
            raise ValueError(f"{value} is too large for a float") from None
        if not math.isfinite(x):
            raise ValueError(f"{x} is not finite")
        if x < self.lo or x > self.hi or (self.lo_open and x == self.lo):
            raise ValueError(f"{x} is outside {'(' if self.lo_open else '['}{self.lo}, {self.hi}]")
        return x


class Bool(Spec):
    def check(self, value: object) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected a boolean, got {type(value).__name__}")
        return value


class Str(Spec):
    """A text string of ``min_len..max_len`` characters, optionally one of ``choices``."""

    def __init__(self, max_len: int, *, min_len: int = 0, choices: frozenset[str] | None = None) -> None:
        self.max_len, self.min_len, self.choices = max_len, min_len, choices

    def check(self, value: object) -> str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        if not self.min_len <= len(value) <= self.max_len:
            raise ValueError(f"length {len(value)} is outside [{self.min_len}, {self.max_len}]")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{value!r} is not one of {sorted(self.choices)}")
        return value


class Bytes(Spec):
    """A byte string of exactly ``length`` bytes, or of ``min_len..max_len`` bytes."""

    def __init__(self, *, length: int | None = None, max_len: int | None = None, min_len: int = 0) -> None:
        if length is None and max_len is None:
            raise TypeError("Bytes needs length= or max_len=")
        self.min_len: int = length if length is not None else min_len
        self.max_len: int = length if length is not None else max_len  # type: ignore[assignment]

    def check(self, value: object) -> bytes:
        if not isinstance(value, bytes):
            raise ValueError(f"expected bytes, got {type(value).__name__}")
        if not self.min_len <= len(value) <= self.max_len:
            raise ValueError(f"{len(value)} bytes is outside [{self.min_len}, {self.max_len}]")
        return value


class Optional(Spec):
    """``None`` or a value accepted by ``inner``."""

    def __init__(self, inner: Spec) -> None:
        self.inner = inner

    def check(self, value: object) -> Any:
        return None if value is None else self.inner.check(value)

    def to_wire(self, value: Any) -> Any:
        return None if value is None else self.inner.to_wire(value)


class Seq(Spec):
    """A tuple (an array on the wire) of at most ``max_len`` items, each accepted by ``item``."""

    def __init__(self, item: Spec, *, max_len: int) -> None:
        self.item, self.max_len = item, max_len

    def check(self, value: object) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected an array, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise ValueError(f"{len(value)} items, more than {self.max_len}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(self.item.check(v))
            except ValueError as e:
                raise ValueError(f"item {i}: {e}") from None
        return tuple(out)

    def to_wire(self, value: Any) -> Any:
        return [self.item.to_wire(v) for v in value]


class Fixed(Spec):
    """A fixed-arity tuple, e.g. a ``(layer, expert)`` pair."""

    def __init__(self, *items: Spec) -> None:
        self.items = items

    def check(self, value: object) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)) or len(value) != len(self.items):
            raise ValueError(f"expected an array of {len(self.items)} items")
        try:
            return tuple(spec.check(v) for spec, v in zip(self.items, value, strict=True))
        except ValueError as e:
            raise ValueError(f"in {list(value)!r:.80}: {e}") from None

    def to_wire(self, value: Any) -> Any:
        return [spec.to_wire(v) for spec, v in zip(self.items, value, strict=True)]


class Map(Spec):
    """A read-only mapping with string keys (sorted on the wire) of at most ``max_len`` entries."""

    def __init__(self, key: Str, value: Spec, *, max_len: int) -> None:
        self.key, self.value, self.max_len = key, value, max_len

    def check(self, value: object) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a map, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise ValueError(f"{len(value)} entries, more than {self.max_len}")
        out: dict[str, Any] = {}
        for k in sorted(value, key=lambda k: (not isinstance(k, str), str(k))):
            try:
                out[self.key.check(k)] = self.value.check(value[k])
            except ValueError as e:
                raise ValueError(f"entry {k!r:.80}: {e}") from None
        return types.MappingProxyType(out)

    def to_wire(self, value: Any) -> Any:
        return {k: self.value.to_wire(value[k]) for k in sorted(value)}


def wire(spec: Spec, default: Any = MISSING) -> Any:
    """A dataclass field validated by ``spec``; ``default`` makes it optional on the wire."""
    return field(default=default, metadata={"spec": spec})


def _spec(f: Field[Any]) -> Spec:
    spec = f.metadata.get("spec")
    if not isinstance(spec, Spec):
        raise TypeError(f"field {f.name!r} has no wire spec; declare it with wire(...)")
    return spec


class Message:
    """Base of every wire message kind. Subclasses are ``@register``-ed frozen slotted dataclasses.

    Class attributes:
        KIND: the registry name, also part of the signing domain.
        VERSION: the schema version (bump only for incompatible changes; adding an optional field is not one).
        MAX_BYTES: the cap on an envelope carrying this kind, checked before any decoding.
    """

    __slots__ = ()
    KIND: ClassVar[str]
    VERSION: ClassVar[int] = 1
    MAX_BYTES: ClassVar[int]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]  # subclasses are dataclasses
            try:
                value = _spec(f).check(getattr(self, f.name))
            except ValueError as e:
                raise LocalProtocolError(f"{self.KIND}.{f.name}: {e}") from None
            object.__setattr__(self, f.name, value)
        try:
            self._validate()
        except ValueError as e:
            raise LocalProtocolError(f"{self.KIND}: {e}") from None

    def _validate(self) -> None:
        """Cross-field checks; raise ``ValueError`` with the reason."""

    def to_wire(self) -> dict[str, Any]:
        """The message as plain msgpack-able values, keys sorted."""
        fs = sorted(fields(self), key=lambda f: f.name)  # type: ignore[arg-type]
        return {f.name: _spec(f).to_wire(getattr(self, f.name)) for f in fs}

    def encode(self) -> bytes:
        """The canonical bytes of this message (the envelope body)."""
        return msgpack.packb(self.to_wire(), use_bin_type=True)  # type: ignore[no-any-return]

    @classmethod
    def from_wire(cls: type[M], obj: object, *, peer: str | None = None) -> M:
        """Build a message from decoded msgpack values; unknown keys are ignored."""
        if not isinstance(obj, dict):
            raise MalformedMessage(f"{cls.KIND}: body is a {type(obj).__name__}, not a map", peer=peer)
        kwargs: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in obj:
                kwargs[f.name] = obj[f.name]
            elif f.default is MISSING:
                raise MalformedMessage(f"{cls.KIND}: missing field {f.name!r}", peer=peer)
        try:
            return cls(**kwargs)
        except LocalProtocolError as e:
            raise MalformedMessage(str(e), peer=peer) from None

    @classmethod
    def decode(cls: type[M], data: Buffer, *, peer: str | None = None) -> M:
        """Parse and validate a body produced by ``encode``.

        Raises:
            OversizedMessage: ``data`` exceeds ``MAX_BYTES`` (checked first).
            MalformedMessage: the bytes do not parse or a field is invalid.
        """
        return cls.from_wire(unpack(data, cls.MAX_BYTES, what=cls.KIND, peer=peer), peer=peer)


def unpack(data: Buffer, max_bytes: int, *, what: str, peer: str | None = None) -> object:
    """msgpack-decode untrusted ``data`` of at most ``max_bytes``, with every container bounded by it."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"{what}: expected bytes, got {type(data).__name__}", peer=peer)
    if len(data) > max_bytes:
        raise OversizedMessage(f"{what}: {len(data)} bytes, more than the cap of {max_bytes}", peer=peer)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes,
            max_ext_len=0,
        )
    except MSGPACK_ERRORS as e:
        raise MalformedMessage(f"{what}: undecodable ({type(e).__name__}: {e})"[:300], peer=peer) from None


KINDS: dict[str, type[Message]] = {}
_KIND_NAME = re.compile(r"[a-z0-9_]{1,40}")  # it appears in the envelope prefix, in clear
_largest_cap = 0


def largest_cap() -> int:
    """The largest ``MAX_BYTES`` of any registered kind: the cap when any kind is acceptable."""
    return _largest_cap


def register(cls: type[M]) -> type[M]:
    """Class decorator: add a message kind to the one registry."""
    kind = getattr(cls, "KIND", None)
    if not isinstance(kind, str) or not _KIND_NAME.fullmatch(kind) or kind in KINDS:
        raise TypeError(f"{cls.__name__}: KIND {kind!r} must be a new name of 1-40 characters [a-z0-9_]")
    if not isinstance(getattr(cls, "MAX_BYTES", None), int):
        raise TypeError(f"{cls.__name__}: declare MAX_BYTES")
    for f in fields(cls):  # type: ignore[arg-type]
        _spec(f)
    global _largest_cap
    KINDS[kind] = cls
    _largest_cap = max(_largest_cap, cls.MAX_BYTES)
    return cls


def message_class(kind: str, *, peer: str | None = None) -> type[Message]:
    """The registered class for ``kind``; ``UnknownKind`` if there is none."""
    try:
        return KINDS[kind]
    except (KeyError, TypeError):
        raise UnknownKind(f"unknown message kind {kind!r:.80}", peer=peer) from None


def domain(kind: str, protocol_version: int) -> bytes:
    """The signing domain of a kind: ``b"parallax/<kind>/v<protocol version>"``."""
    return f"parallax/{kind}/v{protocol_version}".encode()


__all__ = [
    "KINDS",
    "Bool",
    "Bytes",
    "Fixed",
    "Float",
    "Int",
    "Map",
    "Message",
    "Optional",
    "Seq",
    "Spec",
    "Str",
    "domain",
    "largest_cap",
    "message_class",
    "register",
    "unpack",
    "wire",
]
