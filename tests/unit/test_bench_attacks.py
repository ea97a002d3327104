"""``parallax bench attacks``' accounting from the composers' metrics (pure; the runs are in the slow test)."""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID

from parallax.benchmarks.attacker import (
    ATTACKS,
    SERVING,
    Attacker,
    alie,
    alie_z,
    forged_heartbeat,
    inner_product_manipulation,
)
from parallax.benchmarks.attacks import (
    JoinPlan,
    Layout,
    _against_references,
    _attacker_experts,
    _owned,
    _step_at,
    _window,
    clean_names,
    departs_at,
    departure_name,
    fits,
    honest_places_owned,
    hostile_places,
    is_clean,
    longest_behind,
    markdown,
    merge_harm,
    own_data_audits,
    run_attacks,
    time_to_step,
    whole_merges,
    without_attacker,
)
from parallax.dht.records import unpack_message
from parallax.node.peer.local_swarm import NodeProcess
from parallax.node.train.own_data import margin
from parallax.node.train.robust import merge_geometry, robust_merge_groups
from parallax.protocol.identity import Identity
from parallax.protocol.messages import Heartbeat


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
    window = _window(records, honest)
    assert _attacker_experts(records, honest, 8, window) == 3
    assert _attacker_experts({0: [], 1: [], 3: []}, honest, 8, _window({0: [], 1: [], 3: []}, honest)) is None
    # Over the whole window 0-100 s, of 8 experts: 0.0 and 1.0 for 94 s each, 0.1 for 49 s; 1.1 and 0.2 for none
    # (a node's ownership ends with its last record: composer 1's at 50 s, composer 3's at 60 s).
    assert window == (0.0, 100.0)
    assert _window(records, honest, leaving=(0,)) == (0.0, 110.0)  # a place that leaves early does not end it
    assert _owned(records, [0, 1, 3], 8, window) == pytest.approx((94 + 94 + 49) / 800)
    assert _owned(records, [0, 1, 3], 8, None) is None


def test_the_table_marks_rows_past_the_target():
    row = {"val_loss_ratio": 1.0, "attacker_experts": 2, "honest_owned_share": 0.75, "honest_owned_fraction": 0.98,
           "rounds_ok": 30,
           "rounds_ok_clean": 30,
           "attacker_named": False, "attacker_banned": False, "banned_after_s": None, "surrogates_refused": 0,
           "crashed": False, "within_target": True}
    report = {"composers": 4, "join_at": 10, "preset": "tiny", "steps": 500, "periods": {}, "idle_s": 10,
              "clean_val_loss": 2.7, "clean_spread": 0.02, "target": 1.02, "wall_s": 60.0,
              "clean_merge_cosine": 0.98, "merge_clean_spread": 0.001,
              "clean": [{**row, "name": "clean", "description": "no attacker", "merge_cosine_ratio": 1.0}],
              "attacks": [{**row, "name": "nan", "description": ATTACKS["nan"].description, "val_loss_ratio": 1.1,
                           "merge_cosine_ratio": 0.95,
                           "within_target": False, "attacker_banned": True, "banned_after_s": 14.0,
                           "banned_at_step": 10, "attacker_named": True, "within_reference": False,
                           "reference": "departures", "time_to_judged_s": 102.4, "time_ratio": 2.01}],
              "departures": [{**row, "name": "left-10", "description": "no attacker; the first attacker's place "
                              "leaves at step 10", "merge_cosine_ratio": 1.0, "val_loss_ratio": 1.012}],
              "departed_val_loss": 2.73, "reference_spread": 0.012}
    report["false_bans"] = 1
    report["attacks"][0]["honest_bans"] = [{"by": 0, "peer": "12D3KooWx", "reasons": {}}] * 2
    text = markdown(report)
    row = ("| nan | 1 | NaN pseudo-gradients | **1.100** | - | 0.9500 | 2 | 75% (0.98) | 30 (30) | yes "
           "| yes (14 s, 10) | 0 | no | **no** (departures) | 102 s (2.01) |")
    assert row in text
    assert "| left-10 | 0 | no attacker; the first attacker's place leaves at step 10 | 1.012 |" in text
    assert "leaves at step 10 (mean honest val loss 2.7300); with the clean runs they end 1.20% apart" in text
    assert "| clean | 0 | no attacker | 1.000 | - | 1.0000 |" in text and "2.00% apart" in text
    assert "against the clean runs' 0.9800 (they are 0.10% apart)" in text
    assert "Bans of honest peers: 1 in 2 runs without an attacker, 2 in the attack runs." in text


