"""Run manifests and member certificates: signatures, digests, files, the allowlist validator, config resolution."""

from __future__ import annotations

import dataclasses
import json
import time

import msgpack
import pytest

from parallax.dht.adapter import DHTRecord, dht_key_id
from parallax.dht.keys import members_key
from parallax.dht.records import Admission, Ed25519RecordValidator, owner_subkey
from parallax.errors import NodeError
from parallax.node.config.peer import NodeConfig, PeerConfig
from parallax.node.config.resolve import node_defaults, resolve
from parallax.node.config.train import TrainConfig, run_settings, train_config
from parallax.node.config.typed import ConfigError
from parallax.node.net.admission import peer_admission, peer_manifest
from parallax.protocol import manifest as manifests
from parallax.protocol.errors import LocalProtocolError, RemoteProtocolError
from parallax.protocol.identity import Identity

CORPUS = manifests.corpus_digest(b"a corpus")  # the manifests' corpus term

NOW = 1_800_000_000.0
CREATOR = Identity.from_seed(b"c" * 32)
MEMBER = Identity.from_seed(b"m" * 32)
STRANGER = Identity.from_seed(b"s" * 32)
TINY = run_settings(train_config("tiny"))


def test_a_manifest_is_signed_by_its_creator_and_its_digest_covers_the_terms():
    m = manifests.create(CREATOR, "r", TINY, corpus=CORPUS)
    assert m.verified() is m and len(m.digest) == 16
    forged = dataclasses.replace(m, settings=TINY.replace('"seed":0', '"seed":1'))
    with pytest.raises(RemoteProtocolError, match="not signed by its creator"):
        forged.verified()
    assert forged.digest != m.digest
    # Open: the same terms signed by anyone at any time are the same run; allowlist: the creator is part of it.
    assert manifests.create(STRANGER, "r", TINY, created=1.0, corpus=CORPUS).digest == m.digest
    assert manifests.create(CREATOR, "r2", TINY, corpus=CORPUS).digest != m.digest
    private = manifests.create(CREATOR, "r", TINY, admission="allowlist", corpus=CORPUS)
    assert private.digest != m.digest
    assert manifests.create(STRANGER, "r", TINY, admission="allowlist", corpus=CORPUS).digest != private.digest
    with pytest.raises(ValueError, match="admission"):
        manifests.create(CREATOR, "r", TINY, admission="everyone", corpus=CORPUS)
    # Composers of one run train on one corpus (each draws its own batches of it: ``node.train.own_data``).
    other_corpus = manifests.create(CREATOR, "r", TINY, corpus=manifests.corpus_digest(b"another corpus"))
    assert other_corpus.verified() and other_corpus.digest != m.digest
    with pytest.raises(LocalProtocolError, match="corpus"):
        manifests.create(CREATOR, "r", TINY, corpus="not a digest")


