"""The measured profile the Session hands the planners: each layer's latest measurement, kept across plan changes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from vpipe_lab.core.profile import LayerCost, ModelProfile, SharedTensor
from vpipe_lab.wire.events import LayerMeasure


class Profiles:
    """Merges the stages' per-layer reports into one ``ModelProfile``; a layer with no samples in its latest report
    (it just moved, or the plan changed) keeps its last measurement, which is the best there is. A layer's weight
    step (``weight_grad_s``) is its last split backward's measurement, or, never split, half its backward times the
    share of its parameters a split would defer."""

    def __init__(self) -> None:
        self._last: dict[int, LayerCost] = {}  # last measurement of each layer that had samples
        self.newest: ModelProfile | None = None  # the last merged profile: what a preview or a check reuses

    def merge(self, measures: Iterable[LayerMeasure], microbatch_size: int) -> ModelProfile:
        layers: dict[int, LayerCost] = {}
        users: dict[str, set[int]] = {}  # a tied parameter: the units that reported using it, and its bytes
        sizes: dict[str, tuple[int, int]] = {}
        for m in measures:
            for name, (size, state) in m.shared.items():
                users.setdefault(name, set()).add(m.index)
                sizes[name] = (size, max(state, sizes.get(name, (0, 0))[1]))  # Adam's state exists after a step
            index = m.index
            cost = m.cost
            cached = self._last.get(index)
            if m.samples == 0 and cached is not None and cached.name == cost.name:
                cost = LayerCost(cost.name, cached.forward_s, cached.backward_s,
                                 max(cost.activation_bytes, cached.activation_bytes), cached.input_bytes,
                                 cached.output_bytes, cost.param_bytes, cost.optimizer_bytes or cached.optimizer_bytes,
                                 cost.times or cached.times, cached.weight_grad_s,
                                 max(cost.transient_bytes, cached.transient_bytes), cost.step_bytes or cached.step_bytes)
            elif m.samples > 0:
                if cached is not None and cached.name == cost.name and not cost.transient_bytes:
                    # working sets are measured on fewer iterations than times: the last measurement stands
                    cost = replace(cost, transient_bytes=cached.transient_bytes, step_bytes=cached.step_bytes)
                if cost.weight_grad_s is None and cached is not None and cached.weight_grad_s is not None:
                    # measured under a schedule that does not split the backward: the last split's share stands
                    cost = replace(cost, weight_grad_s=min(cached.weight_grad_s, cost.backward_s))
                self._last[index] = cost
            if cost.weight_grad_s is None:  # never split: half the backward for the share a split would defer
                cost = replace(cost, weight_grad_s=cost.backward_s / 2 * m.deferrable)
            layers[index] = cost
        self.newest = ModelProfile(tuple(layers[i] for i in sorted(layers)), name="measured",
                                   microbatch_size=microbatch_size,
                                   shared=tuple(SharedTensor(n, tuple(users[n]), *sizes[n]) for n in sorted(users)
                                                if len(users[n]) > 1))
        return self.newest

    def forget(self) -> None:
        """The model changed (set_model): earlier measurements describe other layers."""
        self._last.clear()
        self.newest = None
