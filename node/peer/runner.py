"""The P2P composer: one process that joins a swarm, trains its expert shard, and exchanges in the background.

``Node.run()`` does, in order:

1. start the DHT (signed records), announce itself (``Membership``: heartbeats, claims), wait until the
   live shard assignment gives it experts;
2. build the composer with the experts it owns (or, with ``node.resume``, the checkpoint's), or load the
   shared groups from live peers when it joins a running swarm (and take the swarm's step count, so
   round numbers and the learning-rate schedule agree);
3. start the network side: one asyncio loop thread (``parallax-net``) for the P2P streams (surrogate
   gossip, expert snapshots) and one worker thread per outer group (``BackgroundRounds``);
4. train (``Training``). Between two steps, and only there, the loop meets the network at its seam: it applies
   the surrogate updates that arrived, takes over or hands over experts when the live assignment changed
   (``experts.py``), applies finished outer rounds and starts due ones, publishes surrogate refreshes and
   expert snapshots, and updates its heartbeat. A step itself does no network I/O;
5. leave on ``node.steps`` reached, SIGINT or SIGTERM: let the rounds in flight end (bounded), push final
   expert snapshots to the heirs, checkpoint, publish the deathrattle; then stop every thread, averager and
   daemon in the reverse order of their start (one ``ExitStack``).

Data: each node samples windows of the whole training split with a seed derived from its identity (a node
does not know how many peers will come, so a fixed shard i/C is not available; random windows of a large
corpus rarely overlap).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parallax.dht.adapter import SwarmDHT, dht_time
from parallax.dht.claims import ShardConfig
from parallax.dht.membership import Membership, PeerState, Presence, QuorumState
from parallax.errors import NodeError
from parallax.node.config.peer import NodeConfig
from parallax.node.config.train import SHARED_GROUPS, TrainConfig, run_settings
from parallax.node.model.transformer import (
    InitialWeights,
    InitPlan,
    MoETransformer,
    Ownership,
    SwiGLU,
    expert_prefix,
)
from parallax.node.net.admission import peer_admission, peer_manifest
from parallax.node.net.expert_exchange import ExpertExchange
from parallax.node.net.gossip import SurrogateGossip
from parallax.node.net.network import NetworkLoop, run_replica_groups, start_dht
from parallax.node.net.observe import Observer, serve_status
from parallax.node.net.scores import PeerScores
from parallax.node.net.whoami import IdentityProver
from parallax.node.offload.exchange import OffloadClient
from parallax.node.offload.proxy import settings_digest
from parallax.node.offload.session import OffloadSession
from parallax.node.outer.averager import TieredOuterSync
from parallax.node.outer.background import BackgroundRounds
from parallax.node.outer.replicas import ReplicaRounds
from parallax.node.outer.state import StateExchange
from parallax.node.outer.transport import OuterGather, RoundPeers
from parallax.node.outer.wire import FingerprintSigner, OuterSyncConfig
from parallax.node.peer.experts import Experts
from parallax.node.peer.ownership import owners_of
from parallax.node.peer.redial import Redialer
from parallax.node.peer.refits import RefitGate
from parallax.node.peer.sinks import open_sinks
from parallax.node.peer.telemetry import NodeStatus, Telemetry
from parallax.node.peer.training import Training
from parallax.node.peer.views import SwarmViews
from parallax.node.train import own_data
from parallax.node.train.checkpoint import CheckpointInfo, load_checkpoint, read_info, sound_checkpoint, state_hash
from parallax.node.train.composer import Composer
from parallax.node.train.data import CorpusInfo, data_seed, load_corpus, val_batches
from parallax.node.train.device import device_of
from parallax.node.train.tokenizer import ByteTokenizer, Tokenizer, run_tokenizer, tokenized_splits
from parallax.protocol.identity import Identity
from parallax.protocol.manifest import corpus_digest

logger = logging.getLogger(__name__)

PROBE_BATCHES = 2
"""Held-out batches a downloaded group state is judged on before it replaces this node's (``take_state``)."""


def ownership_of(owned: dict[int, frozenset[int]], n_layers: int) -> Ownership:
    return tuple(frozenset(owned.get(layer, ())) for layer in range(n_layers))


def outer_sync_config(config: NodeConfig) -> OuterSyncConfig:
    """The outer rounds' settings: the run's merge and wire format, this node's timings."""
    return OuterSyncConfig(sync=config.train.sync, net=config.net.outer)


