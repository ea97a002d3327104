"""A co-owner taking its lead's copy of a replicated expert (``Experts.resync``): the network parts are stand-ins
(this is the node's bookkeeping between two steps), the composers are real."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import torch

from parallax.node.config import train as config
from parallax.node.config.peer import NodeSettings
from parallax.node.config.train import train_config
from parallax.node.config.typed import apply_changes
from parallax.node.net.expert_exchange import SURROGATE_PREFIX, SURROGATE_VERSION, Snapshot
from parallax.node.peer.experts import Experts, Taking
from parallax.node.train.composer import Composer, expert_group
from parallax.node.train.data import load_corpus, split_corpus

EID = (0, 1)
OWNED = (frozenset({1}), frozenset())


class _Gossip:
    def __init__(self) -> None:
        self.held: dict = {}

    def hold(self, eid, version) -> None:
        self.held[eid] = version

    def versions(self) -> dict:
        return dict(self.held)


class _Exchange:
    def __init__(self, answer: Snapshot | str) -> None:
        self.answer, self.asked = answer, []

    def fetch(self, peer, eid) -> Future:
        self.asked.append((peer, eid))
        done: Future = Future()
        done.set_result(self.answer)
        return done


def _composer(seed: int) -> Composer:
    cfg = apply_changes(train_config("tiny", steps=20, batch_size=2), {"sync.outer_momentum": 0.9,
                                                                       "ownership.replicas": 2})
    cfg = config.replace(cfg, surrogate=config.replace(cfg.surrogate, refresh_every=2, distill_steps=2,
                                                       buffer_tokens=48, delta_rank=2))
    train = split_corpus(load_corpus()[:40_000])[0]
    return Composer(cfg, OWNED, train, sampler_seed=seed, replica_outers=True)


def _experts(composer: Composer, exchange: _Exchange) -> tuple[Experts, list]:
    events: list = []
    member = SimpleNamespace(heartbeat=SimpleNamespace(peer_id="lead-peer"))
    membership = SimpleNamespace(view=lambda: SimpleNamespace(alive=lambda: {"lead": member}))
    telemetry = SimpleNamespace(event=lambda kind, **f: events.append((kind, f)))
    experts = Experts(composer, _Gossip(), exchange, membership, None, telemetry, NodeSettings(),  # type: ignore[arg-type]
                      fingerprint="me", online_at=0.0, owners={EID: ("lead", "me")})
    return experts, events


def _lead_snapshot(lead: Composer) -> Snapshot:
    tensors = lead.expert_snapshot(EID)
    for name, p in lead.model.surrogate_parameters(*EID).items():
        tensors[f"{SURROGATE_PREFIX}{name}"] = p.detach().clone()
    tensors[SURROGATE_VERSION] = torch.tensor(7.0)
    return Snapshot(layer=EID[0], expert=EID[1], step=lead.step, final=False, tensors=tensors)


def test_a_co_owner_takes_its_leads_weights_and_outer_state_at_the_next_seam():
    lead, me = _composer(3), _composer(4)
    for c in (lead, me):
        for _ in range(3):
            c.train_step()
    lead.apply_outer(expert_group(EID), lead.pseudo_gradient(expert_group(EID)))  # the lead's anchor moved on
    exchange = _Exchange(_lead_snapshot(lead))
    experts, events = _experts(me, exchange)
    assert experts.led == set()  # the lead publishes this expert, not us
    experts.resync(EID, "lead")
    experts.resync(EID, "lead")  # asked once only
    assert exchange.asked == [("lead-peer", EID)]
    experts._finish_resyncs()
    for name, p in me.model.expert_parameters(*EID).items():
        assert torch.equal(p.data, lead.model.expert_parameters(*EID)[name].data)
    for name, anchor in me.outer[expert_group(EID)].anchor.items():
        assert torch.equal(anchor, lead.outer[expert_group(EID)].anchor[name])
    assert experts.gossip.held[EID] == 7 and [k for k, _ in events] == ["resync"]


def test_no_copy_from_the_lead_or_a_refused_one_leaves_the_own_copy_training():
    lead, me = _composer(3), _composer(4)
    me.train_step()
    before = {n: p.detach().clone() for n, p in me.model.expert_parameters(*EID).items()}
    for answer in ("it holds none", _lead_snapshot(lead)):
        if isinstance(answer, Snapshot):
            answer.tensors["w_up.weight"] = answer.tensors["w_up.weight"][:, :-1]  # a shape the composer refuses
        experts, events = _experts(me, _Exchange(answer))
        experts.resync(EID, "lead")
        experts._finish_resyncs()
        assert EID in set(me.owned_experts()) and events == []
        for name, p in me.model.expert_parameters(*EID).items():
            assert torch.equal(p.data, before[name])
    me.train_step()  # and it trains on


def test_a_leaving_owner_stops_waiting_for_an_heir_that_left_first():
    """Nodes stopped together: the heir of this node's experts leaves before it. The leaving owner reads its heirs
    from the view at every check, so it leaves at once instead of waiting out the leave bound for a peer gone."""
    me = _composer(4)
    ticks = iter(range(1000))
    heirs = [{EID: "heir"}, {EID: "heir"}, {}]  # the heir's deathrattle reaches the view at the third check
    views = SimpleNamespace(heirs_of=lambda experts: heirs.pop(0) if len(heirs) > 1 else heirs[0])
    updates: list = []
    membership = SimpleNamespace(update=lambda **fields: updates.append(fields))
    exchange = SimpleNamespace(servicer=SimpleNamespace(served_steps={}))  # the heir never pulled
    experts = Experts(me, _Gossip(), exchange, membership, views, None, NodeSettings(),  # type: ignore[arg-type]
                      fingerprint="me", online_at=0.0, owners={EID: ("me",)}, clock=lambda: float(next(ticks)))
    experts.push_final_snapshots(deadline=1000.0)
    assert next(ticks) < 10 and updates and updates[0]["step"] == me.step  # it announced its last step, then left



def test_an_heir_that_announces_it_is_leaving_is_no_heir_to_wait_for():
    """Nodes stopped together: two leaving owners, each the other's heir, would each wait out the leave bound for
    a pull the other, no longer training, never makes. An heir whose heartbeat says it is leaving is left out."""
    from parallax.dht.claims import ShardConfig
    from parallax.dht.membership import Member, SwarmView
    from parallax.node.peer.views import LEAVING, SwarmViews
    from parallax.protocol.identity import Identity
    from parallax.protocol.messages import Heartbeat

    def member(seed: bytes, leaving: bool) -> Member:
        ident = Identity.from_seed(seed * 32)
        hb = Heartbeat(peer_id="12D3KooW" + seed.decode() * 44, addresses=("/ip4/127.0.0.1/tcp/1",),
                       role="composer", capacity=1.0, shards=(), step=10,
                       versions={LEAVING: 1} if leaving else {})
        return Member(ident.fingerprint, ident.public_key, hb, expires_at=1e12)

    for leaving in (False, True):
        me, heir = member(b"a", False), member(b"b", leaving)
        view = SwarmView(run_id="r", read_at=100.0, members={me.fingerprint: me, heir.fingerprint: heir},
                         shards=ShardConfig(n_layers=1, n_experts=4))
        assignment = view.assignment()
        assert assignment is not None
        mine = [(0, e) for e in range(4) if assignment.owner(0, e) == me.fingerprint]
        views = SwarmViews(SimpleNamespace(view=lambda v=view: v), me.fingerprint, 10,  # type: ignore[arg-type]
                           lambda *_a, **_k: None)
        assert mine and views.heirs_of(mine) == ({} if leaving else {e: heir.fingerprint for e in mine})


def test_a_hand_over_whose_peers_served_nothing_names_each_and_why_and_resumes_from_the_local_copy(caplog):
    """A take-over ends on its wait with one peer's answer empty and another's request still unanswered: the node
    adopts its own copy, and the log names both peers and what each did."""
    from parallax.node.peer.handover import Finish, Handover

    lead, me = _composer(3), _composer(4)
    me.release_expert(EID)
    own = _lead_snapshot(lead)
    exchange = SimpleNamespace(take_local_copy=lambda eid: (own, "own release"))
    experts, events = _experts(me, exchange)  # type: ignore[arg-type]
    experts.telemetry.status = SimpleNamespace(adoptions=0)
    experts._assignment = SimpleNamespace(owner=lambda *eid: "lead")  # it co-owns EID: nothing to publish here
    handover = Handover(source="peer-a", others=["peer-b"], started=0.0, online_since=0.0, wait_s=10.0,
                        handover_window_s=30.0)
    experts.handovers[EID] = Taking(handover, {"peer-b": Future()},  # asked, never answered
                                    {"peer-a": "it holds none, or serves none to this node"})
    with caplog.at_level("WARNING"):
        experts._carry_out(EID, [Finish(None)])
    assert EID in set(me.owned_experts()) and EID not in experts.handovers
    assert [f["source"] for k, f in events if k == "adopted"] == ["own release"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "peer-a: it holds none" in said and "peer-b: no answer by the end of the wait" in said, said
    assert f"own release of step {own.step}" in said


def test_a_snapshot_that_came_with_the_answer_that_ended_the_wait_is_taken_and_a_failed_request_is_named(caplog):
    from parallax.node.peer.handover import Finish, Handover

    lead, me = _composer(3), _composer(4)
    me.release_expert(EID)
    served: Future = Future()
    served.set_result(_lead_snapshot(lead))
    failed: Future = Future()
    failed.set_exception(RuntimeError("stream reset"))
    experts, events = _experts(me, SimpleNamespace(take_local_copy=lambda eid: None))  # type: ignore[arg-type]
    experts.telemetry.status = SimpleNamespace(adoptions=0)
    experts._assignment = SimpleNamespace(owner=lambda *eid: "lead")
    handover = Handover(source="peer-a", others=["peer-b"], started=0.0, online_since=0.0, wait_s=10.0,
                        handover_window_s=30.0)
    experts.handovers[EID] = Taking(handover, {"peer-a": failed, "peer-b": served})
    experts._carry_out(EID, [Finish(None)])  # the wait ended as peer-a's failure was heard, before peer-b's answer
    assert [(f["source"], f["snapshot_step"]) for k, f in events if k == "adopted"] == [("previous owner", lead.step)]
    me_failed, _ = _experts(_composer(5), SimpleNamespace(take_local_copy=lambda eid: None))  # type: ignore[arg-type]
    me_failed.composer.release_expert(EID)
    me_failed.telemetry.status = SimpleNamespace(adoptions=0)
    me_failed._assignment = experts._assignment
    me_failed.handovers[EID] = Taking(handover, {"peer-a": failed})
    with caplog.at_level("WARNING"):
        me_failed._carry_out(EID, [Finish(None)])
    assert "peer-a: the request raised RuntimeError('stream reset')" in caplog.text
