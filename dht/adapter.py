"""The one module that imports hivemind's DHT: start a node, store and read records, shut it down.

Everything else in Parallax talks to the swarm through ``SwarmDHT`` (a few typed, timed calls) and the
names re-exported here (``RecordValidatorBase``, ``DHTRecord``, ``dht_time``, ``dht_key_id``).

Process model: hivemind runs its DHT in a forked child process (which itself runs the ``p2pd``
daemon) and answers calls over a pipe. Calls here block the calling thread for at most their
``timeout_s``. A node calls them from several threads (the announcer, the gossip loop's workers, the
outer-sync threads): hivemind writes each call to its pipe without a lock, and a large write from two
threads at once interleaves, so every call here sends under ``SwarmDHT._send_lock`` (the wait for the
answer happens outside it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import multiaddr
import multiaddr.exceptions
from hivemind.dht import DHT, DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.utils import get_dht_time

from parallax.errors import DHTError
from parallax.files import create_whole
from parallax.signals import signals_deferred

logger = logging.getLogger(__name__)

__all__ = [
    "DHTConfig",
    "DHTRecord",
    "RecordValidatorBase",
    "SwarmDHT",
    "dht_key_id",
    "dht_time",
    "join_command",
    "p2p_identity_path",
    "parse_initial_peers",
]

DEFAULT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)  # hivemind's own default; real swarms pass 0.0.0.0 + a port


def keep_valid_subkeys(protocol: Any, key_bytes: bytes, dictionary: DictionaryDHTValue) -> bool:
    """``DHTProtocol._validate_dictionary`` that drops the subkeys that fail validation and keeps the others.

    hivemind's refuses a whole dictionary when one subkey fails: one forged entry stored by a peer that does not
    validate (a bootstrap peer started without the run's manifest, or a hostile DHT node) would hide every
    honest heartbeat or claim that peer holds from everyone who reads the key through it.
    """
    validator = protocol.record_validator
    if validator is None:
        return True
    with dictionary.freeze():
        bad = [subkey for subkey, (value, expiration) in dictionary.items()
               if not validator.validate(DHTRecord(key_bytes, protocol.serializer.dumps(subkey), value, expiration))]
    for subkey in bad:
        del dictionary[subkey]
    return True


class OrphanedRequests(logging.Filter):
    """Drops two tracebacks hivemind logs for requests nobody waits for any more (a clean leave prints none).

    - Each DHT request carries its caller's reply pipe, which the DHT process rebuilds through the caller's
      ``multiprocessing`` resource sharer. A request still queued when its caller (an averager's process, or this
      one at exit) is gone cannot be rebuilt: ``DHT._run`` logs ``[Errno 2] No such file or directory`` with a
      traceback, although nobody is left to answer.
    - A call this node gave up on (its future cancelled after our timeout) still finishes in the DHT process,
      which then fails to set the cancelled future's result: ``DHT._run_coroutine`` logs "Caught an exception when
      running a coroutine", asyncio "Task exception was never retrieved", and, when the answer reaches this process,
      hivemind's ``MPFuture`` updater "Could not retrieve update", each with ``InvalidStateError``.

    Counted in ``dropped`` (in the process that logs them: the DHT's own); anything else passes.
    """

    dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        orphaned = (record.name == "hivemind.dht.dht" and record.funcName == "_run"
                    and isinstance(error, FileNotFoundError | ConnectionRefusedError))
        cancelled = (record.name in _CANCELLED_LOGGERS and type(error).__name__ == "InvalidStateError"
                     and ("future that is CANCELLED" in str(error) or str(error).startswith("CANCELLED:")))
        if orphaned or cancelled:
            OrphanedRequests.dropped += 1
            return False
        return True


_CANCELLED_LOGGERS = ("asyncio", "hivemind.dht.dht", "hivemind.utils.mpfuture")


def quiet_orphaned_requests() -> None:
    """Install ``OrphanedRequests`` on hivemind's and asyncio's loggers, once (inherited by forked processes)."""
    for name in _CANCELLED_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, OrphanedRequests) for f in target.filters):
            target.addFilter(OrphanedRequests())


def _read_past_late_replies(read: Callable[..., Any]) -> Callable[..., Any]:
    async def read_on(self: ControlClient, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                await read(self, reader)
                return
            except asyncio.InvalidStateError as e:  # the whole message was read: the next one is read as before
                logger.info("a reply to a call given up on is dropped (%s); the P2P connection reads on", e)

    read_on.reads_past_late_replies = True  # type: ignore[attr-defined]
    return read_on


def read_past_late_replies() -> None:
    """Keep hivemind's P2P daemon connections reading when a reply lands on a call given up on, in this process and
    the ones it forks later.

    hivemind 1.1.12 answers a unary call by setting the result of the call's future, which a cancellation (the
    caller's timeout: hivemind's own DHT requests are bounded this way) may have cancelled a moment before the
    reply was read and before the call was forgotten. Setting it raises ``InvalidStateError`` and ends the
    connection's one reader for good: every later call of that P2P handle (a replica, or the DHT process's own)
    waits forever. Here the reply is dropped and the reader goes on to the next message.
    """
    read = ControlClient._read_from_persistent_conn
    if not getattr(read, "reads_past_late_replies", False):
        ControlClient._read_from_persistent_conn = _read_past_late_replies(read)


_forking_dht = threading.Event()
"""Set while hivemind forks this node's DHT process (``SwarmDHT.start``): the fork handler below watches the parent."""
ORPHAN_POLL_S = 1.0


