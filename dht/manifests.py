"""The run manifests composers republish under ``{run}/manifest``: read them, and say how another differs.

Each composer keeps the manifest it trains by in the DHT (``Membership`` stores it), so a peer that meets a
composer with another run digest can name the settings they disagree on, and ``parallax run fetch`` can hand
a newcomer the run's manifest. A record is believed for nothing but what its creator's signature covers.
"""

from __future__ import annotations

import json
import logging

from parallax.dht.adapter import SwarmDHT
from parallax.dht.keys import manifest_key
from parallax.dht.records import subkey_owner, unpack_message
from parallax.protocol.errors import ProtocolError
from parallax.protocol.identity import fingerprint
from parallax.protocol.manifest import RunManifest

logger = logging.getLogger(__name__)


def read_manifests(dht: SwarmDHT, run_id: str, *, timeout_s: float) -> dict[bytes, tuple[RunManifest, int]] | None:
    """The run's manifests by digest, each with how many composers publish it; ``None`` when the read failed.
    Records that do not decode, are signed by no creator or name another run are logged with their publisher
    and skipped."""
    key = manifest_key(run_id)
    read = dht.get_dicts([key], latest=True, timeout_s=timeout_s)
    if read is None:
        return None
    out: dict[bytes, tuple[RunManifest, int]] = {}
    for subkey, (value, _expiration) in read[key].items():
        publisher = subkey_owner(subkey)
        if publisher is None:
            continue
        who = fingerprint(publisher)
        try:
            manifest = unpack_message(value, (RunManifest,), peer=who)
            assert isinstance(manifest, RunManifest)
            manifest.verified(source=f"a manifest published by {who}", peer=who)
        except ProtocolError as e:
            logger.warning("skipping a run manifest record: %s", e)
            continue
        if manifest.run_id != run_id:
            logger.warning("skipping the manifest of run %r that %s published under run %r", manifest.run_id, who,
                           run_id)
            continue
        seen = out.get(manifest.digest)
        out[manifest.digest] = (seen[0] if seen else manifest, (seen[1] if seen else 0) + 1)
    return out


def settings_difference(mine: str, theirs: str, limit: int = 6) -> str:
    """The settings two manifests disagree on, for a person: ``optim.lr = 0.003 here, 0.001 there; ...``.

    Both are canonical JSON objects (``theirs`` may come from a peer: anything that does not parse is said so).
    """
    try:
        a, b = _flatten(json.loads(mine)), _flatten(json.loads(theirs))
    except (ValueError, TypeError, RecursionError):
        return "settings that do not parse"
    keys = sorted(k for k in set(a) | set(b) if a.get(k, _ABSENT) != b.get(k, _ABSENT))
    shown = [f"{k} = {a.get(k, 'absent')} here, {b.get(k, 'absent')} there" for k in keys[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return "; ".join(shown) + more if shown else "the same settings"


def manifest_difference(mine: RunManifest, theirs: RunManifest) -> str:
    """What differs between two manifests of one run, for a person."""
    parts = []
    if mine.settings != theirs.settings:
        parts.append(settings_difference(mine.settings, theirs.settings))
    if mine.tokenizer != theirs.tokenizer:
        parts.append(f"tokenizer {mine.tokenizer} here, {theirs.tokenizer} there")
    if mine.admission != theirs.admission:
        parts.append(f"admission {mine.admission} here, {theirs.admission} there")
    elif mine.admission == "allowlist" and mine.creator != theirs.creator:
        parts.append(f"allowlist of creator {fingerprint(mine.creator)} here, {fingerprint(theirs.creator)} there")
    return "; ".join(parts) or "nothing (the same terms)"


_ABSENT = object()


def _flatten(obj: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(obj, dict):
        return {prefix or "(settings)": json.dumps(obj)}
    out: dict[str, object] = {}
    for k, v in obj.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


__all__ = ["manifest_difference", "read_manifests", "settings_difference"]
