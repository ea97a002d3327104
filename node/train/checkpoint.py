"""Checkpoints of a composer: safetensors files plus a small JSON manifest, written atomically.

A checkpoint holds everything a composer needs to continue *bit for bit* as if it had never stopped
(``parallax node join --checkpoint-dir DIR --resume``): the weights it holds (owned experts, the
shared groups, every surrogate), the inner AdamW state and the LR schedule, the outer optimizers'
anchors and momenta, the error-feedback mirrors of its published surrogates, the data sampler's
draw count, the activation buffers distillation reads, and its counters. The manifest adds the config,
the run id, the ownership and the surrogate versions the node had applied.

Layout on disk::

    DIR/
      latest                       "step-000000123\\n": the newest complete checkpoint, replaced last
      step-000000120/              an older one (the last ``keep_last`` are kept)
      step-000000123/
        manifest.json              format version, run id, config, ownership, counters, the non-tensor
                                   state, a sha256 per file and a checksum of itself
        experts.safetensors        the experts this composer holds (group "expert")
        shared.safetensors         groups router, latent, backbone
        surrogates.safetensors     every surrogate (group "surrogate")
        optimizer.safetensors      inner AdamW moments and step counts, keyed by parameter name
        outer.safetensors          per shared group: the anchor and the SGD momentum
        publishers.safetensors     per owned expert: what receivers hold of its surrogate
        data.safetensors           sketch generator, activation ring buffers
      .tmp-step-000000126-1f2e/    a save under way, or one a crash left (removed by the next save)

Atomicity: a save writes every file into a temporary folder beside the target, fsyncs the files (the
manifest last) and the folder, renames the folder to ``step-N`` and only then replaces ``latest``
(write ``latest.tmp``, fsync, ``os.replace``). A crash at any point leaves the previous checkpoint and
``latest`` as they were. A load reads each file once, checks its size and sha256 against the manifest
and the manifest against its own checksum, and checks everything against the composer *before*
changing it, so a refused checkpoint leaves the composer untouched.

Save and load between steps (after ``train_step`` / ``optimizer_step``), never between
``forward_backward`` and ``optimizer_step``: gradients and pending sketches are not saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from parallax.dht.keys import ExpertId
from parallax.errors import NodeError
from parallax.files import fsync
from parallax.node.config.train import TrainConfig
from parallax.node.model.surrogate import ActivationBuffer
from parallax.node.model.transformer import Ownership, group_of
from parallax.node.train.data import CorpusInfo

if TYPE_CHECKING:
    from parallax.node.train.composer import Composer

log = logging.getLogger(__name__)

"""(layer, expert)"""

FORMAT = "parallax-checkpoint"
FORMAT_VERSION = 2
"""Bumped whenever a reader of the previous version would misread a checkpoint."""

MANIFEST = "manifest.json"
LATEST = "latest"
FILES = ("experts", "shared", "surrogates", "optimizer", "outer", "publishers", "data")
"""The tensor files of a checkpoint, each ``<name>.safetensors``."""

RUN_ONLY_FIELDS = frozenset({"eval_batches", "eval_every"})
"""TrainConfig fields that do not change the training trajectory, so they may differ on resume."""
MACHINE_SECTIONS = ("compute.",)
"""Sections chosen for the machine (kernels, precision): the same step up to rounding, so a checkpoint resumes on
another machine with other choices."""

OLDER = "use an older checkpoint (parallax checkpoints list DIR, then --resume DIR/step-N)"
"""What every message about a corrupt or incomplete checkpoint ends with."""

_FINGERPRINT_CHARS = 128
"""The longest identity fingerprint a manifest's ``workers`` may hold."""
_WORKERS_KEPT = 1024
"""The most fingerprints a manifest's ``workers`` may hold (a node writes at most 256)."""
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(NodeError):
    """A checkpoint is missing, incomplete or corrupt; the message says which file and why."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A sound checkpoint that does not fit this node (config, run, ownership, data); says what differs."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's manifest says about it (``read_info``), without loading any tensor."""

    path: Path
    step: int
    run_id: str
    owned: Ownership
    """Per layer, the experts the composer owned: build the resuming composer with this."""
    versions: dict[ExpertId, int]
    """Surrogate versions the node had applied when it saved."""
    config: dict[str, Any]
    """The TrainConfig as JSON (``dataclasses.asdict``)."""
    saved_unix_s: float
    """When the checkpoint was written (the writer's clock)."""
    tokens_seen: int
    """Training tokens the composer had processed."""
    data: CorpusInfo | None = None
    """What it trained on, where its writer said."""
    workers: frozenset[str] = frozenset()
    """The composers whose work had reached the node lately (``Membership.workers``): what it counts, resumed, until
    work reaches it again (``Membership.remember``)."""


