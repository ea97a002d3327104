"""``parallax doctor``: check that this machine can train in a swarm, one line per check (``node/peer/doctor.py``)."""

from __future__ import annotations

from pathlib import Path

import typer

from parallax.cli.options import ConfigFile, ManifestFile, Preset, Sets, fail, run_manifest


def doctor(
    initial_peers: list[str] | None = typer.Option(
        None, "--initial-peers", help="Peers to check (repeatable), as `node join` would take them."),
    run_id: str | None = typer.Option(None, "--run-id", help="A live run whose heartbeats the clock is checked "
                                      "against."),
    host: list[str] | None = typer.Option(None, "--host", help="Multiaddr to listen on, as `node join --host` "
                                          "(default every interface)."),
    announce: list[str] | None = typer.Option(None, "--announce", help="Public multiaddr, as `node join --announce`."),
    loopback: bool = typer.Option(False, "--loopback", help="Peers on this machine only (a local swarm): loopback "
                                  "addresses are enough."),
    gpu: int | None = typer.Option(None, "--gpu", help="Check CUDA device N."),
    cpu: bool = typer.Option(False, "--cpu", help="Check training on the CPU."),
    preset: Preset = None,
    manifest_file: ManifestFile = None,
    config_file: ConfigFile = None,
    set_: Sets = None,
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Where checkpoints would go."),
    timeout: float = typer.Option(10.0, "--timeout", min=0.5, help="Seconds for each peer to answer."),
    clock_s: float = typer.Option(5.0, "--clock-s", min=0.5, help="Seconds to read heartbeats for the clock check."),
) -> None:
    """Check p2pd, the initial peers, reachability, the clock, the device, memory and disk. Exit code 1 when
    something blocks training."""
    from parallax.dht.adapter import parse_initial_peers
    from parallax.node.config.peer import NodeConfig
    from parallax.node.config.resolve import node_defaults, resolve
    from parallax.node.config.typed import ConfigError
    from parallax.node.peer import doctor as checks
    from parallax.node.train.device import DeviceError, device_of, device_setting

    flags = {"preset": preset, "peer.host": host or None, "peer.announce": announce or None,
             "node.checkpoint_dir": checkpoint_dir, "peer.loopback": loopback or None}
    try:
        flags["node.device"] = device_setting(gpu, cpu)
        manifest, flags["peer.run_id"] = run_manifest(manifest_file, run_id)
        config = resolve(NodeConfig, node_defaults, file=config_file, flags=flags, sets=set_ or (),
                         default_preset="tiny", manifest=manifest)
        peers = parse_initial_peers(initial_peers or [])
    except (ConfigError, DeviceError, ValueError) as e:
        fail(e)

    results: list[checks.Check] = []

    def say(check: checks.Check) -> None:
        results.append(check)
        typer.echo(check.line())

    params, need = checks.composer_bytes(config.train)
    device = checks.check_device(config.node.device, need)
    say(device)
    try:
        on_gpu = device_of(config.node.device).type == "cuda"
    except DeviceError:  # said in the device line
        on_gpu = False
    say(checks.check_memory(need, on_gpu=on_gpu))
    say(checks.check_disk(config.node.checkpoint_dir, params))
    started, dht = checks.check_p2pd(config.peer.listen, config.peer.announce)
    say(started)
    if dht is not None:
        try:
            say(checks.check_reachable(dht.visible_maddrs(), config.peer.announce, local=config.peer.loopback))
            for check in checks.check_peers(dht, peers, timeout):
                say(check)
            if not peers:
                say(checks.Check("peers", "warn", "no --initial-peers given: only this machine was checked",
                                 "give the --initial-peers line of a running swarm"))
            elif run_id is not None or manifest is not None:
                say(checks.check_clock(dht, config.peer.run_id, clock_s))
        finally:
            dht.shutdown()
    failed = [c.name for c in results if c.verdict == "fail"]
    if failed:
        typer.echo(f"{len(failed)} check(s) block training: {', '.join(failed)}", err=True)
        raise typer.Exit(1)
    typer.echo("nothing blocks training" + (" (see the warnings above)" if any(c.verdict == "warn" for c in results)
                                             else ""))


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
