"""Checkpoints: exact resume, atomic saves, refusal of corrupt or mismatched checkpoints, pruning."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from parallax.errors import NodeError
from parallax.node.config import train as config
from parallax.node.config.typed import apply_changes
from parallax.node.outer.transport import decode_contribution, encode_contribution, keep_unsent
from parallax.node.train import checkpoint as ckpt
from parallax.node.train.checkpoint import (
    CheckpointError,
    CheckpointMismatch,
    checkpoint_at,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    read_info,
    read_weights,
    save_checkpoint,
    state_hash,
)
from parallax.node.train.composer import Composer
from parallax.node.train.data import load_corpus, split_corpus
from parallax.node.train.outer import to_send

OWNED = (frozenset({0, 2}), frozenset({1}))
RUN = "run-test"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: with the CPU shared, torch's thread pool costs 100x more than it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def train():
    return split_corpus(load_corpus()[:40_000])[0]


def _cfg(**changes) -> config.TrainConfig:
    cfg = config.TrainConfig(
        model=config.preset("tiny"), steps=40, batch_size=2, eval_batches=1,
        optim=config.OptimConfig(warmup_steps=3),
        surrogate=config.SurrogateConfig(refresh_every=2, distill_steps=2, buffer_tokens=48, delta_rank=2),
    )
    return apply_changes(cfg, changes)


def _composer(train, cfg=None, owned=OWNED) -> Composer:
    return Composer(cfg or _cfg(), owned, train, sampler_seed=3)


def _advance(c: Composer, steps: int) -> list[float]:
    """Train with everything that carries state: refreshes, outer steps, sketches."""
    losses = []
    for _ in range(steps):
        losses.append(c.train_step().loss)
        if c.sketcher is not None:
            c.take_sketches()
        if c.step % 2 == 0:
            c.refresh_surrogates()
        if c.step % 3 == 0:
            for group in c.outer:  # a merge with only ourselves: exercises anchors and momentum
                c.apply_outer(group, c.pseudo_gradient(group))
    return losses


@pytest.mark.parametrize("sketch", [False, True])
def test_resume_is_exact(train, tmp_path, sketch):
    cfg = _cfg(**{"sim.sketch.enabled": True, "sim.sketch.sample_fraction": 0.9}) if sketch else _cfg()
    original = _composer(train, cfg)
    _advance(original, 4)
    path = save_checkpoint(tmp_path, original, run_id=RUN, versions={(0, 1): 3, (1, 0): 2})

    restored = _composer(train, cfg)
    assert state_hash(restored) != state_hash(original)
    info = load_checkpoint(tmp_path, restored, run_id=RUN)
    assert info.path == path and info.step == 4 and info.run_id == RUN
    assert info.versions == {(0, 1): 3, (1, 0): 2} and info.owned == OWNED
    assert state_hash(restored) == state_hash(original)

    assert _advance(restored, 5) == _advance(original, 5)
    assert state_hash(restored) == state_hash(original)
    for (name, a), b in zip(original.model.named_parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_resume_keeps_what_a_sparse_wire_has_not_sent(train, tmp_path):
    original = _composer(train)
    _advance(original, 3)
    for outer in original.outer.values():
        pending = to_send(outer, error_feedback=True)
        body = encode_contribution(pending, "topk")
        keep_unsent(outer, pending, decode_contribution(body, {n: t.shape for n, t in pending.items()}, peer="me"),
                    "topk")
    assert all(outer.unsent for outer in original.outer.values())
    save_checkpoint(tmp_path, original, run_id=RUN)
    restored = _composer(train)
    load_checkpoint(tmp_path, restored, run_id=RUN)
    assert state_hash(restored) == state_hash(original)
    for group, outer in original.outer.items():
        kept = restored.outer[group].unsent
        assert kept.keys() == outer.unsent.keys() and all(torch.equal(kept[n], u) for n, u in outer.unsent.items())


def test_crash_mid_save_keeps_previous_checkpoint(train, tmp_path, monkeypatch):
    c = _composer(train)
    _advance(c, 2)
    good = save_checkpoint(tmp_path, c, run_id=RUN)
    good_hash = state_hash(c)
    _advance(c, 2)

    real_write, calls = ckpt._write_file, []

    def crash_on_third(path, data):
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError("disk yanked")
        real_write(path, data)

    monkeypatch.setattr(ckpt, "_write_file", crash_on_third)
    with pytest.raises(OSError, match="disk yanked"):
        save_checkpoint(tmp_path, c, run_id=RUN)
    monkeypatch.setattr(ckpt, "_write_file", real_write)

    assert latest_checkpoint(tmp_path) == good
    assert list_checkpoints(tmp_path) == [good]
    fresh = _composer(train)
    assert load_latest(tmp_path, fresh).path == good
    assert state_hash(fresh) == good_hash


def test_leftovers_of_a_killed_save_are_ignored_then_removed(train, tmp_path):
    c = _composer(train)
    _advance(c, 1)
    good = save_checkpoint(tmp_path, c, run_id=RUN)
    # A process killed mid-save: a temp folder, and a step folder someone copied without its manifest.
    (tmp_path / ".tmp-step-000000002-dead").mkdir()
    (tmp_path / ".tmp-step-000000002-dead" / "experts.safetensors").write_bytes(b"half")
    (tmp_path / "step-000000009").mkdir()
    assert list_checkpoints(tmp_path) == [good]
    assert load_latest(tmp_path, _composer(train)).path == good
    with pytest.raises(CheckpointError, match="incomplete: it has no manifest.json"):
        load_checkpoint(tmp_path / "step-000000009", _composer(train))
    _advance(c, 1)
    save_checkpoint(tmp_path, c, run_id=RUN)
    assert not (tmp_path / ".tmp-step-000000002-dead").exists()


@pytest.fixture
def two_checkpoints(train, tmp_path):
    c = _composer(train)
    _advance(c, 2)
    older = save_checkpoint(tmp_path, c, run_id=RUN)
    older_hash = state_hash(c)
    _advance(c, 2)
    newer = save_checkpoint(tmp_path, c, run_id=RUN)
    return older, older_hash, newer


def _untouched(train, action):
    """Run ``action`` on a fresh composer and check that a refused load changed nothing."""
    fresh = _composer(train)
    before = state_hash(fresh)
    action(fresh)
    assert state_hash(fresh) == before


def test_corrupt_tensor_file_is_refused_and_previous_is_used(train, two_checkpoints, tmp_path, caplog):
    older, older_hash, newer = two_checkpoints
    target = newer / "shared.safetensors"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit pattern inside a weight
    target.write_bytes(bytes(data))

    def refuse(fresh):
        with pytest.raises(CheckpointError, match=r"shared\.safetensors is corrupt \(sha256"):
            load_checkpoint(newer, fresh)
    _untouched(train, refuse)

    fresh = _composer(train)
    with caplog.at_level(logging.WARNING, logger="parallax.node.train.checkpoint"):
        info = load_latest(tmp_path, fresh)
    assert info.path == older and state_hash(fresh) == older_hash
    assert "shared.safetensors is corrupt" in caplog.text
    with pytest.raises(CheckpointError, match="corrupt"):
        load_latest(tmp_path, _composer(train), fall_back=False)


def test_truncated_and_missing_files_are_refused(train, two_checkpoints):
    _, _, newer = two_checkpoints
    opt = newer / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:100])

    def refuse(fresh):
        with pytest.raises(CheckpointError, match=r"optimizer\.safetensors has 100 bytes.*truncated"):
            load_checkpoint(newer, fresh)
    _untouched(train, refuse)
    (newer / "experts.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: experts\.safetensors is missing"):
        load_checkpoint(newer, _composer(train))


@pytest.mark.parametrize("damage", ["garbage", "edited"])
def test_corrupt_manifest_is_refused(train, two_checkpoints, tmp_path, damage):
    older, older_hash, newer = two_checkpoints
    manifest = newer / "manifest.json"
    text = manifest.read_text()
    if damage == "garbage":
        manifest.write_text(text[: len(text) // 2])
    else:  # still valid JSON, but no longer what was written
        manifest.write_text(text.replace('"step": 4', '"step": 5', 1))

    def refuse(fresh):
        with pytest.raises(CheckpointError, match=r"manifest\.json is corrupt"):
            load_checkpoint(newer, fresh)
    _untouched(train, refuse)
    fresh = _composer(train)
    assert load_latest(tmp_path, fresh).path == older and state_hash(fresh) == older_hash


def test_newer_format_version_is_refused(train, two_checkpoints):
    _, _, newer = two_checkpoints
    body = json.loads((newer / "manifest.json").read_text())["body"]
    body["format_version"] = ckpt.FORMAT_VERSION + 1
    (newer / "manifest.json").write_bytes(ckpt._manifest_bytes(body))
    with pytest.raises(CheckpointError, match=f"format version {ckpt.FORMAT_VERSION + 1}"):
        load_checkpoint(newer, _composer(train))


def test_the_composers_that_worked_are_kept_and_a_malformed_list_is_refused(train, tmp_path):
    c = _composer(train)
    _advance(c, 1)
    path = save_checkpoint(tmp_path, c, run_id=RUN, workers={"b" * 12, "a" * 12})
    assert read_info(path).workers == {"a" * 12, "b" * 12}
    body = json.loads((path / "manifest.json").read_text())["body"]
    assert body["workers"] == ["a" * 12, "b" * 12]
    assert read_info(save_checkpoint(tmp_path / "none", c, run_id=RUN)).workers == frozenset()
    for bad in ("a" * 12, [1], ["x" * 129], [""], [f"{i:012d}" for i in range(1025)]):
        body["workers"] = bad
        (path / "manifest.json").write_bytes(ckpt._manifest_bytes(body))
        with pytest.raises(CheckpointError, match="its workers are not a list of fingerprints"):
            read_info(path)


def test_config_mismatch_names_the_field(train, two_checkpoints, tmp_path):
    def refuse(fresh):
        with pytest.raises(CheckpointMismatch) as err:
            load_latest(tmp_path, fresh)
        assert "optim.lr: checkpoint 0.003, here 0.001" in str(err.value)
        assert isinstance(err.value, ValueError) and isinstance(err.value, NodeError)

    fresh = _composer(train, _cfg(**{"optim.lr": 1e-3}))
    before = state_hash(fresh)
    refuse(fresh)
    assert state_hash(fresh) == before

    with pytest.raises(CheckpointMismatch, match=r"model\.d_expert: checkpoint 48, here 64"):
        load_latest(tmp_path, _composer(train, _cfg(model=config.replace(config.preset("tiny"), d_expert=64))))
    # Evaluation settings do not change training, nor do the machine's compute choices: allowed to differ.
    assert load_latest(tmp_path, _composer(train, _cfg(eval_every=7))).step == 4
    assert load_latest(tmp_path, _composer(train, _cfg(**{"compute.kernel": "reference"}))).step == 4


def test_a_setting_the_checkpoint_lacks_counts_as_its_default(train, two_checkpoints, tmp_path):
    _, _, newer = two_checkpoints
    body = json.loads((newer / "manifest.json").read_text())["body"]
    del body["config"]["ownership"], body["config"]["optim"]["inner"]  # written before these settings existed
    (newer / "manifest.json").write_bytes(ckpt._manifest_bytes(body))
    assert load_checkpoint(newer, _composer(train)).step == 4
    with pytest.raises(CheckpointMismatch, match=r"ownership\.replicas: checkpoint 1, here 2"):
        load_checkpoint(newer, _composer(train, _cfg(**{"ownership.replicas": 2})))


def test_other_run_ownership_or_data_is_refused(train, two_checkpoints, tmp_path):
    with pytest.raises(CheckpointMismatch, match="belongs to run 'run-test'"):
        load_latest(tmp_path, _composer(train), run_id="another-run")
    with pytest.raises(CheckpointMismatch, match=r"read_info\(path\)\.owned"):
        load_latest(tmp_path, _composer(train, owned=(frozenset({0}), frozenset({1}))))
    with pytest.raises(CheckpointMismatch, match="n_tokens"):
        load_latest(tmp_path, _composer(train[:-10]))
    # The manifest tells the resuming node which composer to build.
    info = read_info(tmp_path)
    assert load_checkpoint(tmp_path, _composer(train, owned=info.owned)).step == info.step


def test_keep_last_k_and_resaving_a_step(train, tmp_path):
    c = _composer(train)
    saved = []
    for _ in range(5):
        _advance(c, 1)
        saved.append(save_checkpoint(tmp_path, c, run_id=RUN, keep_last=2))
    assert list_checkpoints(tmp_path) == saved[-2:]
    assert latest_checkpoint(tmp_path) == saved[-1]
    assert (tmp_path / "latest").read_text() == "step-000000005\n"

    again = save_checkpoint(tmp_path, c, run_id=RUN, keep_last=2)  # same step: replaced in place
    assert again == saved[-1] and list_checkpoints(tmp_path) == saved[-2:]
    fresh = _composer(train)
    load_latest(tmp_path, fresh)
    assert state_hash(fresh) == state_hash(c)
    (tmp_path / "latest").write_text("garbage\n")  # a damaged pointer: the newest checkpoint still resumes
    assert load_latest(tmp_path, _composer(train)).path == saved[-1]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, c, run_id=RUN, keep_last=0)


def test_empty_or_missing_folder(train, tmp_path):
    assert load_latest(tmp_path / "nothing", _composer(train)) is None
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nothing", _composer(train))


def test_checkpoints_list_names_a_corrupt_latest_and_the_older_one_to_resume_from(train, tmp_path) -> None:
    from typer.testing import CliRunner

    from parallax.cli.main import app

    c = _composer(train)
    _advance(c, 2)
    older = ckpt.save_checkpoint(tmp_path, c, run_id="r")
    _advance(c, 2)
    newest = ckpt.save_checkpoint(tmp_path, c, run_id="r")
    data = (newest / "experts.safetensors").read_bytes()
    (newest / "experts.safetensors").write_bytes(data[:-4] + b"\0\0\0\0")
    with pytest.raises(CheckpointError, match=r"parallax checkpoints list DIR, then --resume DIR/step-N"):
        ckpt.verify_checkpoint(newest)
    assert ckpt.verify_checkpoint(older).step == 2
    done = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["checkpoints", "list", str(tmp_path), "--json"])
    assert done.exit_code == 0, done.output
    rows = json.loads(done.output)
    assert [(r["step"], r["ok"], r["latest"]) for r in rows] == [(2, True, False), (None, False, True)]
    assert "experts.safetensors is corrupt" in rows[1]["problem"]
    done = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["checkpoints", "list", str(tmp_path)])
    assert f"--resume {older}" in " ".join(done.output.split())
    done = CliRunner().invoke(app, ["checkpoints", "list", str(tmp_path / "none")])
    assert done.exit_code == 1 and "no checkpoint" in done.output


def test_resume_takes_latest_with_a_checkpoint_dir_or_a_checkpoints_path() -> None:
    from parallax.node.config.peer import NodeSettings

    assert NodeSettings(resume="runs/a/step-000000100").resume == "runs/a/step-000000100"
    with pytest.raises(ValueError, match="--resume DIR/step-N"):
        NodeSettings(resume="latest")


def test_each_groups_outer_round_is_kept_and_says_whether_it_was_ever_merged(train, tmp_path):
    """An export takes a group's anchor only when it was merged (round > 0): the round goes into the checkpoint,
    back into the composer, and into ``read_weights``; a checkpoint written before rounds were kept reads 0."""
    original = _composer(train)
    _advance(original, 3)
    original.outer["router"].round = 7  # merged at round 7; latent and backbone never
    save_checkpoint(tmp_path, original, run_id=RUN)
    restored = _composer(train)
    load_checkpoint(tmp_path, restored, run_id=RUN)
    assert {g: o.round for g, o in restored.outer.items()} == {g: o.round for g, o in original.outer.items()}
    weights = read_weights(tmp_path)
    assert weights.rounds == {"router": 7, **{g: 0 for g in original.outer if g != "router"}}
    assert set(weights.merged) == set(original.outer)
    assert all(torch.equal(weights.merged["router"][n], a) for n, a in original.outer["router"].anchor.items())
    path = latest_checkpoint(tmp_path)
    body = json.loads((path / "manifest.json").read_text())["body"]
    del body["state"]["outer_rounds"]  # written before rounds were kept
    (path / "manifest.json").write_bytes(ckpt._manifest_bytes(body))
    assert read_weights(tmp_path).rounds == dict.fromkeys(original.outer, 0)
    body["state"]["outer_rounds"] = {"router": "seven"}
    (path / "manifest.json").write_bytes(ckpt._manifest_bytes(body))
    with pytest.raises(CheckpointError, match="malformed outer rounds"):
        read_weights(tmp_path)


def test_the_checkpoint_at_a_step_is_the_newest_at_or_before_it(tmp_path):
    for step in (10, 20, 30):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "manifest.json").write_text("{}")
    (tmp_path / "step-25").mkdir()  # no manifest: a save that never finished
    assert checkpoint_at(tmp_path, 20) == tmp_path / "step-20"
    assert checkpoint_at(tmp_path, 29) == tmp_path / "step-20"
    assert checkpoint_at(tmp_path, 10**9) == tmp_path / "step-30"
    with pytest.raises(CheckpointError, match=r"no checkpoint at or before step 9 \(steps held: 10, 20, 30\)"):
        checkpoint_at(tmp_path, 9)