# ---- saving ---------------------------------------------------------------------------------------

def save_checkpoint(root: str | os.PathLike[str], composer: Composer, *, run_id: str,
                    versions: Mapping[ExpertId, int] | None = None, keep_last: int = 3,
                    data: CorpusInfo | None = None, workers: Iterable[str] = ()) -> Path:
    """Write ``root/step-<composer.step>/`` atomically, point ``root/latest`` at it, prune old ones.

    Args:
        root: the checkpoint folder (created if missing).
        composer: the composer to save, between steps.
        run_id: the run this composer trains in (refused on load into another run).
        versions: (layer, expert) -> surrogate version the node has applied (returned by the load).
        keep_last: complete checkpoints kept, newest by step; the one just written is always kept.
        data: the corpus the composer trains on (the model card names it).
        workers: fingerprints of the composers whose work had reached the node lately (``CheckpointInfo.workers``).

    Returns:
        The folder of the new checkpoint.

    Raises:
        ValueError: keep_last < 1.
        OSError: the disk refused a write; the previous checkpoint and ``latest`` are unchanged.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 checkpoint, got {keep_last}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root)
    tensors, meta = _collect(composer)
    name = f"step-{composer.step:09d}"
    tmp = root / f"{_TMP_PREFIX}{name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    final = root / name
    try:
        files = {}
        for fname in FILES:
            blob = safetensors.torch.save(tensors[fname])
            _write_file(tmp / f"{fname}.safetensors", blob)
            files[fname] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
        body = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "run_id": run_id, "step": composer.step,
            "saved_unix_s": time.time(), "config": config_json(composer.cfg),
            "versions": sorted([int(l), int(e), int(v)] for (l, e), v in (versions or {}).items()),
            "files": files, "state": meta,
        }
        if data is not None:
            body["data"] = dataclasses.asdict(data)
        if workers := sorted(workers):
            body["workers"] = workers
        _write_file(tmp / MANIFEST, _manifest_bytes(body))
        fsync(tmp)
        if final.exists():  # the same step saved again (after a resume): move the old one aside first
            aside = root / f"{_TMP_PREFIX}replaced-{name}-{secrets.token_hex(4)}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_file(root / f"{LATEST}.tmp", f"{name}\n".encode())
    os.replace(root / f"{LATEST}.tmp", root / LATEST)
    fsync(root)
    _prune(root, keep_last, keep=final)
    log.info("saved checkpoint %s (state %s)", final, _hash(tensors, meta)[:16])
    return final


def _write_file(path: Path, data: bytes) -> None:
    """Write and fsync one file (the seam tests use to inject a crash mid-save)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove_stale(root: Path) -> None:
    """Remove temporary folders a crashed save left (one saver per folder, so any found are dead)."""
    for p in root.iterdir():
        if p.name.startswith(_TMP_PREFIX) and p.is_dir():
            log.info("removing %s, left by a save that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    dirs = list_checkpoints(root)
    for p in dirs[: max(0, len(dirs) - keep_last)]:
        if p != keep:
            shutil.rmtree(p, ignore_errors=True)


# ---- finding ------------------------------------------------------------------------------------

def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The ``step-N`` folders under root that have a manifest, oldest step first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=_step_of)


def _step_of(folder: Path) -> int:
    m = _STEP_DIR.match(folder.name)
    assert m is not None, folder
    return int(m.group(1))