@dataclass
class _Network:
    """The network side of a node, started before its composer exists."""

    dht: SwarmDHT
    membership: Membership
    views: SwarmViews
    loop: NetworkLoop
    gossip: SurrogateGossip
    exchange: ExpertExchange
    sync: TieredOuterSync
    scores: PeerScores
    states: StateExchange
    gather: OuterGather


class Node:
    """One composer peer (module docstring). ``run()`` trains until done; ``stop()`` asks it to leave.

    Args:
        config: what to run (``parallax config show`` prints one).
        on_status: called with the live status whenever it changes.
    """

    def __init__(self, config: NodeConfig, *, on_status: Callable[[NodeStatus], None] | None = None) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self.identity = Identity.load_or_create(config.peer.identity_path("node"))
        self._stack = contextlib.ExitStack()
        self.telemetry = Telemetry(config.peer.metrics, on_status)
        self._stack.callback(self.telemetry.close)
        self.telemetry.status.fingerprint = self.identity.fingerprint
        self.training: Training | None = None
        self._observer: Observer | None = None
        self._tokenizer: Tokenizer = ByteTokenizer()
        """The run's (``node.train.tokenizer``), known once the corpus is read."""
        self._corpus = ""
        """The corpus's digest, the manifest's term (``protocol.manifest.corpus_digest``), known once it is read."""
        self._started = self._online_at = time.monotonic()

    @property
    def status(self) -> NodeStatus:
        return self.telemetry.status

    def stop(self) -> None:
        """Ask the node to leave after the current step (thread- and signal-safe)."""
        self.stop_event.set()

    @property
    def starting(self) -> bool:
        """True until training begins (``run``): a signal then stops the node at once."""
        return self.training is None

    def run(self) -> NodeStatus:
        """Join, train, leave. Returns the last status.

        Raises:
            NodeError / DHTError / CheckpointError: start-up failed (nothing is left running).
        """
        try:
            self.training = self._start()
            self.training.run()
            self.training.leave()
        finally:
            self.close()
        return self.status

    def close(self) -> None:
        """Stop everything this node started, in reverse order. Safe to call twice and after a failed start."""
        self._stack.close()

    # --- start ---

    def _seconds(self) -> float:
        return round(time.monotonic() - self._started, 3)

    def _start(self) -> Training:
        c, cfg, stack, telemetry = self.config, self.config.train, self._stack, self.telemetry
        if c.peer.status_port is not None:  # first: a port already taken fails before anything else starts
            self._observer = serve_status(c.peer, stack, "composer", n_layers=cfg.model.n_layers,
                                          n_experts=cfg.model.n_experts)
            telemetry.observer = self._observer
            telemetry.publish()
        if c.peer.log_to:  # a missing tracker package fails here, before the network starts
            telemetry.sinks = open_sinks(c.peer.log_to, name=self.identity.fingerprint, run_id=c.peer.run_id,
                                         config=json.loads(run_settings(cfg)))
        corpus = load_corpus(c.node.data)
        self._corpus = corpus_digest(corpus)
        self._tokenizer = run_tokenizer(cfg.model, corpus, c.peer.manifest)
        splits = tokenized_splits(corpus, self._tokenizer, seq_len=cfg.model.seq_len)
        train_tokens, val = splits.train, splits.val
        # The checkpoint is chosen, checked and loaded before the network starts: a node that cannot resume says
        # so before it announces itself to anyone.
        composer, info, resumed_at = None, None, 0
        device = str(device_of(c.node.device))
        sampler_seed = data_seed(self.identity.fingerprint, cfg.seed)
        checkpoint = self._checkpoint()
        if checkpoint is not None:
            info = read_info(checkpoint)
            composer = Composer(cfg, info.owned, train_tokens, sampler_seed=sampler_seed, device=device,
                                replica_outers=cfg.ownership.replicas > 1)
            loaded = load_checkpoint(checkpoint, composer, run_id=c.peer.run_id)
            if composer.sampler.seed != sampler_seed:
                # Another identity's checkpoint: this node's batches must be the ones its peers rebuild from its own
                # identity (``own_data``), so its stream goes on from the draw count under its own seed.
                logger.warning("checkpoint %s was written by another identity than this node's (%s): its data stream "
                               "goes on under this identity's seed", checkpoint, self.identity.fingerprint)
                composer.sampler.seed = sampler_seed
            resumed_at = loaded.step
            telemetry.event("resumed", step=loaded.step, path=str(checkpoint), state_hash=state_hash(composer))
        telemetry.phase("joining")
        net = self._start_network(dict(info.versions) if info is not None else {}, worked_before=resumed_at > 0,
                                  workers=self._workers(info))
        telemetry.event("network_started", seconds=self._seconds())
        owned, joining = self._wait_for_shard(net.membership)
        telemetry.event("shard_offered", seconds=self._seconds(), probation=net.membership.probation)
        others = [m for fp, m in net.membership.view().alive().items()
                  if fp != self.identity.fingerprint and m.heartbeat.role == "composer"]
        # A joiner starts owning nothing: in probation until a round merged its contribution, then it takes its
        # experts over from their previous owners at its seams (``Experts.reconcile``).
        if composer is None:
            composer = Composer(cfg, ownership_of({} if joining else owned, cfg.model.n_layers), train_tokens,
                                sampler_seed=sampler_seed, device=device, replica_outers=cfg.ownership.replicas > 1)
        telemetry.event("composer_built", seconds=self._seconds())
        offload = self._start_offload(net, composer) if cfg.offload.enabled else None
        held_out = val_batches(val, cfg.batch_size, cfg.model.seq_len, cfg.eval_batches)
        probe = held_out[:PROBE_BATCHES]
        period = cfg.sync.periods.get(own_data.GROUP)
        audit = None if period is None or not c.net.outer.own_data_audits else own_data.Auditor(
            composer, lambda peer: net.views.data_seed_of(peer, cfg.seed), period, own_data.OwnDataAudits(),
            telemetry.event)
        rounds = BackgroundRounds(net.sync, composer, serve=not joining or checkpoint is not None, states=net.states,
                                  probe=lambda: composer.evaluate(probe), audit=audit)
        stack.callback(rounds.shutdown)
        if joining and checkpoint is None:
            telemetry.phase("loading state")
            taken = rounds.load_from_peers(timeout_s=c.net.outer.load_state_timeout_s)
            swarm_step = max((m.heartbeat.step for m in others), default=0)
            fast_forward(composer, swarm_step)
            telemetry.event("loaded_state", groups=taken, step=swarm_step)
        # A joiner's backbone is the swarm's last merged anchor (or its own checkpoint's), not where the others
        # have trained it since: its refits wait for a merge (refits.py).
        gate = RefitGate("backbone" if joining and "backbone" in composer.outer else None, telemetry.event)
        rounds.publish_state()
        # A joiner's experts come from their owners in the assignment without it: the view's own, with the same
        # capacity bound and progress rules as every other assignment this node computes.
        view = net.membership.view()
        owners = owners_of(view.assignment(leaving_out=self.identity.fingerprint) if joining else view.assignment())
        experts = Experts(composer, net.gossip, net.exchange, net.membership, net.views, telemetry, c.node,
                          fingerprint=self.identity.fingerprint, online_at=self._online_at, owners=owners,
                          offload=offload)
        replicas = None
        if composer.replica_outers:
            replicas = ReplicaRounds(
                net.dht, c.peer.run_id, composer, outer_sync_config(c), me=self.identity.fingerprint,
                peers_of=net.views.owner_peers, signer=FingerprintSigner(self.identity, net.views.public_key_of),
                gather=net.gather, scores=net.scores, worked=net.views.worked, resync=experts.resync,
                weight_cap=float(cfg.batch_size * cfg.model.seq_len * cfg.sync.periods["backbone"]))
            stack.callback(replicas.shutdown)
        return Training(c, composer, net.dht, net.membership, net.views, net.gossip, net.exchange, net.sync, rounds,
                        experts, gate, telemetry, self.stop_event, offload=offload, scores=net.scores, val=held_out,
                        started=self._started,
                        outer_traffic=lambda: (net.gather.servicer.bytes_served + net.gather.servicer.records_served
                                               + net.states.servicer.bytes_served,
                                               net.gather.bytes_fetched + net.gather.records_fetched),
                        replicas=replicas,
                        data=CorpusInfo.of(c.node.data, corpus))

    def _workers(self, info: CheckpointInfo | None) -> frozenset[str]:
        """The composers the resumed checkpoint names as having worked (``Membership.remember``), while it is younger
        than ``net.membership.idle_s``: older, they would have been idle by the rule that names them, and the swarm's
        working set may have turned over."""
        idle_s = self.config.net.membership.idle_s
        if info is None or not info.workers or idle_s <= 0:
            return frozenset()
        age_s = time.time() - info.saved_unix_s
        if not 0 <= age_s < idle_s:
            logger.info("the checkpoint was written %.0f s ago, more than net.membership.idle_s (%.0f s): the "
                        "composers it names as having worked count as any others do at a start", age_s, idle_s)
            return frozenset()
        return info.workers

    def _checkpoint(self) -> Path | None:
        """The checkpoint ``--resume`` names: with ``latest``, the newest sound one of ``--checkpoint-dir`` (those
        skipped are named in the log)."""
        settings = self.config.node
        if settings.resume is None:
            return None
        if settings.resume != "latest":
            return Path(settings.resume)
        if settings.checkpoint_dir is None:
            raise NodeError("--resume latest needs --checkpoint-dir (the folder the node checkpoints to)")
        found, skipped = sound_checkpoint(settings.checkpoint_dir)
        for folder, why in skipped:
            logger.warning("--resume latest: skipped %s: %s", folder.name, why)
        if found is None:
            raise NodeError(f"--resume latest: no sound checkpoint in {settings.checkpoint_dir}"
                            + "".join(f"; {f.name}: {why}" for f, why in skipped)
                            + "; start without --resume, or name a step-N folder")
        if skipped:
            logger.warning("--resume latest: resuming from %s, the newest sound checkpoint", found.name)
        self.telemetry.event("resume_from", path=str(found), skipped=[str(f) for f, _ in skipped])
        return found

    def _start_network(self, versions: dict[tuple[int, int], int], *, worked_before: bool = False,
                       workers: frozenset[str] = frozenset()) -> _Network:
        """DHT, membership, then the network loop, gossip, snapshot exchange and outer averagers: their
        averagers take seconds to start while the announcer thread settles the shard assignment.
        ``worked_before``: this identity resumes its own checkpoint of the run, so the others that saw its work give
        it the grace period of a restart, and it takes no probation (``Membership.enter_probation``). ``workers``:
        the composers its checkpoint names as having worked, counted until work reaches it (``Membership.remember``)."""
        c, cfg, stack, telemetry = self.config, self.config.train, self._stack, self.telemetry
        # torch's optimizers import torch._dynamo (1-2 s) when the first is built: do it while the DHT starts.
        manifest = peer_manifest(c.peer, self.identity, run_settings(cfg), self._tokenizer.digest, self._corpus)
        assert manifest is not None  # a composer always trains by one
        admission = peer_admission(c.peer, self.identity, manifest)
        dht = start_dht(self.identity, c.peer, identity_path=c.peer.identity_path("node"),
                        n_layers=cfg.model.n_layers, admission=admission, extra_groups=run_replica_groups(cfg),
                        while_starting=lambda: importlib.import_module("torch._dynamo"))
        stack.callback(dht.shutdown)
        telemetry.status.peer_id = dht.peer_id
        telemetry.status.run_digest = manifest.digest_hex
        telemetry.status.join_command = dht.join_command()
        telemetry.event("dht_started", join=telemetry.status.join_command, run_digest=manifest.digest_hex,
                        admission=manifest.admission)
        membership = Membership(dht, self.identity, Presence(run_id=c.peer.run_id, role="composer", manifest=manifest),
                                c.net.membership,
                                shards=ShardConfig(n_layers=cfg.model.n_layers, n_experts=cfg.model.n_experts,
                                                  replicas=cfg.ownership.replicas))
        if worked_before:
            membership.shown_work()
        membership.remember(workers)
        membership.start()
        stack.callback(_leave_quietly, membership)
        if self._observer is not None:
            self._observer.view_source = membership.view
        self._online_at = time.monotonic()
        scores = PeerScores(on_ban=lambda peer, reasons: telemetry.event("banned", peer=peer, reasons=reasons),
                            own_link_doubtful=lambda: membership.view().quorum is not QuorumState.HELD)
        views = SwarmViews(membership, self.identity.fingerprint, c.node.snapshot_every, telemetry.event, scores)
        loop = NetworkLoop(dht, "parallax-net")
        stack.callback(loop.close)
        views.prover = IdentityProver(loop.p2p, loop.loop, c.peer.run_id, self.identity, dht.peer_id).start()
        stack.callback(views.prover.close)
        stack.callback(Redialer(loop.p2p, loop.loop, dht.peer_id, views.peer_addresses).start().close)
        membership.ignored = views.ignored
        shapes = model_shapes(cfg)
        gossip = SurrogateGossip(dht, self.identity, c.net.gossip, run_id=c.peer.run_id,
                                 n_layers=cfg.model.n_layers, shapes=shapes.surrogate, owner_of=views.owner_key,
                                 start_versions=versions, loop=loop.loop).start()
        stack.callback(gossip.close)
        initial = InitialWeights(shapes.init, cfg.seed)  # heirs draw the experts' initial weights on worker threads
        exchange = ExpertExchange(loop.p2p, loop.loop, c.peer.run_id, shapes.expert, identity=self.identity,
                                  key_of=views.public_key_of, surrogate_shapes=shapes.surrogate,
                                  heir_targets=views.heir_targets, snapshot_every=c.node.snapshot_every,
                                  may_fetch=views.may_fetch, config=c.net.exchange,
                                  initial_weights=lambda e: initial(expert_prefix(*e)),
                                  chains=cfg.ownership.replicas == 1).start()
        stack.callback(exchange.close)
        gather = OuterGather(loop.p2p, loop.loop, c.peer.run_id).start()
        gather.answered = views.heard  # each answer of a peer itself: its side of any cut (``Membership.heard``)
        stack.callback(gather.close)
        # A peer's declared tokens count up to what the schedule lets one composer process in a round.
        caps = {g: float(cfg.batch_size * cfg.model.seq_len * p) for g, p in cfg.sync.periods.items()}
        sync = TieredOuterSync(dht, c.peer.run_id, shapes.groups, outer_sync_config(c),
                               signer=FingerprintSigner(self.identity, views.public_key_of), gather=gather,
                               peers=RoundPeers(views.composer_peers, views.working_peers, views.worked, views.vouched),
                               weight_caps=caps, scores=scores)
        stack.callback(sync.shutdown)
        # An open run's merged state is anyone's who joins it; a private run's goes to its live members only.
        states = StateExchange(loop.p2p, loop.loop, c.peer.run_id, views.trusted_peers, own_peer_id=dht.peer_id,
                               may_fetch=views.may_fetch if admission is not None
                               else lambda peer: not views.banned(peer)).start()
        stack.callback(states.close)
        return _Network(dht, membership, views, loop, gossip, exchange, sync, scores, states, gather)

    def _start_offload(self, net: _Network, composer: Composer) -> OffloadSession:
        c = self.config
        client = OffloadClient(net.loop.p2p, net.loop.loop, c.peer.run_id, self.identity, net.views.public_key_of,
                               onboard_timeout_s=c.net.exchange.timeout_s, update_timeout_s=c.net.exchange.timeout_s)
        net.views.settings_digest = settings_digest(c.train)
        session = OffloadSession(composer, client, c.peer.run_id, net.views.live_workers, event=self.telemetry.event)
        self._stack.callback(session.close)
        return session

    def _wait_for_shard(self, membership: Membership) -> tuple[dict[int, frozenset[int]], bool]:
        """Wait until the live assignment has us in it and what it gives us has been stable for a moment, or,
        joining a swarm that already trains, until we see it (a joiner starts owning nothing, in probation
        (``Membership.enter_probation``), and takes its experts over at its seams once that ends, so the assignment
        need not have settled). What it gives us may be nothing: a
        swarm of more composers than experts has composers that own none, and they train the shared groups with
        every expert's surrogate until the swarm shrinks.

        Returns:
            (the experts offered, whether this node joins a running swarm). It joins one when a composer was
            already training when this node first saw it and at least ``min_peers`` others were there: peers
            started together (waiting for ``min_peers`` composers, this one among them) are not joiners, even
            when this node's first view of them comes after their first steps.
        """
        settings = self.config.node
        deadline = time.monotonic() + settings.start_timeout_s
        settle = 2 * membership.timing.refresh_s + 0.5
        first_seen_step: dict[str, int] = {}
        while True:
            if self.stop_event.is_set():
                raise NodeError("stopped before training began")
            owned = membership.owned()
            view = membership.view()
            for fp, m in view.alive().items():
                if fp != self.identity.fingerprint and m.heartbeat.role == "composer":
                    first_seen_step.setdefault(fp, m.heartbeat.step)
            # A node in probation is a composer of the swarm, though it takes no experts yet.
            peers = len(view.composers()) + (membership.probation and self.identity.fingerprint not in view.composers())
            if peers <= 1 and membership.foreign and time.monotonic() - self._online_at >= settle:
                raise NodeError(_other_settings(self.config.peer.run_id, membership))
            stable = time.monotonic() - membership.owned_changed_at >= settle
            # Peers that waited for min_peers composers counting this one started because of it: it is one of them
            # even if its first view of them comes after their first steps.
            running = any(step > 0 for step in first_seen_step.values()) and len(first_seen_step) >= settings.min_peers
            if running or (membership.joins_training(view) and not membership.assigned()):
                # A node whose first read did not show the training composers: its probation begins now.
                membership.enter_probation()
            if peers >= settings.min_peers and ((membership.assigned() and stable) or running or membership.probation):
                return owned, running
            if time.monotonic() > deadline:
                raise NodeError(f"not in the swarm's shard assignment within {settings.start_timeout_s:.0f} s "
                                f"({peers} live composers seen, {settings.min_peers} wanted{_staleness(membership)}); "
                                "check --initial-peers and --run-id")
            self.telemetry.phase(f"waiting for peers ({peers}/{settings.min_peers})")
            self.stop_event.wait(0.1)