def _watch_parent_after_fork() -> None:
    """In the DHT process just forked: a thread that ends this process and its p2pd once the node that forked it is
    gone, however it went (a SIGKILL of the node's process alone leaves no one else to stop them)."""
    if not _forking_dht.is_set():
        return
    _forking_dht.clear()  # not for the processes this one starts (p2pd)
    parent = os.getppid()
    threading.Thread(target=_end_with_parent, args=(parent,), name="parallax-orphan-watch", daemon=True).start()


def _end_with_parent(parent: int) -> None:
    import psutil  # the DHT process only

    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    for child in psutil.Process().children(recursive=True):  # p2pd
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(1)


os.register_at_fork(after_in_child=_watch_parent_after_fork)


def start_shared_memory_manager() -> None:
    """Start torch's shared-memory manager (``torch_shm_manager``) with SIGINT and SIGTERM blocked, so that a
    Ctrl+C or SIGTERM sent to the process group cannot end it.

    hivemind sets torch's ``file_system`` sharing strategy, under which every shared tensor (each batch of
    its futures' shared state) goes through that manager, a child in our process group. Killed by the
    group's signal while the DHT starts, it leaves the next ``share_memory_`` spinning in native code, where
    no Python signal handler runs: the process never exits. A blocked signal mask survives ``exec``, so the
    manager started here never receives them; it exits on its own once its last client process is gone.
    The calling thread's mask is restored afterwards, and a signal that came meanwhile is delivered then.
    """
    import signal

    import torch

    signals = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        torch.empty(1, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]  # the first share of a process starts the manager
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


HIVEMIND_LOCK_WAIT_S = 5.0
"""How long a lock of hivemind's futures may stay held before ``recover_hivemind_locks`` takes its holder for dead:
a live process holds one for a pipe write."""


def recover_hivemind_locks(wait_s: float = HIVEMIND_LOCK_WAIT_S) -> list[str]:
    """Replace each cross-process lock of hivemind's futures that stays held ``wait_s``; returns their names.

    hivemind's ``MPFuture`` sends every result to the process that made its future under one lock that every process
    forked from the same parent shares (``MPFuture._update_lock``; ``_initialization_lock`` and ``SharedBytes._lock``
    alike). A DHT or averager process SIGKILLed while it writes a result leaves that lock held for good, and each
    process this one forks afterwards blocks on its first result: a DHT's "ready" among them, so its start would wait
    forever. Called before each fork of a DHT or averager process (``SwarmDHT.start``,
    ``averager._start_with_signals_deferred``). A lock held longer than
    ``wait_s`` by a live process (a pipe write blocked that long) would be replaced too: its writer goes on under the
    old lock while new processes take the new one.
    """
    import multiprocessing

    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    replaced = []
    for owner, name in ((MPFuture, "_update_lock"), (MPFuture, "_initialization_lock"), (SharedBytes, "_lock")):
        lock = getattr(owner, name)
        if lock.acquire(timeout=wait_s):
            lock.release()
            continue
        setattr(owner, name, multiprocessing.Lock())
        replaced.append(f"{owner.__name__}.{name}")
    if replaced:
        logger.warning("hivemind's %s stayed held %.0f s, by a process killed as it held it: replaced, so that the "
                       "processes started from here on do not wait for it forever", ", ".join(replaced), wait_s)
    return replaced


def dht_time() -> float:
    """The DHT's clock (seconds since the epoch); record expirations are absolute times on it."""
    return float(get_dht_time())


def dht_key_id(key: str) -> bytes:
    """The bytes hivemind puts in ``DHTRecord.key`` for ``key`` (its 160-bit hash)."""
    return bytes(DHTID.generate(source=key).to_bytes())


