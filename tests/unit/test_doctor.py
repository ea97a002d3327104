"""``parallax doctor``'s verdicts that need no network: reachability from addresses, disk, memory estimates."""

from __future__ import annotations

import pytest
import torch

from parallax.node.config.train import train_config
from parallax.node.peer.doctor import Check, check_device, check_disk, check_reachable, composer_bytes

P2P = "/p2p/12D3KooWQMeeqkDeMWWHRcouSnN8REbEvXLVTux8BdjBfgdf7NX9"


def test_reachability_is_judged_from_the_addresses_p2pd_reports():
    public = check_reachable([f"/ip4/127.0.0.1/tcp/1{P2P}", f"/ip4/8.8.4.4/tcp/1{P2P}"], [])
    assert public.verdict == "ok" and "8.8.4.4" in public.detail
    private = check_reachable([f"/ip4/192.168.1.5/tcp/1{P2P}", f"/ip4/127.0.0.1/tcp/1{P2P}"], [])
    assert private.verdict == "warn" and "--announce" in private.fix and P2P not in private.detail
    alone = check_reachable([f"/ip4/127.0.0.1/tcp/1{P2P}"], [])
    assert alone.verdict == "fail" and "--host" in alone.fix
    assert check_reachable([f"/ip4/127.0.0.1/tcp/1{P2P}"], [], local=True).verdict == "ok"
    assert check_reachable([f"/ip4/10.0.0.2/tcp/1{P2P}"], ["/ip4/203.0.113.9/tcp/31337"]).verdict == "ok"


def test_each_line_has_a_verdict_and_the_fix():
    assert Check("disk", "fail", "1 MiB free", "free space").line() == "FAIL  disk: 1 MiB free -> free space"
    assert Check("p2pd", "ok", "started").line() == "OK    p2pd: started"
    with pytest.raises(ValueError):
        Check("x", "maybe", "?")


def test_disk_is_checked_where_checkpoints_would_go(tmp_path):
    assert check_disk(None, 10).verdict == "ok"
    fits = check_disk(tmp_path / "not" / "yet", 10)  # a folder not made yet: its nearest existing parent
    assert fits.verdict == "ok" and str(tmp_path) in fits.detail
    assert check_disk(tmp_path, 10**15).verdict == "fail"


def test_a_larger_preset_needs_more_and_an_absent_device_fails_with_what_to_do():
    tiny, small = composer_bytes(train_config("tiny")), composer_bytes(train_config("small"))
    assert 0 < tiny[0] < small[0] and tiny[1] < small[1]
    assert small[0] > 1_000_000  # every expert of every layer counted, not only the backbone
    assert check_device("cpu", 1).verdict == "ok"
    if torch.cuda.device_count() <= 7:
        missing = check_device("cuda:7", 1)
        assert missing.verdict == "fail" and "--cpu" in missing.fix
