"""Reading a peer's answer stream: its payloads up to a cap, each message within a bound, the stream closed
whatever happens."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from parallax.node.net.network import read_answer
from parallax.protocol.errors import OversizedMessage, StalledStream


@dataclass
class _Message:
    serialized_info: bytes


class _Answer:
    """An answer stream that sends ``parts``, then holds for ``hold_s`` (None: ends)."""

    def __init__(self, parts: list[bytes], hold_s: float | None = None) -> None:
        self.parts, self.hold_s, self.closed = parts, hold_s, False

    def __aiter__(self) -> _Answer:
        return self

    async def __anext__(self) -> _Message:
        if self.parts:
            return _Message(self.parts.pop(0))
        if self.hold_s is not None:
            await asyncio.sleep(self.hold_s)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


def _read(answer: _Answer, cap: int = 100, chunk_timeout_s: float | None = 0.05) -> list[bytes]:
    return asyncio.run(read_answer(answer, cap=cap, peer="QmPeer", what="a test answer",
                                   chunk_timeout_s=chunk_timeout_s))


def test_an_answer_is_its_payloads_and_the_stream_is_closed() -> None:
    answer = _Answer([b"head", b"body1", b"body2"])
    assert _read(answer) == [b"head", b"body1", b"body2"] and answer.closed
    empty = _Answer([])
    assert _read(empty) == [] and empty.closed


def test_an_answer_held_open_is_a_stalled_stream_naming_the_peer() -> None:
    for sent in ([], [b"head"]):  # before its first message, or between two
        answer = _Answer(list(sent), hold_s=5.0)
        with pytest.raises(StalledStream, match=f"nothing for 0.05 s after {len(sent)} message.*QmPeer"):
            _read(answer)
        assert answer.closed


def test_an_answer_over_the_cap_is_refused_and_without_a_bound_a_slow_one_is_read() -> None:
    answer = _Answer([b"x" * 60, b"x" * 60])
    with pytest.raises(OversizedMessage, match="longer than 100 bytes"):
        _read(answer)
    assert answer.closed
    assert _read(_Answer([b"late"], hold_s=0.1), chunk_timeout_s=None) == [b"late"]
