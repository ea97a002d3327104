"""Work on one's own data: whether a contribution holds what its sender learnt of the batches it trained on.

A composer's batches come from a sampler that its identity and the run's seed seed (``data.BatchSampler``,
``data.data_seed``), so any peer that knows the identity and how many batches the sampler had handed out when
the pseudo-gradient was taken (``RoundEntry.drawn``, signed) rebuilds the batches it trained on
(``BatchSampler.replay``). A pseudo-gradient trained on them lowers the loss on them by more than a merge of the
others' pseudo-gradients does: it holds what its sender learnt of its own batches, which a merge dilutes. A copy of
another's pseudo-gradient, plus noise, holds nothing of them, and lowers the loss on them by less than the merge,
which averages the noise out. ``bench own-data`` measures this in the simulator, with the audited composer's model and
with another's (docs/benchmarks.md, "Work on one's own data").

An audit is a ``margin``: ``(own - merged) / |merged|``, where ``own`` and ``merged`` are what the contribution and a
merge lower the auditor's loss by on the rebuilt batches, from the group's anchor (``gains``). A peer is judged not to
work on its own data when fewer than half of its last ``WINDOW`` margins pass (``FAILS_BELOW``, ``judged_idle``). Beside
it, an audit measures both gains on as many batches of a stream the sender never drew (``control_seed``): what the
contribution shows of any batch of the corpus, whatever the auditor's model makes of it, for its own batches' gain to
be compared with: an honest contribution gains more on its sender's batches than on the control's (``own -
own_control``; ``beyond_merge``: by more than the merge does). That tells a copier among nodes that train at their own
pace, where the margins do not, but only pooled over more audits of a peer than one auditor takes: recorded, and
reported by ``bench attacks``; no rule uses it yet.

A node with ``net.outer.own_data_audits`` audits one contribution of each of its ``GROUP`` rounds that merged (``Case``,
drawn at random among the set's others by ``outer.gathered``) against the round's merge, on its own model, at the seam
that applies the round (``Auditor``), and records each audit and the judgement its peer's margins make. Nothing acts on
the judgement: in a local swarm whose nodes train at their own pace the honest composers' audits fail, where they
pass in lockstep and in the simulator (docs/decisions.md, "Work on one's own data"). The merge holds the audited
contribution too (a partitioned round's node holds no other whole).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from parallax.node.train.data import BatchSampler

if TYPE_CHECKING:
    from parallax.node.train.composer import Composer

logger = logging.getLogger(__name__)

GROUP = "backbone"
"""The group whose contributions are audited: the one ``bench own-data`` measured."""
BATCHES = 16
"""The batches an audit rebuilds: the last ones its sender drew before the pseudo-gradient was taken (at most the
group's period)."""
WINDOW = 8
"""The audits a judgement looks back on."""
FAILS_BELOW = -0.2
"""An audit fails when the contribution lowers the loss on its sender's batches by more than this much less than the
round's merge does, relative to the merge's: early in a run every pseudo-gradient is mostly what all the data has in
common, and an honest sender's margins hover about 0 (most within 0.15 of it in ``bench own-data``, single audits down
to -0.57), a copier's fall below -0.2 within a few rounds and stay there."""
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


def control_seed(seed: int) -> int:
    """The seed of a stream drawn like a sender's (``seed``'s) that it never trained on: what its contribution lowers
    the loss on there is what any batch of the corpus shows of it."""
    digest = hashlib.sha256(f"parallax/own-data/control/{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def margin(own: float, merged: float) -> float:
    """How much more a contribution lowered the loss on its sender's batches than the merge of the others' did,
    relative to the latter."""
    return (own - merged) / max(abs(merged), 1e-9)


def beyond_merge(own: float, merged: float, own_control: float, merged_control: float) -> float:
    """How much more of a contribution's gain is specific to its sender's batches (above its gain on the control
    batches) than of the merge's: the model an audit runs on raises or lowers the loss on every batch alike, which
    the difference to the control cancels; the merge holds a share of the sender's batches' specific gain (the
    contribution is one of its terms) and none of a copier's."""
    return (own - own_control) - (merged - merged_control)


def judged_idle(margins: Sequence[float], window: int = WINDOW) -> bool:
    """Whether the last ``window`` margins judge their peer not to work on its own data: fewer than half of them pass
    (above ``FAILS_BELOW``; never with fewer than a window)."""
    last = margins[-window:]
    return len(last) == window and sum(m > FAILS_BELOW for m in last) * 2 < window


def idle_share(margins: Sequence[float], window: int = WINDOW) -> float | None:
    """The share of ``window``-long runs of consecutive audits that judge their peer idle (None with fewer audits
    than a window)."""
    runs = [margins[i:i + window] for i in range(len(margins) - window + 1)]
    return sum(judged_idle(r, window) for r in runs) / len(runs) if runs else None


class _Audited(NamedTuple):
    margins: list[float]  # the latest, at most a window, oldest first
    session: int  # of the latest audited claim
    drawn: int  # the largest draw count an audited claim of that session named


class OwnDataAudits:
    """The latest ``WINDOW`` margins of each audited peer, and the judgement they make."""

    def __init__(self, window: int = WINDOW, peers_kept: int = PEERS_KEPT) -> None:
        self.window, self.peers_kept = window, peers_kept
        self._held: OrderedDict[str, _Audited] = OrderedDict()  # the peer audited least lately first

    def add(self, peer: str, value: float, *, drawn: int = 0, session: int = 0) -> bool:
        """Note an audit of ``peer`` (of a claim of ``session`` naming ``drawn`` draws); returns whether its margins
        now judge it idle."""
        earlier, before = self.margins(peer), self.drawn(peer, session)
        self._held.pop(peer, None)  # reinserted last: the peer audited least lately goes first
        margins = [*earlier, value][-self.window:]
        self._held[peer] = _Audited(margins, session, max(drawn, before))
        while len(self._held) > self.peers_kept:
            self._held.popitem(last=False)
        return judged_idle(margins, self.window)

    def drawn(self, peer: str, session: int = 0) -> int:
        """The largest draw count an audited claim of ``peer`` of ``session`` named (0: none audited)."""
        held = self._held.get(peer)
        return held.drawn if held is not None and held.session == session else 0

    def judged(self, peer: str) -> bool:
        return judged_idle(self.margins(peer), self.window)

    def margins(self, peer: str) -> list[float]:
        """``peer``'s latest margins (at most a window), oldest first."""
        held = self._held.get(peer)
        return list(held.margins) if held is not None else []


@dataclass(frozen=True)
class Case:
    """A contribution to audit: its sender (libp2p peer id), the draws its signed claim names (``RoundEntry.drawn``),
    its pseudo-gradient as decoded, and the round's merge (every contribution of the set, this one included, as the
    round merged them)."""

    peer: str
    drawn: int
    offered: Mapping[str, torch.Tensor]
    merged: Mapping[str, torch.Tensor]
    session: int = 0
    """The sender's round-taking instance its claim names (``RoundEntry.session``): a restart without a checkpoint
    may count its draws from 0 again."""


FAILED = -1.0
"""The margin of a claim no honest sender makes: no draws, or no more than its claim of the same session audited
before."""


class Auditor:
    """Audits contributions on this node's composer (the training thread's: at the seam, ``BackgroundRounds``).

    The batches are the sender's last ``BATCHES`` draws before its claim's count (at most the group's ``period``): what
    an optimizer took its latest steps on stays in the pseudo-gradient most (16 drawn at random among the period's do
    not tell an honest sender from a copier: ``bench own-data``); the control batches are as many draws of the
    ``control_seed`` stream, at the same draw numbers.

    Args:
        composer: this node's; its anchor of ``GROUP`` is the one the audited contributions were taken from.
        seed_of: a peer id's data stream seed (``data.data_seed`` of its identity), None when the peer is not
            known.
        period: ``GROUP``'s period: at most that many of a sender's draws are its round's.
        audits: the margins kept, and the judgement they make.
        event: a metrics event (``Telemetry.event``) for each audit.
    """

    def __init__(self, composer: Composer, seed_of: Callable[[str], int | None], period: int,
                 audits: OwnDataAudits, event: Callable[..., None] | None = None) -> None:
        self.composer, self.seed_of, self.period, self.audits, self.event = composer, seed_of, period, audits, event

    def __call__(self, group: str, case: Case) -> float | None:
        """Audit ``case`` of ``group``: its margin, or None when its sender's data cannot be rebuilt here."""
        seed = self.seed_of(case.peer)
        if seed is None:
            return None
        began = time.perf_counter()
        own: float | None = None
        merged: float | None = None
        own_control: float | None = None
        merged_control: float | None = None
        if case.drawn < 1 or case.drawn <= self.audits.drawn(case.peer, case.session):
            value = FAILED  # an honest sender's count grows with every round it trains
        else:
            sampler = self.composer.sampler
            count = min(BATCHES, self.period, case.drawn)
            batches = BatchSampler(sampler.tokens, sampler.batch_size, sampler.seq_len, seed).replay(
                case.drawn - count, count)
            own, merged = gains(self.composer, group, [case.offered, case.merged], batches)
            control = BatchSampler(sampler.tokens, sampler.batch_size, sampler.seq_len, control_seed(seed)).replay(
                case.drawn - count, count)
            own_control, merged_control = gains(self.composer, group, [case.offered, case.merged], control)
            value = margin(own, merged)
        before = self.audits.judged(case.peer)
        judged = self.audits.add(case.peer, value, drawn=case.drawn, session=case.session)
        if judged != before:
            if judged:
                logger.info("peer %s: its contributions learn less of the batches it says it drew than the round's "
                            "merge does in %d of its last %d audits (recorded; no judgement acts on it)", case.peer,
                            sum(m <= FAILS_BELOW for m in self.audits.margins(case.peer)), self.audits.window)
            else:
                logger.info("peer %s: its contributions learn of its own batches again", case.peer)
        if self.event is not None:
            self.event("own_data_audit", peer=case.peer, group=group, margin=round(value, 4),
                       own=_rounded(own), merged=_rounded(merged), own_control=_rounded(own_control),
                       merged_control=_rounded(merged_control),
                       drawn=case.drawn, judged=judged, seconds=round(time.perf_counter() - began, 3))
        return value
