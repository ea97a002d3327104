"""One precedence for every command: defaults < TOML file (``--config``) < flags that were given < ``--set``.

No environment variable sets a setting (docs/decisions.md). Two choices pick the defaults before any change
applies: the model preset (``preset`` in the file, ``--preset``) and the timing profile (``peer.loopback``), so a
single setting from a file or a flag wins over either.

The file is the same for every command: a top-level ``preset``, a ``[train]`` table (``[train.optim]``, ...),
and the tables of the networked processes (``[peer]``, ``[node]``, ``[net]``, ``[worker]``); each command reads
the tables it has and skips those of the others. ``--set PATH=VALUE`` paths are the file's, and a path into
the training settings may leave out ``train.`` (``--set optim.lr=1e-3``).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from parallax.dht.manifests import settings_difference
from parallax.node.config.peer import NetConfig, NodeConfig, PeerConfig, WorkerConfig
from parallax.node.config.train import PRESETS, TrainConfig, run_settings, train_config
from parallax.node.config.typed import ConfigError, apply_changes, coerce, field_types, parse_sets, table_changes
from parallax.protocol.manifest import RunManifest

R = TypeVar("R")

PROCESS_TABLES = ("peer", "node", "net", "worker")
"""Tables of a run's file that only the networked processes read."""


def read_file(path: Path | None) -> dict[str, Any]:
    """The TOML document at ``path`` ({} for None).

    Raises:
        ConfigError: a missing file or invalid TOML, naming the file.
    """
    if path is None:
        return {}
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path} is not valid TOML: {e}") from None


def _file_changes(root: type, doc: Mapping[str, Any]) -> dict[str, object]:
    """The file's settings as dotted changes against ``root`` (its tables of other commands skipped)."""
    doc = {k: v for k, v in doc.items() if k != "preset"}
    if root is TrainConfig:
        unknown = set(doc) - {"train", *PROCESS_TABLES}
        if unknown:
            raise ConfigError(f"--config: unknown tables or keys {sorted(unknown)}; a run's file has a top-level "
                              f"preset and the tables train, {', '.join(PROCESS_TABLES)}")
        train = doc.get("train", {})
        if not isinstance(train, Mapping):
            raise ConfigError("--config: train must be a table ([train])")
        return table_changes(TrainConfig, train)
    own = {f.name for f in dataclasses.fields(root)}
    return table_changes(root, {k: v for k, v in doc.items() if k in own or k not in PROCESS_TABLES})


def _rooted(root: type, changes: Mapping[str, object]) -> dict[str, object]:
    """``--set`` paths against ``root``; a path into the training settings may leave out ``train.``."""
    fields = field_types(root)
    if "train" not in fields:
        return dict(changes)
    return {(p if p.split(".")[0] in fields else f"train.{p}"): v for p, v in changes.items()}


def resolve(root: type[R], build: Callable[[str, bool], R], *, file: Path | None = None,
            flags: Mapping[str, object] | None = None, sets: Sequence[str] = (),
            default_preset: str = "small", manifest: RunManifest | None = None) -> R:
    """The settings a command runs with.

    Args:
        root: the configuration class (TrainConfig, NodeConfig, WorkerConfig).
        build: the defaults for (preset name, loopback profile).
        file: the ``--config`` TOML file, if any.
        flags: dotted path -> value of the command's own flags; None means the flag was not given. The key
            ``preset`` is the preset flag.
        sets: ``--set PATH=VALUE`` items, in order.
        default_preset: the preset when neither the file nor a flag names one.
        manifest: the run's manifest (``--manifest``): its shared training settings replace the preset's, and
            a file, flag or ``--set`` (or a named preset) that changes one of them is refused, naming it.

    Raises:
        ConfigError: any setting that cannot be used, in one line.
    """
    doc = read_file(file)
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    named = given.pop("preset", None) or doc.get("preset")
    name = named or default_preset
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    layers = [_file_changes(root, doc), given, _rooted(root, parse_sets(sets))]
    loopback = False
    if "peer" in field_types(root):
        for layer in layers:
            if "peer.loopback" in layer:
                loopback = bool(coerce(bool, layer["peer.loopback"], "peer.loopback"))
    try:
        cfg = build(name, loopback)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if manifest is not None:
        cfg = _from_manifest(cfg, manifest, named)
    for layer in layers:
        cfg = apply_changes(cfg, layer)
    if manifest is not None:
        settings = run_settings(cfg.train)  # type: ignore[attr-defined]
        if settings != manifest.settings:
            raise ConfigError(f"the settings given differ from run {manifest.run_id}'s manifest: "
                              f"{settings_difference(settings, manifest.settings)}; leave them out (the manifest "
                              "sets them)")
    return cfg


def _from_manifest(cfg: R, manifest: RunManifest, named: object) -> R:
    """``cfg`` with the manifest's shared training settings (its local ones kept)."""
    if "train" not in field_types(type(cfg)):
        raise ConfigError("a manifest sets training settings, which this command does not have")
    try:
        changes = table_changes(TrainConfig, manifest.settings_dict())
        train = apply_changes(cfg.train, changes)  # type: ignore[attr-defined]
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"run {manifest.run_id}'s manifest holds settings this version cannot use: {e}") from None
    if named and isinstance(named, str) and PRESETS[named] != train.model:
        preset_settings = run_settings(dataclasses.replace(train, model=PRESETS[named]))
        raise ConfigError(f"preset {named} is not the model of run {manifest.run_id}'s manifest: "
                          f"{settings_difference(preset_settings, manifest.settings)}; leave out the preset (the "
                          "manifest sets the model)")
    return dataclasses.replace(cfg, train=train)  # type: ignore[type-var]


def train_defaults(name: str, loopback: bool = False) -> TrainConfig:
    """The training defaults of a preset."""
    return train_config(name)


def node_defaults(name: str, loopback: bool) -> NodeConfig:
    """A node's defaults for a preset and timing profile."""
    return NodeConfig(train=train_defaults(name), peer=PeerConfig(loopback=loopback),
                      net=NetConfig.loopback() if loopback else NetConfig())


def worker_defaults(name: str, loopback: bool) -> WorkerConfig:
    """A worker's defaults for a preset (a worker has no timings to shorten)."""
    return WorkerConfig(train=train_defaults(name), peer=PeerConfig(loopback=loopback))


ROOTS: dict[str, tuple[type[Any], Callable[[str, bool], Any], str]] = {
    "node": (NodeConfig, node_defaults, "tiny"),
    "worker": (WorkerConfig, worker_defaults, "tiny"),
    "sim": (TrainConfig, train_defaults, "small"),
}
"""Each command's configuration: root class, defaults, default preset (``parallax config show --for``)."""
