"""The exported model: assembled from composers' checkpoints, written, loaded back, evaluated and sampled from.

The simulator writes each composer's final checkpoint; the export of those checkpoints must evaluate to exactly
the simulator's assembled model's validation loss on the same windows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import parallax
from parallax.cli.main import app
from parallax.node.config.train import train_config
from parallax.node.export.folder import (
    CONFIG,
    WEIGHTS,
    Copy,
    ExportError,
    Provenance,
    assemble,
    expert_names,
    read_model,
)
from parallax.node.export.offline import export_checkpoints
from parallax.node.export.use import evaluate_on, generate
from parallax.node.sim.simulator import RunSpec, run
from parallax.node.train.data import CorpusInfo, load_corpus, split_corpus

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """A 2-composer tiny run of 20 steps with its checkpoints, and its assembled model's val loss."""
    root = tmp_path_factory.mktemp("sim")
    cfg = train_config("tiny", steps=20, batch_size=4)
    corpus = load_corpus(None)
    train, val = split_corpus(corpus)
    result = run(RunSpec(name="p", kind="parallax", cfg=cfg, composers=2), train, val, checkpoint_dir=root,
                 data=CorpusInfo.of(None, corpus))
    return root, result.assembled_val_loss


def test_the_export_of_a_runs_checkpoints_evaluates_to_its_assembled_model(simulated, tmp_path: Path) -> None:
    root, assembled = simulated
    out = export_checkpoints([root / "composer-0", root / "composer-1"], tmp_path / "model")
    exported = read_model(out)
    windows = exported.eval_windows
    result = evaluate_on(exported.model, None, batch_size=windows["batch_size"], eval_batches=windows["eval_batches"])
    assert result.nats_per_token == pytest.approx(assembled, rel=1e-6)
    config = json.loads((out / CONFIG).read_text())
    assert config["provenance"]["val_loss"]["nats_per_token"] == pytest.approx(assembled, rel=1e-6)
    assert len(config["provenance"]["experts"]) == 2 * 4 and not config["provenance"]["missing"]
    holders = {e["holder"] for e in config["provenance"]["experts"]}
    assert holders == {str(root / "composer-0"), str(root / "composer-1")}
    loaded = parallax.load(out)  # the library's entry: the module, its settings, its tokenizer, generate
    assert isinstance(loaded.model, torch.nn.Module) and not loaded.model.training
    assert loaded.cfg.n_experts == 4 and loaded.tokenizer.kind == "bytes"
    assert not [n for n, _ in loaded.model.named_parameters() if "surrogate" in n]  # no part of an exported model
    text = loaded.generate("ROMEO:", max_new_tokens=12, seed=0)
    assert text.startswith("ROMEO:") and text == loaded.generate("ROMEO:", max_new_tokens=12, seed=0)
    card = (out / "README.md").read_text()
    assert "run `sim`" in card and "nats per byte" in card and "8 from a composer's checkpoint" in card