def _staleness(membership: Membership) -> str:
    """What a start-up error adds when this node's view of the members is old: it counted what it last read."""
    read_at, timing = membership.view().read_at, membership.timing
    if read_at <= 0:
        return (f"; no read of the members answered within {timing.request_timeout_s:g} s: the peers are "
                "unreachable, or this host is too loaded to serve its DHT process")
    age = dht_time() - read_at
    if age <= timing.heartbeat_ttl_s:
        return ""
    return (f"; the last read of the members that answered is {age:.0f} s old, later ones took longer than "
            f"{timing.request_timeout_s:g} s: this host may be too loaded to serve its DHT process")


def _other_settings(run_id: str, membership: Membership) -> str:
    """Why this node cannot join: every live composer of the run trains by another manifest than it."""
    foreign = sorted(membership.foreign.values(), key=lambda m: m.fingerprint)
    first = foreign[0]
    return (f"run {run_id} trains with other settings than this node ({len(foreign)} composer(s), e.g. "
            f"{first.fingerprint}): {membership.foreign_difference(first)}. Start with the run's manifest "
            f"(parallax run fetch --run-id {run_id} --initial-peers ... --out run.json, then --manifest run.json) "
            "or its settings and corpus (the same --preset, --config, --set and --data as its composers), or choose "
            "another --run-id")


