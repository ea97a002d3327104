"""The joiner's refit gate: no surrogate refresh until its backbone has merged with the swarm's.

A node that joins a running swarm starts from the swarm's last merged anchor, up to a whole backbone period
behind the backbones the others run; surrogates it fitted on those activations would mislead every receiver
(receivers keep the previous owner's surrogate meanwhile). The gate opens on the first merged round of the
group, when the node is alone in a fresh view (its own outer steps are then the swarm's), or after two of the
group's rounds failed (rounds that keep failing must not freeze its surrogates for good). The measurement
behind it is in docs/decisions.md ("A joiner's refits wait for a merged backbone").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

FAILED_ROUNDS_TO_OPEN = 2


class RefitGate:
    """Args:
    waits_for: the group whose merge opens the gate (None: open from the start).
    event: writes the metrics event ``refits_ready`` with the reason (merged, alone, rounds_failed).
    """

    def __init__(self, waits_for: str | None, event: Callable[..., None]) -> None:
        self.waits_for = waits_for
        self.event = event
        self.failed = 0

    @property
    def open(self) -> bool:
        return self.waits_for is None

    def round_done(self, group: str, ok: bool, step: int) -> None:
        """An outer round of ``group`` ended (``ok``: merged and verified)."""
        if group != self.waits_for:
            return
        self.failed += not ok
        if ok:
            self._ready("merged", step)
        elif self.failed >= FAILED_ROUNDS_TO_OPEN:
            logger.warning("%d %s rounds failed since joining; refitting surrogates without a merged backbone",
                           self.failed, group)
            self._ready("rounds_failed", step)

    def merged_alone(self, group: str, step: int) -> None:
        """This node applied an outer step of ``group`` alone, in a fresh view with no other composer."""
        if group == self.waits_for:
            self._ready("alone", step)

    def _ready(self, reason: str, step: int) -> None:
        self.event("refits_ready", step=step, reason=reason)
        self.waits_for = None
