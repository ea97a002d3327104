"""The snapshot stream's header [step, final, age in seconds] (and, to an heir's ask, links) and an heir's ask
[chain, version, init], strictly typed."""

from __future__ import annotations

import msgpack
import pytest

from parallax.node.net.expert_exchange import _header, heir_ask
from parallax.protocol.errors import RemoteProtocolError


def test_header_round_trip() -> None:
    assert _header(msgpack.packb([12, True, 3.5, False])) == (12, True, 3.5, False)
    assert _header(msgpack.packb([0, False, 0, True])) == (0, False, 0.0, True)
    assert _header(msgpack.packb([7, False, 1.5])) == (7, False, 1.5, False)  # to a plain ask: an exact snapshot


@pytest.mark.parametrize("bad", [
    b"", b"\xc1", msgpack.packb([1, True]), msgpack.packb([-1, True, 0.0, False]),
    msgpack.packb([1, 1, 0.0, False]), msgpack.packb([1, True, -0.5, False]),
    msgpack.packb([1, True, float("nan"), False]), msgpack.packb([1, True, float("inf"), False]),
    msgpack.packb([1, True, "0", False]), msgpack.packb([1, True, 0.0, 4]), msgpack.packb([1, True, 0.0, False, 1]),
    msgpack.packb({"step": 1}),
])
def test_bad_headers_are_refused(bad: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        _header(bad)


def test_an_exact_request_has_no_metadata_and_an_heirs_names_its_copy() -> None:
    assert heir_ask(b"") is None
    assert heir_ask(msgpack.packb([0, 0, True])) == (0, 0, True)
    assert heir_ask(msgpack.packb([2**62, 7, False])) == (2**62, 7, False)


@pytest.mark.parametrize("bad", [
    b"\xc1", msgpack.packb([1, 2]), msgpack.packb([-1, 0, True]), msgpack.packb([1, 0, 1]),
    msgpack.packb([2**63, 0, True]), msgpack.packb([1, 0.5, True]), msgpack.packb([1, 0, True, 0]),
    msgpack.packb("x" * 40),
])
def test_bad_asks_are_refused(bad: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        heir_ask(bad)
