"""What a node that cannot start says about its view of the members."""

from __future__ import annotations

import types

from parallax.dht.adapter import dht_time
from parallax.dht.membership import MembershipConfig
from parallax.node.peer.runner import _staleness, fast_forward


def _membership(read_at: float) -> object:
    view = types.SimpleNamespace(read_at=read_at)
    return types.SimpleNamespace(view=lambda: view, timing=MembershipConfig())


def test_a_start_up_error_says_when_its_count_of_peers_comes_from_an_old_read_or_none() -> None:
    assert _staleness(_membership(dht_time() - 1.0)) == ""  # type: ignore[arg-type]
    old = _staleness(_membership(dht_time() - 95.0))  # type: ignore[arg-type]
    assert "95 s old" in old and "longer than 3 s" in old
    assert "no read of the members answered within 3 s" in _staleness(_membership(0.0))  # type: ignore[arg-type]


def test_a_joiner_takes_the_swarms_step_and_draws_its_batches_from_there() -> None:
    """Without the checkpoint that says how far its identity drew, a joiner draws none of the batches it may have
    drawn before, and the draw counts its claims name grow past those its peers audited (``train.own_data``)."""
    followed: list[int] = []
    composer = types.SimpleNamespace(step=3, sampler=types.SimpleNamespace(step=3), follow_schedule=followed.append)
    fast_forward(composer, 120)  # type: ignore[arg-type]
    assert composer.step == 120 and composer.sampler.step == 120 and followed == [120]
    fast_forward(composer, 50)  # type: ignore[arg-type]  # never backwards
    assert composer.step == 120 and composer.sampler.step == 120 and followed == [120]
