"""``parallax sim``: C composers in one process, no network, the reference for every networked run.

With no options it is the project's first run: four composers of the ``tiny`` model for 500 steps (about a
minute on two cores), then the synchronous baseline of the same model and tokens beside it, then the exported
model and what to try next. Ctrl+C ends the run after the current step and prints the result so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from parallax.cli.options import RunOptions, fail, new_run_folder, with_run_options
from parallax.cli.progress import run_progress
from parallax.node.sim import RUN_KINDS

if TYPE_CHECKING:
    from parallax.node.sim.simulator import RunResult


@with_run_options
def sim(
    opts: RunOptions,
    kind: str = typer.Option("parallax", "--kind", help=f"What to run: {', '.join(RUN_KINDS)}."),
    reference: bool = typer.Option(
        True, "--reference/--no-reference", help="Also run the synchronous baseline of the same model and tokens, "
        "and print the ratio."),
    out: Path = typer.Option(
        Path("parallax-sim"), "--out", help="Folder for this run's checkpoints and exported model (a new "
        "sub-folder per run)."),
    export: bool = typer.Option(True, "--export/--no-export", help="Write the trained model (parallax export)."),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="bytes (each byte a token) or bpe (a byte-level BPE of model.vocab_size tokens, "
        "trained here on the corpus). Default: the preset's (bytes for tiny and small, bpe for medium and large)."),
) -> None:
    """Run C composers in one process (no network); print the validation loss beside the synchronous baseline's,
    and export the model. Preset tiny unless told otherwise."""
    from parallax.errors import NodeError
    from parallax.node.export.offline import export_checkpoints
    from parallax.node.sim.simulator import RunSpec, run
    from parallax.node.train.data import CorpusInfo, load_corpus
    from parallax.node.train.tokenizer import make_tokenizer, tokenized_splits

    if tokenizer is not None:  # before the user's own --set, which may still change it
        opts = dataclasses.replace(opts, sets=[f"model.tokenizer={tokenizer}", *(opts.sets or [])])
    cfg = opts.train_config(default_preset="tiny")
    logging.getLogger("parallax.node.train.checkpoint").setLevel(logging.WARNING)  # one line per save: noise here
    try:
        spec = RunSpec(name=kind, kind=kind, cfg=cfg, composers=opts.composers)
        corpus = load_corpus(opts.data)
        tok = make_tokenizer(cfg.model, corpus)
        splits = tokenized_splits(corpus, tok, seq_len=cfg.model.seq_len)
    except ValueError as e:
        fail(e)
    train, val = splits.train, splits.val
    console = Console()
    folder = new_run_folder(out, kind) if export else None
    m = cfg.model
    console.print(f"{kind}: {opts.composers} composer(s) of a {m.n_layers}-layer MoE (d_model {m.d_model}, "
                  f"{m.n_experts} experts, top-{m.top_k}), {cfg.steps} steps of {cfg.batch_size} x {m.seq_len} "
                  f"{'byte tokens' if tok.kind == 'bytes' else f'tokens (BPE of {tok.vocab_size})'} each. Ctrl+C "
                  "stops after the current step with the result so far.")
    with stop_on_signal(console) as stop, run_progress(cfg.steps, enabled=not opts.quiet) as progress:
        result = run(spec, train, val, progress=progress, checkpoint_dir=folder / "checkpoints" if folder else None,
                     should_stop=stop.is_set, data=CorpusInfo.of(opts.data, corpus))
        baseline = None
        if reference and kind != "baseline" and not stop.is_set():
            same = RunSpec(name="baseline", kind="baseline", cfg=cfg, composers=opts.composers)
            baseline = run(same, train, val, progress=progress, should_stop=stop.is_set)
    stopped = result.steps < cfg.steps or (baseline is not None and baseline.steps < result.steps)
    _print_result(console, kind, result, baseline, cfg.steps, opts.data, splits.val_bytes_per_token,
                  cfg.model.vocab_size)
    model = None
    if folder is not None:
        try:
            model = export_checkpoints(sorted((folder / "checkpoints").iterdir()), folder / "model", data=opts.data,
                                       tokenizer=tok)
        except (NodeError, ValueError) as e:
            console.print(f"[yellow]model not exported: {e}[/yellow]")
    if model is not None:
        console.print(f"model: {model} (weights, config, a model card)")
    console.print("next:")
    if model is not None:
        console.print(f"  parallax generate {model} --prompt 'ROMEO:'", soft_wrap=True)
    console.print("  parallax swarm local --nodes 3 --steps 100   (the same training as peers on this machine)",
                  soft_wrap=True)
    if opts.json_path is not None:
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        per_byte = splits.val_bytes_per_token
        doc: dict[str, Any] = result.__dict__ | {"val_loss": result.val_loss, "tokenizer": tok.kind,
                                                 "val_bytes_per_token": per_byte,
                                                 "val_loss_per_byte": result.val_loss / per_byte,
                                                 "assembled_val_loss_per_byte": result.assembled_val_loss / per_byte}
        if baseline is not None:
            doc["reference"] = baseline.__dict__ | {
                "val_loss": baseline.val_loss, "assembled_val_loss_per_byte": baseline.assembled_val_loss / per_byte}
        opts.json_path.write_text(json.dumps(doc, indent=2))
    if stopped:
        raise typer.Exit(130)


def _print_result(console: Console, kind: str, result: RunResult, baseline: RunResult | None, steps: int,
                  data: str | None, bytes_per_token: float, vocab_size: int) -> None:
    if result.steps < steps:
        console.print(f"[yellow]stopped at step {result.steps} of {steps}: the result below is for those steps"
                      "[/yellow]")
    where = f"the held-out tail of {data}" if data else "the held-out tail of the built-in corpus"
    bytes_tokens = bytes_per_token == 1.0
    unit = "nats per byte" if bytes_tokens else "nats per token and per byte"
    table = Table(title=f"validation loss in {unit} on {where}; lower is better", title_justify="left")
    table.add_column("model")
    table.add_column("val loss" if bytes_tokens else "per token", justify="right")
    if not bytes_tokens:
        table.add_column("per byte", justify="right")
    table.add_column("/ baseline", justify="right")

    def row(name: str, loss: float, ratio: str) -> None:
        cells = [f"{loss:.4f}"] if bytes_tokens else [f"{loss:.4f}", f"{loss / bytes_per_token:.4f}"]
        table.add_row(name, *cells, ratio)

    def ratio(loss: float) -> str:
        return f"{loss / baseline.assembled_val_loss:.3f}x" if baseline is not None else "-"

    if kind == "baseline":
        row("synchronous baseline", result.assembled_val_loss, "")
    else:
        row(f"{kind}: the exported model", result.assembled_val_loss, ratio(result.assembled_val_loss))
        row(f"{kind}: composers' own views, median", result.val_loss, ratio(result.val_loss))
        if baseline is not None:
            note = "" if baseline.steps == result.steps else f" (stopped at step {baseline.steps})"
            row(f"synchronous baseline, same tokens{note}", baseline.assembled_val_loss, "1.000x")
    row("a uniform guess", math.log(vocab_size), "")
    console.print(table)
    if baseline is None and kind != "baseline" and result.steps < steps:
        console.print("the baseline was not run (stopped); for it: parallax sim --kind baseline --steps "
                      f"{result.steps}")
    console.print(f"tokens {result.tokens:,} in {result.wall_s:.0f} s; train FLOPs {result.train_flops:.3e}")
    if result.stand_in_error:
        step, output, backward = result.stand_in_error[-1]
        console.print(f"surrogates at the last refresh (step {step}): relative output error {output:.4f}, "
                      f"input-gradient error {backward:.4f}")


@contextlib.contextmanager
def stop_on_signal(console: Console) -> Iterator[threading.Event]:
    """An event the first Ctrl+C (or SIGTERM) sets; the second ends the command at once, as everywhere. The
    previous handlers come back on exit."""
    stop = threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def first(_signum: int, _frame: Any) -> None:
        stop.set()
        console.print("[yellow]stopping after the current step (Ctrl+C again to quit at once)[/yellow]")
        for s, handler in previous.items():
            signal.signal(s, handler)

    for s in previous:
        signal.signal(s, first)
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def register(app: typer.Typer) -> None:
    app.command(name="sim")(sim)