def p2p_identity_path(ed25519_key_path: str | os.PathLike[str]) -> Path:
    """Where a node keeps its libp2p identity: beside its Ed25519 key file, with ``.p2p`` appended.

    hivemind creates the file on first start, so the node's libp2p peer id (and its join address)
    stays the same across restarts.
    """
    p = Path(ed25519_key_path)
    return p.with_name(p.name + ".p2p")


def parse_initial_peers(addresses: Sequence[str]) -> list[str]:
    """Validate ``--initial-peers`` with py-multiaddr and return them as strings for hivemind.

    Each address must parse as a multiaddr and end with ``/p2p/<peer id>`` (the id is what lets libp2p
    authenticate the peer). Whitespace- or comma-separated lists inside one string are split.

    Raises:
        ValueError: naming the bad address and the bad part, with the expected form.
    """
    out: list[str] = []
    for item in addresses:
        for text in item.replace(",", " ").split():
            out.append(_parse_one(text))
    return out


def _parse_one(text: str) -> str:
    example = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
    if not text.startswith("/"):
        raise ValueError(f"initial peer {text!r} is not a multiaddr: it must start with '/', like {example}")
    try:
        addr = multiaddr.Multiaddr(text)
    except (multiaddr.exceptions.Error, ValueError, TypeError) as e:
        raise ValueError(f"initial peer {text!r} is malformed: {e}. Expected the form {example}") from None
    names = [p.name for p in addr.protocols()]
    if "p2p" not in names:
        raise ValueError(
            f"initial peer {text!r} lacks the /p2p/<peer id> part: copy the whole line that the peer printed "
            f"at start, like {example}"
        )
    if names[-1] != "p2p":
        raise ValueError(f"initial peer {text!r}: /p2p/<peer id> must be the last part ({example})")
    if not any(n in names for n in ("ip4", "ip6", "dns", "dns4", "dns6")):
        raise ValueError(f"initial peer {text!r} has no /ip4, /ip6 or /dns host part ({example})")
    return str(addr)


def is_loopback(address: str) -> bool:
    """Whether a multiaddr names this machine's loopback (``/ip4/127.x``, ``/ip6/::1``)."""
    return address.startswith(("/ip4/127.", "/ip6/::1/"))


def join_command(addresses: Sequence[str]) -> str:
    """The copy-paste flag others use to join through this node."""
    return "--initial-peers " + " ".join(addresses)


def split_peer_address(address: str) -> tuple[multiaddr.Multiaddr, str]:
    """The multiaddr to dial and the peer id of ``address``, which ends in /p2p/<peer id>: the last /p2p/ part,
    since a relayed address (``<relay>/p2p/<relay id>/p2p-circuit/p2p/<id>``) has two.

    Raises:
        ValueError, multiaddr.exceptions.Error: no /p2p/ part after an address, or not a multiaddr.
    """
    where, _, peer_id = address.rpartition("/p2p/")
    if not where or not peer_id:
        raise ValueError(f"{address!r} does not end in /p2p/<peer id> after an address")
    return multiaddr.Multiaddr(where), peer_id


