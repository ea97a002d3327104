"""The Hugging Face form of an export: transformers loads it as a standard Mixtral or Qwen2-MoE checkpoint, with no
code of Parallax's, and it computes the logits of Parallax's own form of the same model, tokenizes as the run did,
and continues a prompt as ``parallax generate`` does."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from parallax.cli.main import app
from parallax.node.config.train import PRESETS, ModelConfig, train_config
from parallax.node.export.folder import CARD, ExportError, Provenance, read_model, write_model
from parallax.node.export.hf import architecture
from parallax.node.export.use import generate
from parallax.node.model.transformer import MoETransformer
from parallax.node.sim.simulator import RunSpec, run
from parallax.node.train.data import CorpusInfo, load_corpus, split_corpus
from parallax.node.train.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer

runner = CliRunner(env={"COLUMNS": "200"})
LM_EVAL_TASK = Path(__file__).parents[1] / "data" / "lm_eval"
WINDOWS = {"batch_size": 2, "eval_batches": 1, "val_fraction": 0.05}


def _both_forms(cfg: ModelConfig, folder: Path, tokenizer: Tokenizer | None = None) -> tuple[Path, Path]:
    """A model of ``cfg`` with every weight drawn away from its initial value (norm gains included), written in
    Parallax's form and in the Hugging Face form."""
    model = MoETransformer(cfg, seed=0)
    model.drop_surrogates()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.05 if p.dim() > 1 else 0.3))
    state = {n: p.detach() for n, p in model.named_parameters()}  # the tied head once, as tok_emb
    native = write_model(folder / "native", cfg, state, Provenance("run", []), eval_windows=WINDOWS,
                         tokenizer=tokenizer)
    hf = write_model(folder / "hf", cfg, state, Provenance("run", []), eval_windows=WINDOWS, tokenizer=tokenizer,
                     form="hf")
    return native, hf