def test_manifest_files_round_trip_and_an_altered_file_is_refused(tmp_path):
    m = manifests.create(CREATOR, "r", TINY, admission="allowlist", corpus=CORPUS)
    path = tmp_path / "run.json"
    manifests.save(m, path)
    assert manifests.load_manifest(path) == m
    doc = json.loads(path.read_text())
    assert doc["digest"] == m.digest_hex and doc["settings"]["model"]["d_model"] == 32
    doc["settings"]["optim"]["lr"] = 1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(manifests.ManifestError, match="altered"):
        manifests.load_manifest(path)
    with pytest.raises(manifests.ManifestError, match="no such file"):
        manifests.load_manifest(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(manifests.ManifestError, match="not valid"):
        manifests.load_manifest(tmp_path / "junk.json")
    del doc["corpus"]  # a manifest of a release before the corpus was a term
    path.write_text(json.dumps(doc))
    with pytest.raises(manifests.ManifestError, match="has no corpus .* `parallax run create`"):
        manifests.load_manifest(path)
    cert = manifests.admit(CREATOR, m, MEMBER.public_key, valid_s=60)
    manifests.save(cert, tmp_path / "m.cert")
    assert manifests.load_cert(tmp_path / "m.cert") == cert
    with pytest.raises(manifests.ManifestError, match="not a manifest"):
        manifests.load_manifest(tmp_path / "m.cert")


def test_only_the_creator_admits_members_and_certificates_are_checked():
    private = manifests.create(CREATOR, "r", TINY, admission="allowlist", corpus=CORPUS)
    with pytest.raises(manifests.ManifestError, match="only the run's creator"):
        manifests.admit(STRANGER, private, MEMBER.public_key, valid_s=60)
    with pytest.raises(manifests.ManifestError, match="open to anyone"):
        manifests.admit(CREATOR, manifests.create(CREATOR, "r", TINY, corpus=CORPUS), MEMBER.public_key, valid_s=60)
    cert = manifests.admit(CREATOR, private, MEMBER.public_key, valid_s=60)
    now = time.time()

    def check(member: bytes, carried: bytes | None, at: float = now) -> str | None:
        return manifests.check_member(CREATOR.public_key, private.digest, member, carried, at)

    assert check(MEMBER.public_key, cert.wire_form()) is None
    assert check(CREATOR.public_key, None) is None  # the creator needs none
    assert check(STRANGER.public_key, None) == "no member certificate"
    assert check(STRANGER.public_key, cert.wire_form()) == "a member certificate not signed by the run's creator"
    assert check(MEMBER.public_key, cert.wire_form(), now + 120) == "an expired member certificate"
    assert check(MEMBER.public_key, b"\x00garbage") == "a malformed member certificate"
    for junk in (b"", b"\x92", b"\x92\xcb" + b"\x00" * 8 + b"\xc4\x40" + b"\x01" * 64 + b"x", b"\xc1" * 40,
                 bytes(range(256))):
        assert check(MEMBER.public_key, junk) == "a malformed member certificate"
    self_made = manifests.admit(STRANGER, manifests.create(STRANGER, "r", TINY, admission="allowlist", corpus=CORPUS),
                                STRANGER.public_key, valid_s=60)
    assert check(STRANGER.public_key, self_made.wire_form()) is not None


def _record(identity: Identity, validator: Ed25519RecordValidator, key: str = members_key("r")) -> DHTRecord:
    unsigned = DHTRecord(dht_key_id(key), msgpack.packb(owner_subkey(identity.public_key)), b"\xc4\x01x", NOW + 6)
    return dataclasses.replace(unsigned, value=validator.sign_value(unsigned))


def test_an_allowlist_validator_accepts_only_certified_signers_on_run_keys():
    private = manifests.create(CREATOR, "r", TINY, admission="allowlist", corpus=CORPUS)
    cert = manifests.admit(CREATOR, private, MEMBER.public_key, valid_s=1e9)
    keys = [members_key("r")]

    def node(identity: Identity, carried: bytes | None) -> Ed25519RecordValidator:
        return Ed25519RecordValidator(identity, protected_keys=keys, clock=lambda: NOW,
                                      admission=Admission(CREATOR.public_key, private.digest, carried))

    judge = Ed25519RecordValidator(None, protected_keys=keys, clock=lambda: NOW,
                                   admission=Admission(CREATOR.public_key, private.digest))
    member = _record(MEMBER, node(MEMBER, cert.wire_form()))
    assert judge.validate(member) and judge.strip_value(member) == b"\xc4\x01x"
    assert judge.validate(_record(CREATOR, node(CREATOR, None)))
    assert not judge.validate(_record(STRANGER, node(STRANGER, None)))
    assert not judge.validate(_record(STRANGER, node(STRANGER, cert.wire_form())))  # another member's certificate
    # A certificate cut off a member's record and pasted onto a stranger's breaks the stranger's signature too.
    stolen = dataclasses.replace(_record(STRANGER, node(STRANGER, None)), value=member.value)
    assert not judge.validate(stolen)
    # An open run's validator does not ask for certificates; keys outside the run are not the allowlist's.
    assert Ed25519RecordValidator(None, protected_keys=keys, clock=lambda: NOW).validate(member)
    assert judge.validate(_record(STRANGER, node(STRANGER, None), key="hivemind/other"))


def test_a_manifest_sets_the_settings_and_a_flag_that_disagrees_is_named():
    m = manifests.create(CREATOR, "r", run_settings(dataclasses.replace(train_config("tiny"), seed=3)), corpus=CORPUS)
    cfg = resolve(NodeConfig, node_defaults, flags={"peer.run_id": "r"}, manifest=m, default_preset="small",
                  sets=["eval_every=7"])
    assert cfg.train.seed == 3 and cfg.train.model.d_model == 32 and cfg.train.eval_every == 7  # local: allowed
    with pytest.raises(ConfigError, match="seed = 4 here, 3 there"):
        resolve(NodeConfig, node_defaults, flags={"peer.run_id": "r"}, manifest=m, sets=["seed=4"])
    with pytest.raises(ConfigError, match="preset small is not the model"):
        resolve(NodeConfig, node_defaults, flags={"peer.run_id": "r", "preset": "small"}, manifest=m)
    assert resolve(NodeConfig, node_defaults, flags={"peer.run_id": "r", "preset": "tiny"}, manifest=m).train.seed == 3


def test_a_peer_is_told_what_it_lacks_before_it_starts(tmp_path):
    settings = run_settings(TrainConfig())
    private = manifests.create(CREATOR, "r", settings, admission="allowlist", corpus=CORPUS)
    manifests.save(private, tmp_path / "run.json")
    peer = PeerConfig(run_id="r", manifest=tmp_path / "run.json")
    assert peer_manifest(peer, MEMBER, settings, corpus=CORPUS) == private
    with pytest.raises(NodeError, match="differ from manifest"):
        peer_manifest(peer, MEMBER, run_settings(TrainConfig(seed=9)), corpus=CORPUS)
    with pytest.raises(NodeError, match="not 'other'"):
        peer_manifest(PeerConfig(run_id="other", manifest=tmp_path / "run.json"), MEMBER, settings, corpus=CORPUS)
    with pytest.raises(NodeError, match="train on the run's corpus"):
        peer_manifest(peer, MEMBER, settings, corpus=manifests.corpus_digest(b"another corpus"))
    with pytest.raises(ValueError, match="names its corpus"):
        peer_manifest(peer, MEMBER, settings)
    assert peer_manifest(peer, MEMBER, None) == private  # a worker trains by the file's, whatever it reads
    own = peer_manifest(PeerConfig(run_id="r"), MEMBER, settings, corpus=CORPUS)
    assert own is not None and own.creator == MEMBER.public_key and own.admission == "open" and own.corpus == CORPUS
    assert peer_admission(PeerConfig(run_id="r"), MEMBER, own) is None
    with pytest.raises(NodeError, match=f"parallax run admit .* --member {MEMBER.public_key.hex()}"):
        peer_admission(peer, MEMBER, private)
    assert peer_admission(peer, CREATOR, private) == Admission(CREATOR.public_key, private.digest)
    manifests.save(manifests.admit(CREATOR, private, STRANGER.public_key, valid_s=60), tmp_path / "s.cert")
    with pytest.raises(NodeError, match="certifies another key"):
        peer_admission(dataclasses.replace(peer, member_cert=tmp_path / "s.cert"), MEMBER, private)
    manifests.save(manifests.admit(CREATOR, private, MEMBER.public_key, valid_s=60), tmp_path / "m.cert")
    admission = peer_admission(dataclasses.replace(peer, member_cert=tmp_path / "m.cert"), MEMBER, private)
    assert admission is not None and admission.carried is not None
