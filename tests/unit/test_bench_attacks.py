"""``parallax bench attacks``' accounting from the composers' metrics (pure; the runs are in the slow test)."""

from __future__ import annotations

import pytest

from parallax.benchmarks.attacker import ATTACKS
from parallax.benchmarks.attacks import _attacker_experts, _honest_owned, clean_names, is_clean, markdown
from parallax.node.peer.local_swarm import NodeProcess


class _Node:
    def __init__(self, index: int) -> None:
        self.index = index


def _shard(t: float, experts: list[list[int]]) -> dict:
    return {"t": t, "kind": "shard", "experts": experts}


def test_experts_the_attacker_held_are_those_no_honest_composer_owned_four_fifths_into_the_run():
    records = {
        0: [{"t": 0.0, "kind": "first_step"}, _shard(1.0, [[0, 0], [1, 0]]), _shard(95.0, []),
            {"t": 100.0, "kind": "final_eval"}],
        1: [{"t": 0.5, "kind": "first_step"}, _shard(1.0, [[0, 1]]), _shard(50.0, [[0, 1], [1, 1]])],
        3: [{"t": 30.0, "kind": "first_step"}, _shard(60.0, [[0, 2]])],
        2: [{"t": 0.2, "kind": "first_step"}, {"t": 110.0, "kind": "final_eval"}],
    }
    honest: list[NodeProcess] = [_Node(i) for i in (0, 1, 3)]  # type: ignore[misc]
    # The cut is at 80 s: the departure churn at 95 s does not count; 5 of 8 owned by honest composers.
    assert _attacker_experts(records, honest, total=8) == 3
    assert _attacker_experts({0: [], 1: [], 3: []}, honest, total=8) is None
    # Over the whole window 0-100 s, of 8 experts: 0.0 and 1.0 for 94 s each, 0.1 for 49 s; 1.1 and 0.2 for none
    # (a node's ownership ends with its last record: composer 1's at 50 s, composer 3's at 60 s).
    assert _honest_owned(records, honest, total=8) == pytest.approx((94 + 94 + 49) / 800)


def test_the_table_marks_rows_past_the_target():
    row = {"val_loss_ratio": 1.0, "attacker_experts": 2, "honest_owned_fraction": 0.75, "rounds_ok": 30,
           "rounds_ok_clean": 30,
           "attacker_named": False, "attacker_banned": False, "banned_after_s": None, "surrogates_refused": 0,
           "crashed": False, "within_target": True}
    report = {"composers": 4, "join_at": 10, "preset": "tiny", "steps": 500, "periods": {}, "idle_s": 10,
              "clean_val_loss": 2.7, "clean_spread": 0.02, "target": 1.02, "wall_s": 60.0,
              "clean": [{**row, "name": "clean", "description": "no attacker"}],
              "attacks": [{**row, "name": "nan", "description": ATTACKS["nan"].description, "val_loss_ratio": 1.1,
                           "within_target": False, "attacker_banned": True, "banned_after_s": 14.0,
                           "attacker_named": True}]}
    report["false_bans"] = 1
    report["attacks"][0]["honest_bans"] = [{"by": 0, "peer": "12D3KooWx", "reasons": {}}] * 2
    text = markdown(report)
    assert "| nan | NaN pseudo-gradients | **1.100** | - | 2 | 75% | 30 (30) | yes | yes (14 s) | 0 | no |" in text
    assert "| clean | no attacker | 1.000 |" in text and "2.0% apart" in text
    assert "Bans of honest peers: 1 in 1 clean runs, 2 in the attack runs." in text


def test_clean_runs_are_named_in_order_and_told_from_attacks():
    assert clean_names(0) == [] and clean_names(3) == ["clean", "clean-2", "clean-3"] and len(clean_names(20)) == 20
    assert all(is_clean(n) for n in clean_names(20))
    assert not any(is_clean(n) for n in (*ATTACKS, "clean-", "clean-x", "cleaner"))


def test_the_held_fetches_attack_serves_a_handler_hivemind_accepts_and_never_answers(monkeypatch):
    import asyncio
    import typing

    import pytest
    from hivemind.proto import runtime_pb2

    from parallax.node.outer.transport import ContributionServicer, ContributionStore

    monkeypatch.setattr(ContributionServicer, "rpc_contribution", ContributionServicer.rpc_contribution)  # restored
    assert ATTACKS["held-fetches"].patch is not None
    ATTACKS["held-fetches"].patch(None)  # type: ignore[arg-type]
    hints = typing.get_type_hints(ContributionServicer.rpc_contribution)  # what hivemind reads to register it
    assert hints["request"] is runtime_pb2.ExpertRequest
    store = ContributionStore(keep=2)
    store.put("router", 1, b"body")
    answer = ContributionServicer(store).rpc_contribution(runtime_pb2.ExpertRequest(uid="router/1"), None)

    async def first() -> object:
        return await asyncio.wait_for(anext(answer), 0.2)

    with pytest.raises(TimeoutError):
        asyncio.run(first())
