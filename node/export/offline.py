"""Export from checkpoint folders (``parallax export --from-checkpoints DIR ...``): every composer's checkpoint
holds the experts it owned and its copy of the shared groups; together they hold the model."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from parallax.dht.keys import ExpertId
from parallax.node.export.folder import (
    Copy,
    ExportError,
    Form,
    NodeSummary,
    Provenance,
    assemble,
    build_model,
    run_tokenizer_for,
    train_config_from,
    write_model,
)
from parallax.node.export.use import evaluate_on
from parallax.node.train.checkpoint import CheckpointError, read_weights
from parallax.node.train.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def export_checkpoints(folders: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *,
                       allow_missing: bool = False, data: str | os.PathLike[str] | None = None,
                       val_fraction: float = 0.05, tokenizer: Tokenizer | None = None,
                       license: str | None = None, form: Form = "parallax") -> Path:
    """Assemble the model from composers' checkpoints and write it to ``out``.

    Each expert comes from the newest checkpoint that holds it; the shared groups from the newest checkpoint, each
    as of its last outer round (the merged state a live export takes too), or its own weights of a group it never
    merged. The model card names the round and step of every group.
    The model card gets the loss of the exported model on ``data``'s validation windows.

    Args:
        folders: checkpoint roots (``--checkpoint-dir``, their ``latest`` is read) or ``step-N`` folders.
        out: the model folder to create.
        allow_missing: write experts no checkpoint holds as zeros instead of failing.
        data: the corpus for the card's validation loss (None: the built-in corpus).
        val_fraction: the held-out tail of ``data``, as in training.
        tokenizer: the run's (None: bytes); a BPE run's is required (its file is copied into the model).
        license: the licence the model card and config.json give the weights (an SPDX id).
        form: the folder's layout (``folder.write_model``).

    Raises:
        ExportError: no folders, folders of different runs or model shapes, unreadable checkpoints, missing
            experts (without ``allow_missing``).
    """
    if not folders:
        raise ExportError("no checkpoint folders given; pass the --checkpoint-dir of each composer")
    shared: list[Copy] = []
    experts: dict[ExpertId, list[Copy]] = {}
    nodes: list[NodeSummary] = []
    run_ids: dict[str, str] = {}
    models: dict[str, str] = {}
    config = None
    for folder in folders:
        try:
            weights = read_weights(folder)
        except CheckpointError as e:
            raise ExportError(f"cannot read checkpoint {folder}: {e}") from None
        info, held = weights.info, weights.experts
        # Each shared group as of its last outer round (every composer's consensus), or, while it was never
        # merged, this composer's own weights of it: an initial anchor is no model.
        own_shared = dict(weights.shared)
        groups = {}
        for group, anchor in weights.merged.items():
            merged = weights.rounds[group] > 0
            if merged:
                own_shared.update({n: t for n, t in anchor.items() if n in weights.shared})
            groups[group] = {"round": weights.rounds[group], "step": info.step,
                             "origin": "merged" if merged else "own weights (never merged)"}
        holder = str(folder)
        run_ids[holder] = info.run_id
        models[holder] = json.dumps(info.config.get("model"), sort_keys=True)
        config = config or info.config
        nodes.append(NodeSummary(holder=holder, step=info.step, tokens=info.tokens_seen, data=info.data))
        shared.append(Copy(own_shared, holder, "checkpoint", info.step, info.saved_unix_s, groups))
        for layer, owned in enumerate(info.owned):
            for expert in owned:
                prefix = f"blocks.{layer}.moe.experts.{expert}."
                tensors = {n: t for n, t in held.items() if n.startswith(prefix)}
                experts.setdefault((layer, expert), []).append(
                    Copy(tensors, holder, "checkpoint", info.step, info.saved_unix_s))
    if len(set(run_ids.values())) > 1:
        raise ExportError(f"the checkpoints belong to different runs: {run_ids}; export one run at a time")
    if len(set(models.values())) > 1:
        raise ExportError("the checkpoints hold models of different shapes; export one run at a time")
    assert config is not None
    train = train_config_from(config, f"checkpoint {folders[0]}")
    cfg = train.model
    provenance = Provenance(run_id=next(iter(run_ids.values())), nodes=nodes, settings=config, license=license)
    state = assemble(cfg, shared, experts, allow_missing=allow_missing, provenance=provenance)
    batch_size, eval_batches = train.batch_size, train.eval_batches
    windows = {"batch_size": batch_size, "eval_batches": eval_batches, "val_fraction": val_fraction}
    tokenizer = run_tokenizer_for(cfg, tokenizer)
    model = build_model(cfg, state, "the assembled model")
    try:
        provenance.val_loss = evaluate_on(model, data, batch_size=batch_size, eval_batches=eval_batches,
                                          val_fraction=val_fraction, tokenizer=tokenizer).as_dict()
    except ValueError as e:
        log.warning("the model card gets no validation loss: %s", e)
    return write_model(out, cfg, state, provenance, eval_windows=windows, tokenizer=tokenizer, form=form)
