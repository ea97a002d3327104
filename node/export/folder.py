"""An exported model: one folder a user can take away, load, generate and evaluate with.

Layout::

    DIR/
      model.safetensors   every parameter of the model with every expert real (no surrogates: nothing
                          calls them when every expert is held); the tied head is stored once, as tok_emb
      config.json         format, the model's shape, the tokenizer, the evaluation windows the run used,
                          the sha256 of model.safetensors, and the provenance of every tensor
      README.md           the model card: run, nodes, steps and tokens, val loss, where each expert came from

``write_model`` checks every tensor against the model's shapes and refuses non-finite values before anything
is written, and writes into a temporary folder renamed at the end, so a failed export leaves no half folder.
``load_model`` checks the format, the digest and every name and shape before returning a module.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import safetensors.torch
import torch

from parallax.dht.keys import ExpertId
from parallax.errors import NodeError
from parallax.node.config.train import ModelConfig, TrainConfig
from parallax.node.config.typed import ConfigError, apply_changes, table_changes
from parallax.node.export import hf
from parallax.node.model.transformer import MoETransformer, group_of, own_all
from parallax.node.train.data import CorpusInfo
from parallax.node.train.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, TokenizerError

FORMAT = "parallax-model"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "README.md"

ORIGINS = {"owner": "from their trainer's periodic snapshot", "final": "from a leaving owner's final snapshot",
           "checkpoint": "from a composer's checkpoint"}

TOKENIZER = "tokenizer.json"
"""A BPE run's tokenizer file (a byte run needs none: raw bytes are the tokens)."""

HF_DESCRIPTION = "parallax.json"
"""In the Hugging Face form, what config.json holds in Parallax's: settings, tokenizer, windows, provenance."""

Form = Literal["parallax", "hf"]
"""The layout of an exported folder: Parallax's own, or a standard Hugging Face transformers checkpoint."""


S = TypeVar("S", ModelConfig, TrainConfig)


class ExportError(NodeError):
    """An export could not be assembled or a model folder could not be read; the message says what to do."""


@dataclass(frozen=True)
class Copy:
    """One copy of an expert (or of the shared groups) and where it came from."""

    tensors: Mapping[str, torch.Tensor]
    """Parameter name (as in ``MoETransformer``) -> tensor."""
    holder: str
    """Who held it: a peer's fingerprint, or a checkpoint folder."""
    origin: str
    """"owner" (its trainer's periodic snapshot, live), "final" (the snapshot a leaving or releasing owner
    served), "merged" (the shared groups as the composers agree on them, live) or "checkpoint"."""
    step: int
    """The holder's step when the copy was taken."""
    saved_unix_s: float
    """When the copy was taken (the holder's clock)."""
    groups: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """For a copy of the shared groups: group -> {"round", "step", "origin"}, where each group's weights come from
    (the model card's table)."""


@dataclass(frozen=True)
class NodeSummary:
    """What the card says about one node of the run."""

    holder: str
    step: int
    tokens: int
    val_loss: float | None = None
    """Its own view's validation loss, when known (a checkpoint does not hold one)."""
    train_loss: float | None = None
    """The training loss its last heartbeat announced (a live export)."""
    data: CorpusInfo | None = None
    """What it trained on, when known (its checkpoint names it; a heartbeat does not)."""


@dataclass
class Provenance:
    run_id: str
    nodes: list[NodeSummary]
    shared_from: dict[str, Any] = field(default_factory=dict)
    experts: list[dict[str, Any]] = field(default_factory=list)
    missing: list[ExpertId] = field(default_factory=list)
    val_loss: dict[str, Any] | None = None
    """The exported model's loss on the run's validation windows, measured at export."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The run's training settings (``TrainConfig`` as JSON), as the checkpoints or the run's manifest hold them."""
    license: str | None = None
    """The licence the exporter gives the weights (an SPDX id), or None when none was given."""
    exported_unix_s: float = field(default_factory=time.time)


