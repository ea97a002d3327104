"""Questions a node's network threads ask about the swarm, answered from the membership's cached view.

Every answer reads one immutable view (no DHT call), so gossip, the snapshot exchange, the outer rounds and the
offload client may call these from their own threads.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Collection, Sequence

from parallax.dht.adapter import dht_time
from parallax.dht.keys import ExpertId
from parallax.dht.membership import Member, Membership, QuorumState, SwarmView
from parallax.node.net.scores import PeerScores
from parallax.node.net.whoami import IdentityProver
from parallax.node.offload.proxy import SETTINGS_KEY
from parallax.node.train.data import data_seed

logger = logging.getLogger(__name__)

LEAVING = "leaving"
"""Heartbeat ``versions`` key a node sets while it leaves: its heirs fetch its final snapshots at once."""


class SwarmViews:
    """Views of the live swarm for one node.

    Args:
        membership: this node's membership (heartbeats, the cached view).
        fingerprint: this node's identity fingerprint.
        snapshot_every: the node's snapshot period (a leaving owner's final snapshot counts as this much newer).
        event: writes a metrics event (a worker running other settings is named once).
        scores: this node's bans (None: it bans nobody).
    """

    def __init__(self, membership: Membership, fingerprint: str, snapshot_every: int,
                 event: Callable[..., None], scores: PeerScores | None = None) -> None:
        self.membership = membership
        self.scores = scores
        self.fingerprint = fingerprint
        self.snapshot_every = snapshot_every
        self.event = event
        self.settings_digest: int | None = None
        """offload.settings_digest of this node's configuration (set when it offloads)."""
        self._mismatched_workers: set[str] = set()
        self._squatted: set[str] = set()
        self.prover: IdentityProver | None = None
        """Settles which identity a peer id claimed by two belongs to (set once the network loop runs)."""

    def peer_addresses(self) -> dict[str, tuple[str, ...]]:
        """The live members' libp2p peer ids and the addresses their heartbeats name (``Redialer``), banned
        peers left out."""
        return {m.heartbeat.peer_id: m.heartbeat.addresses for fp, m in self.membership.view().alive().items()
                if fp != self.fingerprint and not self.banned(m.heartbeat.peer_id)}

    def fresh(self) -> SwarmView | None:
        """The membership view, or None when our own reads have been failing (an overloaded host): then
        expired heartbeats prove nothing and no decision should follow from them, but one: a view that shows this node
        cut off (``SwarmView.short_since``) stands however late the next read comes, and dropping its experts trains
        none twice."""
        view, m = self.membership.view(), self.membership
        if view.quorum is QuorumState.LOST:
            return view
        return view if dht_time() - view.read_at <= m.read_s + 2 * m.timing.refresh_s + 1.0 else None

    def owner_key(self, eid: ExpertId) -> bytes | None:
        """The identity key of the expert's owner in the live assignment (who may publish its surrogate)."""
        view = self.membership.view()
        assignment = view.assignment()
        if assignment is None:
            return None
        member = view.members.get(assignment.owner(*eid))
        return member.public_key if member is not None else None

    def banned(self, peer_id: str) -> bool:
        """Whether this node ignores ``peer_id`` now (``node.net.scores``)."""
        return self.scores is not None and self.scores.banned(peer_id)

    def ignored(self, fingerprint: str, view: SwarmView) -> bool:
        """Whether the composer ``fingerprint`` of ``view`` owns nothing here: this node bans its peer id, or
        another identity claiming the same peer id proved it at that peer id (``whoami``). Never blocks: a
        question not answered yet ignores nobody."""
        member = view.members[fingerprint]
        peer_id = member.heartbeat.peer_id
        if self.banned(peer_id):
            return True
        claimants = [m.public_key for m in view.alive().values() if m.heartbeat.peer_id == peer_id]
        if len(claimants) < 2 or self.prover is None:
            return False
        key = self.prover.proven(peer_id, claimants)
        return key is not None and key != member.public_key

    def may_fetch(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may download this node's expert snapshots: a live composer or reader of the run (an
        exporter) that it does not ban."""
        member = self.member(peer_id)
        return member is not None and member.heartbeat.role in ("composer", "reader") and not self.banned(peer_id)

    def trusted_peers(self) -> list[str]:
        """The live composers' peer ids but those this node bans: where it loads group states from."""
        return [p for p in self.composer_peers() if not self.banned(p)]

    def owner_peer(self, eid: ExpertId) -> str | None:
        """The libp2p peer id of the expert's owner in the live assignment (logs and scores name it)."""
        view = self.membership.view()
        assignment = view.assignment()
        member = view.members.get(assignment.owner(*eid)) if assignment is not None else None
        return member.heartbeat.peer_id if member is not None else None

    def member(self, peer_id: str | None, *, live: bool = True) -> Member | None:
        """The live member whose signed heartbeat names this libp2p peer id (``live`` False: any member of the view,
        its heartbeat expired or not)."""
        if peer_id is None:
            return None
        view = self.membership.view()
        members = view.alive() if live else view.members
        found = [m for m in members.values() if m.heartbeat.peer_id == peer_id]
        if len(found) <= 1:
            return found[0] if found else None
        # Two identities claim one peer id: the one that proves it at that peer id (``whoami``), else neither.
        key = self.prover.proven(peer_id, [m.public_key for m in found]) if self.prover is not None else None
        if peer_id not in self._squatted:
            self._squatted.add(peer_id)
            logger.warning("identities %s all claim peer id %s; asking it which one it is",
                           ", ".join(m.fingerprint for m in found), peer_id)
        return next((m for m in found if m.public_key == key), None)

    def public_key_of(self, peer_id: str) -> bytes | None:
        """The identity key a live peer id belongs to, for its outer-round fingerprints, expert snapshots and
        offload answers."""
        member = self.member(peer_id)
        return member.public_key if member is not None else None

    def heir_targets(self) -> dict[ExpertId, tuple[str, int] | None] | None:
        """Experts this node owns (None) or is heir of ((owner's peer id, the owner's step)); None without a
        fresh view, or while this node's side of the swarm holds no majority (its heir copies are what a
        partition's other side may need)."""
        view = self.fresh()
        assignment = view.assignment() if view else None
        if view is None or assignment is None or view.quorum is not QuorumState.HELD:
            return None
        alive = view.alive()
        out: dict[ExpertId, tuple[str, int] | None] = {
            (layer, e): None for layer, es in assignment.owned_by(self.fingerprint).items() for e in es}
        for layer, experts in assignment.inherited_by(self.fingerprint).items():
            for e in experts:
                owner = alive.get(assignment.owner(layer, e))
                if owner is not None:
                    hb = owner.heartbeat
                    # A leaving owner serves its final snapshot now: make any older copy count as stale.
                    step = hb.step + (self.snapshot_every if hb.versions.get(LEAVING) else 0)
                    out[(layer, e)] = (hb.peer_id, step)
        return out

    def heirs_of(self, experts: list[ExpertId]) -> dict[ExpertId, str]:
        """expert -> its heir's fingerprint, for those of ``experts`` whose heir keeps a snapshot of them (with
        replicas, the heir is a co-owner training a live copy: it pulls none). An heir whose heartbeat says it is
        leaving pulls nothing more (it trains no more steps), so it is no heir to wait for."""
        view = self.membership.view()
        assignment = view.assignment()
        if assignment is None:
            return {}
        leaving = {fp for fp, m in view.alive().items() if m.heartbeat.versions.get(LEAVING)}
        return {eid: heir for eid in experts if (heir := assignment.heir(*eid)) is not None
                and heir not in assignment.owners_of(*eid) and heir not in leaving}

    def live_workers(self) -> dict[str, float] | None:
        """Offload workers in the view that run this node's worker settings: libp2p peer id -> capacity. A
        worker with other settings is named once in the log."""
        ours, live = self.settings_digest, {}
        for m in self.membership.view().alive().values():
            hb = m.heartbeat
            if hb.role != "worker":
                continue
            if hb.versions.get(SETTINGS_KEY) == ours:
                live[hb.peer_id] = hb.capacity
            elif hb.peer_id not in self._mismatched_workers:
                self._mismatched_workers.add(hb.peer_id)
                logger.warning("worker %s runs other offload settings than this node (settings digest %s, ours %s): "
                               "not used. Start it with the composers' --preset and --set options (model shapes, "
                               "steps, optim betas / weight decay / warm-up, offload.worker_*, offload codecs, "
                               "offload.lookahead, offload.private_layers)", hb.peer_id,
                               hb.versions.get(SETTINGS_KEY), ours)
                self.event("offload_worker_mismatch", worker=hb.peer_id)
        return live

    def composers(self) -> int:
        """Live composers in the view that a round merges with, this one included: those that count
        (``SwarmView.composers``) and the joiners in probation (``SwarmView.joining``: their probation ends when a
        round merges their contribution, so a node whose view counts only itself beside one must hold rounds)."""
        view = self.membership.view()
        return len(set(view.composers()) | view.joining)

    def alone(self) -> bool:
        """Whether this node is the swarm's only live composer that counts for good: a fresh view in which it is
        alive, no other composer counts (``composers`` says whether a joiner in probation is there to merge with),
        and its side holds the quorum (the others left with deathrattles, or long enough ago). Not a view that lost
        the others, or this node, for a moment on a loaded host: a merge among one then would move this node's
        anchor away from theirs."""
        view = self.fresh()
        return (view is not None and view.quorum is QuorumState.HELD
                and list(view.composers()) == [self.fingerprint])

    def run_step(self) -> int | None:
        """The run's place in its learning-rate schedule as the view tells it: the median (the higher of the middle
        two) of the steps the live composers that show work announce, this one included; None before a read. The
        steps are self-declared: a minority cannot move the median, and a node follows it only forwards."""
        view = self.membership.view()
        steps = [view.members[fp].heartbeat.step for fp in view.composers()]
        return statistics.median_high(steps) if steps else None

    def composer_peers(self) -> list[str]:
        """The libp2p peer ids of the live composers in the view (this one included): a gathered outer
        round merges their contributions."""
        return sorted(m.heartbeat.peer_id for m in self.membership.view().alive().values()
                      if m.heartbeat.role == "composer")

    def owner_peers(self, owners: Sequence[str]) -> tuple[list[str], list[str]]:
        """The libp2p peer ids of those of ``owners`` (fingerprints) that are alive, and of those of them that show
        work, this node and the peers it bans left out: a replicated expert's outer round deals with them."""
        view = self.membership.view()
        alive, working = view.alive(), set(view.composers())
        live = {fp: alive[fp].heartbeat.peer_id for fp in owners if fp in alive and fp != self.fingerprint}
        live = {fp: peer for fp, peer in live.items() if not self.banned(peer)}
        return list(live.values()), [peer for fp, peer in live.items() if fp in working]

    def working_peers(self) -> list[str]:
        """The libp2p peer ids of the live composers that show work (``Membership``'s progress rules): a
        gathered outer round waits for them."""
        view = self.membership.view()
        return sorted(view.members[fp].heartbeat.peer_id for fp in view.composers())

    def worked(self, peer_id: str) -> None:
        """Work of the composer at ``peer_id`` reached this node (a contribution, a surrogate update)."""
        member = self.member(peer_id)
        if member is not None:
            self.membership.worked(member.fingerprint)

    def data_seed_of(self, peer_id: str, seed: int) -> int | None:
        """The data stream seed of the live composer at ``peer_id`` in a run of ``seed`` (``train.data.data_seed``),
        None when it is not in the view."""
        member = self.member(peer_id)
        return None if member is None else data_seed(member.fingerprint, seed)

    def heard(self, peer_id: str) -> None:
        """An answer came from the member at ``peer_id`` itself just now (``Membership.heard``): of the view, alive
        in it or not, since an aged view drops members whose heartbeats a slow read has not renewed; the last read's
        quorum decides whom it counts."""
        member = self.member(peer_id, live=False)
        if member is not None:
            self.membership.heard(member.fingerprint)

    def vouched(self, peer_ids: Collection[str]) -> None:
        """The rounds records vouch for the composers at ``peer_ids`` (``Membership.vouched``)."""
        members = (self.member(peer) for peer in peer_ids)
        self.membership.vouched({m.fingerprint for m in members if m is not None})
