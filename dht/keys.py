"""The one place that names DHT keys and expert ids (hivemind's ``moe/expert_uid.py`` habit).

Every key is namespaced by the run, so two runs can share a swarm (and a bootstrap peer) without
reading each other's records:

    {run_id}/manifest             subkey per composer: the run manifest it trains by (``protocol.manifest``)
    {run_id}/members              subkey per node: its signed Heartbeat, or its Deathrattle
    {run_id}/members/{L}/{i}      the same records split into 2**L parts by identity (``member_part``): in a
                                  large swarm each node reads the parts of one level, so each part's storers
                                  serve N readers a part of the swarm's records, not all of them
    {run_id}/claims/{layer}       subkey per claimant: its signed claims/releases for that layer
    {run_id}/surrogates/{layer}   subkey per node: the surrogate versions it announces (as owner) and
                                  the payloads it serves (``dht.surrogates.SurrogateRecord``)
    {run_id}/outer/{group}        hivemind's averager prefix of one shared group (its own keys below it)
    {run_id}/outer/{group}/rounds subkey per node: the fingerprints of its latest outer rounds of the group
                                  (a shared group, or ``replica_group``: the owners of replicated experts)

Every key above but the averager's is *protected*: each entry must be signed by the key its subkey names
(``protected_keys``), so a plain value written by a stock hivemind client is refused. Keys that change
every round could not be protected (a validator sees only a key's hash), so no key here contains a round.

Subkeys are not named here: they carry the signer's public key (``records.owner_subkey``).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence

ExpertId = tuple[int, int]
"""An expert by (layer, index within the layer): the whole model's routed-expert namespace."""

_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_EXPERT_ID_RE = re.compile(r"expert\.(\d{1,5})\.(\d{1,5})")


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a valid run name, else raise ``ValueError`` saying what is allowed."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(
            f"run id {run_id!r} is invalid: use 1-64 letters, digits, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return run_id


def manifest_key(run_id: str) -> str:
    """Where composers republish the run manifest they train by (one subkey each)."""
    return f"{check_run_id(run_id)}/manifest"


MEMBER_LEVELS = 8
"""The deepest split of the members key: 2**8 parts, about 32 heartbeats each at 8,192 members."""


def members_key(run_id: str, level: int = 0, part: int = 0) -> str:
    """The key under which every node of the run keeps its heartbeat (one subkey per node): the whole swarm's at
    ``level`` 0, else part ``part`` of the ``2**level`` parts (the nodes whose ``member_part`` at that level it is).

    Raises:
        ValueError: a level outside 0..``MEMBER_LEVELS`` or a part outside 0..2**level - 1.
    """
    if not 0 <= level <= MEMBER_LEVELS or not 0 <= part < 1 << level:
        raise ValueError(f"members part {part} of level {level}: the level must be 0..{MEMBER_LEVELS} and the part "
                         f"0..2**level - 1")
    return f"{check_run_id(run_id)}/members" if level == 0 else f"{check_run_id(run_id)}/members/{level}/{part}"


def members_keys(run_id: str, level: int) -> list[str]:
    """Every part of the members key at ``level``, in part order (one key at level 0)."""
    return [members_key(run_id, level, part) for part in range(1 << level)]


def member_part(fingerprint: str, level: int) -> int:
    """The part of the members key at ``level`` that holds the node of ``fingerprint``: the first ``level`` bits
    of the hash its fingerprint spells (``protocol.identity.fingerprint``, base32), so parts are even and a node
    cannot choose its part without choosing its key."""
    if not 0 <= level <= MEMBER_LEVELS:
        raise ValueError(f"level must be 0..{MEMBER_LEVELS}, got {level}")
    try:  # 8 base32 characters are 5 bytes; the first 2 hold MEMBER_LEVELS bits and more
        head = base64.b32decode(fingerprint[:8].upper())[:2]
    except binascii.Error:
        raise ValueError(f"{fingerprint!r} is not a fingerprint (base32)") from None
    return int.from_bytes(head, "big") >> (16 - level)


def claims_key(run_id: str, layer: int) -> str:
    """The key under which owners of ``layer``'s experts keep their leased claims (one subkey each)."""
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    return f"{check_run_id(run_id)}/claims/{layer}"


def surrogates_key(run_id: str, layer: int) -> str:
    """The key under which nodes announce surrogate versions of ``layer``'s experts (one subkey each)."""
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    return f"{check_run_id(run_id)}/surrogates/{layer}"


def outer_prefix(run_id: str, group: str) -> str:
    """The averager prefix (and P2P namespace) of one shared group: ``{run_id}/outer/{group}``.

    Raises:
        ValueError: an invalid run id or group name; hivemind refuses '.' in prefixes.
    """
    check_run_id(run_id)
    if "." in run_id or not group or "." in group or "/" in group:
        raise ValueError(f"run id {run_id!r} and group {group!r} must not contain '.' (hivemind's averager "
                         "uses it as a separator); the group must be non-empty and contain no '/'")
    return f"{run_id}/outer/{group}"


def outer_rounds_key(run_id: str, group: str) -> str:
    """The key under which each node keeps the fingerprints of its latest outer rounds of ``group``."""
    return f"{outer_prefix(run_id, group)}/rounds"


def replica_group(eid: ExpertId) -> str:
    """The outer-round group of the replicated experts one set of owners shares, named after the first of them
    ("experts-<layer>-<expert>"): a name every owner derives alike, from a set of names known in advance."""
    layer, expert = (int(x) for x in eid)
    if layer < 0 or expert < 0:
        raise ValueError(f"layer and expert must be >= 0, got ({layer}, {expert})")
    return f"experts-{layer}-{expert}"


def replica_groups(n_layers: int, n_experts: int) -> list[str]:
    """Every ``replica_group`` of a model (their round keys go in ``protected_keys``)."""
    return [replica_group((layer, expert)) for layer in range(n_layers) for expert in range(n_experts)]


def protected_keys(run_id: str, n_layers: int, groups: Sequence[str] = ()) -> list[str]:
    """Every key of a run whose entries must be signed (``records.Ed25519RecordValidator``): manifests, members
    (every part of every level), claims and surrogates of ``n_layers`` layers, and the round fingerprints of the
    shared ``groups``."""
    return ([manifest_key(run_id)] + [key for level in range(MEMBER_LEVELS + 1) for key in members_keys(run_id, level)]
            + [claims_key(run_id, layer) for layer in range(n_layers)]
            + [surrogates_key(run_id, layer) for layer in range(n_layers)]
            + [outer_rounds_key(run_id, group) for group in groups])


def expert_id(layer: int, expert: int) -> str:
    """The stable name of one expert, ``expert.{layer}.{expert}`` (logs, checkpoints, P2P namespaces)."""
    if layer < 0 or expert < 0:
        raise ValueError(f"layer and expert must be >= 0, got ({layer}, {expert})")
    return f"expert.{layer}.{expert}"


def parse_expert_id(uid: str) -> tuple[int, int]:
    """Inverse of ``expert_id``; ``ValueError`` on anything else."""
    m = _EXPERT_ID_RE.fullmatch(uid)
    if not m:
        raise ValueError(f"{uid!r} is not an expert id of the form expert.<layer>.<expert>")
    return int(m.group(1)), int(m.group(2))
