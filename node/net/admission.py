"""Which run manifest a peer trains by, and whether it is admitted to it (``protocol.manifest``).

A composer given ``--manifest`` trains by that file's manifest, and its settings must be the file's (the CLI
resolves them from it; ``Node`` checks again). Without one it signs a manifest of its own settings: an open
run, whose digest every composer with the same settings computes alike. In an ``allowlist`` run a peer needs a
certificate from the run's creator (``--member-cert``) before it starts anything: its DHT records would be
refused by every honest peer without one, so it is told what to do instead of waiting for peers that ignore it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from parallax.dht.adapter import DHTConfig, SwarmDHT, parse_initial_peers
from parallax.dht.keys import manifest_key, members_key
from parallax.dht.manifests import Published, choose_manifest, read_manifests, settings_difference
from parallax.dht.membership import read_live_view, working_by_run
from parallax.dht.records import Admission, Ed25519RecordValidator
from parallax.errors import NodeError
from parallax.node.config.peer import PeerConfig
from parallax.protocol.identity import Identity
from parallax.protocol.manifest import BYTE_TOKENIZER, RunManifest, check_member, create, load_cert, load_manifest


def peer_manifest(peer: PeerConfig, identity: Identity, settings: str | None,
                  tokenizer: str = BYTE_TOKENIZER, corpus: str | None = None) -> RunManifest | None:
    """The manifest this peer trains by.

    Args:
        settings: a composer's run settings (``run_settings``); ``None`` for a worker, which trains by the
            file's manifest if it is given one and by none otherwise.
        tokenizer: a composer's tokenizer term (``bytes``, or its BPE file's sha256).
        corpus: a composer's corpus term (``protocol.manifest.corpus_digest``); required with ``settings``.

    Raises:
        ManifestError: the file is missing, altered or unreadable.
        NodeError: the manifest is another run's, or its settings, tokenizer or corpus are not this composer's.
    """
    if settings is not None and corpus is None:
        raise ValueError("a composer's manifest names its corpus")
    if peer.manifest is None:
        return None if settings is None or corpus is None else create(identity, peer.run_id, settings,
                                                                      tokenizer=tokenizer, corpus=corpus)
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
    if corpus is not None and corpus != manifest.corpus:
        raise NodeError(f"this node's corpus ({corpus[:16]}) is not the one manifest {peer.manifest} names "
                        f"({manifest.corpus[:16]}): train on the run's corpus (the --data its composers give)")
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


def fetch_manifest(run_id: str, initial_peers: Sequence[str], *, digest: str | None = None,
                   creator: str | None = None, timeout_s: float) -> tuple[RunManifest, str]:
    """The manifest a newcomer to live run ``run_id`` takes (``manifests.choose_manifest``: the one its working
    composers announce, narrowed by ``digest`` or ``creator``), and a line naming the choice. A client-mode DHT
    node reads the run's manifests and heartbeats once (the heartbeats for up to ``timeout_s`` while none is
    alive), then stops.

    Raises:
        DHTError: the swarm is unreachable.
        ManifestChoiceError: no manifest, none read in time, or several that nothing tells apart.
    """
    config = DHTConfig(initial_peers=tuple(parse_initial_peers(initial_peers)), client_mode=True,
                       start_attempts=2)
    dht = SwarmDHT.start(config, [Ed25519RecordValidator(None, protected_keys=[manifest_key(run_id),
                                                                               members_key(run_id)])])
    try:
        found = read_manifests(dht, run_id, timeout_s=timeout_s) or {}
        view = read_live_view(dht, run_id, timeout_s=timeout_s, wait_s=timeout_s) if found else None
    finally:
        dht.shutdown()
    working = working_by_run(view, view.judged_at) if view is not None else {}
    published = {d: Published(m, n, working.get(d, 0)) for d, (m, n) in found.items()}
    return choose_manifest(published, digest=digest, creator=creator)


__all__ = ["fetch_manifest", "peer_admission", "peer_manifest"]
