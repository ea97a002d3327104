"""A harness for tests of gathered and partitioned outer rounds over real hivemind peers on loopback (``tests/``):
four DHT peers, each with its network loop, contribution server and fingerprint signer; averagers of a group over
them; the pseudo-gradients they merge. Real p2pd daemons, nothing mocked."""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from parallax.dht.adapter import SwarmDHT
from parallax.dht.testing import LocalSwarm, fixed_identity
from parallax.node.net.network import NetworkLoop
from parallax.node.net.scores import PeerScores
from parallax.node.outer.averager import GroupAverager
from parallax.node.outer.transport import ContributionServicer, ContributionStore, OuterGather, RoundPeers
from parallax.node.outer.wire import FingerprintSigner, OuterSyncConfig

SHAPES = {"w": (64, 100), "b": (32,)}
"""A group's tensors in most tests."""
PARTS = {"w": (128, 256), "b": (32,)}
"""A group of 32,800 entries: 9 blocks, 2 or 3 for each of four mergers (partitioned rounds)."""
CAP = 1000.0
"""The weight cap of every averager (``start_averagers``)."""


@dataclass
class Peer:
    dht: SwarmDHT
    loop: NetworkLoop
    gather: OuterGather
    signer: FingerprintSigner


@contextlib.contextmanager
def gather_peers(count: int = 4, run_id: str = "gather") -> Iterator[list[Peer]]:
    """``count`` DHT peers of ``run_id`` on loopback, each with its network loop and contribution server (under the
    namespace "gather"); all closed on leaving."""
    swarm = LocalSwarm(run_id=run_id, groups=("router",))
    made: list[Peer] = []
    try:
        for i in range(count):
            swarm.add_dht(fixed_identity(i))
        keys = {p.dht.peer_id: p.identity.public_key for p in swarm.peers}
        for local in swarm.peers:
            loop = NetworkLoop(local.dht, f"net-{local.fp}")
            gather = OuterGather(loop.p2p, loop.loop, "gather").start()
            made.append(Peer(local.dht, loop, gather, FingerprintSigner(local.identity, keys.get)))
        yield made
    finally:
        for peer in made:
            peer.gather.close()
            peer.loop.close()
        swarm.close()


def gathered_config(**changes: typing.Any) -> OuterSyncConfig:
    """The loopback outer settings of a gathered round on the fp16 wire, with ``changes``."""
    return OuterSyncConfig.loopback(compression="fp16", aggregation="gather", **changes)


@contextlib.contextmanager
def start_averagers(peers: Sequence[Peer], group: str, scores: Sequence[PeerScores | None] | None = None,
                    round_peers: RoundPeers | Sequence[RoundPeers] | None = None,
                    quorum_waits: Sequence[float] | None = None,
                    gathers: Sequence[OuterGather] | None = None, compression: str = "fp16",
                    timings: dict[str, float] | None = None, aggregation: str = "gather",
                    shapes: Mapping[str, tuple[int, ...]] = SHAPES) -> Iterator[list[GroupAverager]]:
    """One averager of ``group`` per peer, shut down on leaving (also when one fails to start); the live
    composers are ``peers`` unless ``round_peers`` (one for all, or one per peer) says otherwise. A round waits up
    to 15 s for a quorum (the loopback profile's 4 s ran out on a machine busy with other work; ``quorum_waits``:
    each peer's wait instead): these tests are about what is merged. ``gathers``: each peer's contribution server
    and fetcher instead of its own; ``compression``: the wire (fp16); ``timings``: other loopback timings
    (``net.outer``); ``aggregation``: gathered or partitioned; ``shapes``: the group's tensors."""
    ids = [p.dht.peer_id for p in peers]
    round_peers = round_peers or RoundPeers(lambda: ids)
    each = [round_peers] * len(peers) if isinstance(round_peers, RoundPeers) else list(round_peers)
    with contextlib.ExitStack() as stack:
        averagers = []
        for p, score, wait, gather, whom in zip(peers, scores or [None] * len(peers),
                                                quorum_waits or [15.0] * len(peers),
                                                gathers or [p.gather for p in peers], each, strict=True):
            config = OuterSyncConfig.loopback(compression=compression, aggregation=aggregation,
                                              matchmaking_timeout_s=wait, **(timings or {}))
            averagers.append(stack.enter_context(GroupAverager(
                p.dht, "gather", group, shapes, config, p.signer, gather=gather, peers=whom,
                weight_cap=CAP, scores=score)))
        yield averagers


@contextlib.contextmanager
def own_gathers(peers: Sequence[Peer], name: str, one: int,
                servicer: Callable[[ContributionStore], ContributionServicer]) -> Iterator[list[OuterGather]]:
    """A contribution server and fetcher of its own per peer, named ``name``, peer ``one``'s answering with
    ``servicer(store)``; closed on leaving."""
    gathers: list[OuterGather] = []
    try:
        for i, p in enumerate(peers):
            gather = OuterGather(p.loop.p2p, p.loop.loop, name)
            if i == one:
                gather.servicer = servicer(gather.store)
            gathers.append(gather.start())
        yield gathers
    finally:
        for gather in gathers:
            gather.close()


def noisy_deltas(n: int, seed: int, shapes: Mapping[str, tuple[int, ...]] = SHAPES) -> list[dict[str, torch.Tensor]]:
    """``n`` pseudo-gradients of ``shapes``: one true update, each with noise of half its size."""
    g = torch.Generator().manual_seed(seed)
    true = {name: torch.randn(shape, generator=g) * 0.01 for name, shape in shapes.items()}
    return [{name: t + 0.5 * torch.randn(t.shape, generator=g) * 0.01 for name, t in true.items()} for _ in range(n)]


def run_all(averagers: Sequence[GroupAverager], deltas: Sequence[Mapping[str, torch.Tensor]],
            tokens: Sequence[float], round_id: int,
            fault: Callable[..., typing.Any] | None = None) -> list[dict[str, torch.Tensor] | None]:
    """Round ``round_id`` of every averager at once, each with its delta and tokens (``fault`` for the first)."""
    with ThreadPoolExecutor(len(averagers)) as pool:
        futures = [pool.submit(a.run_round, d, t, round_id=round_id, fault=fault if i == 0 else None)
                   for i, (a, d, t) in enumerate(zip(averagers, deltas, tokens, strict=True))]
        return [f.result(timeout=60) for f in futures]
