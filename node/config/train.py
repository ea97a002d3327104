"""Configuration of the model and of a composer's training, as nested frozen dataclasses.

Every field has a unit and a one-line doc; ``__post_init__`` raises ``ValueError`` saying what to change.
Presets:
    tiny    unit/integration tests: seconds on a CPU, exercises every code path (latent interface on).
    small   the CPU benchmark: 4 layers, d=128, 8 experts top-2, f=384, r=8 (f/r = 48, as the report).
    medium  a GPU user's first run: 12 layers, d=768, 32 experts top-4, latent 384, f=288, r=6, 1024 tokens.
    large   about 1B parameters: 20 layers, d=1536, 32 experts top-4, latent 768, f=576, r=12, 2048 tokens.
    report  report-sized (20B-class), used only for FLOP accounting, never instantiated.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

MergeName = Literal["rda", "mean"]
"""The merge rules (``node.train.merge_rules.MERGE_RULES``, held equal to this by a test)."""
Compression = Literal["fp16", "uint8", "int4", "topk", "none"]
GATHERED_WIRES: tuple[Compression, ...] = ("int4", "topk")
"""Wires only gathered rounds carry (hivemind's all-reduce has no such codec); each sender keeps what they leave out
of its pseudo-gradient and adds it to its next one (error feedback)."""
Aggregation = Literal["gather", "parts", "allreduce"]
DeltaDtype = Literal["float16", "float32"]
NonOwned = Literal["surrogate", "drop", "frozen_copy"]
SketchCodec = Literal["raw", "fp16", "int8", "int4"]

SHARED_GROUPS = ("router", "latent", "backbone")
"""Parameter groups every composer trains and merges DiLoCo-style, fastest cadence first."""

GROUPS = (*SHARED_GROUPS, "expert", "surrogate")
"""Every parameter belongs to exactly one group; it decides how the tensor is trained and synced."""

Tokenizer = Literal["bytes", "bpe"]
TOKENIZERS: tuple[str, ...] = get_args(Tokenizer)
"""How text becomes tokens (``ModelConfig.tokenizer``; ``node/train/tokenizer.py``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """A decoder-only transformer with MoE feed-forward layers (DESIGN.md section 2)."""

    vocab_size: int = 256
    """Tokens in the vocabulary: 256 with byte tokens; the BPE's size with ``tokenizer = "bpe"``."""
    tokenizer: Tokenizer = "bytes"
    """"bytes" (each byte a token: no tokenizer, any encoding) or "bpe" (a byte-level BPE of vocab_size tokens
    trained on the run's corpus, stored with the run: ``node/train/tokenizer.py``)."""
    seq_len: int = 128
    """Context length, tokens."""
    n_layers: int = 4
    """Transformer blocks, each attention + an MoE feed-forward layer."""
    d_model: int = 128
    """Residual stream width d."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_experts: int = 8
    """Routed experts per MoE layer, E: the router's global namespace."""
    top_k: int = 2
    """Experts each token is routed to."""
    d_expert: int = 384
    """Hidden width f of a routed expert (SwiGLU l -> f -> l)."""
    d_surrogate: int = 8
    """Hidden width r of a surrogate (SwiGLU l -> r -> l), r << f."""
    d_latent: int = 128
    """Latent interface width l: experts work in l. l == d_model disables the interface."""
    d_shared: int = 0
    """Hidden width of the always-on shared expert (backbone); 0 = none."""
    renormalize_gates: bool = True
    """Renormalise the top-k softmax probabilities to sum to 1 per token."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss E * sum_e f_e * P_e over all E experts."""
    rope_base: float = 10000.0
    """Rotary position embedding base."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "n_experts", "top_k",
                    "d_expert", "d_surrogate", "d_latent")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("the head dimension d_model/n_heads must be even (rotary embeddings)")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} cannot exceed n_experts={self.n_experts}")
        if self.d_latent > self.d_model:
            raise ValueError(f"d_latent={self.d_latent} must be <= d_model={self.d_model} (equal disables it)")
        if self.d_surrogate > self.d_expert:
            raise ValueError(f"d_surrogate={self.d_surrogate} must be <= d_expert={self.d_expert}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"ModelConfig.tokenizer must be bytes or bpe, got {self.tokenizer!r}")
        if self.tokenizer == "bytes" and self.vocab_size < 256:
            raise ValueError(f"byte tokens need ModelConfig.vocab_size >= 256, got {self.vocab_size}")
        if self.tokenizer == "bpe" and self.vocab_size < 512:
            raise ValueError(f"a BPE needs ModelConfig.vocab_size >= 512 (256 bytes and their merges), got "
                             f"{self.vocab_size}: set model.vocab_size=8192, say")
        if self.d_shared < 0 or self.aux_loss_weight < 0:
            raise ValueError("d_shared and aux_loss_weight must be >= 0")

    @property
    def has_latent(self) -> bool:
        return self.d_latent != self.d_model


InnerOptimizer = Literal["adamw", "muon"]
INNER_OPTIMIZERS: tuple[str, ...] = get_args(InnerOptimizer)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """The inner (per-composer) optimizer."""

    inner: InnerOptimizer = "adamw"
    """"adamw" for every parameter, or "muon": Muon (Newton-Schulz orthogonalised momentum, torch's, with its
    learning rate scaled to match AdamW's update size) for the hidden matrices, AdamW for the token embedding
    (tied to the output head), norm gains and other vectors. Muon runs in ``parallax sim`` only: a node hands
    experts over with their AdamW state."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 20
    """Linear warm-up, steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of lr (reached at the last step)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("OptimConfig needs lr > 0, warmup_steps >= 0, 0 <= min_lr_ratio <= 1")
        if self.inner not in INNER_OPTIMIZERS:
            raise ValueError(f"optim.inner must be one of {INNER_OPTIMIZERS}, got {self.inner!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnershipConfig:
    """How many composers own each routed expert."""

    replicas: int = 1
    """R: each expert is trained by R distinct owners (the top R of the bounded-load rendezvous ranking,
    balanced by capacity), each on its own tokens, and averaged among them on the backbone's cadence. R = 1 is
    Parallax (disjoint shards); R = C is the DiLoCo reference (every composer trains every expert). Each step
    costs R/C of the expert compute and memory of a full copy. Nodes and the simulator both run it (not with
    offload); a node's co-owners merge each set of shared experts in a gathered round (``node.outer.replicas``)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"ownership.replicas must be >= 1, got {self.replicas}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    """Tiered DiLoCo outer sync of the shared groups (router, latent, backbone)."""

    outer_lr: float = 1.0
    """Outer learning rate. 1.0 with momentum 0 is plain parameter averaging (docs/decisions.md, "Outer
    optimizer"); DiLoCo's defaults are lr 0.7, momentum 0.9."""
    outer_momentum: float = 0.0
    """Outer Nesterov momentum (0 disables momentum; DiLoCo uses 0.9)."""
    periods: dict[str, int] = field(default_factory=lambda: {"router": 25, "latent": 50, "backbone": 100})
    """Inner steps between merges of each shared group, H_G."""
    merge: MergeName = "rda"
    """How pseudo-gradients are merged: "rda" (radial-directional) or "mean"."""
    compression: Compression = "int4"
    """Wire format of the outer merge: "fp16", "uint8" (8 bits an entry), "int4" (4 bits an entry, a scale per 1024,
    the rounding error kept by the sender for its next rounds), "topk" (each 4096 entries' 64 largest at 2 bits,
    the rest kept by the sender) or "none"; "int4" and "topk" are for gathered rounds only. Tensors under 4096
    entries always go uncompressed. The in-process simulator applies the same rounding."""
    aggregation: Aggregation = "parts"
    """How the composers merge: "parts" (each sender of a set merges its blocks of every contribution, robustly:
    weights capped by the schedule, non-finite ones refused, norms clipped, CenteredClip; and fetches the others'
    merged blocks, some recomputed at random: ``node.outer.partitioned``; bytes per peer flat in the swarm's size),
    "gather" (the same robust merge, each sender fetching every pseudo-gradient and merging them all itself: n - 1
    bodies per peer) or "allreduce" (hivemind's butterfly all-reduce: fewer bytes, every peer trusted)."""

    def __post_init__(self) -> None:
        if set(self.periods) != set(SHARED_GROUPS):
            raise ValueError(f"SyncConfig.periods needs exactly the groups {SHARED_GROUPS}, got {sorted(self.periods)}")
        if any(p <= 0 for p in self.periods.values()):
            raise ValueError("every SyncConfig period must be a positive number of steps")
        if self.compression not in get_args(Compression):
            raise ValueError(f"SyncConfig.compression must be one of {get_args(Compression)}, got "
                             f"{self.compression!r}")
        if self.compression in GATHERED_WIRES and self.aggregation == "allreduce":
            raise ValueError(f"SyncConfig.compression {self.compression!r} needs aggregation 'gather' or 'parts' "
                             "(hivemind's all-reduce has no such codec): set sync.aggregation=gather or another "
                             "compression")
        if self.aggregation not in get_args(Aggregation):
            raise ValueError(f"SyncConfig.aggregation must be one of {get_args(Aggregation)}, got "
                             f"{self.aggregation!r}")
        if self.merge not in get_args(MergeName):
            raise ValueError(f"SyncConfig.merge must be 'rda' or 'mean', got {self.merge!r}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError("SyncConfig needs outer_lr > 0 and 0 <= outer_momentum < 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class SurrogateConfig:
    """How owners refresh the surrogates of their experts and publish the change."""

    refresh_every: int = 25
    """Inner steps between refreshes, S."""
    distill_steps: int = 64
    """Optimizer steps of ||s(x) - E(x)||^2 per refresh (docs/decisions.md measures 8 against 64)."""
    distill_lr: float = 3e-3
    """Adam learning rate of the distillation (the distiller's state is discarded after each refresh)."""
    jacobian_weight: float = 0.0
    """Weight of the input-gradient term of the distillation (``surrogate.distill``): the surrogate also
    learns to pass back what its expert would, J_E(x)^T u. 0: outputs only."""
    buffer_tokens: int = 2048
    """Most recent routed activations kept per owned expert for distillation."""
    delta_rank: int = 8
    """Rank of the published low-rank delta (error feedback carries the rest)."""
    input_grad: bool = True
    """Backpropagate through non-owned stand-ins into their input (the latent interface and backbone then
    learn from every selection, as in the baseline); their weights stay frozen. Costs ~2x their forward
    (a surrogate's: r/f of an expert's); docs/decisions.md measures it."""
    delta_dtype: DeltaDtype = "float16"
    """Width of the published delta's numbers: "float16" (half the bytes; error feedback carries the
    rounding to the next refresh) or "float32"."""
    non_owned: NonOwned = "surrogate"
    """What a non-owned selection calls: "surrogate", "drop" (output zero) or "frozen_copy" (full expert)."""

    def __post_init__(self) -> None:
        if min(self.refresh_every, self.distill_steps, self.buffer_tokens, self.delta_rank) <= 0:
            raise ValueError("SurrogateConfig periods, steps, buffer and rank must be positive")
        if self.jacobian_weight < 0:
            raise ValueError(f"SurrogateConfig.jacobian_weight must be >= 0, got {self.jacobian_weight}")
        if self.delta_dtype not in get_args(DeltaDtype):
            raise ValueError(f"SurrogateConfig.delta_dtype must be float16 or float32, got {self.delta_dtype!r}")
        if self.non_owned not in get_args(NonOwned):
            raise ValueError(f"non_owned must be surrogate, drop or frozen_copy, got {self.non_owned!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SketchConfig:
    """Sketched expert gradients: non-owners send (x, dL/dy) of their non-owned selections to the owner."""

    enabled: bool = False
    """Owners add the Taylor-proxy gradient of other composers' sketches to their experts' gradients."""
    sample_fraction: float = 1.0
    """Probability of keeping each selection in a sketch (kept rows are scaled by 1/p: unbiased)."""
    delay: int = 1
    """Steps between computing a sketch and its owner applying it (network latency; 0 = same step)."""
    wire_codec: SketchCodec = "int8"
    """Codec of x and g on the wire: raw, fp16, int8 or int4 (parallax.protocol.codec)."""

    def __post_init__(self) -> None:
        if not 0 < self.sample_fraction <= 1:
            raise ValueError(f"SketchConfig.sample_fraction must be in (0, 1], got {self.sample_fraction}")
        if self.delay < 0:
            raise ValueError("SketchConfig.delay must be >= 0 steps")
        if self.wire_codec not in get_args(SketchCodec):
            raise ValueError(f"SketchConfig.wire_codec must be raw, fp16, int8 or int4, got {self.wire_codec!r}")


SimData = Literal["shards", "stream"]
LateMerge = Literal["progress", "drop", "freeze"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """Levers that only the in-process simulator (``parallax sim``, ``parallax bench``) runs: a networked node has
    no path for them, and refuses a configuration that changes any of them."""

    sketch: SketchConfig = field(default_factory=SketchConfig)
    """Non-owners send sketches of their selections' (x, dL/dy) to the owners."""
    dense_steps: int = 0
    """A dense start-up phase: for the first dense_steps inner steps every composer trains every expert, merged
    with the backbone on its cadence as in the DiLoCo reference; then the experts are merged once more and split
    into the shards. 0 = split from the start."""
    offload_delay: int = 0
    """Steps between a sketch and the composer applying its worker's answer. 0 = the same step (a networked
    composer that waits for its workers, ``offload.wait_s``); 1+ = a composer that does not wait, on a round trip
    of that many steps."""
    outer_group_size: int = 0
    """Each outer round merges among groups of at most this many composers, drawn anew each round (the Moshpit
    schedule: a peer's bytes bounded by the group, not the swarm); 0 = every composer in one group, as the
    networked rounds do."""
    outer_parts: int = 0
    """A gathered round's robust merge computed as this many peers would share it, each merging its blocks of
    everyone's contributions (``train.parts``): a tensor larger than 1/outer_parts of the group's entries is merged
    in row blocks of its own. 0 or 1 = whole tensors, as the networked rounds merge."""
    merge_lag: int = 0
    """Inner steps between an outer round's contributions and its merge landing on the composers (every round's: the
    shared groups' and the replicated experts'), as a node's background rounds land a round that took that many of
    its steps; what the composer does with the group meanwhile is ``late_merge``'s. 0 = at once, the composers waiting
    for it (DiLoCo). The merges of the run's end and of ``dense_steps``' split land at once. Below the shortest
    ``sync.periods``: a node skips a group's round while the last one is on its way, which the simulator does not
    model."""
    data: SimData = "shards"
    """What each composer samples its batches from: "shards" gives composer i the i-th of C slices of the training
    split; "stream" gives every composer the whole split, each with its own seed, as networked composers sample the
    run's whole corpus (``data.data_seed``)."""
    late_merge: LateMerge = "progress"
    """What a composer does with a group while its merge is on its way (``merge_lag``): "progress" trains it and keeps
    what it trained on top of the new anchor when the merge lands (a node's background rounds); "drop" trains it and
    the merge replaces what it trained meanwhile; "freeze" leaves it as it was when the round took its pseudo-gradient
    (the other parameters train), so the merge lands on the parameters it was computed from."""

    def __post_init__(self) -> None:
        if self.outer_parts < 0:
            raise ValueError("sim.outer_parts must be >= 0 (0: whole tensors)")
        if self.data not in get_args(SimData):
            raise ValueError(f"sim.data must be one of {get_args(SimData)}, got {self.data!r}")
        if self.late_merge not in get_args(LateMerge):
            raise ValueError(f"sim.late_merge must be one of {get_args(LateMerge)}, got {self.late_merge!r}")
        if self.dense_steps < 0 or self.offload_delay < 0 or self.merge_lag < 0:
            raise ValueError("sim.dense_steps, sim.offload_delay and sim.merge_lag must be >= 0 steps")
        if self.outer_group_size < 0 or self.outer_group_size == 1:
            raise ValueError("sim.outer_group_size must be 0 (every composer) or at least 2")


ResultCodec = Literal["ternary", "lowrank", "fp16"]
RESULT_CODECS: tuple[str, ...] = get_args(ResultCodec)
OnboardCodec = Literal["ternary", "fp16", "raw"]
ONBOARD_CODECS: tuple[str, ...] = get_args(OnboardCodec)
MAX_WAIT_S = 60.0
"""Longest offload.wait_s: a composer should not stall a minute a step on a worker (drop it instead)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """Worker offload (DESIGN.md section 4): owned experts run forward only on the composer, a worker
    updates them from sketches of (x, dL/dy) with a Taylor-proxy objective and sends the weight change."""

    enabled: bool = False
    """Hand the update of owned experts (outside the private layers) to workers."""
    worker_steps: int = 1
    """AdamW steps the worker takes on the proxy objective per sketch, k (1 = the composer's own step)."""
    worker_lr: float = 3e-3
    """Peak learning rate of the worker's AdamW; it follows the composer's warm-up and cosine schedule by
    the sketch's step (the composer's optim.lr, 3e-3 by default, reproduces direct ownership)."""
    proxy_lambda: float = 0.0
    """lambda of the proxy's trust term lambda/2 ||f(x) - y0||^2, per (token, latent unit) of the
    sketch's mean-loss scale; 0 = the linear proxy. Matters only with worker_steps > 1."""
    sample_fraction: float = 1.0
    """Probability of keeping each owned selection in a sketch (kept rows' g scaled by 1/p: unbiased)."""
    wire_codec: SketchCodec = "int8"
    """Codec of the sketch's x and g: raw, fp16, int8 or int4 (parallax.protocol.codec)."""
    result_codec: ResultCodec = "ternary"
    """How the worker sends a weight change: "ternary" (1.6 bits a weight, per-row scale, error feedback
    on the worker), "lowrank" (rank result_rank per matrix, error feedback) or "fp16"."""
    result_rank: int = 8
    """Rank of a "lowrank" result per weight matrix, at most 64."""
    onboard_codec: OnboardCodec = "fp16"
    """How a worker receives its expert's weights: "fp16", "raw" (the worker's copy then equals the
    composer's) or "ternary" (1.6 bits a weight: the worker trains a ternary copy's Jacobian)."""
    private_layers: int = 0
    """The experts of the first K layers are never offloaded (updated on the composer, as without offload)."""
    lookahead: int = 1
    """Delay compensation: the worker sends its weights extrapolated by this many of its own AdamW steps
    with no new gradient (momentum only), so a composer that applies the result that many steps late runs
    roughly the weights the worker will have by then; the next result takes the extrapolation back.
    0 = send the weights as they are. Meant for worker_steps = 1; the simulator caps it at sim.offload_delay."""
    lookahead_measured: bool = False
    """Over the network: ask each worker to extrapolate by the lateness this composer measures for the expert
    (steps from a request's newest sketch to its applied result, a moving average, rounded, at most 16) instead
    of offload.lookahead. In process every answer is sim.offload_delay steps late: the lookahead is then that."""
    wait_s: float = 10.0
    """Over the network: after sending a step's sketches, wait up to this many seconds for the answers of every
    request in flight and apply them before the next step, so a worker that answers within it is no step late.
    The composer idles while it waits (it trains at its workers' pace when they are slower). 0 = never wait:
    answers are applied when they arrive, the round trip in steps late (docs/decisions.md compares both)."""
    clip_sketches: bool = True
    """Scale a sketch's g by the composer's gradient-clip coefficient of its step (optim.grad_clip), so the
    worker's expert gradient is clipped with the rest of the step as direct ownership clips it."""
    input_grad: bool = True
    """Let the loss's gradient flow through an offloaded expert into its input (its weights get none: the
    worker updates them), as ``surrogate.input_grad`` does for stand-ins; 2x the expert's forward."""
    max_change: float = 0.5
    """A result is refused when ||dW||_F > max_change x ||W||_F for a weight (a poisoned or broken worker)."""
    state_every: int = 100
    """Every this many results of an expert, the worker sends its AdamW state too (float32 moments: 2x the
    expert's weights); the composer keeps it as the expert's optimizer state, so a fall-back, the next worker and
    a checkpoint go on from it instead of restarting AdamW. Only where it fits half a unary message
    (``offload.STATE_BUDGET``). 0: never."""

    def __post_init__(self) -> None:
        if self.worker_steps < 1 or self.worker_lr <= 0 or self.proxy_lambda < 0:
            raise ValueError("OffloadConfig needs worker_steps >= 1, worker_lr > 0 and proxy_lambda >= 0")
        if not 0 < self.sample_fraction <= 1:
            raise ValueError(f"OffloadConfig.sample_fraction must be in (0, 1], got {self.sample_fraction}")
        if self.wire_codec not in get_args(SketchCodec):
            raise ValueError(f"OffloadConfig.wire_codec must be raw, fp16, int8 or int4, got {self.wire_codec!r}")
        if self.result_codec not in RESULT_CODECS:
            raise ValueError(f"OffloadConfig.result_codec must be one of {RESULT_CODECS}, got {self.result_codec!r}")
        if self.onboard_codec not in ONBOARD_CODECS:
            raise ValueError(f"OffloadConfig.onboard_codec must be one of {ONBOARD_CODECS}, "
                             f"got {self.onboard_codec!r}")
        if self.state_every < 0:
            raise ValueError(f"OffloadConfig.state_every must be >= 0 (0 = never), got {self.state_every}")
        if not 0 <= self.wait_s <= MAX_WAIT_S:
            raise ValueError(f"OffloadConfig.wait_s must be in [0, {MAX_WAIT_S}] seconds, got {self.wait_s}")
        if self.lookahead < 0:
            raise ValueError(f"OffloadConfig.lookahead must be >= 0 (0 = no extrapolation), got {self.lookahead}")
        if not 1 <= self.result_rank <= 64 or self.private_layers < 0 or self.max_change <= 0:
            raise ValueError("OffloadConfig needs 1 <= result_rank <= 64 (the receivers' cap), private_layers >= 0 "
                             "and max_change > 0")


Kernel = Literal["auto", "grouped_mm", "slices", "reference"]
KERNELS: tuple[str, ...] = get_args(Kernel)
Precision = Literal["auto", "fp32", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeConfig:
    """How this composer computes its step, chosen for its own hardware: every choice gives the same step up to
    rounding, so composers of one run may differ here."""

    kernel: Kernel = "auto"
    """How an MoE layer runs its experts (``KERNELS``): every kernel but "reference" sorts the selections by expert
    once. "auto": on CUDA the owned experts as one grouped GEMM and the surrogates as one batched matmul, on a CPU
    a matmul per expert on its slice; "grouped_mm" and "slices" force one way; "reference" is a mask and a gather
    per expert."""
    precision: Precision = "auto"
    """"bf16": autocast to bfloat16 on CUDA, float32 master weights and optimizer state; "fp32"; "auto": bf16 on
    a CUDA device that supports it, fp32 elsewhere (on a CPU bf16 is slower than fp32)."""
    compile: bool = False
    """``torch.compile`` each block's attention (the expert dispatch stays eager: its shapes change every step)."""
    checkpoint: bool = False
    """Activation checkpointing: keep each block's input only and recompute the block in the backward pass
    (about a third more compute for the activations of one block instead of all). Not with sketches or offload,
    whose hooks would run twice."""

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"compute.kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"compute.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One composer's training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    surrogate: SurrogateConfig = field(default_factory=SurrogateConfig)
    ownership: OwnershipConfig = field(default_factory=OwnershipConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    """Levers of the in-process simulator only; ``node join`` and ``worker join`` refuse any change here."""
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    """Kernels, precision, compilation, activation checkpointing: each composer's own."""
    batch_size: int = 8
    """Sequences per composer step."""
    steps: int = 500
    """Inner steps per composer."""
    seed: int = 0
    """Seed of the model initialisation and of every data sampler (per composer: seed + index)."""
    eval_batches: int = 16
    """Validation batches (fixed windows) per evaluation."""
    eval_every: int = 100
    """Steps between evaluations on the validation windows: the simulator's history, a node's ``eval`` metrics events,
    val loss in its status and trackers (0 = only at the end: the simulator's, a node's with ``--final-eval``)."""

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.steps <= 0 or self.eval_batches <= 0:
            raise ValueError("batch_size, steps and eval_batches must be positive")
        if self.eval_every < 0:
            raise ValueError("eval_every must be >= 0 (0 = evaluate only at the end)")
        if self.compute.checkpoint and (self.offload.enabled or self.sim.sketch.enabled):
            raise ValueError("compute.checkpoint does not combine with offload or sketches (their hooks would run "
                             "again in the recomputation): set compute.checkpoint=false or turn those off")
        if self.sim.merge_lag >= min(self.sync.periods.values()):
            raise ValueError(f"sim.merge_lag={self.sim.merge_lag} must be below the shortest of sync.periods "
                             f"{self.sync.periods}: a node skips a group's round while the last one is on its way, "
                             "which the simulator does not model")
        if self.offload.enabled and self.offload.private_layers > self.model.n_layers:
            raise ValueError(f"offload.private_layers={self.offload.private_layers} exceeds the model's "
                             f"{self.model.n_layers} layers")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(seq_len=32, n_layers=2, d_model=32, n_heads=2, n_experts=4, top_k=2,
                        d_expert=48, d_surrogate=4, d_latent=24, d_shared=16),
    # small: a shared expert of width 96 every token passes through, its width taken from the routed experts (384 ->
    # 352): total parameters 0.952x, active a token 1.033x the routed-only shape's (docs/decisions.md).
    "small": ModelConfig(seq_len=128, n_layers=4, d_model=128, n_heads=4, n_experts=8, top_k=2,
                         d_expert=352, d_surrogate=8, d_latent=128, d_shared=96),
    # GPU presets, f/r = 48 as the report, with a BPE of the run's corpus. medium: 172M parameters (58M active a
    # token); large: 1.15B.
    "medium": ModelConfig(vocab_size=8192, tokenizer="bpe", seq_len=1024, n_layers=12, d_model=768, n_heads=12,
                          n_experts=32, top_k=4, d_expert=288, d_surrogate=6, d_latent=384),
    "large": ModelConfig(vocab_size=32768, tokenizer="bpe", seq_len=2048, n_layers=20, d_model=1536, n_heads=12,
                         n_experts=32, top_k=4, d_expert=576, d_surrogate=12, d_latent=768),
    # Report-sized: f/r = 48 with a rank-64 surrogate. Only for FLOP accounting.
    "report": ModelConfig(vocab_size=131072, seq_len=4096, n_layers=24, d_model=2048, n_heads=16,
                          n_experts=64, top_k=8, d_expert=3072, d_surrogate=64, d_latent=1024),
}


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset; ``ValueError`` lists the names on a typo."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` re-exported so callers read ``config.replace(cfg, steps=10)``."""
    return dataclasses.replace(cfg, **changes)


def train_config(preset_name: str = "small", *, steps: int | None = None, batch_size: int | None = None,
                 seed: int | None = None) -> TrainConfig:
    """A TrainConfig for a model preset with the CLI's common overrides (None keeps the default)."""
    cfg = TrainConfig(model=preset(preset_name))
    overrides: dict[str, Any] = {k: v for k, v in (("steps", steps), ("batch_size", batch_size), ("seed", seed))
                                 if v is not None}
    return dataclasses.replace(cfg, **overrides)


LOCAL_SETTINGS = ("offload", "sim", "compute", "eval_batches", "eval_every")
"""Sections and fields of ``TrainConfig`` that each composer chooses for itself; every other one must agree
across the run (model shapes, optimizer and schedule, merges, surrogates, batch, steps, seed)."""


def run_settings(cfg: TrainConfig) -> str:
    """The settings every composer of a run must share, as canonical JSON (sorted keys, no spaces).

    Composers carry it in their heartbeats and ignore those whose settings differ (``dht.membership``): a node
    started with another ``--preset`` or ``--set optim.lr=...`` would otherwise be handed experts whose
    snapshots it cannot read, or be averaged with nodes that train differently.
    """
    shared = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in LOCAL_SETTINGS}
    return json.dumps(shared, sort_keys=True, separators=(",", ":"))