def checkpoint_at(root: str | os.PathLike[str], step: int) -> Path:
    """The newest ``step-N`` folder under ``root`` with N <= ``step`` (nodes checkpoint at their own steps: the
    state each held at ``step``, as far as its checkpoints say).

    Raises:
        CheckpointError: ``root`` holds no checkpoint at or before ``step`` (the message lists what it holds).
    """
    found = list_checkpoints(root)
    before = [f for f in found if _step_of(f) <= step]
    if not before:
        held = ", ".join(str(_step_of(f)) for f in found[:10]) or "none"
        raise CheckpointError(f"{root} holds no checkpoint at or before step {step} (steps held: {held}); "
                              "`parallax checkpoints list DIR` lists them")
    return before[-1]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The folder ``root/latest`` points at, or None when there is no pointer or it points nowhere."""
    pointer = Path(root) / LATEST
    try:
        name = pointer.read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    target = Path(root) / name
    return target if _STEP_DIR.match(name) and target.is_dir() else None


def read_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Read and verify a checkpoint's manifest (a step folder, or a root with ``latest``).

    Raises:
        CheckpointError: no checkpoint there, or a manifest that is corrupt or of another format.
    """
    folder = _resolve(Path(path))
    return _info(folder, _read_manifest(folder))


def _info(folder: Path, body: Mapping[str, Any]) -> CheckpointInfo:
    if not isinstance(body.get("config"), dict):
        raise CheckpointError(f"checkpoint {folder}: malformed manifest (its config is not a table)")
    try:
        return CheckpointInfo(
            path=folder, step=int(body["step"]), run_id=str(body["run_id"]),
            owned=tuple(frozenset(int(e) for e in layer) for layer in body["state"]["owned"]),
            versions={(int(l), int(e)): int(v) for l, e, v in body["versions"]},
            config=body["config"], saved_unix_s=float(body["saved_unix_s"]),
            tokens_seen=int(body["state"]["counters"]["tokens_seen"]), data=CorpusInfo.from_json(body.get("data")),
            workers=_fingerprints(body.get("workers", [])),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder}: malformed manifest ({e!r})") from e


def _fingerprints(found: Any) -> frozenset[str]:
    if not isinstance(found, list) or len(found) > _WORKERS_KEPT or not all(
            isinstance(fp, str) and 0 < len(fp) <= _FINGERPRINT_CHARS for fp in found):
        raise ValueError(f"its workers are not a list of fingerprints: {str(found)[:200]}")
    return frozenset(found)


@dataclass(frozen=True)
class CheckpointWeights:
    """A checkpoint's model weights (``read_weights``), by parameter name."""

    info: CheckpointInfo
    experts: dict[str, torch.Tensor]
    """The experts the composer held."""
    shared: dict[str, torch.Tensor]
    """Its working copy of the shared groups (router, latent interface, backbone)."""
    merged: dict[str, dict[str, torch.Tensor]]
    """group -> the group as of its last outer round (its anchor), for the groups it merges."""
    rounds: dict[str, int]
    """group -> the outer round its anchor is from (0: never merged, the anchor is the initial parameters)."""


def read_weights(path: str | os.PathLike[str]) -> CheckpointWeights:
    """A checkpoint's model weights, verified against its manifest, without a composer to load them into.

    Raises:
        CheckpointError: missing, incomplete or corrupt (which file, and why).
    """
    folder = _resolve(Path(path))
    body = _read_manifest(folder)
    info = _info(folder, body)
    merged: dict[str, dict[str, torch.Tensor]] = {}
    try:
        experts, shared, outer = (_read_tensors(folder, f, body["files"]) for f in ("experts", "shared", "outer"))
        for key, t in outer.items():
            if "/anchor/" in key:
                group, name = key.split("/anchor/", 1)
                merged.setdefault(group, {})[name] = t
        rounds = _outer_rounds(folder, body["state"], merged)
    except (KeyError, TypeError, IndexError, AttributeError) as e:  # a manifest of the right format, wrong shape
        raise CheckpointError(f"checkpoint {folder}: malformed manifest ({e!r})") from e
    return CheckpointWeights(info, experts, shared, merged, rounds)


