"""Typed settings: coercion at the edge, one precedence for every command, ``parallax config show``."""

from __future__ import annotations

import tomllib

import pytest
from typer.testing import CliRunner

from parallax.cli.main import app
from parallax.node.config.net import NetConfig
from parallax.node.config.peer import NodeConfig, WorkerConfig
from parallax.node.config.resolve import ROOTS, node_defaults, resolve, train_defaults
from parallax.node.config.train import TrainConfig
from parallax.node.config.typed import (
    ConfigError,
    apply_changes,
    field_docs,
    field_types,
    is_section,
    parse_sets,
    to_explained_toml,
    to_toml,
)

runner = CliRunner()


@pytest.mark.parametrize(("text", "value"), [("false", False), ("False", False), ("FALSE", False), ("0", False),
                                             ("true", True), ("True", True), ("1", True)])
def test_booleans_from_text_in_any_case(text: str, value: bool) -> None:
    cfg = apply_changes(TrainConfig(), parse_sets([f"surrogate.input_grad={text}"]))
    assert cfg.surrogate.input_grad is value


@pytest.mark.parametrize(("change", "named"), [
    ("model.n_layers=2.5", "model.n_layers"),
    ("sync.outer_lr=abc", "sync.outer_lr"),
    ("surrogate.input_grad=maybe", "surrogate.input_grad"),
    ("sync.merge=rdx", "rda"),  # a typo in a choice names the valid ones
    ("sync.periods=router", "JSON"),
    ('sync.periods={"router": 2.5, "latent": 50, "backbone": 100}', "sync.periods['router']"),
    ("optim.nosuch=1", "optim.nosuch"),
    ("nosuch.lr=1", "nosuch"),
    ("model=1", "section"),
    ("optim.lr=-1", "lr > 0"),
    ("steps=true", "steps"),
])
def test_bad_values_are_one_line_errors_naming_the_setting(change: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_changes(TrainConfig(), parse_sets([change]))
    message = str(info.value)
    assert named in message and "\n" not in message


def test_an_error_names_the_one_setting_at_fault_among_those_given_together() -> None:
    """Many settings of one section change at once (a node's flags): the error names the one refused, not them all;
    a pair that is refused only together (one bound against another) is named as the pair."""
    changes = {"peer.run_id": "demo", "peer.loopback": True, "peer.identity": "a.key", "peer.initial_peers": ["x"]}
    with pytest.raises(ConfigError) as info:
        apply_changes(node_defaults("tiny", True), changes)
    assert str(info.value).startswith("peer.initial_peers: initial peer 'x' is not a multiaddr"), info.value
    with pytest.raises(ConfigError) as info:
        apply_changes(node_defaults("tiny", True), {"net.membership.stall_s": 3.0, "net.gossip.poll_s": 0.5})
    assert str(info.value).startswith("net.membership.stall_s") and "poll_s" not in str(info.value), info.value
    with pytest.raises(ConfigError) as info:
        apply_changes(node_defaults("tiny", True),
                      {"net.gossip.announce_period_s": 20.0, "net.gossip.announce_ttl_s": 10.0})
    assert str(info.value).startswith("net.gossip.announce_period_s, net.gossip.announce_ttl_s: "), info.value


def test_typed_values_from_toml_and_python_are_checked_too() -> None:
    cfg = apply_changes(TrainConfig(), {"optim.lr": 1, "optim.betas": [0.8, 0.9], "batch_size": 4.0})
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 0.9) and cfg.batch_size == 4 and isinstance(cfg.batch_size, int)
    with pytest.raises(ConfigError, match="batch_size"):
        apply_changes(TrainConfig(), {"batch_size": 4.5})
    with pytest.raises(ConfigError, match="expected a number"):
        apply_changes(TrainConfig(), {"steps": True})


def test_settings_that_must_agree_change_together_in_any_order() -> None:
    small = train_defaults("small")
    tiny = train_defaults("tiny")
    cfg = apply_changes(small, {"model.d_model": 32, "model.n_heads": 2, "model.d_latent": 24})
    assert (cfg.model.d_model, cfg.model.d_latent) == (32, 24)
    with pytest.raises(ConfigError, match="d_latent"):
        apply_changes(tiny, {"model.d_latent": 64})


