"""A group's state comes from several live composers at once and is taken only when another source vouches for
it: a peer serving a poisoned anchor (or one of another shape) is outvoted. Real hivemind peers on loopback."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch

from parallax.dht.testing import LocalSwarm, fixed_identity
from parallax.node.net.network import NetworkLoop
from parallax.node.outer.state import StateExchange

pytestmark = pytest.mark.timeout(120)

SHAPES = {"w": (16, 8), "b": (8,)}


def _state(scale: float, *, shapes=SHAPES, round_id: int = 4) -> tuple[dict, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    anchor = [torch.randn(s, generator=g) * scale for s in shapes.values()]
    meta = {"v": 1, "group": "router", "round": round_id, "step": 40, "names": list(shapes), "momentum": False}
    return meta, anchor


@contextlib.contextmanager
def _swarm(n: int) -> Iterator[list[StateExchange]]:
    with LocalSwarm("state") as swarm, contextlib.ExitStack() as stack:
        dhts = [swarm.add_dht(fixed_identity(i)).dht for i in range(n)]
        ids = [d.peer_id for d in dhts]
        exchanges = []
        for d in dhts:
            loop = NetworkLoop(d, f"net-{d.peer_id[-4:]}")
            stack.callback(loop.close)
            exchange = StateExchange(loop.p2p, loop.loop, "state", lambda: ids, own_peer_id=d.peer_id).start()
            stack.callback(exchange.close)
            exchanges.append(exchange)
        yield exchanges


def test_a_poisoned_state_is_outvoted_and_an_unvouched_one_is_not_taken() -> None:
    with _swarm(4) as (joiner, honest_a, honest_b, liar):
        honest_a.serve("router", lambda: _state(1.0))
        honest_b.serve("router", lambda: _state(1.0))
        liar.serve("router", lambda: _state(1000.0, round_id=10**6))
        got = joiner.download("router", SHAPES, timeout_s=20)
        assert got is not None and got[0]["round"] == 4
        assert torch.equal(got[1][0], _state(1.0)[1][0])
        # A source that serves other shapes does not count, nor does one serving nothing: the liar's state is then
        # the only one, and nobody vouches for it.
        honest_b.serve("router", lambda: _state(1.0, shapes={"w": (4, 4), "b": (8,)}))
        honest_a.serve("router", None)
        assert joiner.download("router", SHAPES, timeout_s=20) is None


def test_the_only_live_composer_is_taken_at_its_word() -> None:
    with _swarm(2) as (joiner, only):
        only.serve("router", lambda: _state(1.0))
        got = joiner.download("router", SHAPES, timeout_s=20)
        assert got is not None and torch.equal(got[1][1], _state(1.0)[1][1])


def test_two_sources_that_disagree_prove_nothing_and_close_ones_are_taken() -> None:
    """Of two that disagree, ``download`` (an export) takes neither and ``candidates`` gives both, each naming its
    source, for a node's held-out probe to choose (``background.best_of``)."""
    with _swarm(3) as (joiner, one, other):
        one.serve("router", lambda: _state(1.0))
        other.serve("router", lambda: _state(50.0))
        assert joiner.download("router", SHAPES, timeout_s=20) is None
        both = joiner.candidates("router", SHAPES, timeout_s=20)
        assert sorted(meta["source"] for meta, _ in both) == sorted([one.own_peer_id, other.own_peer_id])
        assert sorted(float(t[0].norm() / _state(1.0)[1][0].norm()) for _, t in both) == pytest.approx([1.0, 50.0])
        other.serve("router", lambda: _state(1.05, round_id=5))  # an honest peer a round further
        got = joiner.download("router", SHAPES, timeout_s=20)
        assert got is not None and got[0]["round"] in (4, 5)


def test_sources_that_do_not_answer_are_replaced_so_a_liar_is_still_outvoted(caplog) -> None:
    # Under churn the view still lists peers that just left: here two peers serve no state at all. Each draw of
    # three sources that holds one of them asks another composer in its place, so the joiner always compares three
    # answers and the honest pair outvotes the liar (three sources drawn once would often leave one honest answer
    # beside the liar's: no two that agree, nothing taken).
    caplog.set_level(logging.INFO, logger="parallax.node.outer.state")  # a failure then says why each source failed
    with _swarm(6) as (joiner, honest_a, honest_b, liar, _silent, _gone):
        honest_a.serve("router", lambda: _state(1.0))
        honest_b.serve("router", lambda: _state(1.0))
        liar.serve("router", lambda: _state(1000.0, round_id=10**6))
        for _ in range(6):
            got = joiner.download("router", SHAPES, timeout_s=20)
            assert got is not None and got[0]["round"] == 4 and torch.equal(got[1][0], _state(1.0)[1][0])


def test_a_source_whose_request_failed_in_transit_is_asked_once_more() -> None:
    """An honest source whose answer broke off (here its handler fails once) is asked again after the others: one
    unlucky stream must not leave the liar's state beside a single honest one, with nobody to outvote it."""
    calls = []

    def once_broken() -> tuple[dict, list[torch.Tensor]]:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("the stream broke off")
        return _state(1.0)

    with _swarm(4) as (joiner, honest_a, honest_b, liar):
        honest_a.serve("router", lambda: _state(1.0))
        honest_b.serve("router", once_broken)
        liar.serve("router", lambda: _state(1000.0, round_id=10**6))
        got = joiner.download("router", SHAPES, timeout_s=20)
        assert got is not None and got[0]["round"] == 4 and len(calls) == 2
