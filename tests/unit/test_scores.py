"""Peer scores: evidence adds up, fades by half-life, bans past the threshold for a while, memory stays bounded."""

from __future__ import annotations

import pytest

from parallax.node.net.scores import Evidence, PeerScores


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_evidence_bans_past_the_threshold_for_a_while_and_fades() -> None:
    clock, bans = Clock(), []
    scores = PeerScores(threshold=3.0, ban_s=100.0, half_life_s=50.0, clock=clock,
                        on_ban=lambda peer, reasons: bans.append((peer, reasons)))
    assert not scores.record("liar", Evidence.OUTLIER)
    assert not scores.record("liar", Evidence.OUTLIER)
    assert scores.record("liar", Evidence.FORGED)
    assert scores.banned("liar") and not scores.banned("honest")
    assert bans == [("liar", {"outlier outer contribution": 2, "forged or malformed outer contribution": 1})]
    clock.now = 101.0
    assert not scores.banned("liar")  # the ban ran out
    assert scores.snapshot()["liar"]["score"] < 1.0  # 4 points, two half-lives later
    # Evidence spread thinly over time never adds up to a ban.
    for _ in range(10):
        clock.now += 60.0
        assert not scores.record("unlucky", Evidence.OUTLIER)
    assert len(bans) == 1


def test_held_fetches_count_for_nothing_while_this_node_s_own_link_is_in_doubt() -> None:
    """Cut off, every fetch this node had begun is held: those are not counted (each peer behind the cut would be
    banned, and ignored once the link heals); what no broken link gives still is, and held fetches count again once
    the node's side holds a majority."""
    doubtful = [True]
    scores = PeerScores(threshold=2.5, ban_s=100.0, half_life_s=1e9, clock=Clock(),
                        own_link_doubtful=lambda: doubtful[0])
    for _ in range(10):
        assert not scores.record("behind the cut", Evidence.STALLED)
    assert "behind the cut" not in scores.snapshot()
    assert not scores.record("liar", Evidence.FORGED) and scores.record("liar", Evidence.FORGED)
    doubtful[0] = False
    assert not any(scores.record("holder", Evidence.STALLED) for _ in range(4))
    assert scores.record("holder", Evidence.STALLED)


def test_settings_must_be_positive() -> None:
    for bad in (dict(threshold=0), dict(ban_s=0), dict(half_life_s=-1)):
        with pytest.raises(ValueError):
            PeerScores(**bad)


def test_suspects_are_the_highest_scores_and_the_bans_a_heartbeat_carries() -> None:
    clock = Clock()
    scores = PeerScores(threshold=2.5, ban_s=100.0, half_life_s=1e9, clock=clock)
    for i in range(5):
        for _ in range(i):
            scores.record(f"p{i:02d}", Evidence.OUTLIER)  # p0i: i points
    for _ in range(5):
        scores.record("liar", Evidence.FORGED)
    suspects, banned = scores.suspects(4)
    assert list(suspects) == ["liar", "p04", "p03", "p02"] and suspects["liar"] == 10.0
    assert banned == ("liar", "p04", "p03")  # 4 and 3 are past the threshold too, 2 is not
    suspects, banned = scores.suspects(8, floor=3.1)
    assert list(suspects) == ["liar", "p04"] and banned[:2] == ("liar", "p04")
