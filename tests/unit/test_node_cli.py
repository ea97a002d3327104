"""``parallax node join``: bad input is refused with a clear message before anything starts."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from parallax.cli.main import app
from parallax.cli.node import _invoked_as_node_join

runner = CliRunner()


def join(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["node", "join", "--quiet", "--loopback", *args])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is absent")
def test_gpu_without_cuda_says_what_to_do(tmp_path) -> None:
    result = join("--gpu", "0", "--identity", str(tmp_path / "k"))
    assert result.exit_code == 2
    assert "--cpu" in result.output


def test_resume_needs_a_checkpoint_dir(tmp_path) -> None:
    result = join("--cpu", "--resume", "latest", "--identity", str(tmp_path / "k"))
    assert result.exit_code == 2
    assert "--checkpoint-dir" in result.output


def test_malformed_initial_peer_is_named(tmp_path) -> None:
    result = join("--cpu", "--initial-peers", "/ip4/127.0.0.1/tcp/notaport", "--identity", str(tmp_path / "k"))
    assert result.exit_code == 2
    assert "notaport" in result.output


def test_unknown_config_field_is_named(tmp_path) -> None:
    result = join("--cpu", "--set", "sync.no_such_field=1", "--identity", str(tmp_path / "k"))
    assert result.exit_code == 2
    assert "no_such_field" in result.output


@pytest.mark.parametrize("change", ["sim.sketch.enabled=true", "sim.dense_steps=50", "optim.inner=muon"])
def test_simulator_only_levers_are_refused_with_what_to_do(tmp_path, change) -> None:
    result = join("--cpu", "--set", change, "--identity", str(tmp_path / "k"))
    assert result.exit_code == 2
    message = " ".join(result.output.replace("│", " ").split())  # unwrapped from rich's error box
    assert change.split("=")[0] in message and "parallax sim" in message


def test_replicated_experts_with_offload_are_refused_with_what_to_do(tmp_path) -> None:
    result = join("--cpu", "--set", "ownership.replicas=2", "--set", "offload.enabled=true",
                  "--identity", str(tmp_path / "k"))
    assert result.exit_code == 2
    message = " ".join(result.output.replace("│", " ").split())
    assert "ownership.replicas=2" in message and "offload" in message


def test_config_file_errors_name_the_setting_and_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[peer]\ncolour = "blue"\n')
    result = join("--cpu", "--config", str(bad), "--identity", str(tmp_path / "k"))
    assert result.exit_code == 2 and "peer.colour" in result.output and "Traceback" not in result.output
    result = join("--cpu", "--config", str(tmp_path / "missing.toml"), "--identity", str(tmp_path / "k"))
    assert result.exit_code == 2 and "no such file" in result.output


def test_missing_data_file_is_an_error_not_a_traceback(tmp_path) -> None:
    result = join("--cpu", "--data", str(tmp_path / "nope.txt"), "--identity", str(tmp_path / "k"))
    assert result.exit_code == 1
    assert "nope.txt" in result.output.replace("\n", "")  # the console wraps a long path anywhere


def test_supervision_only_when_run_from_a_command_line() -> None:
    assert _invoked_as_node_join(["/bin/parallax", "node", "join", "--cpu"])
    assert _invoked_as_node_join(["/x/__main__.py", "--log-level", "DEBUG", "node", "join"])
    assert not _invoked_as_node_join(["/bin/pytest", "tests/unit", "-q"])
    assert not _invoked_as_node_join(["node", "join"])  # argv[0] is the program, never the command


@pytest.mark.parametrize("width", [20, 40, 80, 120, 300])
def test_the_join_line_prints_whole_on_one_line_at_any_width(tmp_path, width) -> None:
    import io
    import shlex
    from types import SimpleNamespace

    from rich.console import Console

    from parallax.cli.node import join_line, print_join_line
    from parallax.node.config.peer import PeerConfig

    address = "/ip4/127.0.0.1/tcp/41234/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
    manifest = tmp_path / "a run" / "demo.json"
    for peer, expected in ((PeerConfig(run_id="demo", loopback=True, manifest=manifest), ["--manifest", str(manifest)]),
                           (PeerConfig(run_id="demo"), ["--preset", "small", "--set", 'sync.periods={"router": 5}'])):
        config = SimpleNamespace(peer=peer)
        line = join_line(config, f"--initial-peers {address}", preset="small", sets=['sync.periods={"router": 5}'])
        out = io.StringIO()
        print_join_line(Console(file=out, width=width, force_terminal=True),
                        SimpleNamespace(peer_id="QmPeer", run_digest="ab12"), line)
        lines = out.getvalue().splitlines()
        assert lines[1] == f"  {line}", lines  # no break inserted, nothing styled or cut
        argv = shlex.split(line)
        assert argv[:5] == ["parallax", "node", "join", "--run-id", "demo"]
        assert argv[-2:] == ["--initial-peers", address]
        assert " ".join(expected) in " ".join(argv) and ("--loopback" in argv) == peer.loopback


@pytest.mark.parametrize(("command", "root"), [("node", "NodeConfig"), ("worker", "WorkerConfig")])
def test_every_flag_of_a_join_names_a_setting_of_its_command(command, root) -> None:
    """The flag map is built from the options' own setting paths (``cli.options.Setting``): each must exist."""
    import inspect

    from parallax.cli import node, worker
    from parallax.cli.options import setting_flags
    from parallax.node.config import peer
    from parallax.node.config.typed import field_types

    join = {"node": node.join, "worker": worker.join}[command]
    flags = setting_flags(join, {name: None for name in inspect.signature(join).parameters})
    assert "peer.run_id" in flags and "peer.initial_peers" in flags
    for path in flags.keys() - {"preset"}:
        section: type = getattr(peer, root)
        *parents, leaf = path.split(".")
        for name in parents:
            section = field_types(section)[name]
        assert leaf in field_types(section), path


def test_the_live_table_says_the_target_step_and_the_time_left() -> None:
    from rich.console import Console

    from parallax.cli.node import _duration, _status_table
    from parallax.node.peer.telemetry import NodeStatus

    assert [_duration(s) for s in (None, 20, 180, 7_500)] == ["-", "under a minute", "about 3 min",
                                                              "about 2 h 05 min"]
    status = NodeStatus(fingerprint="ab12", step=120, trained=20, schedule="step 120 of 500 (24%)", time_left_s=190)
    console = Console(width=100, record=True)
    console.print(_status_table(status))
    text = console.export_text()
    assert "step 120 of 500 (24%)" in text and "about 3 min" in text
