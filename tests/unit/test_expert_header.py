"""The snapshot stream's header: [step, final, age in seconds], strictly typed."""

from __future__ import annotations

import msgpack
import pytest

from parallax.node.net.expert_exchange import _header
from parallax.protocol.errors import RemoteProtocolError


def test_header_round_trip() -> None:
    assert _header(msgpack.packb([12, True, 3.5])) == (12, True, 3.5)
    assert _header(msgpack.packb([0, False, 0])) == (0, False, 0.0)


@pytest.mark.parametrize("bad", [
    b"", b"\xc1", msgpack.packb([1, True]), msgpack.packb([-1, True, 0.0]), msgpack.packb([1, 1, 0.0]),
    msgpack.packb([1, True, -0.5]), msgpack.packb([1, True, float("nan")]), msgpack.packb([1, True, float("inf")]),
    msgpack.packb([1, True, "0"]), msgpack.packb([1, True, 0.0, 4]), msgpack.packb({"step": 1}),
])
def test_bad_headers_are_refused(bad: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        _header(bad)
