"""A hostile composer for ``parallax bench attacks``, written as an attacker would write one against the open
source: the stock node with one behaviour changed (a function replaced before it starts), or a stock node beside
identities and clients doing what a node never does.

    python -m parallax.benchmarks.attacker ATTACK IDS.json node join ARGS...

runs ``parallax node join ARGS...`` with ``ATTACK`` (one of ``ATTACKS``) in effect. Once the node's membership
has started, the peer ids and fingerprints the attacker speaks with (its node's, and those of any identities it
made up) are written to ``IDS.json``: the benchmark looks for them in the honest nodes' bans and logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import runpy
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("parallax.attacker")


@dataclass
class Attacker:
    """What an attack's side activities may use: the attacked node's membership, and where to write ids."""

    ids_path: Path
    run_id: str
    initial_peers: list[str]
    membership: Any = None
    peer_ids: list[str] = field(default_factory=list)
    fingerprints: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def write_ids(self) -> None:
        self.ids_path.write_text(json.dumps({"peer_ids": self.peer_ids, "fingerprints": self.fingerprints}))

    def honest_peer_ids(self) -> list[str]:
        """The libp2p peer ids of the other composers in the attacked node's view."""
        own = set(self.peer_ids)
        return sorted({m.heartbeat.peer_id for m in self.membership.view().alive().values()
                       if m.heartbeat.role == "composer" and m.heartbeat.peer_id not in own})


@dataclass(frozen=True)
class Attack:
    """One attack: ``patch`` runs before the node starts; ``side`` runs in a thread once its membership started;
    ``node_args`` are added to the node's arguments."""

    description: str
    patch: Callable[[Attacker], None] | None = None
    side: Callable[[Attacker], None] | None = None
    node_args: tuple[str, ...] = ()
    colluders: int = 1
    """Attacking composers in a run, each its own process running this attack."""
    composes: bool = True
    """Whether its node is a composer of the attacked run: the composers that start with it wait for it, so that
    every run begins from the same shard assignment."""
    crafts: bool = False
    """Whether it changes what its node contributes to outer rounds (the bodies, or the tokens declared for them).
    A merge is judged by how well it points along its honest senders' update (``attacks.merge_harm``): the senders
    of an attack that crafts nothing send honest contributions, and count among them, as their places do in a clean
    run."""


# --- outer-round contributions ---


