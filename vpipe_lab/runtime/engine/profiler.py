"""The online profiler: every layer's measured costs per micro-batch, as the ``LayerCost`` the planners take.

The measurements come from profiling iterations, which the worker schedules itself with a ``ProfileSchedule``: three
after start-up, a plan change, new input shapes or a profile reset (the first runs cold and is dropped), and one in 25
otherwise. A profiling iteration costs ~2% more than a fused one on CPU (more on a GPU, which it synchronises per
layer), so the periodic ones cost well under 1% of throughput. In them every layer runs as its own segment and is
timed with the device synchronised (see ``stage.Stage``); the iterations between run fused and untimed per layer.
Times are the median per micro-batch over the profiling iterations since the last reset. A profiling iteration also
times each layer on its first micro-batch's input cut to half and repeated to twice its size (``Stage.probe``): the
points of its throughput-vs-micro-batch-size curve, so the planners can choose the micro-batch count
(``core/cost/scaling.py``). That adds about 2.5 micro-batches' compute to a profiling iteration. A layer that only takes
its own batch size (a graph captured with a fixed batch dimension, a hard-coded reshape) fails its probe once and is
then taken as linear in the micro-batch size; a captured model with a free batch dimension (the default) is probed. A
recomputed layer's saved bytes are measured when it is rematerialised; its forward time is the no-grad forward, a
slight underestimate of a kept forward. Under a zero-bubble schedule a layer's W step is timed on its own and reported
apart (``weight_grad_s``) and inside its backward; ``deferrable`` is the share of the layer's parameter elements a
split would defer (linear weights of at least ``wgrad.SPLIT_MIN_PARAMS`` elements: smaller ones' gradients stay in B),
from which the controller estimates W before it has been timed (``control/changes/profiles.py``).
"""

from __future__ import annotations

from collections.abc import Set

import torch

from vpipe_lab.core.profile import LayerCost
from vpipe_lab.runtime.engine import wgrad
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.wire.events import LayerMeasure


def layer_costs(stage: Stage, names_of: dict[int, str], shared: Set[str] = frozenset()) -> list[LayerMeasure]:
    """One ``LayerCost`` (with its global index) per owned layer, averaged since the last reset. A weight
    tied between layers counts with each of them (each would need it were it alone on a stage); those of ``shared``
    (the tied ones) are named with their bytes too, so that a stage holding two of its users counts it once."""
    out = []
    for index in stage.owned:
        layer = stage.layers[index]
        st = layer.stats
        names = list(dict.fromkeys(c for _, c in layer.tensors.params))
        state = stage.optimizer_state(names)
        opt_of = {n: sum(_whole(v) for v in state.get(n, {}).values() if isinstance(v, torch.Tensor))
                  for n in names}
        params, opt = sum(_whole(stage.tensors[n]) for n in names), sum(opt_of.values())
        weight = st.typical(st.weight_times) if st.weight_times else None  # a split backward's W, timed apart
        routed, _ = wgrad.routed_elements(layer.module, wgrad.split_threshold(stage.fused_wgrad))
        elements = sum(stage.tensors[n].numel() for n in names)
        cost = LayerCost(names_of.get(index, str(index)), st.typical(st.forward_times),
                         st.typical(st.backward_times) + (weight or 0.0), int(st.activation_bytes), int(st.input_bytes),
                         int(st.output_bytes), int(params), int(opt),
                         tuple((size, st.typical(fwd), st.typical(bwd)) for size, (fwd, bwd) in sorted(st.sizes.items())),
                         weight, int(st.transient_bytes), int(st.step_bytes))
        out.append(LayerMeasure(index, cost, st.forwards, min(1.0, routed / elements) if elements else 0.0,
                                {n: [_whole(stage.tensors[n]), opt_of[n]] for n in names if n in shared}))
    return out


def _whole(t: torch.Tensor) -> int:
    """A tensor's bytes whole: a profile describes the model, and a sharded stage's DTensor holds a shard of it
    (the cost model divides by the shards, ``core/cost/sharded.py``)."""
    return t.numel() * t.element_size()


class ProfileSchedule:
    """Which iterations are profiling iterations (see the module docstring).

    ``soon()`` asks for ``after_trigger`` of them from the next iteration on: the first runs cold (allocator, caches,
    layers that just arrived) and its measurements are dropped when the second begins. Besides those, one iteration
    in ``every`` profiles.
    """

    def __init__(self, every: int = 25, after_trigger: int = 3) -> None:
        if every < 1 or after_trigger < 2:
            raise ValueError(f"profile every {every} iterations with {after_trigger} after a trigger: use every >= 1 "
                             "and at least 2 after a trigger (the first is dropped)")
        self.every, self.after_trigger = every, after_trigger
        self.left = after_trigger
        self.cold = True  # the iteration ``next`` last answered is the first after a trigger (its figures are dropped)

    def soon(self) -> None:
        self.left = self.after_trigger

    def next(self, iteration: int) -> tuple[bool, bool]:
        """(profile this iteration, drop the measurements so far first)."""
        profile = self.left > 0 or iteration % self.every == 0
        drop = self.left == self.after_trigger - 1
        self.cold = self.left == self.after_trigger
        self.left = max(0, self.left - 1)
        return profile, drop
