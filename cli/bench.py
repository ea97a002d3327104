"""``parallax bench ...``: the measured comparisons. Each command writes JSON and a markdown summary."""

from __future__ import annotations

import typer

from parallax.cli.options import BatchSize, Composers, Data, JsonPath, Preset, Quiet, Seed, Steps

QUALITY_RUNS = ("baseline", "diloco", "parallax", "no_surrogates", "frozen_copies", "plain_mean")

bench_app = typer.Typer(help="Benchmarks: each writes JSON (--json) and prints a markdown table.", no_args_is_help=True)


@bench_app.command("quality")
def quality(
    composers: Composers = 4,
    preset: Preset = "small",
    steps: Steps = None,
    batch_size: BatchSize = None,
    seed: Seed = 0,
    data: Data = None,
    runs: str = typer.Option(",".join(QUALITY_RUNS), "--runs", help="Comma-separated subset of the runs."),
    json_path: JsonPath = None,
    quiet: Quiet = False,
) -> None:
    """Parallax vs a synchronous MoE and a DiLoCo reference at equal tokens (about 25 min on 2 cores)."""
    from parallax.benchmarks.quality import markdown, run_quality, write
    from parallax.cli.progress import run_progress
    from parallax.node.config import train_config

    try:
        cfg = train_config(preset, steps=steps, batch_size=batch_size, seed=seed)
        names = [r.strip() for r in runs.split(",") if r.strip()]
        with run_progress(cfg.steps, enabled=not quiet) as progress:
            report = run_quality(cfg, composers, data, runs=names, progress=progress)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    write(report, json_path)
    typer.echo(markdown(report))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
