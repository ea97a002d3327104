"""``parallax run ...``: define a run once (a signed manifest), admit members to a private run, fetch and show."""

from __future__ import annotations

from pathlib import Path

import typer

from parallax.cli.options import ConfigFile, Data, Preset, RunCreator, RunDigest, Sets, fail

run_app = typer.Typer(help="Run manifests: the settings every peer of a run shares, signed by its creator.",
                      no_args_is_help=True, rich_markup_mode=None)

CreatorKey = typer.Option(None, "--identity", help="The creator's Ed25519 key file (default ~/.parallax/node.key; "
                          "created if missing). Keep it: it admits members to an allowlist run.")


@run_app.command("create")
def create(
    run_id: str = typer.Option(..., "--run-id", help="The run's name (every peer's --run-id)."),
    out: Path = typer.Option(..., "--out", help="Where to write the manifest (JSON)."),
    preset: Preset = None,
    config_file: ConfigFile = None,
    set_: Sets = None,
    admission: str = typer.Option("open", "--admission", help="open (anyone may join) or allowlist (only peers with "
                                  "a member certificate from this key: `parallax run admit`)."),
    identity: Path | None = CreatorKey,
    data: Data = None,
) -> None:
    """Write a run's manifest: the shared settings (defaults < --config < --preset < --set, as `node join`), signed.

    Peers start with `--manifest FILE`: they take its settings, and composers of another manifest ignore them. The
    manifest names the corpus (--data, default the built-in one): the run's composers train on the same text. With
    model.tokenizer=bpe (the medium and large presets) the BPE is trained on --data and written beside the
    manifest (RUN.tokenizer.json): hand both files to the run's peers."""
    from parallax.node.config.peer import NodeConfig
    from parallax.node.config.resolve import node_defaults, resolve
    from parallax.node.config.train import run_settings
    from parallax.node.train.data import load_corpus
    from parallax.node.train.tokenizer import BpeTokenizer, make_tokenizer, tokenizer_file
    from parallax.protocol import manifest as manifests
    from parallax.protocol.errors import KeyFileError
    from parallax.protocol.identity import Identity

    try:
        config = resolve(NodeConfig, node_defaults, file=config_file, flags={"preset": preset, "peer.run_id": run_id},
                         sets=set_ or (), default_preset="tiny")
        creator = Identity.load_or_create(_creator_path(identity))
        if out.exists():
            raise ValueError(f"{out} exists: choose another --out (a run's manifest is never rewritten in place)")
        model = config.train.model
        corpus = load_corpus(data)
        tokenizer = make_tokenizer(model, corpus if model.tokenizer == "bpe" else b"")
        manifest = manifests.create(creator, config.peer.run_id, run_settings(config.train), admission=admission,
                                    tokenizer=tokenizer.digest, corpus=manifests.corpus_digest(corpus))
        if isinstance(tokenizer, BpeTokenizer):
            typer.echo(f"wrote {tokenizer.save(tokenizer_file(out))}: the run's BPE of {tokenizer.vocab_size} tokens")
        manifests.save(manifest, out)
    except (ValueError, KeyFileError, OSError) as e:
        fail(e)
    typer.echo(f"wrote {out}: run {manifest.run_id}, digest {manifest.digest_hex}, admission {manifest.admission}, "
               f"creator {creator.fingerprint}")
    if manifest.admission == "allowlist":
        typer.echo("admit each member: parallax run admit --manifest "
                   f"{out} --member <their public key (parallax keys show)> --out member.cert")


@run_app.command("admit")
def admit(
    manifest_file: Path = typer.Option(..., "--manifest", help="The allowlist run's manifest."),
    member: str = typer.Option(..., "--member", help="The member's Ed25519 public key, 64 hex characters "
                               "(`parallax keys show` prints it)."),
    out: Path = typer.Option(..., "--out", help="Where to write the certificate (give it to the member)."),
    days: float = typer.Option(30.0, "--days", min=0.001, help="How long the certificate is valid."),
    identity: Path | None = CreatorKey,
) -> None:
    """Certify a member of an allowlist run (only its creator's key can)."""
    from parallax.protocol import manifest as manifests
    from parallax.protocol.errors import KeyFileError
    from parallax.protocol.identity import PUBLIC_KEY_BYTES, Identity, fingerprint

    try:
        manifest = manifests.load_manifest(manifest_file)
        try:
            key = bytes.fromhex(member)
        except ValueError:
            key = b""
        if len(key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"--member {member[:80]!r} is not a public key: give the 64 hex characters that "
                             "`parallax keys show KEYFILE` prints after 'public key:'")
        creator = Identity.load(_creator_path(identity))
        cert = manifests.admit(creator, manifest, key, valid_s=days * 86400.0)
        manifests.save(cert, out)
    except (ValueError, KeyFileError, OSError) as e:
        fail(e)
    typer.echo(f"wrote {out}: {fingerprint(key)} may join run {manifest.run_id} for {days:g} days (start it with "
               f"--manifest {manifest_file} --member-cert {out})")


@run_app.command("show")
def show(manifest_file: Path = typer.Argument(..., help="A manifest file.")) -> None:
    """Print a manifest (its signature checked) and its digest."""
    import json

    from parallax.protocol import manifest as manifests
    from parallax.protocol.identity import fingerprint

    try:
        manifest = manifests.load_manifest(manifest_file)
    except ValueError as e:
        fail(e)
    typer.echo(f"run {manifest.run_id}  digest {manifest.digest_hex}  admission {manifest.admission}  "
               f"tokenizer {manifest.tokenizer}  corpus {manifest.corpus}  creator {fingerprint(manifest.creator)}")
    typer.echo(json.dumps(manifest.settings_dict(), indent=2, sort_keys=True))


@run_app.command("fetch")
def fetch(
    run_id: str = typer.Option(..., "--run-id", help="The run."),
    initial_peers: list[str] = typer.Option(..., "--initial-peers", help="Multiaddr of a live peer (repeatable)."),
    out: Path = typer.Option(..., "--out", help="Where to write the manifest."),
    digest: RunDigest = None,
    creator: RunCreator = None,
    timeout: float = typer.Option(10.0, "--timeout", min=0.1, help="Seconds for each DHT read."),
) -> None:
    """Download the manifest a live run's working composers announce (its creator's signature checked), and say
    which it took and which it left out."""
    from parallax.dht.keys import check_run_id
    from parallax.dht.manifests import ManifestChoiceError
    from parallax.errors import DHTError
    from parallax.node.net.admission import fetch_manifest
    from parallax.protocol import manifest as manifests

    try:
        check_run_id(run_id)
    except ValueError as e:
        fail(e)
    if out.exists():
        fail(f"{out} exists: choose another --out")
    try:
        manifest, choice = fetch_manifest(run_id, initial_peers, digest=digest, creator=creator, timeout_s=timeout)
    except DHTError as e:
        fail(f"the swarm is unreachable: {e}", 1)
    except ManifestChoiceError as e:
        fail(f"run {run_id!r}: {e}", 1)
    except ValueError as e:  # a malformed --initial-peers
        fail(e)
    manifests.save(manifest, out)
    typer.echo(f"wrote {out}: run {run_id}, {choice}")
    typer.echo(f"join with: parallax node join --manifest {out} --initial-peers {' '.join(initial_peers)}")


def _creator_path(identity: Path | None) -> Path:
    return (identity or Path.home() / ".parallax" / "node.key").expanduser()


def register(app: typer.Typer) -> None:
    app.add_typer(run_app, name="run")
