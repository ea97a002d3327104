"""``parallax doctor``: can this machine train in a swarm, and if not, what to do. One line per check.

Each check gives a verdict (``ok``, ``warn``: training works but something is worse than it should be, ``fail``:
training cannot start or will not work) and, when not ``ok``, the fix. The network checks start a real DHT node
(p2pd) with the addresses ``node join`` would use, dial each initial peer and ping its DHT node, and read the
heartbeats of a run to estimate how far the clocks disagree (heartbeats carry their sending time; replay
windows and record expirations allow ``DEFAULT_CLOCK_SKEW_S``). Whether another machine can dial this one is
judged from the addresses p2pd reports: only private or loopback addresses and no ``--announce`` means peers
outside this network cannot reach it.
"""

from __future__ import annotations

import ipaddress
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import multiaddr
import psutil

from parallax.dht.adapter import DHTConfig, SwarmDHT, dht_time
from parallax.dht.keys import members_key
from parallax.dht.membership import parse_members
from parallax.dht.records import DEFAULT_CLOCK_SKEW_S, Ed25519RecordValidator
from parallax.errors import DHTError
from parallax.node.config.train import TrainConfig

BYTES_PER_PARAMETER = 20
"""fp32 weights, gradients and AdamW's two moments (16 bytes), and the outer anchors of the shared groups."""
CHECKPOINTS_KEPT = 2


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    verdict: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in ("ok", "warn", "fail"):
            raise ValueError(f"verdict {self.verdict!r}")

    def line(self) -> str:
        return f"{self.verdict.upper():4}  {self.name}: {self.detail}" + (f" -> {self.fix}" if self.fix else "")


def composer_bytes(cfg: TrainConfig) -> tuple[int, int]:
    """(parameters, bytes) of a composer that owns every expert (the most one can hold: alone in a run) for
    ``cfg``: parameters at ``BYTES_PER_PARAMETER``, plus the activations of one batch (an estimate)."""
    import torch

    from parallax.node.peer.runner import model_shapes

    with torch.device("meta"):  # shapes only: nothing allocated, even for large presets
        found = model_shapes(cfg)
    m = cfg.model
    count = sum(math.prod(shape) for group in found.groups.values() for shape in group.values())
    per_expert = sum(math.prod(s) for s in found.expert.values()) + sum(math.prod(s) for s in found.surrogate.values())
    count += m.n_layers * m.n_experts * per_expert
    activations = 4 * cfg.batch_size * m.seq_len * m.n_layers * (16 * m.d_model + 3 * m.top_k * m.d_expert)
    return count, count * BYTES_PER_PARAMETER + activations


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_device(device: str, need: int) -> Check:
    """The torch device ``node join`` would train on, and its free memory against ``need`` bytes."""
    import torch

    from parallax.node.train.device import DeviceError, device_of

    try:
        chosen = device_of(device)
    except DeviceError as e:
        return Check("device", "fail", str(e), "pass --cpu, or a --gpu N that exists")
    if chosen.type != "cuda":
        return Check("device", "ok", "CPU (no CUDA device chosen or present)")
    free, total = torch.cuda.mem_get_info(chosen)
    name = torch.cuda.get_device_name(chosen)
    detail = f"{chosen} {name}: {_gib(free)} free of {_gib(total)}, the preset needs about {_gib(need)}"
    if free < need:
        return Check("device", "fail", detail, "free the GPU, choose a smaller --preset, or pass --cpu")
    return Check("device", "ok", detail)


def check_memory(need: int, *, on_gpu: bool) -> Check:
    available = psutil.virtual_memory().available
    want = need // 4 if on_gpu else need  # on a GPU the host holds the data and the transfers, not the model
    detail = f"{_gib(available)} of host memory available, about {_gib(want)} needed"
    if available < want:
        return Check("memory", "fail", detail, "close other programs or choose a smaller --preset")
    return Check("memory", "ok", detail)


def check_disk(folder: Path | None, params: int) -> Check:
    """Free space where checkpoints go against ``CHECKPOINTS_KEPT`` checkpoints of ``params`` parameters."""
    if folder is None:
        return Check("disk", "ok", "no --checkpoint-dir: no checkpoints (a crash loses this node's own progress)")
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    need = CHECKPOINTS_KEPT * params * 16
    detail = f"{_gib(free)} free at {where}, about {_gib(need)} for {CHECKPOINTS_KEPT} checkpoints"
    if free < need:
        return Check("disk", "fail", detail, "free space, or give --checkpoint-dir on another disk")
    return Check("disk", "ok", detail)


