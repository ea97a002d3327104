"""Export from a live swarm (``parallax export --initial-peers ... --run-id R``).

The exporter joins the run as a *reader*: it signs heartbeats like any peer (an allowlist run needs its member
certificate), so the composers serve it what they serve each other, but it owns nothing, counts in no quorum and
takes part in no round. From the live membership it learns who owns each expert and asks that owner for its
snapshot, which must be signed by the key the membership names for that peer (``ExpertExchange``); the shared
groups are the merged state (the anchors) several composers agree on (``StateExchange``). An owner that does not
answer is asked again, as the view changes, until ``timeout_s``: when one dies, its heir owns the expert within
seconds and serves it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from parallax.dht.claims import ShardConfig
from parallax.dht.keys import ExpertId
from parallax.dht.manifests import ManifestChoiceError
from parallax.dht.membership import Membership, Presence
from parallax.errors import DHTError
from parallax.node.config.peer import PeerConfig
from parallax.node.config.train import SHARED_GROUPS, TrainConfig
from parallax.node.export.folder import (
    Copy,
    ExportError,
    Form,
    NodeSummary,
    Provenance,
    assemble,
    build_model,
    check_copy,
    run_tokenizer_for,
    train_config_from,
    write_model,
)
from parallax.node.export.use import evaluate_on
from parallax.node.net.admission import fetch_manifest, peer_admission, peer_manifest
from parallax.node.net.expert_exchange import ExpertExchange, Snapshot
from parallax.node.net.network import NetworkLoop, run_replica_groups, start_dht
from parallax.node.outer.background import live_uid
from parallax.node.outer.state import StateExchange
from parallax.node.peer.runner import model_shapes
from parallax.node.peer.views import SwarmViews
from parallax.node.train.checkpoint import config_json
from parallax.node.train.tokenizer import Tokenizer
from parallax.protocol.identity import Identity
from parallax.protocol.manifest import RunManifest

log = logging.getLogger(__name__)

POLL_S = 1.0


def _fetched(peer: PeerConfig, digest: str | None, creator: str | None, timeout_s: float) -> RunManifest:
    try:
        manifest, choice = fetch_manifest(peer.run_id, peer.initial_peers, digest=digest, creator=creator,
                                          timeout_s=timeout_s)
    except ManifestChoiceError as e:
        raise ExportError(f"run {peer.run_id!r}: {e}") from None
    log.info("run manifest: %s", choice)
    return manifest


def _train_config(manifest: RunManifest) -> TrainConfig:
    try:
        settings = manifest.settings_dict()
    except ValueError as e:
        raise ExportError(str(e)) from None
    return train_config_from(settings, f"run {manifest.run_id}'s manifest")


def export_live(peer: PeerConfig, identity: Identity, out: str | Path, *, allow_missing: bool = False,
                digest: str | None = None, creator: str | None = None, data: str | None = None,
                timeout_s: float = 60.0,
                tokenizer: Tokenizer | None = None, license: str | None = None, form: Form = "parallax") -> Path:
    """Assemble the model of a live run and write it to ``out``.

    Args:
        peer: the run, the initial peers, this exporter's addresses, manifest and member certificate.
        identity: the key the exporter's heartbeats are signed with.
        allow_missing: write experts no live owner served as zeros instead of failing.
        digest: which manifest to take when the run has several (without ``peer.manifest``).
        creator: the fingerprint of the run's creator, which narrows the manifests alike.
        data: the corpus of the card's validation loss (None: the built-in corpus).
        timeout_s: bounds the manifest read, and then the whole fetch of the groups and the experts.
        tokenizer: the run's (None: bytes); a BPE run's is required, and must be the one its manifest names.
        license: the licence the model card and config.json give the weights (an SPDX id).
        form: the folder's layout (``folder.write_model``).

    Raises:
        ExportError: unreachable swarm, no composers, or what could not be fetched.
    """
    if not peer.initial_peers:
        raise ExportError("a live export needs --initial-peers (a peer of the run), or use --from-checkpoints")
    with contextlib.ExitStack() as stack:
        try:
            manifest = peer_manifest(peer, identity, None) if peer.manifest else _fetched(peer, digest, creator,
                                                                                           timeout_s)
            assert manifest is not None
            cfg = _train_config(manifest)
            tokenizer = run_tokenizer_for(cfg.model, tokenizer, manifest.tokenizer)
            admission = peer_admission(peer, identity, manifest)
            dht = start_dht(identity, peer, identity_path=peer.identity_path("reader"),
                            n_layers=cfg.model.n_layers, admission=admission, extra_groups=run_replica_groups(cfg))
        except DHTError as e:
            raise ExportError(f"the swarm is unreachable: {e}") from None
        stack.callback(dht.shutdown)
        membership = Membership(dht, identity, Presence(run_id=peer.run_id, role="reader", manifest=manifest),
                                shards=ShardConfig(n_layers=cfg.model.n_layers, n_experts=cfg.model.n_experts,
                                                  replicas=cfg.ownership.replicas))
        membership.start()
        stack.callback(_leave, membership)
        views = SwarmViews(membership, identity.fingerprint, 1, lambda *_a, **_k: None)  # for its key lookups
        loop = NetworkLoop(dht, "parallax-export")
        stack.callback(loop.close)
        shapes = model_shapes(cfg)
        exchange = ExpertExchange(loop.p2p, loop.loop, peer.run_id, shapes.expert, identity=identity,
                                  key_of=views.public_key_of, surrogate_shapes=shapes.surrogate,
                                  heir_targets=lambda: None, may_fetch=lambda _peer: False).start()
        stack.callback(exchange.close)
        states = StateExchange(loop.p2p, loop.loop, peer.run_id, views.trusted_peers, own_peer_id=dht.peer_id,
                               may_fetch=lambda _peer: False).start()
        stack.callback(states.close)
        deadline = time.monotonic() + timeout_s
        shared, nodes = _shared_groups(membership, states, shapes.groups, deadline)
        experts = _experts(membership, exchange, cfg, deadline, allow_missing)
    provenance = Provenance(run_id=peer.run_id, settings=config_json(cfg), license=license, nodes=[
        NodeSummary(holder=fp, step=step, tokens=step * cfg.tokens_per_step, train_loss=loss)
        for fp, (step, loss) in sorted(nodes.items())])
    state = assemble(cfg.model, [shared], experts, allow_missing=allow_missing, provenance=provenance)
    windows = {"batch_size": cfg.batch_size, "eval_batches": cfg.eval_batches, "val_fraction": 0.05}
    try:
        provenance.val_loss = evaluate_on(build_model(cfg.model, state, "the assembled model"), data,
                                          batch_size=cfg.batch_size, eval_batches=cfg.eval_batches,
                                          tokenizer=tokenizer).as_dict()
    except ValueError as e:
        log.warning("the model card gets no validation loss: %s", e)
    return write_model(out, cfg.model, state, provenance, eval_windows=windows, tokenizer=tokenizer, form=form)


def _leave(membership: Membership) -> None:
    with contextlib.suppress(Exception):  # a failed deathrattle only delays when the others forget the reader
        membership.leave("export done")


def _wait(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise ExportError(what)
    time.sleep(POLL_S)


Steps = dict[str, tuple[int, float | None]]
"""fingerprint -> (step, loss) of each live composer."""


def _shared_groups(membership: Membership, states: StateExchange, groups: dict[str, dict[str, tuple[int, ...]]],
                   deadline: float) -> tuple[Copy, Steps]:
    """The shared groups as the live composers agree on them, and each composer's (step, loss): each group's merged
    state (its anchor), or, for a group never merged yet (round 0: the anchor is the initial parameters), the
    composers' current weights of it. A group state that does not check out (shape, finiteness) is asked for
    again."""
    tensors: dict[str, torch.Tensor] = {}
    origins: dict[str, dict[str, Any]] = {}
    pending = [g for g in SHARED_GROUPS if g in groups]
    refused: list[str] = []
    while True:
        view = membership.view()
        composers = {fp: m for fp, m in view.alive().items() if m.heartbeat.role == "composer"}
        if composers:
            for group in list(pending):
                timeout = max(1.0, min(30.0, deadline - time.monotonic()))
                got = states.download(group, groups[group], timeout_s=timeout)
                live = got is not None and int(got[0]["round"]) == 0
                if live:
                    got = states.download(live_uid(group), groups[group], timeout_s=timeout)
                if got is None:
                    continue
                meta, values = got
                copy = Copy(dict(zip(groups[group], values, strict=False)), "the composers", "merged", 0, 0.0)
                why = check_copy(copy, groups[group], f"the state of {group}")  # the anchor comes first
                if why is not None:
                    refused.append(why)
                    continue
                tensors.update(copy.tensors)
                origins[group] = {"round": int(meta["round"]), "step": int(meta.get("step", 0)),
                                  "origin": f"current weights of peer {meta['source']} (never merged)" if live
                                  else "merged"}
                pending.remove(group)
            if not pending:
                break
        _wait(deadline, "no composer of the run was seen" if not composers else
              f"no agreed state of {', '.join(pending)} from the live composers" + "".join(f"; {r}" for r in refused))
    nodes = {fp: (m.heartbeat.step, m.heartbeat.loss) for fp, m in composers.items()}
    holder = f"the state of {len(composers)} composer(s), rounds " + ", ".join(
        f"{g} {o['round']}" for g, o in origins.items())
    return Copy(tensors, holder, "merged", max(s for s, _ in nodes.values()), time.time(), origins), nodes


def _experts(membership: Membership, exchange: ExpertExchange, cfg: TrainConfig, deadline: float,
             allow_missing: bool) -> dict[ExpertId, list[Copy]]:
    """Every expert's snapshot from its owner in the live assignment; asked again as the view changes."""
    out: dict[ExpertId, list[Copy]] = {}
    wanted = [(layer, e) for layer in range(cfg.model.n_layers) for e in range(cfg.model.n_experts)]
    while True:
        view = membership.view()
        assignment = view.assignment()
        asked, unserved = {}, {}
        for eid in wanted:
            if eid in out or assignment is None:
                continue
            owner = view.members.get(assignment.owner(*eid))
            if owner is not None:
                asked[eid] = (owner.fingerprint, exchange.fetch(owner.heartbeat.peer_id, eid))
        for eid, (fp, future) in asked.items():
            snap: Snapshot | str = future.result()
            if isinstance(snap, str):
                unserved[eid] = f"{fp}: {snap}"
            else:
                out[eid] = [_copy(snap, fp)]
        left = [eid for eid in wanted if eid not in out]
        if not left:
            return out
        if time.monotonic() > deadline and allow_missing:
            return out
        _wait(deadline, f"{len(left)} expert(s) were not served by their owners in time: "
              + ", ".join(f"{l}.{e}" + (f" ({unserved[l, e]})" if (l, e) in unserved else "") for l, e in left)
              + "; try again, or --allow-missing writes them as zeros")


def _copy(snap: Snapshot, holder: str) -> Copy:
    prefix = f"blocks.{snap.layer}.moe.experts.{snap.expert}."
    tensors = {prefix + n: t for n, t in snap.tensors.items() if "." in n and not n.startswith(("adam.", "surrogate."))}
    return Copy(tensors, holder, "final" if snap.final else "owner", snap.step, time.time() - snap.age_s)
