"""Surrogate updates in lockstep (``node.lockstep``): every node applies an owner's update the same number of its own
steps after the owner published it, however soon gossip brought it.

Without lockstep a receiver applies an update at the first seam after it arrives, so two runs of the same swarm apply
the same updates a few steps apart, and the tiny preset's losses end percents apart for that alone. In lockstep an
update published at the owner's step ``s`` (``SurrogateDelta.step``) is applied at the receiver's step ``s + lag``
(``lag`` = ``train.surrogate.refresh_every``); at each refresh step the receiver first waits, bounded, for the updates
published one refresh before by the owners that owned their experts then and still do (a new owner publishes its
first update when its adoption ends, at no step the others can tell). An expert whose update missed a wait is not
waited for again until one of its updates comes (an owner that defers its refits, or left). The announced step is the
owner's word: one past what a node could be ahead of the receiver counts from there, so a lie delays its own updates
by a bounded number of steps and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from parallax.dht.keys import ExpertId
from parallax.node.net.gossip import SurrogateUpdate

AHEAD_LAGS = 4
"""An announced step further than this many lags past the receiver's own counts as the receiver's step plus that."""


class LockstepSurrogates:
    """The updates drained from gossip, held until the step they are due (module docstring)."""

    def __init__(self, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"lockstep lag must be >= 1 step, not {lag}")
        self.lag = lag
        self._held: list[tuple[int, SurrogateUpdate]] = []  # (the step it is due at, the update), in arrival order
        self._published: dict[ExpertId, int] = {}  # the latest publication step drained, per expert
        self._late: set[ExpertId] = set()  # missed a wait: not waited for until one of its updates comes
        self._owners: dict[ExpertId, str] = {}  # the followed experts' owners at the last refresh step

    def add(self, updates: Iterable[SurrogateUpdate], step: int) -> None:
        """Hold ``updates`` (drained at the receiver's ``step``) until they are due."""
        for update in updates:
            eid = (update.layer, update.expert)
            published = min(update.step, step + AHEAD_LAGS * self.lag)
            self._held.append((published + self.lag, update))
            self._published[eid] = max(self._published.get(eid, -1), published)
            self._late.discard(eid)

    def expect(self, step: int, followed: Mapping[ExpertId, str]) -> set[ExpertId]:
        """At a refresh step (``step`` a multiple of the lag), the experts whose update of one refresh ago is waited
        for: those of ``followed`` (expert -> its live owner, another node) that had the same owner at the last
        refresh step, from the second on (owners first publish at the first), but the late ones. Nothing at any other
        step. Records the owners for the next refresh step."""
        if step < self.lag or step % self.lag:
            return set()
        before, self._owners = self._owners, dict(followed)
        if step < 2 * self.lag:
            return set()
        return {eid for eid, owner in followed.items() if before.get(eid) == owner and eid not in self._late}

    def missing(self, step: int, expected: Iterable[ExpertId]) -> set[ExpertId]:
        """Those of ``expected`` whose update published one refresh before ``step`` (or later) has not arrived."""
        return {eid for eid in expected if self._published.get(eid, -1) < step - self.lag}

    def late(self, eids: Iterable[ExpertId]) -> None:
        """``eids`` missed a wait: not waited for again until one of their updates comes."""
        self._late.update(eids)

    def due(self, step: int) -> list[SurrogateUpdate]:
        """The held updates due at ``step``, in arrival order; per expert, none after one that is not due yet (an
        expert's deltas apply in version order)."""
        out: list[SurrogateUpdate] = []
        kept: list[tuple[int, SurrogateUpdate]] = []
        blocked: set[ExpertId] = set()
        for at, update in self._held:
            eid = (update.layer, update.expert)
            if at <= step and eid not in blocked:
                out.append(update)
            else:
                blocked.add(eid)
                kept.append((at, update))
        self._held = kept
        return out
