"""The ``parallax`` command.

Commands are thin: parse options, build a config, call into ``parallax.node`` (or ``dht``/``protocol``).
Each command group lives in its own module and is registered here.
"""

from __future__ import annotations

import logging

import typer

from parallax import __version__

app = typer.Typer(
    name="parallax",
    help="Decentralized Mixture-of-Experts training: owned experts, forward-only surrogates, tiered DiLoCo.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,  # help texts are literal: "[train]" and "'.[wandb]'" are text, not style tags
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"parallax {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    log_level: str = typer.Option("INFO", "--log-level", help="Python logging level: DEBUG, INFO, WARNING."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Parallax: train a sparse MoE language model across machines that are not in one data centre."""
    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        raise typer.BadParameter(f"unknown log level {log_level!r}; use DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register() -> None:
    # Imported here so that `parallax --help` stays fast and each group owns its module.
    from parallax.cli import bench, checkpoints, config, dht, doctor, keys, model, node, run, sim, swarm, worker

    sim.register(app)
    bench.register(app)
    config.register(app)
    keys.register(app)
    dht.register(app)
    swarm.register(app)
    run.register(app)
    doctor.register(app)
    node.register(app)
    worker.register(app)
    model.register(app)
    checkpoints.register(app)


_register()
