"""``parallax checkpoints list DIR``: a node's checkpoints, each checked whole, newest last."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

checkpoints_app = typer.Typer(help="A node's checkpoints (--checkpoint-dir).", no_args_is_help=True,
                              rich_markup_mode=None)


@checkpoints_app.command("list")
def list_checkpoints_command(
    folder: Path = typer.Argument(..., help="A node's --checkpoint-dir."),
    as_json: bool = typer.Option(False, "--json", help="Print the list as JSON."),
) -> None:
    """Every checkpoint in FOLDER with its step, run, save time and experts, each verified (manifest, sizes,
    sha256): resume from a sound one with `node join --resume FOLDER/step-N`. Exit 1 when there is none."""
    from parallax.node.train.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, verify_checkpoint

    found = list_checkpoints(folder)
    if not found:
        typer.echo(f"error: no checkpoint in {folder} (a folder a node wrote with --checkpoint-dir)", err=True)
        raise typer.Exit(1)
    latest = latest_checkpoint(folder)
    rows: list[dict[str, Any]] = []
    for path in found:
        try:
            info = verify_checkpoint(path)
            saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.saved_unix_s))
            rows.append({"path": str(path), "step": info.step, "run_id": info.run_id,
                         "experts": sum(map(len, info.owned)), "saved": saved, "ok": True, "problem": None,
                         "latest": path == latest})
        except CheckpointError as e:
            rows.append({"path": str(path), "step": None, "run_id": None, "experts": None, "saved": None, "ok": False,
                         "problem": str(e), "latest": path == latest})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"checkpoints in {folder}, oldest first")
    for column in ("checkpoint", "step", "run", "experts", "saved", "state"):
        table.add_column(column, justify="right" if column in ("step", "experts") else "left",
                         overflow="fold" if column == "state" else "ellipsis")
    for r in rows:
        name = Path(r["path"]).name + (" (latest)" if r["latest"] else "")
        state = "ok" if r["ok"] else f"unusable: {r['problem']}"
        table.add_row(name, str(r["step"] if r["ok"] else "-"), r["run_id"] or "-", str(r["experts"] or "-"),
                      r["saved"] or "-", state)
    console = Console()
    console.print(table, markup=False)
    good = [r for r in rows if r["ok"]]
    if good:
        console.print(f"resume from the newest sound one: parallax node join ... --resume {good[-1]['path']}",
                      markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.add_typer(checkpoints_app, name="checkpoints")