def test_own_data_audits_are_summed_up_for_the_attackers_places_and_the_others_and_tabled():
    def audit(peer: str, own: float, merged: float, own_control: float, merged_control: float) -> dict:
        return {"kind": "own_data_audit", "peer": peer, "margin": margin(own, merged), "own": own, "merged": merged,
                "own_control": own_control, "merged_control": merged_control}

    records = {0: [audit("copier", 0.10, 0.12, 0.11, 0.12), audit("copier", 0.12, 0.10, 0.10, 0.11),
                   {"kind": "own_data_audit", "peer": "copier", "margin": -1.0, "own": None, "merged": None,
                    "own_control": None, "merged_control": None}],
               1: [audit("honest", 0.13, 0.10, 0.10, 0.095)], 2: [audit("honest", 0.5, 0.1, 0.1, 0.1)]}
    honest = [SimpleNamespace(index=0), SimpleNamespace(index=1)]  # node 2's audits are not an honest composer's
    summary = own_data_audits(records, honest, frozenset({"copier"}))
    # the claim that failed without an evaluation is an audit that neither passed nor showed specific gains
    assert summary == {"places": {"audits": 3, "passed": 2 / 3, "specific": 1 / 3, "beyond_merge": 1 / 3},
                       "others": {"audits": 1, "passed": 1.0, "specific": 1.0, "beyond_merge": 1.0}}
    assert own_data_audits({0: [], 1: []}, honest, frozenset()) is None
    row = {"name": "copied-work", "description": "copies", "val_loss_ratio": 1.0, "attacker_experts": 2,
           "honest_owned_share": 0.75, "rounds_ok": 30, "rounds_ok_clean": 30, "attacker_named": False,
           "attacker_banned": False, "banned_after_s": None, "surrogates_refused": 0, "crashed": False,
           "within_target": True, "own_data": summary}
    report = {"composers": 4, "join_at": 10, "preset": "tiny", "steps": 500, "periods": {}, "idle_s": 10,
              "clean_val_loss": 2.7, "clean_spread": 0.02, "target": 1.02, "wall_s": 60.0, "clean": [],
              "attacks": [row]}
    assert "| copied-work | 3 / 1 | 67% / 100% | 33% / 100% | 33% / 100% |" in markdown(report)


def test_an_attacks_honest_owned_expert_time_is_judged_against_the_same_places_in_the_clean_runs():
    """A composing attack's colluders keep their fair share, as their places do in a clean run: its honest places are
    the composers but the colluders'. An attack whose node is not a composer leaves every composer's share to the
    honest ones."""
    layout = Layout(8, 2)
    clean = [{"owned_without_places": [0.98, 0.85, 0.72]}, {"owned_without_places": [0.96, 0.87, 0.74]}]
    assert hostile_places("clean-2", layout) == () and hostile_places("nan", layout) == (5,)
    assert hostile_places("alie-2", layout) == (5, 6)
    assert honest_places_owned("clean", layout, clean) == pytest.approx(0.97)
    assert honest_places_owned("nan", layout, clean) == pytest.approx(0.86)
    assert honest_places_owned("alie-2", layout, clean) == pytest.approx(0.73)
    assert not ATTACKS["mismatched-preset"].composes
    assert honest_places_owned("mismatched-preset", layout, clean) == pytest.approx(0.97)
    assert honest_places_owned("nan", layout, []) is None
    assert honest_places_owned("nan", layout, [*clean, {"owned_without_places": [None, None, None]}]) is None


def test_in_lockstep_the_joiner_comes_after_the_step_the_others_are_judged_at_and_they_train_on_beside_it():
    assert JoinPlan.lockstep(500) == JoinPlan(steps=800, join_at=500, joiner_steps=300, judged_at=500)
    assert JoinPlan.lockstep(2000) == JoinPlan(steps=2500, join_at=2000, joiner_steps=500, judged_at=2000)


