"""``parallax sim``: C composers in one process, no network, the reference for every networked run."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from parallax.cli.options import RunOptions, fail, with_run_options
from parallax.cli.progress import run_progress
from parallax.node.sim.simulator import RUN_KINDS, RunSpec, run
from parallax.node.train.data import load_corpus, split_corpus


@with_run_options
def sim(
    opts: RunOptions,
    kind: str = typer.Option("parallax", "--kind", help=f"What to run: {', '.join(RUN_KINDS)}."),
    checkpoint_dir: Path | None = typer.Option(
        None, "--checkpoint-dir", help="Save each composer's final checkpoint to DIR/composer-<i> (for "
        "`parallax export --from-checkpoints`)."),
) -> None:
    """Run C composers in one process (no network) and print each one's validation loss."""
    cfg = opts.train_config()
    try:
        spec = RunSpec(name=kind, kind=kind, cfg=cfg, composers=opts.composers)
        train, val = split_corpus(load_corpus(opts.data))
    except ValueError as e:
        fail(e)
    with run_progress(cfg.steps, enabled=not opts.quiet) as progress:
        result = run(spec, train, val, progress=progress, checkpoint_dir=checkpoint_dir)
    table = Table(title=f"{kind}: {opts.composers} composer(s), d_model {cfg.model.d_model}, {cfg.steps} steps")
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
    if opts.json_path is not None:
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(json.dumps(result.__dict__ | {"val_loss": result.val_loss}, indent=2))


def register(app: typer.Typer) -> None:
    app.command(name="sim")(sim)
