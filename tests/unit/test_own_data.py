"""``train.own_data``: an audit's arithmetic, its judgement, the peers' margins kept, and gains on a real composer."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from parallax.node.config import train as config
from parallax.node.sim.simulator import RunSpec, run
from parallax.node.train import own_data
from parallax.node.train.data import BatchSampler, data_seed, load_corpus, split_corpus


def test_a_window_judges_a_peer_idle_when_fewer_than_half_its_latest_margins_are_positive() -> None:
    assert not own_data.judged_idle([-1.0] * 7)  # fewer audits than a window
    assert own_data.judged_idle([-1.0] * 5 + [1.0] * 3)
    assert not own_data.judged_idle([-1.0] * 4 + [1.0] * 4)  # half positive is not fewer than half
    assert not own_data.judged_idle([-1.0] * 9 + [1.0] * 4 + [-1.0] * 4)  # only the latest window counts
    assert own_data.idle_share([1.0] * 7) is None
    assert own_data.idle_share([1.0] * 8) == 0.0
    assert own_data.idle_share([-1.0] * 5 + [1.0] * 4) == 0.5  # the first window of two judges it idle
    # Margins about 0 (early in a run, every pseudo-gradient mostly what all the data has in common) pass.
    assert not own_data.judged_idle([-0.1] * 8) and own_data.judged_idle([own_data.FAILS_BELOW] * 8)
    assert own_data.margin(3.0, 1.0) == 2.0 and own_data.margin(-1.0, -2.0) == 0.5
    assert own_data.margin(1.0, 0.0) > 0 > own_data.margin(-1.0, 0.0)


def test_audits_keep_a_window_per_peer_and_forget_the_peer_audited_least_lately() -> None:
    audits = own_data.OwnDataAudits(window=4, peers_kept=2)
    assert not audits.judged("a") and audits.margins("a") == []
    judged = [audits.add("a", -1.0) for _ in range(4)]
    assert judged == [False, False, False, True] and audits.judged("a")
    for _ in range(3):
        audits.add("a", 1.0)
    assert not audits.judged("a") and audits.margins("a") == [-1.0, 1.0, 1.0, 1.0]  # a window, no more
    # Draw counts are kept per session: a restart may count from 0 again.
    audits.add("a", 1.0, drawn=100, session=1)
    assert audits.drawn("a", 1) == 100 and audits.drawn("a", 2) == 0
    audits.add("a", 1.0, drawn=40, session=2)
    assert audits.drawn("a", 2) == 40 and audits.drawn("a", 1) == 0
    audits.add("b", 1.0)
    audits.add("a", 1.0)
    audits.add("c", 1.0)  # two peers kept: the one audited least lately goes
    assert audits.margins("b") == [] and len(audits.margins("a")) == 4 and audits.margins("c") == [1.0]
    assert audits.drawn("b") == 0


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


def test_an_auditor_rebuilds_the_senders_batches_from_its_seed_and_draws_and_audits_on_its_own_model() -> None:
    """A peer's audit of a composer's contribution evaluates on the auditor's model, on the batches the composer's
    sampler handed out last before the contribution was taken: the composer's own replay of its stream, no more
    than the group's period. The composers sample one stream, as a run's nodes sample its corpus."""
    train, val = split_corpus(load_corpus()[:200_000])
    cfg = config.TrainConfig(
        model=config.preset("tiny"), steps=8, batch_size=4, eval_batches=2,
        sync=config.SyncConfig(periods={"router": 2, "latent": 3, "backbone": 4}),
        surrogate=config.SurrogateConfig(refresh_every=3, distill_steps=2, buffer_tokens=64),
        sim=config.SimConfig(data="stream"),
    )
    checked = []

    def audit(composers, group, step):
        if group != own_data.GROUP or checked:
            return
        sender, auditor_model, third = composers
        offered = [c.outer[group].pseudo_gradient() for c in composers]
        merge = {n: sum(d[n] for d in offered) / 3 for n in offered[0]}
        events: list[dict[str, object]] = []
        audits = own_data.OwnDataAudits()
        auditor = own_data.Auditor(auditor_model, {"sender": sender.sampler.seed, "third": third.sampler.seed}.get,
                                   period=3, audits=audits,
                                   event=lambda name, **fields: events.append({"name": name, **fields}))
        drawn = sender.sampler.step
        value = auditor(group, own_data.Case("sender", drawn, offered[0], merge))
        # A period of 3 draws: all three of the sender's last are audited.
        own, merged = own_data.gains(auditor_model, group, [offered[0], merge], sender.sampler.replay(drawn - 3, 3))
        assert value == own_data.margin(own, merged) and audits.margins("sender") == [value]
        assert audits.drawn("sender") == drawn
        assert events and events[0]["name"] == "own_data_audit" and events[0]["peer"] == "sender"
        # Beside them, as many batches of a stream the sender never drew from: what the contribution shows any batch.
        control = BatchSampler(sender.sampler.tokens, sender.sampler.batch_size, sender.sampler.seq_len,
                               own_data.control_seed(sender.sampler.seed)).replay(drawn - 3, 3)
        own_control, merged_control = own_data.gains(auditor_model, group, [offered[0], merge], control)
        assert (events[0]["own_control"], events[0]["merged_control"]) == (round(own_control, 6),
                                                                           round(merged_control, 6))
        assert own_data.control_seed(sender.sampler.seed) not in (sender.sampler.seed, third.sampler.seed)
        assert auditor(group, own_data.Case("stranger", drawn, offered[0], merge)) is None  # no seed known
        assert audits.margins("stranger") == []
        # Claims no honest sender makes fail without an evaluation: the same count again, or none at all.
        assert auditor(group, own_data.Case("sender", drawn, offered[0], merge)) == own_data.FAILED
        assert auditor(group, own_data.Case("third", 0, offered[2], merge)) == own_data.FAILED
        assert audits.margins("sender") == [value, own_data.FAILED] and audits.margins("third") == [own_data.FAILED]
        # A restart (another session) counts its draws anew: audited, not failed.
        again = auditor(group, own_data.Case("sender", drawn, offered[0], merge, session=1))
        assert again == value
        checked.append(value)

    run(RunSpec(name="p", kind="parallax", cfg=cfg, composers=3), train, val, before_merge=audit)
    assert checked


def test_a_peer_ids_data_seed_is_its_identitys_in_the_view() -> None:
    from parallax.dht.membership import Member, SwarmView
    from parallax.node.peer.views import SwarmViews
    from parallax.protocol.identity import Identity
    from parallax.protocol.messages import Heartbeat

    ident = Identity.from_seed(b"a" * 32)
    hb = Heartbeat(peer_id="12D3KooW" + "a" * 44, addresses=("/ip4/127.0.0.1/tcp/1",), role="composer", capacity=1.0,
                   shards=(), step=10)
    view = SwarmView(run_id="r", read_at=100.0,
                     members={ident.fingerprint: Member(ident.fingerprint, ident.public_key, hb, expires_at=1e12)})
    views = SwarmViews(SimpleNamespace(view=lambda: view), "me", 10, lambda *_a, **_k: None)  # type: ignore[arg-type]
    assert views.data_seed_of(hb.peer_id, 7) == data_seed(ident.fingerprint, 7)
    assert views.data_seed_of("12D3KooWx", 7) is None
