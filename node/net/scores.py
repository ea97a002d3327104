"""What this node holds against each peer, and whom it ignores for a while because of it.

Evidence (``Evidence``: what was found, and how much it counts) comes from the places that check what peers
send: a gathered outer round whose robust merge dropped or clipped a contribution far past the honest spread, a
contribution whose body did not match its signed announcement or did not decode, a surrogate update that would
multiply the surrogate. Each piece adds its weight to the sender's score, which halves every ``half_life_s``;
a peer whose score reaches ``threshold`` is banned for ``ban_s``: this node leaves it out of its rounds
(``GroupAverager``) and says so in its log, naming it. Bans are local: every node judges for itself, so a
liar cannot get an honest peer banned by others by accusing it. What peers share is proof, never accusation:
two contributions a peer signed for one round (``outer.witness``) are checked by each node against the peer's
own key before it bans.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

logger = logging.getLogger(__name__)

_MAX_PEERS = 4096  # bounded memory: the least suspected are forgotten first


class Evidence(Enum):
    """What a check found against a peer, and its weight in the peer's score (a ban at ``threshold``, 2.5 by
    default). An outlier can be an honest peer's bad luck and counts 1; a body that contradicts its signed
    announcement, or an update that would multiply a surrogate, cannot be, and counts 2. A fetch held open with
    nothing sent counts 0.5: an honest peer answers at once, but a frozen host's daemon still accepts the stream
    its process will never serve (it is gone within a heartbeat's life); so does a round claimed in two sessions, once
    per pair (a restart from a checkpoint, once in a while; a new session for each fetcher, from a liar). A
    ``proof`` (two claims its sender signed for one round, or a block it signed with non-finite values:
    ``outer.witness``) bans at once, whatever the score: anyone can check it, so it is shared, and every peer that
    checks it bans the same sender. ``link`` evidence (a held fetch) is what a link broken on this node's own side also
    gives (``PeerScores``' ``own_link_doubtful``)."""

    OUTLIER = ("outlier outer contribution", 1.0)
    NON_FINITE = ("non-finite outer contribution", 1.0)
    ZERO_WEIGHT = ("zero weight outer contribution", 1.0)
    FORGED = ("forged or malformed outer contribution", 2.0)
    STALLED = ("outer contribution fetch accepted and then held", 0.5, False, True)
    SURROGATE_GROWTH = ("surrogate update past the growth bound", 2.0)
    RESTARTED = ("a round claimed again in another session", 0.5)
    MISMERGED = ("merged blocks of a partitioned round that its contributions do not give", 2.0)
    EQUIVOCATION = ("two signed contributions for one round", 2.5, True)
    BAD_BLOCK = ("a signed contribution block with non-finite values", 2.5, True)

    def __init__(self, reason: str, weight: float, proof: bool = False, link: bool = False) -> None:
        self.reason, self.weight, self.proof, self.link = reason, weight, proof, link


@dataclass
class _Record:
    score: float = 0.0
    at: float = 0.0
    banned_until: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)


class PeerScores:
    """Scores and bans by libp2p peer id (thread-safe).

    Args:
        threshold: the score at which a peer is banned (2.5: three pieces of evidence in quick succession).
        ban_s: how long a ban lasts (evidence during a ban extends it).
        half_life_s: how fast evidence fades.
        clock: monotonic seconds (injected for tests).
        on_ban: called with (peer, reasons) when a ban begins.
        own_link_doubtful: whether this node's own link may be what broke a stream now (its side of the swarm holds
            no majority: a partition, or its uplink down): evidence a broken link also gives (``Evidence.link``) is
            not counted then. Each peer behind the cut held every fetch this node had begun, and a ban would have
            the node ignore them once the link healed.
    """

    def __init__(self, threshold: float = 2.5, ban_s: float = 600.0, half_life_s: float = 600.0, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_ban: Callable[[str, dict[str, int]], None] | None = None,
                 own_link_doubtful: Callable[[], bool] | None = None) -> None:
        if not (threshold > 0 and ban_s > 0 and half_life_s > 0):
            raise ValueError("threshold, ban_s and half_life_s must be > 0")
        self.threshold, self.ban_s, self.half_life_s = threshold, ban_s, half_life_s
        self._clock, self._on_ban, self._own_link_doubtful = clock, on_ban, own_link_doubtful
        self._peers: dict[str, _Record] = {}
        self._lock = threading.Lock()

    def record(self, peer: str, evidence: Evidence) -> bool:
        """Add ``evidence`` against ``peer``; True when this starts (or extends) a ban."""
        if evidence.link and self._own_link_doubtful is not None and self._own_link_doubtful():
            logger.info("not counted against peer %s while this node's side of the swarm holds no majority (its own "
                        "link may be the cause): %s", peer, evidence.reason)
            return False
        now = self._clock()
        with self._lock:
            rec = self._peers.setdefault(peer, _Record(at=now))
            rec.score = self._decayed(rec, now) + evidence.weight
            rec.at = now
            rec.reasons[evidence.reason] = rec.reasons.get(evidence.reason, 0) + 1
            starts = rec.score >= self.threshold or evidence.proof
            was_banned = rec.banned_until > now
            if starts:
                rec.banned_until = now + self.ban_s
            reasons = dict(rec.reasons)
            if len(self._peers) > _MAX_PEERS:
                least = min(self._peers, key=lambda p: self._decayed(self._peers[p], now))
                del self._peers[least]
        if starts and not was_banned:
            logger.warning("ignoring peer %s for %.0f s: %s", peer, self.ban_s,
                           ", ".join(f"{n} x {r}" for r, n in sorted(reasons.items())))
            if self._on_ban is not None:
                self._on_ban(peer, reasons)
        return starts

    def banned(self, peer: str) -> bool:
        with self._lock:
            rec = self._peers.get(peer)
            return rec is not None and rec.banned_until > self._clock()

    def snapshot(self) -> dict[str, dict[str, object]]:
        """peer -> {"score", "banned_s" (seconds left, 0 when not banned), "reasons"}: status and metrics."""
        now = self._clock()
        with self._lock:
            return {peer: {"score": round(self._decayed(rec, now), 3),
                           "banned_s": round(max(0.0, rec.banned_until - now), 1), "reasons": dict(rec.reasons)}
                    for peer, rec in self._peers.items()}

    def suspects(self, limit: int, floor: float = 0.5) -> tuple[dict[str, float], tuple[str, ...]]:
        """The ``limit`` peers with the highest scores of at least ``floor`` (peer -> score, highest first), and
        the ``limit`` banned peers with the highest scores: what this node's heartbeat tells the swarm."""
        now = self._clock()
        with self._lock:
            scored = sorted(((self._decayed(rec, now), peer, rec.banned_until > now)
                             for peer, rec in self._peers.items()), reverse=True)
        top = {peer: round(score, 3) for score, peer, _ in scored if score >= floor}
        return dict(list(top.items())[:limit]), tuple(peer for _, peer, banned in scored if banned)[:limit]

    def _decayed(self, rec: _Record, now: float) -> float:
        return rec.score * math.pow(0.5, max(0.0, now - rec.at) / self.half_life_s)