def test_an_expert_nobody_holds_fails_the_export_unless_allowed_and_then_is_zero_and_named(simulated,
                                                                                          tmp_path: Path) -> None:
    root, _ = simulated
    with pytest.raises(ExportError, match=r"4 expert\(s\) are held by nobody reachable: .*--allow-missing"):
        export_checkpoints([root / "composer-0"], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    out = export_checkpoints([root / "composer-0"], tmp_path / "partial", allow_missing=True)
    config = json.loads((out / CONFIG).read_text())
    missing = [tuple(m) for m in config["provenance"]["missing"]]
    assert len(missing) == 4
    model = read_model(out).model
    for layer, expert in missing:
        assert all(float(p.detach().abs().max()) == 0 for p in model.expert_parameters(layer, expert).values())
    assert "are zeros" in (out / "README.md").read_text()


def test_a_poisoned_copy_is_refused_by_name_and_a_good_one_is_used_instead() -> None:
    cfg = train_config("tiny").model
    names = expert_names(cfg, 0, 1)
    good = Copy({n: torch.ones(s) for n, s in names.items()}, "peer-good", "snapshot", 10, 100.0)
    poisoned = Copy({n: torch.full(s, float("nan")) for n, s in names.items()}, "peer-bad", "owner", 12, 200.0)
    wrong = Copy({n: torch.ones(3) for n in names}, "peer-wrong", "owner", 12, 300.0)
    from parallax.node.export.folder import shared_shapes
    shared = Copy({n: torch.zeros(s) for n, s in shared_shapes(cfg).items()}, "peer-good", "owner", 10, 100.0)
    provenance = Provenance(run_id="r", nodes=[])
    with pytest.raises(ExportError) as e:
        assemble(cfg, [shared], {(0, 1): [poisoned, wrong, good]}, allow_missing=False, provenance=provenance)
    said = str(e.value)
    assert "peer-bad" in said and "NaN" in said and "peer-wrong" in said
    assert "7 expert(s) are held by nobody" in said  # 0.1 is not among them: its good copy was used
    provenance = Provenance(run_id="r", nodes=[])
    state = assemble(cfg, [shared], {(0, 1): [poisoned, wrong, good]}, allow_missing=True, provenance=provenance)
    assert all(float(state[n].min()) == 1.0 for n in names)
    assert [e["holder"] for e in provenance.experts] == ["peer-good"]


def test_checkpoints_of_two_runs_or_a_missing_folder_are_refused(simulated, tmp_path: Path) -> None:
    root, _ = simulated
    with pytest.raises(ExportError, match="cannot read checkpoint .*nowhere"):
        export_checkpoints([root / "composer-0", tmp_path / "nowhere"], tmp_path / "m")
    with pytest.raises(ExportError, match="no checkpoint folders"):
        export_checkpoints([], tmp_path / "m")


def test_a_corrupt_or_foreign_model_folder_gets_a_clear_error(simulated, tmp_path: Path) -> None:
    root, _ = simulated
    out = export_checkpoints([root / "composer-0", root / "composer-1"], tmp_path / "model")
    with pytest.raises(ExportError, match="no config.json"):
        read_model(tmp_path)
    weights = (out / WEIGHTS).read_bytes()
    (out / WEIGHTS).write_bytes(weights[:-8] + b"\0" * 8)
    with pytest.raises(ExportError, match="does not match the sha256"):
        read_model(out)
    (out / WEIGHTS).write_bytes(weights)
    config = json.loads((out / CONFIG).read_text())
    config["model"]["n_heads"] = 5
    (out / CONFIG).write_text(json.dumps(config))
    with pytest.raises(ExportError, match="settings this version cannot use"):
        read_model(out)
    (out / CONFIG).write_text("[1, 2]")
    with pytest.raises(ExportError, match="corrupt"):
        read_model(out)


def test_generation_is_seeded_greedy_at_temperature_zero_and_of_the_asked_length(simulated, tmp_path: Path) -> None:
    root, _ = simulated
    model = read_model(export_checkpoints([root / "composer-0", root / "composer-1"], tmp_path / "m")).model
    a = generate(model, b"ROMEO:", max_new_tokens=40, temperature=0.9, top_k=20, seed=3)
    b = generate(model, b"ROMEO:", max_new_tokens=40, temperature=0.9, top_k=20, seed=3)
    assert a == b and len(a) == 40
    greedy = generate(model, b"ROMEO:", max_new_tokens=5, temperature=0)
    first = int(model(torch.tensor([list(b"ROMEO:")])).logits[0, -1].argmax())
    assert greedy[0] == first
    long_prompt = b"x" * (model.cfg.seq_len * 3)  # longer than the context: its tail is used
    assert len(generate(model, long_prompt, max_new_tokens=3, seed=0)) == 3


def test_cached_tokens_run_on_one_thread_and_the_process_keeps_its_setting(monkeypatch) -> None:
    from parallax.node.config.train import preset
    from parallax.node.model.transformer import MoETransformer
    from parallax.node.train.device import threads as torch_threads

    threads = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
    model = MoETransformer(preset("tiny"), seed=0)
    seen: list[tuple[int, int]] = []  # (positions, threads) of each forward and each decoded token
    forward, decode = model.forward, model.decode

    def watched(idx, *args, **kwargs):
        seen.append((idx.shape[1], torch.get_num_threads()))
        return forward(idx, *args, **kwargs)

    def watched_token(token, cache):
        seen.append((1, torch.get_num_threads()))
        return decode(token, cache)

    monkeypatch.setattr(model, "forward", watched)
    monkeypatch.setattr(model, "decode", watched_token)
    generate(model, b"ROMEO:", max_new_tokens=4, temperature=0)
    assert seen == [(6, threads)] + [(1, 1)] * 4 and torch.get_num_threads() == threads
    seen.clear()
    generate(model, b"ROMEO:", max_new_tokens=2, temperature=0, token_threads=None)  # the process's setting
    assert seen == [(6, threads)] * 1 + [(1, threads)] * 2
    with pytest.raises(ValueError, match="token_threads"):
        generate(model, b"ROMEO:", max_new_tokens=1, token_threads=0)


def test_top_p_keeps_the_fewest_most_likely_tokens_that_reach_p(simulated, tmp_path: Path) -> None:
    from parallax.node.export.use import nucleus

    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    assert torch.equal(nucleus(probs, 0.7), torch.tensor([0.0, 0.5, 0.0, 0.3]))
    assert torch.equal(nucleus(probs, 0.5), torch.tensor([0.0, 0.5, 0.0, 0.0]))  # the most likely alone reaches p
    assert torch.equal(nucleus(probs, 0.01), torch.tensor([0.0, 0.5, 0.0, 0.0]))  # and always stays
    assert torch.equal(nucleus(probs, 0.96), probs)
    root, _ = simulated
    model = read_model(export_checkpoints([root / "composer-0", root / "composer-1"], tmp_path / "m")).model
    greedy = generate(model, b"ROMEO:", max_new_tokens=30, temperature=0.0)
    assert generate(model, b"ROMEO:", max_new_tokens=30, temperature=1.0, top_p=1e-6, seed=5) == greedy
    with pytest.raises(ValueError, match="top_p"):
        generate(model, b"ROMEO:", max_new_tokens=1, top_p=0.0)


def test_the_cache_gives_the_logits_and_tokens_of_rerunning_the_context_and_the_text_streams(simulated,
                                                                                          tmp_path: Path) -> None:
    root, _ = simulated
    model = read_model(export_checkpoints([root / "composer-0", root / "composer-1"], tmp_path / "m")).model.eval()
    ids = torch.tensor([list(b"ROMEO: the king")])
    cache = model.new_cache()
    with torch.no_grad():
        whole = model(ids).logits
        first = model(ids[:, :9], cache=cache).logits  # a prefix, then the rest two at a time, then one
        rest = [model(ids[:, i:j], cache=cache).logits for i, j in ((9, 11), (11, 13), (13, 14), (14, 15))]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), whole, rtol=1e-4, atol=1e-4)
    fits = model.cfg.seq_len - 8  # prompt and sample within one window: the two ways agree token for token
    cached = generate(model, b"ROMEO:", max_new_tokens=fits, temperature=0, use_cache=True)
    assert cached == generate(model, b"ROMEO:", max_new_tokens=fits, temperature=0, use_cache=False)
    pieces: list[bytes] = []
    longer = generate(model, b"ROMEO:", max_new_tokens=2 * model.cfg.seq_len, seed=1, on_text=pieces.append)
    assert len(longer) == 2 * model.cfg.seq_len and b"".join(pieces) == longer  # past the window: it goes on