def expert_names(cfg: ModelConfig, layer: int, expert: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of one routed expert."""
    prefix = f"blocks.{layer}.moe.experts.{expert}"
    return {f"{prefix}.w_gate.weight": (cfg.d_expert, cfg.d_latent),
            f"{prefix}.w_up.weight": (cfg.d_expert, cfg.d_latent),
            f"{prefix}.w_down.weight": (cfg.d_latent, cfg.d_expert)}


def shared_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of every shared parameter (router, latent interface, backbone)."""
    model = MoETransformer(cfg, tuple(frozenset() for _ in range(cfg.n_layers)), seed=0)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if group_of(n) not in ("expert", "surrogate")}


def check_copy(copy: Copy, shapes: Mapping[str, tuple[int, ...]], what: str) -> str | None:
    """Why ``copy`` cannot be used for ``what`` (names, shapes, dtype, finiteness), or None when it can."""
    missing = sorted(set(shapes) - set(copy.tensors))
    if missing:
        return f"{what} from {copy.holder} lacks {missing[:3]}"
    for name, shape in shapes.items():
        t = copy.tensors[name]
        if tuple(t.shape) != shape or not t.is_floating_point():
            return f"{what} from {copy.holder}: {name} is {tuple(t.shape)} {t.dtype}, expected {shape} floating point"
        if not bool(torch.isfinite(t).all()):
            return f"{what} from {copy.holder}: {name} holds NaN or infinite values"
    return None


def choose(copies: Sequence[Copy], shapes: Mapping[str, tuple[int, ...]], what: str,
           refused: list[str]) -> Copy | None:
    """The newest usable copy (the trainer's own before a snapshot when equally new); unusable ones are
    named in ``refused``."""
    usable = []
    for c in copies:
        why = check_copy(c, shapes, what)
        if why is None:
            usable.append(c)
        else:
            refused.append(why)
    if not usable:
        return None
    return max(usable, key=lambda c: (c.saved_unix_s, c.origin != "snapshot", c.step))


def assemble(cfg: ModelConfig, shared: Sequence[Copy], experts: Mapping[ExpertId, Sequence[Copy]], *,
             allow_missing: bool, provenance: Provenance) -> dict[str, torch.Tensor]:
    """The exported model's tensors: the chosen shared groups and every expert, each from its chosen copy.

    Fills ``provenance`` (where each came from, which are missing).

    Raises:
        ExportError: no usable copy of the shared groups, or experts nobody holds without ``allow_missing``
            (each named, with why copies were refused).
    """
    refused: list[str] = []
    base = choose(shared, shared_shapes(cfg), "the shared groups", refused)
    if base is None:
        raise ExportError("no usable copy of the shared groups (router, latent interface, backbone)"
                          + (f": {'; '.join(refused)}" if refused else ": no source holds them"))
    state = {n: base.tensors[n].detach().to("cpu", torch.float32).contiguous() for n in shared_shapes(cfg)}
    provenance.shared_from = {"holder": base.holder, "origin": base.origin, "step": base.step,
                              "saved_unix_s": base.saved_unix_s, "groups": {g: dict(v) for g, v in base.groups.items()}}
    missing = []
    for layer in range(cfg.n_layers):
        for expert in range(cfg.n_experts):
            shapes = expert_names(cfg, layer, expert)
            chosen = choose(experts.get((layer, expert), ()), shapes, f"expert {layer}.{expert}", refused)
            if chosen is None:
                missing.append((layer, expert))
                state.update({n: torch.zeros(s) for n, s in shapes.items()})
                continue
            state.update({n: chosen.tensors[n].detach().to("cpu", torch.float32).contiguous() for n in shapes})
            provenance.experts.append({"layer": layer, "expert": expert, "holder": chosen.holder,
                                       "origin": chosen.origin, "step": chosen.step,
                                       "age_s": round(max(0.0, provenance.exported_unix_s - chosen.saved_unix_s), 1)})
    provenance.missing = missing
    if missing and not allow_missing:
        names = ", ".join(f"{l}.{e}" for l, e in missing)
        raise ExportError(f"{len(missing)} expert(s) are held by nobody reachable: {names}"
                          + (f" (refused copies: {'; '.join(refused)})" if refused else "")
                          + ". Export from more checkpoints or while their owners are up; --allow-missing writes "
                            "them as zeros (they then contribute nothing) and says so in the model card")
    return state


