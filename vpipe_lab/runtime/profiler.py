"""The online profiler: every layer's measured costs per micro-batch, as the ``LayerCost`` the planners take.

The measurements come from profiling iterations, which the worker schedules itself (after start-up, a plan change,
new input shapes or a profile reset, and one in ``worker.PROFILE_EVERY``; see ``Worker.profile_soon``): in them every layer runs as its own segment
and is timed with the device synchronised (see ``stage.Stage``); the iterations between run fused and untimed per
layer. Times are the median per micro-batch over the profiling iterations since the last reset. A recomputed layer's saved bytes are measured when it is rematerialised; its
forward time is the no-grad forward, a slight underestimate of a kept forward.
"""

from __future__ import annotations

from typing import Any

import torch

from vpipe_lab.runtime.memory import tensor_bytes
from vpipe_lab.runtime.stage import Stage


def layer_costs(stage: Stage, names_of: dict[int, str]) -> list[dict[str, Any]]:
    """One ``LayerCost`` document (plus its global index) per owned layer, averaged since the last reset. A weight
    tied between layers counts with each of them (each would need it were it alone on a stage)."""
    out = []
    for index in stage.owned:
        layer = stage.layers[index]
        st = layer.stats
        names = [c for _, c in layer.tensors.params]
        params = sum(tensor_bytes(stage.tensors[n]) for n in dict.fromkeys(names))
        opt = sum(tensor_bytes(v) for state in stage.optimizer_state(names).values() for v in state.values()
                  if isinstance(v, torch.Tensor))
        out.append({
            "index": index,
            "name": names_of.get(index, str(index)),
            "forward_s": st.typical(st.forward_times),
            "backward_s": st.typical(st.backward_times),
            "activation_bytes": int(st.activation_bytes),
            "input_bytes": int(st.input_bytes),
            "output_bytes": int(st.output_bytes),
            "param_bytes": int(params),
            "optimizer_bytes": int(opt),
            "samples": st.forwards,
        })
    return out