def test_the_commands_export_evaluate_and_generate(simulated, tmp_path: Path) -> None:
    root, assembled = simulated
    done = runner.invoke(app, ["export", "--from-checkpoints", str(root / "composer-0"), "--from-checkpoints",
                               str(root / "composer-1"), "--out", str(tmp_path / "m")])
    assert done.exit_code == 0, done.output
    assert "exported 8 experts from 2 node(s)" in done.output and "parallax generate" in done.output
    done = runner.invoke(app, ["eval", str(tmp_path / "m"), "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["nats_per_byte"] == pytest.approx(assembled, rel=1e-6)
    done = runner.invoke(app, ["generate", str(tmp_path / "m"), "--prompt", "KING:", "--max-new-tokens", "20",
                               "--seed", "1"])
    assert done.exit_code == 0 and done.output.startswith("KING:"), done.output
    done = runner.invoke(app, ["export", "--from-checkpoints", str(root / "composer-0"), "--out", str(tmp_path / "x")])
    assert done.exit_code == 1 and "--allow-missing" in done.output
    done = runner.invoke(app, ["eval", str(tmp_path / "nothing")])
    assert done.exit_code == 1 and "parallax export" in done.output


def test_an_export_at_a_step_names_it_with_the_runs_settings_and_licence(simulated, tmp_path: Path) -> None:
    root, _ = simulated
    roots = ["--from-checkpoints", str(root / "composer-0"), "--from-checkpoints", str(root / "composer-1")]
    done = runner.invoke(app, ["export", *roots, "--step", "20", "--license", "apache-2.0", "--out",
                               str(tmp_path / "m")])
    assert done.exit_code == 0, done.output
    config = json.loads((tmp_path / "m" / CONFIG).read_text())["provenance"]
    assert {n["step"] for n in config["nodes"]} == {20} and config["license"] == "apache-2.0"
    assert config["settings"]["steps"] == 20 and config["settings"]["batch_size"] == 4
    card = (tmp_path / "m" / "README.md").read_text()
    assert "License: apache-2.0." in card and "| schedule | 20 steps of 4 sequences per composer |" in card
    assert "m.generate(" in card
    digest = hashlib.sha256(load_corpus(None)).hexdigest()
    assert f"| tinyshakespeare (built-in) | `{digest}` |" in card and "| 2 |" in card  # both nodes trained on it
    assert all(n["data"]["sha256"] == digest for n in config["nodes"])
    done = runner.invoke(app, ["export", *roots, "--step", "19", "--out", str(tmp_path / "early")])
    assert done.exit_code == 1 and "no checkpoint at or before step 19" in done.output, done.output
    assert not (tmp_path / "early").exists()
    done = runner.invoke(app, ["export", "--step", "20", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--out",
                               str(tmp_path / "live")])
    assert done.exit_code == 2 and "--from-checkpoints" in done.output


def test_a_stopped_simulation_is_a_complete_shorter_run_that_exports(tmp_path: Path) -> None:
    cfg = train_config("tiny", steps=50, batch_size=4)
    train, val = split_corpus(load_corpus(None))
    polls = []
    result = run(RunSpec(name="p", kind="parallax", cfg=cfg, composers=2), train, val, checkpoint_dir=tmp_path,
                 should_stop=lambda: polls.append(1) or len(polls) >= 7)
    assert result.steps == 7 and result.tokens == 2 * 7 * 4 * cfg.model.seq_len
    out = export_checkpoints([tmp_path / "composer-0", tmp_path / "composer-1"], tmp_path / "model")
    assert json.loads((out / CONFIG).read_text())["provenance"]["nodes"][0]["step"] == 7
    assert "2 node(s) did not name their data" in (out / "README.md").read_text()  # run without ``data``


def test_the_first_run_prints_the_loss_beside_the_baseline_exports_and_says_what_next(tmp_path: Path) -> None:
    done = runner.invoke(app, ["sim", "--steps", "20", "--quiet", "--out", str(tmp_path), "--composers", "2"])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert "nats per byte" in text and "synchronous baseline, same tokens" in text and "x │" in done.output
    model = next(tmp_path.glob("parallax-*/model"))
    assert f"parallax generate {model}" in text and "parallax swarm local" in text
    assert read_model(model).cfg.n_layers == 2  # the tiny preset unless told otherwise


@pytest.mark.parametrize("change", [{"files": {"model.safetensors": "x"}}, {"model": [1]}, {"eval": {"batch_size": 0}},
                                    {"eval": "windows"}, {"tokenizer": "bpe"}])
def test_a_config_json_of_the_wrong_shape_is_named_not_a_traceback(simulated, tmp_path: Path, change) -> None:
    root, _ = simulated
    out = export_checkpoints([root / "composer-0", root / "composer-1"], tmp_path / "m")
    config = json.loads((out / CONFIG).read_text())
    config.update(change)
    (out / CONFIG).write_text(json.dumps(config))
    with pytest.raises(ExportError):
        read_model(out)


def test_a_config_json_claiming_a_far_larger_model_is_refused_before_building_it(simulated, tmp_path: Path) -> None:
    root, _ = simulated
    out = export_checkpoints([root / "composer-0", root / "composer-1"], tmp_path / "m")
    config = json.loads((out / CONFIG).read_text())
    config["model"]["n_layers"] = 100_000
    (out / CONFIG).write_text(json.dumps(config))
    with pytest.raises(ExportError, match="number of expert tensors"):
        read_model(out)
