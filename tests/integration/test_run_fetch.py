"""``parallax run fetch`` against real DHT peers: a run's two working composers and five fresh keys that publish a
forged manifest under the same run id. The newcomer gets the run's manifest, and is told which it left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from parallax.dht.manifests import read_manifests
from parallax.dht.testing import LocalSwarm, fixed_identity, wait_until
from parallax.node.config.train import TrainConfig, run_settings
from parallax.node.net.admission import fetch_manifest
from parallax.protocol import manifest as manifests

CORPUS = manifests.corpus_digest(b"a corpus")  # the manifests' corpus term


def test_run_fetch_takes_the_manifest_the_working_composers_announce_beside_forgeries(swarm: LocalSwarm,
                                                                                      tmp_path: Path) -> None:
    settings = run_settings(TrainConfig())
    run = manifests.create(fixed_identity(100), swarm.run_id, settings, admission="allowlist", corpus=CORPUS)
    forged = manifests.create(fixed_identity(101), swarm.run_id, settings, admission="allowlist", corpus=CORPUS)
    composers = [swarm.add(i, manifest=run) for i in range(2)]
    for c in composers:
        assert c.membership is not None
        c.membership.update(step=12)
    for i in range(5):  # heartbeats and manifests, never a step
        swarm.add(10 + i, manifest=forged)
    reader = composers[0].dht

    def published() -> bool:
        found = read_manifests(reader, swarm.run_id, timeout_s=5) or {}
        return found.get(run.digest, (None, 0))[1] == 2 and found.get(forged.digest, (None, 0))[1] == 5

    wait_until(published, timeout=60)
    address = composers[1].dht.visible_maddrs()[0]
    out = tmp_path / "run.manifest"
    done = subprocess.run([sys.executable, "-m", "parallax.cli", "run", "fetch", "--run-id", swarm.run_id,
                           "--initial-peers", str(address), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert manifests.load_manifest(out).digest == run.digest
    assert f"took {run.digest_hex}" in done.stdout and "announced by 2 working composer(s)" in done.stdout
    assert f"left out: {forged.digest_hex}" in done.stdout and "published by 5 key(s)" in done.stdout
    # A newcomer who has the creator's fingerprint from the run's host names it: the forgery then never counts.
    took, _ = fetch_manifest(swarm.run_id, [str(address)], creator=fixed_identity(100).fingerprint, timeout_s=5)
    assert took.digest == run.digest
