"""``parallax keys ...``: create and inspect a node's Ed25519 identity file."""

from __future__ import annotations

from pathlib import Path

import typer

from parallax.protocol.errors import KeyFileError
from parallax.protocol.identity import Identity

keys_app = typer.Typer(help="Node identities: Ed25519 key files (PEM, owner-only).",
                       no_args_is_help=True, rich_markup_mode=None)

KeyPath = typer.Argument(..., help="Path of the key file (PEM, created with mode 0600).")


@keys_app.command("new")
def new(path: Path = KeyPath) -> None:
    """Create a new identity at PATH; refuses to overwrite an existing file."""
    try:
        identity = Identity.generate()
        identity.save(path)
    except (KeyFileError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"created {path} (mode 0600)")
    _describe(identity)


@keys_app.command("show")
def show(path: Path = KeyPath) -> None:
    """Print the fingerprint and public key of the identity at PATH."""
    try:
        identity = Identity.load(path)
    except (KeyFileError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    _describe(identity)


def _describe(identity: Identity) -> None:
    typer.echo(f"fingerprint: {identity.fingerprint}")
    typer.echo(f"public key:  {identity.public_key.hex()}")


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")
