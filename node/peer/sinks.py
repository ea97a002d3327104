"""Optional experiment trackers a node also logs to: TensorBoard and Weights & Biases (``--log-to``, off by default).

Each takes the numbers of the node's step lines (loss, tokens/s, traffic, outer rounds) and its final evaluation;
the metrics file stays the record. A tracker's package is an extra (``pip install -e '.[tensorboard]'`` or
``'.[wandb]'``): asked for without it, the node refuses to start and says which to install. W&B follows its own
environment (``WANDB_MODE=offline`` keeps a run on disk, ``wandb sync`` uploads it later).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from parallax.errors import NodeError
from parallax.node.config.peer import parse_sink


class Sink(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _module(name: str, extra: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise NodeError(f"--log-to {extra} needs the {extra} package: pip install -e '.[{extra}]' (or pip install "
                        f"{extra})") from None


class TensorBoardSink:
    """Scalars in ``DIR/<name>`` (one folder per node, so ``tensorboard --logdir DIR`` overlays the nodes)."""

    def __init__(self, folder: Path, name: str) -> None:
        _module("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder / name))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per node, grouped by the run id. Its W&B id follows from the run id and the node's name (its
    identity), so a node resumed from its checkpoints goes on logging into the same W&B run."""

    def __init__(self, project: str, name: str, group: str, config: Mapping[str, Any]) -> None:
        self.wandb = _module("wandb", "wandb")
        self.id = wandb_run_id(group, name)
        self.run = self.wandb.init(project=project, name=name, group=group, config=dict(config), id=self.id,
                                   resume="allow")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # its service process ends now, not in an exit hook racing the node's own shutdown


def wandb_run_id(run_id: str, name: str) -> str:
    """The W&B id of node ``name``'s run in training run ``run_id``: the same on every start of that node, and made
    only of the characters W&B ids allow."""
    return hashlib.sha256(f"{run_id}\0{name}".encode()).hexdigest()[:32]


def open_sinks(specs: Sequence[str], *, name: str, run_id: str, config: Mapping[str, Any]) -> list[Sink]:
    """The trackers ``specs`` name, opened (``name``: this node; ``config``: its settings, for W&B).

    Raises:
        ValueError: a malformed spec. NodeError: a tracker's package is missing.
    """
    sinks: list[Sink] = []
    try:
        for spec in specs:
            kind, target = parse_sink(spec)
            try:
                sinks.append(TensorBoardSink(Path(target), name) if kind == "tensorboard"
                             else WandbSink(target, name, run_id, config))
            except (NodeError, ValueError):
                raise
            except Exception as e:  # the tracker's own errors (a W&B login or network failure, a bad folder)
                raise NodeError(f"--log-to {spec}: the tracker did not start ({e}); fix it or leave --log-to "
                                "out") from e
    except BaseException:
        for sink in sinks:
            with contextlib.suppress(Exception):
                sink.close()
        raise
    return sinks


def scalars(line: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a step line worth a curve."""
    out = {k: float(line[k]) for k in ("loss", "ce", "tokens_per_s", "bytes_sent", "bytes_received", "peers",
                                       "owned") if isinstance(line.get(k), int | float)}
    for group, n in (line.get("rounds_ok") or {}).items():
        out[f"rounds_ok/{group}"] = float(n)
    return out
