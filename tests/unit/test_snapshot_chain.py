"""Heir copies as chains of ternary changes: the heir rebuilds the owner's copy bit for bit, the copy lags the owner
by one link's rounding and never drifts, keyframes where links cannot reach, and every bad answer refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from parallax.node.net.snapshot_chain import (
    KEPT_LINKS,
    Chain,
    ChainMismatch,
    HeirCopy,
    factored_second_moment,
    rebuild,
    released_copy,
)
from parallax.node.train.composer import check_adam_state
from parallax.protocol.codec import encode
from parallax.protocol.errors import RemoteProtocolError
from parallax.protocol.messages import ExpertSnapshotLinks

SHAPES = {"w_gate.weight": (48, 32), "w_up.weight": (48, 32), "w_down.weight": (32, 48)}
NAMES = tuple(SHAPES)
EID = (1, 3)


class Owner:
    """An expert trained by random steps of about ``lr`` per value, with an AdamW-like state."""

    def __init__(self, seed: int = 0, lr: float = 0.01) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.init = {n: torch.randn(s, generator=self.gen) * 0.02 for n, s in SHAPES.items()}
        self.weights = {n: t.clone() for n, t in self.init.items()}
        self.lr, self.steps = lr, 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            for t in self.weights.values():
                t.add_(torch.randn(t.shape, generator=self.gen) * self.lr)
        self.steps += steps

    def snapshot(self) -> dict[str, torch.Tensor]:
        out = {n: t.clone() for n, t in self.weights.items()}
        if self.steps:
            for n, s in SHAPES.items():
                out[f"adam.exp_avg.{n}"] = torch.full(s, 1e-4)
                out[f"adam.exp_avg_sq.{n}"] = torch.rand(s, generator=self.gen) * 1e-6
            out["adam.step"] = torch.tensor(float(self.steps), dtype=torch.float64)
        return out


def _norm(a: dict[str, torch.Tensor] | dict[str, np.ndarray], b: dict[str, torch.Tensor]) -> float:
    return float(sum(((torch.as_tensor(a[n]) - b[n]) ** 2).sum() for n in NAMES)) ** 0.5


def _pull(chain: Chain, held: HeirCopy | None, owner: Owner, *, init: bool = True):
    msg = chain.answer(chain.base_for(None if held is None else (held.chain, held.version), init=init), *EID)
    msg = ExpertSnapshotLinks.decode(msg.encode())  # as it crosses the wire
    return msg, rebuild(msg, SHAPES, held, (lambda: owner.init) if init else None)


def test_the_heir_rebuilds_the_owners_copy_bit_for_bit_and_it_lags_one_links_rounding() -> None:
    owner = Owner()
    chain = Chain.start(0, owner.snapshot(), NAMES, taken=0.0)
    assert chain.from_init and chain.version == 0
    msg, (held, tensors) = _pull(chain, None, owner)
    assert msg.base == 0 and msg.version == 0 and not any(n in msg.tensors for n in NAMES)  # nothing but the init
    lags = []
    for period in range(1, 9):
        before = {n: t.clone() for n, t in owner.weights.items()}
        owner.train(50)
        previous_ref = chain.ref
        chain = chain.advance(owner.steps, owner.snapshot(), taken=float(period))
        msg, (held, tensors) = _pull(chain, held, owner)
        assert (msg.base, msg.version) == (period - 1, period)
        assert all(np.array_equal(held.ref[n], chain.ref[n]) for n in NAMES)  # what the digest vouches for
        assert all(torch.equal(tensors[n], torch.from_numpy(chain.ref[n])) for n in NAMES)
        # Ternary rounding never grows what it codes: the copy is nearer the owner's weights than before the link.
        assert _norm(chain.ref, owner.weights) < _norm(previous_ref, owner.weights)
        lags.append(_norm(chain.ref, owner.weights) / _norm(before, owner.weights))
    # Error feedback: the copy stays about half a period's change behind, it does not fall further back.
    assert max(lags[3:]) < 0.8 and lags[-1] < 1.5 * lags[2]
    link_bytes = sum(len(b) for n, b in msg.tensors.items() if n.startswith("link."))
    assert link_bytes / sum(np.prod(s) for s in SHAPES.values()) < 0.25  # bytes a parameter, against 12 exact


def test_links_close_the_gap_once_the_owner_stops() -> None:
    owner = Owner()
    chain = Chain.start(0, owner.snapshot(), NAMES, taken=0.0)
    owner.train(200)
    gaps = []
    for _ in range(6):
        chain = chain.advance(owner.steps, owner.snapshot(), taken=0.0)
        gaps.append(_norm(chain.ref, owner.weights))
    assert all(b < a for a, b in zip(gaps, gaps[1:], strict=False)) and gaps[-1] < 0.25 * gaps[0]


def test_an_heir_behind_by_several_links_catches_up_and_beyond_the_kept_ones_gets_a_keyframe() -> None:
    owner = Owner()
    chain = Chain.start(0, owner.snapshot(), NAMES, taken=0.0)
    _, (held, _) = _pull(chain, None, owner)
    for _ in range(3):
        owner.train(10)
        chain = chain.advance(owner.steps, owner.snapshot(), taken=0.0)
    msg, (caught_up, _) = _pull(chain, held, owner)
    assert (msg.base, msg.version) == (0, 3) and caught_up.version == 3
    for _ in range(KEPT_LINKS + 1):
        owner.train(10)
        chain = chain.advance(owner.steps, owner.snapshot(), taken=0.0)
    msg, (held, tensors) = _pull(chain, caught_up, owner)
    assert msg.base == msg.version == chain.version and all(n in msg.tensors for n in NAMES)  # a keyframe
    assert all(np.array_equal(held.ref[n], chain.ref[n]) for n in NAMES)
    msg, _ = _pull(chain, None, owner)  # no copy, and the links from the initialisation are gone
    assert msg.base == chain.version and all(n in msg.tensors for n in NAMES)


def test_keyframes_for_another_chain_a_stepped_start_or_an_heir_that_cannot_draw_the_init() -> None:
    owner = Owner()
    owner.train(5)
    stepped = Chain.start(5, owner.snapshot(), NAMES, taken=0.0)
    assert not stepped.from_init
    msg, (held, tensors) = _pull(stepped, None, owner)
    assert msg.base == msg.version == 0 and all(n in msg.tensors for n in NAMES)
    assert all(torch.equal(tensors[n], owner.weights[n]) for n in NAMES)  # a keyframe of version 0 is exact
    restarted = Chain.start(5, owner.snapshot(), NAMES, taken=0.0)  # restarted from the same copy: the same chain
    assert restarted.chain == stepped.chain
    msg, (same, _) = _pull(restarted, held, owner)
    assert msg.base == msg.version == 0 and not set(NAMES) & set(msg.tensors) and same == held
    owner.train(5)
    moved = Chain.start(10, owner.snapshot(), NAMES, taken=0.0)  # restarted from other weights: a new chain
    assert moved.chain != stepped.chain
    msg, _ = _pull(moved, held, owner)
    assert all(n in msg.tensors for n in NAMES)
    fresh = Owner()
    from_init = Chain.start(0, fresh.snapshot(), NAMES, taken=0.0)
    msg, _ = _pull(from_init, None, fresh, init=False)
    assert all(n in msg.tensors for n in NAMES)


def test_the_releaser_of_an_expert_continues_the_chain_its_new_owner_starts_from_the_released_copy() -> None:
    """A new owner starts its chain at the copy it adopted, the previous owner's final snapshot; the previous
    owner, its heir now, holds that copy exactly and rebuilds every version from links alone."""
    previous = Owner(seed=1)
    previous.train(30)
    final = previous.snapshot()
    chain = Chain.start(0, final, NAMES, taken=0.0)  # the new owner's step counts from its own start
    held = released_copy(final, NAMES)
    assert held.chain == chain.chain and held.version == 0
    for _ in range(2):
        previous.train(10)  # the new owner trains it on
        chain = chain.advance(previous.steps, previous.snapshot(), taken=0.0)
    msg, (copy, tensors) = _pull(chain, held, previous, init=False)
    assert (msg.base, msg.version) == (0, 2) and not set(NAMES) & set(msg.tensors)  # links, no keyframe
    assert copy.version == 2 and all(np.array_equal(copy.ref[n], chain.ref[n]) for n in NAMES)
    other = released_copy(Owner(seed=2).snapshot(), NAMES)  # a copy the new owner did not adopt: a keyframe
    msg, _ = _pull(chain, other, previous, init=False)
    assert msg.base == msg.version and all(n in msg.tensors for n in NAMES)


def test_two_chains_from_one_copy_share_a_name_and_a_later_version_of_the_other_is_a_mismatch() -> None:
    """An owner restarted from the copy its chain started at trains it another way: the heir's place on the first
    chain names a version the second has too, its links do not rebuild the signed copy, and the heir, asking again
    with nothing, is answered from the initialisation while the chain is young, else with a keyframe."""
    owner = Owner()
    first = Chain.start(0, owner.snapshot(), NAMES, taken=0.0)
    second = Chain.start(0, owner.snapshot(), NAMES, taken=0.0)
    owner.train(10)
    first = first.advance(10, owner.snapshot(), taken=0.0)
    _, (held, _) = _pull(first, None, owner)
    other = Owner(seed=7)
    other.init = owner.init
    other.weights = {n: t.clone() for n, t in owner.init.items()}
    for _ in range(2):
        other.train(10)
        second = second.advance(other.steps, other.snapshot(), taken=0.0)
    assert (held.chain, held.version) == (second.chain, 1)
    with pytest.raises(ChainMismatch):
        _pull(second, held, owner)
    msg, (copy, _) = _pull(second, None, owner)
    assert msg.base == 0 and copy.version == 2 and all(np.array_equal(copy.ref[n], second.ref[n]) for n in NAMES)
    for _ in range(KEPT_LINKS):
        other.train(10)
        second = second.advance(other.steps, other.snapshot(), taken=0.0)
    msg, _ = _pull(second, held, owner)  # a place the kept links no longer reach, another chain's or not
    assert all(n in msg.tensors for n in NAMES)


def test_the_restored_adam_state_is_one_adamw_accepts() -> None:
    owner = Owner()
    owner.train(3)
    snap = owner.snapshot()
    chain = Chain.start(3, snap, NAMES, taken=0.0)
    _, (_, tensors) = _pull(chain, None, owner)
    assert float(tensors["adam.step"]) == 3.0
    assert all(float(tensors[f"adam.exp_avg.{n}"].abs().max()) == 0 for n in NAMES)  # the first moment restarts
    step, moments = check_adam_state("heir copy", {k: v for k, v in tensors.items() if k.startswith("adam.")},
                                     {n: torch.Size(s) for n, s in SHAPES.items()}, betas=(0.9, 0.95))
    assert step == 3.0 and all(float(moments[f"exp_avg_sq.{n}"].min()) >= 0 for n in NAMES)
    for n in NAMES:  # the row and column means of the estimate are those of the owner's second moment
        v, est = snap[f"adam.exp_avg_sq.{n}"], tensors[f"adam.exp_avg_sq.{n}"]
        assert torch.allclose(est.mean(1), v.mean(1), rtol=1e-4) and torch.allclose(est.mean(0), v.mean(0), rtol=1e-4)


def test_a_rank_one_second_moment_is_restored_exactly() -> None:
    rows, cols = np.array([1.0, 2.0, 4.0], dtype=np.float32), np.array([0.5, 1.5], dtype=np.float32)
    v = np.outer(rows, cols)
    est = factored_second_moment(v.mean(axis=1), v.mean(axis=0), (3, 2))
    assert np.allclose(est, v, rtol=1e-6)
    assert not factored_second_moment(np.zeros(3, np.float32), np.zeros(2, np.float32), (3, 2)).any()


def _linked() -> tuple[Owner, HeirCopy, Chain]:
    owner = Owner()
    chain = Chain.start(0, owner.snapshot(), NAMES, taken=0.0)
    _, (held, _) = _pull(chain, None, owner)
    owner.train(20)
    return owner, held, chain.advance(owner.steps, owner.snapshot(), taken=0.0)


def test_links_that_do_not_rebuild_the_signed_copy_are_a_mismatch() -> None:
    owner, held, chain = _linked()
    msg = chain.answer(chain.base_for((held.chain, held.version)), *EID)
    with pytest.raises(ChainMismatch):  # another digest
        rebuild(dataclasses.replace(msg, digest=bytes(32)), SHAPES, held, None)
    with pytest.raises(ChainMismatch):  # links for a copy this heir does not hold
        rebuild(msg, SHAPES, dataclasses.replace(held, chain=held.chain + 1), None)
    tampered = dict(msg.tensors)
    blob = bytearray(tampered["link.0.w_up.weight"])
    blob[-1] = (blob[-1] + 1) % 243  # another valid trit code
    tampered["link.0.w_up.weight"] = bytes(blob)
    with pytest.raises(ChainMismatch):
        rebuild(dataclasses.replace(msg, tensors=tampered), SHAPES, held, None)
    rebuild(msg, SHAPES, held, None)  # the untouched answer rebuilds


def _bad(tensors: dict[str, bytes], name: str) -> dict[str, bytes]:
    if name == "unknown":
        return {**tensors, "adam.exp_avg.w_up.weight": tensors["v.rows.w_up.weight"]}
    if name == "half a state":
        return {k: v for k, v in tensors.items() if k != "v.cols.w_down.weight"}
    if name == "missing link":
        return {k: v for k, v in tensors.items() if k != "link.0.w_gate.weight"}
    if name == "shape":
        return {**tensors, "v.rows.w_up.weight": encode(np.ones(7, np.float32))}
    if name == "negative":
        return {**tensors, "v.cols.w_up.weight": encode(-np.ones(32, np.float32))}
    if name == "step":
        return {**tensors, "adam.step": encode(np.float32(2.5))}
    if name == "nan":
        return {**tensors, "v.rows.w_up.weight": encode(np.full(48, 1e30, np.float32))}
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["unknown", "half a state", "missing link", "shape", "negative", "step", "nan"])
def test_bad_answers_are_refused(name: str) -> None:
    _, held, chain = _linked()
    msg = chain.answer(chain.base_for((held.chain, held.version)), *EID)
    with pytest.raises(RemoteProtocolError):
        rebuild(dataclasses.replace(msg, tensors=_bad(dict(msg.tensors), name)), SHAPES, held, None)


@pytest.mark.parametrize("links", [KEPT_LINKS + 1, 2**62])
def test_more_links_than_kept_are_refused_before_anything_is_built(links: int) -> None:
    _, held, chain = _linked()
    msg = chain.answer(chain.base_for((held.chain, held.version)), *EID)
    with pytest.raises(RemoteProtocolError, match="more than"):
        rebuild(dataclasses.replace(msg, version=msg.base + links, tensors={}), SHAPES, held, None)


def test_only_links_from_an_initialisation_drawn_here_blame_the_initialisation() -> None:
    owner = Owner()
    chain = Chain.start(0, owner.snapshot(), NAMES, taken=0.0)
    msg = chain.answer(chain.base_for(None), *EID)
    other = {n: t + 1.0 for n, t in owner.init.items()}  # another generator's draws
    with pytest.raises(ChainMismatch) as drawn:
        rebuild(msg, SHAPES, None, lambda: other)
    assert drawn.value.from_init
    _, held, linked = _linked()
    with pytest.raises(ChainMismatch) as held_copy:
        rebuild(dataclasses.replace(linked.answer(linked.base_for((held.chain, held.version)), *EID),
                                    digest=bytes(32)), SHAPES, held, None)
    assert not held_copy.value.from_init