def verify_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check a checkpoint whole: its manifest, then every file's size, sha256 and format. Loads nothing into a
    composer (``parallax checkpoints list``).

    Raises:
        CheckpointError: what is wrong, and with which file.
    """
    folder = _resolve(Path(path))
    body = _read_manifest(folder)
    info = _info(folder, body)
    try:
        for fname in FILES:
            _read_tensors(folder, fname, body["files"])
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {folder}: malformed manifest ({e!r})") from e
    return info


# ---- loading ------------------------------------------------------------------------------------

def load_checkpoint(path: str | os.PathLike[str], composer: Composer, *, run_id: str | None = None) -> CheckpointInfo:
    """Restore ``composer`` exactly from a checkpoint.

    The composer must be built like the one that saved (same config, ownership, data shard, batch
    size: ``read_info(path).owned`` gives the ownership). Nothing is changed unless everything checks.

    Args:
        path: a ``step-N`` folder, or a checkpoint root (its ``latest`` is loaded, no fallback).
        composer: a composer to restore into, typically fresh.
        run_id: when given, the checkpoint must belong to this run.

    Returns:
        The checkpoint's info (step, run id, ownership, surrogate versions).

    Raises:
        CheckpointError: missing, incomplete or corrupt (which file, and why).
        CheckpointMismatch: sound, but of another run, config, ownership or data (what differs).
    """
    folder = _resolve(Path(path))
    body = _read_manifest(folder)
    info = _info(folder, body)
    try:
        _check_fits(folder, body, composer, run_id)
        tensors = {fname: _read_tensors(folder, fname, body["files"]) for fname in FILES}
        apply = _plan_restore(composer, body["state"], tensors)
    except (KeyError, TypeError, IndexError, AttributeError) as e:  # a manifest of the right format but wrong shape
        raise CheckpointError(f"checkpoint {folder}: malformed manifest or state ({e!r})") from e
    apply()
    log.info("resumed from %s at step %d (state %s)", folder, info.step, state_hash(composer)[:16])
    return info


def load_latest(root: str | os.PathLike[str], composer: Composer, *, run_id: str | None = None,
                fall_back: bool = True) -> CheckpointInfo | None:
    """Restore from the newest usable checkpoint under root (``--resume``).

    Args:
        root: the checkpoint folder.
        composer: as for ``load_checkpoint``.
        run_id: as for ``load_checkpoint``.
        fall_back: when the checkpoint ``latest`` names is corrupt or incomplete, log why and try the
            older ones, newest first (when there is no pointer: every checkpoint, newest first).

    Returns:
        The info of the checkpoint loaded, or None when root holds no checkpoint at all.

    Raises:
        CheckpointError: checkpoints exist but none could be loaded (every reason is listed).
        CheckpointMismatch: a sound checkpoint that does not fit this node (not retried on older
            ones: they were written by the same node).
    """
    candidates = _newest_first(root)
    if not candidates:
        return None
    if not fall_back:
        candidates = candidates[:1]
    reasons = []
    for folder in candidates:
        try:
            return load_checkpoint(folder, composer, run_id=run_id)
        except CheckpointMismatch:
            raise
        except CheckpointError as e:
            log.warning("cannot resume from %s: %s", folder, e)
            reasons.append(str(e))
    raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(reasons))


def _newest_first(root: str | os.PathLike[str]) -> list[Path]:
    """The checkpoints to resume from, in order: the one ``latest`` names, then the older ones, newest first
    (without a pointer: every checkpoint, newest first)."""
    pointed = latest_checkpoint(root)
    every = list_checkpoints(root)
    if pointed is None:
        return list(reversed(every))
    return [pointed, *reversed([p for p in every if _step_of(p) < _step_of(pointed)])]


def sound_checkpoint(root: str | os.PathLike[str]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` whose every file checks out (``verify_checkpoint``), and the newer
    ones skipped with why (a save that did not finish, a damaged file). (None, reasons) when none is sound."""
    skipped = []
    for folder in _newest_first(root):
        try:
            verify_checkpoint(folder)
        except CheckpointError as e:
            skipped.append((folder, str(e)))
            continue
        return folder, skipped
    return None, skipped


def _resolve(path: Path) -> Path:
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: there is no such folder")
    if (path / MANIFEST).exists() or _STEP_DIR.match(path.name):
        return path
    if (path / LATEST).exists():
        target = latest_checkpoint(path)
        if target is None:
            raise CheckpointError(f"{path / LATEST} points at no checkpoint folder; pick one of "
                                  f"{[p.name for p in list_checkpoints(path)]}")
        return target
    raise CheckpointError(f"no checkpoint at {path}: expected a step-N folder or a folder with '{LATEST}'")