@dataclass(frozen=True, kw_only=True)
class DHTConfig:
    """How to start this node's DHT. All times in seconds."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs (with /p2p/<id>) of peers already in the swarm; empty starts a new swarm."""
    host_maddrs: tuple[str, ...] = DEFAULT_HOST_MADDRS
    """Where to listen, e.g. /ip4/0.0.0.0/tcp/31337 (port 0 picks a free one)."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses others should dial, when they differ from host_maddrs (NAT, 0.0.0.0)."""
    identity_path: Path | None = None
    """libp2p key file (created if missing) so the peer id is stable; see p2p_identity_path."""
    client_mode: bool = False
    """True for nodes that cannot accept connections: they query the DHT but store nothing for others."""
    relays: tuple[str, ...] = ()
    """Circuit relays (multiaddrs with /p2p/<id>) where this node reserves a slot, so that peers that cannot dial
    it reach it through them; empty: none."""
    relay_always: bool = False
    """Reserve at ``relays`` from the start; otherwise only once libp2p's AutoNAT finds this node unreachable."""
    startup_timeout_s: float = 60.0
    """Give up starting the p2p daemon and DHT after this long (busy hosts need 30-120 s)."""
    request_timeout_s: float = 3.0
    """A DHT RPC to one peer is deemed lost after this long (hivemind's wait_timeout)."""
    start_attempts: int = 3
    """Tries to join through initial_peers before giving up (hivemind fails when none answers)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for hivemind's DHTNode.create (tests and experiments only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(parse_initial_peers(self.initial_peers)))
        for name in ("startup_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds")
        if self.start_attempts < 1:
            raise ValueError("start_attempts must be >= 1")


RELAY_SERVICE: dict[str, object] = {"relayMaxCircuits": 16, "relayMaxReservations": 128,
                                     "relayDataLimit": 1 << 30, "relayTimeLimit": "30m"}
"""What every node relays for the peers that reserved a slot at it (p2pd flags): at most 16 circuits per peer and
128 reservations, and each circuit is reset after 1 GiB in either direction or 30 minutes (the peers dial again)."""


@contextlib.contextmanager
def p2pd_flags(flags: dict[str, object]) -> Any:
    """Add ``flags`` to the command line of every p2p daemon started inside (in a process forked inside, too).

    hivemind has no option for some p2pd flags: the relay service's caps, and ``relayDiscovery``, which is on by
    default in p2pd and makes autorelay wait about three minutes for more relay candidates than the static relays
    it is given. hivemind builds the command line from ``P2P.DHT_MODE_MAPPING``, so the flags go there.
    """
    saved = P2P.DHT_MODE_MAPPING
    P2P.DHT_MODE_MAPPING = {mode: {**args, **flags} for mode, args in saved.items()}
    try:
        yield
    finally:
        P2P.DHT_MODE_MAPPING = saved


@contextlib.contextmanager
def _forking(flag: threading.Event) -> Any:
    flag.set()
    try:
        yield
    finally:
        flag.clear()


READY_POLL_S = 0.5
"""How often a start checks that the DHT process it waits for is alive."""
READY_BOOTSTRAP_REQUESTS = 10
"""Request timeouts a start allows the DHT process beyond the p2p daemon's start-up: hivemind pings the initial
peers, looks up this node's neighbours and maybe its identity, each bounded by one request timeout."""


def _wait_ready(dht: DHT, within_s: float) -> None:
    """Wait until the DHT process just started is ready; raise its error, or a clear one when it ends first or is
    not ready ``within_s`` (a process that stalls while it starts must not hold the node's start forever)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            dht.wait_until_ready(timeout=READY_POLL_S)
            return
        except TimeoutError as e:  # the poll's, or the process's own (a p2p daemon that did not start in time)
            if e.args:
                raise
        if not dht.is_alive():
            raise DHTError(f"the DHT process ended (exit code {dht.exitcode}) before it was ready")
        if time.monotonic() > deadline:
            raise DHTError(f"the DHT process was not ready within {within_s:.0f} s (its p2p daemon's start-up "
                           "and the bootstrap requests): it stalled")


def _stop_starting(dht: DHT) -> None:
    """Stop a DHT process that did not become ready, and the p2p daemon it started: one that stalled does not
    answer hivemind's shutdown message, and a daemon outlives a process that is terminated."""
    import psutil

    daemons: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error, TypeError):
        daemons = psutil.Process(dht.pid).children(recursive=True)
    dht.shutdown()
    for daemon in daemons:
        with contextlib.suppress(psutil.Error):
            daemon.kill()


def _relay_options(config: DHTConfig) -> tuple[dict[str, object], dict[str, object]]:
    """hivemind keyword arguments and extra p2pd flags for ``config``'s relays."""
    if not config.relays:
        return {}, dict(RELAY_SERVICE)
    options: dict[str, object] = {"use_auto_relay": True, "trusted_relays": list(config.relays)}
    if config.relay_always:
        options["force_reachability"] = "private"
    return options, {**RELAY_SERVICE, "relayDiscovery": 0}  # the static relays only, at once


# Module-level so that hivemind can run it inside its forked DHT process (HIVEMIND.md trap 10).
async def _store_many(_dht: DHT, node: DHTNode, keys: list[str], subkey: bytes, value: bytes,
                      expiration_time: float) -> dict[str, bool]:
    found = await node.store_many(keys, [value] * len(keys), expiration_time, subkeys=[subkey] * len(keys))
    return {key: bool(found.get((key, subkey))) for key in keys}


async def _get_many(
    _dht: DHT, node: DHTNode, keys: list[str], latest: bool
) -> dict[str, dict[Any, tuple[Any, float]]]:
    found = await node.get_many(keys, sufficient_expiration_time=float("inf") if latest else None)
    return _dicts(found, keys)


class Answer(dict[str, dict[Any, tuple[Any, float]]]):
    """What ``SwarmDHT.get_dicts`` returns: ``{key: {subkey: (value, expiration_time)}}`` and ``age_s``, the seconds
    from when the read that made it was sent to when it was returned."""

    age_s: float = 0.0


