"""A captured unit: one piece of torch.export's graph that takes the carry and returns it (``capture.py`` cuts them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Carry = dict[str, Any]


class GraphUnit(nn.Module):
    """One piece of the captured graph: takes the carry, runs its nodes, returns the carry for the next unit."""

    def __init__(self, graph: nn.Module, in_keys: list[str], out_keys: list[str], carry_keys: list[str],
                 copy_keys: set[str] | None = None) -> None:
        super().__init__()
        self.graph = graph
        self.in_keys, self.out_keys, self.carry_keys = in_keys, out_keys, carry_keys
        # Inputs the graph writes in place (a residual ``add_`` on what it received): it gets a copy, made once,
        # since a received tensor is a leaf of its own autograd graph and must not change.
        self.copy_keys = copy_keys if copy_keys is not None else written_inputs(graph)

    def forward(self, carry: Carry) -> Carry:
        args = (carry[k].clone() if k in self.copy_keys and isinstance(carry[k], torch.Tensor) else carry[k]
                for k in self.in_keys)
        produced = dict(zip(self.out_keys, self.graph(*args)))
        return {k: produced[k] if k in produced else carry[k] for k in self.carry_keys}

    def retarget(self, device: torch.device) -> None:
        """Run on ``device``: ops that make tensors (``arange``, ``to``, metadata asserts) carry the device the model
        was captured on (the meta device, or the CPU it was built on), so they are pointed at the stage's."""
        changed = False
        for node in self.graph.graph.nodes:  # type: ignore[union-attr]
            args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
            kwargs = {k: device if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            self.graph.recompile()  # type: ignore[operator]

    def inference(self) -> GraphUnit:
        """This unit as eval mode runs it, over the same parameter objects. torch.export baked training mode into
        the graph, so ``.eval()`` changes nothing: here dropout becomes the identity, batch norm uses its running
        statistics, and in-place writes to buffers (``num_batches_tracked += 1``) are dropped."""
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(self.graph.graph, {}))  # type: ignore[union-attr, arg-type]
        for node in list(graph.nodes):
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            name = node.target.name()
            schema = node.target._schema
            if "dropout" in name:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
            elif name == "aten::batch_norm":
                node.args = (*node.args[:5], False, *node.args[6:])
            elif (schema.arguments and schema.arguments[0].alias_info is not None
                  and schema.arguments[0].alias_info.is_write and isinstance(node.args[0], torch.fx.Node)
                  and node.args[0].op == "get_attr"):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        return GraphUnit(torch.fx.GraphModule(self.graph, graph), self.in_keys, self.out_keys, self.carry_keys,
                         self.copy_keys)


def written_inputs(graph: nn.Module) -> set[str]:
    """The placeholders of ``graph`` that one of its ops writes in place (``add_``, ``relu_``: the schema says)."""
    found: set[str] = set()
    for node in graph.graph.nodes:  # type: ignore[union-attr]
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for arg, spec in zip(node.args, schema.arguments):
            if isinstance(arg, torch.fx.Node) and arg.op == "placeholder" and spec.alias_info is not None \
                    and spec.alias_info.is_write:
                found.add(arg.name)
    return found


def for_inference(unit: nn.Module) -> tuple[nn.Module, bool]:
    """What runs a unit in eval mode, and whether it must be put back into training mode afterwards."""
    if isinstance(unit, GraphUnit):
        return unit.inference(), False
    unit.eval()
    return unit, True