def test_clean_runs_are_named_in_order_and_told_from_attacks():
    assert clean_names(0) == [] and clean_names(3) == ["clean", "clean-2", "clean-3"] and len(clean_names(20)) == 20
    assert all(is_clean(n) for n in clean_names(20))
    assert not any(is_clean(n) for n in (*ATTACKS, "clean-", "clean-x", "cleaner", "left-10"))
    assert departure_name(30) == "left-30" and departs_at("left-30") == 30
    assert all(departs_at(n) is None for n in (*ATTACKS, "clean", "left-", "left-x"))
    assert without_attacker("left-10") and without_attacker("clean-2") and not without_attacker("nan")
    assert hostile_places("left-10", Layout()) == ()


def test_a_banned_attackers_run_is_judged_against_the_departures_and_the_clean_runs_and_others_against_clean():
    references = {"clean": [2.50, 2.50], "departures": [2.50, 2.50, 2.52, 2.54]}
    banned = {"name": "nan", "val_loss": 2.53, "attacker_banned": True, "banned_at_step": 12, "crashed": False}
    assert _against_references(banned, references, 30) == {"reference": "departures", "within_reference": True}
    assert _against_references(banned, references, 0) == {"reference": "clean", "within_reference": False}
    # banned after the last departure, or not at all: the swarm kept its composer longer than any departure's
    assert _against_references({**banned, "banned_at_step": 31}, references, 30)["reference"] == "clean"
    kept = {**banned, "attacker_banned": False, "banned_at_step": None}
    assert _against_references(kept, references, 30) == {"reference": "clean", "within_reference": False}
    # two colluders banned are two composers lost; an attack that is not a composer leaves none
    assert _against_references({**banned, "name": "alie-2"}, references, 30)["reference"] == "clean"
    assert not ATTACKS["mismatched-preset"].composes
    assert _against_references({**banned, "name": "mismatched-preset"}, references, 30)["reference"] == "clean"
    assert _against_references({**banned, "crashed": True}, references, 30)["within_reference"] is False
    assert _against_references({**banned, "val_loss": None}, references, 30)["within_reference"] is None
    assert _against_references({**banned, "name": "left-10"}, references, 30) == {}


def test_the_time_to_a_step_is_the_composers_median_from_their_first_step_and_none_when_one_did_not_reach_it():
    def steps(first: float, per_step: float, last: int) -> list[dict]:
        return [{"t": first, "kind": "first_step"}] + [{"t": first + per_step * s, "kind": "step", "step": s}
                                                      for s in range(1, last + 1)]

    records = {0: steps(10.0, 0.5, 100), 1: steps(12.0, 0.25, 100), 2: steps(11.0, 1.0, 100)}
    assert time_to_step(records, 100) == pytest.approx(50.0)  # 50, 25 and 100 s
    assert time_to_step({**records, 3: steps(9.0, 0.5, 80)}, 100) is None
    assert time_to_step({0: records[0][1:]}, 10) is None  # no first step


def test_the_longest_time_behind_counts_one_groups_applied_rounds_in_a_row_whose_anchor_was_apart():
    def rounds(group: str, behind: list[int]) -> list[dict]:
        return [{"kind": "round", "group": group, "status": "ok", "behind": bool(b)} for b in behind]

    router, latent = rounds("router", [0, 1, 1, 0, 1, 1, 1, 0]), rounds("latent", [1, 0, 1, 1])
    # Interleaved, the groups do not break each other's runs.
    assert longest_behind([r for pair in zip(router, latent + latent, strict=True) for r in pair]) == 3
    assert longest_behind(latent) == 2
    assert longest_behind(rounds("router", [0, 0])) == 0 and longest_behind([{"group": "router"}]) == 0


def test_a_ban_is_placed_at_the_banning_composers_last_step_before_it():
    ban = {"t": 5.5, "kind": "banned", "peer": "x"}
    records = {0: [{"t": float(s), "kind": "step", "step": s} for s in range(1, 10)] + [ban],
               1: [{"t": float(s), "kind": "step", "step": 2 * s} for s in range(1, 10)]}
    assert _step_at(records, [ban]) == 5
    assert _step_at(records, []) is None