def _logits_agree(native: Path, hf: Path, seq_len: int) -> transformers.PreTrainedModel:
    ours = read_model(native).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    idx = torch.randint(0, ours.cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = ours(idx).logits, theirs(idx).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4
    return theirs


SHAPES = {
    "tiny: shared expert, latent interface": (PRESETS["tiny"], "Qwen2MoeForCausalLM"),
    "tiny without its shared expert": (dataclasses.replace(PRESETS["tiny"], d_shared=0), "MixtralForCausalLM"),
    "tiny, gates not renormalised": (dataclasses.replace(PRESETS["tiny"], d_shared=0, renormalize_gates=False),
                                     "Qwen2MoeForCausalLM"),
    "small: shared expert": (PRESETS["small"], "Qwen2MoeForCausalLM"),
    "small without its shared expert": (dataclasses.replace(PRESETS["small"], d_shared=0), "MixtralForCausalLM"),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_transformers_loads_the_hf_form_as_a_standard_architecture_with_parallaxs_logits(shape: str,
                                                                                         tmp_path: Path) -> None:
    cfg, arch = SHAPES[shape]
    assert architecture(cfg) == arch
    native, hf = _both_forms(cfg, tmp_path)
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == [arch] and "auto_map" not in config  # no modeling code of its own
    theirs = _logits_agree(native, hf, cfg.seq_len)
    assert type(theirs).__name__ == arch


def test_the_hf_form_tokenizes_bytes_as_the_run_did_and_continues_a_prompt_as_parallax_does(tmp_path: Path) -> None:
    cfg = PRESETS["tiny"]
    native, hf = _both_forms(cfg, tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    text = "ROMEO: naïve façade — 東京\n\ttabs  and spaces "
    ids = tokenizer(text).input_ids
    assert ids == list(text.encode())
    assert tokenizer.decode(ids) == text
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    prompt = "ROMEO:"
    out = model.generate(tokenizer(prompt, return_tensors="pt").input_ids, max_new_tokens=12, do_sample=False)
    ours = generate(read_model(native).model, prompt.encode(), max_new_tokens=12, temperature=0.0)
    assert out[0].tolist() == list(prompt.encode() + ours)


def test_a_bpe_runs_hf_form_carries_its_tokenizer(tmp_path: Path) -> None:
    tokenizer = BpeTokenizer.train(load_corpus(None)[:200_000], 512)
    cfg = dataclasses.replace(PRESETS["tiny"], tokenizer="bpe", vocab_size=512)
    native, hf = _both_forms(cfg, tmp_path, tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(hf)
    text = "ROMEO: What, art thou hurt?\nMERCUTIO: Ay, ay, a scratch."
    assert theirs(text).input_ids == tokenizer.encode(text.encode()).tolist()
    assert theirs.decode(theirs(text).input_ids) == text
    _logits_agree(native, hf, cfg.seq_len)


def test_the_hf_forms_card_says_how_to_load_it_and_what_differs_and_parallax_load_points_to_transformers(
        tmp_path: Path) -> None:
    _, hf = _both_forms(PRESETS["tiny"], tmp_path)
    card = (hf / CARD).read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "AutoModelForCausalLM.from_pretrained" in card and "latent interface" in card and "surrogates" in card
    assert json.loads((hf / "parallax.json").read_text())["architecture"] == "Qwen2MoeForCausalLM"
    with pytest.raises(ExportError, match="Hugging Face form.*transformers"):
        read_model(hf)


def test_export_format_hf_from_a_runs_checkpoints_gives_the_native_exports_logits(tmp_path: Path) -> None:
    cfg = train_config("tiny", steps=8, batch_size=2)
    corpus = load_corpus(None)
    train, val = split_corpus(corpus)
    run(RunSpec(name="p", kind="parallax", cfg=cfg, composers=2), train, val, checkpoint_dir=tmp_path / "ckpt",
        data=CorpusInfo.of(None, corpus))
    sources = [a for c in ("composer-0", "composer-1") for a in ("--from-checkpoints", str(tmp_path / "ckpt" / c))]
    native = runner.invoke(app, ["export", *sources, "--out", str(tmp_path / "native")])
    assert native.exit_code == 0, native.output
    done = runner.invoke(app, ["export", *sources, "--format", "hf", "--license", "apache-2.0",
                               "--out", str(tmp_path / "hf")])
    assert done.exit_code == 0, done.output
    assert "from transformers import pipeline" in done.output
    assert "license: apache-2.0" in (tmp_path / "hf" / CARD).read_text()
    _logits_agree(tmp_path / "native", tmp_path / "hf", cfg.model.seq_len)


def test_the_byte_tokenizers_file_is_the_byte_tokenizer() -> None:
    """Every byte value is one token of its own number, whatever text it comes from."""
    from tokenizers import Tokenizer as HFTokenizer

    from parallax.node.export.hf import byte_tokenizer_json

    tok = HFTokenizer.from_str(byte_tokenizer_json())
    assert tok.get_vocab_size() == 256
    text = "".join(chr(c) for c in range(1, 0x2FF)) + "\U0001F600"
    assert tok.encode(text).ids == ByteTokenizer().encode(text.encode()).tolist()


@pytest.mark.slow
def test_lm_eval_scores_the_hf_form_on_a_local_task_as_parallaxs_model_does(tmp_path: Path) -> None:
    """lm-eval's own command over the task shipped with the tests (no download): each line's log-likelihood, as
    lm-eval computes it through transformers (the line after the end-of-text token), is Parallax's."""
    native, hf = _both_forms(PRESETS["tiny"], tmp_path)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={hf}",
                           "--include_path", ".", "--tasks", "parallax_lines", "--device", "cpu", "--batch_size", "4",
                           "--output_path", str(tmp_path / "out"), "--log_samples"],
                          cwd=LM_EVAL_TASK, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_parallax_lines_*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == len((LM_EVAL_TASK / "lines.jsonl").read_text().splitlines()) == 24
    ours = read_model(native).model
    for sample in samples:
        tokens = list(sample["doc"]["text"].encode())
        with torch.no_grad():
            logits = ours(torch.tensor([[0, *tokens[:-1]]])).logits[0]
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens].sum().item()
        assert float(sample["resps"][0][0]) == pytest.approx(expected, abs=1e-3)
