"""A node's network side, one section per component: ``net.gossip``, ``net.exchange``, ``net.outer`` and
``net.membership``. Each component takes its section whole; nothing is copied field by field.

Timings have two profiles: the internet (the defaults) and loopback (peers on one machine: tests and ``parallax
swarm local``), ``NetConfig.loopback()``, built from each section's own ``loopback()``. ``config/resolve.py``
picks the profile before applying changes, so a timing set by a file or a flag wins over either profile.
Times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallax.dht.membership import MembershipConfig

UNARY_CAP = 4 * 2**20
"""hivemind refuses a unary P2P message larger than this, bytes."""


def _positive(section: str, obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ValueError(f"net.{section}.{name} must be > 0 seconds, got {getattr(obj, name)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class GossipConfig:
    """Surrogate gossip (``node.net.gossip``): how often to poll and announce, how long to wait, what to accept."""

    poll_s: float = 2.0
    """Re-read the surrogate announcements this often."""
    announce_period_s: float = 10.0
    """Re-store this node's announcements this often (and at once after a publish or a fetch)."""
    announce_ttl_s: float = 60.0
    """An announcement expires this long after it is stored: providers can re-serve an owner's versions for this
    long after it vanished."""
    window: int = 4
    """Delta versions per expert kept, served and announced (the latest full copy is kept besides)."""
    max_behind: int = 4
    """A receiver further behind than this pulls the full copy instead of the deltas."""
    request_timeout_s: float = 3.0
    """Timeout of each DHT store/get."""
    chunk_timeout_s: float = 5.0
    """Give up on a provider when the next chunk takes longer than this."""
    fetch_timeout_s: float = 30.0
    """Give up on a provider when one whole payload takes longer than this."""
    chunk_bytes: int = 256 * 1024
    """Bytes per streamed message (hivemind caps one message at 4 MiB)."""
    max_norm: float | None = 1e4
    """L2 bound on each received delta factor and full tensor (None: no bound)."""
    max_parallel: int = 4
    """Experts synchronised concurrently in one poll."""

    def __post_init__(self) -> None:
        _positive("gossip", self, ("poll_s", "announce_period_s", "announce_ttl_s", "request_timeout_s",
                                   "chunk_timeout_s", "fetch_timeout_s"))
        if self.announce_ttl_s <= self.announce_period_s:
            raise ValueError("net.gossip.announce_ttl_s must exceed net.gossip.announce_period_s, or records lapse "
                             "between stores")
        if min(self.window, self.max_behind, self.max_parallel) < 1:
            raise ValueError("net.gossip: window, max_behind and max_parallel must be >= 1")
        if not 1024 <= self.chunk_bytes <= UNARY_CAP - 1024:
            raise ValueError("net.gossip.chunk_bytes must be in [1 KiB, 4 MiB - 1 KiB] (hivemind's message cap)")

    @classmethod
    def loopback(cls) -> GossipConfig:
        return cls(poll_s=0.5, announce_period_s=2.0, announce_ttl_s=30.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeConfig:
    """Expert snapshots to heirs (``node.net.expert_exchange``) and requests to offload workers."""

    poll_s: float = 10.0
    """An heir checks its owners' heartbeats for newer expert snapshots this often."""
    timeout_s: float = 30.0
    """One expert snapshot download, and one offload request to a worker."""

    def __post_init__(self) -> None:
        _positive("exchange", self, ("poll_s", "timeout_s"))

    @classmethod
    def loopback(cls) -> ExchangeConfig:
        return cls(poll_s=2.0, timeout_s=5.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterConfig:
    """This node's timings of the outer rounds (``node.outer``); the merge rule, wire format and aggregation are
    the run's (``train.sync``)."""

    target_group_size: int = 16
    """An all-reduce round starts at once when this many peers are looking: set it to the live composer count."""
    min_group_size: int = 2
    """Fewer peers than this is no all-reduce round."""
    min_matchmaking_time_s: float = 15.0
    """A round waits this long for more peers before merging with those present (internet: 15, covering peers
    whose inner steps run a few seconds apart; loopback: 1)."""
    request_timeout_s: float = 5.0
    """A matchmaking request to one peer is lost after this long; must be < min_matchmaking_time_s."""
    matchmaking_timeout_s: float = 60.0
    """A round that formed no group (no quorum of contributions) within this long is given up."""
    allreduce_timeout_s: float = 300.0
    """A merge not finished this long after its group formed is given up; also bounds one contribution's fetch
    (internet: 300 s is ~1 GB of fp16 pseudo-gradient over a 30 Mbit/s uplink; loopback: 20)."""
    next_chunk_timeout_s: float = 30.0
    """A groupmate that sends no chunk for this long is dropped from the all-reduce (the round is then
    inconsistent and verification discards it); in a gathered round, a contributor whose answer holds this long
    without a chunk is left out of the round and scored."""
    verify_timeout_s: float = 15.0
    """Wait at most this long for the participants' fingerprints in the DHT (loopback: 3)."""
    parts_rechecks: int = 1
    """The fewest blocks of the others' merged shares this node recomputes from the contributions in each partitioned
    round (``sync.aggregation = "parts"``), drawn at random; it recomputes as many as a body's worth of fetches pays
    for when that is more (``node.outer.partitioned.rechecks``): each costs a block of every contribution."""
    record_merges: bool = False
    """Write each applied round's geometry (the inner products of its contributions and its result:
    ``train.robust.merge_geometry``) to this node's metrics as a ``merge`` event, for ``parallax bench attacks`` to
    measure what an attack took from each round. A partitioned round records the blocks this node merged (no node
    holds a whole merge; the products of the set's mergers add up to the whole's). It costs K^2 products of the
    group's size (partitioned: of its share) for each round that verifies."""
    own_data_audits: bool = False
    """Audit one other contribution of each backbone round for work on its sender's own data, on this node's model,
    and record each audit (``train.own_data``; metrics event ``own_data_audit``): a partitioned round fetches that
    contribution whole (one body a round), and the audit holds the training thread up to a few seconds a round at
    the tiny preset on a CPU (six evaluations of 16 batches). A measurement: no judgement acts on it (in a local swarm
    whose nodes train at their own pace the honest composers' audits fail; in lockstep and in the simulator they
    pass: docs/decisions.md, "Work on one's own data")."""
    dht_timeout_s: float = 5.0
    """Each DHT store/get of a round's records."""
    fingerprint_ttl_s: float = 600.0
    """Round records expire after this long (only the rounds just run are read)."""
    fingerprint_tolerance: float | None = None
    """Two merged results agree when every projection and norm differs by at most this times their scale;
    None: by compression (fp16 2e-2, uint8 0.15, none 1e-5), far above rounding noise, below a broken round
    (under uint8 the margin is thinner: a round merged from a subset differs by tens of percent)."""
    direction_eps: float | None = None
    """RDA falls back to the plain mean below this length of the mean unit direction; None: by compression.
    fp16 gives the mean direction ~3e-4 of noise per peer and the rebuilt direction amplifies it by
    1/length, so under fp16 we fall back below 0.05, under uint8 (~3.5e-2 per peer) below 0.1
    (rda.DIRECTION_EPS, 1e-6, when uncompressed)."""
    startup_timeout_s: float = 60.0
    """Starting an averager process (busy hosts need 30-120 s)."""
    shutdown_timeout_s: float = 5.0
    """Grace period of an averager process at shutdown before it is terminated."""
    load_state_timeout_s: float = 30.0
    """A joiner's download of the shared groups from live peers."""

    def __post_init__(self) -> None:
        if self.min_group_size < 2 or self.target_group_size < self.min_group_size:
            raise ValueError("net.outer needs 2 <= min_group_size <= target_group_size")
        _positive("outer", self, ("min_matchmaking_time_s", "request_timeout_s", "matchmaking_timeout_s",
                                  "allreduce_timeout_s", "next_chunk_timeout_s", "verify_timeout_s", "dht_timeout_s",
                                  "fingerprint_ttl_s", "startup_timeout_s", "shutdown_timeout_s",
                                  "load_state_timeout_s"))
        if self.parts_rechecks < 0:
            raise ValueError(f"net.outer.parts_rechecks must be >= 0, got {self.parts_rechecks}")
        if self.request_timeout_s >= self.min_matchmaking_time_s:
            raise ValueError("net.outer.request_timeout_s must be < net.outer.min_matchmaking_time_s (hivemind can "
                             "deadlock otherwise); lower request_timeout_s or raise min_matchmaking_time_s")
        if self.next_chunk_timeout_s >= self.allreduce_timeout_s:
            raise ValueError("net.outer.next_chunk_timeout_s must be < net.outer.allreduce_timeout_s (a fetch that "
                             "gets no message within the first is held, one still coming at the second is slow); "
                             "lower next_chunk_timeout_s or raise allreduce_timeout_s")
        if self.matchmaking_timeout_s <= self.min_matchmaking_time_s:
            raise ValueError("net.outer.matchmaking_timeout_s must exceed net.outer.min_matchmaking_time_s, or no "
                             "group smaller than target_group_size can ever form")
        for name in ("fingerprint_tolerance", "direction_eps"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"net.outer.{name} must be in (0, 1) or None, got {value}")

    @classmethod
    def loopback(cls) -> OuterConfig:
        return cls(min_matchmaking_time_s=1.0, request_timeout_s=0.5, matchmaking_timeout_s=15.0,
                   allreduce_timeout_s=20.0, next_chunk_timeout_s=5.0, verify_timeout_s=3.0, dht_timeout_s=2.0,
                   startup_timeout_s=30.0, shutdown_timeout_s=3.0)


@dataclass(frozen=True, kw_only=True)
class NetConfig:
    """A node's network side, one section per component. The defaults suit the internet;
    ``NetConfig.loopback()`` suits peers on one machine."""

    gossip: GossipConfig = field(default_factory=GossipConfig)
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)

    @classmethod
    def loopback(cls) -> NetConfig:
        """Short timings for peers on one machine: each section's loopback profile."""
        return cls(gossip=GossipConfig.loopback(), exchange=ExchangeConfig.loopback(), outer=OuterConfig.loopback(),
                   membership=MembershipConfig.loopback())