def test_the_held_fetches_attack_serves_a_handler_hivemind_accepts_and_never_answers(monkeypatch):
    import asyncio
    import typing

    import pytest
    from hivemind.proto import runtime_pb2

    from parallax.node.outer.blocks import BlockedBody, wanted_uid
    from parallax.node.outer.transport import ContributionServicer, ContributionStore

    for name in SERVING:
        monkeypatch.setattr(ContributionServicer, name, getattr(ContributionServicer, name))  # restored
    assert ATTACKS["held-fetches"].patch is not None
    ATTACKS["held-fetches"].patch(None)  # type: ignore[arg-type]
    store = ContributionStore(keep=2)
    store.put("router", 1, b"body")
    store.put("backbone", 1, BlockedBody((b"a", b"b")))
    servicer = ContributionServicer(store)
    for name, uid in (("rpc_contribution", "router/1"), ("rpc_blocks", wanted_uid("backbone", 1, [0, 1]))):
        handler = getattr(ContributionServicer, name)
        assert typing.get_type_hints(handler)["request"] is runtime_pb2.ExpertRequest  # what hivemind registers
        answer = handler(servicer, runtime_pb2.ExpertRequest(uid=uid), None)

        async def first(answer: typing.Any = answer) -> object:
            return await asyncio.wait_for(anext(answer), 0.2)

        with pytest.raises(TimeoutError):
            asyncio.run(first())


def test_the_trickled_fetches_attack_answers_the_whole_body_a_few_bytes_each_just_inside_the_chunk_wait(monkeypatch):
    import asyncio

    from hivemind.proto import runtime_pb2

    from parallax.node.config.net import OuterConfig
    from parallax.node.outer.transport import ContributionServicer, ContributionStore

    for name in SERVING:
        monkeypatch.setattr(ContributionServicer, name, getattr(ContributionServicer, name))  # restored
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", pause)
    ATTACKS["trickled-fetches"].patch(None)  # type: ignore[arg-type, misc]
    store = ContributionStore(keep=2)
    body = bytes(range(200))
    store.put("router", 1, body)

    async def read() -> list[bytes]:
        answer = ContributionServicer(store).rpc_contribution(runtime_pb2.ExpertRequest(uid="router/1"), None)
        return [m.serialized_info async for m in answer]

    messages = asyncio.run(read())
    assert b"".join(messages) == body and max(map(len, messages)) == 64 and len(pauses) == len(messages) == 4
    assert all(0 < p < OuterConfig.loopback().next_chunk_timeout_s for p in pauses)


def test_a_layout_places_the_colluders_before_the_joiner_and_keeps_two_honest_composers_from_the_start():
    assert (Layout().from_the_start, Layout().attacker_places, Layout().joiner) == ((0, 1), (2,), 3)
    eight = Layout(8, 2)
    assert eight.from_the_start == (0, 1, 2, 3, 4) and eight.attacker_places == (5, 6) and eight.honest[-1] == 7
    with pytest.raises(ValueError, match="fewer than two honest"):
        Layout(4, 2)
    assert fits(1, 4) and not fits(2, 4) and fits(2, 5)
    with pytest.raises(ValueError, match="needs --composers 5 or more"):  # before any process starts
        run_attacks(attacks=["alie-2"], composers=4)
    with pytest.raises(ValueError, match="a departure must come between"):
        run_attacks(attacks=["nan"], steps=500, left_at=(10, 500))
    with pytest.raises(ValueError, match="PATH=VALUE"):
        run_attacks(attacks=["nan"], settings=("net.outer.own_data_audits",))
    with pytest.raises(ValueError, match="the benchmark sets it itself"):
        run_attacks(attacks=["nan"], settings=("sync.periods={}",))


def test_alie_moves_z_standard_deviations_from_the_colluders_mean_and_ipm_points_against_it():
    assert alie_z(4, 1) == 0.0 and alie_z(8, 2) == pytest.approx(0.3186, abs=1e-4)  # Phi^-1(5/8)
    assert alie_z(16, 2) < alie_z(8, 2) < alie_z(8, 4)  # more colluders, or fewer honest, go further
    honest = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0])]
    z = alie_z(8, 2)
    assert torch.allclose(alie(2)(honest, 8), torch.tensor([2.0 - z * 2 ** 0.5, 2.0]))
    assert torch.equal(alie(2)(honest[:1], 8), honest[0])  # alone, its own honest tensor
    assert torch.allclose(inner_product_manipulation(0.1)(honest, 8), torch.tensor([-0.2, -0.2]))


