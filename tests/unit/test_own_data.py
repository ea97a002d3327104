"""``train.own_data``: an audit's arithmetic, its judgement, the peers' margins kept, and gains on a real composer."""

from __future__ import annotations

import torch

from parallax.node.config import train as config
from parallax.node.sim.simulator import RunSpec, run
from parallax.node.train import own_data
from parallax.node.train.data import load_corpus, split_corpus


def test_a_window_judges_a_peer_idle_when_fewer_than_half_its_latest_margins_are_positive() -> None:
    assert not own_data.judged_idle([-1.0] * 7)  # fewer audits than a window
    assert own_data.judged_idle([-1.0] * 5 + [1.0] * 3)
    assert not own_data.judged_idle([-1.0] * 4 + [1.0] * 4)  # half positive is not fewer than half
    assert not own_data.judged_idle([-1.0] * 9 + [1.0] * 4 + [-1.0] * 4)  # only the latest window counts
    assert own_data.idle_share([1.0] * 7) is None
    assert own_data.idle_share([1.0] * 8) == 0.0
    assert own_data.idle_share([-1.0] * 5 + [1.0] * 4) == 0.5  # the first window of two judges it idle
    assert own_data.margin(3.0, 1.0) == 2.0 and own_data.margin(-1.0, -2.0) == 0.5
    assert own_data.margin(1.0, 0.0) > 0 > own_data.margin(-1.0, 0.0)


def test_audits_keep_a_window_per_peer_and_name_the_peer_audited_least_lately() -> None:
    audits = own_data.OwnDataAudits(window=4, peers_kept=2)
    assert audits.least_lately(["a", "b"]) == "a" and audits.least_lately([]) is None
    assert not audits.add("a", -1.0)
    assert audits.least_lately(["a", "b"]) == "b"  # never audited first
    for _ in range(3):
        judged = audits.add("a", -1.0)
    assert judged and audits.judged("a") and audits.audited("a") == 4
    for _ in range(3):
        audits.add("a", 1.0)
    assert not audits.judged("a") and audits.audited("a") == 4  # a window, no more
    audits.add("b", 1.0)
    assert audits.least_lately(["a", "b"]) == "a"
    audits.add("c", 1.0)  # two peers kept: the one audited least lately goes
    assert audits.audited("a") == 0 and audits.audited("b") == 1 and not audits.judged("a")


def test_the_gains_of_pseudo_gradients_leave_the_live_parameters_as_they_were_and_the_anchor_gains_nothing() -> None:
    train, val = split_corpus(load_corpus()[:200_000])
    cfg = config.TrainConfig(
        model=config.preset("tiny"), steps=8, batch_size=4, eval_batches=2,
        sync=config.SyncConfig(periods={"router": 2, "latent": 3, "backbone": 4}),
        surrogate=config.SurrogateConfig(refresh_every=3, distill_steps=2, buffer_tokens=64),
    )
    seen = []

    def audit(composers, group, step):
        if group == "backbone" and not seen:
            c = composers[0]
            live = c.outer[group].live_copy()
            zero = {name: torch.zeros_like(t) for name, t in live.items()}
            batches = c.sampler.replay(0, 2)
            gains = own_data.gains(c, group, [zero, c.outer[group].pseudo_gradient()], batches)
            assert gains[0] == 0.0 and gains[1] != 0.0
            assert all(torch.equal(live[n], t) for n, t in c.outer[group].live_copy().items())
            seen.append(gains)

    run(RunSpec(name="p", kind="parallax", cfg=cfg, composers=3), train, val, before_merge=audit)
    assert seen