def _ends_by(future: Any, deadline: float) -> bool:
    """Wait for ``future`` until ``deadline`` (monotonic); whether it ended, however."""
    try:
        future.result(timeout=max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
        return bool(future.done())  # a call that failed with a timeout of its own ended too
    except Exception:  # it failed: it ended all the same
        pass
    return True


def _dicts(found: Mapping[str, Any], keys: Sequence[str]) -> dict[str, dict[Any, tuple[Any, float]]]:
    """hivemind's answer to a read as ``{key: {subkey: (value, expiration_time)}}``, ``{}`` for a key not found."""
    out: dict[str, dict[Any, tuple[Any, float]]] = {}
    for key in keys:
        value = getattr(found.get(key), "value", None)
        items: dict[Any, tuple[Any, float]] = {}
        if isinstance(value, dict):
            for subkey, item in value.items():
                v, exp = getattr(item, "value", None), getattr(item, "expiration_time", None)
                if isinstance(exp, float):
                    items[subkey] = (v, exp)
        out[key] = items
    return out


async def _local_dict(_dht: DHT, node: DHTNode, key: str) -> dict[Any, tuple[Any, float]]:
    found = node.protocol.storage.get(DHTID.generate(source=key))
    if found is None or not hasattr(found.value, "items"):
        return {}
    return {sub: (bytes(v), float(exp)) for sub, (v, exp) in found.value.items()}


async def _refusals(_dht: DHT, node: DHTNode) -> int:
    validators = getattr(node.protocol.record_validator, "_validators", [])
    return sum(int(getattr(v, "refused", 0)) for v in validators)


async def _ping(_dht: DHT, node: DHTNode, address: str, timeout_s: float) -> tuple[float, float] | str:
    """Dial ``address`` (a multiaddr ending in /p2p/<id>), then ask its DHT node for a ping: the seconds of each, or
    why it failed (returned, not raised: hivemind logs a traceback for every exception of a coroutine)."""
    from hivemind.p2p import PeerID

    start = time.monotonic()
    try:
        where, last = split_peer_address(address)
        peer_id = PeerID.from_base58(last)
        await asyncio.wait_for(node.p2p._client.connect(peer_id, [where]), timeout_s)
        connected = time.monotonic()
        answer = await asyncio.wait_for(node.protocol.call_ping(peer_id), max(0.1, timeout_s - (connected - start)))
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except Exception as e:
        return " ".join(f"{type(e).__name__}: {e}".split())
    if answer is None:
        return "it connected but its DHT node did not answer a ping (not a hivemind DHT peer, or overloaded)"
    return connected - start, time.monotonic() - connected


@dataclass
class DHTCalls:
    """Counts of one node's DHT calls and of the record bytes they carried: keys, subkeys and values stored,
    values read back. hivemind's own traffic comes on top: each store goes to several of the nearest peers, each
    read walks the key's neighbourhood, and every message is framed. Thread-safe."""

    stores: int = 0
    reads: int = 0
    """Keys read (a read of several keys counts each)."""
    bytes_stored: int = 0
    bytes_read: int = 0
    joined: int = 0
    """Reads that waited for the same keys' read already running instead of sending another."""
    by_kind: dict[str, int] = field(default_factory=dict)
    """Stores and key reads by the kind of key (its second path component: members, claims, outer, ...)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def stored(self, key: str, size: int) -> None:
        with self._lock:
            self.stores += 1
            self.bytes_stored += size
            self._count(key)

    def read(self, keys: Sequence[str], size: int) -> None:
        with self._lock:
            self.reads += len(keys)
            self.bytes_read += size
            for key in keys:
                self._count(key)

    def join(self) -> None:
        with self._lock:
            self.joined += 1

    def kinds(self) -> dict[str, int]:
        """A copy of ``by_kind`` (other threads may be adding to it)."""
        with self._lock:
            return dict(self.by_kind)

    def _count(self, key: str) -> None:
        kind = key.split("/")[1] if "/" in key else key
        if kind in self.by_kind or len(self.by_kind) < 32:  # bounded: keys are the run's, a few kinds
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1


class SwarmDHT:
    """A running hivemind DHT node with Parallax's record validators.

    Use ``SwarmDHT.start(config, validators)``; always ``shutdown()`` (or use it as a context manager),
    which also stops the p2p daemon.
    """

    def __init__(self, dht: DHT, relays: tuple[str, ...] = ()) -> None:
        self._dht = dht
        self.peer_id: str = str(dht.peer_id)
        self.relays = relays
        """The circuit relays this node reserves a slot at (``DHTConfig.relays``)."""
        self._closed = False
        self._send_lock = threading.Lock()  # one write to hivemind's control pipe at a time
        self.forbidden_thread: int | None = None
        """A thread that must not call the network (the node's training loop); its calls are counted."""
        self.forbidden_calls = 0
        self.calls = DHTCalls()
        """What this node's own stores and reads asked of the DHT (what grows with the swarm: a read of the run's
        members key returns every live heartbeat)."""
        self._running: dict[tuple[object, ...], Any] = {}
        """Reads and stores running in the DHT process: ("read", keys, latest) or ("store", keys, subkey) -> the
        future of the one sent first (``get_dicts``, ``store_many``)."""
        self._read_sent: dict[tuple[object, ...], float] = {}
        """A running read's slot -> when it was sent (monotonic): a call that joins it gets a view of that time."""
        self._running_lock = threading.Lock()

    @classmethod
    def start(cls, config: DHTConfig, validators: Sequence[RecordValidatorBase] = (),
              while_starting: Callable[[], object] | None = None) -> SwarmDHT:
        """Start the node, joining ``config.initial_peers`` (or a new swarm when empty).

        Args:
            config: addresses, identity, timeouts.
            validators: record validators plugged into hivemind.
            while_starting: work for the calling thread while the DHT process starts (p2pd, bootstrap),
                called once, after hivemind forked it: nothing forks concurrently with it.

        Raises:
            DHTError: the node could not start or reach any initial peer; the message says what to check.
        """
        DHTProtocol._validate_dictionary = keep_valid_subkeys  # inherited by the DHT process forked below
        recover_hivemind_locks()  # inherited by the DHT process forked below
        quiet_orphaned_requests()
        read_past_late_replies()  # inherited by the DHT process forked below
        start_shared_memory_manager()
        created: dict[str, Any] = {}
        if config.identity_path is not None and not config.identity_path.exists():
            # hivemind would write it in place inside the DHT process: a stop meanwhile left a truncated key that
            # the next start's p2pd refuses. Written here whole, hivemind finds it and uses it; as for one it had
            # just made itself, it skips asking the swarm whether the identity is taken (a second p2pd, and a
            # lookup of a peer nobody knows: seconds to minutes of start-up).
            with contextlib.suppress(FileExistsError):  # another process's start wrote it meanwhile
                create_whole(config.identity_path, lambda tmp: P2P.generate_identity(str(tmp)))
                created["check_if_identity_free"] = False
        last: BaseException | None = None
        attempts = config.start_attempts if config.initial_peers else 1
        for attempt in range(1, attempts + 1):
            try:
                relaying, flags = _relay_options(config)
                # The DHT process is forked inside, with the flags; a signal meanwhile is handled once it is forked.
                with p2pd_flags(flags), _forking(_forking_dht), signals_deferred():
                    dht = DHT(
                        initial_peers=list(config.initial_peers) or None,
                        start=True,
                        await_ready=False,
                        record_validators=list(validators),
                        host_maddrs=list(config.host_maddrs),
                        announce_maddrs=list(config.announce_maddrs) or None,
                        identity_path=str(config.identity_path) if config.identity_path else None,
                        client_mode=config.client_mode,
                        startup_timeout=config.startup_timeout_s,
                        wait_timeout=config.request_timeout_s,
                        cache_refresh_before_expiry=0,  # our records live seconds; refreshing them is waste
                        **relaying,
                        **created,
                        **config.extra,
                    )
                try:
                    if while_starting is not None:
                        while_starting()
                        while_starting = None
                    _wait_ready(dht, config.startup_timeout_s + READY_BOOTSTRAP_REQUESTS * config.request_timeout_s)
                except BaseException:
                    _stop_starting(dht)
                    raise
            except Exception as e:  # hivemind raises many types here (P2PDaemonError, TimeoutError, ...)
                last = e
                if "already taken" in str(e):
                    raise DHTError(
                        f"the libp2p identity {config.identity_path} is already in use by a live peer of "
                        "this swarm: stop that node, or start this one with another identity"
                    ) from e
                logger.warning("DHT start attempt %d/%d failed: %s", attempt, attempts, e)
                continue
            return cls(dht, config.relays)
        where = ", ".join(config.initial_peers) if config.initial_peers else "a new swarm"
        hint = (" Check that at least one of the initial peers is up and reachable from here (firewall, NAT, the "
                "/p2p/ id); hivemind does not start when no initial peer answers." if config.initial_peers else "")
        raise DHTError(f"could not start the DHT ({where}) after {attempts} attempt(s): {last}.{hint}") from last

    # --- addresses ---

    def visible_maddrs(self) -> list[str]:
        """Addresses (with /p2p/<id>) others can use to join through this node, those another machine can dial
        first (a node listening on every interface also reports 127.0.0.1)."""
        return sorted((str(m) for m in self._dht.get_visible_maddrs()), key=is_loopback)

    def relayed_maddrs(self) -> list[str]:
        """Addresses at which peers reach this node through its circuit relays (once it holds a reservation
        there): ``<relay>/p2p-circuit/p2p/<this peer id>``; none without relays."""
        return [f"{relay}/p2p-circuit/p2p/{self.peer_id}" for relay in self.relays if "/p2p-circuit" not in relay]

    def join_command(self) -> str:
        """The line to print at start: ``--initial-peers <addr> ...``."""
        return join_command(self.visible_maddrs())

    @property
    def hivemind_dht(self) -> DHT:
        """The underlying hivemind DHT object, for the few ``node/`` components that need hivemind's
        averager or P2P layer on this same node (``DecentralizedAverager(dht=...)``, ``replicate_p2p()``).

        Everything else goes through the typed, timed calls of this class; do not store or read records
        through it directly.
        """
        return self._dht

    # --- records ---

    def _check_thread(self, what: str) -> None:
        if self.forbidden_thread is not None and threading.get_ident() == self.forbidden_thread:
            self.forbidden_calls += 1
            logger.warning("DHT %s called from the training thread: network I/O on the step path", what)

    def store(
        self, key: str, subkey: bytes, value: bytes, expiration_time: float, *, timeout_s: float, force: bool = False
    ) -> bool:
        """Store ``value`` under ``key``/``subkey`` until ``expiration_time`` (signed by the validators).

        Returns False when no peer accepted it (a newer record is there, validation refused it, the call timed
        out, or the previous store of ``key``/``subkey`` was still running: ``store_many``); never raises for
        network trouble.
        """
        return self.store_many([key], subkey, value, expiration_time, timeout_s=timeout_s, force=force)[key]

    def store_many(
        self, keys: Sequence[str], subkey: bytes, value: bytes, expiration_time: float, *, timeout_s: float,
        force: bool = False,
    ) -> dict[str, bool]:
        """``store`` of one value under ``subkey`` of several keys in one traversal (each signed for its own key);
        for each key whether a peer accepted it (all False on timeout or failure).

        A store that times out goes on in the DHT process, as a read does (``get_dicts``). The next store under the
        same keys and subkey waits for it, within its own ``timeout_s``, and is sent only once it ended: a node that
        stores every period on a host too loaded to answer in time would otherwise queue stores none of which ends
        in time. What it stores replaces the earlier value, so nothing is lost; with ``force`` it is sent at once
        anyway (a deathrattle, a release: the last word must go out).
        """
        self._check_thread("store")
        deadline = time.monotonic() + timeout_s
        slot = ("store", tuple(keys), subkey)
        if not force:
            with self._running_lock:
                earlier = self._running.get(slot)
            if earlier is not None and not _ends_by(earlier, deadline):
                logger.debug("DHT store of %d keys not sent: the previous one is still running", len(keys))
                return dict.fromkeys(keys, False)
        for key in keys:
            self.calls.stored(key, len(key) + len(subkey) + len(value))
        coro = partial(_store_many, keys=list(keys), subkey=subkey, value=value, expiration_time=expiration_time)
        future = self._send(slot, coro)
        try:
            return dict(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            logger.debug("DHT store of %d keys timed out after %.1f s; it goes on", len(keys), timeout_s)
        except Exception as e:
            logger.debug("DHT store of %d keys failed: %s", len(keys), e)
        return dict.fromkeys(keys, False)

    def get_dicts(
        self, keys: Sequence[str], *, latest: bool, timeout_s: float
    ) -> dict[str, dict[Any, tuple[Any, float]]] | None:
        """Read dictionary values: ``{key: {subkey: (value, expiration_time)}}`` (missing keys -> ``{}``).

        Records that failed validation never get here (hivemind drops them). The answer is an ``Answer``: its
        ``age_s`` says how long before it returned the read that made it was sent (a read joined while running is
        older than the call). Returns ``None`` on timeout or failure, so callers keep their previous view rather
        than seeing everyone vanish. The answer may be shared with other callers of the same read: read it, do not
        modify it.

        A read that times out goes on in the DHT process (hivemind cannot stop it): a later read of the same keys
        waits for that one instead of sending another. On a loaded host where a read takes longer than its timeout,
        readers that ask again every period would otherwise each add a read to the DHT process's queue, every read
        would take longer still, and none would ever finish in time: a node would see nobody for as long as the
        load lasts. With one read of given keys at a time, it sees the swarm as of that read, late but true.
        """
        self._check_thread("get")
        future, sent = self._shared_read(tuple(keys), latest)
        try:
            found = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            logger.debug("DHT get of %d keys timed out after %.1f s; the next read of them waits for it", len(keys),
                         timeout_s)
            return None
        except Exception as e:
            logger.debug("DHT get failed: %s", e)
            return None
        answer = Answer(found)
        answer.age_s = time.monotonic() - sent
        return answer

    def _shared_read(self, keys: tuple[str, ...], latest: bool) -> tuple[Any, float]:
        """The read of ``keys`` running in the DHT process, started if none is, and when it was sent (monotonic);
        the calls count each read once."""
        slot = ("read", keys, latest)
        with self._running_lock:
            running, sent = self._running.get(slot), self._read_sent.get(slot, time.monotonic())
        if running is not None:
            self.calls.join()
            return running, sent
        with self._running_lock:
            sent = self._read_sent[slot] = time.monotonic()
        future = self._send(slot, partial(_get_many, keys=list(keys), latest=latest))
        future.add_done_callback(partial(self._count_read, keys))
        return future, sent

    def _count_read(self, keys: tuple[str, ...], future: Any) -> None:
        if not future.cancelled() and future.exception() is None:
            self.calls.read(keys, sum(len(v) for items in future.result().values() for v, _ in items.values()
                                      if isinstance(v, bytes | bytearray)))

    def _send(self, slot: tuple[object, ...], coro: Callable[..., Any]) -> Any:
        """Run ``coro`` in the DHT process; its future is ``slot``'s running call until it ends (unless another
        call took the slot first). Sent outside ``_running_lock``: a send can block while the DHT process is busy,
        and the thread that hands us its answers takes that lock (``_ended``)."""
        with self._send_lock:
            future = self._dht.run_coroutine(coro, return_future=True)
        with self._running_lock:
            self._running.setdefault(slot, future)
        future.add_done_callback(partial(self._ended, slot))
        return future

    def _ended(self, slot: tuple[object, ...], future: Any) -> None:
        with self._running_lock:
            if self._running.get(slot) is future:
                del self._running[slot]
                self._read_sent.pop(slot, None)

    def local_dict(self, key: str, *, timeout_s: float = 5.0) -> dict[Any, tuple[Any, float]]:
        """What this node itself stores under ``key`` (no network): ``{subkey: (value, expiration)}``.

        Values are the raw stored bytes (serialized value, then the signature); diagnostics and tests.
        """
        with self._send_lock:
            future = self._dht.run_coroutine(partial(_local_dict, key=key), return_future=True)
        return dict(future.result(timeout_s))

    def ping(self, address: str, *, timeout_s: float) -> tuple[float, float]:
        """Dial a peer at ``address`` (ending in /p2p/<id>) and ping its DHT node: (seconds to connect, seconds of
        the ping). Raises ``DHTError`` saying what failed."""
        with self._send_lock:
            future = self._dht.run_coroutine(partial(_ping, address=address, timeout_s=timeout_s), return_future=True)
        try:
            result = future.result(timeout_s + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DHTError(f"no answer within {timeout_s:g} s") from None
        if isinstance(result, str):
            raise DHTError(result)
        return float(result[0]), float(result[1])

    def refusals(self, *, timeout_s: float = 5.0) -> int:
        """How many records this node's validators refused so far (each was also logged)."""
        with self._send_lock:
            future = self._dht.run_coroutine(_refusals, return_future=True)
        return int(future.result(timeout_s))

    # --- lifecycle ---

    @property
    def process_ids(self) -> list[int]:
        """PIDs of the DHT process and its p2p daemon (for tests that kill a node the hard way)."""
        import psutil

        pids = [self._dht.pid] if self._dht.pid else []
        with contextlib.suppress(psutil.Error, TypeError):
            pids += [c.pid for c in psutil.Process(self._dht.pid).children(recursive=True)]
        return pids

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` ran (the DHT process and p2pd are stopped or stopping)."""
        return self._closed

    def shutdown(self) -> None:
        """Stop the DHT process and its p2p daemon. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._dht.shutdown()
        except Exception as e:  # already dead (killed in a test, or crashed): nothing left to stop
            logger.debug("DHT shutdown: %s", e)

    def __enter__(self) -> SwarmDHT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
