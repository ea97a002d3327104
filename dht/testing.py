"""Local swarms of real DHT peers on loopback, for tests and benchmarks (hivemind's ``launch_dht_instances``).

Every peer binds port 0 on 127.0.0.1; later peers bootstrap from the first, the middle and the last.
``LocalSwarm.close()`` shuts every peer down (p2p daemons included); use it in ``finally`` or as a context manager.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import msgpack
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from hivemind.dht.validation import DHTRecord

from parallax.dht.adapter import DHTConfig, SwarmDHT
from parallax.dht.claims import ShardConfig
from parallax.dht.keys import protected_keys
from parallax.dht.membership import Membership, MembershipConfig, Presence, SwarmView
from parallax.dht.records import Ed25519RecordValidator, owner_subkey
from parallax.protocol.identity import Identity
from parallax.protocol.manifest import RunManifest


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05,
               explain: Callable[[], str] | None = None) -> float:
    """Poll ``predicate`` until true; return the seconds it took.

    ``TimeoutError`` after ``timeout``; its message ends with ``explain()`` when given (the state a failure needs
    to be understood, read at the moment it failed).
    """
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            said = f"\n{explain()}" if explain is not None else ""
            raise TimeoutError(f"condition not met within {timeout} s{said}")
        time.sleep(interval)


def agreed(views: Sequence[SwarmView], gone: str | None = None, now: float | None = None) -> bool:
    """Whether ``views`` (one per peer) settled together: each the same assignment, owners and co-owners, without
    ``gone`` (a fingerprint), and in each every expert validly claimed by exactly its assigned owners; each view
    judged as its node judges it (``SwarmView.judged_at``) unless ``now`` is given."""
    assignments = [v.assignment(now) for v in views]
    first = assignments[0] if assignments else None
    if first is None or any(a is None or gone in a.peers or (a.owners, a.co_owners) != (first.owners, first.co_owners)
                            for a in assignments):
        return False
    want = {(layer, e): first.owners_of(layer, e) for layer in range(first.n_layers) for e in range(first.n_experts)}
    return all(v.claims(now) == want for v in views)


class ManyKeysValidator(Ed25519RecordValidator):
    """An attacker's DHT peer (tests and ``bench attacks``): it signs each record with the key its subkey names, so
    one peer writes validly signed records for any number of identities. Records are signed in the DHT process,
    which hivemind forks with the validator as it is then: ``add`` identities before the peer starts, ``sign_for``
    once it runs."""

    def __init__(self, identities: Sequence[Identity], **kwargs: Any) -> None:
        super().__init__(identities[0], **kwargs)
        self._keys: dict[bytes, Identity] = {}
        for identity in identities:
            self.add(identity)

    def add(self, identity: Identity) -> None:
        self._keys[msgpack.packb(owner_subkey(identity.public_key), use_bin_type=True)] = identity

    def sign_value(self, record: DHTRecord) -> bytes:
        self._identity, self._own_subkey_bytes = self._keys[record.subkey], record.subkey
        return super().sign_value(record)


def sign_for(dht: SwarmDHT, identities: Sequence[Identity], timeout_s: float = 30.0) -> None:
    """Make the running ``dht``'s ``ManyKeysValidator`` sign for ``identities`` too (in its DHT process).

    Raises:
        TimeoutError: the DHT process did not take them within ``timeout_s``.
    """
    seeds = [i.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()) for i in identities]
    dht.hivemind_dht.run_coroutine(functools.partial(_sign_for, seeds), return_future=True).result(timeout_s)


async def _sign_for(seeds: Sequence[bytes], _: Any, node: Any) -> None:
    for validator in node.protocol.record_validator._validators:
        if isinstance(validator, ManyKeysValidator):
            for seed in seeds:
                validator.add(Identity.from_seed(seed))


def fixed_identity(i: int) -> Identity:
    """A stable key per index, so failures reproduce with the same fingerprints (never use in production)."""
    return Identity.from_seed(i.to_bytes(4, "big") * 8)


class MembershipTiming(TypedDict, total=False):
    """The timings of ``MembershipConfig`` that a test may shorten (seconds)."""

    heartbeat_period_s: float
    heartbeat_ttl_s: float
    refresh_s: float
    request_timeout_s: float
    idle_s: float
    full_pace_members: int


@dataclass
class LocalPeer:
    identity: Identity
    dht: SwarmDHT
    membership: Membership | None = None
    killed: bool = False
    maddr: str = ""
    """The address others bootstrap from, read once at start (asking a frozen or dead peer would block)."""

    @property
    def fp(self) -> str:
        return self.identity.fingerprint

    def kill(self) -> None:
        """SIGKILL this peer's DHT process and p2p daemon: a crash, no deathrattle."""
        self.killed = True
        for pid in self.dht.process_ids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class LocalSwarm:
    """A growing set of loopback peers in one run."""

    def __init__(self, run_id: str = "local", n_layers: int = 2, groups: Sequence[str] = ()) -> None:
        self.run_id = run_id
        self.n_layers = n_layers
        self.groups = tuple(groups)
        self.peers: list[LocalPeer] = []

    def add_dht(self, identity: Identity, **config: object) -> LocalPeer:
        """Start a DHT peer (no membership), bootstrapping from the first, the middle and the last peer still up
        (one that answers is enough: in a swarm of dozens on one machine a single bootstrap peer stops answering
        pings)."""
        up = [p for p in self.peers if not p.killed and not p.dht.closed]
        initial = tuple(up[i].maddr for i in sorted({0, len(up) // 2, len(up) - 1})) if up else ()
        protected = protected_keys(self.run_id, self.n_layers, self.groups)
        validator = Ed25519RecordValidator(identity, protected_keys=protected)
        dht = SwarmDHT.start(DHTConfig(initial_peers=initial, **config), [validator])  # type: ignore[arg-type]
        peer = LocalPeer(identity, dht, maddr=dht.visible_maddrs()[0])
        self.peers.append(peer)
        return peer

    def add(
        self,
        i: int,
        *,
        shards: ShardConfig | None = None,
        capacity: float = 1.0,
        role: str = "composer",
        manifest: RunManifest | None = None,
        remember: Collection[str] = (),
        **timing: Unpack[MembershipTiming],
    ) -> LocalPeer:
        """Start a peer with ``fixed_identity(i)`` and its announcer (JOINING -> ONLINE), training by
        ``manifest`` when given; ``remember``: the composers a checkpoint it resumes names (``Membership.remember``)."""
        peer = self.add_dht(fixed_identity(i))
        presence = Presence(run_id=self.run_id, capacity=capacity, role=role, manifest=manifest)
        try:
            peer.membership = Membership(peer.dht, peer.identity, presence, MembershipConfig(**timing),
                                         shards=shards)
            peer.membership.remember(remember)
            peer.membership.start()
        except BaseException:  # a peer that did not come online leaves no DHT process or p2pd behind
            self.peers.remove(peer)
            peer.dht.shutdown()
            raise
        return peer

    def close(self) -> None:
        for p in self.peers:
            if p.membership is not None:
                p.membership.abandon()
        for p in self.peers:
            p.dht.shutdown()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
