"""Worker offload, the in-process part (DESIGN.md section 4): the worker's Taylor-proxy update and the
composer's side of it, wired together without a network.

A composer in offload mode runs its offloaded experts without a weight gradient (``MoELayer.offloaded``;
with ``offload.input_grad``, the default, the loss's gradient still reaches their input through detached
weights), and its ``SketchRecorder`` captures x and
g = dL/dy for their selections. ``sketch.compress`` sub-samples and quantises them. A worker holding a
copy of the expert and its own AdamW state runs k steps on

    P(w) = sum_n g_n . (f_w(x_n) - y0_n) + lambda/2 sum_n ||f_w(x_n) - y0_n||^2,   y0 = f at the start

(``sketch.taylor_proxy``) and sends back the change of its weights, compressed.

Decisions, and why:
- y0 is not sent: the worker recomputes it from its own copy (one forward, no bytes). Its copy equals the
  composer's when onboarded with "raw"; with "fp16" or "ternary" it differs by that rounding, and the
  expansion is around the worker's copy. The linear term needs no y0 at all.
- Estimator: rows kept with probability p, g scaled by 1/p, so the first step's gradient is an unbiased
  estimate of the expert's gradient on the composer's tokens (Horvitz-Thompson; variance ~ (1-p)/p). The
  int8/int4 rounding of x and g is deterministic round-to-nearest: biased, within max/254 (int8) per
  chunk. Steps after the first (k > 1) re-use the sample, so they are no longer unbiased.
- Result: Delta = w - m, where m mirrors what the composer holds (the worker's onboarded copy plus every
  change it sent, decoded exactly as the composer decodes it). Whatever the codec drops stays in w - m
  and goes out with the next result: error feedback with no separate residual buffer, as in
  ``lowrank.ErrorFeedbackPublisher``. Ternary (``protocol/ternary.py``) is per-row scaled.
- The composer checks every result (codec limits: shape, finite; ||dW|| <= max_change ||W||) before
  adding it. A refused result drops the worker for that expert: the composer trains it itself again and
  applies every sketch still unanswered as a local Taylor-proxy gradient, so no step's tokens are lost.

Shape legend: N sampled selections, L latent width, F expert hidden width.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from parallax.dht.keys import ExpertId
from parallax.node.config.train import TrainConfig
from parallax.node.config.typed import apply_changes
from parallax.node.model.sketch import Sketch, accumulate_expert_gradient, compress, taylor_proxy
from parallax.node.model.transformer import SwiGLU
from parallax.node.train.composer import (
    ADAM_PREFIX,
    Composer,
    adam_state,
    adam_state_shapes,
    check_adam_state,
    load_adam_state,
    lr_lambda,
)
from parallax.protocol import codec
from parallax.protocol.errors import RemoteProtocolError

log = logging.getLogger(__name__)

Blobs = dict[str, bytes]
"""Weight name ("w_gate.weight", ...) -> a ``protocol.codec`` blob."""


def encode_tensors(tensors: Mapping[str, torch.Tensor], codec_name: str, *, rank: int = 8) -> Blobs:
    """Encode expert-shaped tensors for the wire; ternary gets one scale per row (the last dimension).

    Args:
        tensors: name -> tensor (weights or weight changes).
        codec_name: "raw", "fp16", "ternary" or "lowrank".
        rank: rank of "lowrank" per matrix.

    Returns:
        name -> blob.
    """
    out = {}
    for name, t in tensors.items():
        a = t.detach().cpu().float().numpy()
        chunk = a.shape[-1] if a.ndim else 1
        out[name] = codec.encode(a, codec_name, chunk=chunk, rank=rank)
    return out


def decode_tensors(blobs: Mapping[str, bytes], shapes: Mapping[str, torch.Size], *,
                   max_norms: Mapping[str, float] | None = None, peer: str | None = None,
                   what: str = "expert") -> dict[str, torch.Tensor]:
    """Decode and check a peer's expert-shaped tensors.

    Args:
        blobs: name -> blob, exactly the names of ``shapes``.
        shapes: the expected names and shapes.
        max_norms: per name, the largest L2 norm accepted (None: no bound).
        peer: the sender, for error messages.
        what: names the payload in error messages.

    Returns:
        name -> float32 CPU tensor.

    Raises:
        RemoteProtocolError: missing or extra names, a wrong shape, and everything ``codec.decode`` refuses
            (oversized, malformed, non-finite, norm above the bound).
    """
    if set(blobs) != set(shapes):
        raise RemoteProtocolError(f"{what}: tensors {sorted(blobs)}, expected {sorted(shapes)}", peer=peer)
    out = {}
    for name, shape in shapes.items():
        limits = codec.TensorLimits(max_elements=max(1, shape.numel()), max_ndim=len(shape),
                                    max_norm=None if max_norms is None else max_norms[name])
        a = codec.decode(blobs[name], limits, peer=peer, what=f"{what} {name}")
        if tuple(a.shape) != tuple(shape):
            raise RemoteProtocolError(f"{what} {name}: shape {a.shape}, expected {tuple(shape)}", peer=peer)
        out[name] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).reshape(shape)  # 0-d stays 0-d
    return out


def blob_bytes(blobs: Mapping[str, bytes]) -> int:
    return sum(len(b) for b in blobs.values())


STATE_BUDGET = 2 * 2**20
"""An AdamW state travels with an onboarding or a result only when the message stays under this (half of
hivemind's 4 MiB unary cap): true for the small preset (1.18 MB of state an expert), not for the report's."""

SETTINGS_KEY = "offload_settings"
"""Heartbeat ``versions`` key under which a worker announces ``settings_digest`` of its config."""


def worker_settings(cfg: TrainConfig) -> dict[str, object]:
    """Every setting a worker's answers depend on (``TaylorProxyTrainer`` and the request checks): a worker and
    a composer that differ in any of them would train the expert differently without either noticing."""
    m, o, off = cfg.model, cfg.optim, cfg.offload
    # int() and float(): `--set offload.proxy_lambda=0` parses as an int; it must hash like the default 0.0.
    return {"d_latent": int(m.d_latent), "d_expert": int(m.d_expert), "n_layers": int(m.n_layers),
            "n_experts": int(m.n_experts), "betas": [float(b) for b in o.betas],
            "weight_decay": float(o.weight_decay), "warmup_steps": int(o.warmup_steps),
            "min_lr_ratio": float(o.min_lr_ratio), "steps": int(cfg.steps), "worker_steps": int(off.worker_steps),
            "worker_lr": float(off.worker_lr), "proxy_lambda": float(off.proxy_lambda),
            "result_codec": off.result_codec, "result_rank": int(off.result_rank),
            "onboard_codec": off.onboard_codec, "lookahead": int(off.lookahead),
            "private_layers": int(off.private_layers), "state_every": int(off.state_every)}


def settings_digest(cfg: TrainConfig) -> int:
    """``worker_settings`` as a 62-bit number (it travels in a heartbeat's ``versions``)."""
    canonical = json.dumps(worker_settings(cfg), sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(canonical).digest()[:8], "big") >> 2


class TaylorProxyTrainer:
    """The worker's side for one expert: its copy, its AdamW state, and the mirror of the composer's copy.

    Args:
        cfg: the run's config (model shapes, optimizer betas and decay, cfg.offload).
        onboard: the expert's weights as the composer sent them (``encode_tensors``).
        device: where the worker's copy and its optimizer state live (the mirror stays on the CPU).
    """

    def __init__(self, cfg: TrainConfig, onboard: Mapping[str, bytes], device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        m, o = cfg.model, cfg.optim
        self.device = torch.device(device)
        self.expert = SwiGLU(m.d_latent, m.d_expert).to(self.device)
        shapes = {n: p.shape for n, p in self.expert.named_parameters()}
        weights, adam = decode_expert_state(onboard, shapes, cfg.optim.betas, what="onboarding")
        with torch.no_grad():
            for name, p in self.expert.named_parameters():
                p.copy_(weights[name].to(self.device))
        self.mirror = {n: w.clone() for n, w in weights.items()}
        self.optimizer = torch.optim.AdamW(self.expert.parameters(), lr=cfg.offload.worker_lr, betas=o.betas,
                                           weight_decay=o.weight_decay)
        if adam is not None:  # the composer's state of this expert: go on from it instead of restarting AdamW
            load_adam_state(self.optimizer, dict(self.expert.named_parameters()), *adam)
        self.results = 0
        """Results sent so far: every ``offload.state_every``-th carries the AdamW state."""
        self._state_too_big = False
        self._schedule = lr_lambda(o.warmup_steps, cfg.steps, o.min_lr_ratio)
        self.rows = 0
        """Sketch rows trained on so far (for FLOP accounting)."""
        self.onboard_step = 0
        """The composer's step when it sent these weights: older sketches are refused (the network worker)."""

    def update(self, parts: Sequence[tuple[int, Sketch]], lookahead: int | None = None) -> Blobs:
        """For each (step, sketch) in turn, k AdamW steps on its proxy at that step's learning rate; return the
        change since the last result, compressed.

        Args:
            parts: decoded sketches of this expert, oldest first, each with the composer step it was taken at
                (1-based; sets the learning rate as the composer's scheduler would for that step). One request
                carries one part, or several when the composer coalesced them (``Sketch.parts``): the weights
                then move exactly as they would for separate requests; only the answer is one.
            lookahead: momentum-only steps to extrapolate the answer by (the composer's measured lateness);
                None: cfg.offload.lookahead.

        Returns:
            name -> blob of the weight change (cfg.offload.result_codec); the mirror already includes it.
        """
        if not parts:
            raise ValueError("an update needs at least one (step, sketch) part")
        off = self.cfg.offload
        for step, sketch in parts:
            x_NL, g_NL = sketch.x_NL.float().to(self.device), sketch.g_NL.float().to(self.device)
            self.rows += x_NL.shape[0]
            for group in self.optimizer.param_groups:
                group["lr"] = off.worker_lr * self._schedule(max(step - 1, 0))
            if not x_NL.shape[0]:
                continue
            with torch.no_grad():
                y0_NL = self.expert(x_NL) if off.proxy_lambda > 0 else None
            for _ in range(off.worker_steps):
                self.optimizer.zero_grad(set_to_none=True)
                taylor_proxy(self.expert, x_NL, g_NL, y0_NL, off.proxy_lambda).backward()
                self.optimizer.step()
        step = parts[-1][0]
        current = {n: p.detach().cpu() for n, p in self.expert.named_parameters()}
        lookahead = off.lookahead if lookahead is None else lookahead
        if lookahead:
            ahead = self._momentum_steps(lookahead, step)
            current = {n: current[n] + ahead[n] for n in current}
        delta = {n: current[n] - self.mirror[n] for n in current}
        blobs = encode_tensors(delta, off.result_codec, rank=off.result_rank)
        # Decode our own bytes as the composer will, so the mirror stays bit-identical to its copy's changes.
        sent = decode_tensors(blobs, {n: t.shape for n, t in delta.items()}, what="own result")
        for n, t in sent.items():
            self.mirror[n] += t
        self.results += 1
        if off.state_every and self.results % off.state_every == 0:
            state = encode_tensors(adam_state(self.optimizer, dict(self.expert.named_parameters())), "raw")
            if blob_bytes(blobs) + blob_bytes(state) <= STATE_BUDGET:
                blobs.update(state)
            elif not self._state_too_big:
                self._state_too_big = True
                log.warning("this expert's AdamW state (%d B) does not fit a result (budget %d B): not sent, so "
                            "a fall-back restarts AdamW", blob_bytes(state), STATE_BUDGET)
        return blobs

    def _momentum_steps(self, steps: int, step: int) -> dict[str, torch.Tensor]:
        """The change ``steps`` more AdamW steps would make with zero gradients (both moments decay, the
        weight decay applies), from the optimizer's state after the sketch of composer step ``step``."""
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        out = {}
        for name, p in self.expert.named_parameters():
            state = self.optimizer.state.get(p)
            w = p.detach().clone()
            if state:
                m, v, k = state["exp_avg"].clone(), state["exp_avg_sq"].clone(), int(state["step"])
                for j in range(1, steps + 1):
                    lr = self.cfg.offload.worker_lr * self._schedule(step - 1 + j)
                    m.mul_(beta1)
                    v.mul_(beta2)
                    w.mul_(1 - lr * group["weight_decay"])
                    m_hat, v_hat = m / (1 - beta1 ** (k + j)), v / (1 - beta2 ** (k + j))
                    w.addcdiv_(m_hat, v_hat.sqrt().add_(group["eps"]), value=-lr)
            out[name] = (w - p.detach()).cpu()
        return out


def onboard_blobs(composer: Composer, expert_id: ExpertId) -> Blobs:
    """What a worker receives to start on an owned expert: its weights (cfg.offload.onboard_codec) and, once
    that state has taken ``offload.state_every`` optimizer steps and if it fits ``STATE_BUDGET``, its AdamW
    state (float32: what the composer trained it with, or its last worker's state)."""
    off = composer.cfg.offload
    snapshot = composer.expert_snapshot(expert_id)
    weights = encode_tensors({n: t for n, t in snapshot.items() if not n.startswith(ADAM_PREFIX)}, off.onboard_codec)
    optimizer_steps = float(snapshot.get(f"{ADAM_PREFIX}step", 0.0))
    if not off.state_every or optimizer_steps < off.state_every:
        return weights  # a younger state is worth less than its bytes (4x the fp16 weights)
    state = encode_tensors({n: t for n, t in snapshot.items() if n.startswith(ADAM_PREFIX)}, "raw")
    return {**weights, **state} if blob_bytes(weights) + blob_bytes(state) <= STATE_BUDGET else weights


def decode_expert_state(blobs: Mapping[str, bytes], shapes: Mapping[str, torch.Size], betas: tuple[float, float],
                        *, max_norms: Mapping[str, float] | None = None, peer: str | None = None, what: str
                        ) -> tuple[dict[str, torch.Tensor], tuple[float, dict[str, torch.Tensor]] | None]:
    """Decode expert-shaped tensors with an optional AdamW state (``adam.*`` names, all or none) and check
    both (``composer.check_adam_state``: the moments must be ones AdamW can have made).

    Returns:
        (name -> tensor of ``shapes``, (AdamW step, moments) or None).

    Raises:
        RemoteProtocolError: what ``decode_tensors`` refuses, or a state that is incomplete or impossible.
    """
    state_names = {n for n in blobs if n.startswith(ADAM_PREFIX)}
    main = decode_tensors({n: b for n, b in blobs.items() if n not in state_names}, shapes, max_norms=max_norms,
                          peer=peer, what=what)
    if not state_names:
        return main, None
    state = decode_tensors({n: blobs[n] for n in state_names}, adam_state_shapes(shapes), peer=peer,
                           what=f"{what} AdamW state")
    try:
        return main, check_adam_state(what, state, shapes, betas)
    except ValueError as e:
        raise RemoteProtocolError(str(e), peer=peer) from None


def apply_result(composer: Composer, expert_id: ExpertId, blobs: Mapping[str, bytes], *,
                 peer: str | None = None) -> None:
    """Check a worker's weight change and add it to the composer's expert (between steps); a result that
    carries the worker's AdamW state (every ``offload.state_every``-th) sets the expert's optimizer state.

    Raises:
        RemoteProtocolError: the result is malformed, misshapen, non-finite or above the norm bound
            (||dW|| > max_change x ||W||), or its AdamW state is incomplete or impossible; the expert is left
            unchanged.
    """
    params = composer.model.expert_parameters(*expert_id)
    bound = {n: composer.cfg.offload.max_change * float(p.detach().float().norm()) for n, p in params.items()}
    betas = composer.optimizer.param_groups[0]["betas"]
    delta, adam = decode_expert_state(blobs, {n: p.shape for n, p in params.items()}, betas, max_norms=bound,
                                      peer=peer, what=f"worker result for expert {expert_id}")
    with torch.no_grad():
        for name, p in params.items():
            p.add_(delta[name].to(p.device, p.dtype))
    if adam is not None:  # the worker's optimizer state: a fall-back or the next worker goes on from it
        composer.load_expert_adam(expert_id, *adam)


def fall_back(composer: Composer, expert_id: ExpertId, unanswered: list[Sketch]) -> None:
    """Take an expert back from its worker: train it here from now on, and turn the sketches the worker
    never answered into a local gradient (their mean Taylor-proxy gradient) for the coming optimizer step.

    Call between ``forward_backward`` and ``optimizer_step``.
    """
    composer.offload_expert(expert_id, False)
    layer, expert = expert_id
    module = composer.model.moe_layer(layer).experts[str(expert)]
    if unanswered:
        accumulate_expert_gradient(module, unanswered, scale=1.0 / len(unanswered))


Tamper = Callable[[int, ExpertId, int, Blobs], Blobs]
"""tamper(composer index, expert, step, result) -> the result the composer receives (fault injection)."""


class LocalWorkers:
    """Every composer's offloaded experts updated by in-process workers through the wire path.

    One ``TaylorProxyTrainer`` per (composer, owned expert outside the private layers), onboarded at
    construction. ``exchange`` is called once a step, after every composer's ``forward_backward`` and before
    its ``optimizer_step``: it compresses this step's sketches and sends them; the answers to the sketches of
    ``cfg.sim.offload_delay`` steps ago are computed and applied (delay 0: this step's own).

    Args:
        composers: the composers of the run, each built with cfg.offload.enabled.
        tamper: optional fault injection on every result before the composer checks it.
    """

    def __init__(self, composers: Sequence[Composer], *, tamper: Tamper | None = None) -> None:
        self.composers = list(composers)
        self.cfg = self.composers[0].cfg
        if self.cfg.offload.lookahead_measured:  # here the lateness is known: every answer is `delay` late
            self.cfg = apply_changes(self.cfg, {"offload.lookahead": self.cfg.sim.offload_delay})
        if self.cfg.offload.lookahead > self.cfg.sim.offload_delay:
            # Extrapolating further than the answers are late would run the composer's copy ahead of
            # the worker's: here the lateness is known exactly (none at delay 0, the default).
            if self.cfg.sim.offload_delay:
                log.info("offload.lookahead %d > sim.offload_delay %d: the workers look %d step(s) ahead",
                         self.cfg.offload.lookahead, self.cfg.sim.offload_delay, self.cfg.sim.offload_delay)
            self.cfg = apply_changes(self.cfg, {"offload.lookahead": self.cfg.sim.offload_delay})
        self.tamper = tamper
        self.trainers: dict[tuple[int, ExpertId], TaylorProxyTrainer] = {}
        self.in_flight: list[dict[tuple[int, ExpertId], tuple[int, Sketch, Sketch]]] = []
        """Per step sent, oldest first: (composer, expert) -> (step, raw sketch, decoded wire sketch)."""
        self.bytes = {"onboarding": 0, "offload_sketches": 0, "offload_results": 0}
        self.messages = {"onboarding": 0, "offload_sketches": 0, "offload_results": 0}
        """How many payloads of each kind crossed (one per expert)."""
        self.fallbacks: list[tuple[int, ExpertId, str]] = []
        """(composer, expert, reason) for every worker dropped."""
        self._dropped_rows = 0
        for i, c in enumerate(self.composers):
            for eid in c.owned_experts():
                if eid[0] >= self.cfg.offload.private_layers:
                    blobs = onboard_blobs(c, eid)
                    self.bytes["onboarding"] += blob_bytes(blobs)
                    self.messages["onboarding"] += 1
                    self.trainers[(i, eid)] = TaylorProxyTrainer(self.cfg, blobs)
                    c.offload_expert(eid, True)

    @property
    def worker_flops(self) -> float:
        """FLOPs the workers spent: per sketch row k x (forward + backward) plus the y0 forward if used."""
        m, off = self.cfg.model, self.cfg.offload
        per_row = 6.0 * m.d_latent * m.d_expert * (3 * off.worker_steps + (1 if off.proxy_lambda > 0 else 0))
        return per_row * (sum(t.rows for t in self.trainers.values()) + self._dropped_rows)

    def exchange(self) -> None:
        """Send this step's sketches; answer and apply those that arrive now (see the class docstring)."""
        off = self.cfg.offload
        sent = {}
        for i, c in enumerate(self.composers):
            for eid, raw in c.take_offload_sketches().items():
                wire = compress(raw, sample_fraction=off.sample_fraction, generator=c.sketch_rng,
                                wire_codec=off.wire_codec)
                self.bytes["offload_sketches"] += wire.wire_bytes
                self.messages["offload_sketches"] += 1
                sent[(i, eid)] = (c.step, raw, wire)
        self.in_flight.append(sent)
        if len(self.in_flight) <= self.cfg.sim.offload_delay:
            return
        for key, (step, raw, wire) in self.in_flight.pop(0).items():
            trainer = self.trainers.get(key)
            if trainer is None:
                continue  # its worker was dropped: the sketch was applied locally then
            i, eid = key
            blobs = trainer.update([(step, wire)])
            self.bytes["offload_results"] += blob_bytes(blobs)
            self.messages["offload_results"] += 1
            if self.tamper is not None:
                blobs = self.tamper(i, eid, step, blobs)
            try:
                apply_result(self.composers[i], eid, blobs, peer=f"worker-{i}-{eid[0]}-{eid[1]}")
            except RemoteProtocolError as e:
                log.warning("composer %d drops the worker of expert %s and trains it locally: %s", i, eid, e)
                self.drop(key, [raw], str(e))

    def drop(self, key: tuple[int, ExpertId], unanswered: list[Sketch], reason: str) -> None:
        """Drop a worker: its expert is trained by the composer again, every sketch it left unanswered
        (those given and those still in flight) applied as a local gradient. Call before ``optimizer_step``."""
        i, eid = key
        unanswered = unanswered + [item.pop(key)[1] for item in self.in_flight if key in item]
        self._dropped_rows += self.trainers.pop(key).rows
        self.fallbacks.append((i, eid, reason))
        fall_back(self.composers[i], eid, unanswered)