def _offering(change: Callable[[Any, dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Every contribution the node offers is ``change(rounds, delta)`` of what it would offer (``rounds``: the
    group's ``GatheredRounds``), whatever the run's aggregation: the body or blocks the others fetch and the digest
    announced for them, both."""
    from parallax.node.outer.gathered import GatheredRounds

    honest = GatheredRounds._offer

    @functools.wraps(honest)
    def offer(self: Any, n: int, delta: Any) -> Any:
        return honest(self, n, change(self, dict(delta)))

    GatheredRounds._offer = offer  # type: ignore[method-assign]


def _tamper_contributions(change: Callable[[str, torch.Tensor], torch.Tensor]) -> Callable[[Attacker], None]:
    """Every contribution the node serves is ``change(name, tensor)`` of the honest one (``_offering``)."""

    def patch(_: Attacker) -> None:
        _offering(lambda _rounds, delta: {name: change(name, t) for name, t in delta.items()})

    return patch


def alie_z(composers: int, colluders: int) -> float:
    """How many standard deviations ALIE ("A Little Is Enough", Baruch et al. 2019) moves from the honest mean: the
    most that leaves the colluders' vector nearer the mean than ``s`` of the honest ones, ``s = composers // 2 + 1 -
    colluders`` (the honest votes a majority-based rule still needs from them): ``Phi^-1((composers - s) /
    composers)`` (0.32 for 2 of 8, 0 for 1 of 4)."""
    s = max(1, composers // 2 + 1 - colluders)
    return statistics.NormalDist().inv_cdf(min((composers - s) / composers, 1 - 1e-9)) if composers > s else 0.0


def alie(colluders: int) -> Callable[[list[torch.Tensor], int], torch.Tensor]:
    """ALIE's vector from the colluders' honest tensors: their mean less ``alie_z`` of their standard deviation,
    coordinate by coordinate (their own honest one while only one is known)."""

    def craft(honest: list[torch.Tensor], composers: int) -> torch.Tensor:
        stacked = torch.stack(honest)
        mean = stacked.mean(dim=0)
        if len(honest) < 2:
            return mean
        return mean - alie_z(composers, colluders) * stacked.std(dim=0)

    return craft


def inner_product_manipulation(epsilon: float) -> Callable[[list[torch.Tensor], int], torch.Tensor]:
    """Inner-product manipulation (Xie et al. 2020): ``-epsilon`` times the colluders' honest mean, a short vector
    against the honest direction that no norm bound and no median stands out from."""

    def craft(honest: list[torch.Tensor], _composers: int) -> torch.Tensor:
        return -epsilon * torch.stack(honest).mean(dim=0)

    return craft


def _colluding(craft: Callable[[list[torch.Tensor], int], torch.Tensor]) -> Callable[[Attacker], None]:
    """Colluders that each train honestly and share their honest pseudo-gradients through a folder beside their ids
    (the channel a group of attackers has among themselves; here the run's folder). Each sends, tensor by tensor,
    ``craft(honest, composers)``: its own honest tensor and the other colluders' latest of it, and how many composers
    its view holds; computed from nearly the same tensors, the colluders' bodies nearly agree, and vouch for each
    other in every median."""

    def patch(attacker: Attacker) -> None:
        folder = attacker.ids_path.parent / "colluders"
        folder.mkdir(exist_ok=True)
        me = attacker.ids_path.stem

        def tampered(_rounds: Any, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            group = hashlib.sha256("\0".join(sorted(delta)).encode()).hexdigest()[:12]  # one file per shared group
            own = {name: t.detach().to(torch.float32).clone() for name, t in delta.items()}
            written = folder / f".{group}-{me}.tmp"
            torch.save(own, written)
            written.replace(folder / f"{group}-{me}.pt")
            held = [own]
            for path in sorted(folder.glob(f"{group}-*.pt")):
                if path.stem != f"{group}-{me}":
                    with contextlib.suppress(Exception):  # one being replaced is read at the next round
                        theirs = torch.load(path, weights_only=True)
                        if theirs.keys() == own.keys() and all(theirs[n].shape == t.shape for n, t in own.items()):
                            held.append(theirs)
            view = attacker.membership.view() if attacker.membership is not None else None
            composers = (sum(1 for m in view.alive().values() if m.heartbeat.role == "composer")
                         if view is not None else len(held))
            return {name: craft([h[name] for h in held], composers).to(t.dtype) for name, t in delta.items()}

        _offering(tampered)

    return patch


def _nan_contributions(one: bool) -> Callable[[Attacker], None]:
    """Contributions with NaN values, packed by hand (the stock encoders refuse non-finite tensors): with ``one``, a
    single tensor of a whole body (a gathered round) or a single block, drawn at random, of a body in blocks (a
    partitioned one: only the peers that fetch that block see it); else every tensor, every block."""

    def patch(_: Attacker) -> None:
        import random

        import msgpack
        import numpy as np

        from parallax.node.outer import gathered
        from parallax.node.outer.blocks import BlockedBody, block_layout
        from parallax.protocol import codec

        def nan(shape: tuple[int, ...]) -> bytes:
            return codec._pack("raw", "float32", shape, [], np.full(shape, np.nan, dtype="<f4").tobytes())

        def raw(t: torch.Tensor) -> bytes:
            array = t.detach().to(torch.float32).numpy()
            return codec._pack("raw", "float32", tuple(array.shape), [], array.astype("<f4").tobytes())

        def poisoned(delta: Any, compression: str) -> bytes:
            bad = random.choice(sorted(delta)) if one else None
            return msgpack.packb({name: nan(tuple(t.shape)) if bad in (None, name) else raw(t)
                                  for name, t in delta.items()}, use_bin_type=True)

        honest_blocks = gathered.encode_blocks

        def poisoned_blocks(delta: Any, compression: str) -> BlockedBody:
            shapes = {name: tuple(t.shape) for name, t in delta.items()}
            layout = block_layout(shapes)
            blobs = list(honest_blocks(delta, compression).blobs) if one else [b""] * len(layout)
            for i in [random.randrange(len(layout))] if one else range(len(layout)):
                blobs[i] = nan((layout[i].stop - layout[i].start, *shapes[layout[i].name][1:]))
            return BlockedBody(tuple(blobs))

        def read_back(honest: Callable[..., Any]) -> Callable[..., Any]:
            def decode(body: Any, shapes: Any, *, peer: str) -> Any:  # its own body, read back before it is published
                try:
                    return honest(body, shapes, peer=peer)
                except Exception:
                    return {name: torch.zeros(tuple(shape)) for name, shape in shapes.items()}

            return decode

        gathered.encode_contribution, gathered.encode_blocks = poisoned, poisoned_blocks
        gathered.decode_contribution = read_back(gathered.decode_contribution)
        gathered.decode_all = read_back(gathered.decode_all)

    return patch


def _random_direction(name: str, t: torch.Tensor) -> torch.Tensor:
    noise = torch.randn_like(t)
    return noise * (10 * torch.linalg.vector_norm(t) / torch.linalg.vector_norm(noise).clamp_min(1e-12))


def _replay(patch_state: dict[str, torch.Tensor]) -> Callable[[str, torch.Tensor], torch.Tensor]:
    def change(name: str, t: torch.Tensor) -> torch.Tensor:
        return patch_state.setdefault(name, t.clone())  # the first pseudo-gradient of each tensor, forever

    return change


def _declared_weight(weight: float) -> Callable[[Attacker], None]:
    def patch(_: Attacker) -> None:
        from parallax.node.outer.gathered import GatheredRounds

        honest = GatheredRounds.run

        @functools.wraps(honest)
        def run(self: Any, delta: Any, tokens: float, *args: Any, **kwargs: Any) -> Any:
            return honest(self, delta, weight, *args, **kwargs)

        GatheredRounds.run = run  # type: ignore[method-assign]

    return patch


SERVING = ("rpc_contribution", "rpc_blocks")
"""The handlers that answer fetches of a node's outer contributions: whole bodies, and blocks of them."""


def _serving(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Every handler in ``SERVING`` replaced by ``wrap`` of the honest one."""
    from parallax.node.outer.transport import ContributionServicer

    for name in SERVING:
        setattr(ContributionServicer, name, wrap(getattr(ContributionServicer, name)))


def _held_fetches(_: Attacker) -> None:
    """Every fetch of its outer contributions (bodies or blocks) is accepted and held open for an hour, not a byte
    sent: the rounds of everyone who gathers its contribution wait on it."""

    def wrap(honest: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(honest)  # hivemind reads the handler's types through __wrapped__
        async def held(self: Any, request: Any, context: Any) -> Any:
            await asyncio.sleep(3600)
            for _ in ():
                yield None

        return held

    _serving(wrap)


def _trickled_fetches(_: Attacker) -> None:
    """Every fetch of its outer contributions is answered a few bytes at a time, each message just inside the
    loopback profile's wait for the next one (``net.outer.next_chunk_timeout_s``): the answer never stalls, and it
    never ends within a fetch's overall bound either (a late upload that is never late enough to be called held)."""
    from hivemind.proto import runtime_pb2

    from parallax.node.config.net import OuterConfig

    pause_s = 0.8 * OuterConfig.loopback().next_chunk_timeout_s

    def wrap(honest: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(honest)  # hivemind reads the handler's types through __wrapped__
        async def trickled(self: Any, request: Any, context: Any) -> Any:
            async for message in honest(self, request, context):
                body = message.serialized_info
                for start in range(0, len(body), 64):
                    await asyncio.sleep(pause_s)
                    yield runtime_pb2.ExpertInfo(serialized_info=body[start:start + 64])

        return trickled

    _serving(wrap)


_ROUNDS: dict[str, Any] = {}
"""group -> the attacked node's gathered rounds of it (``_capture_rounds``)."""


def _capture_rounds(_: Attacker) -> None:
    """Keep each gathered rounds instance the node makes in ``_ROUNDS`` (what a side activity reads its rounds from)."""
    from parallax.node.outer.gathered import GatheredRounds

    honest_init = GatheredRounds.__init__

    @functools.wraps(honest_init)
    def init(self: Any, records: Any, *args: Any, **kwargs: Any) -> None:
        honest_init(self, records, *args, **kwargs)
        _ROUNDS[records.group] = self

    GatheredRounds.__init__ = init  # type: ignore[method-assign]


def _equivocation(attacker: Attacker) -> None:
    """After the first fetch of each round's contribution (its body, or blocks of it), signs a claim of another
    body for the same round (the body x1.5, its session unchanged) and serves that one: every fetcher's digest
    check passes, on a body of its own."""
    from parallax.node.outer.blocks import BlockedBody, decode_all, encode_blocks, parse_wanted
    from parallax.node.outer.transport import (
        RoundEntry,
        body_digest,
        decode_contribution,
        encode_contribution,
        encode_record,
    )
    from parallax.node.outer.witness import sign

    switched: set[tuple[str, int]] = set()

    def switch(group: str, n: int) -> None:
        gathered = _ROUNDS.get(group)  # None for a partitioned round's merged blocks: those are not its claim
        if gathered is None or gathered.records.signer is None or n not in gathered._entries:
            return
        entry, body = gathered._entries[n], gathered.gather.store.get(group, n)
        wire, shapes, me = gathered.config.compression, gathered.shapes, gathered.peer_id
        other: BlockedBody | bytes
        if isinstance(body, BlockedBody):
            blocked = encode_blocks({k: 1.5 * t for k, t in decode_all(body, shapes, peer=me).items()}, wire)
            other, digest, size = blocked, blocked.digest, blocked.size
        elif isinstance(body, bytes):
            whole = encode_contribution({k: 1.5 * t for k, t in decode_contribution(body, shapes, peer=me).items()},
                                        wire)
            other, digest, size = whole, body_digest(whole), len(whole)
        else:
            return
        gathered.gather.store.put(group, n, other)
        claim = RoundEntry(n, digest, size, entry.tokens, session=entry.session, base=entry.base, drawn=entry.drawn)
        # The round's entry replaced in place (its thread publishes it again later), and the record stored now.
        gathered._entries[n] = sign(gathered.records.signer.identity, gathered.records.run_id, group, claim)
        entries = dict(gathered._entries)
        gathered.records.store(encode_record([entries[k] for k in sorted(entries)]))

    def asked(uid: str) -> tuple[str, int] | None:
        """(group, round) of a fetch of a body (``group/n``) or of blocks of one (``group/n/i,j``)."""
        blocks = parse_wanted(uid)
        if blocks is not None:
            return blocks[0], blocks[1]
        group, _, n = uid.rpartition("/")
        return (group, int(n)) if n.isdigit() and len(n) <= 18 else None

    def wrap(honest: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(honest)  # hivemind reads the handler's types through __wrapped__
        async def equivocating(self: Any, request: Any, context: Any) -> Any:
            async for part in honest(self, request, context):
                yield part
            round_of = asked(request.uid)
            if round_of is not None and round_of not in switched:
                switched.add(round_of)
                asyncio.get_running_loop().run_in_executor(None, switch, *round_of)

        return equivocating

    _capture_rounds(attacker)
    _serving(wrap)


def _late_uploads(_: Attacker) -> None:
    """Every contribution is offered late: the node trains honestly, then holds each round's contribution back for
    the others' whole wait for the contributions still missing (``net.min_matchmaking_time_s``) before it offers it,
    so that it arrives at the edge of every round the others run."""

    def late(rounds: Any, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(rounds.config.net.min_matchmaking_time_s)
        return delta

    _offering(late)


def _copied_work(_: Attacker) -> None:
    """A free rider: its optimizer steps nothing (its experts never train; only merges move its shared groups), and
    each contribution it offers is the newest contribution of another composer it has seen, fetched whole from that
    composer and sent with 1% noise (no two bodies alike bit for bit), under its own signed claim; an all-zero one
    while it has none to copy. (What it offers is not its own pseudo-gradient: the wire's error feedback keeps the
    difference, which it never sends.)"""
    from parallax.node.outer.blocks import assemble, block_layout, decode_block
    from parallax.node.outer.gathered import GatheredRounds
    from parallax.node.outer.transport import decode_contribution, split_pair
    from parallax.node.train.composer import Composer

    honest_step = Composer.optimizer_step

    @functools.wraps(honest_step)
    def optimizer_step(self: Any) -> None:
        for optimizer in self._optimizers():
            optimizer.zero_grad(set_to_none=True)  # the optimizers step only the parameters that have a gradient
        honest_step(self)

    Composer.optimizer_step = optimizer_step  # type: ignore[method-assign]

    newest: dict[str, tuple[str, Any]] = {}  # group -> (peer, claim): the newest claim of another composer checked
    honest_fetch = GatheredRounds._fetch

    @functools.wraps(honest_fetch)
    def fetch(self: Any, name: str, entry: Any) -> Any:
        got = honest_fetch(self, name, entry)
        peer = split_pair(name)[0]
        held = newest.get(self.group)
        if got is not None and peer != self.peer_id and (held is None or entry.round_id >= held[1].round_id):
            newest[self.group] = (peer, entry)
        return got

    def copied(self: Any) -> dict[str, torch.Tensor] | None:
        if self.group not in newest:
            return None
        peer, entry = newest[self.group]
        timeout = self.config.net.allreduce_timeout_s
        if self.parts is None:
            return decode_contribution(self.gather.fetch(peer, self.group, entry, timeout), self.shapes, peer=peer)
        layout = block_layout(self.shapes)
        answer = self.gather.fetch_blocks(peer, self.group, entry.round_id, entry.digest, entry.size,
                                          list(range(len(layout))), len(layout), timeout)
        return assemble({i: decode_block(answer.blobs[i], b, self.shapes[b.name], peer=peer)
                         for i, b in enumerate(layout)}, self.shapes)

    def offered(rounds: Any, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        try:
            theirs = copied(rounds)
        except Exception as e:  # not served (any more): nothing to copy this round
            logger.info("copying a contribution failed: %r", e)
            theirs = None
        if theirs is None:
            return {name: torch.zeros_like(t) for name, t in delta.items()}
        return {name: t + 0.01 * torch.linalg.vector_norm(t) / math.sqrt(max(1, t.numel())) * torch.randn_like(t)
                for name, t in theirs.items()}

    GatheredRounds._fetch = fetch  # type: ignore[method-assign]
    _offering(offered)


def _poisoned_state(_: Attacker) -> None:
    """Every group state this node serves to a joiner is its anchor x3."""
    from parallax.node.outer.state import StateExchange

    honest = StateExchange.serve

    def serve(self: Any, group: str, provider: Any) -> None:
        if provider is None:
            return honest(self, group, None)

        def poisoned() -> tuple[dict[str, Any], list[torch.Tensor]]:
            meta, tensors = provider()
            return meta, [3 * t for t in tensors]

        return honest(self, group, poisoned)

    StateExchange.serve = serve  # type: ignore[method-assign]


# --- surrogates, ownership, identities ---


def _surrogates_at_the_bound(_: Attacker) -> None:
    """Each surrogate delta the node publishes makes the receivers' copy just under ``MAX_GROWTH`` times longer
    than the one they hold (the attacker tracks what they hold): growth compounds refresh after refresh."""
    from parallax.node.model.lowrank import change_of
    from parallax.node.net import gossip

    honest = gossip.SurrogateGossip.publish
    held: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    factor = 0.95 * gossip.MAX_GROWTH

    def publish(self: Any, layer: int, expert: int, version: int, factors: Any, full: Any = None, *,
                step: int = 0) -> Any:
        if full is None:
            return honest(self, layer, expert, version, factors, full, step=step)
        eid = (layer, expert)
        theirs = held.setdefault(eid, {n: full[n] - change_of(f).reshape(full[n].shape) for n, f in factors.items()})
        scaled, new_full = {}, {}
        for name, (u, v) in factors.items():
            old = theirs[name]
            change = change_of((u, v)).reshape(old.shape)
            floor = gossip.GROWTH_FLOOR * math.sqrt(old.numel())
            scale = factor * max(float(old.norm()), floor) / max(float(change.norm()), 1e-12)
            scaled[name] = (u * scale, v)
            new_full[name] = old + scale * change
        held[eid] = new_full
        return honest(self, layer, expert, version, scaled, new_full, step=step)

    gossip.SurrogateGossip.publish = publish  # type: ignore[method-assign]


def _capacity(value: float) -> Callable[[Attacker], None]:
    def patch(_: Attacker) -> None:
        from parallax.dht import membership

        honest = membership.Membership.__init__

        def init(self: Any, dht: Any, identity: Any, presence: Any, *args: Any, **kwargs: Any) -> None:
            honest(self, dht, identity, replace(presence, capacity=value), *args, **kwargs)

        membership.Membership.__init__ = init  # type: ignore[method-assign]

    return patch


def _watch_membership(attacker: Attacker) -> None:
    """Remember the node's membership when it starts (every attack does: the side activities need it)."""
    from parallax.dht import membership

    honest = membership.Membership.start

    def start(self: Any, *args: Any, **kwargs: Any) -> None:
        honest(self, *args, **kwargs)
        if attacker.membership is None:
            attacker.membership = self
            attacker.peer_ids.append(str(self.dht.peer_id))
            attacker.fingerprints.append(self.identity.fingerprint)
            attacker.write_ids()

    membership.Membership.start = start  # type: ignore[method-assign]


class _PeerIdOf:
    """A DHT node whose heartbeats name someone else's libp2p peer id."""

    def __init__(self, dht: Any, peer_id: str) -> None:
        self._dht, self.peer_id = dht, peer_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dht, name)


def _phantom_class() -> type[Any]:
    """A ``Membership`` that never says it is in probation: a liar does not say it has shown no work."""
    from parallax.dht.membership import Membership

    class Phantom(Membership):
        def enter_probation(self) -> bool:
            return False

    return Phantom


def _extra_identities(count: int, *, squat: bool) -> Callable[[Attacker], None]:
    """``count`` more composers' heartbeats, each from a fresh key on a DHT node of its own, announcing the
    attacked node's step and settings: they train nothing. ``squat``: each names an honest node's libp2p peer id
    instead of its own."""

    def side(attacker: Attacker) -> None:
        from parallax.dht.adapter import DHTConfig, SwarmDHT
        from parallax.dht.keys import protected_keys
        from parallax.dht.records import Ed25519RecordValidator
        from parallax.node.config.train import SHARED_GROUPS
        from parallax.protocol.identity import Identity

        real, phantom_class = attacker.membership, _phantom_class()
        victims = attacker.honest_peer_ids() if squat else []
        if squat and not victims:
            logger.warning("no honest composer in view to squat on")
            return
        def start_dht(identity: Identity) -> SwarmDHT:
            validator = Ed25519RecordValidator(identity, protected_keys=protected_keys(
                attacker.run_id, real.shards.n_layers, SHARED_GROUPS), learn_protected=False)
            return SwarmDHT.start(DHTConfig(initial_peers=tuple(attacker.initial_peers),
                                            host_maddrs=("/ip4/127.0.0.1/tcp/0",)), [validator])

        identities = [Identity.generate() for _ in range(count)]
        with contextlib.ExitStack() as stack, ThreadPoolExecutor(count) as pool:
            dhts = list(pool.map(start_dht, identities))  # all at once: they appear together
            for dht in dhts:
                stack.callback(dht.shutdown)
            phantoms = []
            for i, (identity, dht) in enumerate(zip(identities, dhts, strict=True)):
                speaking: Any = _PeerIdOf(dht, victims[i % len(victims)]) if squat else dht
                phantom = phantom_class(speaking, identity, real.config, shards=real.shards)
                phantom.start()
                stack.callback(phantom.abandon, False)
                phantoms.append(phantom)
                attacker.fingerprints.append(identity.fingerprint)
                if not squat:
                    attacker.peer_ids.append(str(dht.peer_id))
            attacker.write_ids()
            while not attacker.stop.wait(1.0):
                for phantom in phantoms:
                    phantom.update(step=real._step, versions=real._versions)

    return side


def _signer_once_work_began(attacker: Attacker) -> Any:
    """Once work reached the attacked node: a DHT peer of the attacker's that signs for any key given to it
    (``ManyKeysValidator``, ``sign_for``); None when the attack stopped first."""
    from parallax.dht.adapter import DHTConfig, SwarmDHT
    from parallax.dht.keys import protected_keys
    from parallax.dht.testing import ManyKeysValidator
    from parallax.node.config.train import SHARED_GROUPS
    from parallax.protocol.identity import Identity

    real = attacker.membership
    while not real._progress.work_began and not attacker.stop.wait(0.5):
        pass
    if attacker.stop.is_set():
        return None
    validator = ManyKeysValidator([Identity.generate()], protected_keys=protected_keys(
        attacker.run_id, real.shards.n_layers, SHARED_GROUPS), learn_protected=False)
    dht = SwarmDHT.start(DHTConfig(initial_peers=tuple(attacker.initial_peers),
                                   host_maddrs=("/ip4/127.0.0.1/tcp/0",)), [validator])
    attacker.peer_ids.append(str(dht.peer_id))
    return dht


def _fresh_phantoms(count: int, renew_s: float) -> Callable[[Attacker], None]:
    """``count`` composers' heartbeats that appear once work reached the attacked node (a merged round), announcing
    its step and settings, all of them replaced by fresh keys every ``renew_s`` seconds; one DHT node of the
    attacker's signs for every key (a validator that signs each record with the key its subkey names)."""

    def side(attacker: Attacker) -> None:
        from parallax.dht.testing import sign_for
        from parallax.protocol.identity import Identity

        real, phantom_class = attacker.membership, _phantom_class()
        dht = _signer_once_work_began(attacker)
        if dht is None:
            return
        try:
            while not attacker.stop.is_set():
                identities = [Identity.generate() for _ in range(count)]
                sign_for(dht, identities)
                attacker.fingerprints.extend(identity.fingerprint for identity in identities)
                attacker.write_ids()
                phantoms = [phantom_class(dht, identity, real.config, shards=real.shards) for identity in identities]
                try:
                    for phantom in phantoms:
                        phantom.start()
                    until = time.monotonic() + renew_s
                    while time.monotonic() < until and not attacker.stop.wait(1.0):
                        for phantom in phantoms:
                            phantom.update(step=real._step, versions=real._versions)
                finally:
                    for phantom in phantoms:
                        phantom.abandon(wait=False)
        finally:
            dht.shutdown()

    return side


def unrun_peer_id(identity: Any) -> str:
    """A libp2p peer id for ``identity`` that nobody runs: the sha2-256 multihash of its key."""
    from hivemind.p2p import PeerID

    return str(PeerID(b"\x12\x20" + hashlib.sha256(identity.public_key).digest()).to_base58())


def forged_heartbeat(real: Any, identity: Any) -> bytes:
    """A composer's heartbeat for ``identity`` that copies what the attacked node announces (its step, versions,
    run and capacity) and names a libp2p peer id nobody runs (``unrun_peer_id``)."""
    from parallax.dht.adapter import dht_time
    from parallax.dht.membership import heartbeat_value
    from parallax.protocol.messages import Heartbeat

    peer_id = unrun_peer_id(identity)
    with real._lock:
        step, versions = real._step, dict(real._versions)
    return heartbeat_value(Heartbeat(peer_id=peer_id, addresses=(), role="composer", capacity=real.presence.capacity,
                                     shards=(), step=step, versions=versions, run=real.presence.run_digest,
                                     sent=dht_time()))


def _store_heartbeat(dht: Any, attacker: Attacker, identity: Any, ttl_s: float) -> bool:
    """Store a forged heartbeat of ``identity`` (``forged_heartbeat``) through ``dht`` for ``ttl_s``, in the members
    key's part each key's node reads at the attacked node's write levels; whether every part was stored."""
    from parallax.dht.adapter import dht_time
    from parallax.dht.keys import member_part, members_key
    from parallax.dht.records import owner_subkey

    real = attacker.membership
    keys = [members_key(attacker.run_id, level, member_part(identity.fingerprint, level))
            for level in sorted(real._write_levels)]
    stored = dht.store_many(keys, owner_subkey(identity.public_key), forged_heartbeat(real, identity),
                            dht_time() + ttl_s, timeout_s=10.0)
    return all(stored.values())


def _signed_heartbeats(count: int, *, ttl_s: float | None, keys_every_s: float | None) -> Callable[[Attacker], None]:
    """One DHT peer that signs for any key (``ManyKeysValidator``) writes ``count`` composers' heartbeats once work
    reached the attacked node, in the members key's part each key's node reads at the attacked node's write levels.
    ``ttl_s``: how long each lives (None: the attacked node's own TTL); they are written again every half of it when
    ``keys_every_s`` is None, else written once and replaced by ``count`` fresh keys every ``keys_every_s``."""

    def side(attacker: Attacker) -> None:
        from parallax.dht.testing import sign_for
        from parallax.protocol.identity import Identity

        real = attacker.membership
        ttl = ttl_s if ttl_s is not None else real._timing.heartbeat_ttl_s
        dht = _signer_once_work_began(attacker)
        if dht is None:
            return
        try:
            identities: list[Identity] = []
            fresh_at = 0.0
            while not attacker.stop.is_set():
                began = time.monotonic()
                if not identities or (keys_every_s is not None and began >= fresh_at):
                    identities, fresh_at = [Identity.generate() for _ in range(count)], began + (keys_every_s or 0.0)
                    sign_for(dht, identities)
                    attacker.fingerprints.extend(identity.fingerprint for identity in identities)
                    attacker.write_ids()
                elif keys_every_s is not None:  # written once: the next keys come at their time
                    attacker.stop.wait(fresh_at - began)
                    continue
                refused = 0
                for identity in identities:
                    if attacker.stop.is_set():
                        break
                    refused += not _store_heartbeat(dht, attacker, identity, ttl)
                if refused:
                    logger.warning("%d of %d forged heartbeats were not stored", refused, len(identities))
                if keys_every_s is None:
                    attacker.stop.wait(max(0.0, began + ttl / 2 - time.monotonic()))
        finally:
            dht.shutdown()

    return side


def sybil_records(identities: list[Any], run_id: str, group: str, entries: list[Any],
                  claims: dict[tuple[str, str], Any]) -> dict[str, bytes]:
    """fingerprint -> the rounds record of ``group`` each of ``identities`` keeps (``_vouching_sybils``): the newest
    round the attacked node merged (of its ``entries``; not one it withdrew), with its fingerprint, naming every one
    of the identities (each under a peer id nobody runs) as its senders, and each identity's claim of it, signed by
    its key. ``claims`` (fingerprint, group) -> the claim made: one claim per identity and round, the same each time
    it is written again (a second, different claim of a round would be an equivocation, another defence). Empty while
    the node merged nothing."""
    from parallax.node.outer.transport import WITHDRAWN, RoundEntry, encode_record, pair
    from parallax.node.outer.witness import new_session, sign

    merged = [e for e in entries if e.fingerprint and e.fingerprint != WITHDRAWN]
    if not merged:
        return {}
    latest = max(merged, key=lambda e: e.round_id)
    n = latest.round_id
    named = tuple(sorted(pair(unrun_peer_id(identity), n) for identity in identities))
    out = {}
    for identity in identities:
        held = claims.get((identity.fingerprint, group))
        if held is None or held.round_id != n:
            held = claims[(identity.fingerprint, group)] = sign(identity, run_id, group, RoundEntry(
                n, hashlib.sha256(identity.public_key + group.encode() + n.to_bytes(8, "big")).digest(), latest.size,
                latest.tokens, session=new_session(), base=latest.base))
        out[identity.fingerprint] = encode_record([replace(held, fingerprint=latest.fingerprint,
                                                              participants=named)])
    return out


def _vouching_sybils(count: int) -> Callable[[Attacker], None]:
    """``count`` composers' heartbeats from fresh keys once work reached the attacked node (as ``_signed_heartbeats``,
    renewed every half TTL, at most every 10 s), each with a rounds record of every shared group that names all of
    them as the senders of a round the node merged (``sybil_records``). Each Sybil is then named by the records of
    ``count - 1`` others, as an honest composer is by the records of the peers that merged its contributions; the
    sets they name hold no honest contribution, so no honest node would merge them."""

    def side(attacker: Attacker) -> None:
        from parallax.dht.adapter import dht_time
        from parallax.dht.records import owner_subkey
        from parallax.dht.testing import sign_for
        from parallax.protocol.identity import Identity

        real = attacker.membership
        ttl = real._timing.heartbeat_ttl_s
        dht = _signer_once_work_began(attacker)
        if dht is None:
            return
        try:
            identities = [Identity.generate() for _ in range(count)]
            sign_for(dht, identities)
            attacker.fingerprints.extend(identity.fingerprint for identity in identities)
            attacker.peer_ids.extend(unrun_peer_id(identity) for identity in identities)
            attacker.write_ids()
            keys_of = {identity.fingerprint: identity.public_key for identity in identities}
            claims: dict[tuple[str, str], Any] = {}
            while not attacker.stop.is_set():
                began = time.monotonic()
                for identity in identities:
                    _store_heartbeat(dht, attacker, identity, ttl)
                for rounds in list(_ROUNDS.values()):
                    records = sybil_records(identities, attacker.run_id, rounds.group,
                                            list(rounds._entries.values()), claims)
                    for fingerprint, record in records.items():
                        dht.store(rounds.records.key, owner_subkey(keys_of[fingerprint]), record,
                                  dht_time() + rounds.config.net.fingerprint_ttl_s, timeout_s=10.0)
                attacker.stop.wait(max(0.0, began + min(ttl / 2, 10.0) - time.monotonic()))
        finally:
            dht.shutdown()

    return side


# --- the DHT and the streams ---


def _plain_values(attacker: Attacker) -> None:
    """A stock hivemind client writes plain values with a one-hour expiry under every key of the run, again and
    again (with and without subkeys)."""
    import hivemind
    from hivemind.utils import get_dht_time

    from parallax.dht.keys import protected_keys
    from parallax.node.config.train import SHARED_GROUPS

    client = hivemind.DHT(initial_peers=attacker.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        attacker.peer_ids.append(str(client.peer_id))
        attacker.write_ids()
        keys = protected_keys(attacker.run_id, attacker.membership.shards.n_layers, SHARED_GROUPS)
        while not attacker.stop.is_set():
            expiry = get_dht_time() + 3600
            for key in keys:
                client.store(key, b"plain", expiry)
                client.store(key, b"plain", expiry, subkey=b"squat")
            attacker.stop.wait(5.0)
    finally:
        client.shutdown()


async def announce_huge(p2p: Any, peer_id: Any, handle: str, sent: int) -> bytes:
    """Open a stream to ``handle`` at ``peer_id``, announce a 256 MiB message in hivemind's framing (a message
    marker, an 8-byte length), send ``sent`` bytes of it, and read what comes back until the server closes the
    stream (b"" when it drops it)."""
    _, reader, writer = await p2p._client.stream_open(peer_id, (handle,))
    chunk = b"x" * 2**20
    try:
        writer.write(b"\x00" + (256 * 2**20).to_bytes(8, "big"))
        for _ in range(sent // len(chunk)):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass  # the server already dropped the stream
    try:
        return await asyncio.wait_for(reader.read(), timeout=30)  # without a cap: no answer, a timeout
    except ConnectionError:  # reset or broken pipe: the server dropped the stream
        return b""
    finally:
        writer.close()


def _oversized_streams(attacker: Attacker) -> None:
    """Every few seconds, to every honest composer's every handler: a stream announcing 256 MiB, 16 MiB sent."""
    from hivemind.p2p import PeerID

    from parallax.node.net.expert_exchange import ExpertServicer
    from parallax.node.net.gossip import SurrogateServicer
    from parallax.node.net.network import NetworkLoop
    from parallax.node.net.whoami import IdentityServicer
    from parallax.node.outer.state import StateServicer
    from parallax.node.outer.transport import ContributionServicer

    run = attacker.run_id
    handles = [*(ContributionServicer._get_handle_name(f"parallax.{run}.outer", name) for name in SERVING),
               StateServicer._get_handle_name(f"parallax.{run}.state", "rpc_state"),
               ExpertServicer._get_handle_name(f"parallax.{run}.experts", "rpc_snapshot"),
               SurrogateServicer._get_handle_name(f"parallax.{run}.surrogates", "rpc_fetch"),
               IdentityServicer._get_handle_name(f"parallax.{run}.whoami", "rpc_whoami")]
    loop = NetworkLoop(attacker.membership.dht, "attacker")
    try:
        while not attacker.stop.is_set():
            for peer in attacker.honest_peer_ids():
                for handle in handles:
                    with contextlib.suppress(Exception):
                        loop.run(announce_huge(loop.p2p, PeerID.from_base58(peer), handle, 16 * 2**20), 45)
            attacker.stop.wait(2.0)
    finally:
        loop.close()


ATTACKS: dict[str, Attack] = {
    "scale-1000": Attack("its outer pseudo-gradient x1000",
                         _tamper_contributions(lambda _, t: 1000 * t), crafts=True),
    "scale-neg10": Attack("its outer pseudo-gradient x(-10)", _tamper_contributions(lambda _, t: -10 * t), crafts=True),
    "random-10x": Attack("a random direction at 10x its pseudo-gradient's norm",
                         _tamper_contributions(_random_direction), crafts=True),
    "nan": Attack("NaN pseudo-gradients", _nan_contributions(one=False), crafts=True),
    "nan-block": Attack("one block of each pseudo-gradient NaN, drawn at random (a gathered round's body: one tensor)",
                        _nan_contributions(one=True), crafts=True),
    "weight-1e12": Attack("declares 1e12 tokens per round", _declared_weight(1e12), crafts=True),
    "stale-replay": Attack("replays its first pseudo-gradient in every round", _tamper_contributions(_replay({})),
                           crafts=True),
    "held-fetches": Attack("accepts every fetch of its outer contributions and sends nothing", _held_fetches),
    "trickled-fetches": Attack("answers every fetch of its outer contributions 64 bytes at a time, each just inside "
                               "the wait for the next message", _trickled_fetches),
    "equivocation": Attack("signs a second, different contribution for each round after its first fetch",
                           _equivocation, crafts=True),
    "late-uploads": Attack("trains honestly and offers each contribution only after the others' whole wait for "
                           "missing contributions", _late_uploads),
    "copied-work": Attack("trains nothing and offers another composer's newest contribution, plus 1% noise, as its "
                          "own", _copied_work, crafts=True),
    "poisoned-state": Attack("serves its anchor x3 as the group state a joiner loads", _poisoned_state),
    "surrogate-at-bound": Attack("surrogate deltas that make each copy 3.8x longer, refresh after refresh",
                                 _surrogates_at_the_bound),
    "capacity-1e6": Attack("declares capacity 1e6", _capacity(1e6)),
    "phantoms-5": Attack("5 more identities that heartbeat (the node's step) and train nothing",
                         side=_extra_identities(5, squat=False)),
    "fresh-phantoms-5": Attack("5 identities like phantoms-5 that appear once rounds merge, replaced by fresh keys "
                               "every 8 s (under idle_s)", side=_fresh_phantoms(5, renew_s=8.0)),
    "member-flood-300": Attack("300 composers' heartbeats from fresh keys, validly signed by one DHT peer once rounds "
                               "merge, each living 120 s and written again every 60 s", side=_signed_heartbeats(
                                   300, ttl_s=120.0, keys_every_s=None)),
    "heartbeats-once-8": Attack("8 composers' heartbeats from fresh keys, each signed once and never renewed (the "
                                "node's TTL), 8 fresh keys again every 60 s", side=_signed_heartbeats(
                                    8, ttl_s=None, keys_every_s=60.0)),
    "sybils-vouching-5": Attack("5 composers' heartbeats from fresh keys once rounds merge, renewed, whose rounds "
                                "records each name the 5 as the senders of the node's latest merged round",
                                _capture_rounds, side=_vouching_sybils(5)),
    "peer-id-squatter": Attack("an identity whose heartbeats name an honest node's libp2p peer id",
                               side=_extra_identities(1, squat=True)),
    "plain-values": Attack("a stock hivemind client writes plain values under every key of the run",
                           side=_plain_values),
    "mismatched-preset": Attack("joins with another preset", node_args=("--preset", "small"), composes=False),
    "oversized-streams": Attack("streams announcing 256 MiB to every handler of every composer",
                                side=_oversized_streams),
    "alie-2": Attack("one of 2 colluders, each sending their honest pseudo-gradients' mean less z standard deviations "
                     "(ALIE; z for the composers in its view, 0.32 for 2 of 8)", _colluding(alie(2)), colluders=2,
                     crafts=True),
    "ipm-2": Attack("one of 2 colluders, each sending -0.1 x their honest pseudo-gradients' mean (inner-product "
                    "manipulation)", _colluding(inner_product_manipulation(0.1)), colluders=2,
                    crafts=True),
}


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in ATTACKS:
        sys.exit(f"usage: python -m parallax.benchmarks.attacker {{{','.join(ATTACKS)}}} IDS.json node join ...")
    attack, ids_path, node_args = ATTACKS[argv[0]], Path(argv[1]), argv[2:]
    peers = node_args[node_args.index("--initial-peers") + 1].split(",") if "--initial-peers" in node_args else []
    run_id = node_args[node_args.index("--run-id") + 1] if "--run-id" in node_args else "default"
    attacker = Attacker(ids_path, run_id, peers)
    _watch_membership(attacker)
    if attack.patch is not None:
        attack.patch(attacker)
    if attack.side is not None:
        def side() -> None:
            while attacker.membership is None and not attacker.stop.wait(0.2):
                pass
            time.sleep(2.0)  # let the view fill
            try:
                attack.side(attacker)  # type: ignore[misc]
            except Exception:
                logger.exception("the attack's side activity failed")

        thread = threading.Thread(target=side, name="attack", daemon=True)
        thread.start()
    sys.argv = ["parallax", *node_args, *attack.node_args]
    try:  # the command as ``python -m parallax.cli`` runs it, with the attack in effect
        runpy.run_module("parallax.cli", run_name="__main__", alter_sys=True)
    finally:
        attacker.stop.set()
        if attack.side is not None:
            thread.join(15.0)  # its DHT nodes and clients shut down


if __name__ == "__main__":
    main(sys.argv[1:])
