"""``parallax sim``: C composers in one process, no network, the reference for every networked run."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from parallax.cli.options import BatchSize, Composers, Data, JsonPath, Preset, Quiet, Seed, Sets, Steps
from parallax.cli.progress import run_progress
from parallax.node.config.train import override, parse_changes, train_config
from parallax.node.sim.simulator import RUN_KINDS, RunSpec, run
from parallax.node.train.data import load_corpus, split_corpus


def sim(
    composers: Composers = 4,
    preset: Preset = "small",
    steps: Steps = None,
    batch_size: BatchSize = None,
    seed: Seed = 0,
    kind: str = typer.Option("parallax", "--kind", help=f"What to run: {', '.join(RUN_KINDS)}."),
    data: Data = None,
    set_: Sets = None,
    json_path: JsonPath = None,
    quiet: Quiet = False,
) -> None:
    """Run C composers in one process (no network) and print each one's validation loss."""
    try:
        cfg = train_config(preset, steps=steps, batch_size=batch_size, seed=seed)
        cfg = override(cfg, parse_changes(set_ or []))
        spec = RunSpec(name=kind, kind=kind, cfg=cfg, composers=composers)
        train, val = split_corpus(load_corpus(data))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    with run_progress(cfg.steps, enabled=not quiet) as progress:
        result = run(spec, train, val, progress=progress)
    table = Table(title=f"{kind}: {composers} composer(s), preset {preset}, {cfg.steps} steps")
    table.add_column("composer")
    table.add_column("val loss (own view)", justify="right")
    for i, loss in enumerate(result.composer_val_losses):
        table.add_row(str(i), f"{loss:.4f}")
    console = Console()
    console.print(table)
    console.print(f"median {result.val_loss:.4f}  assembled {result.assembled_val_loss:.4f}  "
                  f"tokens {result.tokens:,}  train FLOPs {result.train_flops:.3e}  wall {result.wall_s:.1f} s")
    if result.stand_in_error:
        step, output, backward = result.stand_in_error[-1]
        console.print(f"surrogates at the last refresh (step {step}): relative output error {output:.4f}, "
                      f"input-gradient error {backward:.4f}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.__dict__ | {"val_loss": result.val_loss}, indent=2))


def register(app: typer.Typer) -> None:
    app.command(name="sim")(sim)