def model_config_from(table: Mapping[str, Any], where: str) -> ModelConfig:
    """A ``ModelConfig`` from its JSON table, every value type-checked (a config file is input like any other)."""
    return settings_from(ModelConfig, table, where)


def train_config_from(table: Mapping[str, Any], where: str) -> TrainConfig:
    """A ``TrainConfig`` from its JSON table (a checkpoint's or a manifest's), every value type-checked."""
    return settings_from(TrainConfig, table, where)


def settings_from(cls: type[S], table: Mapping[str, Any], where: str) -> S:
    """``cls``'s defaults with ``table``'s values, each checked as ``--set`` checks it.

    Raises:
        ExportError: not a table, an unknown setting, a value of the wrong type, settings that do not fit together.
    """
    if not isinstance(table, Mapping):
        raise ExportError(f"{where}: the settings are not a table")
    try:
        return apply_changes(cls(), table_changes(cls, table))
    except (ConfigError, ValueError, TypeError, AttributeError) as e:
        raise ExportError(f"{where}: settings this version cannot use ({e})") from None


def write_model(out: str | os.PathLike[str], cfg: ModelConfig, state: Mapping[str, torch.Tensor],
                provenance: Provenance, *, eval_windows: Mapping[str, Any], tokenizer: Tokenizer | None = None,
                form: Form = "parallax") -> Path:
    """Write the model folder ``out`` (which must not exist, or be empty) atomically.

    Args:
        out: the folder to create.
        cfg: the model's shape.
        state: every non-surrogate parameter (``assemble``'s result).
        provenance: for config.json and the model card.
        eval_windows: batch_size, eval_batches and val_fraction of the run, the defaults of ``parallax eval``.
        tokenizer: how text becomes tokens (None: bytes); a BPE's file is written beside the weights.
        form: "parallax" (the layout above, read by ``read_model``) or "hf" (``node.export.hf``: a standard
            transformers checkpoint, with Parallax's description of the model in parallax.json).

    Raises:
        ExportError: ``out`` is taken, or the tokenizer is not the one ``cfg`` names.
    """
    tokenizer = tokenizer or ByteTokenizer()
    if tokenizer.kind != cfg.tokenizer or tokenizer.vocab_size > cfg.vocab_size:
        raise ExportError(f"the model tokenizes with {cfg.tokenizer} ({cfg.vocab_size} tokens), the tokenizer given "
                          f"is {tokenizer.kind} ({tokenizer.vocab_size}): pass the run's own")
    table: dict[str, Any] = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size}
    if isinstance(tokenizer, BpeTokenizer):
        table |= {"file": TOKENIZER, "sha256": tokenizer.digest}
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder; choose a new --out")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if form == "hf":
            data = hf.write_hf_files(tmp, cfg, state, tokenizer)
        else:
            data = safetensors.torch.save(dict(state), metadata={"format": FORMAT})
            (tmp / WEIGHTS).write_bytes(data)
            if isinstance(tokenizer, BpeTokenizer):
                tokenizer.save(tmp / TOKENIZER)
        body = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "model": asdict(cfg), "tokenizer": table,
            "eval": dict(eval_windows),
            "files": {WEIGHTS: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}},
            "provenance": _provenance_json(provenance),
        }
        if form == "hf":
            body |= {"form": "hf", "architecture": hf.architecture(cfg)}
        (tmp / (HF_DESCRIPTION if form == "hf" else CONFIG)).write_text(json.dumps(body, indent=1) + "\n")
        card = model_card(cfg, provenance, parameters=sum(t.numel() for t in state.values()), form=form)
        (tmp / CARD).write_text(card)
        if out.exists():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _provenance_json(p: Provenance) -> dict[str, Any]:
    return {"run_id": p.run_id, "nodes": [asdict(n) for n in p.nodes], "shared_from": p.shared_from,
            "experts": p.experts, "missing": [list(m) for m in p.missing], "val_loss": p.val_loss,
            "exported_unix_s": p.exported_unix_s, "settings": p.settings, "license": p.license}


