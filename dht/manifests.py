"""The run manifests composers republish under ``{run}/manifest``: read them, and say how another differs.

Each composer keeps the manifest it trains by in the DHT (``Membership`` stores it), so a peer that meets a
composer with another run digest can name the settings they disagree on, and ``parallax run fetch`` can hand
a newcomer the run's manifest. A record is believed for nothing but what its creator's signature covers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

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


class ManifestChoiceError(ValueError):
    """No manifest of the run, or several that nothing tells apart (the message lists them)."""


@dataclass(frozen=True)
class Published:
    """One manifest of a run as a newcomer sees it."""

    manifest: RunManifest
    publishers: int
    """Keys that publish it under the run's manifest key (any key can: it counts for nothing)."""
    working: int
    """Live composers whose signed heartbeat announces it and that have trained (step > 0)."""

    @property
    def creator(self) -> str | None:
        """An allowlist run's creator (part of its digest); None for an open run, whose digest any key signs."""
        return fingerprint(self.manifest.creator) if self.manifest.admission == "allowlist" else None

    def describe(self) -> str:
        terms = f"allowlist of creator {self.creator}" if self.creator else "open"
        return (f"{self.manifest.digest_hex} ({terms}; announced by {self.working} working composer(s), published "
                f"by {self.publishers} key(s))")


def choose_manifest(published: Mapping[bytes, Published], *, digest: str | None = None,
                    creator: str | None = None) -> tuple[RunManifest, str]:
    """The manifest a newcomer to a live run takes, and a line that names the choice.

    Any key can publish a manifest under a run's id, so how many publish one says nothing; what counts is how many
    of the run's live composers train by it (``working``). ``digest`` or ``creator`` (an allowlist run's creator's
    fingerprint) narrow the choice first: a newcomer who got either from the run's host cannot be misled by
    manifests that others publish under the run's id.
    One manifest is taken when it is the only one left, or when more working composers announce it than any
    other; otherwise the choice is refused.

    Raises:
        ManifestChoiceError: none left, or several with as many working composers (the message lists them and
            says how to choose).
    """
    if not published:
        raise ManifestChoiceError("no composer of the run publishes a manifest, or none answered in time: check "
                                  "--run-id and --initial-peers, or raise --timeout")
    left = dict(published)
    if digest is not None:
        left = {d: p for d, p in left.items() if d.hex() == digest.lower()}
    if creator is not None:
        left = {d: p for d, p in left.items() if p.creator == creator}
    narrowed = " of that digest" * (digest is not None) + " of that creator" * (creator is not None)
    if not left:
        raise ManifestChoiceError(f"no manifest{narrowed} is published in the run")
    ranked = sorted(left.values(), key=lambda p: (-p.working, p.manifest.digest_hex))
    best, others = ranked[0], ranked[1:]
    if others and best.working <= others[0].working:
        tied = [p for p in ranked if p.working == best.working]
        raise ManifestChoiceError(
            f"{len(tied)} manifests{narrowed} are announced by as many working composers: "
            + "; ".join(p.describe() for p in tied)
            + ". Ask the run's host for its digest or creator and pass --digest or --creator")
    line = f"took {best.describe()}"
    if not best.working:
        line += "; no live composer announces it yet"
    if others:
        line += "; left out: " + "; ".join(p.describe() for p in others)
    return best.manifest, line


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
    if mine.corpus != theirs.corpus:
        parts.append(f"corpus {mine.corpus[:16]} here, {theirs.corpus[:16]} there (--data)")
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


__all__ = ["ManifestChoiceError", "Published", "choose_manifest", "manifest_difference", "read_manifests",
           "settings_difference"]