def _read_manifest(folder: Path) -> dict[str, Any]:
    try:
        raw = (folder / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} is incomplete: it has no {MANIFEST} "
                              f"(a save that did not finish?); {OLDER}") from None
    try:
        manifest = json.loads(raw)
        body, checksum = manifest["body"], manifest["sha256"]
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is corrupt ({e}); {OLDER}") from None
    if hashlib.sha256(_canonical(body)).hexdigest() != checksum:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is corrupt (its checksum does not match "
                              f"its contents); {OLDER}")
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not a Parallax checkpoint (format {body.get('format')!r})")
    if body.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {folder} has format version {body.get('format_version')}; this "
                              f"Parallax reads version {FORMAT_VERSION}: use the Parallax release that wrote it")
    return body


def _read_tensors(folder: Path, fname: str, files: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    path = folder / f"{fname}.safetensors"
    if fname not in files:
        raise CheckpointError(f"checkpoint {folder}: the manifest lists no {path.name}")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} is incomplete: {path.name} is missing") from None
    expected = files[fname]
    if len(data) != expected["bytes"]:
        raise CheckpointError(f"checkpoint {folder}: {path.name} has {len(data)} bytes, the manifest says "
                              f"{expected['bytes']} (truncated?); {OLDER}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected["sha256"]:
        raise CheckpointError(f"checkpoint {folder}: {path.name} is corrupt (sha256 {digest[:16]}..., the "
                              f"manifest says {expected['sha256'][:16]}...); {OLDER}")
    try:
        loaded = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own SafetensorError on a malformed header
        raise CheckpointError(f"checkpoint {folder}: {path.name} is unreadable ({e})") from e
    # load() views the immutable bytes; the optimizer updates its state in place, so own the memory.
    return {k: v.clone() for k, v in loaded.items()}


def _check_fits(folder: Path, body: Mapping[str, Any], composer: Composer, run_id: str | None) -> None:
    """Raise CheckpointMismatch naming what differs between the checkpoint and this composer."""
    if run_id is not None and body["run_id"] != run_id:
        raise CheckpointMismatch(f"checkpoint {folder} belongs to run {body['run_id']!r}, this node joins run "
                                 f"{run_id!r}; use one --checkpoint-dir per run")
    diffs = config_differences(body["config"], composer.cfg)
    if diffs:
        raise CheckpointMismatch(f"checkpoint {folder} was written with another config: {'; '.join(diffs)}. "
                                 "Resume with the checkpoint's settings, or start in a new --checkpoint-dir")
    state = body["state"]
    mine = _ownership_json(composer.owned)
    if state["owned"] != mine:
        raise CheckpointMismatch(f"checkpoint {folder} owns experts {state['owned']} (per layer), this composer "
                                 f"owns {mine}; build the composer with read_info(path).owned")
    if state["merged_groups"] != list(composer.outer):
        raise CheckpointMismatch(f"checkpoint {folder} merges groups {state['merged_groups']}, this composer "
                                 f"merges {list(composer.outer)}")
    sampler = composer.sampler
    for key, have in (("batch_size", sampler.batch_size), ("seq_len", sampler.seq_len),
                      ("n_tokens", len(sampler.tokens))):
        if state["sampler"][key] != have:
            raise CheckpointMismatch(f"checkpoint {folder} sampled with {key}={state['sampler'][key]}, this "
                                     f"composer has {key}={have}; resume with the same data, shard and batch size")


def config_differences(saved: Mapping[str, Any], cfg: TrainConfig) -> list[str]:
    """The fields where a checkpoint's config (as JSON) and ``cfg`` differ, as "path: checkpoint X, here Y".

    ``RUN_ONLY_FIELDS`` and ``MACHINE_SECTIONS`` are ignored. A setting the checkpoint lacks (one added to
    ``TrainConfig`` after it was written) counts as its default, what training did before the setting existed.
    """
    a, b = _flatten(saved), _flatten(config_json(cfg))
    defaults = _flatten(config_json(TrainConfig()))
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        if key in RUN_ONLY_FIELDS or key.startswith(MACHINE_SECTIONS):
            continue
        was, now = a.get(key, defaults.get(key, missing)), b.get(key, missing)
        if was != now:
            show = ["(absent)" if v is missing else json.dumps(v) for v in (was, now)]
            out.append(f"{key}: checkpoint {show[0]}, here {show[1]}")
    return out


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---- the composer's state, both ways --------------------------------------------------------------

def _collect(composer: Composer) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """(file -> name -> CPU tensor copy, JSON-able rest): everything a resume needs, canonically named."""
    t: dict[str, dict[str, torch.Tensor]] = {f: {} for f in FILES}
    for name, p in composer.model.named_parameters():  # tied head weight appears once, as tok_emb
        group = group_of(name)
        t["experts" if group == "expert" else "surrogates" if group == "surrogate" else "shared"][name] = _cpu(p)
    for name, b in composer.model.named_buffers():
        t["shared"][name] = _cpu(b)

    names = _param_names(composer)
    opt_tensors, optimizer = _flatten_optimizer(composer.optimizer.state_dict(), names)
    t["optimizer"] = opt_tensors

    outer = {}
    for group, oo in composer.outer.items():
        for n, a in oo.anchor.items():
            t["outer"][f"{group}/anchor/{n}"] = _cpu(a)
        for n, u in oo.unsent.items():  # error feedback under a sparse wire
            t["outer"][f"{group}/unsent/{n}"] = _cpu(u)
        sgd_tensors, outer[group] = _flatten_optimizer(oo.optimizer.state_dict(), list(oo.anchor))
        t["outer"].update({f"{group}/{k}": v for k, v in sgd_tensors.items()})

    for (layer, expert), pub in composer.publishers.items():
        for n, v in pub.published.items():
            t["publishers"][f"{layer}.{expert}/{n}"] = _cpu(v)

    sampler = composer.sampler.state_dict()
    t["data"]["sketch/generator"] = _cpu(composer.sketch_rng.get_state())
    recorder = None
    if composer.recorder is not None:
        buffers = {}
        for (layer, expert), buf in sorted(composer.recorder.buffers.items()):
            # The ring's slots, not rows() re-ordered, and the write position: distillation sums rows
            # in slot order, so the same slots give bit-identical refreshes.
            slots, next_slot, filled = buf.state()
            t["data"][f"recorder/{layer}.{expert}"] = _cpu(slots)
            buffers[f"{layer}.{expert}"] = {"next": next_slot, "filled": filled}
        recorder = {"capacity": composer.recorder.capacity, "width": composer.recorder.width, "buffers": buffers}

    meta = {
        "owned": _ownership_json(composer.owned),
        "merged_groups": list(composer.outer),
        "batch_size": composer.batch_size,
        "counters": {"step": composer.step, "tokens_seen": composer.tokens_seen,
                     "tokens_since_merge": dict(composer.tokens_since_merge),
                     "selections_owned": composer.selections_owned, "selections_total": composer.selections_total},
        "optimizer": optimizer,
        "scheduler": composer.scheduler.state_dict(),
        "outer": outer,
        "outer_rounds": {group: oo.round for group, oo in composer.outer.items()},
        "publishers": sorted([l, e] for l, e in composer.publishers),
        "sampler": sampler,
        "recorder": recorder,
    }
    return t, meta


def _plan_restore(composer: Composer, meta: Mapping[str, Any],
                  t: Mapping[str, Mapping[str, torch.Tensor]]) -> Any:
    """Check every tensor against the composer and return a closure that applies them (cannot fail)."""
    params = dict(composer.model.named_parameters())
    buffers = dict(composer.model.named_buffers())
    model_t = {**t["experts"], **t["shared"], **t["surrogates"]}
    _same_tensors("model weights", {**params, **buffers}, model_t)

    names = _param_names(composer)
    opt_state = _unflatten_optimizer(composer.optimizer, meta["optimizer"], t["optimizer"], names, "inner AdamW")

    outer_states = {}
    outer_names: set[str] = set()
    for group, oo in composer.outer.items():
        anchors = {n: t["outer"].get(f"{group}/anchor/{n}") for n in oo.anchor}
        _same_tensors(f"outer anchors of {group}", oo.anchor, anchors)
        sgd_t = {k[len(group) + 1:]: v for k, v in t["outer"].items() if k.startswith(f"{group}/state/")}
        sgd = _unflatten_optimizer(oo.optimizer, meta["outer"][group], sgd_t, list(oo.anchor), f"outer {group}")
        unsent = {n: t["outer"][f"{group}/unsent/{n}"] for n in oo.anchor if f"{group}/unsent/{n}" in t["outer"]}
        _same_tensors(f"outer unsent parts of {group}", {n: oo.anchor[n] for n in unsent}, unsent)
        outer_states[group] = {"anchor": anchors, "optimizer": sgd, "unsent": unsent}
        outer_names |= ({f"{group}/anchor/{n}" for n in oo.anchor} | {f"{group}/{k}" for k in sgd_t}
                        | {f"{group}/unsent/{n}" for n in unsent})
    _no_extras("outer.safetensors", t["outer"], outer_names)

    expected_pub = {f"{l}.{e}/{n}": v for (l, e), pub in composer.publishers.items() for n, v in pub.published.items()}
    _same_tensors("publisher mirrors", expected_pub, t["publishers"])

    recorder = meta["recorder"]
    if (recorder is None) != (composer.recorder is None):
        raise CheckpointError("the checkpoint's activation recorder does not match the composer's")
    rows = {}
    if recorder is not None:
        for key, pos in recorder["buffers"].items():
            r = t["data"][f"recorder/{key}"]
            if r.shape != (pos["filled"], composer.recorder.width) or r.dtype != torch.float32:  # type: ignore[union-attr]
                raise CheckpointError(f"activation buffer {key} has shape {tuple(r.shape)}, {r.dtype}")
            layer, expert = (int(x) for x in key.split("."))
            rows[(layer, expert)] = (r, int(pos["next"]), int(pos["filled"]))
    _no_extras("data.safetensors", t["data"],
               {"sketch/generator", *(f"recorder/{l}.{e}" for l, e in rows)})
    sampler_state = dict(meta["sampler"])
    sketch_state = t["data"]["sketch/generator"]
    counters = meta["counters"]
    scheduler = meta["scheduler"]
    rounds = _outer_rounds(None, meta, composer.outer)

    @torch.no_grad()
    def apply() -> None:
        for name, p in {**params, **buffers}.items():
            p.copy_(model_t[name])
        composer.optimizer.load_state_dict(opt_state)
        composer.scheduler.load_state_dict(dict(scheduler))
        for group, state in outer_states.items():
            composer.outer[group].load_state_dict({**state, "round": rounds[group]})
        for key, v in expected_pub.items():
            v.copy_(t["publishers"][key])
        composer.sampler.load_state_dict(sampler_state)
        composer.sketch_rng.set_state(sketch_state)
        if composer.recorder is not None:
            composer.recorder.buffers.clear()
            for eid, (r, nxt, filled) in rows.items():
                composer.recorder.buffers[eid] = ActivationBuffer.restore(
                    composer.recorder.capacity, composer.recorder.width, r, nxt, filled)
        composer.step = int(counters["step"])
        composer.tokens_seen = int(counters["tokens_seen"])
        composer.tokens_since_merge = {g: int(counters["tokens_since_merge"][g]) for g in composer.outer}
        composer.selections_owned = int(counters["selections_owned"])
        composer.selections_total = int(counters["selections_total"])

    return apply


def _outer_rounds(folder: Path | None, meta: Mapping[str, Any], groups: Iterable[str]) -> dict[str, int]:
    """group -> the outer round of its saved anchor; 0 for a checkpoint written before rounds were kept."""
    saved = meta.get("outer_rounds", {})
    rounds = {g: saved.get(g, 0) if isinstance(saved, Mapping) else None for g in groups}
    good = {g: r for g, r in rounds.items() if type(r) is int and r >= 0}
    if len(good) != len(rounds):
        raise CheckpointError(f"{f'checkpoint {folder}: ' if folder else ''}malformed outer rounds {saved!r}")
    return good


def _param_names(composer: Composer) -> list[str]:
    """Inner optimizer parameter names in the optimizer's own index order."""
    by_id = {id(p): n for n, p in composer.model.named_parameters()}
    return [by_id[id(p)] for g in composer.optimizer.param_groups for p in g["params"]]


def _flatten_optimizer(sd: Mapping[str, Any], names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A torch optimizer state_dict keyed by parameter name: tensors "state/<name>/<key>", the rest JSON."""
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    for index, per_param in sd["state"].items():
        name = names[index]
        values = {}
        for key, v in per_param.items():
            if torch.is_tensor(v):
                tensors[f"state/{name}/{key}"] = _cpu(v)
            else:
                values[key] = v
        state[name] = {"tensors": sorted(k for k, v in per_param.items() if torch.is_tensor(v)), "values": values}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "state": state}


def _unflatten_optimizer(optimizer: torch.optim.Optimizer, meta: Mapping[str, Any],
                         tensors: Mapping[str, torch.Tensor], names: list[str], what: str) -> dict[str, Any]:
    """The inverse of ``_flatten_optimizer`` for ``optimizer``, checked against its parameters."""
    index = {n: i for i, n in enumerate(names)}
    current = optimizer.param_groups
    live_groups, start = [], 0
    for g in current:
        live_groups.append(names[start: start + len(g["params"])])
        start += len(g["params"])
    if [g["params"] for g in meta["param_groups"]] != live_groups:
        raise CheckpointError(f"{what}: the checkpoint's parameter groups do not match the composer's")
    groups = []
    for saved, now in zip(meta["param_groups"], current, strict=True):
        # JSON turns tuples (betas) into lists: give each value the type the live group has.
        g = {k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in saved.items() if k != "params"}
        g["params"] = [index[n] for n in saved["params"]]
        groups.append(g)
    flat_params = [p for g in current for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    expected: set[str] = set()
    for name, entry in meta["state"].items():
        i = index[name]
        per = dict(entry["values"])
        for key in entry["tensors"]:
            v = tensors.get(f"state/{name}/{key}")
            if v is None:
                raise CheckpointError(f"{what}: state {key} of {name} is missing")
            if v.dim() and v.shape != flat_params[i].shape:
                raise CheckpointError(f"{what}: state {key} of {name} has shape {tuple(v.shape)}, "
                                      f"the parameter {tuple(flat_params[i].shape)}")
            per[key] = v
            expected.add(f"state/{name}/{key}")
        state[i] = per
    _no_extras(f"{what} state", tensors, expected)
    return {"state": state, "param_groups": groups}


def _same_tensors(what: str, live: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor | None]) -> None:
    missing = sorted(n for n in live if saved.get(n) is None)
    extra = sorted(set(saved) - set(live))
    if missing or extra:
        raise CheckpointError(f"{what}: the checkpoint lacks {missing[:5]} and has extra {extra[:5]}")
    for n, v in live.items():
        s = saved[n]
        assert s is not None
        if s.shape != v.shape or s.dtype != v.dtype:
            raise CheckpointError(f"{what}: {n} is {tuple(s.shape)} {s.dtype} in the checkpoint, "
                                  f"{tuple(v.shape)} {v.dtype} here")


def _no_extras(what: str, tensors: Mapping[str, torch.Tensor], expected: set[str]) -> None:
    extra = sorted(set(tensors) - expected)
    if extra:
        raise CheckpointError(f"{what}: unexpected tensors {extra[:5]} in the checkpoint")


# ---- hashing and small helpers --------------------------------------------------------------------

def state_hash(composer: Composer) -> str:
    """sha256 over every tensor and counter a checkpoint saves, in a canonical order.

    Equal hashes mean the composers continue identically (weights, optimizer, outer, publishers,
    sampler, buffers, counters); for tests and for the node's resume log.
    """
    return _hash(*_collect(composer))


def _hash(tensors: Mapping[str, Mapping[str, torch.Tensor]], meta: Mapping[str, Any]) -> str:
    h = hashlib.sha256()
    for fname in FILES:
        for name in sorted(tensors[fname]):
            v = tensors[fname][name]
            h.update(f"{fname}:{name}:{v.dtype}:{tuple(v.shape)}\n".encode())
            h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(_canonical(meta))
    return h.hexdigest()


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _ownership_json(owned: Ownership) -> list[list[int]]:
    return [sorted(int(e) for e in layer) for layer in owned]


def config_json(cfg: TrainConfig) -> dict[str, Any]:
    """The config as JSON values (tuples become lists), as stored in the manifest."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _canonical(obj: Any) -> bytes:
    # Python's float repr round-trips exactly, so a parsed manifest re-encodes to the same bytes.
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _manifest_bytes(body: Mapping[str, Any]) -> bytes:
    manifest = {"sha256": hashlib.sha256(_canonical(body)).hexdigest(), "body": body}
    return json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"
