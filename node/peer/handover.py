"""Taking one expert over: whom to ask for its snapshot, in which order, and when to stop asking.

A pure state machine in the style of h11's ``_state.py``: the node feeds it events (an answer arrived, time
passed) with the time they happened, and carries out the actions it returns (ask a peer, finish with the best
snapshot). No clock, no network, no composer inside: the unit tests drive it with plain events.

The protocol. The new owner asks the previous owner first (when it is alive; with replicas, an owner that keeps
the expert, whose first snapshot is enough), then, while the answers are not the hand-over's final snapshot, every
other live composer in turn (those a later view shows too: ``meet``), with the previous owner again every other
request: a previous owner whose view lagged ours releases the expert (and serves its final snapshot) seconds
later, and under churn the node that trained the expert last may not be the owner our view names. At most
two requests a second per expert. A request unanswered for ``stall_s`` (a stream stalled on a link that came back,
a peer that accepts and sends nothing) holds nothing up: the next peer is asked beside it, and its answer, should it
come within the wait, counts as any other. The wait ends with the hand-over's final snapshot (released within
``handover_window_s`` before the adoption began, and not before this node came online), or when ``wait_s``
has passed; the node then adopts the newest snapshot it was served, or its own copy when that was taken later
("newest" by when each holder took its copy: every node counts its own steps), or restarts the expert from its
initialisation when it has neither.

When the previous owner is dead, there is no hand-over to wait for: unless this node holds the copy it pulled as
the expert's heir, it asks every other live composer once (a survey) and adopts the newest copy served. A final
snapshot does not end a survey early: a peer that released the expert to the dead owner serves one, older than
what the dead owner trained after it, which its heir (in that heir's view, maybe not ours) still holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

REQUEST_INTERVAL_S = 0.5
"""At most one request per expert this often (two a second)."""
STALL_S = 2.0
"""A request unanswered this long is stalled: the hand-over asks on beside it (module docstring). At full pace: the
node stretches it as it stretches ``wait_s``."""


class Served(Protocol):
    """What the state machine reads of a snapshot."""

    @property
    def step(self) -> int: ...

    @property
    def final(self) -> bool: ...

    @property
    def age_s(self) -> float: ...


class Phase(enum.Enum):
    ASKING = "asking"
    """A request is in flight to ``Handover.asking``."""
    ANSWERED = "answered"
    """The last request was answered without the final snapshot; the next goes out after the interval."""
    DONE = "done"
    """Finished: the node adopts ``Handover.best`` (or its own copy, or the initialisation)."""


@dataclass(frozen=True, slots=True)
class Ask:
    """Action: request the expert's snapshot from ``peer`` (a libp2p peer id) and report the answer."""

    peer: str


@dataclass(frozen=True, slots=True)
class Finish:
    """Action: adopt the expert from ``best`` (None: nobody served one) or from a newer own heir copy."""

    best: Served | None


Action = Ask | Finish


