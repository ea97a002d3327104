"""``parallax bench bytes``: the bytes each peer moves in one outer round of each shared group, against the
swarm's size, for every wire and transport.

A contribution's size is measured, not estimated: a pseudo-gradient of the preset's shared groups (the model built
on torch's meta device for its shapes, then a random tensor of each shape) goes through the gathered round's own
encoder (``transport.encode_contribution``). Under every wire the size follows from the shapes alone
(fixed layouts), so a random pseudo-gradient gives a trained one's size. The schedules:

- gather (``sync.aggregation = "gather"``): each peer serves its body to the n - 1 others and fetches theirs,
  ``(n - 1) x body`` each way;
- parts (``sync.aggregation = "parts"``, ``outer.partitioned``): each peer fetches its share of the blocks of the
  n - 1 other contributions, the n - 1 other merged shares (``partitioned.MERGED_WIRE``) and, for each recheck, a
  block of the n - 1 other contributions (``partitioned.round_bytes`` over the real encoded sizes of every block;
  the mean over the peers), bounded in n with the robust merge kept;
- allreduce (hivemind's butterfly): ``2 (n - 1) / n x`` the merge rule's buffers (``wire.payload_bytes``) each way,
  bounded in n, but every peer is trusted with a part of everyone's (no robust merge).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from parallax.benchmarks.report import write_report
from parallax.node.config.net import OuterConfig
from parallax.node.config.train import SHARED_GROUPS, Compression, SyncConfig, preset
from parallax.node.model.transformer import MoETransformer, own_all
from parallax.node.outer.blocks import encode_blocks
from parallax.node.outer.partitioned import MERGED_WIRE, round_bytes
from parallax.node.outer.transport import encode_contribution
from parallax.node.outer.wire import OuterSyncConfig, payload_bytes

WIRES = ("fp16", "uint8", "int4", "topk")
ALLREDUCE_WIRE: Compression = "uint8"
"""The all-reduce's row: the smallest wire hivemind's codecs have."""


def group_shapes(preset_name: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """group -> tensor name -> shape of the preset's shared groups (groups the preset lacks left out)."""
    cfg = preset(preset_name)
    with torch.device("meta"):
        model = MoETransformer(cfg, own_all(cfg), seed=0)
    shapes = {g: {n: tuple(p.shape) for n, p in model.group_parameters(g).items()} for g in SHARED_GROUPS}
    return {g: s for g, s in shapes.items() if s}


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def body_bytes(shapes: dict[str, tuple[int, ...]], compression: str, seed: int = 0) -> int:
    """Bytes of one gathered contribution of a group of these shapes under ``compression``."""
    return len(encode_contribution(_random(shapes, seed), compression))


def block_bytes(shapes: dict[str, tuple[int, ...]], compression: str, seed: int = 0) -> list[int]:
    """Bytes of each block of one contribution in blocks (``outer.blocks``) of a group of these shapes."""
    return [len(blob) for blob in encode_blocks(_random(shapes, seed), compression).blobs]


def parts_bytes(blocks: list[int], merged: list[int], n: int, rechecks: int) -> int:
    """Bytes each way per peer (the mean) of one partitioned round of ``n`` peers of a group whose contribution's
    blocks and merged blocks are these sizes."""
    return round(round_bytes([blocks] * n, merged, rechecks) / n)


def run_bytes(preset_name: str, peers: Sequence[int]) -> dict[str, Any]:
    """Per group and for one round of every group: body bytes per wire, and bytes each way per peer per round for
    each transport and swarm size."""
    groups = group_shapes(preset_name)
    default = SyncConfig()
    bodies = {g: {w: body_bytes(s, w) for w in WIRES} for g, s in groups.items()}
    reduced = dataclasses.replace(default, aggregation="allreduce", compression=ALLREDUCE_WIRE)
    allreduce = {g: payload_bytes(s, OuterSyncConfig(sync=reduced)) for g, s in groups.items()}
    blocks = {g: block_bytes(s, default.compression) for g, s in groups.items()}
    merged = {g: block_bytes(s, MERGED_WIRE) for g, s in groups.items()}
    rechecks = OuterConfig().parts_rechecks
    transports: dict[str, dict[str, int]] = {}
    for n in peers:
        for w in WIRES:
            transports.setdefault(f"gather_{w}", {})[str(n)] = (n - 1) * sum(b[w] for b in bodies.values())
        transports.setdefault(f"parts_{default.compression}", {})[str(n)] = sum(
            parts_bytes(blocks[g], merged[g], n, rechecks) for g in groups)
        transports.setdefault(f"allreduce_{ALLREDUCE_WIRE}", {})[str(n)] = round(
            2 * (n - 1) / n * sum(allreduce.values()))
    default_name = f"{default.aggregation}_{default.compression}"
    return {
        "preset": preset_name, "peers": list(peers),
        "parameters": {g: sum(torch.Size(s).numel() for s in shapes.values()) for g, shapes in groups.items()},
        "body_bytes": bodies, "allreduce_payload_bytes": allreduce,
        "blocks": {g: len(b) for g, b in blocks.items()}, "parts_rechecks": rechecks,
        "default": default_name,
        "bytes_per_peer_per_round": {"default": transports[default_name],
                                     "gather": transports[f"gather_{default.compression}"], **transports},
    }


def markdown(report: dict[str, Any]) -> str:
    peers = report["peers"]
    lines = [f"Bytes each way per peer for one round of every shared group, preset {report['preset']} "
             f"({sum(report['parameters'].values()):,} shared parameters); the default is {report['default']}.", "",
             "| transport | " + " | ".join(f"n = {n:,}" for n in peers) + " |", "|---|" + "---|" * len(peers)]
    for name, row in report["bytes_per_peer_per_round"].items():
        if name not in ("default", "gather"):
            lines.append(f"| {name} | " + " | ".join(f"{row[str(n)]:,}" for n in peers) + " |")
    return "\n".join(lines)


def write(report: dict[str, Any], json_path: Any) -> None:
    write_report(report, markdown(report), json_path)
