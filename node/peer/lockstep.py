"""Surrogate updates in lockstep (``node.lockstep``): every node applies an owner's update the same number of its own
steps after the owner published it, however soon gossip brought it.

Without lockstep a receiver applies an update at the first seam after it arrives, so two runs of the same swarm apply
the same updates a few steps apart, and the tiny preset's losses end percents apart for that alone. In lockstep an
update published at the owner's step ``s`` (``SurrogateDelta.step``) is applied at the receiver's step ``s + lag``
(``lag`` = ``train.surrogate.refresh_every``); at each refresh step the receiver first waits, bounded, for the updates
published one refresh before by the owners that owned their experts then and still do (a new owner publishes its
first update when its adoption ends, at no step the others can tell). An expert whose update missed a wait (an owner
that defers its refits, or left) is not waited for again until an update as recent as the one waited for comes. The
announced step is the owner's word: one past what a node could be ahead of the receiver counts from there, and one
that stays old costs its receivers a single wait, so a lie delays its own updates by a bounded number of steps and
nothing else. Updates held back are not in the model yet: ``applied`` gives the versions it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

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
        self._late: dict[ExpertId, int] = {}  # missed the wait for this publication step: not waited for until it came
        self._owners: dict[ExpertId, str] = {}  # the followed experts' owners at the last refresh step
        self._given: dict[ExpertId, int] = {}  # the version of each expert's surrogate as applied

    def add(self, updates: Iterable[SurrogateUpdate], step: int) -> None:
        """Hold ``updates`` (drained at the receiver's ``step``) until they are due."""
        for update in updates:
            eid = (update.layer, update.expert)
            published = min(update.step, step + AHEAD_LAGS * self.lag)
            self._held.append((published + self.lag, update))
            self._published[eid] = max(self._published.get(eid, -1), published)
            if published >= self._late.get(eid, published + 1):
                del self._late[eid]

    def expect(self, step: int, followed: Callable[[], Mapping[ExpertId, str]]) -> set[ExpertId]:
        """At a refresh step (``step`` a multiple of the lag), the experts whose update of one refresh ago is waited
        for: those that ``followed()`` (expert -> its live owner, another node) gives the same owner as at the last
        refresh step, from the second on (owners first publish at the first), but the late ones. Nothing at any other
        step (``followed`` is not called). Records the owners for the next refresh step."""
        if step < self.lag or step % self.lag:
            return set()
        before, self._owners = self._owners, dict(followed())
        if step < 2 * self.lag:
            return set()
        return {eid for eid, owner in self._owners.items() if before.get(eid) == owner and eid not in self._late}

    def missing(self, step: int, expected: Iterable[ExpertId]) -> set[ExpertId]:
        """Those of ``expected`` whose update published one refresh before ``step`` (or later) has not arrived."""
        return {eid for eid in expected if self._published.get(eid, -1) < step - self.lag}

    def late(self, eids: Iterable[ExpertId], step: int) -> None:
        """``eids`` missed the wait at ``step``: not waited for again until an update published one refresh before
        it, or later, comes (an owner that announces older steps is waited for once, not at every refresh)."""
        for eid in eids:
            self._late[eid] = step - self.lag

    def due(self, step: int) -> list[SurrogateUpdate]:
        """The held updates due at ``step``, in arrival order, but those at or below the version applied already (a
        snapshot set the surrogate past them); per expert, none after one that is not due yet (an expert's deltas
        apply in version order)."""
        out: list[SurrogateUpdate] = []
        kept: list[tuple[int, SurrogateUpdate]] = []
        blocked: set[ExpertId] = set()
        for at, update in self._held:
            eid = (update.layer, update.expert)
            if at <= step and eid not in blocked:
                if update.version > self._given.get(eid, 0):
                    out.append(update)
                    self._given[eid] = update.version
            else:
                blocked.add(eid)
                kept.append((at, update))
        self._held = kept
        return out

    def replaced(self, eid: ExpertId, version: int) -> None:
        """A snapshot set ``eid``'s surrogate at ``version``: the updates held up to it are in it already."""
        self._given[eid] = max(self._given.get(eid, 0), version)

    def applied(self, versions: Mapping[ExpertId, int]) -> dict[ExpertId, int]:
        """``versions`` (``SurrogateGossip.versions``: what gossip fetched) as the surrogates hold them: an expert with
        updates held back at the version applied (none yet: left out). Checkpoints and snapshots name these."""
        waiting = {(u.layer, u.expert) for _, u in self._held}
        out = {eid: v for eid, v in versions.items() if eid not in waiting}
        out.update({eid: self._given[eid] for eid in waiting if eid in self._given})
        return out