def model_card(cfg: ModelConfig, p: Provenance, *, parameters: int, form: Form = "parallax") -> str:
    """The README.md of an exported model (of the Hugging Face form: with the Hub's metadata header and how that
    form differs)."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(p.exported_unix_s))
    lines = ["---", "library_name: transformers", *([f"license: {p.license}"] if p.license else []),
             "tags: [mixture-of-experts, parallax]", "---", ""] if form == "hf" else []
    lines += [
        f"# Parallax MoE model of run `{p.run_id}`", "",
        f"Exported {when}. A decoder-only Mixture-of-Experts transformer trained by Parallax: {cfg.n_layers} "
        f"layers, d_model {cfg.d_model}, {cfg.n_experts} routed experts per layer (top-{cfg.top_k}), context "
        f"{cfg.seq_len} tokens, {'byte tokens' if cfg.tokenizer == 'bytes' else 'a byte-level BPE'} (vocabulary "
        f"{cfg.vocab_size}); {parameters:,} parameters. Every expert is real: the surrogates the composers trained "
        "with are no part of it.", "",
        f"License: {p.license or 'none given (`parallax export --license SPDX-ID` sets one)'}.", "",
    ]
    if form == "hf":
        lines += hf.card_section(cfg)
    else:
        lines += ["```python", "import parallax",
                  "m = parallax.load(\"<this folder>\")  # m.model: the torch.nn.Module",
                  "print(m.generate(\"ROMEO:\", max_new_tokens=100))", "```", "",
                  "`parallax generate <this folder> --prompt ...` samples text; `parallax eval <this folder> --data "
                  "FILE` measures loss per byte and per token.", ""]
    if p.val_loss is not None:
        v = p.val_loss
        lines += [f"Validation loss at export: **{v['nats_per_token']:.4f} nats per token**, "
                  f"{v['nats_per_byte']:.4f} nats per byte, perplexity {v['perplexity']:.2f} "
                  f"({v['windows']} windows of {cfg.seq_len} tokens from {v['data']}).", ""]
    lines += _training_lines(p.settings)
    lines += _data_lines(p.nodes)
    lines += ["## Nodes", "", "| node | step | tokens | training loss (last heartbeat) |", "|---|---:|---:|---:|"]
    for n in p.nodes:
        loss = f"{n.train_loss:.4f}" if n.train_loss is not None and math.isfinite(n.train_loss) else "-"
        lines.append(f"| `{n.holder}` | {n.step:,} | {n.tokens:,} | {loss} |")
    s = p.shared_from
    lines += ["", f"Shared groups (router, latent interface, backbone) from `{s.get('holder')}` "
                  f"({s.get('origin')}, step {s.get('step')}).", ""]
    if s.get("groups"):
        lines += ["| group | outer round | step | weights |", "|---|---:|---:|---|"]
        lines += [f"| {g} | {v['round']} | {v['step']:,} | {v['origin']} |" for g, v in s["groups"].items()] + [""]
    lines += ["## Experts", "",
              "| layer.expert | from | origin | holder's step | age at export (s) |", "|---|---|---|---:|---:|"]
    for e in p.experts:
        lines.append(f"| {e['layer']}.{e['expert']} | `{e['holder']}` | {e['origin']} | {e['step']:,} | {e['age_s']} |")
    origins = collections.Counter(e["origin"] for e in p.experts)
    lines += ["", "Experts by origin: " + ", ".join(f"{n} {ORIGINS.get(o, o)}" for o, n in sorted(origins.items()))
              + "."]
    if p.missing:
        lines += ["", f"**{len(p.missing)} expert(s) were held by nobody and are zeros** (they contribute nothing "
                      f"where the router picks them): {', '.join(f'{l}.{e}' for l, e in p.missing)}."]
    return "\n".join(lines) + "\n"


def _data_lines(nodes: Sequence[NodeSummary]) -> list[str]:
    """The card's data section: each corpus the nodes trained on, with its digest and how many trained on it."""
    corpora = collections.Counter(n.data for n in nodes if n.data is not None)
    unknown = sum(1 for n in nodes if n.data is None)
    lines = ["## Training data", ""]
    if corpora:
        lines += ["| corpus | sha256 | bytes | nodes |", "|---|---|---:|---:|"]
        lines += [f"| {c.name} | `{c.sha256}` | {c.size:,} | {n} |" for c, n in corpora.most_common()]
        lines.append("")
    if unknown:
        lines += [f"{unknown} node(s) did not name their data (a live export reads heartbeats, which do not; "
                  "an export from checkpoints names it).", ""]
    return lines