def test_precedence_defaults_file_flags_sets(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('preset = "small"\n[train]\nsteps = 7\nseed = 3\n[train.optim]\nlr = 0.5\n'
                    '[peer]\nrun_id = "from-file"\n[node]\nsteps = 11\n')
    cfg = resolve(NodeConfig, node_defaults, file=path, flags={"peer.run_id": "from-flag", "node.steps": None},
                  sets=["optim.lr=0.25", "train.seed=4"], default_preset="tiny")
    assert cfg.train.model.d_model == 128  # the file's preset beats the command's default
    assert (cfg.train.steps, cfg.train.seed, cfg.train.optim.lr) == (7, 4, 0.25)  # --set beats the file
    assert cfg.peer.run_id == "from-flag" and cfg.node.steps == 11  # a flag not given leaves the file's value
    tiny = resolve(NodeConfig, node_defaults, file=path, flags={"preset": "tiny"}, default_preset="tiny")
    assert tiny.train.model.d_model == 32  # a given flag beats the file, whatever the default


def test_the_loopback_profile_yields_to_an_explicit_timing() -> None:
    cfg = resolve(NodeConfig, node_defaults, flags={"peer.loopback": True}, sets=["net.exchange.timeout_s=9"])
    assert cfg.net.gossip.poll_s == 0.5 and cfg.net.exchange.timeout_s == 9.0
    assert resolve(NodeConfig, node_defaults).net.gossip.poll_s == 2.0


def test_simulator_levers_are_refused_by_a_node_and_taken_by_the_simulator() -> None:
    assert resolve(TrainConfig, train_defaults, sets=["sim.dense_steps=5"]).sim.dense_steps == 5
    with pytest.raises(ConfigError, match="parallax sim"):
        resolve(NodeConfig, node_defaults, sets=["sim.dense_steps=5"])


def test_a_run_file_serves_every_command(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\nbatch_size = 3\n[peer]\nrun_id = "r"\n[node]\nsteps = 2\n')
    assert resolve(TrainConfig, train_defaults, file=path).batch_size == 3
    path.write_text('[colour]\nblue = 1\n')
    with pytest.raises(ConfigError, match="colour"):
        resolve(TrainConfig, train_defaults, file=path)


def test_show_prints_toml_that_reads_back_to_the_same_settings(tmp_path) -> None:
    result = runner.invoke(app, ["config", "show", "--set", "surrogate.input_grad=False", "--set", "optim.lr=1e-3"])
    assert result.exit_code == 0, result.output
    assert "input_grad = false" in result.output
    doc = tomllib.loads(result.output)
    assert doc["train"]["optim"]["lr"] == 1e-3
    path = tmp_path / "shown.toml"
    path.write_text(result.output)
    again = runner.invoke(app, ["config", "show", "--config", str(path)])
    assert again.output == result.output
    cfg = resolve(NodeConfig, node_defaults, file=path)
    assert to_toml(cfg) == result.output


@pytest.mark.parametrize("change", ["model.n_layers=2.5", "sync.outer_lr=abc"])
def test_show_refuses_bad_values_with_exit_2_and_one_line(change: str) -> None:
    result = runner.invoke(app, ["config", "show", "--set", change])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and change.split("=")[0] in lines[0]


def _settings(cls: type, path: str = "") -> list[tuple[str, type, str]]:
    """(path, owning class, field) for every setting under ``cls``, sections walked into."""
    out = []
    for name, tp in field_types(cls).items():
        out += _settings(tp, f"{path}{name}.") if is_section(tp) else [(f"{path}{name}", cls, name)]
    return out


@pytest.mark.parametrize("root", [NodeConfig, WorkerConfig, TrainConfig])
def test_every_setting_is_documented_and_the_explained_file_reads_back(root) -> None:
    undocumented = [path for path, cls, name in _settings(root) if not field_docs(cls).get(name)]
    assert not undocumented, undocumented
    cfg = resolve(root, ROOTS[{NodeConfig: "node", WorkerConfig: "worker", TrainConfig: "sim"}[root]][1])
    explained = to_explained_toml(cfg)
    assert tomllib.loads(explained) == tomllib.loads(to_toml(cfg))
    assert "# Re-read the surrogate announcements this often." in explained or root is not NodeConfig


def test_one_entry_of_a_mapping_setting_changes_alone() -> None:
    cfg = resolve(NodeConfig, node_defaults, sets=["sync.periods.backbone=50"])
    assert cfg.train.sync.periods == {"router": 25, "latent": 50, "backbone": 50}
    cfg = resolve(TrainConfig, train_defaults, sets=['sync.periods={"router": 5, "latent": 10, "backbone": 20}',
                                                      "sync.periods.latent=15"])
    assert cfg.sync.periods == {"router": 5, "latent": 15, "backbone": 20}
    with pytest.raises(ConfigError, match="sync.periods.backbone"):
        resolve(TrainConfig, train_defaults, sets=["sync.periods.backbone=often"])
    with pytest.raises(ConfigError, match="needs exactly the groups"):
        resolve(TrainConfig, train_defaults, sets=["sync.periods.experts=50"])


def test_one_loopback_profile_sets_every_sections_timings() -> None:
    internet, loopback = node_defaults("tiny", False).net, node_defaults("tiny", True).net
    assert loopback == NetConfig.loopback() and internet == NetConfig()
    assert loopback.outer.matchmaking_timeout_s < internet.outer.matchmaking_timeout_s
    assert loopback.gossip.poll_s < internet.gossip.poll_s and loopback.membership.idle_s < internet.membership.idle_s
