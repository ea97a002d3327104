"""``parallax dht ...``: DHT-only commands. ``bootstrap`` runs a stable entry point with no training."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import typer

from parallax.cli.options import ManifestFile, MemberCertFile, run_manifest

dht_app = typer.Typer(help="DHT-only peers and tools (no training).", no_args_is_help=True, rich_markup_mode=None)
logger = logging.getLogger(__name__)


@dht_app.command("bootstrap")
def bootstrap(
    host: list[str] = typer.Option(
        ["/ip4/0.0.0.0/tcp/31337"], "--host", help="Multiaddr to listen on (repeatable); tcp/0 picks a free port."
    ),
    announce: list[str] = typer.Option(
        [], "--announce", help="Public multiaddr others should dial, e.g. /ip4/203.0.113.7/tcp/31337 (repeatable)."
    ),
    initial_peers: list[str] = typer.Option(
        [], "--initial-peers", help="Other bootstrap peers to link with: multiaddrs ending in /p2p/<peer id>."
    ),
    identity: Path | None = typer.Option(
        None, "--identity", help="Ed25519 key file (created if missing); the libp2p key is kept beside it "
        "(<file>.p2p) so the join address stays the same across restarts."
    ),
    run_id: str | None = typer.Option(
        None, "--run", help="Also announce this node in run RUN (role bootstrap) and enforce signed records there."
    ),
    layers: int = typer.Option(64, "--layers", min=0, help="Claim keys protected for --run: layers 0..N-1."),
    manifest_file: ManifestFile = None,
    member_cert: MemberCertFile = None,
    startup_timeout: float = typer.Option(60.0, "--startup-timeout", min=1, help="Seconds to wait for p2pd/DHT."),
    duration: float | None = typer.Option(
        None, "--for", min=0, help="Exit after this many seconds (default: until Ctrl+C or SIGTERM)."
    ),
) -> None:
    """Run a standalone DHT peer that others join through; prints the --initial-peers line to share."""
    from parallax.dht.adapter import DHTConfig, SwarmDHT, p2p_identity_path
    from parallax.dht.keys import protected_keys
    from parallax.dht.membership import Membership, Presence
    from parallax.dht.records import Admission, Ed25519RecordValidator
    from parallax.errors import DHTError, NodeError
    from parallax.node.config.peer import PeerConfig
    from parallax.node.config.train import SHARED_GROUPS
    from parallax.node.net.admission import peer_admission
    from parallax.node.peer.processes import ForcedStop, install_signal_handlers
    from parallax.protocol.identity import Identity

    try:
        key = Identity.load_or_create(identity) if identity is not None else Identity.generate()
        config = DHTConfig(
            initial_peers=tuple(initial_peers),
            host_maddrs=tuple(host),
            announce_maddrs=tuple(announce),
            identity_path=p2p_identity_path(identity) if identity is not None else None,
            startup_timeout_s=startup_timeout,
        )
        manifest, run_id = run_manifest(manifest_file, run_id)
        admission, announce_in_run = None, run_id is not None
        if manifest is not None and manifest.admission == "allowlist":
            if member_cert is None and key.public_key != manifest.creator:
                # It enforces the allowlist, but without a certificate its own heartbeat would be refused.
                admission, announce_in_run = Admission(manifest.creator, manifest.digest), False
                typer.echo(f"not announcing in run {run_id}: no --member-cert", err=True)
            else:
                peer_config = PeerConfig(run_id=manifest.run_id, manifest=manifest_file, member_cert=member_cert)
                try:
                    admission = peer_admission(peer_config, key, manifest)
                except NodeError as e:
                    raise ValueError(str(e)) from None
        presence = Presence(run_id=run_id, role="bootstrap") if announce_in_run and run_id else None
        protected = protected_keys(run_id, layers, SHARED_GROUPS) if run_id else []
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e

    peer = _Bootstrap()
    previous = install_signal_handlers(peer)
    dht = membership = None
    try:
        dht = SwarmDHT.start(config, [Ed25519RecordValidator(key, protected_keys=protected, admission=admission)])
        typer.echo(f"bootstrap peer {dht.peer_id} is up (identity {key.fingerprint}). Others join with:\n")
        typer.echo(f"  {dht.join_command()}\n")
        if presence is not None:
            membership = Membership(dht, key, presence)
            membership.start()
            typer.echo(f"announcing in run {run_id} as bootstrap")
        peer.up = True
        peer.stopped.wait(duration)
    except DHTError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e
    except ForcedStop as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(130) from e
    finally:
        if membership is not None:
            membership.leave("bootstrap shutting down")
        if dht is not None:
            dht.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
        typer.echo("bootstrap peer stopped")


class _Bootstrap:
    """The bootstrap peer as ``install_signal_handlers`` sees it: a signal stops start-up at once, and once up
    asks it to leave."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.up = False

    @property
    def starting(self) -> bool:
        return not self.up

    def stop(self) -> None:
        self.stopped.set()


def register(app: typer.Typer) -> None:
    app.add_typer(dht_app, name="dht")