def _leave_quietly(membership: Membership) -> None:
    """The deathrattle at shutdown, unless the node already left (a failed DHT write is no reason to stop)."""
    if membership.state is not PeerState.STOPPED:
        try:
            membership.leave("shutting down")
        except Exception as e:
            logger.debug("leave during close: %r", e)


def fast_forward(composer: Composer, step: int) -> None:
    """Take the swarm's step count (round numbers, learning-rate schedule) when joining a running swarm, and go on
    drawing batches from there: an identity that trained before, without the checkpoint that would say how far,
    draws none it drew then, and the draw counts its claims name grow past those its peers audited of it."""
    if step <= composer.step:
        return
    composer.step = step
    composer.follow_schedule(step)
    composer.sampler.step = max(composer.sampler.step, step)


@dataclass(frozen=True)
class ModelShapes:
    """Tensor shapes a node needs before it has a composer (name -> shape)."""

    groups: dict[str, dict[str, tuple[int, ...]]]
    """group -> tensors of each shared group a composer merges, in its anchors' order."""
    surrogate: dict[str, tuple[int, ...]]
    expert: dict[str, tuple[int, ...]]
    init: InitPlan
    """What the initialisation draws (``MoETransformer.init_plan``): any expert's initial weights, on any thread."""


def model_shapes(cfg: TrainConfig) -> ModelShapes:
    """Read from a model of ``cfg`` that owns no expert (and one expert module), so the shapes are the model's."""
    model = MoETransformer(cfg.model, ownership_of({}, cfg.model.n_layers), cfg.surrogate.non_owned, seed=cfg.seed)
    groups = {g: {n: tuple(p.shape) for n, p in model.group_parameters(g).items()}
              for g in SHARED_GROUPS if model.group_parameters(g)}
    surrogate = {n: tuple(p.shape) for n, p in model.surrogate_parameters(0, 0).items()}
    expert = {n: tuple(p.shape) for n, p in SwiGLU(cfg.model.d_latent, cfg.model.d_expert).named_parameters()}
    return ModelShapes(groups, surrogate, expert, model.init_plan())


__all__ = ["Node", "NodeStatus", "model_shapes"]
