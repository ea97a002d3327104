"""The Hugging Face form of an exported model: a folder ``transformers.AutoModelForCausalLM`` loads as a standard
architecture, with no modeling code of its own, so that the tools built on transformers (lm-eval) read it as they
read any Mixtral or Qwen-MoE checkpoint, and those that support the two architectures (vLLM, llama.cpp's
converter) have what they need: neither of those two is run here (docs/decisions.md says what may stop them).

Parallax's model maps exactly onto one of two standard decoders (docs/decisions.md, "The Hugging Face form"):

- **Mixtral** when there is no shared expert and the top-k gates are renormalised (the small preset and up);
- **Qwen2-MoE** otherwise (the tiny preset's shared expert; gates as the router gives them).

The mapping changes no function, only the form of the weights:

- the latent interface is folded into the experts: ``latent_up · W_down`` and ``W_gate · latent_down`` (and
  ``W_up · latent_down``) are each one matrix, because ``latent_up`` is linear and is applied to the gated sum of
  the experts' outputs (products in float64, stored in float32);
- the fused ``qkv`` projection is split into ``q_proj``, ``k_proj``, ``v_proj`` (one key-value head per head);
- Qwen2-MoE scales its shared expert by ``sigmoid(shared_expert_gate · x)``: that gate is written as zeros (a
  constant 1/2) and the shared expert's down projection doubled, which is exact in floating point; its q, k and
  v biases are zeros; with no shared expert at all (gates not renormalised) the shared expert is one unit wide
  and zero, so it adds nothing;
- the RMSNorm epsilon is float32's machine epsilon, the one ``torch.nn.RMSNorm`` uses by default;
- the surrogates are not part of the model (nothing selects them once every expert is real).

Weights are named as the architectures' published checkpoints name them (one tensor per expert): the names
transformers loads (version 5 fuses the experts as it loads them) and the converters of those checkpoints expect.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from parallax.node.config.train import ModelConfig
from parallax.node.train.tokenizer import BpeTokenizer, Tokenizer

Architecture = Literal["MixtralForCausalLM", "Qwen2MoeForCausalLM"]

RMS_EPS = torch.finfo(torch.float32).eps
"""``torch.nn.RMSNorm(eps=None)`` on float32 activations."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def architecture(cfg: ModelConfig) -> Architecture:
    """The standard decoder ``cfg`` maps onto exactly (module docstring)."""
    return "MixtralForCausalLM" if cfg.d_shared == 0 and cfg.renormalize_gates else "Qwen2MoeForCausalLM"


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of the Hugging Face form."""
    arch = architecture(cfg)
    common: dict[str, Any] = {
        "architectures": [arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.d_model // cfg.n_heads, "hidden_act": "silu", "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": RMS_EPS, "tie_word_embeddings": True, "attention_dropout": 0.0, "use_cache": True,
        "num_experts_per_tok": cfg.top_k, "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "router_aux_loss_coef": cfg.aux_loss_weight, "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    if arch == "MixtralForCausalLM":
        return common | {"model_type": "mixtral", "num_local_experts": cfg.n_experts,
                         "intermediate_size": cfg.d_expert, "sliding_window": None, "router_jitter_noise": 0.0}
    return common | {"model_type": "qwen2_moe", "num_experts": cfg.n_experts, "moe_intermediate_size": cfg.d_expert,
                     "intermediate_size": cfg.d_expert, "shared_expert_intermediate_size": max(cfg.d_shared, 1),
                     "norm_topk_prob": cfg.renormalize_gates, "decoder_sparse_step": 1, "mlp_only_layers": [],
                     "qkv_bias": True, "use_sliding_window": False, "sliding_window": None,
                     "max_window_layers": cfg.n_layers}


def hf_tensors(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face form's weights from an exported model's (``folder.assemble``'s names), float32.

    Raises:
        KeyError: ``state`` lacks a tensor the model has.
    """
    arch = architecture(cfg)
    moe, (w_gate, w_up, w_down) = (("block_sparse_moe", ("w1", "w3", "w2")) if arch == "MixtralForCausalLM"
                                   else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    D = cfg.d_model
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm_f.weight"]}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        qkv = state[f"{ours}.attn.qkv.weight"]
        out |= {f"{theirs}.input_layernorm.weight": state[f"{ours}.attn_norm.weight"],
                f"{theirs}.post_attention_layernorm.weight": state[f"{ours}.moe_norm.weight"],
                f"{theirs}.self_attn.q_proj.weight": qkv[:D], f"{theirs}.self_attn.k_proj.weight": qkv[D:2 * D],
                f"{theirs}.self_attn.v_proj.weight": qkv[2 * D:],
                f"{theirs}.self_attn.o_proj.weight": state[f"{ours}.attn.proj.weight"],
                f"{theirs}.{moe}.gate.weight": state[f"{ours}.moe.router.weight"]}
        down = state.get(f"{ours}.moe.latent_down.weight")  # [L, D], absent when the latent interface is off
        up = state.get(f"{ours}.moe.latent_up.weight")  # [D, L]
        for e in range(cfg.n_experts):
            expert = f"{ours}.moe.experts.{e}"
            parts = {w_gate: _fold(state[f"{expert}.w_gate.weight"], right=down),
                     w_up: _fold(state[f"{expert}.w_up.weight"], right=down),
                     w_down: _fold(state[f"{expert}.w_down.weight"], left=up)}
            out |= {f"{theirs}.{moe}.experts.{e}.{name}.weight": t for name, t in parts.items()}
        if arch == "Qwen2MoeForCausalLM":
            out |= _qwen_extras(cfg, state, ours, theirs)
    return {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in out.items()}


def _fold(w: torch.Tensor, *, left: torch.Tensor | None = None, right: torch.Tensor | None = None) -> torch.Tensor:
    """``left · w · right`` (each factor optional), multiplied in float64."""
    out = w.double()
    if left is not None:
        out = left.double() @ out
    if right is not None:
        out = out @ right.double()
    return out.float()


def _qwen_extras(cfg: ModelConfig, state: Mapping[str, torch.Tensor], ours: str,
                 theirs: str) -> dict[str, torch.Tensor]:
    """One Qwen2-MoE layer's (``theirs``) attention biases (zeros), shared expert and its gate (module docstring)."""
    D, mlp = cfg.d_model, f"{theirs}.mlp"
    out = {f"{theirs}.self_attn.{p}_proj.bias": torch.zeros(D) for p in "qkv"}
    out[f"{mlp}.shared_expert_gate.weight"] = torch.zeros(1, D)  # sigmoid(0) = 1/2 for every token
    if cfg.d_shared:
        shared = f"{ours}.moe.shared"
        out |= {f"{mlp}.shared_expert.gate_proj.weight": state[f"{shared}.w_gate.weight"],
                f"{mlp}.shared_expert.up_proj.weight": state[f"{shared}.w_up.weight"],
                f"{mlp}.shared_expert.down_proj.weight": state[f"{shared}.w_down.weight"] * 2}
    else:
        out |= {f"{mlp}.shared_expert.{p}.weight": torch.zeros(shape) for p, shape
                in (("gate_proj", (1, D)), ("up_proj", (1, D)), ("down_proj", (D, 1)))}
    return out


def byte_tokenizer_json() -> str:
    """tokenizer.json of the byte tokens: token i is byte i (a byte-level BPE of the 256 bytes and no merges)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    tok = HFTokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return str(tok.to_str())


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable character for each byte (GPT-2's table: printable Latin-1 bytes
    stand for themselves, the others for the characters from U+0100 on, in byte order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_hf_files(folder: Path, cfg: ModelConfig, state: Mapping[str, torch.Tensor], tokenizer: Tokenizer) -> bytes:
    """The Hugging Face form's files (weights, config, generation defaults, tokenizer) into ``folder``; returns the
    weights file's bytes."""
    import safetensors.torch

    data = safetensors.torch.save(hf_tensors(cfg, state), metadata={"format": "pt"})
    (folder / "model.safetensors").write_bytes(data)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=1) + "\n")
    generation = {"do_sample": True, "temperature": 0.8, "top_k": 50}  # ``parallax generate``'s defaults
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    text = tokenizer.text if isinstance(tokenizer, BpeTokenizer) else byte_tokenizer_json()
    (folder / "tokenizer.json").write_text(text)
    # Tools that batch (lm-eval) or score a text's first token want an end-of-text and a padding token; neither
    # vocabulary has one, so both name the NUL byte, which text does not hold (docs/decisions.md).
    nul = _bytes_to_unicode()[0]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len,
              "clean_up_tokenization_spaces": False, "eos_token": nul, "pad_token": nul}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return data