def check_p2pd(host: Sequence[str], announce: Sequence[str]) -> tuple[Check, SwarmDHT | None]:
    """Start a DHT node (and its p2pd) on ``host``: the node the network checks use, or ``None``."""
    start = time.monotonic()
    try:
        dht = SwarmDHT.start(DHTConfig(host_maddrs=tuple(host), announce_maddrs=tuple(announce),
                                       startup_timeout_s=30.0), [Ed25519RecordValidator(None)])
    except (DHTError, ValueError) as e:
        return Check("p2pd", "fail", f"did not start on {', '.join(host)}: {e}",
                     "check that --host names an address of this machine and a free port"), None
    return Check("p2pd", "ok", f"started in {time.monotonic() - start:.1f} s, listening on "
                 f"{', '.join(host)}"), dht


def check_reachable(visible: Sequence[str], announce: Sequence[str], *, local: bool = False) -> Check:
    """Whether a machine on another network could dial one of ``visible`` (what p2pd reports); with ``local``
    (a swarm on this machine), whether this machine's peers can."""
    hosts = []
    for address in visible:
        try:
            hosts.append(ipaddress.ip_address(multiaddr.Multiaddr(address).value_for_protocol(
                "ip4" if "/ip4/" in address else "ip6")))
        except (ValueError, multiaddr.exceptions.Error):
            continue
    public = [h for h in hosts if h.is_global]
    shown = ", ".join(a.split("/p2p/")[0] for a in visible[:3]) or "none"
    if local:
        return Check("reachable", "ok", f"peers on this machine only (--loopback): {shown}")
    if announce:
        return Check("reachable", "ok", f"announcing {', '.join(announce)} (given with --announce)")
    if public:
        return Check("reachable", "ok", f"a public address: {public[0]} ({shown})")
    if any(not h.is_loopback for h in hosts):
        return Check("reachable", "warn", f"only private addresses ({shown}): peers on this network can dial "
                     "this node, peers elsewhere cannot",
                     "forward a TCP port to this machine, listen on it (--host /ip4/0.0.0.0/tcp/PORT) and give "
                     "the public address (--announce /ip4/PUBLIC-IP/tcp/PORT); or let the initial peers relay for "
                     "it (--relay always: transfers then pass through them)")
    return Check("reachable", "fail", f"only loopback addresses ({shown}): no other machine can dial this node",
                 "listen on every interface (leave out --host, or --host /ip4/0.0.0.0/tcp/PORT)")


def check_peers(dht: SwarmDHT, peers: Sequence[str], timeout_s: float) -> list[Check]:
    """Dial each initial peer and ping its DHT node."""
    out = []
    for address in peers:
        try:
            connect_s, ping_s = dht.ping(address, timeout_s=timeout_s)
        except DHTError as e:
            out.append(Check(f"peer {address}", "fail", f"unreachable: {e}",
                             "check the address (copy the whole --initial-peers line the peer printed), that the "
                             "peer is up, and that no firewall blocks its port"))
            continue
        slow = connect_s + ping_s > 2.0
        out.append(Check(f"peer {address}", "warn" if slow else "ok",
                         f"connected in {connect_s * 1000:.0f} ms, DHT ping {ping_s * 1000:.0f} ms",
                         "a slow link: expect slow joins and outer rounds" if slow else ""))
    return out


def check_clock(dht: SwarmDHT, run_id: str, wait_s: float) -> Check:
    """Read the run's heartbeats for ``wait_s`` and estimate this clock's offset from its peers'. A heartbeat read
    right after it was sent shows the offset; later reads show it minus the heartbeat's age, so the largest
    difference per peer is the estimate."""
    offsets: dict[str, float] = {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        read = dht.get_dicts([members_key(run_id)], latest=True, timeout_s=max(0.5, deadline - time.monotonic()))
        now = dht_time()
        if read is not None:
            members, _departed = parse_members(read[members_key(run_id)])
            for fp, m in members.items():
                if m.heartbeat.sent > 0:
                    offsets[fp] = max(offsets.get(fp, -math.inf), m.heartbeat.sent - now)
        time.sleep(0.5)
    if not offsets:
        return Check("clock", "warn", f"no heartbeat of run {run_id} to compare with",
                     "give --run-id of a live run (and --initial-peers) to check the clock")
    median = sorted(offsets.values())[len(offsets) // 2]
    detail = f"peers' clocks are {median:+.1f} s from this one (median of {len(offsets)})"
    if abs(median) > DEFAULT_CLOCK_SKEW_S:
        return Check("clock", "fail", detail, "synchronise this machine's clock (NTP: timedatectl set-ntp true); "
                     f"records and messages more than {DEFAULT_CLOCK_SKEW_S:g} s off are refused")
    return Check("clock", "ok", detail)


__all__ = ["Check", "check_clock", "check_device", "check_disk", "check_memory", "check_p2pd", "check_peers",
           "check_reachable", "composer_bytes"]
