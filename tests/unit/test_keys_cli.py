"""``parallax keys new`` / ``show`` through Typer's CliRunner."""

from __future__ import annotations

import os
import stat

from typer.testing import CliRunner

from parallax.cli.main import app
from parallax.protocol.identity import Identity

runner = CliRunner()


def test_new_then_show(tmp_path):
    path = tmp_path / "node.key"
    created = runner.invoke(app, ["keys", "new", str(path)])
    assert created.exit_code == 0, created.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    identity = Identity.load(path)
    assert identity.fingerprint in created.output
    shown = runner.invoke(app, ["keys", "show", str(path)])
    assert shown.exit_code == 0, shown.output
    assert f"fingerprint: {identity.fingerprint}" in shown.output
    assert identity.public_key.hex() in shown.output


def test_new_refuses_to_overwrite(tmp_path):
    path = tmp_path / "node.key"
    assert runner.invoke(app, ["keys", "new", str(path)]).exit_code == 0
    before = path.read_bytes()
    again = runner.invoke(app, ["keys", "new", str(path)])
    assert again.exit_code == 1
    assert "already exists" in again.output
    assert path.read_bytes() == before


def test_show_refuses_a_key_readable_by_others(tmp_path):
    path = tmp_path / "node.key"
    Identity.generate().save(path)
    os.chmod(path, 0o644)
    shown = runner.invoke(app, ["keys", "show", str(path)])
    assert shown.exit_code == 1
    assert "accessible by other users" in shown.output and "chmod 600" in shown.output


def test_show_explains_a_missing_or_broken_key(tmp_path):
    missing = runner.invoke(app, ["keys", "show", str(tmp_path / "nope.key")])
    assert missing.exit_code == 1 and "parallax keys new" in missing.output
    junk = tmp_path / "junk.key"
    junk.write_text("not a key")
    os.chmod(junk, 0o600)
    broken = runner.invoke(app, ["keys", "show", str(junk)])
    assert broken.exit_code == 1 and "not a readable" in broken.output
