"""The DiLoCo outer optimizer of one shared parameter group, and the tier schedule of the groups.

DiLoCo (Douillard et al., 2023) treats the change of the parameters since the last merge,
delta = theta(last merge) - theta(now), as a pseudo-gradient: the composers' deltas are merged
(``parallax.node.train.rda``) and applied to the anchor theta(last merge) by SGD with Nesterov momentum
(lr 0.7, momentum 0.9); the live parameters then restart from the new anchor.

The anchor and the momentum live on the CPU in float32 whatever the model's device and dtype: they
are touched once per H_G steps, and keeping them off the accelerator leaves its memory to training.

Tiered sync (DESIGN.md section 4): each shared group has its own period H_G, router fastest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from parallax.node.config.train import SHARED_GROUPS


class OuterOptimizer:
    """Nesterov outer optimizer over the anchor of one shared group (one instance per group)."""

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        """Args:
            params: the group's live parameters by name (any device/dtype); updated in place by step().
            lr: outer learning rate.
            momentum: outer momentum; 0 gives plain SGD (Nesterov needs momentum > 0, so it is then off).
            nesterov: use Nesterov momentum.

        Raises:
            ValueError: no parameters, lr <= 0 or momentum outside [0, 1).
        """
        if not params:
            raise ValueError("an outer optimizer needs at least one parameter")
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.params = dict(params)
        self.anchor: dict[str, torch.Tensor] = {
            name: p.detach().to(device="cpu", dtype=torch.float32).clone() for name, p in self.params.items()
        }
        # torch's SGD, not a hand-written Nesterov: its update is the reference everyone checks against.
        # torch refuses nesterov=True with momentum 0, which is plain SGD anyway.
        self.optimizer = torch.optim.SGD(
            list(self.anchor.values()), lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0
        )
        self.round = 0
        """The outer round whose merge gave the anchor (its number: the step of the round over the group's period); 0
        while the anchor is the initial parameters. Set by whoever applies or loads a merge; checkpoints keep it."""
        self.unsent: dict[str, torch.Tensor] = {}
        """Error feedback under a sparse wire: what this node's merged rounds did not send of its pseudo-gradients
        (CPU float32), added to the next one it sends (``with_unsent``, ``keep_unsent``); checkpoints keep it."""

    def _live(self, name: str) -> torch.Tensor:
        return self.params[name].detach().to(device="cpu", dtype=torch.float32)

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        """Returns: name -> anchor - current parameter (CPU float32), the step DiLoCo merges."""
        return {name: a - self._live(name) for name, a in self.anchor.items()}

    @torch.no_grad()
    def step(self, merged: Mapping[str, torch.Tensor]) -> None:
        """Apply the merged pseudo-gradient to the anchor, then reset the live parameters to it.

        Args:
            merged: name -> merged pseudo-gradient, same names and shapes as the parameters.

        Raises:
            ValueError: names or shapes differ from the group's.
        """
        if set(merged) != set(self.anchor):
            raise ValueError(f"merged tensors {sorted(merged)} != group tensors {sorted(self.anchor)}")
        for name, a in self.anchor.items():
            if merged[name].shape != a.shape:
                raise ValueError(
                    f"merged {name} has shape {tuple(merged[name].shape)}, expected {tuple(a.shape)}")
            # clone: SGD must never alias a tensor the caller (or the averager) still owns.
            a.grad = merged[name].detach().to(device="cpu", dtype=torch.float32).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for name, a in self.anchor.items():
            self.params[name].copy_(a)  # copy_ converts to the parameter's device and dtype

    @torch.no_grad()
    def step_late(self, merged: Mapping[str, torch.Tensor], submitted: Mapping[str, torch.Tensor]) -> None:
        """Apply a merge that arrived after training went on (the node merges in the background).

        The merged pseudo-gradient was computed from the parameters ``submitted`` (CPU copies taken when
        the round began); the progress made since, live - submitted, is kept on top of the new anchor,
        so it counts in the next round's pseudo-gradient instead of being lost.

        Args:
            merged: name -> merged pseudo-gradient (as for ``step``).
            submitted: name -> the live parameters when the round's pseudo-gradient was taken.
        """
        drift = {name: self._live(name) - submitted[name].to(torch.float32) for name in self.anchor}
        self.step(merged)
        for name, p in self.params.items():
            p.add_(drift[name].to(p.device, p.dtype))

    def step_kept(self, merged: Mapping[str, torch.Tensor]) -> None:
        """Apply a merge that left this node's pseudo-gradient out (taken from another anchor than the others'): all
        it trained since its anchor stays on top of the new anchor, for its next round. What earlier rounds did not
        send stays unsent: nothing of it was merged."""
        self.step_late(merged, {name: a.clone() for name, a in self.anchor.items()})

    def live_copy(self) -> dict[str, torch.Tensor]:
        """Returns: name -> CPU float32 copy of the live parameters (``step_late``'s ``submitted``)."""
        return {name: self._live(name).clone() for name in self.anchor}

    @torch.no_grad()
    def load_live(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set the live parameters to ``values`` (name -> tensor: a ``live_copy``, or the anchor)."""
        for name, p in self.params.items():
            p.copy_(values[name])

    def with_unsent(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``delta`` (a pseudo-gradient of this group) plus what earlier merged rounds did not send of theirs."""
        return {name: d + self.unsent[name] if name in self.unsent else d.clone() for name, d in delta.items()}

    def keep_unsent(self, pending: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> None:
        """A round merged ``sent`` of ``pending`` (``with_unsent``'s): the rest waits for the next rounds. A round
        that merged nothing leaves ``unsent`` alone: its pseudo-gradient is still in the next one."""
        self.unsent = {name: (p - sent[name]).to(device="cpu", dtype=torch.float32) for name, p in pending.items()}

    def step_alone(self) -> None:
        """A merge among one: the outer step with this node's whole pseudo-gradient and all it had not sent."""
        pending = self.with_unsent(self.pseudo_gradient())
        self.unsent = {}
        self.step(pending)

    def state_dict(self) -> dict[str, Any]:
        """Returns: the anchor (name -> CPU float32 tensor), the SGD state (momentum buffers), the round and what
        was not sent yet."""
        return {"anchor": {n: a.clone() for n, a in self.anchor.items()},
                "optimizer": self.optimizer.state_dict(), "round": self.round,
                "unsent": {n: u.clone() for n, u in self.unsent.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; the live parameters are left alone (the checkpoint has them).

        Raises:
            ValueError: the state belongs to a group with other tensor names or shapes.
        """
        anchor = state["anchor"]
        if list(anchor) != list(self.anchor):
            raise ValueError(f"outer state has tensors {list(anchor)}, this group has {list(self.anchor)}")
        for name, a in self.anchor.items():
            if anchor[name].shape != a.shape:
                raise ValueError(
                    f"outer state {name} has shape {tuple(anchor[name].shape)}, expected {tuple(a.shape)}")
            a.copy_(anchor[name])  # in place: the SGD keeps pointing at the same tensors
        self.optimizer.load_state_dict(state["optimizer"])
        self.round = int(state.get("round", 0))
        unsent = state.get("unsent") or {}
        if any(n not in self.anchor or u.shape != self.anchor[n].shape for n, u in unsent.items()):
            raise ValueError(f"outer state's unsent tensors {sorted(unsent)} do not match this group's")
        self.unsent = {n: u.to(device="cpu", dtype=torch.float32).clone() for n, u in unsent.items()}

    @torch.no_grad()
    def reset_anchor(self, *, reset_momentum: bool = False) -> None:
        """Make the current parameters the anchor (after a joiner loaded the group from peers).

        Args:
            reset_momentum: also forget the momentum buffers.
        """
        for name, a in self.anchor.items():
            a.copy_(self._live(name))
        if reset_momentum:
            self.optimizer.state.clear()


class OuterBundle:
    """Several outer optimizers stepped as one: the experts one set of owners merges in one round.

    SGD is elementwise, so stepping each part with its share of the merged pseudo-gradient is the step of one
    optimizer over all of them; the names of the parts must differ (the model's parameter names do).
    """

    def __init__(self, parts: Sequence[OuterOptimizer]) -> None:
        names = [n for p in parts for n in p.anchor]
        if not parts or len(set(names)) != len(names):
            raise ValueError("an outer bundle needs at least one part and distinct tensor names")
        self.parts = list(parts)

    @property
    def anchor(self) -> dict[str, torch.Tensor]:
        return {n: a for p in self.parts for n, a in p.anchor.items()}

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        return {n: d for p in self.parts for n, d in p.pseudo_gradient().items()}

    def live_copy(self) -> dict[str, torch.Tensor]:
        return {n: t for p in self.parts for n, t in p.live_copy().items()}

    def load_live(self, values: Mapping[str, torch.Tensor]) -> None:
        """``OuterOptimizer.load_live`` of every part with its tensors of ``values``."""
        for p in self.parts:
            p.load_live({n: values[n] for n in p.anchor})

    def with_unsent(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t for p in self.parts for n, t in p.with_unsent({n: delta[n] for n in p.anchor}).items()}

    def keep_unsent(self, pending: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> None:
        for p in self.parts:
            p.keep_unsent({n: pending[n] for n in p.anchor}, {n: sent[n] for n in p.anchor})

    def step(self, merged: Mapping[str, torch.Tensor]) -> None:
        """``OuterOptimizer.step`` of every part with its tensors of ``merged``."""
        self._check(merged)
        for p in self.parts:
            p.step({n: merged[n] for n in p.anchor})

    def step_late(self, merged: Mapping[str, torch.Tensor], submitted: Mapping[str, torch.Tensor]) -> None:
        """``OuterOptimizer.step_late`` of every part."""
        self._check(merged)
        for p in self.parts:
            p.step_late({n: merged[n] for n in p.anchor}, {n: submitted[n] for n in p.anchor})

    def _check(self, merged: Mapping[str, torch.Tensor]) -> None:
        if set(merged) != set(self.anchor):
            raise ValueError(f"merged tensors {sorted(merged)} != bundle tensors {sorted(self.anchor)}")


def to_send(outer: OuterOptimizer | OuterBundle, error_feedback: bool) -> dict[str, torch.Tensor]:
    """What a round of ``outer``'s group sends: its pseudo-gradient, plus what earlier rounds did not send when the
    wire keeps the rest (``error_feedback``)."""
    delta = outer.pseudo_gradient()
    return outer.with_unsent(delta) if error_feedback else delta


class TierSchedule:
    """Which shared groups merge at which inner step: group G every H_G steps, steps counted from 1."""

    def __init__(self, periods: Mapping[str, int]) -> None:
        """Args:
            periods: group -> period H_G in inner steps; groups from SHARED_GROUPS (a model without
                a latent interface has no "latent" group, so a subset is allowed).

        Raises:
            ValueError: an unknown group or a period that is not a positive integer.
        """
        unknown = set(periods) - set(SHARED_GROUPS)
        if unknown:
            raise ValueError(f"unknown groups {sorted(unknown)}; shared groups are {SHARED_GROUPS}")
        for group, period in periods.items():
            if not isinstance(period, int) or period < 1:
                raise ValueError(f"period of {group!r} must be a positive number of steps, got {period!r}")
        self.periods = {g: periods[g] for g in SHARED_GROUPS if g in periods}

    def due(self, step: int) -> list[str]:
        """Groups to merge after inner step ``step``, fastest cadence first (SHARED_GROUPS order).

        Args:
            step: the inner step just finished, counted from 1.

        Returns:
            The groups whose period divides step.

        Raises:
            ValueError: step < 1 (step 0 would make every group due before any training).
        """
        if step < 1:
            raise ValueError(f"steps are counted from 1, got {step}")
        return [g for g, period in self.periods.items() if step % period == 0]

    def next_round(self, group: str, step: int) -> int:
        """The first step strictly after ``step`` at which ``group`` merges.

        Args:
            group: a group of this schedule.
            step: the current step (0 before training).

        Returns:
            The next multiple of the group's period greater than step.

        Raises:
            ValueError: the group is not in this schedule.
        """
        if group not in self.periods:
            raise ValueError(f"group {group!r} is not scheduled; scheduled groups are {list(self.periods)}")
        period = self.periods[group]
        return (max(step, 0) // period + 1) * period
