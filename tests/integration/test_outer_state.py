"""A group's state comes from several live composers at once and is taken only when another source vouches for
it: a peer serving a poisoned anchor (or one of another shape) is outvoted. Real hivemind peers on loopback."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from hivemind.p2p import PeerID

from parallax.dht.testing import LocalSwarm, fixed_identity
from parallax.node.net.network import NetworkLoop
from parallax.node.outer.state import StateExchange, source_order

pytestmark = pytest.mark.timeout(120)

SHAPES = {"w": (16, 8), "b": (8,)}


def _state(scale: float, *, shapes=SHAPES, round_id: int = 4) -> tuple[dict, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    anchor = [torch.randn(s, generator=g) * scale for s in shapes.values()]
    meta = {"v": 1, "group": "router", "round": round_id, "step": 40, "names": list(shapes), "momentum": False}
    return meta, anchor


MADE_UP = [PeerID(b"\x12\x20" + hashlib.sha256(bytes([i])).digest()).to_base58() for i in range(40)]
"""40 libp2p peer ids nobody runs (the multihashes of made-up keys): live composers in a view, as a flood's are."""


def _honest_pair_and_liar(honest_a: StateExchange, honest_b: StateExchange, liar: StateExchange) -> None:
    """Two sources serve the honest state of router, the liar a poisoned one from a far later round."""
    honest_a.serve("router", lambda: _state(1.0))
    honest_b.serve("router", lambda: _state(1.0))
    liar.serve("router", lambda: _state(1000.0, round_id=10**6))


@contextlib.contextmanager
def _swarm(n: int, made_up: Sequence[str] = ()) -> Iterator[list[StateExchange]]:
    """``n`` peers, each with a state exchange whose live composers are the ``n`` and the ``made_up`` peer ids."""
    with LocalSwarm("state") as swarm, contextlib.ExitStack() as stack:
        dhts = [swarm.add_dht(fixed_identity(i)).dht for i in range(n)]
        ids = [d.peer_id for d in dhts] + list(made_up)
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
        _honest_pair_and_liar(honest_a, honest_b, liar)
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
        found = joiner.candidates("router", SHAPES, timeout_s=20)
        both = found.states
        assert found.served == {one.own_peer_id, other.own_peer_id}  # they run, whichever state is right
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
        _honest_pair_and_liar(honest_a, honest_b, liar)
        for _ in range(6):
            got = joiner.download("router", SHAPES, timeout_s=20)
            assert got is not None and got[0]["round"] == 4 and torch.equal(got[1][0], _state(1.0)[1][0])


def test_the_peers_put_first_are_asked_first_each_part_in_random_order() -> None:
    live = [f"p{i}" for i in range(40)]
    orders = [source_order(live, own="p0", first={"p7", "p9", "p0", "gone"}) for _ in range(20)]
    assert all(set(o[:2]) == {"p7", "p9"} and sorted(o) == sorted(live[1:]) for o in orders)
    assert len({tuple(o[2:]) for o in orders}) > 1  # the rest drawn at random
    assert source_order(live, own="p0", sources={"p3", "p9"}, first={"p9"}) == ["p9", "p3"]


def test_a_download_asks_the_peers_vouched_for_before_identities_nobody_runs(caplog) -> None:
    """Any identity that heartbeats is a live composer: here 40 whose peer ids nobody runs stand beside two honest
    sources and a liar. A download asks the peers the rounds records vouch for first and, as they answer, none of
    the others (drawn from all alike, nearly every draw of three would hold made-up ones, each failing only once its
    dial does)."""
    caplog.set_level(logging.INFO, logger="parallax.node.outer.state")
    with _swarm(4, MADE_UP) as (joiner, honest_a, honest_b, liar):
        _honest_pair_and_liar(honest_a, honest_b, liar)
        first = {honest_a.own_peer_id, honest_b.own_peer_id, liar.own_peer_id}
        for _ in range(3):
            got = joiner.download("router", SHAPES, timeout_s=20, first=first)
            assert got is not None and got[0]["round"] == 4 and torch.equal(got[1][0], _state(1.0)[1][0])
    asked = [p for p in MADE_UP if p in caplog.text]
    assert not asked, f"{len(asked)} made-up peers asked"


def test_past_the_peers_vouched_for_a_download_asks_a_few_others_for_a_third_state(caplog) -> None:
    """Two peers vouched for serve agreeing states; the liar and 40 identities nobody runs are the others. A third
    state is asked of at most three of them (the liar's, when drawn, is outvoted), never of all."""
    caplog.set_level(logging.INFO, logger="parallax.node.outer.state")
    with _swarm(4, MADE_UP) as (joiner, honest_a, honest_b, liar):
        _honest_pair_and_liar(honest_a, honest_b, liar)
        for _ in range(3):
            caplog.clear()
            got = joiner.download("router", SHAPES, timeout_s=20, first={honest_a.own_peer_id, honest_b.own_peer_id})
            assert got is not None and got[0]["round"] == 4 and torch.equal(got[1][0], _state(1.0)[1][0])
            asked = [p for p in MADE_UP if p in caplog.text]
            assert len(asked) <= 3, f"{len(asked)} made-up peers asked"


def test_when_the_peers_vouched_for_give_fewer_than_two_states_the_others_are_asked_in_turn() -> None:
    """The one peer vouched for answers late, while three others are asked and identities nobody runs fail; it gives
    one state, and the others are then asked in turn until states that agree with it are in hand (from the two honest
    peers nobody vouched for yet)."""

    def late() -> tuple[dict, list[torch.Tensor]]:
        time.sleep(2.0)  # holds this source's own network loop: it answers after the others were asked
        return _state(1.0)

    with _swarm(4, MADE_UP) as (joiner, vouched_for, honest_b, honest_c):
        vouched_for.serve("router", late)
        honest_b.serve("router", lambda: _state(1.0))
        honest_c.serve("router", lambda: _state(1.0))
        for _ in range(3):
            got = joiner.download("router", SHAPES, timeout_s=30, first={vouched_for.own_peer_id})
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
