"""``parallax export``, ``parallax generate``, ``parallax eval``: the trained model out of a run, and used."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console

from parallax.cli.options import Data, fail

ModelDir = typer.Argument(..., help="An exported model folder (`parallax export --out`).")


def export(
    out: Path = typer.Option(..., "--out", help="The model folder to create (must not exist, or be empty)."),
    from_checkpoints: list[Path] | None = typer.Option(
        None, "--from-checkpoints", help="A composer's --checkpoint-dir (repeat for each composer of the run)."),
    allow_missing: bool = typer.Option(
        False, "--allow-missing", help="Write experts nobody holds as zeros (named in the model card) instead of "
        "failing."),
    data: Data = None,
) -> None:
    """Assemble the trained model of a run (every expert real) into one folder: model.safetensors, config.json,
    a model card."""
    from parallax.node.export.folder import ExportError
    from parallax.node.export.offline import export_checkpoints

    if not from_checkpoints:
        fail("say where the model comes from: --from-checkpoints DIR (one per composer)")
    try:
        folder = export_checkpoints(from_checkpoints, out, allow_missing=allow_missing, data=data)
    except (ExportError, ValueError) as e:
        fail(e, code=1)
    _exported(folder)


def _exported(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    p = config["provenance"]
    said = f"exported {len(p['experts'])} experts from {len(p['nodes'])} node(s) of run {p['run_id']} to {folder}"
    if p.get("val_loss"):
        said += f"; val loss {p['val_loss']['nats_per_byte']:.4f} nats per byte"
    if p["missing"]:
        said += f"; {len(p['missing'])} missing expert(s) written as zeros"
    typer.echo(said)
    typer.echo(f"next: parallax generate {folder} --prompt 'ROMEO:'")


def generate(
    model_dir: Path = ModelDir,
    prompt: str = typer.Option("", "--prompt", help="Text to continue."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", min=0, help="Tokens to sample."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 picks the most likely token."),
    top_k: int | None = typer.Option(50, "--top-k", min=1, help="Sample among the k most likely tokens."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the sampler (same seed, same text)."),
) -> None:
    """Continue a prompt with an exported model; prints the prompt and the sampled text."""
    from parallax.node.export.folder import ExportError, read_model
    from parallax.node.export.use import generate as sample

    try:
        model = read_model(model_dir).model
    except ExportError as e:
        fail(e, code=1)
    out = sample(model, prompt.encode(), max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 seed=seed)
    sys.stdout.write(prompt + out.decode("utf-8", errors="replace") + "\n")


def evaluate(
    model_dir: Path = ModelDir,
    data: Data = None,
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Windows per batch (default: the run's)."),
    batches: int | None = typer.Option(None, "--batches", min=1, help="Batches (default: the run's eval_batches)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Loss per token and per byte and perplexity of an exported model on the held-out tail of --data (the fixed
    windows training validates on)."""
    from parallax.node.export.folder import ExportError, read_model
    from parallax.node.export.use import evaluate_on

    try:
        exported = read_model(model_dir)
        windows = exported.eval_windows
        result = evaluate_on(exported.model, data, batch_size=batch_size or int(windows.get("batch_size", 8)),
                             eval_batches=batches or int(windows.get("eval_batches", 16)),
                             val_fraction=float(windows.get("val_fraction", 0.05)))
    except (ExportError, ValueError) as e:
        fail(e, code=1)
    if json_out:
        typer.echo(json.dumps(result.as_dict()))
        return
    Console().print(f"{result.nats_per_token:.4f} nats per token, {result.nats_per_byte:.4f} nats per byte "
                    f"({result.bits_per_byte:.3f} bits), perplexity {result.perplexity:.2f}; {result.windows} windows, "
                    f"{result.tokens:,} tokens of {result.data}")


def register(app: typer.Typer) -> None:
    app.command(name="export")(export)
    app.command(name="generate")(generate)
    app.command(name="eval")(evaluate)