def card_section(cfg: ModelConfig) -> list[str]:
    """What the model card says about the Hugging Face form: how to load it and what differs from Parallax's."""
    arch = architecture(cfg)
    changes = ["the fused attention projection is split into q, k and v projections"]
    if cfg.has_latent:
        changes.append(f"the latent interface ({cfg.d_model} -> {cfg.d_latent} -> {cfg.d_model}) is folded into "
                       "each expert's projections, so experts read and write the model width directly")
    if arch == "Qwen2MoeForCausalLM":
        changes.append("the q, k and v biases and the shared expert's gate are zeros (the gate a constant 1/2, with "
                       "the shared expert's down projection doubled to match)"
                       + ("" if cfg.d_shared else "; the shared expert is one unit wide and zero: the model has none"))
    return [
        "## Hugging Face transformers", "",
        f"This folder is a standard `{arch}` checkpoint: no modeling code of its own, no `trust_remote_code`.", "",
        "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(\"<this folder>\")",
        "tokenizer = AutoTokenizer.from_pretrained(\"<this folder>\")",
        "ids = tokenizer(\"ROMEO:\", return_tensors=\"pt\").input_ids",
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=100)[0]))", "```", "",
        "`lm_eval --model hf --model_args pretrained=<this folder> --tasks hellaswag,arc_easy` evaluates it. Neither "
        "vocabulary has special tokens: the tokenizer names the NUL byte, which no text holds, as its end-of-text "
        "and padding token for the tools that need one.", "",
        "The same function as the Parallax model, in another form: " + "; ".join(changes) + ". The surrogates the "
        "composers trained with are no part of it, and the load-balancing loss weight is the config's "
        "`router_aux_loss_coef`. `parallax.json` holds Parallax's own description of the model (settings, "
        "provenance).", "",
    ]
