"""``parallax export``, ``parallax generate``, ``parallax eval``: the trained model out of a run, and used."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer
from rich.console import Console

from parallax.cli.options import Data, ManifestFile, MemberCertFile, RunCreator, RunDigest, fail, run_manifest

if TYPE_CHECKING:
    from parallax.node.export.folder import Form

ModelDir = typer.Argument(..., help="An exported model folder (`parallax export --out`).")


def export(
    out: Path = typer.Option(..., "--out", help="The model folder to create (must not exist, or be empty)."),
    from_checkpoints: list[Path] | None = typer.Option(
        None, "--from-checkpoints", help="A composer's --checkpoint-dir (repeat for each composer of the run)."),
    step: int | None = typer.Option(
        None, "--step", min=0, help="With --from-checkpoints: each composer's newest checkpoint at or before step N "
        "instead of its latest (`parallax checkpoints list DIR` lists them)."),
    allow_missing: bool = typer.Option(
        False, "--allow-missing", help="Write experts nobody holds as zeros (named in the model card) instead of "
        "failing."),
    data: Data = None,
    initial_peers: list[str] | None = typer.Option(
        None, "--initial-peers", help="A live peer of the run, ending in /p2p/<id> (repeatable): export from the "
        "running swarm."),
    run_id: str | None = typer.Option(None, "--run-id", help="The run to export from the live swarm."),
    manifest_file: ManifestFile = None,
    member_cert: MemberCertFile = None,
    digest: RunDigest = None,
    creator: RunCreator = None,
    identity: Path | None = typer.Option(
        None, "--identity", help="Key file the exporter signs its heartbeats with (default ~/.parallax/reader.key)."),
    loopback: bool = typer.Option(False, "--loopback", help="Listen on 127.0.0.1 (a swarm on this machine)."),
    timeout: float = typer.Option(60.0, "--timeout", min=1.0, help="Seconds for the manifest read, then for the "
                                  "whole fetch of the shared groups and the experts."),
    license: str | None = typer.Option(
        None, "--license", help="The licence the model card gives the weights, as an SPDX id (e.g. apache-2.0)."),
    tokenizer_file: Path | None = typer.Option(
        None, "--tokenizer", help="The run's tokenizer.json, for a run with model.tokenizer=bpe (default: the one "
        "beside --manifest)."),
    form: Literal["parallax", "hf"] = typer.Option(
        "parallax", "--format", help="parallax: the folder parallax generate, eval and load read; hf: a standard "
        "Hugging Face transformers checkpoint (Mixtral or Qwen2-MoE) with its tokenizer, for transformers and the "
        "tools built on it (lm-eval)."),
) -> None:
    """Assemble the trained model of a run (every expert real) into one folder: model.safetensors, config.json,
    a model card. From checkpoint folders, or from a live swarm (each expert from its owner, the shared groups
    as the composers merged them)."""
    from parallax.cli.entry import Interrupted
    from parallax.errors import NodeError
    from parallax.node.export.offline import export_checkpoints
    from parallax.node.train.checkpoint import checkpoint_at
    from parallax.node.train.tokenizer import BpeTokenizer
    from parallax.node.train.tokenizer import tokenizer_file as tokenizer_file_of

    if step is not None and not from_checkpoints:
        fail("--step picks checkpoints: give the composers' --from-checkpoints DIR (a live swarm exports its present)")
    if bool(from_checkpoints) == bool(initial_peers):
        fail("say where the model comes from: --from-checkpoints DIR (one per composer), or --initial-peers ADDR "
             "--run-id RUN for a live swarm")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"{out} exists and is not an empty folder; choose a new --out")
    try:
        if tokenizer_file is None and manifest_file is not None and tokenizer_file_of(manifest_file).is_file():
            tokenizer_file = tokenizer_file_of(manifest_file)
        tokenizer = BpeTokenizer.load(tokenizer_file) if tokenizer_file is not None else None
        if from_checkpoints:
            if step is not None:
                from_checkpoints = [checkpoint_at(root, step) for root in from_checkpoints]
            folder = export_checkpoints(from_checkpoints, out, allow_missing=allow_missing, data=data,
                                        tokenizer=tokenizer, license=license, form=form)
        else:
            folder = _export_live(initial_peers or [], run_id, manifest_file, member_cert, identity, loopback, out,
                                  allow_missing=allow_missing, digest=digest, creator=creator, data=data,
                                  timeout=timeout, tokenizer=tokenizer, license=license, form=form)
    except (NodeError, ValueError, OSError) as e:
        fail(e, code=1)
    except (KeyboardInterrupt, Interrupted):
        fail("stopped before the export was written; nothing was written", code=130)
    _exported(folder)


def _export_live(initial_peers: list[str], run_id: str | None, manifest_file: Path | None,
                 member_cert: Path | None, identity: Path | None, loopback: bool, out: Path, *, allow_missing: bool,
                 digest: str | None, creator: str | None, data: str | None, timeout: float, tokenizer: Any,
                 license: str | None, form: Form) -> Path:
    from parallax.node.config.peer import PeerConfig
    from parallax.node.export.live import export_live
    from parallax.protocol.identity import Identity

    _manifest, run_id = run_manifest(manifest_file, run_id)
    if run_id is None:
        fail("a live export needs --run-id (or the run's --manifest)")
    peer = PeerConfig(run_id=run_id, identity=identity, initial_peers=tuple(initial_peers), loopback=loopback,
                      manifest=manifest_file, member_cert=member_cert, relay="off")
    key = Identity.load_or_create(peer.identity_path("reader"))
    return export_live(peer, key, out, allow_missing=allow_missing, digest=digest, creator=creator, data=data,
                       timeout_s=timeout, tokenizer=tokenizer, license=license, form=form)


def _exported(folder: Path) -> None:
    from parallax.node.export.folder import CONFIG, HF_DESCRIPTION

    hf = (folder / HF_DESCRIPTION).is_file()
    config = json.loads((folder / (HF_DESCRIPTION if hf else CONFIG)).read_text())
    p = config["provenance"]
    said = f"exported {len(p['experts'])} experts from {len(p['nodes'])} node(s) of run {p['run_id']} to {folder}"
    if p.get("val_loss"):
        said += f"; val loss {p['val_loss']['nats_per_byte']:.4f} nats per byte"
    if p["missing"]:
        said += f"; {len(p['missing'])} missing expert(s) written as zeros"
    typer.echo(said)
    if hf:
        typer.echo(f"next: python -c \"from transformers import pipeline; print(pipeline('text-generation', "
                   f"'{folder}')('ROMEO:', max_new_tokens=100)[0]['generated_text'])\"")
    else:
        typer.echo(f"next: parallax generate {folder} --prompt 'ROMEO:'")


def generate(
    model_dir: Path = ModelDir,
    prompt: str = typer.Option("", "--prompt", help="Text to continue."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", min=0, help="Tokens to sample."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 picks the most likely token."),
    top_k: int | None = typer.Option(50, "--top-k", min=1, help="Sample among the k most likely tokens."),
    top_p: float | None = typer.Option(
        None, "--top-p", min=0.0, max=1.0, help="Sample among the fewest most likely tokens whose probabilities add "
        "up to p (nucleus sampling), after --top-k."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the sampler (same seed, same text)."),
) -> None:
    """Continue a prompt with an exported model; prints the prompt, then the sampled text as it comes."""
    from parallax.node.export.folder import ExportError, read_model
    from parallax.node.export.use import generate as sample

    try:
        exported = read_model(model_dir)
    except (ExportError, OSError) as e:
        fail(e, code=1)
    sys.stdout.write(prompt)
    sys.stdout.flush()

    def show(piece: bytes) -> None:  # each piece of text as it is sampled
        sys.stdout.write(piece.decode("utf-8", errors="replace"))
        sys.stdout.flush()

    try:
        sample(exported.model, prompt.encode(), max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
               top_p=top_p, seed=seed, tokenizer=exported.tokenizer, on_text=show)
    except ValueError as e:
        fail(e, code=2)
    sys.stdout.write("\n")


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
                             val_fraction=float(windows.get("val_fraction", 0.05)), tokenizer=exported.tokenizer)
    except (ExportError, ValueError, OSError) as e:
        fail(e, code=1)
    if json_out:
        typer.echo(json.dumps(result.as_dict()))
        return
    Console().print(f"{result.nats_per_token:.4f} nats per token, {result.nats_per_byte:.4f} nats per byte "
                    f"({result.bits_per_byte:.3f} bits), perplexity {result.perplexity:.2f}; {result.windows} windows, "
                    f"{result.tokens:,} tokens of {result.data}")


def report(
    metrics: list[Path] = typer.Argument(..., help="Nodes' metrics files (node join --metrics), one per node."),
    out: Path = typer.Option(..., "--out", help="Folder for the plots and report.md."),
    baseline: Path | None = typer.Option(
        None, "--baseline", help="A `parallax bench quality --json` file: its synchronous baseline's validation "
        "curve joins the loss plot."),
) -> None:
    """Plots and a markdown summary of a run from its nodes' metrics files: loss per node, tokens/s, bytes per
    step, outer-round outcomes (needs matplotlib: pip install -e '.[bench]')."""
    from parallax.node.peer.report import report_run

    try:
        path = report_run(metrics, out, baseline)
    except ModuleNotFoundError as e:
        fail(f"{e}; install the plotting extra: pip install -e '.[bench]'", code=1)
    except ValueError as e:
        fail(e, code=1)
    typer.echo(f"wrote {path} and its plots (loss.png, throughput.png, rounds.png)")


def register(app: typer.Typer) -> None:
    app.command(name="export")(export)
    app.command(name="generate")(generate)
    app.command(name="eval")(evaluate)
    app.command(name="report")(report)
