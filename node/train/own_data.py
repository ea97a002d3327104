"""Work on one's own data: whether a contribution holds what its sender learnt of the batches it trained on.

A composer's batches come from a sampler that its identity and the run's seed seed (``data.BatchSampler``,
``peer.runner.data_seed``), so any peer that knows the identity and how many batches the sampler had handed out when
the pseudo-gradient was taken (``RoundEntry.drawn``, signed) rebuilds the batches it trained on
(``BatchSampler.replay``). A pseudo-gradient trained on them lowers the loss on them by more than a merge of the
others' pseudo-gradients does: it holds what its sender learnt of its own batches, which a merge dilutes. A copy of
another's pseudo-gradient, plus noise, holds nothing of them, and lowers the loss on them by less than the merge,
which averages the noise out. ``bench own-data`` measures this in the simulator, with the audited composer's model and
with another's (docs/benchmarks.md, "Work on one's own data").

An audit is a ``margin``: ``(own - merged) / |merged|``, where ``own`` and ``merged`` are what each pseudo-gradient
lowers the auditor's loss by on the rebuilt batches, from the group's anchor (``gains``). A peer is judged not to work
on its own data when fewer than half of its last ``WINDOW`` margins are positive (``judged_idle``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from parallax.node.train.composer import Composer

BATCHES = 16
"""The batches an audit rebuilds: the last ones its sender drew before the pseudo-gradient was taken (at most the
group's period)."""
WINDOW = 8
"""The audits a judgement looks back on."""
PEERS_KEPT = 1024
"""Peers whose margins are kept (those audited least lately go first)."""


def gains(composer: Composer, group: str, deltas: Sequence[Mapping[str, torch.Tensor]],
          batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """How much each of ``deltas`` (pseudo-gradients of ``group``: anchor - parameters) lowers ``composer``'s loss on
    ``batches`` from the group's anchor. The composer's live parameters are left as they were."""
    outer = composer.outer[group]
    live = outer.live_copy()
    try:
        outer.load_live(outer.anchor)
        at_anchor = composer.evaluate(batches)
        out = []
        for delta in deltas:
            outer.load_live({name: outer.anchor[name] - delta[name] for name in outer.anchor})
            out.append(at_anchor - composer.evaluate(batches))
        return out
    finally:
        outer.load_live(live)


def margin(own: float, merged: float) -> float:
    """How much more a contribution lowered the loss on its sender's batches than the merge of the others' did,
    relative to the latter."""
    return (own - merged) / max(abs(merged), 1e-9)


def judged_idle(margins: Sequence[float], window: int = WINDOW) -> bool:
    """Whether the last ``window`` margins judge their peer not to work on its own data: fewer than half of them
    positive (never with fewer than a window)."""
    last = margins[-window:]
    return len(last) == window and sum(m > 0 for m in last) * 2 < window


def idle_share(margins: Sequence[float], window: int = WINDOW) -> float | None:
    """The share of ``window``-long runs of consecutive audits that judge their peer idle (None with fewer audits
    than a window)."""
    runs = [margins[i:i + window] for i in range(len(margins) - window + 1)]
    return sum(judged_idle(r, window) for r in runs) / len(runs) if runs else None


class OwnDataAudits:
    """The latest ``WINDOW`` margins of each audited peer, and the judgement they make."""

    def __init__(self, window: int = WINDOW, peers_kept: int = PEERS_KEPT) -> None:
        self.window, self.peers_kept = window, peers_kept
        self._margins: OrderedDict[str, list[float]] = OrderedDict()

    def add(self, peer: str, value: float) -> bool:
        """Note an audit of ``peer``; returns whether its margins now judge it idle."""
        kept = self._margins.pop(peer, [])
        kept = [*kept, value][-self.window:]
        self._margins[peer] = kept
        while len(self._margins) > self.peers_kept:
            self._margins.popitem(last=False)
        return judged_idle(kept, self.window)

    def judged(self, peer: str) -> bool:
        return judged_idle(self._margins.get(peer, []), self.window)

    def audited(self, peer: str) -> int:
        """Audits of ``peer`` held (at most a window)."""
        return len(self._margins.get(peer, []))

    def least_lately(self, peers: Sequence[str]) -> str | None:
        """Of ``peers``, the one to audit next: one never audited first (in the given order), else the one audited
        least lately."""
        order = {peer: i for i, peer in enumerate(self._margins)}
        return min(peers, key=lambda p: order.get(p, -1), default=None)