@dataclass
class Handover:
    """The take-over of one expert (module docstring).

    Args:
        source: the previous owner's peer id when it is alive; None when it is dead.
        others: the other live composers' peer ids, asked in turn after the source.
        started: when the adoption began (the node's monotonic clock, seconds).
        online_since: earliest release time a final snapshot may have to count as this hand-over's (when this
            node came online, less a heartbeat lifetime for views that lag).
        wait_s: give up asking after this long.
        handover_window_s: a final snapshot released longer than this before ``started`` is stale.
        has_own_copy: this node holds the copy it pulled as the expert's heir (with a dead source: ask nobody).
        live_source: the source keeps training the expert (another of its owners, with replicas): its first
            snapshot ends the wait as a final one would; it never releases the expert.
        stall_s: a request unanswered this long is stalled (``STALL_S``).
    """

    source: str | None
    others: list[str]
    started: float
    online_since: float
    wait_s: float
    handover_window_s: float
    has_own_copy: bool = False
    live_source: bool = False
    stall_s: float = STALL_S
    phase: Phase = Phase.ASKING
    asking: str | None = None
    asked_at: float = 0.0
    best: Served | None = None
    survey: bool = False
    """The source is dead: each of ``others`` is asked once, and the newest copy wins."""
    _last: Served | None = field(default=None, repr=False)
    _best_taken: float = field(default=0.0, repr=False)  # when ``best``'s holder took it
    _known: set[str] = field(default_factory=set, repr=False)  # every peer the hand-over asks or has asked
    stalled: set[str] = field(default_factory=set)
    """Peers whose request stalled and has not been answered: not asked again until it is."""

    def meet(self, peers: list[str]) -> None:
        """Live composers a later view shows: those the hand-over did not know are asked in turn too. A view read
        just as a partition healed, or on a loaded host, shows some of the others late, and the owner that trained
        the expert meanwhile may be among them."""
        if self.phase is Phase.DONE:
            return
        self.others += [p for p in peers if p not in self._known]
        self._known.update(peers)

    def start(self) -> list[Action]:
        """The first action: ask the source, or (dead source) another peer unless we hold our own copy."""
        self._known = {p for p in (self.source, *self.others) if p is not None}
        others = [p for p in self.others if p != self.source]
        if self.source is None:
            if self.has_own_copy or not others:
                self.others = []
                return self._finish()
            self.survey = True
            self.source = others.pop(0)
        self.others = others
        return self._ask(self.source, self.started)

    def answered(self, snapshot: Served | None, now: float, peer: str | None = None) -> list[Action]:
        """``peer``'s request was answered (``snapshot`` None: it holds none or failed); ``peer`` None: the request
        in flight. The answer of a stalled request counts as any other, and asks nothing itself."""
        peer = self.asking if peer is None else peer
        current = self.phase is Phase.ASKING and peer == self.asking
        if self.phase is Phase.DONE or not (current or peer in self.stalled):
            return []
        self.stalled.discard(peer)
        # The newest by when its holder took it: each node counts its own steps, so steps order nothing here.
        if snapshot is not None and (self.best is None or now - snapshot.age_s >= self._best_taken):
            self.best, self._best_taken = snapshot, now - snapshot.age_s
        in_flight = self.phase is Phase.ASKING and not current  # another request, not stalled yet
        survey_over = self.survey and not self.others and not self.stalled and not in_flight
        if self._is_handover_final(peer, snapshot, now) or now - self.started >= self.wait_s or survey_over:
            return self._finish()
        if not current:
            return []
        self._last = snapshot
        self.phase = Phase.ANSWERED
        return self.tick(now)

    def tick(self, now: float) -> list[Action]:
        """Time passed: ask the next peer once the interval is over; give up once the wait is."""
        if self.phase is Phase.DONE:
            return []
        if now - self.started >= self.wait_s:
            return self._finish()
        if self.phase is Phase.ASKING:
            if now - self.asked_at < self.stall_s:
                return []
            assert self.asking is not None
            self.stalled.add(self.asking)  # its answer may still come: ``answered`` takes it
            self.phase, self._last = Phase.ANSWERED, None
        if now - self.asked_at < REQUEST_INTERVAL_S:
            return []
        assert self.asking is not None and self.source is not None
        if self.survey:
            # ``answered`` finished when none was left to ask and none stalled; a stalled one is waited for.
            return self._ask(self.others.pop(0), now) if self.others else []
        last = self._last
        # Nothing there, a stale final, or another peer's copy (an heir's, or with a live source a replica's; a
        # peer whose lagging view still has it train the expert serves its final when next in turn): someone else.
        if (last is None or last.final or self.asking != self.source) and self.others:
            # The next of the others, in turn, and every other time the previous owner again; past those stalled.
            nxt = self._next_other() if self.asking == self.source or self.source in self.stalled else self.source
            if nxt is None and self.source not in self.stalled:
                nxt = self.source
            return [] if nxt is None else self._ask(nxt, now)
        return [] if self.asking in self.stalled else self._ask(self.asking, now)

    def _next_other(self) -> str | None:
        """The next of ``others`` in turn whose request has not stalled (the turn moves past it), or None."""
        for _ in range(len(self.others)):
            nxt = self.others.pop(0)
            self.others.append(nxt)
            if nxt not in self.stalled:
                return nxt
        return None

    def _is_handover_final(self, peer: str | None, snapshot: Served | None, now: float) -> bool:
        if self.survey:
            return False
        if snapshot is not None and self.live_source and peer == self.source:
            return True
        if snapshot is None or not snapshot.final:
            return False
        released_at = now - snapshot.age_s
        return released_at >= max(self.online_since, self.started - self.handover_window_s)

    def _ask(self, peer: str, now: float) -> list[Action]:
        self.phase, self.asking, self.asked_at = Phase.ASKING, peer, now
        return [Ask(peer)]

    def _finish(self) -> list[Action]:
        self.phase = Phase.DONE
        return [Finish(self.best)]
