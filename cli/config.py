"""``parallax config show``: the settings a command would run with, as a TOML file ``--config`` reads back."""

from __future__ import annotations

import typer

from parallax.cli.options import ConfigFile, Preset, Sets, fail

config_app = typer.Typer(help="Inspect the settings a run would use.", no_args_is_help=True, rich_markup_mode=None)


@config_app.command("show")
def show(
    preset: Preset = None,
    config_file: ConfigFile = None,
    set_: Sets = None,
    command: str = typer.Option("node", "--for", help="Whose settings: node (node join), worker (worker join) or "
                                "sim (sim and the in-process benchmarks)."),
    explain: bool = typer.Option(False, "--explain", help="Write each setting's description above it, as a "
                                 "comment (the file still reads back with --config)."),
) -> None:
    """Print the resolved settings (defaults < --config file < --set) as TOML."""
    from parallax.node.config.resolve import ROOTS, resolve
    from parallax.node.config.typed import ConfigError, to_explained_toml, to_toml

    if command not in ROOTS:
        fail(f"--for {command!r}: choose one of {', '.join(ROOTS)}")
    root, build, default_preset = ROOTS[command]
    try:
        cfg = resolve(root, build, file=config_file, flags={"preset": preset}, sets=set_ or (),
                      default_preset=default_preset)
    except ConfigError as e:
        fail(e)
    typer.echo(to_explained_toml(cfg) if explain else to_toml(cfg), nl=False)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
