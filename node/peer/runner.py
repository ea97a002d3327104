"""The P2P composer: one process that joins a swarm, trains its expert shard, and exchanges in the background.

DESIGN.md section 4. ``Node.run()`` does, in order:

1. start the DHT (signed records), announce itself (``Membership``: heartbeats, claims), wait until the
   live shard assignment gives it experts;
2. build the composer with the experts it owns (or, with ``resume``, the checkpoint's), or load the
   shared groups from live peers when it joins a running swarm (and take the swarm's step count, so
   round numbers and the learning-rate schedule agree);
3. start the network side: one asyncio loop thread (``parallax-net``) for the P2P streams (surrogate
   gossip, expert snapshots) and one worker thread per outer group (``BackgroundRounds``);
4. train. Between two steps, and only there, the loop meets the network at ``_seam``: it applies the
   surrogate updates that arrived, takes over or hands over experts when the live assignment changed,
   applies finished outer rounds and starts due ones, publishes surrogate refreshes and expert
   snapshots, and updates its heartbeat. A step itself does no network I/O;
5. leave on ``steps`` reached, SIGINT or SIGTERM: let the rounds in flight end (bounded), push final
   expert snapshots to the heirs, checkpoint, publish the deathrattle, stop every thread, averager and
   daemon (``close``, in ``finally``).

Ownership changes. The live assignment (``Membership.owned``) decides what this node trains. An
expert it loses is released at the next seam: its final snapshot is served (``ExpertExchange``) for
the peer taking it over, and the node's surrogate of it returns to what every receiver holds. An
expert it gains is taken over from the previous owner's snapshot (asked for by peer id; a final one
when that owner already released it) or, when the owner is dead, from this node's heir copy (the
owner's periodic snapshot it kept pulling as heir). An expert no snapshot exists for restarts from the
seeded init (logged). The new owner then publishes the surrogate as a full copy at a version that
makes every receiver catch up with it (``SurrogateGossip.next_version``).

Data: each node samples windows of the whole training split with a seed derived from its identity
(decision: a node does not know how many peers will come, so a fixed shard i/C is not available;
random windows of a large corpus rarely overlap).
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.claims import ShardConfig
from parallax.dht.membership import Member, Membership, MembershipConfig, PeerState, SwarmView
from parallax.dht.shards import Assignment, assign_experts
from parallax.errors import NodeError
from parallax.node.config.train import SHARED_GROUPS, TrainConfig
from parallax.node.model.transformer import MoETransformer, Ownership, SwiGLU
from parallax.node.net.expert_exchange import SURROGATE_PREFIX, SURROGATE_VERSION, ExpertExchange, Snapshot
from parallax.node.net.gossip import GossipConfig, SurrogateGossip
from parallax.node.net.network import NetworkLoop, start_dht
from parallax.node.net.outer_rounds import BackgroundRounds, next_round_in
from parallax.node.net.outer_sync import RoundStatus, TieredOuterSync
from parallax.node.net.outer_wire import FingerprintSigner, OuterSyncConfig, payload_bytes
from parallax.node.offload.exchange import OffloadClient
from parallax.node.offload.proxy import SETTINGS_KEY, settings_digest
from parallax.node.offload.session import OffloadSession
from parallax.node.train.checkpoint import latest_checkpoint, load_checkpoint, read_info, save_checkpoint, state_hash
from parallax.node.train.composer import ADAM_PREFIX, BadOptimizerState, Composer
from parallax.node.train.data import load_corpus, split_corpus, val_batches
from parallax.node.train.outer import TierSchedule
from parallax.protocol.identity import Identity

logger = logging.getLogger(__name__)

ExpertId = tuple[int, int]

LEAVING = "leaving"
"""Heartbeat ``versions`` key a node sets while it leaves: its heirs fetch its final snapshots at once."""

HANDOVER_WINDOW_S = 30.0
"""A released expert's final snapshot is the hand-over to us only when released at most this long before our
adoption began, and not before we came online (less a heartbeat TTL for views that lag): a releaser serves
its final snapshot for minutes, and under churn the expert may have been trained elsewhere since (seen: a
step-0 final won at step 410). In seconds, not steps: the releaser trains on after the release, at its own
speed, while a joiner first loads the shared state (measured: a final 4 s old was 60 releaser steps back)."""


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything ``parallax node join`` decides. Times in seconds, periods in inner steps."""

    train: TrainConfig
    """Model, optimizers, sync periods, surrogates (``--preset``, ``--config``, ``--set``)."""
    run_id: str
    """The training run: every peer of a run uses the same id and the same TrainConfig."""
    identity_path: Path
    """Ed25519 key file (created on first run); the libp2p key lives beside it."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of live peers; empty starts a new swarm."""
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    data: str | None = None
    """Corpus path (None: built-in tinyshakespeare)."""
    device: str = "cpu"
    steps: int | None = None
    """Train this many steps, then leave gracefully (None: until Ctrl+C / SIGTERM)."""
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 100
    resume: bool = False
    metrics_path: Path | None = None
    """JSONL file, one line per step (and one per event)."""
    loopback: bool = False
    """Timings for peers on one machine (tests, ``swarm local``): short matchmaking and polls."""
    min_peers: int = 1
    """Wait until this many composers are alive (this one included) before the first step."""
    start_timeout_s: float = 120.0
    """Give up when the swarm does not offer this node a shard within this long."""
    snapshot_every: int = 50
    """Serve a fresh snapshot of every owned expert (for its heir) every this many steps: an owner's death
    loses at most this many steps of its experts; each snapshot is weights + AdamW moments (12 bytes per
    expert parameter) pulled by the heir, so short periods cost traffic (``parallax bench swarm``)."""
    adopt_wait_s: float = 10.0
    """How long to wait for the previous owner's final snapshot before taking its latest periodic one."""
    leave_timeout_s: float = 30.0
    """Bound on the graceful leave (rounds in flight, final snapshots)."""
    final_eval: bool = False
    """Evaluate this node's own view on the validation split when it leaves (metrics event final_eval)."""

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError("--steps must be >= 1")
        for name in ("checkpoint_every", "snapshot_every", "min_peers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("--resume needs --checkpoint-dir (where the checkpoints are)")
        # Levers measured in the in-process simulator only (issue 3); the node has no path for them.
        if self.train.sketch.enabled:
            raise ValueError("sketch.enabled (non-owners' (x, g) sketches to the owners) runs in `parallax sim` "
                             "only; a node offloads its own experts' updates with offload.enabled instead")
        if self.train.sync.dense_steps:
            raise ValueError("sync.dense_steps (a dense start-up phase) runs in `parallax sim` only; "
                             "a node splits the experts from the start: leave it at 0")


@dataclass
class NodeStatus:
    """What the live display shows, refreshed after every step (a plain value: safe to hand to the UI)."""

    fingerprint: str = ""
    peer_id: str = ""
    join_command: str = ""
    """``--initial-peers ...`` line others join through (printed once at start)."""
    phase: str = "starting"
    step: int = 0
    trained: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    live_peers: int = 0
    view_age_s: float = 0.0
    """Seconds since this node last read the swarm's members (grows while its DHT reads fail)."""
    owned: int = 0
    surrogates_held: int = 0
    surrogate_version_max: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    gossip_bytes: int = 0
    """Surrogate payloads fetched + served."""
    snapshot_bytes: int = 0
    """Expert snapshots fetched + served (heir copies, hand-overs)."""
    heir_copies: list[list[int]] = field(default_factory=list)
    """[layer, expert] of other owners' experts this node holds a snapshot of, as their heir."""
    rounds_ok: dict[str, int] = field(default_factory=dict)
    next_round: dict[str, int] = field(default_factory=dict)
    adoptions: int = 0
    releases: int = 0
    val_loss: float | None = None


@dataclass
class _Adoption:
    eid: ExpertId
    source: str | None  # previous owner's peer id, when it is alive
    started: float
    future: Any = None
    best: Snapshot | None = None
    asked: float = 0.0
    others: list[str] = field(default_factory=list)
    """Further peers to ask when the source holds none, in turn, every other request going to the source again:
    a previous owner that had nothing yet (its view lagged ours; it releases the expert seconds later) is asked
    again within a second, however many peers there are."""
    asking: str | None = None
    """The peer the pending (or last) request went to."""


def ownership_of(owned: dict[int, frozenset[int]], n_layers: int) -> Ownership:
    return tuple(frozenset(owned.get(layer, ())) for layer in range(n_layers))


def data_seed(fingerprint: str, seed: int) -> int:
    """A node's data stream seed: its identity and the run's seed (stable across restarts)."""
    return (zlib.crc32(fingerprint.encode()) ^ seed) & 0x7FFF_FFFF


class Node:
    """One composer peer (module docstring). ``run()`` trains until done; ``stop()`` asks it to leave."""

    def __init__(self, config: NodeConfig, *, on_status: Callable[[NodeStatus], None] | None = None) -> None:
        self.config = config
        self.cfg = config.train
        self.on_status = on_status
        self.status = NodeStatus()
        self.stop_event = threading.Event()
        self.identity = Identity.load_or_create(config.identity_path)
        self.status.fingerprint = self.identity.fingerprint
        self.dht: SwarmDHT | None = None
        self.membership: Membership | None = None
        self.composer: Composer | None = None
        self.gossip: SurrogateGossip | None = None
        self.exchange: ExpertExchange | None = None
        self.sync: TieredOuterSync | None = None
        self.rounds: BackgroundRounds | None = None
        self.offload: OffloadSession | None = None  # only with cfg.offload.enabled
        self._mismatched_workers: set[str] = set()  # workers named in the log for running other settings
        self._settings_digest: int | None = None  # offload.settings_digest of this node's config
        self._refits_wait_for: str | None = None
        """A joiner publishes no surrogate refresh until this group has merged once (None: ready), it is alone in
        a fresh view (its own outer steps are the swarm's), or two of the group's rounds failed (rounds that keep
        failing must not freeze its surrogates for good)."""
        self._refits_rounds_failed = 0
        self.schedule = TierSchedule(self.cfg.sync.periods)
        self._net: NetworkLoop | None = None
        self._metrics: Any = None
        self._owners: dict[ExpertId, str] = {}  # expert -> owner fingerprint at the last seam
        self._adopting: dict[ExpertId, _Adoption] = {}
        self._online_at = 0.0  # when our first heartbeat was stored (monotonic clock)
        self._adopted: set[ExpertId] = set()  # taken over since start: next publication jumps versions
        self._started = time.monotonic()
        self.join_to_first_step_s: float | None = None

    # --- public ---

    def stop(self) -> None:
        """Ask the node to leave after the current step (thread- and signal-safe)."""
        self.stop_event.set()

    def run(self) -> NodeStatus:
        """Join, train, leave. Returns the last status.

        Raises:
            NodeError / DHTError / CheckpointError: start-up failed (nothing is left running).
        """
        try:
            self._start()
            self._train()
            self._leave()
        finally:
            self.close()
        return self.status

    # --- start ---

    def _start(self) -> None:
        c, cfg = self.config, self.cfg
        corpus = load_corpus(c.data)
        self.train_tokens, val = split_corpus(corpus, seq_len=cfg.model.seq_len)
        self.val = val_batches(val, cfg.batch_size, cfg.model.seq_len, cfg.eval_batches)
        if c.metrics_path is not None:
            c.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = c.metrics_path.open("a", encoding="utf-8")
        self._phase("joining")
        # torch's optimizers import torch._dynamo (1-2 s) when the first is built: do it while the DHT starts.
        self.dht = start_dht(self.identity, run_id=c.run_id, n_layers=cfg.model.n_layers,
                             identity_path=c.identity_path, initial_peers=c.initial_peers,
                             host_maddrs=c.host_maddrs, announce_maddrs=c.announce_maddrs,
                             while_starting=lambda: importlib.import_module("torch._dynamo"))
        self.status.peer_id = self.dht.peer_id
        self.status.join_command = self.dht.join_command()
        self._event("dht_started", join=self.status.join_command)
        shards = ShardConfig(n_layers=cfg.model.n_layers, n_experts=cfg.model.n_experts)
        mcfg = MembershipConfig(run_id=c.run_id, role="composer")
        self.membership = Membership(self.dht, self.identity, mcfg, shards=shards)
        self.membership.start()
        self._online_at = time.monotonic()
        checkpoint = latest_checkpoint(c.checkpoint_dir) if c.resume and c.checkpoint_dir else None
        if c.resume and checkpoint is None:
            raise NodeError(f"--resume: no checkpoint in {c.checkpoint_dir}; start without --resume")
        info = read_info(checkpoint) if checkpoint is not None else None
        # The network side first: its averagers take seconds to start, while the announcer thread settles
        # the shard assignment meanwhile (``_wait_for_shard`` then rarely waits).
        self._start_network(dict(info.versions) if info is not None else {})
        self._event("network_started", seconds=round(time.monotonic() - self._started, 3))
        owned = self._wait_for_shard()
        self._event("shard_offered", seconds=round(time.monotonic() - self._started, 3))
        # Joining a running swarm = another composer has trained already (peers started together all read 0).
        others = [m for fp, m in self.membership.view().alive().items()
                  if fp != self.identity.fingerprint and m.heartbeat.role == "composer"]
        swarm_step = max((m.heartbeat.step for m in others), default=0)

        joining = swarm_step > 0
        # A joiner takes its experts over from their previous owners at its first seams (``_reconcile_ownership``),
        # so it starts owning nothing; the previous owners are those of the assignment without it.
        ownership = ownership_of({} if joining else owned, cfg.model.n_layers)
        if info is not None:
            ownership = info.owned
        self.composer = Composer(cfg, ownership, self.train_tokens,
                                 sampler_seed=data_seed(self.identity.fingerprint, cfg.seed), device=c.device)
        self._event("composer_built", seconds=round(time.monotonic() - self._started, 3))
        if cfg.offload.enabled:
            assert self._net is not None
            timeout_s = 5.0 if c.loopback else 30.0
            client = OffloadClient(self._net.p2p, self._net.loop, c.run_id, self.identity, self._public_key_of,
                                   onboard_timeout_s=timeout_s, update_timeout_s=timeout_s)
            self._settings_digest = settings_digest(cfg)
            self.offload = OffloadSession(self.composer, client, c.run_id, self._live_workers, event=self._event)
        if checkpoint is not None:
            loaded = load_checkpoint(checkpoint, self.composer, run_id=c.run_id)
            self._event("resumed", step=loaded.step, path=str(checkpoint), state_hash=state_hash(self.composer))
        assert self.sync is not None
        self.rounds = BackgroundRounds(self.sync, self.composer, serve=not joining or checkpoint is not None)
        if joining and checkpoint is None:
            self._phase("loading state")
            taken = self.rounds.load_from_peers(timeout_s=30.0)
            self._fast_forward(swarm_step)
            self._event("loaded_state", groups=taken, step=swarm_step)
        if joining and "backbone" in self.composer.outer:
            # Our backbone is the swarm's last merged anchor (or our own checkpoint's), not where the others
            # have trained it since: surrogates fitted on its activations would mislead everyone (_publish_refresh).
            self._refits_wait_for = "backbone"
        self.rounds.publish_state()
        if joining:
            before = {m.fingerprint: m.heartbeat.capacity for m in others}
            self._owners = _owners(assign_experts(c.run_id, cfg.model.n_layers, cfg.model.n_experts, before))
        else:
            self._owners = _owners(self.membership.view().assignment())

    def _wait_for_shard(self) -> dict[int, frozenset[int]]:
        """Wait until the live assignment gives us experts and has been stable for a moment, or, joining a
        swarm that already trains, until we see it (a joiner starts owning nothing and takes its experts
        over at its first seams, so the assignment need not have settled)."""
        assert self.membership is not None
        deadline = time.monotonic() + self.config.start_timeout_s
        settle = 2 * self.membership.config.refresh_s + 0.5
        while True:
            if self.stop_event.is_set():
                raise NodeError("stopped before training began")
            owned = self.membership.owned()
            view = self.membership.view()
            peers = len(view.composers())
            stable = time.monotonic() - self.membership.owned_changed_at >= settle
            running = any(m.heartbeat.step > 0 and m.heartbeat.role == "composer" for m in view.alive().values())
            if peers >= self.config.min_peers and ((owned and stable) or running):
                return owned
            if time.monotonic() > deadline:
                raise NodeError(f"no expert shard within {self.config.start_timeout_s:.0f} s ({peers} live composers "
                                f"seen, {self.config.min_peers} wanted); check --initial-peers and --run-id")
            self._phase(f"waiting for peers ({peers}/{self.config.min_peers})")
            time.sleep(0.1)

    def _start_network(self, versions: dict[ExpertId, int]) -> None:
        assert self.dht is not None
        c, cfg = self.config, self.cfg
        self._net = net = NetworkLoop(self.dht, "parallax-net")
        gcfg = GossipConfig(run_id=c.run_id, n_layers=cfg.model.n_layers,
                            **({"poll_s": 0.5, "announce_period_s": 2.0, "announce_ttl_s": 30.0} if c.loopback else {}))
        shapes = model_shapes(cfg)
        self.gossip = SurrogateGossip(self.dht, self.identity, gcfg, shapes=shapes.surrogate,
                                      owner_of=self._owner_key, start_versions=versions, loop=net.loop).start()
        self.exchange = ExpertExchange(net.p2p, net.loop, c.run_id, shapes.expert, identity=self.identity,
                                       key_of=self._public_key_of, surrogate_shapes=shapes.surrogate,
                                       heir_targets=self._heir_targets,
                                       snapshot_every=c.snapshot_every, poll_s=2.0 if c.loopback else 10.0,
                                       timeout_s=5.0 if c.loopback else 30.0).start()
        ocfg = OuterSyncConfig.loopback(matchmaking_timeout_s=15.0) if c.loopback else OuterSyncConfig()
        ocfg = OuterSyncConfig(**{**asdict(ocfg), "method": cfg.sync.merge, "compression": cfg.sync.compression})
        self.sync = TieredOuterSync(self.dht, c.run_id, shapes.groups, ocfg,
                                    signer=FingerprintSigner(self.identity, self._public_key_of))

    def _fast_forward(self, step: int) -> None:
        """Take the swarm's step count (round numbers, learning-rate schedule) when joining a running swarm."""
        composer = self.composer
        assert composer is not None
        if step <= composer.step:
            return
        composer.step = step
        scheduler = composer.scheduler
        scheduler.last_epoch = step
        for group, base, factor in zip(composer.optimizer.param_groups, scheduler.base_lrs,  # type: ignore[attr-defined]
                                       scheduler.lr_lambdas, strict=True):
            group["lr"] = base * factor(step)

    # --- views the network threads read (immutable snapshots; thread-safe) ---

    def _owner_key(self, eid: ExpertId) -> bytes | None:
        view = self.membership.view() if self.membership else None
        assignment = view.assignment() if view else None
        if view is None or assignment is None:
            return None
        member = view.members.get(assignment.owner(*eid))
        return member.public_key if member is not None else None

    def _fresh_view(self) -> SwarmView | None:
        """The membership view, or None when our own reads have been failing (an overloaded host): then
        expired heartbeats prove nothing and no decision should follow from them."""
        membership = self.membership
        if membership is None:
            return None
        view = membership.view()
        return view if dht_time() - view.read_at <= 2 * membership.config.refresh_s + 1.0 else None

    def _heir_targets(self) -> dict[ExpertId, tuple[str, int] | None] | None:
        view = self._fresh_view()
        assignment = view.assignment() if view else None
        if view is None or assignment is None:
            return None
        alive = view.alive()
        out: dict[ExpertId, tuple[str, int] | None] = {
            (layer, e): None for layer, es in assignment.owned_by(self.identity.fingerprint).items() for e in es}
        for layer, experts in assignment.inherited_by(self.identity.fingerprint).items():
            for e in experts:
                owner = alive.get(assignment.owner(layer, e))
                if owner is not None:
                    hb = owner.heartbeat
                    # A leaving owner serves its final snapshot now: make any older copy count as stale.
                    step = hb.step + (self.config.snapshot_every if hb.versions.get(LEAVING) else 0)
                    out[(layer, e)] = (hb.peer_id, step)
        return out

    # --- training ---

    def _shard_event(self) -> None:
        assert self.composer is not None
        self._event("shard", step=self.composer.step, experts=[list(eid) for eid in self.composer.owned_experts()])

    def _train(self) -> None:
        composer = self.composer
        assert composer is not None
        self._phase("training")
        self._shard_event()
        assert self.dht is not None
        self.dht.forbidden_thread = threading.get_ident()  # counts any DHT call from this loop (none expected)
        trained, tokens_window, window_started = 0, 0, time.monotonic()
        while not self.stop_event.is_set() and (self.config.steps is None or trained < self.config.steps):
            self._seam()
            if self.offload is None:
                stats = composer.train_step()
            else:  # the offload exchange must sit between backward and the optimizer step (offload_client.py)
                stats = composer.forward_backward()
                self.offload.exchange()
                composer.optimizer_step()
            trained += 1
            if self.join_to_first_step_s is None:
                self.join_to_first_step_s = time.monotonic() - self._started
                self._event("first_step", seconds=round(self.join_to_first_step_s, 3))
            tokens_window += stats.tokens
            elapsed = time.monotonic() - window_started
            if elapsed >= 2.0:
                self.status.tokens_per_s = tokens_window / elapsed
                tokens_window, window_started = 0, time.monotonic()
            self.status.step, self.status.trained, self.status.loss = composer.step, trained, stats.loss
            self._metric(step=composer.step, loss=round(stats.loss, 5), ce=round(stats.ce_loss, 5),
                         **({} if self.offload is None else self._offload_fields()))
            if self.config.checkpoint_dir is not None and composer.step % self.config.checkpoint_every == 0:
                self._checkpoint()
        self._seam()  # apply what arrived during the last step before leaving
        self.dht.forbidden_thread = None
        self._event("step_path", dht_calls=self.dht.forbidden_calls, steps=trained)

    def _offload_fields(self) -> dict[str, int | float | None]:
        session = self.offload
        assert session is not None
        client = session.client
        sent, received = client.bytes_sent, client.bytes_received
        return {"offload_applied": session.applied, "offloaded": len(session.offloaded),
                "offload_coalesced": session.coalesced, "offload_merged": session.merged,
                "offload_lateness": None if session.mean_lateness is None else round(session.mean_lateness, 3),
                "offload_waited_s": round(session.waited_s, 3),
                "offload_sketches": client.requests["rpc_update"], "offload_sketch_bytes": sent["rpc_update"],
                "offload_results": client.replies["rpc_update"], "offload_result_bytes": received["rpc_update"],
                "offload_onboards": client.requests["rpc_onboard"], "offload_onboard_bytes": sent["rpc_onboard"]}

    def _seam(self) -> None:
        """The one place the training loop meets the network (module docstring). Never waits on it."""
        composer, gossip, rounds, membership = self.composer, self.gossip, self.rounds, self.membership
        assert composer is not None and gossip is not None and rounds is not None and membership is not None
        owned_now = set(composer.owned_experts())
        for update in gossip.drain():
            eid = (update.layer, update.expert)
            if eid not in owned_now:
                update.apply({n: p.data for n, p in composer.model.surrogate_parameters(*eid).items()})
        self._reconcile_ownership()
        for report in rounds.collect():
            self._round_event(report)
            if report.group == self._refits_wait_for:
                self._refits_rounds_failed += report.status is not RoundStatus.OK
                if report.status is RoundStatus.OK:
                    self._refits_ready("merged")
                elif self._refits_rounds_failed >= 2:
                    logger.warning("%d %s rounds failed since joining; refitting surrogates without a merged "
                                   "backbone", self._refits_rounds_failed, report.group)
                    self._refits_ready("rounds_failed")
        step = composer.step
        if step > 0:
            alone = len(membership.view().composers()) < 2
            for group in self.schedule.due(step):
                if group not in composer.outer:
                    continue
                if alone and not rounds.busy(group):  # a merge among one: the outer step with our own delta
                    composer.apply_outer(group, composer.pseudo_gradient(group))
                    fresh = self._fresh_view()  # not a view that lost the others for a moment
                    if group == self._refits_wait_for and fresh is not None and len(fresh.composers()) < 2:
                        self._refits_ready("alone")
                elif not alone:
                    rounds.submit(group, round_id=step // self.schedule.periods[group])
            if step % self.cfg.surrogate.refresh_every == 0:
                self._publish_refresh()
            if step % self.config.snapshot_every == 0:
                for eid in composer.owned_experts():
                    self.exchange.put(eid, step, self._snapshot(eid))  # type: ignore[union-attr]
        versions = gossip.versions()
        membership.update(step=step, loss=self.status.loss,
                          versions={"max": max(versions.values(), default=0), "held": len(versions)})
        self._refresh_status()

    def _round_event(self, report: Any) -> None:
        self._event("round", group=report.group, status=report.status.value, round_id=report.round_id,
                    participants=len(report.participants), allreduce_s=round(report.allreduce_s, 4),
                    total_s=round(report.total_s, 4), bytes_est=self._round_bytes(report))

    def _round_bytes(self, report: Any) -> int:
        """Bytes this node sent in an all-reduce: a butterfly all-reduce sends (n-1)/n of the payload to the
        others and receives as much back."""
        n = len(report.participants)
        if self.sync is None or n < 2 or not report.began_allreduce:
            return 0
        averager = self.sync.groups[report.group]
        return int(payload_bytes(averager.shapes, averager.config) * (n - 1) / n)

    def _refits_ready(self, reason: str) -> None:
        """The joiner's wait for a merged backbone is over (``reason``: merged, alone, rounds_failed)."""
        self._event("refits_ready", step=self.composer.step if self.composer else 0, reason=reason)
        self._refits_wait_for = None

    def _publish_refresh(self) -> None:
        """Distil the owned experts and publish the deltas; not while this node is a joiner whose backbone has
        not merged with the swarm's yet (``_refits_wait_for``): until then its activations come from the last
        anchor, up to a whole backbone period behind the backbones the others run, and a surrogate fitted on
        them misleads every receiver. Measured (``parallax bench swarm``, small preset, 64 distillation
        steps, a joiner at step ~50): the first nodes' median val loss 2.51 / 2.59 when it refitted at once,
        2.24 / 2.26 with this wait (2.17 with no joiner until the end). Receivers keep the previous owner's
        surrogate meanwhile."""
        composer, gossip = self.composer, self.gossip
        assert composer is not None and gossip is not None
        if composer.recorder is None:
            return
        if self._refits_wait_for is not None:
            self._event("refit_deferred", step=composer.step, until=self._refits_wait_for)
            return
        published = composer.refresh_surrogates()
        for (layer, expert), factors in published.items():
            self._publish(layer, expert, factors)
        self._event("refit", step=composer.step, experts=len(published))

    def _publish(self, layer: int, expert: int, factors: Any) -> None:
        composer, gossip = self.composer, self.gossip
        assert composer is not None and gossip is not None
        eid = (layer, expert)
        adopted = eid in self._adopted
        version = gossip.next_version(layer, expert, adopted=adopted)
        gossip.publish(layer, expert, version, factors, full=composer.publishers[eid].full())
        self._adopted.discard(eid)

    # --- ownership changes ---

    def _reconcile_ownership(self) -> None:
        composer, membership = self.composer, self.membership
        assert composer is not None and membership is not None
        view = self._fresh_view()
        assignment = view.assignment() if view is not None else None
        if view is None or assignment is None or self.identity.fingerprint not in assignment.peers:
            return  # no fresh view that has us in it (a transient DHT miss): change nothing
        target = {(layer, e) for layer, es in assignment.owned_by(self.identity.fingerprint).items() for e in es}
        current = set(composer.owned_experts())
        for eid in sorted(current - target):
            self._release(eid)
        for eid in sorted(target - current - set(self._adopting)):
            previous = self._owners.get(eid)
            member = view.alive().get(previous) if previous and previous != self.identity.fingerprint else None
            adoption = _Adoption(eid, member.heartbeat.peer_id if member else None, time.monotonic())
            # Under churn the previous owner in our view may not be the node that trained the expert last:
            # after it, ask every other live composer (a releaser serves its final snapshot for minutes).
            adoption.others = [m.heartbeat.peer_id for fp, m in sorted(view.alive().items())
                               if m.heartbeat.role == "composer" and fp != self.identity.fingerprint
                               and m.heartbeat.peer_id != adoption.source]
            if adoption.source is None:  # the owner died: our own copy if we hold one, else ask around
                if self.exchange.has_local_copy(eid):  # type: ignore[union-attr]
                    adoption.others = []
                elif adoption.others:
                    adoption.source = adoption.others.pop(0)
            if adoption.source is not None:
                adoption.asking = adoption.source
                adoption.future = self.exchange.fetch(adoption.source, eid)  # type: ignore[union-attr]
                adoption.asked = time.monotonic()
            self._adopting[eid] = adoption
        for eid in list(self._adopting):
            if eid not in target:
                del self._adopting[eid]  # it moved on before we took it
                continue
            self._progress_adoption(self._adopting[eid])
        self._owners = _owners(assignment)
        if set(composer.owned_experts()) != current:
            self._shard_event()

    def _progress_adoption(self, a: _Adoption) -> None:
        exchange = self.exchange
        assert exchange is not None
        waited = time.monotonic() - a.started
        if a.future is not None:
            if not a.future.done():
                if waited < self.config.adopt_wait_s:
                    return
            else:
                snap = a.future.result()
                if snap is not None and (a.best is None or snap.step >= a.best.step):
                    a.best = snap
                # Only the final snapshot of this hand-over ends the wait (HANDOVER_WINDOW_S).
                not_before = max(self._online_at - self.membership.config.heartbeat_ttl_s,  # type: ignore[union-attr]
                                 a.started - HANDOVER_WINDOW_S)
                recent_final = snap is not None and snap.final and time.monotonic() - snap.age_s >= not_before
                if not recent_final and waited < self.config.adopt_wait_s:
                    if time.monotonic() - a.asked < 0.5:  # at most two requests a second per expert
                        return
                    if (snap is None or snap.final) and a.others:  # none here, or a stale final: someone else
                        if a.asking == a.source:  # the next of the others, in turn
                            a.asking = a.others.pop(0)
                            a.others.append(a.asking)
                        else:  # and every other time the previous owner again
                            a.asking = a.source
                    a.future, a.asked = exchange.fetch(a.asking, a.eid), time.monotonic()  # type: ignore[arg-type]
                    return
        local = exchange.take_local_copy(a.eid)
        if a.best is not None and local is not None and local[0].step > a.best.step:
            a.best = None  # our own copy is newer than anything a live peer had
        if a.best is not None:
            self._adopt(a.eid, a.best, source="previous owner")
        else:
            self._adopt(a.eid, local[0] if local else None, source=local[1] if local else "init")
        del self._adopting[a.eid]

    def _member(self, peer_id: str | None) -> Member | None:
        """The live member whose signed heartbeat names this libp2p peer id (thread-safe: views are immutable)."""
        if self.membership is None or peer_id is None:
            return None
        found = [m for m in self.membership.view().alive().values() if m.heartbeat.peer_id == peer_id]
        return found[0] if len(found) == 1 else None  # two identities claiming one peer id: trust neither

    def _public_key_of(self, peer_id: str) -> bytes | None:
        """The identity key a live peer id belongs to, for its outer-round fingerprints, expert snapshots and
        offload answers."""
        member = self._member(peer_id)
        return member.public_key if member is not None else None

    def _snapshot(self, eid: ExpertId) -> dict[str, torch.Tensor]:
        """An owned expert's snapshot: weights + AdamW state, and the surrogate every receiver holds with its
        version, so whoever takes the expert over continues the surrogate's versions from the same base."""
        composer, gossip = self.composer, self.gossip
        assert composer is not None and gossip is not None
        tensors = composer.expert_snapshot(eid)
        for name, t in composer.publishers[eid].full().items():
            tensors[f"{SURROGATE_PREFIX}{name}"] = t
        tensors[SURROGATE_VERSION] = torch.tensor(float(gossip.versions().get(eid, 0)))
        return tensors

    def _adopt(self, eid: ExpertId, snapshot: Snapshot | None, *, source: str) -> None:
        composer, gossip = self.composer, self.gossip
        assert composer is not None and gossip is not None
        expert = None
        if snapshot is not None:
            expert = {k: v for k, v in snapshot.tensors.items() if not k.startswith(SURROGATE_PREFIX)}
            surrogate = {k[len(SURROGATE_PREFIX):]: v for k, v in snapshot.tensors.items()
                         if k.startswith(SURROGATE_PREFIX) and k != SURROGATE_VERSION}
            try:
                try:
                    composer.adopt_expert(eid, expert)
                except BadOptimizerState as e:  # usable weights: keep them, start AdamW afresh
                    logger.warning("expert %s: the %s's snapshot has an unusable AdamW state (%s); adopting its "
                                   "weights with a fresh optimizer state", eid, source, e)
                    composer.adopt_expert(eid, {k: v for k, v in expert.items() if not k.startswith(ADAM_PREFIX)})
            except ValueError as e:  # a peer's snapshot the composer refuses: never raised into the loop
                logger.warning("expert %s: refused the snapshot from the %s (%s); trying without it", eid, source, e)
                snapshot = expert = None
            else:
                if surrogate:
                    with torch.no_grad():
                        for n, p in composer.model.surrogate_parameters(*eid).items():
                            p.copy_(surrogate[n])
                    composer.reset_publisher(eid)
                    gossip.hold(eid, int(snapshot.tensors[SURROGATE_VERSION]))
        if snapshot is None:
            logger.warning("expert %s: no live peer served a usable snapshot of it within the adoption wait; "
                           "restarting it from init", eid)
            source = "init"
            composer.adopt_expert(eid, None)
        self._adopted.add(eid)
        self.status.adoptions += 1
        self._event("adopted", layer=eid[0], expert=eid[1], source=source,
                    snapshot_step=snapshot.step if snapshot else None,
                    surrogate_version=self.gossip.versions().get(eid, 0) if self.gossip else None)
        # Publish at once: every receiver switches to this node's copy of the surrogate (a full copy at a
        # version past anything the previous owner may have published).
        self._publish(eid[0], eid[1], composer.publishers[eid].delta(
            {n: p.data for n, p in composer.model.surrogate_parameters(*eid).items()}))

    def _release(self, eid: ExpertId) -> None:
        composer, gossip, exchange = self.composer, self.gossip, self.exchange
        assert composer is not None and gossip is not None and exchange is not None
        if self.offload is not None:  # trained here again before its snapshot (unanswered sketches are dropped)
            self.offload.release(eid)
        mirror = composer.publishers[eid].full() if eid in composer.publishers else None
        snapshot = self._snapshot(eid)
        composer.release_expert(eid)
        exchange.put(eid, composer.step, snapshot, final=True)
        gossip.disown(*eid)
        if mirror is not None:  # back to the surrogate every receiver holds
            with torch.no_grad():
                for n, p in composer.model.surrogate_parameters(*eid).items():
                    p.copy_(mirror[n])
        self.status.releases += 1
        self._event("released", layer=eid[0], expert=eid[1], step=composer.step)

    # --- leaving ---

    def _leave(self) -> None:
        composer, rounds, membership = self.composer, self.rounds, self.membership
        assert composer is not None and rounds is not None and membership is not None
        self._phase("leaving")
        started = time.monotonic()
        if len(membership.view().composers()) > 1:  # alone, a round in flight can only time out
            for report in rounds.wait(timeout_s=min(self.config.leave_timeout_s, 20.0)):
                self._round_event(report)  # the last rounds count in the metrics too
        for eid in composer.owned_experts():
            self.exchange.put(eid, composer.step, self._snapshot(eid), final=True)  # type: ignore[union-attr]
        self._push_final_snapshots(deadline=started + self.config.leave_timeout_s)
        if self.config.checkpoint_dir is not None:
            self._checkpoint()
        if self.config.final_eval:
            self.status.val_loss = composer.evaluate(self.val)
            self._event("final_eval", step=composer.step, val_loss=round(self.status.val_loss, 5),
                        tokens=composer.tokens_seen)
        rattle = membership.leave("leaving after training" if not self.stop_event.is_set() else "stopped by the user")
        self._event("left", step=composer.step, seconds=round(time.monotonic() - started, 3), deathrattle=rattle)

    def _push_final_snapshots(self, deadline: float) -> None:
        """Hand our experts' final state to their heirs before the deathrattle.

        Heirs pull the owner's snapshot whenever its heartbeat shows a newer step; we announce our last
        step and wait (bounded) until each owned expert's snapshot at that step was served."""
        exchange, membership, composer = self.exchange, self.membership, self.composer
        assert exchange is not None and membership is not None and composer is not None
        owned = [eid for eid in self._heirs_of_owned()]
        if not owned:
            return
        versions = self.gossip.versions() if self.gossip else {}
        membership.update(step=composer.step, versions={"max": max(versions.values(), default=0),
                                                        "held": len(versions), LEAVING: 1})
        while time.monotonic() < deadline:
            served = exchange.servicer.served_steps
            if all(served.get(eid, -1) >= composer.step for eid in owned):
                return
            time.sleep(0.2)
        logger.info("leaving before every heir pulled its final snapshot (heirs keep their last periodic copy)")

    def _heirs_of_owned(self) -> dict[ExpertId, str]:
        view = self.membership.view() if self.membership else None
        assignment = view.assignment() if view else None
        if assignment is None or self.composer is None:
            return {}
        out = {}
        for eid in self.composer.owned_experts():
            heir = assignment.heir(*eid)
            if heir is not None:
                out[eid] = heir
        return out

    def _checkpoint(self) -> None:
        composer, gossip = self.composer, self.gossip
        assert composer is not None and gossip is not None and self.config.checkpoint_dir is not None
        path = save_checkpoint(self.config.checkpoint_dir, composer, run_id=self.config.run_id,
                               versions=gossip.versions())
        self._event("checkpoint", step=composer.step, path=str(path), state_hash=state_hash(composer))

    def _live_workers(self) -> dict[str, float] | None:
        """Offload workers in the membership view that run this node's worker settings: libp2p peer id ->
        capacity (a cached read, no DHT call). A worker with other settings is named once in the log."""
        if self.membership is None:
            return None
        ours, live = self._settings_digest, {}
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
                self._event("offload_worker_mismatch", worker=hb.peer_id)
        return live

    def close(self) -> None:
        """Stop everything this node started, in reverse order. Safe to call twice and after a failed start."""
        if self.offload is not None:
            self.offload.close()
            self.offload = None
        if self.membership is not None and self.membership.state is not PeerState.STOPPED:
            try:
                self.membership.leave("shutting down")
            except Exception as e:
                logger.debug("leave during close: %r", e)
        if self.rounds is not None:
            self.rounds.shutdown()
        if self.sync is not None:
            self.sync.shutdown()
        if self.exchange is not None:
            self.exchange.close()
        if self.gossip is not None:
            self.gossip.close()
        if self._net is not None:
            self._net.close()
        if self.dht is not None:
            self.dht.shutdown()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self.rounds = self.sync = self.exchange = self.gossip = None
        self.membership = None
        self._net = None

    # --- status and metrics ---

    def _refresh_status(self) -> None:
        s, composer = self.status, self.composer
        assert composer is not None
        view = self.membership.view() if self.membership else None
        s.live_peers = len(view.composers()) if view else 0
        s.view_age_s = max(0.0, dht_time() - view.read_at) if view else 0.0
        s.owned = sum(len(es) for es in composer.owned)
        if self.gossip is not None:
            versions = self.gossip.versions()
            s.surrogates_held = len(versions)
            s.surrogate_version_max = max(versions.values(), default=0)
            st = self.gossip.stats
            snap_in = self.exchange.bytes_fetched if self.exchange else 0
            snap_out = self.exchange.servicer.bytes_served if self.exchange else 0
            s.bytes_received = st.bytes_fetched + snap_in
            s.bytes_sent = st.bytes_served + snap_out
            s.gossip_bytes = st.bytes_fetched + st.bytes_served
            s.heir_copies = [list(eid) for eid in sorted(self.exchange.heir_copies())] if self.exchange else []
            s.snapshot_bytes = snap_in + snap_out
        if self.rounds is not None:
            s.rounds_ok = dict(self.rounds.rounds_ok)
        s.next_round = next_round_in(dict(self.schedule.periods), composer.step)
        if self.on_status is not None:
            self.on_status(s)

    def _phase(self, phase: str) -> None:
        self.status.phase = phase
        if self.on_status is not None:
            self.on_status(self.status)

    def _metric(self, **fields: Any) -> None:
        if self._metrics is None:
            return
        s = self.status
        line = {"t": round(dht_time(), 3), "kind": "step", **fields, "peers": s.live_peers,
                "view_age_s": round(s.view_age_s, 2), "owned": s.owned, "surrogates_held": s.surrogates_held,
                "surrogate_version_max": s.surrogate_version_max,
                "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received, "gossip_bytes": s.gossip_bytes,
                "snapshot_bytes": s.snapshot_bytes, "heir_copies": s.heir_copies, "rounds_ok": s.rounds_ok,
                "tokens_per_s": round(s.tokens_per_s, 1)}
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()

    def _event(self, kind: str, **fields: Any) -> None:
        logger.info("%s %s", kind, fields)
        if self._metrics is not None:
            self._metrics.write(json.dumps({"t": round(dht_time(), 3), "kind": kind, **fields}) + "\n")
            self._metrics.flush()


def _owners(assignment: Assignment | None) -> dict[ExpertId, str]:
    """expert -> owner fingerprint in ``assignment`` (empty without one)."""
    return {} if assignment is None else {(layer, e): owner for layer, e, owner, _ in assignment.items()}


@dataclass(frozen=True)
class ModelShapes:
    """Tensor shapes a node needs before it has a composer (name -> shape)."""

    groups: dict[str, dict[str, tuple[int, ...]]]
    """group -> tensors of each shared group a composer merges, in its anchors' order."""
    surrogate: dict[str, tuple[int, ...]]
    expert: dict[str, tuple[int, ...]]


def model_shapes(cfg: TrainConfig) -> ModelShapes:
    """Read from a model of ``cfg`` that owns no expert (and one expert module), so the shapes are the model's."""
    model = MoETransformer(cfg.model, ownership_of({}, cfg.model.n_layers), cfg.surrogate.non_owned, seed=cfg.seed)
    groups = {g: {n: tuple(p.shape) for n, p in model.group_parameters(g).items()}
              for g in SHARED_GROUPS if model.group_parameters(g)}
    surrogate = {n: tuple(p.shape) for n, p in model.surrogate_parameters(0, 0).items()}
    expert = {n: tuple(p.shape) for n, p in SwiGLU(cfg.model.d_latent, cfg.model.d_expert).named_parameters()}
    return ModelShapes(groups, surrogate, expert)


__all__ = ["SHARED_GROUPS", "Node", "NodeConfig", "NodeStatus"]