def test_colluders_share_their_honest_tensors_and_send_the_same_crafted_body(monkeypatch, tmp_path):
    from parallax.node.outer.gathered import GatheredRounds

    sent: list[dict[str, torch.Tensor]] = []

    def record(self: object, n: int, delta: dict[str, torch.Tensor]) -> None:
        sent.append(delta)

    patch = ATTACKS["ipm-2"].patch
    assert patch is not None and ATTACKS["ipm-2"].colluders == 2
    colluders = []
    for place in (5, 6):  # each colluder's process patches its own stock node, whatever its rounds' transport
        monkeypatch.setattr(GatheredRounds, "_offer", record)
        patch(Attacker(tmp_path / f"attacker-{place}.json", "run", []))
        colluders.append(GatheredRounds._offer)
    colluders[0](None, 1, {"w": torch.tensor([1.0, 1.0])})  # alone so far: -0.1 x its own
    colluders[1](None, 1, {"w": torch.tensor([3.0, 3.0])})  # the other's honest tensor is in the shared folder
    colluders[0](None, 2, {"w": torch.tensor([1.0, 1.0])})
    assert [d["w"].tolist() for d in sent] == [pytest.approx([x, x]) for x in (-0.1, -0.2, -0.2)]
    assert len(list((tmp_path / "colluders").glob("*.pt"))) == 2  # one per colluder and group, nothing half-written
    assert not list((tmp_path / "colluders").glob(".*"))


