"""A node taking an expert over (``Node._progress_adoption``), its pure decision logic with a stand-in exchange:
whom it asks, in which order, and what it adopts."""

from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace

from parallax.node.net.expert_exchange import Snapshot
from parallax.node.peer.runner import Node, _Adoption

EID = (0, 3)


class Exchange:
    """Answers ``fetch`` at once from ``held`` (peer -> snapshot or None), which a test may change."""

    def __init__(self, held: dict[str, Snapshot | None]) -> None:
        self.held, self.asked = held, []

    def fetch(self, peer: str, eid: tuple[int, int]) -> concurrent.futures.Future:
        self.asked.append(peer)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(self.held.get(peer))
        return future

    def take_local_copy(self, eid: tuple[int, int]) -> None:
        return None


def _node(exchange: Exchange) -> SimpleNamespace:
    adopted: list[tuple[Snapshot | None, str]] = []
    node = SimpleNamespace(exchange=exchange, config=SimpleNamespace(adopt_wait_s=30.0), _online_at=time.monotonic(),
                           membership=SimpleNamespace(config=SimpleNamespace(heartbeat_ttl_s=6.0)), _adopting={},
                           adopted=adopted)
    node._adopt = lambda eid, snapshot, *, source: adopted.append((snapshot, source))
    return node


def test_a_previous_owner_that_had_nothing_yet_is_asked_again_in_turn() -> None:
    """The previous owner's view lagged ours: it releases (and serves its final snapshot) only after the other
    live peers said they hold nothing. It must be asked again, every other request, not the last peer over and
    over (that ended in a restart from init in `parallax bench swarm` runs, losing the expert's training)."""
    exchange = Exchange({"owner": None, "b": None, "c": None})
    node = _node(exchange)
    adoption = _Adoption(EID, "owner", time.monotonic(), others=["b", "c"], asking="owner")
    adoption.future, adoption.asked = exchange.fetch("owner", EID), 0.0
    node._adopting[EID] = adoption
    for _ in range(3):  # the owner, b, the owner, c: nobody holds it yet
        adoption.asked = 0.0  # as if half a second passed between seams
        Node._progress_adoption(node, adoption)
    final = Snapshot(EID[0], EID[1], step=51, final=True, tensors={}, age_s=0.1)
    exchange.held["owner"] = final  # the owner released it meanwhile
    for _ in range(2):  # c holds nothing either: the owner's turn again, and its final snapshot ends the wait
        adoption.asked = 0.0
        Node._progress_adoption(node, adoption)
    assert exchange.asked == ["owner", "b", "owner", "c", "owner"]
    assert node.adopted == [(final, "previous owner")] and EID not in node._adopting


def test_requests_are_paced_and_the_wait_ends_in_init_only_when_nobody_served_one() -> None:
    exchange = Exchange({"owner": None})
    node = _node(exchange)
    adoption = _Adoption(EID, "owner", time.monotonic(), others=[], asking="owner")
    adoption.future, adoption.asked = exchange.fetch("owner", EID), time.monotonic()
    node._adopting[EID] = adoption
    for _ in range(5):  # seams within half a second: no new request
        Node._progress_adoption(node, adoption)
    assert exchange.asked == ["owner"] and not node.adopted
    adoption.started -= 31.0  # the adoption wait is over
    Node._progress_adoption(node, adoption)
    assert node.adopted == [(None, "init")]
