"""Which run manifest a peer trains by, and whether it is admitted to it (``protocol.manifest``).

A composer given ``--manifest`` trains by that file's manifest, and its settings must be the file's (the CLI
resolves them from it; ``Node`` checks again). Without one it signs a manifest of its own settings: an open
run, whose digest every composer with the same settings computes alike. In an ``allowlist`` run a peer needs a
certificate from the run's creator (``--member-cert``) before it starts anything: its DHT records would be
refused by every honest peer without one, so it is told what to do instead of waiting for peers that ignore it.
"""

from __future__ import annotations

import time

from parallax.dht.manifests import settings_difference
from parallax.dht.records import Admission
from parallax.errors import NodeError
from parallax.node.config.peer import PeerConfig
from parallax.protocol.identity import Identity
from parallax.protocol.manifest import BYTE_TOKENIZER, RunManifest, check_member, create, load_cert, load_manifest


def peer_manifest(peer: PeerConfig, identity: Identity, settings: str | None,
                  tokenizer: str = BYTE_TOKENIZER) -> RunManifest | None:
    """The manifest this peer trains by.

    Args:
        settings: a composer's run settings (``run_settings``); ``None`` for a worker, which trains by the
            file's manifest if it is given one and by none otherwise.
        tokenizer: a composer's tokenizer term (``bytes``, or its BPE file's sha256).

    Raises:
        ManifestError: the file is missing, altered or unreadable.
        NodeError: the manifest is another run's, or its settings or tokenizer are not this composer's.
    """
    if peer.manifest is None:
        return None if settings is None else create(identity, peer.run_id, settings, tokenizer=tokenizer)
    manifest = load_manifest(peer.manifest)
    if manifest.run_id != peer.run_id:
        raise NodeError(f"manifest {peer.manifest} is run {manifest.run_id!r}'s, not {peer.run_id!r}'s: leave out "
                        "--run-id (the manifest names the run) or give the run's manifest")
    if settings is not None and settings != manifest.settings:
        raise NodeError(f"this node's settings differ from manifest {peer.manifest}: "
                        f"{settings_difference(settings, manifest.settings)}. Leave those settings out: the "
                        "manifest sets them")
    if settings is not None and tokenizer != manifest.tokenizer:
        raise NodeError(f"this node's tokenizer ({tokenizer[:16]}) is not the one manifest {peer.manifest} names "
                        f"({manifest.tokenizer[:16]}): use the run's tokenizer file, beside its manifest")
    return manifest


def peer_admission(peer: PeerConfig, identity: Identity, manifest: RunManifest | None) -> Admission | None:
    """The record validator's rule for an ``allowlist`` run (``None`` for an open one).

    Raises:
        ManifestError: the certificate file is missing or unreadable.
        NodeError: this peer holds no valid certificate for the run: what to ask the creator for.
    """
    if manifest is None or manifest.admission != "allowlist":
        return None
    if identity.public_key == manifest.creator:
        return Admission(manifest.creator, manifest.digest)
    ask = (f"ask the run's creator for one: parallax run admit --manifest MANIFEST --member "
           f"{identity.public_key.hex()} --out member.cert (with the creator's --identity), then start with "
           "--member-cert member.cert")
    if peer.member_cert is None:
        raise NodeError(f"run {manifest.run_id!r} admits only members certified by its creator, and this peer "
                        f"({identity.fingerprint}) has no certificate: {ask}")
    cert = load_cert(peer.member_cert)
    if cert.member != identity.public_key:
        why: str | None = f"it certifies another key than this peer's ({identity.fingerprint})"
    elif cert.run != manifest.digest:
        why = "it is for another run or manifest"
    else:
        why = check_member(manifest.creator, manifest.digest, identity.public_key, cert.wire_form(), time.time())
    if why is not None:
        raise NodeError(f"member certificate {peer.member_cert} cannot be used: {why}; {ask}")
    return Admission(manifest.creator, manifest.digest, cert.wire_form())


__all__ = ["peer_admission", "peer_manifest"]