def _contributions(k: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    return [{n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in base.items()} for _ in range(k)]


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([d[n].reshape(-1).double() for n in ("w", "b")])


def test_a_merges_geometry_gives_what_it_kept_of_the_honest_mean_without_the_tensors():
    """From the inner products alone: the merge's cosine with the honest senders' weighted mean and its length along
    it, as computed from the tensors; a NaN contribution has no products and is never honest."""
    deltas = _contributions(5, seed=1)
    deltas[4] = {n: -4.0 * t for n, t in deltas[0].items()}  # a sign-flipped, scaled liar
    weights = [1.0, 2.0, 1.0, 1.0, 1.0]
    merged = {n: sum(w * d[n] for w, d in zip(weights, deltas, strict=True)) / sum(weights) for n in ("w", "b")}
    event = {**merge_geometry(deltas, merged), "weights": weights, "senders": ["a", "b", "c", "d", "liar"]}
    honest = [_flat(d) for d in deltas[:4]]
    h = sum(w * x for w, x in zip(weights[:4], honest, strict=True)) / sum(weights[:4])
    m = _flat(merged)
    cosine, progress = merge_harm(event, lambda peer: peer != "liar")
    assert cosine == pytest.approx(float(m @ h / torch.linalg.vector_norm(m) / torch.linalg.vector_norm(h)), rel=1e-9)
    assert progress == pytest.approx(float(m @ h / (h @ h)), rel=1e-9) and progress < 0.9
    assert merge_harm(event, lambda _peer: True) == pytest.approx((1.0, 1.0), abs=1e-6)  # the mean of all five
    # The robust merge of the same five points along the honest update better than their mean.
    robust, _ = robust_merge_groups(deltas, weights, "mean")
    assert robust is not None
    kept, _ = merge_harm({**merge_geometry(deltas, robust), "weights": weights, "senders": event["senders"]},
                         lambda peer: peer != "liar")
    assert cosine < kept <= 1.0 + 1e-9
    deltas[4] = {n: torch.full_like(t, float("nan")) for n, t in deltas[4].items()}
    poisoned = merge_geometry(deltas, merged)
    assert poisoned["dots"][4] is None and poisoned["gram"][0][4] is None and poisoned["gram"][0][0] is not None
    poisoned.update(weights=weights, senders=event["senders"])
    assert merge_harm(poisoned, lambda _peer: True) is not None
    assert merge_harm(poisoned, lambda peer: peer == "liar") is None


def test_the_nan_attack_poisons_every_block_of_a_partitioned_contribution_and_reads_its_own_back_as_zeros(
        monkeypatch):
    from parallax.node.outer import gathered
    from parallax.node.outer.blocks import block_layout, decode_block
    from parallax.protocol.errors import MalformedMessage

    for name in ("encode_contribution", "encode_blocks", "decode_contribution", "decode_all"):
        monkeypatch.setattr(gathered, name, getattr(gathered, name))  # restored
    assert ATTACKS["nan"].patch is not None
    ATTACKS["nan"].patch(None)  # type: ignore[arg-type]
    shapes = {"w": (3000, 4), "b": (8,)}  # 12,000 entries: three blocks of w, one of b
    blocked = gathered.encode_blocks({n: torch.ones(s) for n, s in shapes.items()}, "int4")
    layout = block_layout(shapes)
    assert len(blocked.blobs) == len(layout) > 2
    for blob, block in zip(blocked.blobs, layout, strict=True):
        with pytest.raises(MalformedMessage, match=r"contains NaN or Inf \(peer attacker\)$"):
            decode_block(blob, block, shapes[block.name], peer="attacker")
    assert all(not t.any() for t in gathered.decode_all(blocked, shapes, peer="me").values())


def test_the_nan_block_attack_poisons_one_block_of_a_contribution_in_blocks_and_one_tensor_of_a_whole_one(monkeypatch):
    import msgpack
    import numpy as np

    from parallax.node.outer import gathered
    from parallax.node.outer.blocks import block_layout, decode_block
    from parallax.node.outer.transport import decode_contribution
    from parallax.protocol.errors import MalformedMessage

    for name in ("encode_contribution", "encode_blocks", "decode_contribution", "decode_all"):
        monkeypatch.setattr(gathered, name, getattr(gathered, name))  # restored
    assert ATTACKS["nan-block"].patch is not None
    ATTACKS["nan-block"].patch(None)  # type: ignore[arg-type]
    shapes = {"w": (3000, 4), "b": (8,)}
    layout = block_layout(shapes)
    bad = []
    for blob, block in zip(gathered.encode_blocks({n: torch.ones(s) for n, s in shapes.items()}, "int4").blobs,
                           layout, strict=True):
        try:
            decode_block(blob, block, shapes[block.name], peer="attacker")
        except MalformedMessage:
            bad.append(block)
    assert len(bad) == 1
    body = gathered.encode_contribution({n: torch.ones(s) for n, s in shapes.items()}, "int4")
    with pytest.raises(MalformedMessage, match="NaN"):
        decode_contribution(body, shapes, peer="attacker")
    packed = {name: msgpack.unpackb(blob) for name, blob in msgpack.unpackb(body).items()}  # [codec, dtype, ...]
    assert sorted(name for name, (_, _, _, _, data) in packed.items() if np.isnan(np.frombuffer(data, "<f4")).any()
                  ) in (["b"], ["w"])  # a whole body: one tensor NaN, the other as sent


def test_a_partitioned_merges_shares_sum_to_the_whole_once_each_and_a_gathered_merge_stands_alone():
    deltas = _contributions(3, seed=4)
    merged = {n: sum(d[n] for d in deltas) / 3 for n in ("w", "b")}
    rows = {"0": ("w", 0, 8), "1": ("w", 8, 16), "2": ("b", 0, 8)}  # three blocks: w in two, b whole

    def share(blocks: list[int], node: str) -> dict[str, object]:
        keys = [str(i) for i in blocks]
        part = [{k: d[rows[k][0]][rows[k][1]:rows[k][2]] for k in keys} for d in deltas]
        result = {k: merged[rows[k][0]][rows[k][1]:rows[k][2]] for k in keys}
        return {"kind": "merge", "group": "backbone", "node": node, "senders": ["a", "b", "c"],
                "contributions": ["a:1", "b:4", "c:2"], "weights": [1.0, 1.0, 1.0], "blocks": blocks,
                **merge_geometry(part, result)}

    gathered = {"group": "router", "senders": ["a", "b"], **merge_geometry(deltas[:2], merged), "weights": [1.0, 1.0]}
    got = whole_merges([share([0], "a"), share([1, 2], "b"), share([1, 2], "c"), gathered])
    assert got[0] is gathered and len(got) == 2
    whole, expected = got[1], merge_geometry(deltas, merged)
    assert whole["blocks"] == {0, 1, 2}  # the repeated share counted once
    assert whole["square"] == pytest.approx(expected["square"])
    assert all(a == pytest.approx(b) for a, b in zip(whole["dots"], expected["dots"], strict=True))
    assert all(a == pytest.approx(b) for x, y in zip(whole["gram"], expected["gram"], strict=True)
               for a, b in zip(x, y, strict=True))
    assert merge_harm(whole, lambda _: True) == pytest.approx(merge_harm({**expected, "senders": ["a", "b", "c"],
                                                                          "weights": [1.0] * 3}, lambda _: True))


def test_a_forged_heartbeat_copies_the_attacked_nodes_announcement_under_a_peer_id_nobody_runs():
    real = SimpleNamespace(presence=SimpleNamespace(capacity=1.0, run_digest=b"r" * 16), _step=420,
                           _versions={"router": 3}, _lock=threading.Lock())
    identity = Identity.from_seed(b"f" * 32)
    beat = unpack_message(forged_heartbeat(real, identity), (Heartbeat,), peer="test")
    assert (beat.role, beat.step, beat.versions, beat.run, beat.shards) == ("composer", 420, {"router": 3},
                                                                             b"r" * 16, ())
    assert PeerID.from_base58(beat.peer_id).to_bytes() == b"\x12\x20" + hashlib.sha256(identity.public_key).digest()
    assert not beat.probation  # a liar does not say it has shown no work



def test_the_late_uploads_attack_offers_each_contribution_after_the_others_wait_for_missing_ones(monkeypatch):
    import time

    from parallax.node.outer.gathered import GatheredRounds

    offered: list[tuple[int, float]] = []
    monkeypatch.setattr(GatheredRounds, "_offer", lambda self, n, delta: offered.append((n, time.monotonic())))
    patch = ATTACKS["late-uploads"].patch
    assert patch is not None and not ATTACKS["late-uploads"].crafts
    patch(None)  # type: ignore[arg-type]
    node = SimpleNamespace(config=SimpleNamespace(net=SimpleNamespace(min_matchmaking_time_s=0.2)))
    began = time.monotonic()
    GatheredRounds._offer(node, 3, {})  # type: ignore[arg-type]
    assert offered[0][0] == 3 and offered[0][1] - began >= 0.2


@pytest.mark.parametrize("parts", [False, True])
def test_the_copied_work_attack_trains_nothing_and_offers_another_composers_newest_contribution(monkeypatch, parts):
    from parallax.node.outer.blocks import check_answer, encode_blocks
    from parallax.node.outer.gathered import GatheredRounds
    from parallax.node.outer.transport import RoundEntry, encode_contribution
    from parallax.node.train.composer import Composer

    shapes = {"w": (64, 80), "b": (8,)}
    g = torch.Generator().manual_seed(0)
    theirs = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    own = {name: torch.ones(shape) for name, shape in shapes.items()}  # what the wire would send: not sent
    blocked, whole = encode_blocks(theirs, "none"), encode_contribution(theirs, "none")
    claim = RoundEntry(4, blocked.digest if parts else b"d", blocked.size if parts else len(whole), 1.0)

    def fetch_blocks(peer, key, round_id, digest, size, wanted, count, timeout_s):
        assert (peer, key, round_id, digest) == ("victim", "backbone", 4, blocked.digest)
        return check_answer(blocked.answer(wanted), digest, wanted, count, peer=peer)

    gather = SimpleNamespace(fetch=lambda peer, group, entry, timeout_s: whole, fetch_blocks=fetch_blocks)
    node = SimpleNamespace(group="backbone", peer_id="copier", parts=object() if parts else None, shapes=shapes,
                           gather=gather, config=SimpleNamespace(net=SimpleNamespace(allreduce_timeout_s=5.0)))
    offered: list[dict[str, torch.Tensor]] = []
    stepped: list[bool] = []
    monkeypatch.setattr(GatheredRounds, "_offer", lambda self, n, delta: offered.append(dict(delta)))
    monkeypatch.setattr(GatheredRounds, "_fetch", lambda self, name, entry: ({}, entry.tokens))
    monkeypatch.setattr(Composer, "optimizer_step", lambda self: stepped.append(all(
        p.grad is None for o in self._optimizers() for group in o.param_groups for p in group["params"])))
    patch = ATTACKS["copied-work"].patch
    assert patch is not None and ATTACKS["copied-work"].crafts
    patch(None)  # type: ignore[arg-type]

    GatheredRounds._offer(node, 3, own)  # type: ignore[arg-type]
    assert all(not offered[-1][n].any() for n in shapes)  # nothing seen yet: zeros, whatever it would send
    GatheredRounds._fetch(node, "copier@4", claim)  # type: ignore[arg-type]  # its own: not copied
    GatheredRounds._offer(node, 4, own)  # type: ignore[arg-type]
    assert all(not offered[-1][n].any() for n in shapes)
    GatheredRounds._fetch(node, "victim@4", claim)  # type: ignore[arg-type]
    GatheredRounds._offer(node, 5, own)  # type: ignore[arg-type]
    for name, t in theirs.items():
        off = float(torch.linalg.vector_norm(offered[-1][name] - t) / torch.linalg.vector_norm(t))
        assert 0 < off < 0.03, (name, off)  # the copy, with noise: no bit-for-bit match

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    Composer.optimizer_step(SimpleNamespace(_optimizers=lambda: [torch.optim.AdamW([weight])]))  # type: ignore[arg-type]
    assert stepped == [True] and weight.grad is None


def test_sybil_records_name_only_the_sybils_in_the_nodes_latest_merged_round_and_claim_each_round_once():
    from parallax.benchmarks.attacker import sybil_records, unrun_peer_id
    from parallax.node.outer.transport import WITHDRAWN, RoundEntry, decode_entries, pair, vouched
    from parallax.node.outer.witness import signed_by

    sybils = [Identity.generate() for _ in range(3)]
    merged = RoundEntry(4, b"d" * 32, 100, 5.0, b"f" * 8, ("QmNode@4",))
    withdrawn = RoundEntry(5, b"e" * 32, 100, 5.0, WITHDRAWN, ())
    assert sybil_records(sybils, "run", "router", [withdrawn], {}) == {}  # nothing merged yet
    claims: dict = {}
    records = sybil_records(sybils, "run", "router", [merged, withdrawn], claims)
    again = sybil_records(sybils, "run", "router", [merged, withdrawn], claims)
    assert records == again  # the same claim each time: no second claim of a round
    entries = {}
    for sybil in sybils:
        (entry,) = decode_entries(records[sybil.fingerprint]).values()
        assert entry.round_id == 4 and entry.fingerprint == merged.fingerprint
        assert entry.participants == tuple(sorted(pair(unrun_peer_id(s), 4) for s in sybils))  # not the node's
        assert signed_by(sybil.public_key, "run", "router", entry)
        entries[unrun_peer_id(sybil)] = {4: entry}
    assert vouched(entries) == set(entries)  # each named by two others' records
    later = RoundEntry(6, b"g" * 32, 100, 5.0, b"h" * 8, ("QmNode@6",))
    newer = sybil_records(sybils, "run", "router", [merged, later], claims)
    assert {e.round_id for r in newer.values() for e in decode_entries(r).values()} == {6}
    assert len(claims) == len(sybils)  # one claim kept per identity and group


def test_a_run_that_outlasts_its_bound_is_stopped_and_reported_and_the_benchmark_goes_on(monkeypatch, tmp_path):
    """Composers that never finish (a stand-in for the process swarm: the pure bookkeeping of ``_run``)."""
    import parallax.benchmarks.attacks as attacks

    closed: list[bool] = []

    node_args: list[list[str]] = []

    class Swarm:
        def __init__(self, folder, **kwargs: object) -> None:
            self.folder, self.nodes = folder, []
            node_args.append(list(kwargs["node_args"]))  # type: ignore[call-overload]

        def start_bootstrap(self) -> None:
            pass

        def add_node(self, *_: object, **__: object) -> None:
            i = len(self.nodes)
            (self.folder / f"node-{i}").mkdir(parents=True, exist_ok=True)
            self.nodes.append(SimpleNamespace(index=i, step=0, alive=True, metrics=self.folder / f"node-{i}" / "m",
                                              log=self.folder / f"node-{i}" / "log",
                                              process=SimpleNamespace(returncode=None)))

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(attacks, "LocalSwarm", Swarm)
    monkeypatch.setattr(attacks, "RUN_BOUND_S", 0.0)
    said: list[str] = []
    report = run_attacks(attacks=["nan"], steps=100, clean_runs=1, workdir=tmp_path, progress=said.append,
                         settings=("net.outer.own_data_audits=true",))
    assert len(closed) == 2  # both runs ran, each stopped at its bound
    for args in node_args:  # every node gets the settings asked for, after the bench's own
        at = args.index("net.outer.own_data_audits=true")
        assert args[at - 1] == "--set" and at > args.index("net.outer.record_merges=true")
    assert report["settings"] == ["net.outer.own_data_audits=true"]
    for row in (*report["clean"], *report["attacks"]):
        assert row["timed_out"] and row["crashed"] and row["val_loss"] is None, row
    assert any("stopped: not finished within 0 s" in line for line in said), said
    assert "| nan |" in markdown(report)
