"""Per-peer request rates: a burst, then the average rate; each peer and each handler has its own bucket."""

from __future__ import annotations

import pytest

from parallax.node.net.network import RateLimiter


def test_a_peer_gets_its_burst_then_its_rate_and_others_are_unaffected() -> None:
    now = [0.0]
    limiter = RateLimiter(per_s=2.0, burst=5.0, clock=lambda: now[0])
    assert [limiter.allow("flooder", "rpc_fetch") for _ in range(7)] == [True] * 5 + [False] * 2
    assert limiter.allow("honest", "rpc_fetch") and limiter.allow("flooder", "rpc_other")
    now[0] = 1.0  # two more tokens a second
    assert [limiter.allow("flooder", "rpc_fetch") for _ in range(3)] == [True, True, False]
    assert limiter.refused == 3


def test_memory_is_bounded_and_settings_are_checked() -> None:
    limiter = RateLimiter(per_s=1.0, burst=1.0, max_peers=10)
    for i in range(100):
        limiter.allow(f"peer{i}", "rpc_fetch")
    assert len(limiter._buckets) == 10
    for bad in (dict(per_s=0, burst=1), dict(per_s=1, burst=0.5)):
        with pytest.raises(ValueError):
            RateLimiter(**bad)
