"""Membership: a signed heartbeat per node in the DHT, a deathrattle on leave, and the live view.

Each node runs one ``Membership`` with explicit states:

    JOINING  -> checks that its identity is not already alive, publishes its first heartbeat
    ONLINE   -> a reader thread re-reads the members (and claims) every ``refresh_s``; an announcer
                thread re-announces the heartbeat every ``heartbeat_period_s`` (and at once when what the
                node owns changes) and renews its claims
    LEAVING  -> releases its claims and publishes a signed Deathrattle, so others react at once
    STOPPED  -> nothing more is sent

A heartbeat record expires ``heartbeat_ttl_s`` after it is stored (default 2 s period, 6 s TTL): its expiration
adds how long the node's heartbeats take to land (``Membership.store_lag_s``, at most a TTL), so a node on a slow
link or a loaded host stays in the views while it heartbeats. Liveness is judged when the view's read began (what
the DHT held then), not when the view is asked: a record that expires while a read runs, or until the next read,
belongs to a node that may have re-announced meanwhile, which only the next read can tell. A node killed without a
deathrattle drops out of every view at the first read that begins after its last heartbeat expired (and after the
reader's ``SwarmView.grace_s``, when it stretched for slow reads): ``heartbeat_ttl_s`` plus that lag, plus up to
one ``refresh_s`` and a read.

A node whose reads take longer than its ``refresh_s`` (a loaded host, a slow link) doubles its periods, up to
``slow_read_stretch`` times: it reads and announces less often, which is what a loaded DHT process needs, and counts
a heartbeat for as long beyond its expiry as its reads come later than at full pace (``SwarmView.grace_s``), so that
a record carried over a read that missed it lasts to its next read as it would at full pace.

Reads and writes run in two threads because on a loaded host each DHT call may take a second or more
(four nodes and their averagers on two cores). In one loop, a tick of a read, a heartbeat and a claim
per layer takes several such calls, so views go stale and heartbeats lapse: live nodes drop out of each
other's views and experts move for nothing. What a node owns follows only
from a read that succeeded: a failed read proves nobody dead.

The view (``SwarmView``) is an immutable snapshot replaced whole by the reader thread; readers (the training
loop, the CLI) never block on the network. Records that fail to parse, or whose content does not
match their signer, are logged and skipped.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.claims import ClaimSet, ShardConfig, build_claim_set, release_all, valid_claims
from parallax.dht.keys import (
    MEMBER_LEVELS,
    check_run_id,
    claims_key,
    manifest_key,
    member_part,
    members_key,
    members_keys,
)
from parallax.dht.manifests import manifest_difference, read_manifests
from parallax.dht.records import MAX_RECORD_BYTES, owner_subkey, pack_message, subkey_owner, unpack_message
from parallax.dht.shards import Assignment, assign_experts
from parallax.errors import DHTError
from parallax.protocol.errors import ProtocolError
from parallax.protocol.identity import Identity, fingerprint
from parallax.protocol.manifest import RunManifest
from parallax.protocol.messages import MAX_SUSPECTS, ROLES, Deathrattle, Heartbeat

logger = logging.getLogger(__name__)

CAPACITY_BOUND = 2.0
"""A composer's declared capacity counts up to this many times the median of the live composers'."""
_MIN_EXPIRY_STEP_S = 1e-3  # hivemind keeps a subkey's record only if its expiration is strictly later
_NAMING_TRIES = 5
RELAYED_KEPT = 2
MANIFEST_TTL_S = 300.0  # a manifest record outlives a few missed stores; the validator allows up to 600 s


class PeerState(enum.Enum):
    JOINING = "joining"
    ONLINE = "online"
    LEAVING = "leaving"
    STOPPED = "stopped"


class DuplicateIdentityError(DHTError):
    """This node's identity is already alive in the swarm (another process runs the same key)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Presence:
    """Who a node is in a run: what its heartbeat says besides its progress."""

    run_id: str
    """The training run (namespaces every key)."""
    role: str = "composer"
    """composer, worker, reader or bootstrap; only composers own experts."""
    capacity: float = 1.0
    """Declared relative capacity (> 0): the weight in shard assignment."""
    manifest: RunManifest | None = None
    """The run manifest this composer trains by: its digest goes in the heartbeat, the manifest itself under
    ``{run}/manifest`` every ``MembershipConfig.manifest_period_s``. When set, composers announcing another digest
    are left out of this node's view: they own nothing here and take no part in its rounds."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {sorted(ROLES)}")
        if not self.capacity > 0:
            raise ValueError("capacity must be > 0")
        if self.manifest is not None and self.manifest.run_id != self.run_id:
            raise ValueError(f"the manifest is run {self.manifest.run_id!r}'s, not {self.run_id!r}'s")

    @property
    def run_digest(self) -> bytes:
        return self.manifest.digest if self.manifest is not None else b""


@dataclass(frozen=True, kw_only=True, slots=True)
class MembershipConfig:
    """How often a node announces itself and reads the swarm, and when it counts a composer out (the section
    ``net.membership`` of a node's settings). Times in seconds."""

    heartbeat_period_s: float = 2.0
    """Re-announce the heartbeat this often."""
    heartbeat_ttl_s: float = 6.0
    """A heartbeat expires this long after it is sent: a silent node is dead after this."""
    refresh_s: float = 0.5
    """Re-read members and claims this often (bounds how late a deathrattle is seen)."""
    request_timeout_s: float = 3.0
    """Timeout of each DHT store/get."""
    max_addresses: int = 4
    """Addresses carried in the heartbeat (keeps the record small)."""
    stall_s: float = 120.0
    """A composer whose announced step has not moved for this long, while others trained, owns nothing (an
    identity that sends heartbeats and does no work)."""
    idle_s: float = 300.0
    """A composer none of whose work (outer contributions, surrogate updates: ``Membership.worked``) reached this
    node for this long, while others' did, owns nothing and no round waits for it (an identity that heartbeats
    and trains nothing; ``Progress``). 0: work is not asked for."""
    manifest_period_s: float = 60.0
    """How often the manifest record is stored again (it lives ``MANIFEST_TTL_S``)."""
    quorum_window_s: float = 60.0
    """Composers seen alive this recently count in the quorum (``Quorum``): a node whose side of a partition holds
    no majority of them owns nothing. A partition longer than this ends with each side training every expert."""
    slow_read_stretch: int = 8
    """A node whose reads of the swarm take longer than its ``refresh_s`` (the median of its last reads) doubles its
    periods, up to this factor (a power of two); it halves them again once its reads take under half its
    ``refresh_s``. 1: never."""
    full_pace_members: int = 32
    """Up to this many live members a node runs the periods above; in a larger swarm it stretches them
    (``paced``), so that what it reads per second, and the lookups the swarm serves, stay at most those of a swarm
    of this size. 0: never stretch."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_period_s < self.heartbeat_ttl_s:
            raise ValueError("need 0 < heartbeat_period_s < heartbeat_ttl_s (a TTL of 3 periods is usual)")
        if not 0 < self.refresh_s <= self.heartbeat_period_s:
            raise ValueError("need 0 < refresh_s <= heartbeat_period_s")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.max_addresses < 1:
            raise ValueError("max_addresses must be >= 1")
        if self.stall_s <= self.heartbeat_ttl_s:
            raise ValueError("stall_s must exceed heartbeat_ttl_s")
        if self.idle_s < 0 or 0 < self.idle_s <= self.heartbeat_ttl_s:
            raise ValueError("idle_s must be 0 (off) or exceed heartbeat_ttl_s")
        if not 0 < self.manifest_period_s < MANIFEST_TTL_S:
            raise ValueError(f"need 0 < manifest_period_s < {MANIFEST_TTL_S:.0f}")
        if self.quorum_window_s <= self.heartbeat_ttl_s:
            raise ValueError("quorum_window_s must exceed heartbeat_ttl_s")
        if self.slow_read_stretch < 1 or self.slow_read_stretch & (self.slow_read_stretch - 1):
            raise ValueError("slow_read_stretch must be a power of two >= 1 (1: never stretch for slow reads)")
        if self.full_pace_members < 0:
            raise ValueError("full_pace_members must be >= 0 (0: never stretch the periods)")

    def stretch(self, members: int) -> int:
        """By how much a node in a swarm of ``members`` live members stretches its periods: 1 up to
        ``full_pace_members``, else the power of two at or above ``members / full_pace_members``. Powers of two,
        so that nodes whose views differ by a few members mostly agree, and differ by 2x where they do not: a
        reader that re-reads at half a writer's pace still reads every heartbeat before it expires."""
        if self.full_pace_members == 0 or members <= self.full_pace_members:
            return 1
        return 1 << math.ceil(math.log2(members / self.full_pace_members))

    def paced(self, members: int, load: int = 1) -> MembershipConfig:
        """The periods a node runs in a swarm of ``members`` live members (``load``: the node's own stretch for slow
        reads, ``slow_read_stretch``, when larger than the swarm's): every read and heartbeat period, the
        heartbeat's TTL and the windows counted in heartbeats (stall, quorum) stretched by ``stretch``, the work
        rule's ``idle_s`` kept (work does not arrive by heartbeat) unless a TTL outgrows it. Every member reads
        every heartbeat once a ``refresh_s`` (the members key's parts at ``level``), so at ``n`` members a node reads
        ``n / refresh_s`` heartbeats a second and each part's storers serve ``n / refresh_s`` lookups of a part of
        at most ``full_pace_members`` heartbeats: stretched, each stays between half its figure at
        ``full_pace_members`` and that figure."""
        k = max(self.stretch(members), load)
        if k == 1:
            return self
        ttl = self.heartbeat_ttl_s * k
        return dataclasses.replace(
            self, refresh_s=self.refresh_s * k, heartbeat_period_s=self.heartbeat_period_s * k, heartbeat_ttl_s=ttl,
            stall_s=self.stall_s * k, quorum_window_s=self.quorum_window_s * k,
            idle_s=self.idle_s if self.idle_s == 0 or self.idle_s > 2 * ttl else 2 * ttl)

    def level(self, members: int) -> int:
        """The level of the members key a node of a swarm of ``members`` live members reads (``keys.members_key``):
        as many parts as ``stretch``, so that each part holds at most ``full_pace_members`` heartbeats and its
        storers serve what the whole key's did in a swarm of that size (capped at ``keys.MEMBER_LEVELS``)."""
        return min(MEMBER_LEVELS, self.stretch(members).bit_length() - 1)

    def write_levels(self, members: int) -> frozenset[int]:
        """The levels a node of a swarm of ``members`` live members writes its heartbeat to: level 0, whole, which
        joiners and tools read (nobody else does past ``full_pace_members``); its own level; and the level of a
        node that counts 1.5x more or fewer members, so that readers whose views lag or lead its own still find it
        (in a swarm of up to two thirds of ``full_pace_members``: level 0 alone)."""
        return frozenset({0, self.level(members), self.level(int(members / 1.5)), self.level(math.ceil(1.5 * members))})

    @classmethod
    def loopback(cls) -> MembershipConfig:
        """Peers on one machine: work arrives within seconds, so a composer that sends none is named sooner."""
        return cls(idle_s=60.0)


@dataclass(frozen=True, slots=True)
class Member:
    """A node's latest heartbeat as read from the DHT."""

    fingerprint: str
    public_key: bytes
    heartbeat: Heartbeat
    expires_at: float

    def alive(self, now: float) -> bool:
        return self.expires_at > now


class QuorumState(enum.Enum):
    """Where a node stands with the swarm's majority (``Quorum``)."""

    HELD = "held"
    """Its side holds a majority: it owns what the assignment gives it."""
    DOUBT = "doubt"
    """Its side holds exactly half, or has held less for under the grace period: it keeps what it owns and takes
    nothing new."""
    LOST = "lost"
    """Cut off: it owns nothing (the other side of the partition takes its experts)."""


@dataclass(frozen=True)
class SwarmView:
    """What one node knows of the swarm at ``read_at``. Immutable."""

    run_id: str
    read_at: float
    """When the read that made this view began (DHT clock): every record in it was current then or later."""
    members: Mapping[str, Member] = field(default_factory=dict)
    departed: Mapping[str, Deathrattle] = field(default_factory=dict)
    claim_records: Mapping[int, Mapping[str, tuple[ClaimSet, float]]] = field(default_factory=dict)
    shards: ShardConfig | None = None
    record_expiry: Mapping[str, float] = field(default_factory=dict)
    """Expiration of every signed ``members`` entry by signer fingerprint (heartbeat, deathrattle, or
    one that did not parse): a node restarting under its key must store strictly later than this."""
    stalled: frozenset[str] = frozenset()
    """Composers that own nothing in this view: they show no work (``Progress``: a step that has not moved, or no
    work that reached this node) or this node ignores them (``Membership.ignored``)."""
    quorum: QuorumState = QuorumState.HELD
    """Where this node's side of the swarm stands (``Quorum``): LOST, it owns nothing in this view; DOUBT, it
    changes nothing it owns."""
    joining: frozenset[str] = frozenset()
    """Composers in probation (``Heartbeat.probation``) that this node first saw less than ``idle_s`` ago and does
    not ignore: joiners whose first contribution a round must merge (``Membership.enter_probation``). One that says
    so for longer is a liar or cannot reach anyone, and no round is held for it."""
    grace_s: float = 0.0
    """How much longer than full pace the node's reads come apart (``MembershipConfig.slow_read_stretch``): a
    heartbeat counts for that long past its expiry, so a record carried over a read that missed it (``merge_views``)
    lasts to the next read as at full pace."""
    aged_to: float = -math.inf
    """A view kept while its node's reads fail or stall is judged no earlier than this (``Membership.view``)."""
    short_since: float = math.inf
    """The DHT time since which this node's side has been short of half the swarm by the heartbeats its reads brought
    (``Quorum``: of the live composers that count, against the most seen at one time): the expiry that left it short,
    as the last view that held half gave it (``majority_until``); inf while the side holds half. Past it and the
    quorum's grace the node is cut off (``Membership.view``), whenever it looks, not at its next read's end."""

    @property
    def judged_at(self) -> float:
        """The DHT time this view judges liveness and leases at: ``read_at`` less ``grace_s``, or ``aged_to``."""
        return max(self.read_at - self.grace_s, self.aged_to)

    def alive(self, now: float | None = None) -> dict[str, Member]:
        """Members whose heartbeat has not expired at ``now`` (default: ``judged_at``). A heartbeat that expired
        while the read ran, or since, belongs to a member alive as far as this view can tell: only a later read
        tells a newer heartbeat (the member lives on) from none (it died). Judged at the DHT clock instead, every
        read that takes a while drops the members whose heartbeat is due during it, and a loaded host whose reads
        take seconds loses live members from its view by the second."""
        now = self.judged_at if now is None else now
        return {fp: m for fp, m in self.members.items() if m.alive(now)}

    def composers(self, now: float | None = None) -> dict[str, float]:
        """Live composers that show work and their capacities, the input of the shard assignment.

        A declared capacity counts up to ``CAPACITY_BOUND`` x the median of the live composers' (so one peer
        declaring 1e6 cannot take every expert); stalled composers (``stalled``) and those that say they are in
        probation (``Heartbeat.probation``: joined a training swarm, no work shown yet) are left out.
        """
        declared = {fp: m.heartbeat.capacity for fp, m in self.alive(now).items()
                    if m.heartbeat.role == "composer" and fp not in self.stalled and not m.heartbeat.probation}
        if not declared:
            return {}
        bound = CAPACITY_BOUND * statistics.median_low(declared.values())
        return {fp: min(c, bound) for fp, c in declared.items()}

    def assignment(self, now: float | None = None, leaving_out: str | None = None) -> Assignment | None:
        """The owners and heir of every expert over the live composers (None without shards or composers), with
        ``shards.replicas`` owners per expert or as many as there are composers; ``leaving_out``: over those but
        that one (the assignment the others held while it was cut off)."""
        peers = {fp: c for fp, c in self.composers(now).items() if fp != leaving_out}
        if self.shards is None or not peers:
            return None
        return _cached_assignment(self.run_id, self.shards.n_layers, self.shards.n_experts, peers,
                                  min(self.shards.replicas, len(peers)))

    def claims(self, now: float | None = None) -> dict[tuple[int, int], tuple[str, ...]]:
        """(layer, expert) -> fingerprints of the holders of its valid claims at ``now`` (default: ``judged_at``),
        its assigned owners first by rank."""
        now = self.judged_at if now is None else now
        found = valid_claims(self.claim_records, set(self.alive(now)), now, self.assignment(now))
        return {shard: tuple(c.holder for c in claims) for shard, claims in found.items()}


class Progress:
    """Which composers show work (pure; the caller's clock).

    Three rules, each leaving a composer out of the shard assignment while it holds:

    - *stalled*: its announced step has not moved for ``stall_s`` while another's has;
    - *idle* (when ``idle_s`` > 0): none of its work reached this node for ``idle_s`` (an outer contribution
      fetched and decoded, a surrogate update applied: ``worked``), or for twice the longest of the latest gaps
      between its arrivals when that is longer, up to ``IDLE_STRETCH`` x ``idle_s`` (``idle_after``: a composer whose
      work comes further apart than ``idle_s``, on a slow link or with late rounds, is not judged idle and working
      again between each two arrivals, its experts handed over each time), while another's did, ``idle_s`` after this
      node first saw it and after anyone's work first arrived. Steps are self-declared: an identity that only
      sends heartbeats can make its step move, but it cannot make its work arrive;
    - *unproven* (when ``idle_s`` > 0): first seen after anyone's work reached this node, and none of its own
      has: fresh keys earn nothing until they show work, however many there are and however often they are
      replaced. One whose work arrived before and comes back (a restart) has the idle rule's grace period. An
      honest composer that joins a training swarm says so itself (``Heartbeat.probation``) until a round merged
      its contribution, so that it gives itself no experts either.

    None of them names anybody while nobody shows what it looks for (a swarm starting up, or paused); the unproven
    rule looks for the identity's own work once anyone's has arrived, and holds while nobody's work is recent (rounds
    slowed past ``idle_s``) as long as a composer whose work did arrive is alive. A node that
    joins a swarm that trains has seen no work yet, but the swarm's records say whose work others merged
    (``vouched``): the rules then run from those; a node that resumes its checkpoint counts, the same way, the
    composers whose work had reached it when it was written (``working``).
    """

    def __init__(self, stall_s: float, idle_s: float = 0.0) -> None:
        self.stall_s, self.idle_s = stall_s, idle_s
        self._seen: dict[str, tuple[int, float, bool]] = {}
        """fingerprint -> (its step, since when, whether it moved since this node first saw it)."""
        self._first: dict[str, float] = {}
        self._work: dict[str, float] = {}
        self._gaps: dict[str, collections.deque[float]] = {}  # of ``_work``: the gaps between its latest arrivals
        self._work_began: float | None = None  # when the first work of anyone arrived, or the records vouched
        self._arrived = False  # whether work itself reached this node (not only the records' word)
        self._vouching = False  # the rules run from the records' word (``vouched``)
        self._word: set[str] = set()  # of ``_work``: those only vouched for, whose own work has not arrived

    def worked(self, fingerprint: str, now: float) -> None:
        """Evidence of ``fingerprint``'s work arrived at ``now``."""
        if self._work_began is None:
            self._work_began = now
        self._arrived = True
        last = self._work.get(fingerprint)
        # A gap under a second parts one burst (a round's groups, a refresh's experts); one past the stretch is an
        # absence (the composer was judged idle over it), not its pace.
        if last is not None and fingerprint not in self._word and _GAP_FLOOR_S <= now - last <= (
                IDLE_STRETCH * self.idle_s):
            self._gaps.setdefault(fingerprint, collections.deque(maxlen=_GAPS_KEPT)).append(now - last)
        self._work[fingerprint] = now
        self._word.discard(fingerprint)
        _forget_oldest(self._work)
        for fp in self._gaps.keys() - self._work.keys():
            del self._gaps[fp]

    def idle_after(self, fingerprint: str) -> float:
        """How long ``fingerprint`` may go without work reaching this node before the idle rule names it:
        ``idle_s``, or twice the longest of its latest ``_GAPS_KEPT`` gaps between arrivals (those of a second to
        ``IDLE_STRETCH`` x ``idle_s``) when that is longer, at most ``IDLE_STRETCH`` x ``idle_s``."""
        gaps = self._gaps.get(fingerprint, ())
        return min(IDLE_STRETCH * self.idle_s, max(self.idle_s, 2 * max(gaps, default=0.0)))

    def vouched(self, fingerprints: Iterable[str], now: float) -> bool:
        """The swarm's rounds records vouch for ``fingerprints`` (others merged their work:
        ``outer.transport.vouched``) before any work reached this node: it joins a swarm that trains (a joiner
        reads them before it downloads the shared groups' state, and counts those of the peers that served it the
        state: ``GatheredRounds.vouch``). The rules then run from the records: those
        vouched for count as having worked at ``now`` (each has one idle period to show work of its own), and every
        other composer is unproven until its own work arrives, those this node saw in its first read beside the
        swarm's composers no less than those it sees later (a flood of identities written before it joined earns
        nothing either). Once work has reached this node it judges by what arrived. True when it took any it had
        not."""
        new = set(fingerprints) - self._work.keys()
        if self._arrived or not new:
            return False
        if self._work_began is None:
            self._work_began = now
        self._vouching = True
        self._work.update(dict.fromkeys(new, now))
        self._word |= new
        _forget_oldest(self._work)
        return True

    def working(self, now: float) -> frozenset[str]:
        """The composers whose own work reached this node within ``idle_s`` of ``now`` (every one whose work did,
        when the idle rule is off), the most recent ``_WORKING_KEPT``: what a checkpoint keeps so that the node,
        resumed from it, counts them again (``Membership.remember``). Not those only vouched for: a node that
        restarts again and again must not carry an identity's grace period forward without its work."""
        recent = sorted(((t, fp) for fp, t in self._work.items()
                         if fp not in self._word and (self.idle_s <= 0 or now - t < self.idle_after(fp))),
                        reverse=True)
        return frozenset(fp for _, fp in recent[:_WORKING_KEPT])

    def stalled(self, steps: Mapping[str, int], now: float) -> frozenset[str]:
        """The composers of ``steps`` (fingerprint -> announced step) that show no work by either rule."""
        for fp, step in steps.items():
            seen = self._seen.get(fp)
            if seen is None and fp in self._work:
                self._first[fp] = now  # it worked before: coming back (a restart) starts a new grace period
            if seen is None:
                self._seen[fp] = (step, now, False)
            elif seen[0] != step:
                self._seen[fp] = (step, now, True)
            # An identity that never worked keeps its first sighting after it leaves: coming back starts none.
            self._first.setdefault(fp, now)
        _forget_oldest(self._first, keep=steps.keys())
        for fp in self._seen.keys() - steps.keys():
            del self._seen[fp]
        # Moving is a step that changed: a composer just seen is in its grace period, but it shows no one else
        # that training goes on (newcomers to a paused swarm must not make everyone stalled).
        fresh = {fp for fp in steps if now - self._seen[fp][1] < self.stall_s}
        moving = {fp for fp in fresh if self._seen[fp][2]}
        stalled = steps.keys() - fresh if moving else set()
        if self.idle_s > 0:
            working = {fp for fp in steps if now - self._work.get(fp, -math.inf) < self.idle_after(fp)}
            if working:
                # The grace period runs from first sight, and not before work began to flow: the first
                # contribution fetched must not make everyone else idle at once.
                began = self._work_began if self._work_began is not None else now
                stalled |= {fp for fp in steps.keys() - working
                            if now - max(self._first.get(fp, now), began) >= self.idle_s}
            # Unproven while a composer that did work is alive, whether or not its work is recent: when the rounds
            # slow past ``idle_s`` (a loaded swarm, or one a flood of identities slows), counting hundreds of
            # identities that never worked would raise every round's quorum past reach, and no work would arrive
            # again. Not once every composer that worked has left: a node that then merged alone would fetch nothing,
            # and an honest newcomer whose work had not reached it would stay out of its view for good (while the
            # newcomer's view shares the experts with it).
            if working or any(fp in self._work for fp in steps):
                stalled |= {fp for fp in steps.keys() - working if self.unproven(fp)}
        return frozenset(stalled)

    def idle(self, fingerprint: str, now: float) -> bool:
        """Whether ``fingerprint``'s last work (if any) is older than ``idle_after`` (for the log)."""
        return now - self._work.get(fingerprint, -math.inf) >= self.idle_after(fingerprint) > 0

    def seen_for(self, fingerprint: str, now: float) -> float:
        """How long ago this node first saw ``fingerprint`` (0 when it has not)."""
        return now - self._first.get(fingerprint, now)

    def unproven(self, fingerprint: str) -> bool:
        """Whether ``fingerprint`` was first seen after anyone's work reached this node (or at any time, once the
        records vouched: ``vouched``) and none of its own has (the unproven rule; for the log)."""
        began = self._work_began
        return fingerprint not in self._work and began is not None and (
            self._vouching or self._first.get(fingerprint, began) > began)

    @property
    def work_began(self) -> bool:
        """Whether any composer's work has reached this node, or the records vouched for some (``vouched``)."""
        return self._work_began is not None

    @property
    def work_arrived(self) -> bool:
        """Whether any composer's work itself has reached this node."""
        return self._arrived

    def counted(self, composers: Iterable[str], me: str) -> frozenset[str]:
        """The ``composers`` that count in the quorum: this node (``me``) and those whose work has reached it (or
        that the records vouched for: ``vouched``); all of them before anyone's work has (heartbeats are then all
        there is to count). Heartbeats are free to sign: identities that only send them, however many, neither cut
        a node off nor make up its side."""
        composers = frozenset(composers)
        if self._work_began is None:
            return composers
        return frozenset(fp for fp in composers if fp == me or fp in self._work)


_ALONE_READS = 3
"""Fresh reads in a row without another composer that counts after which a node's probation ends (one read that
misses the others on a loaded host must not end it)."""
_PROGRESS_KEPT = 4096
_GAPS_KEPT = 16
"""The gaps between one composer's arrivals of work that ``Progress.idle_after`` looks back on (a few rounds)."""
_GAP_FLOOR_S = 1.0
"""Arrivals closer than this are one burst: no gap between them is kept."""
IDLE_STRETCH = 3.0
"""The most ``Progress.idle_after`` stretches ``idle_s`` for a composer whose work comes far apart: one that shows
work at all, however rarely, still loses its experts within this many idle periods once it stops."""
_WORKING_KEPT = 256
"""Composers a checkpoint names as having worked (``Progress.working``): a swarm's working set, not its history."""
_STORED_KEPT = 64
"""Heartbeats stored that ``majority_heard_until`` looks back over (64 periods: far past any TTL)."""
_ANSWERS_LOGGED_S = 60.0
"""``Membership.confirmed`` says at most this often that answers alone keep the node training."""
_FLOOD_NAMED_AT = 8
"""Composers without work in one view from which on the log names them (a few are joiners in their first round)."""
_READS_JUDGED = 8
"""Reads whose median decides a stretch for slow reads (then as many again at the new pace before the next)."""


def majority_until(view: SwarmView, alive: Collection[str], me: str, most: int, ttl: float) -> float:
    """The DHT time until which the heartbeats of ``view`` keep at least half of ``most`` of the composers ``alive``
    (those that count; ``me`` always) alive, as ``Quorum`` counts them (each heartbeat ``grace_s`` past its expiry);
    -inf when they do not now, inf when nothing is counted.

    A heartbeat whose TTL is longer than ``ttl`` (this node's: its sender's periods stretched for slow reads) counts
    for ``ttl`` or two thirds of its own, the longer: the others see this node's heartbeat expire a TTL of its own
    after its last one reached them, and a stretched peer's one heartbeat must not keep this node's side half of the
    swarm long after (it still counts past its sender's next period: two thirds of a TTL of three periods). Its
    sender's clock sets both its expiry and its ``sent``: their difference is its TTL, whatever the clocks' skew."""
    need = (most + 1) // 2
    if not alive or need <= 0:
        return math.inf

    def counted_until(fp: str) -> float:
        if fp == me:
            return math.inf
        member = view.members.get(fp)
        if member is None:
            return -math.inf
        own = member.expires_at - member.heartbeat.sent
        if member.heartbeat.sent <= 0 or own <= ttl:
            return member.expires_at
        return member.expires_at - own + max(ttl, 2 * own / 3)

    ends = sorted((counted_until(fp) for fp in alive), reverse=True)
    return ends[need - 1] + view.grace_s if len(ends) >= need else -math.inf


def majority_heard_until(heard: Mapping[str, float], alive: Collection[str], me: str, most: int,
                         stored: Sequence[tuple[float, float]]) -> float:
    """The DHT time until which answers from the composers themselves show this node's side holding at least half of
    ``most`` of the composers ``alive`` (``me`` always), read or no read (``Membership.confirmed``); -inf when they do
    not, inf when nothing is counted.

    ``heard``: when an answer of each composer last came from it directly (``Membership.heard``: a contribution,
    blocks, a rounds record its outer transport answered); at ``w``, the latest time by which half of
    them had answered, this node was on their side of any cut. Only the composers the last read counted count (a
    read that showed the side short counted too few). ``stored``: (when each of this node's heartbeats was stored,
    when it expires), in any order: the others count this node alive until the last heartbeat stored by ``w``
    expires, so they cannot have taken its experts before then, however slow its reads."""
    need = (most + 1) // 2
    if not alive or need <= 0:
        return math.inf
    times = sorted((math.inf if fp == me else heard.get(fp, -math.inf) for fp in alive), reverse=True)
    if len(times) < need or times[need - 1] == -math.inf:
        return -math.inf
    w = times[need - 1]
    if w == math.inf:
        return math.inf
    return max((expires for at, expires in stored if at <= w), default=-math.inf)


class Quorum:
    """Whether this node is on the side of the swarm that owns experts (pure; the caller's clock).

    A node cut off from the others sees them all expire at once, as they see it expire: both sides would go on
    training the other side's experts. Only a side holding more than half of the most composers alive at one time
    in its views of the last ``window_s`` takes over the experts of the missing; a side holding exactly half keeps
    its own and takes none (an even split trains every expert once); a smaller side owns nothing, until the link
    heals or the window forgets the missing composers. The reference is the largest swarm seen at one time, not
    every composer seen in the window: under churn, composers that died (no deathrattle) and those that replaced
    them are never alive together, and counting both would cut a whole healthy swarm off once as many died in a
    window as it holds. A composer that left with a deathrattle is forgotten at once, so a graceful leave never
    takes the quorum away. A smaller side loses its experts only after ``grace_s``: one DHT read that misses live
    peers' heartbeats must not make a node drop every expert it trains. What it counts is the caller's choice
    (``Progress.counted``: composers whose work arrived, so that identities that only sign heartbeats count for
    nothing).
    """

    def __init__(self, window_s: float, grace_s: float) -> None:
        self.window_s, self.grace_s = window_s, grace_s
        self._alive: collections.deque[tuple[float, frozenset[str]]] = collections.deque()
        """(last seen, the composers alive then) of every distinct set of live composers within the window."""
        self._short_since: float | None = None

    def check(self, alive: Iterable[str], departed: Iterable[str], now: float) -> QuorumState:
        """Where the composers ``alive`` now (this node among them) stand against the most alive at one time
        recently (HELD while none is alive: this node has not read its own heartbeat yet)."""
        alive = frozenset(alive)
        if not alive:
            return QuorumState.HELD
        gone = set(departed) - alive
        if gone and any(gone & seen for _, seen in self._alive):
            self._alive = collections.deque((t, seen - gone) for t, seen in self._alive)
        if self._alive and self._alive[-1][1] == alive:
            self._alive[-1] = (now, alive)
        else:
            self._alive.append((now, alive))
        while now - self._alive[0][0] > self.window_s:
            self._alive.popleft()
        present, most = 2 * len(alive), self.seen()
        if present >= most:
            self._short_since = None
            return QuorumState.HELD if present > most else QuorumState.DOUBT
        if self._short_since is None:
            self._short_since = now
        return QuorumState.DOUBT if now - self._short_since < self.grace_s else QuorumState.LOST

    def restart(self) -> None:
        """Forget every composer seen: what is counted changed (``Progress.counted``, once work began to arrive),
        and sets counted before are no reference for the sets counted now."""
        self._alive.clear()
        self._short_since = None

    def seen(self) -> int:
        """The most composers alive at one time within the window: what a majority is of."""
        return max(len(seen) for _, seen in self._alive) if self._alive else 0


def _forget_oldest(times: dict[str, float], keep: Iterable[str] = ()) -> None:
    """Bound ``times`` to ``_PROGRESS_KEPT`` entries, forgetting the oldest first but never those in ``keep``."""
    if len(times) <= _PROGRESS_KEPT:
        return
    kept = set(keep)
    for fp in sorted((fp for fp in times if fp not in kept), key=times.__getitem__)[:len(times) - _PROGRESS_KEPT]:
        del times[fp]


def heartbeat_value(hb: Heartbeat) -> bytes:
    """``hb`` as a DHT value; without its suspects and bans when with them it would outgrow a DHT record (many
    shards and long addresses)."""
    value = pack_message(hb)
    if len(value) > MAX_RECORD_BYTES and (hb.suspects or hb.banned):
        value = pack_message(dataclasses.replace(hb, suspects={}, banned=()))
    return value


def split_by_run(view: SwarmView, digest: bytes) -> tuple[SwarmView, dict[str, Member]]:
    """``view`` without the composers whose heartbeat announces a run digest other than ``digest``, and those
    composers by fingerprint. An empty ``digest`` keeps everyone (a tool that only looks)."""
    if not digest:
        return view, {}
    foreign = {fp: m for fp, m in view.members.items()
               if m.heartbeat.role == "composer" and m.heartbeat.run != digest}
    if not foreign:
        return view, {}
    members = {fp: m for fp, m in view.members.items() if fp not in foreign}
    return dataclasses.replace(view, members=members), foreign


def working_by_run(view: SwarmView, now: float) -> dict[bytes, int]:
    """Run digest -> how many composers alive at ``now`` announce it and have trained a step (what a newcomer
    tells a run's manifests apart by: ``manifests.choose_manifest``)."""
    counts: dict[bytes, int] = {}
    for m in view.alive(now).values():
        if m.heartbeat.role == "composer" and m.heartbeat.step > 0:
            counts[m.heartbeat.run] = counts.get(m.heartbeat.run, 0) + 1
    return counts


def merge_views(previous: SwarmView, new: SwarmView) -> SwarmView:
    """``new``, keeping every record of ``previous`` that is later than what ``new`` has for its signer and
    has not expired at ``new.judged_at`` (its read's start, less the reader's ``grace_s``).

    A signed heartbeat we saw is proof of life until its expiration. One read may not return it: a fresh
    joiner's routing table, or a replica that missed the latest store, answers with an older copy of the
    ``members`` dictionary (a joiner whose view lacked a live node would take that node's experts and restart
    them from init). Merging keeps knowledge monotonic; a killed node still drops out when its last heartbeat
    expires, a leaver when its (later) deathrattle arrives.
    """
    members, departed, expiry = dict(new.members), dict(new.departed), dict(new.record_expiry)
    for fp, old_expiry in previous.record_expiry.items():
        if old_expiry <= new.judged_at or old_expiry <= expiry.get(fp, float("-inf")):
            continue
        expiry[fp] = old_expiry
        if fp in previous.members:
            members[fp] = previous.members[fp]
            departed.pop(fp, None)
        elif fp in previous.departed:
            departed[fp] = previous.departed[fp]
            members.pop(fp, None)
    return dataclasses.replace(new, members=members, departed=departed, record_expiry=expiry)


_assignment_cache: dict[tuple[object, ...], Assignment] = {}
_assignment_lock = threading.Lock()


def _cached_assignment(run_id: str, n_layers: int, n_experts: int, peers: dict[str, float],
                       replicas: int) -> Assignment:
    # Views are asked often with the same live set; the assignment is pure, so memoise a few.
    key = (run_id, n_layers, n_experts, replicas, tuple(sorted(peers.items())))
    with _assignment_lock:
        hit = _assignment_cache.get(key)
    if hit is None:
        hit = assign_experts(run_id, n_layers, n_experts, peers, replicas)
        with _assignment_lock:
            if len(_assignment_cache) > 64:
                _assignment_cache.clear()
            _assignment_cache[key] = hit
    return hit


def parse_members(
    raw: Mapping[object, tuple[object, float]],
) -> tuple[dict[str, Member], dict[str, Deathrattle]]:
    """Members and departed nodes from the ``members`` dictionary; bad entries are logged and skipped."""
    members: dict[str, Member] = {}
    departed: dict[str, Deathrattle] = {}
    for subkey, (value, expiration) in raw.items():
        public_key = subkey_owner(subkey)
        if public_key is None:
            logger.debug("skipping a members entry under a foreign subkey")
            continue
        fp = fingerprint(public_key)
        try:
            msg = unpack_message(value, (Heartbeat, Deathrattle), peer=fp)
        except ProtocolError as e:
            logger.info("skipping a bad members record: %s", e)
            continue
        if isinstance(msg, Heartbeat):
            members[fp] = Member(fp, public_key, msg, expiration)
        else:
            assert isinstance(msg, Deathrattle)
            departed[fp] = msg
    return members, departed


def parse_claims(
    raw_by_layer: Mapping[int, Mapping[object, tuple[object, float]]],
) -> dict[int, dict[str, tuple[ClaimSet, float]]]:
    """Claim records by layer and claimant; bad entries are logged and skipped."""
    out: dict[int, dict[str, tuple[ClaimSet, float]]] = {}
    for layer, raw in raw_by_layer.items():
        for subkey, (value, expiration) in raw.items():
            public_key = subkey_owner(subkey)
            if public_key is None:
                continue
            fp = fingerprint(public_key)
            try:
                out.setdefault(layer, {})[fp] = (ClaimSet.decode(value, layer=layer, peer=fp), expiration)
            except ProtocolError as e:
                logger.info("skipping a bad claim record: %s", e)
    return out


def read_view(
    dht: SwarmDHT,
    run_id: str,
    *,
    shards: ShardConfig | None = None,
    timeout_s: float,
    clock: Callable[[], float] = dht_time,
    level: int = 0,
) -> SwarmView | None:
    """Read the run's members (and, with ``shards``, its claims) once and parse them into a view.

    One ``get(latest=True)`` of the members key's parts at ``level`` (the whole key at level 0: every node writes
    its heartbeat there) plus one claims key per layer. Used by the reader thread every refresh and by tools
    that only look (``parallax swarm status``).

    Args:
        dht: a started node (a client-mode one is enough).
        run_id: the training run.
        shards: the model shape; ``None`` reads no claims (the view's ``assignment()`` is then ``None``).
        timeout_s: give up the DHT read after this many seconds.
        clock: the DHT clock; the read's start is stamped on the view as ``read_at``.
        level: which split of the members key to read (``MembershipConfig.level``); a record found in a part
            that is not its signer's (``keys.member_part``) is skipped.

    Returns:
        The view, or ``None`` when the read failed or timed out (keep the previous view, if any).
        Bad records from peers are logged and skipped.
    """
    parts = members_keys(run_id, level)
    claim_keys = [claims_key(run_id, layer) for layer in range(shards.n_layers)] if shards else []
    began = clock()
    read = dht.get_dicts([*parts, *claim_keys], latest=True, timeout_s=timeout_s)
    if read is None:
        return None
    began = min(began, clock() - getattr(read, "age_s", 0.0))  # a read joined while running began before the call
    raw: dict[object, tuple[object, float]] = {}
    record_expiry: dict[str, float] = {}
    for part, key in enumerate(parts):
        for subkey, record in read[key].items():
            public_key = subkey_owner(subkey)
            if public_key is None:
                continue
            fp = fingerprint(public_key)
            if level and member_part(fp, level) != part:
                logger.debug("skipping %s's members record in part %d of level %d: not its part", fp, part, level)
                continue
            raw[subkey] = record
            record_expiry[fp] = record[1]
    members, departed = parse_members(raw)
    claims = parse_claims({layer: read[k] for layer, k in enumerate(claim_keys)})
    return SwarmView(
        run_id=run_id, read_at=began, members=members, departed=departed, claim_records=claims,
        shards=shards, record_expiry=record_expiry,
    )


def read_live_view(
    dht: SwarmDHT,
    run_id: str,
    *,
    shards: ShardConfig | None = None,
    timeout_s: float,
    wait_s: float,
    retry_s: float = 1.0,
    clock: Callable[[], float] = dht_time,
) -> SwarmView | None:
    """``read_view`` again every ``retry_s`` until someone in the run is alive or ``wait_s`` has passed.

    For a tool that has just joined: its first read may come before the routing table fills, or in
    the gap of a restarting swarm. Returns the first view with a live member, else the last view
    read (nobody alive), else ``None`` (every read failed: the swarm did not answer).
    """
    deadline = time.monotonic() + wait_s
    last: SwarmView | None = None
    while True:
        view = read_view(dht, run_id, shards=shards, timeout_s=timeout_s, clock=clock)
        if view is not None:
            last = view
            if view.alive():
                return view
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return last
        time.sleep(min(retry_s, remaining))


class Membership:
    """The reader and announcer threads of one node: heartbeats, deathrattle, claims, and the live view.

    Usage::

        m = Membership(dht, identity, Presence(run_id="r1"), shards=ShardConfig(n_layers=4, n_experts=8))
        m.start()                 # JOINING -> ONLINE; raises DuplicateIdentityError
        view = m.view()           # any time, from any thread; never blocks
        m.update(step=120)        # carried by the next heartbeat
        m.leave("done")           # LEAVING: releases claims, publishes the deathrattle -> STOPPED
    """

    def __init__(
        self,
        dht: SwarmDHT,
        identity: Identity,
        presence: Presence,
        config: MembershipConfig | None = None,
        *,
        shards: ShardConfig | None = None,
        clock: Callable[[], float] = dht_time,
    ) -> None:
        self.dht = dht
        self.identity = identity
        self.presence = presence
        self.config = config = config if config is not None else MembershipConfig()
        self.shards = shards
        self.fingerprint = identity.fingerprint
        self._clock = clock
        self._subkey = owner_subkey(identity.public_key)
        self._claim_keys = [claims_key(presence.run_id, layer) for layer in range(shards.n_layers)] if shards else []
        relayed = dht.relayed_maddrs()[:RELAYED_KEPT]  # after the direct ones: how peers reach a node behind NAT
        direct = dht.visible_maddrs()[: max(1, config.max_addresses - len(relayed))]
        self._addresses = tuple(direct + relayed)[: config.max_addresses]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._announce_now = threading.Event()
        self._threads: list[threading.Thread] = []
        self._state = PeerState.JOINING
        self._view = SwarmView(run_id=presence.run_id, read_at=0.0, shards=shards)
        self._step = 0
        self._versions: dict[str, int] = {}
        self._loss: float | None = None
        self._suspects: dict[str, float] = {}
        self._banned: tuple[str, ...] = ()
        self._last_expiry: dict[str, float] = {}
        self._members_expiry = 0.0
        """The expiration of our last members record, every part alike: each next one is later."""
        self.store_lag_s = 0.0
        """How long our heartbeats take to land (the last store's time, decaying by half a store when faster, at
        most a TTL): each heartbeat lives that much longer, so it lives its TTL once stored."""
        self._level = 0
        self._write_levels = frozenset({0})
        self._written: dict[int, float] = {}
        """Level -> the expiration of our last heartbeat there: where a deathrattle must go."""
        self._next_heartbeat = 0.0
        self._next_manifest = 0.0
        self._next_claims = 0.0
        self._owned: dict[int, frozenset[int]] = {}
        self._ownership: tuple[Assignment | None, dict[int, frozenset[int]]] = (None, {})
        """The assignment of the reader's last successful view and what we own in it (replaced whole)."""
        self.owned_changed_at = time.monotonic()
        """When ``owned()`` last changed (monotonic clock): lets a caller wait for a settled assignment."""
        self._claimed: dict[int, frozenset[int]] = {}
        self.heartbeats_sent = 0
        self.read_s = 0.0
        """How long the last read that answered took (its view is that much older than the read's end)."""
        self.foreign: dict[str, Member] = {}
        """Composers of the run seen at the last read announcing another run digest (left out of the view)."""
        self._naming: dict[str, int] = {}  # foreign composer -> reads that tried to name what differs
        self._timing, self._stretch = config, 1
        self._load = 1
        """This node's own stretch for slow reads (``MembershipConfig.slow_read_stretch``)."""
        self._reads: collections.deque[float] = collections.deque(maxlen=_READS_JUDGED)
        self._pacing = 1  # the members the pace was last set by
        self._grace_s = 0.0  # SwarmView.grace_s of the next view
        self._progress = Progress(config.stall_s, config.idle_s)
        self._view_lock = threading.Lock()  # installing a view: the reader's, or ``vouched``'s update of it
        self._vouchings = 0  # ``vouched`` calls that took composers (a read judged across one is judged again)
        self._remembered: frozenset[str] = frozenset()  # ``remember``: counted while alive, until work arrives
        self._quorum = Quorum(config.quorum_window_s, grace_s=config.heartbeat_period_s)
        self._lapsed = False  # ``view`` said this node is cut off before its quorum did (logged once)
        self._majority_until = math.inf  # ``majority_until`` of the last view that held half
        self._heard: dict[str, float] = {}  # composer -> when an answer last came from it directly (DHT time)
        self._stored: collections.deque[tuple[float, float]] = collections.deque(maxlen=_STORED_KEPT)
        """(when stored, when it expires) of this node's latest heartbeats stored (``majority_heard_until``)."""
        self._counted: tuple[frozenset[str], int] = (frozenset(), 0)
        """The composers the quorum counted at the last read, and the most of them alive at one time (``Quorum``)."""
        self._by_answers_logged = -math.inf  # when ``confirmed`` last said answers alone confirm it
        self._counting_work = False  # the quorum counts only composers whose work arrived (once any did)
        self._probation_since: float | None = None  # Heartbeat.probation while set (``enter_probation``)
        self._shown_work = False
        self._alone_reads = 0  # fresh reads in a row in which no other composer counts, while in probation
        self.without_work = 0
        """Live composers in the last view whose work has not reached this node while others' has
        (``_pacing_members``)."""
        self._named_without_work = 0
        self.ignored: Callable[[str, SwarmView], bool] | None = None
        """(fingerprint, view) -> whether this node ignores that composer (it bans its peer id, or another
        identity proved that peer id its own): an ignored composer owns nothing here."""

    # --- public ---

    @property
    def state(self) -> PeerState:
        return self._state

    def view(self) -> SwarmView:
        """The latest snapshot of the swarm (immutable). One whose reads have failed or stalled for over a TTL is
        judged a TTL ago at most (``SwarmView.aged_to``): a member that is gone drops out a TTL late, not never."""
        view, now = self._view, self._clock()
        floor = now - self._timing.heartbeat_ttl_s
        if view.read_at > 0 and view.judged_at < floor:
            view = dataclasses.replace(view, aged_to=floor)
        if view.quorum is not QuorumState.LOST and now > view.short_since + self._quorum.grace_s:
            # A cut-off side learns of the cut from reads that wait out their timeouts: the heartbeats it read tell
            # since when its side is short, and the others take its experts from then on.
            if not self._lapsed:
                self._lapsed = True
                logger.warning("cut off from the swarm: this node's side has been short of half of it since the "
                               "heartbeats that kept it there expired %.1f s ago; it trains no expert until it sees a "
                               "majority again (the other side of a partition trains them)", now - view.short_since)
            view = dataclasses.replace(view, quorum=QuorumState.LOST)
        return view

    def confirmed(self) -> bool:
        """Whether this composer's side is shown, lately enough, to hold half of the swarm: by a read, until the
        heartbeats of its last view that held half stop holding it (``majority_until``; always before the first read
        that shows half, and for a role that owns nothing); or by answers from half of the swarm themselves, until
        the last heartbeat of this node stored before them expires (``majority_heard_until``).

        A cut-off side learns of the cut from reads that wait out their timeouts, and it is cut off a quorum grace
        after that time; the others take its experts once its own last heartbeats expire by their clocks. Past
        both times, with nothing since to say the others are still there, the node holds its experts without
        training them (``Composer.pause``) until a read or their answers tell. No grace: holding is undone by the
        next read whose heartbeats hold half, or answers from half of the swarm after a heartbeat of this node was
        stored; a loaded host whose reads and stores both lag loses a stretch of its experts' training, never the
        experts."""
        now = self._clock()
        if now <= self._majority_until:
            return True
        with self._lock:
            counted, most = self._counted
            until = majority_heard_until(self._heard, counted, self.fingerprint, most, self._stored)
        if now > until:
            return False
        if now - self._by_answers_logged > _ANSWERS_LOGGED_S:
            self._by_answers_logged = now
            logger.info("no read of the swarm has shown this node's side holding half of it lately (its last view was "
                        "read %.0f s ago), but half of the swarm answered it directly since a heartbeat of its own "
                        "was stored: it trains on for %.0f s, while the others still count that heartbeat",
                        now - self._view.read_at, until - now)
        return True

    @property
    def timing(self) -> MembershipConfig:
        """The periods this node runs now: ``config`` paced to the live members of its last view
        (``MembershipConfig.paced``)."""
        return self._timing

    @property
    def stretch(self) -> int:
        """The factor ``timing`` stretches ``config``'s periods by (1 up to ``full_pace_members`` live members while
        reads are quick): waits that count on others noticing a change at their next read stretch with it."""
        return self._stretch

    @property
    def level(self) -> int:
        """The split of the members key this node reads (``MembershipConfig.level``): 0 up to
        ``full_pace_members``."""
        return self._level

    def owned(self) -> dict[int, frozenset[int]]:
        """The experts this node owns in its latest view, by layer."""
        return dict(self._owned)

    @property
    def probation(self) -> bool:
        """Whether this composer says it is in probation (``Heartbeat.probation``)."""
        return self._probation_since is not None

    def enter_probation(self) -> bool:
        """This composer joins a swarm that already trains: until a round merges its contribution
        (``shown_work``) its heartbeat says so, and nobody, this node included, gives it experts. The others give
        it none anyway once their work began, until its work reaches them (``Progress``, the unproven rule);
        saying so keeps its own view in step with theirs, so that it does not take over experts their owners
        keep. It trains the shared groups meanwhile, and its contributions are merged. Only when the work rule is
        on (``idle_s`` > 0), and only before it showed work (or resumed as one that had: ``shown_work``). Its
        probation also ends when no other composer counts in its view for a few fresh reads (nobody else would
        train the experts), or when no composer's work has reached it for ``idle_s`` (the swarm it saw train
        announced steps, never work). True when it began it."""
        with self._lock:
            if (self.presence.role != "composer" or self.config.idle_s <= 0 or self._shown_work
                    or self._probation_since is not None):
                return False
            self._probation_since, self._alone_reads = time.monotonic(), 0
        logger.info("%s joins run %s while it trains: it owns no expert until a round merges its contribution",
                    self.fingerprint, self.presence.run_id)
        self._announce_now.set()
        return True

    def shown_work(self) -> bool:
        """A round merged this composer's contribution with others' (they fetched and checked it), or it resumes
        as an identity whose work the others saw: its probation ends, or never begins, for good in this process.
        True when it ended one."""
        with self._lock:
            self._shown_work = True
            if self._probation_since is None:
                return False
            self._probation_since = None
        logger.info("%s: a round merged its contribution; it takes its share of the experts", self.fingerprint)
        self._announce_now.set()
        return True

    def joins_training(self, view: SwarmView) -> bool:
        """Whether the other live composers of ``view`` train: the higher median of their announced steps is past
        0 (one identity announcing a step alone does not make a starting swarm a training one)."""
        steps = [m.heartbeat.step for fp, m in view.alive().items()
                 if m.heartbeat.role == "composer" and fp != self.fingerprint]
        return bool(steps) and statistics.median_high(steps) > 0

    def _end_probation_when_alone(self, arrived: bool) -> None:
        """``enter_probation``'s last two ends, judged at each read (``arrived``: ``Progress.work_arrived``)."""
        since = self._probation_since
        if since is None:
            return
        others = set(self._view.composers()) - {self.fingerprint}
        self._alone_reads = 0 if others or self._view.quorum is not QuorumState.HELD else self._alone_reads + 1
        if self._alone_reads >= _ALONE_READS:
            why = "no other composer counts in its view: nobody else would train the experts"
        elif not arrived and time.monotonic() - since >= self._timing.idle_s:
            why = f"no composer's work reached it in {self._timing.idle_s:.0f} s: the others announce steps only"
        else:
            return
        with self._lock:
            if self._probation_since is None:
                return
            self._probation_since = None
        logger.info("%s: its probation ends (%s)", self.fingerprint, why)
        self._announce_now.set()

    def assigned(self) -> bool:
        """Whether this node's latest view has a shard assignment with this node among its composers, whether or
        not it owns an expert there (with more composers than a layer has experts, some own none in that layer,
        and a swarm larger than all the experts has composers that own none at all)."""
        assignment, _ = self._ownership
        return assignment is not None and self.fingerprint in assignment.peers

    def update(self, *, step: int | None = None, versions: Mapping[str, int] | None = None,
               loss: float | None = None, suspects: Mapping[str, float] | None = None,
               banned: Sequence[str] | None = None) -> None:
        """Set what the next heartbeat carries (thread-safe; the training loop's one seam). ``suspects`` and
        ``banned`` keep their first ``MAX_SUSPECTS``."""
        with self._lock:
            if suspects is not None:
                self._suspects = dict(list(suspects.items())[:MAX_SUSPECTS])
            if banned is not None:
                self._banned = tuple(banned)[:MAX_SUSPECTS]
            if step is not None:
                self._step = step
            if versions is not None:
                self._versions = dict(versions)
            if loss is not None:
                self._loss = loss

    def start(self, timeout_s: float = 30.0) -> None:
        """JOINING: refuse a duplicate identity, publish the first heartbeat, start the threads -> ONLINE.

        Raises:
            DuplicateIdentityError: a live heartbeat under this identity comes from another peer id.
            DHTError: the first heartbeat could not be stored within ``timeout_s``.
        """
        if self._state is not PeerState.JOINING:
            raise RuntimeError(f"start() in state {self._state.value}")
        if self._refresh() and self.joins_training(self._view):
            self.enter_probation()
        self._check_duplicate()
        deadline = time.monotonic() + timeout_s
        while not self._send_heartbeat():
            if time.monotonic() > deadline:
                raise DHTError(f"could not publish a heartbeat within {timeout_s:.0f} s; is the swarm reachable?")
            time.sleep(min(0.5, self._timing.refresh_s))
        self._refresh()
        self._state = PeerState.ONLINE
        self._threads = [
            threading.Thread(target=self._loop, args=(self._read_tick,), name=f"parallax-view-{self.fingerprint}",
                             daemon=True),
            threading.Thread(target=self._loop, args=(self._write_tick,),
                             name=f"parallax-announcer-{self.fingerprint}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        logger.info("%s is online in run %s as %s", self.fingerprint, self.presence.run_id, self.presence.role)

    def leave(self, reason: str = "", timeout_s: float = 5.0) -> bool:
        """LEAVING: release claims, publish a signed deathrattle, stop. True if the deathrattle was stored."""
        if self._state is PeerState.STOPPED:
            return False
        self._state = PeerState.LEAVING
        self._stop_thread(timeout_s)
        now = self._clock()
        for layer, claim_set in release_all(self._claimed, self._view.assignment(), self.fingerprint,
                                            step=self._step).items():
            self._store(self._claim_keys[layer], claim_set.encode(), now + self._lease_s(), timeout_s, force=True)
        self._claimed = {}
        with self._lock:
            rattle = Deathrattle(peer_id=self.dht.peer_id, step=self._step, reason=reason[:256])
        levels = {0} | {level for level, expiry in self._written.items() if expiry > now}
        ok = self._store_member(pack_message(rattle), levels, now + self._timing.heartbeat_ttl_s, timeout_s,
                                force=True)
        self._state = PeerState.STOPPED
        logger.info("%s left run %s (deathrattle %s)", self.fingerprint, self.presence.run_id,
                    "stored" if ok else "NOT stored")
        return ok

    def abandon(self, wait: bool = True) -> None:
        """Stop announcing without a deathrattle, as a crash would (tests and fault injection).

        With ``wait=False`` the threads are only told to stop (they may be inside a DHT call for up to
        ``request_timeout_s``).
        """
        self._stop_thread(self._timing.request_timeout_s + 1.0 if wait else 0.0)
        self._state = PeerState.STOPPED

    # --- the threads ---

    def _stop_thread(self, timeout_s: float) -> None:
        self._stop.set()
        self._announce_now.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self, tick: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                tick()
            except Exception:  # the announcer must survive anything a peer or the DHT throws at it
                logger.exception("membership %s failed; retrying", tick.__name__)
                self._stop.wait(self._timing.refresh_s)

    def _read_tick(self) -> None:
        """The reader: a fresh view, and from it (only) what we own; a change wakes the announcer."""
        if self._refresh() and self.shards is not None and not self._stop.is_set():
            quorum = self.view().quorum
            assignment = self._view.assignment()
            if quorum is QuorumState.LOST:
                owned = {}
            elif quorum is QuorumState.DOUBT:
                owned = self._owned  # what we own stays, and nothing is added
            else:
                owned = assignment.owned_by(self.fingerprint) if assignment is not None else {}
            self._ownership = (assignment, owned)
            if owned != self._owned:
                self._owned = owned
                self.owned_changed_at = time.monotonic()
                self._announce_now.set()  # say so now, not at the next period
        self._stop.wait(self._timing.refresh_s)

    def _write_tick(self) -> None:
        """The announcer: the manifest when due (first: a peer that sees our first heartbeat can read it), the
        heartbeat when due (or ownership changed), then the claims when due."""
        changed = self._announce_now.is_set()
        self._announce_now.clear()
        manifest = self.presence.manifest
        if manifest is not None and self._clock() >= self._next_manifest and not self._stop.is_set():
            now = self._clock()
            if self._store(manifest_key(self.presence.run_id), pack_message(manifest), now + MANIFEST_TTL_S,
                           self._timing.request_timeout_s):
                self._next_manifest = now + self._timing.manifest_period_s
        failed = False
        if changed or self._clock() >= self._next_heartbeat:
            failed = not self._send_heartbeat()
        if self.shards is not None and not self._stop.is_set():
            assignment, owned = self._ownership
            now = self._clock()
            if changed or now >= self._next_claims:
                self._send_claims(assignment, owned, now)
        due = min(self._next_heartbeat, self._next_claims if self.shards is not None else float("inf"))
        # A failed heartbeat is retried after refresh_s, not at once: a DHT that fails fast must not spin us.
        wait = self._timing.refresh_s if failed else min(self._timing.refresh_s, max(0.0, due - self._clock()))
        self._announce_now.wait(wait)

    def _heartbeat_if_due(self) -> None:
        # Checked between the claim stores: on a loaded host each call may take seconds, and several slow
        # calls must not let our heartbeat lapse while we are alive.
        if self._clock() >= self._next_heartbeat and not self._stop.is_set():
            self._send_heartbeat()

    def _lease_s(self) -> float:
        return self.shards.lease_s * self._stretch if self.shards else self._timing.heartbeat_ttl_s

    def _send_claims(self, assignment: Assignment | None, owned: Mapping[int, frozenset[int]], now: float) -> None:
        if assignment is None:  # no successful read yet: nothing to claim; the reader wakes us when there is
            self._next_claims = now + self._timing.heartbeat_period_s
            return
        peer_ids = {fp: m.heartbeat.peer_id for fp, m in self._view.members.items()}
        claimed: dict[int, frozenset[int]] = {}
        for layer in sorted(set(owned) | set(self._claimed)):
            self._heartbeat_if_due()
            claim_set = build_claim_set(
                assignment, layer, owned.get(layer, frozenset()), self._claimed.get(layer, ()), now=now,
                lease_s=self._lease_s(), step=self._step, peer_ids=peer_ids,
            )
            if self._store(self._claim_keys[layer], claim_set.encode(), now + self._lease_s(),
                           self._timing.request_timeout_s):
                if claim_set.claims:
                    claimed[layer] = frozenset(c.expert for c in claim_set.claims)
            elif self._claimed.get(layer):
                claimed[layer] = self._claimed[layer]  # unknown outcome: keep releasing it next time
        self._claimed = claimed
        self._next_claims = now + self._timing.heartbeat_period_s

    def _send_heartbeat(self) -> bool:
        now = self._clock()
        shards = tuple(sorted((layer, e) for layer, es in self._owned.items() for e in es))
        with self._lock:
            hb = Heartbeat(
                peer_id=self.dht.peer_id, addresses=self._addresses, role=self.presence.role,
                capacity=self.presence.capacity, shards=shards, step=self._step, versions=dict(self._versions),
                loss=self._loss, run=self.presence.run_digest, suspects=dict(self._suspects),
                banned=self._banned, sent=now, probation=self._probation_since is not None,
            )
        value = heartbeat_value(hb)
        ttl, started = self._timing.heartbeat_ttl_s, time.monotonic()
        ok = self._store_member(value, self._write_levels, now + ttl + self.store_lag_s, self._timing.request_timeout_s)
        self.store_lag_s = min(ttl, max(time.monotonic() - started, self.store_lag_s / 2))
        if ok:
            self.heartbeats_sent += 1
            with self._lock:  # counted from its sending, stored once the store returned
                self._stored.append((self._clock(), now + ttl))
            self._next_heartbeat = now + self._timing.heartbeat_period_s
        else:
            logger.debug("heartbeat store failed; retrying at the next tick")
        return ok

    def _store(self, key: str, value: bytes, expiration: float, timeout_s: float, *, force: bool = False) -> bool:
        if self._stop.is_set() and threading.current_thread() in self._threads:
            # An announcer that was stuck in a DHT call past leave()'s join must not re-announce us after the
            # deathrattle (whose expiration, bumped past any store begun earlier, wins over those).
            return False
        expiration = max(expiration, self._last_expiry.get(key, 0.0) + _MIN_EXPIRY_STEP_S)
        self._last_expiry[key] = expiration  # even on failure: a half-done store may have landed
        return self.dht.store(key, self._subkey, value, expiration, timeout_s=timeout_s, force=force)

    def _store_member(self, value: bytes, levels: Iterable[int], expiration: float, timeout_s: float, *,
                      force: bool = False) -> bool:
        """Store our members record (heartbeat or deathrattle) in our part of each of ``levels``; True when every
        store was accepted. ``force``: sent even while the previous store is still running (``SwarmDHT.store_many``)."""
        if self._stop.is_set() and threading.current_thread() in self._threads:
            return False  # as ``_store``: never re-announce us after the deathrattle
        expiration = self._members_expiry = max(expiration, self._members_expiry + _MIN_EXPIRY_STEP_S)
        keys = {level: members_key(self.presence.run_id, level, member_part(self.fingerprint, level))
                for level in sorted(levels)}
        for level in keys:  # even on failure: a half-done store may have landed
            self._written[level] = expiration
        stored = self.dht.store_many(list(keys.values()), self._subkey, value, expiration, timeout_s=timeout_s,
                                     force=force)
        return all(stored.values())

    def _refresh(self) -> bool:
        """Read a new view; False (the previous view kept) when the read failed."""
        began = self._clock()
        view = read_view(self.dht, self.presence.run_id, shards=self.shards, timeout_s=self._timing.request_timeout_s,
                         clock=self._clock, level=self._level)
        took = max(0.0, self._clock() - (view.read_at if view is not None else began))
        self._read_took(took)
        if view is None:
            return False  # the previous view is kept (``view`` ages it past a TTL)
        self.read_s = took
        mine = view.record_expiry.get(self.fingerprint)
        if mine is not None:  # keep our own expirations moving strictly forward after a restart
            self._members_expiry = max(self._members_expiry, mine)
        view, foreign = split_by_run(view, self.presence.run_digest)
        unnamed = {fp: m for fp, m in foreign.items() if self._naming.get(fp, 0) < _NAMING_TRIES}
        if unnamed:
            self._name_foreign(unnamed)
        self.foreign = foreign
        merged = merge_views(self._view, dataclasses.replace(view, grace_s=self._grace_s))
        alive = merged.alive()
        composers = [fp for fp, m in alive.items() if m.heartbeat.role == "composer"]
        self._vouch_remembered(composers)
        with self._lock:
            counted = self._progress.counted(composers, self.fingerprint)
            work_began, arrived = self._progress.work_began, self._progress.work_arrived
        self._pace(self._pacing_members(len(alive), len(composers), len(counted)))
        vouchings = self._vouchings
        stalled = self._stalled(merged)
        quorum = self._check_quorum(merged, counted, work_began)
        seen = self._quorum.seen()
        with self._lock:
            self._counted = (counted, seen)
        until = majority_until(merged, counted, self.fingerprint, seen, self._timing.heartbeat_ttl_s) \
            if self.presence.role == "composer" else math.inf
        short_since = math.inf
        if until == -math.inf:  # short now: since the heartbeats the last view that held half gave ran out
            short_since = min(self._majority_until, merged.judged_at)
        else:
            self._majority_until = until
        with self._view_lock:
            if self._vouchings != vouchings:  # the records vouched while this read was judged
                stalled = self._stalled(merged)
            self._view = dataclasses.replace(merged, stalled=stalled, joining=self._joining(merged), quorum=quorum,
                                             short_since=short_since)
        self._end_probation_when_alone(arrived)
        return True

    def _joining(self, view: SwarmView) -> frozenset[str]:
        """``SwarmView.joining`` of ``view`` (after ``_stalled``, which notes when each composer was first seen)."""
        now, idle_s = time.monotonic(), self._timing.idle_s
        probation = [fp for fp, m in view.alive().items() if m.heartbeat.role == "composer" and m.heartbeat.probation]
        with self._lock:
            recent = {fp for fp in probation if self._progress.seen_for(fp, now) < idle_s}
        return frozenset(fp for fp in recent if fp == self.fingerprint or not self._ignores(fp, view))

    def _pacing_members(self, alive: int, composers: int, counted: int) -> int:
        """How many members set this node's pace (``MembershipConfig.paced``): the composers that count in the
        quorum (``Progress.counted``: those whose work reached this node, once anyone's has) and at most as many
        workers and bootstrap peers. Heartbeats are free to sign: identities that only send them, however many,
        must not stretch every honest node's periods (a death seen 16x later under a flood of a few hundred).
        Such identities are named in the log once their number doubles. ``alive``: the live members, ``composers``
        of them composers, ``counted`` of those counted."""
        self.without_work = composers - counted
        if self.without_work >= max(2 * self._named_without_work, _FLOOD_NAMED_AT):
            self._named_without_work = self.without_work
            logger.warning("%d composers heartbeat in this node's view without any of their work reaching it (%d "
                           "that count): fresh identities, or a flood of them. They set no pace and count in no "
                           "quorum (net.membership.idle_s leaves them out of the assignment)", self.without_work,
                           counted)
        elif self.without_work < self._named_without_work // 2:
            self._named_without_work = self.without_work
        return counted + min(alive - composers, counted)

    def _read_took(self, seconds: float) -> None:
        """Count a read's duration (failed ones too) towards this node's stretch for slow reads
        (``MembershipConfig.slow_read_stretch``): once ``_READS_JUDGED`` reads are in, a median over this node's
        ``refresh_s`` doubles its periods, one under half of it halves them (down to the swarm's pace)."""
        self._reads.append(seconds)
        if len(self._reads) < _READS_JUDGED:
            return
        median, k, cap = statistics.median(self._reads), self._stretch, self.config.slow_read_stretch
        if median > self._timing.refresh_s and k < cap:
            self._load = min(cap, 2 * k)
            logger.warning("this node's reads of the swarm take %.1f s (median of its last %d), longer than its %.1f s "
                           "between reads: its host or link is loaded. It reads and heartbeats %dx less often than "
                           "at full pace (a death is seen up to that much later); at most %dx "
                           "(net.membership.slow_read_stretch)", median, len(self._reads), self._timing.refresh_s,
                           self._load, cap)
        elif median < self._timing.refresh_s / 2 and self._load > 1:
            self._load = 1 if self._load <= self.config.stretch(self._pacing) else self._load // 2
            logger.info("reads of the swarm take %.2f s again: the load's stretch of the periods is now x%d",
                        median, self._load)
        else:
            return
        self._reads.clear()
        self._pace(self._pacing)

    def _pace(self, members: int) -> None:
        self._pacing = members
        self._write_levels = self.config.write_levels(members)
        self._level = self.config.level(members)
        by_members = self.config.stretch(members)
        stretch = max(by_members, self._load)
        self._grace_s = self.config.refresh_s * (stretch - by_members)
        if stretch == self._stretch:
            return
        timing = self.config.paced(members, self._load)
        logger.info("%d live members: heartbeat every %.0f s (TTL %.0f s), the swarm re-read every %.1f s in %d "
                    "part(s) (x%d the periods of a swarm of %d or fewer%s)", members, timing.heartbeat_period_s,
                    timing.heartbeat_ttl_s, timing.refresh_s, 1 << self._level, stretch, self.config.full_pace_members,
                    "" if stretch == by_members else ", for this node's slow reads")
        self._timing, self._stretch = timing, stretch
        with self._lock:
            self._progress.stall_s, self._progress.idle_s = timing.stall_s, timing.idle_s
        self._quorum.window_s, self._quorum.grace_s = timing.quorum_window_s, timing.heartbeat_period_s

    def _check_quorum(self, view: SwarmView, alive: frozenset[str], counting_work: bool) -> QuorumState:
        """Where this node's side stands, from the live composers that count (``alive``: ``Progress.counted``) and
        whether they are counted by work (``counting_work``)."""
        if self.presence.role != "composer":
            return QuorumState.HELD
        if counting_work and not self._counting_work:
            self._quorum.restart()
            self._counting_work = True
        state = self._quorum.check(alive, view.departed, time.monotonic())
        cut_off, was = state is QuorumState.LOST, self._view.quorum is QuorumState.LOST or self._lapsed
        self._lapsed = self._lapsed and state is not QuorumState.HELD  # logged once until a majority is back
        if cut_off and not was:
            logger.warning("cut off from the swarm: %d composers that showed work are alive in this node's view, of "
                           "%d alive at once "
                           "in the last %.0f s; it trains no expert until it sees a majority again (the other side "
                           "of a partition trains them). If the network is down, check the link; if the others "
                           "left, it takes their experts after %.0f s", len(alive), self._quorum.seen(),
                           self._timing.quorum_window_s, self._timing.quorum_window_s)
        elif was and state is QuorumState.HELD:
            logger.warning("back in the swarm's majority: %d composers alive; taking its experts again",
                           len(alive))
        return state

    def _name_foreign(self, new: Mapping[str, Member]) -> None:
        """Log each composer seen training by another manifest once, with what differs (one DHT read); one whose
        manifest cannot be read yet is tried again at the next reads, a few times."""
        found = self._read_manifests()
        for fp, m in new.items():
            tries = self._naming[fp] = self._naming.get(fp, 0) + 1
            if m.heartbeat.run in found or tries == _NAMING_TRIES:
                self._naming[fp] = _NAMING_TRIES
                logger.warning("ignoring composer %s (peer %s): it trains by another run manifest than this node: "
                               "%s", fp, m.heartbeat.peer_id, self.foreign_difference(m, found))
        while len(self._naming) > _PROGRESS_KEPT:  # bounded under a flood of identities: the oldest go first
            del self._naming[next(iter(self._naming))]

    def _read_manifests(self) -> dict[bytes, tuple[RunManifest, int]]:
        return read_manifests(self.dht, self.presence.run_id, timeout_s=self._timing.request_timeout_s) or {}

    def foreign_difference(self, member: Member, found: Mapping[bytes, tuple[RunManifest, int]] | None = None) -> str:
        """How ``member``'s manifest differs from this node's, as far as the published manifests (``found``, read
        now when not given) tell."""
        mine, theirs = self.presence.manifest, member.heartbeat.run
        if mine is None:
            return "this node has none"
        found = self._read_manifests() if found is None else found
        if theirs in found:
            return manifest_difference(mine, found[theirs][0])
        return (f"digest {theirs.hex() or '(none)'} there, {mine.digest_hex} here (its manifest is not published "
                "yet)")

    def _ignores(self, fingerprint: str, view: SwarmView) -> bool:
        judge = self.ignored
        if judge is None:
            return False
        try:
            return judge(fingerprint, view)
        except Exception as e:  # a judge that fails (its loop closing at shutdown) ignores nobody
            logger.debug("could not tell whether to ignore %s: %r", fingerprint, e)
            return False

    def worked(self, fingerprint: str) -> None:
        """Evidence of a composer's work reached this node (thread-safe; ``Progress``)."""
        with self._lock:
            self._progress.worked(fingerprint, time.monotonic())

    def heard(self, fingerprint: str) -> None:
        """An answer came from this composer itself just now (thread-safe; ``majority_heard_until``): anything its
        outer transport answered (``OuterGather.answered``). Not a surrogate update, which any holder may serve and
        the training thread takes in later."""
        with self._lock:
            self._heard[fingerprint] = self._clock()
            _forget_oldest(self._heard)

    def vouched(self, fingerprints: Collection[str]) -> None:
        """The swarm's rounds records vouch for these composers (thread-safe; ``Progress.vouched``): before any
        work reached this node, they are the composers that count, and the others count once their work arrives."""
        if self._vouch(fingerprints):
            # The view's working set follows at once (a joiner's first rounds begin as its download ends), unless
            # the reader installed a newer view meanwhile, judged with them (``_refresh``).
            view = self._view
            stalled = self._stalled(view)
            with self._view_lock:
                if self._view is view:
                    self._view = dataclasses.replace(view, stalled=stalled)
            self._said_vouched(fingerprints, "the swarm's rounds records vouch for",
                               [fp for fp, m in self._view.alive().items() if m.heartbeat.role == "composer"])

    def remember(self, fingerprints: Collection[str]) -> None:
        """This node resumes a checkpoint that names these composers as having worked when it was written
        (``workers``). Until work reaches this node, each read counts those of them it shows alive as the records'
        word counts for a joiner (``Progress.vouched``), so identities that only heartbeat, written while this
        node was away, count once their own work arrives, not for a grace period. While none of them is alive,
        nothing changes: a swarm that turned over meanwhile is judged as a node starting up judges one."""
        with self._lock:
            self._remembered = frozenset(fingerprints) - {self.fingerprint}

    def workers(self) -> frozenset[str]:
        """The other composers whose work reached this node lately (``Progress.working``), for its checkpoint."""
        with self._lock:
            return self._progress.working(time.monotonic()) - {self.fingerprint}

    def _vouch(self, fingerprints: Collection[str]) -> bool:
        with self._lock:
            took = self._progress.vouched(fingerprints, time.monotonic())
            if took:
                self._vouchings += 1
        return took

    def _vouch_remembered(self, composers: Collection[str]) -> None:
        """Count the composers this node's checkpoint remembers among the live ``composers`` (``remember``)."""
        with self._lock:
            if self._progress.work_arrived:  # the node judges by what arrives from now on
                self._remembered = frozenset()
            alive = self._remembered & set(composers)
        if alive and self._vouch(alive):
            self._said_vouched(alive, "the checkpoint this node resumes names as having worked", composers)

    def _said_vouched(self, fingerprints: Collection[str], who: str, composers: Collection[str]) -> None:
        logger.info("%s: %s %s; until their work reaches this node they count, and the %d other composer(s) in its "
                    "view count once theirs does", self.fingerprint, who, ", ".join(sorted(fingerprints)),
                    len(set(composers) - set(fingerprints) - {self.fingerprint}))

    def _stalled(self, view: SwarmView) -> frozenset[str]:
        live = {fp: m.heartbeat.step for fp, m in view.alive().items() if m.heartbeat.role == "composer"}
        now = time.monotonic()
        with self._lock:
            stalled = self._progress.stalled(live, now) - {self.fingerprint}
            idle = {fp: self._progress.idle_after(fp) for fp in stalled if self._progress.idle(fp, now)}
            unproven = {fp for fp in idle if self._progress.unproven(fp)}
        ignored = {fp for fp in live if fp != self.fingerprint and self._ignores(fp, view)}
        stalled |= ignored
        for fp in stalled - self._view.stalled:
            if fp in unproven and fp not in ignored:
                # Fresh identities (joiners, or a flood of keys: named by their number in _pacing_members).
                logger.debug("composer %s (peer %s) owns nothing here until its work reaches this node", fp,
                             view.members[fp].heartbeat.peer_id)
                continue
            why = ("this node bans it or another identity proved its peer id" if fp in ignored else
                   f"none of its work (outer contributions, surrogate updates) reached this node for "
                   f"{idle[fp]:.0f} s or more while others' did" if fp in idle else
                   f"it announced step {live[fp]} for {self._timing.stall_s:.0f} s or more while others trained")
            logger.warning("composer %s (peer %s) owns nothing here until it shows work: %s", fp,
                           view.members[fp].heartbeat.peer_id, why)
        return stalled

    def _check_duplicate(self) -> None:
        now = self._clock()
        me = self._view.members.get(self.fingerprint)
        if me is not None and me.alive(now) and me.heartbeat.peer_id != self.dht.peer_id:
            raise DuplicateIdentityError(
                f"identity {self.fingerprint} is already alive in run {self.presence.run_id} as peer "
                f"{me.heartbeat.peer_id} (heartbeat valid for {me.expires_at - now:.1f} more s). Another "
                "process is using the same key file: stop it, or give this node its own --identity. If that "
                f"process just crashed, retry in {me.expires_at - now:.0f} s."
            )