def _training_lines(settings: Mapping[str, Any]) -> list[str]:
    """The card's training section: the settings a reader compares runs by (all of them are in config.json)."""
    if not settings:
        return []
    optim, sync, own = settings.get("optim", {}), settings.get("sync", {}), settings.get("ownership", {})
    rows = [("schedule", f"{settings.get('steps')} steps of {settings.get('batch_size')} sequences per composer"),
            ("inner optimizer", f"{optim.get('inner')}, lr {optim.get('lr')}, warm-up {optim.get('warmup_steps')}"),
            ("outer rounds", f"every {sync.get('periods')} steps, {sync.get('merge')} merge, {sync.get('compression')} "
                             f"wire, {sync.get('aggregation')}"),
            ("owners per expert", str(own.get("replicas"))), ("seed", str(settings.get("seed")))]
    return (["## Training", "", "| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
            + ["", "Every setting is in `config.json` (`provenance.settings`).", ""])


@dataclass(frozen=True)
class ExportedModel:
    """A loaded model folder."""

    model: MoETransformer
    config: dict[str, Any]
    """config.json as written."""
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def eval_windows(self) -> dict[str, Any]:
        return dict(self.config.get("eval", {}))

    def generate(self, prompt: str, max_new_tokens: int = 200, *, temperature: float = 0.8, top_k: int | None = 50,
                 top_p: float | None = None, seed: int | None = None) -> str:
        """``prompt`` and the text the model continues it with (``node.export.use.generate``)."""
        from parallax.node.export.use import generate

        text = generate(self.model, prompt.encode(), max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, tokenizer=self.tokenizer)
        return prompt + text.decode("utf-8", errors="replace")


def read_model(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> ExportedModel:
    """Load a model folder written by ``write_model``, checked (format, digest, names, shapes).

    Raises:
        ExportError: not a model folder, another format version, a corrupt or mismatched file.
    """
    folder = Path(path)
    if (folder / HF_DESCRIPTION).is_file():
        raise ExportError(f"{folder} is the Hugging Face form of a Parallax model: load it with transformers "
                          "(AutoModelForCausalLM.from_pretrained), or export Parallax's own form (no --format hf) "
                          "for parallax generate, eval and load")
    if not (folder / CONFIG).is_file():
        raise ExportError(f"{folder} is not an exported Parallax model (no {CONFIG}); make one with parallax export")
    try:
        config = json.loads((folder / CONFIG).read_text())
        if not isinstance(config, dict):
            raise TypeError("not a JSON object")
        files, table, windows = config["files"], config["model"], config.get("eval", {})
        if not (isinstance(files, dict) and isinstance(files.get(WEIGHTS), dict) and isinstance(table, dict)
                and isinstance(windows, dict)):
            raise TypeError("files, model and eval must be tables")
        for key in ("batch_size", "eval_batches"):
            if key in windows and not (type(windows[key]) is int and windows[key] > 0):
                raise TypeError(f"eval.{key} must be a positive whole number")
        if "val_fraction" in windows and not (type(windows["val_fraction"]) is float
                                              and 0 < windows["val_fraction"] < 1):
            raise TypeError("eval.val_fraction must be in (0, 1)")
    except (ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{folder / CONFIG} is corrupt ({e}); export the model again") from None
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{folder} holds format {config.get('format')!r} version {config.get('format_version')}; "
                          f"this Parallax reads {FORMAT!r} version {FORMAT_VERSION}")
    cfg = model_config_from(table, str(folder / CONFIG))
    tokenizer = _read_tokenizer(folder, config.get("tokenizer"), cfg)
    try:
        data = (folder / WEIGHTS).read_bytes()
    except FileNotFoundError:
        raise ExportError(f"{folder} has no {WEIGHTS}; export the model again") from None
    if hashlib.sha256(data).hexdigest() != files[WEIGHTS].get("sha256"):
        raise ExportError(f"{folder / WEIGHTS} does not match the sha256 in {CONFIG} (corrupt or replaced); "
                          "export the model again")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error type on a malformed header
        raise ExportError(f"{folder / WEIGHTS} is unreadable ({e})") from None
    model = build_model(cfg, tensors, str(folder / WEIGHTS))
    return ExportedModel(model.to(device), config, tokenizer)


def run_tokenizer_for(cfg: ModelConfig, tokenizer: Tokenizer | None, digest: str | None = None) -> Tokenizer:
    """The tokenizer an export writes: bytes for a byte run; for a BPE run the one given, which must be the run's
    (``digest``: the manifest's tokenizer term, where known).

    Raises:
        ExportError: a BPE run without its tokenizer, or with another one.
    """
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if tokenizer is None:
        raise ExportError("the run tokenizes with a BPE: pass --tokenizer FILE, the run's tokenizer.json (beside its "
                          "manifest, or in a model exported from it)")
    if digest is not None and tokenizer.digest != digest:
        raise ExportError(f"the tokenizer given has sha256 {tokenizer.digest[:16]}..., the run's manifest names "
                          f"{digest[:16]}...: pass the run's own tokenizer.json")
    return tokenizer


def _read_tokenizer(folder: Path, table: object, cfg: ModelConfig) -> Tokenizer:
    if not isinstance(table, dict) or table.get("kind") not in ("bytes", "bpe") or table.get("kind") != cfg.tokenizer:
        raise ExportError(f"{folder}: tokenizer {table!r} is not one this Parallax reads for this model")
    if table["kind"] == "bytes":
        return ByteTokenizer()
    if table.get("file") != TOKENIZER or not isinstance(table.get("sha256"), str):
        raise ExportError(f"{folder / CONFIG}: the BPE tokenizer entry names no {TOKENIZER} and sha256")
    try:
        tokenizer = BpeTokenizer.load(folder / TOKENIZER, table["sha256"])
    except TokenizerError as e:
        raise ExportError(f"{folder}: {e}; export the model again") from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ExportError(f"{folder}: the tokenizer has {tokenizer.vocab_size} tokens, the model {cfg.vocab_size}")
    return tokenizer


def build_model(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], where: str) -> MoETransformer:
    """The model with every expert real and ``tensors`` (every non-surrogate parameter) in it, without surrogates,
    in eval mode.

    Raises:
        ExportError: a name missing or extra, or a shape that does not fit ``cfg``.
    """
    # The sizes a config.json claims are checked against the tensors at hand before a model of that size is built.
    embedding = tensors.get("tok_emb.weight")
    experts = [n for n in tensors if ".moe.experts." in n]
    if embedding is None or tuple(embedding.shape) != (cfg.vocab_size, cfg.d_model) \
            or len(experts) != cfg.n_layers * cfg.n_experts * 3:
        raise ExportError(f"{where} does not fit its model settings: the embedding or the number of expert "
                          "tensors differs from what they describe")
    model = MoETransformer(cfg, own_all(cfg), seed=0)
    wanted = {n: tuple(p.shape) for n, p in model.named_parameters() if group_of(n) != "surrogate"}
    missing, extra = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    if missing or extra:
        raise ExportError(f"{where} does not fit its model settings: lacks {missing[:3]}, extra {extra[:3]}")
    bad = [n for n, s in wanted.items() if tuple(tensors[n].shape) != s]
    if bad:
        raise ExportError(f"{where}: {bad[0]} is {tuple(tensors[bad[0]].shape)}, the model needs {wanted[bad[0]]}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in wanted:
            params[n].copy_(tensors[n])
    model.drop_surrogates()
    return model.eval()


