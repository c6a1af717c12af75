"""How a unit recomputes the symbolic sizes (batch size, sequence length) earlier units computed, so that only
tensors cross stage boundaries (``capture.py`` cuts the graph; this is the part that reads sizes off tensors)."""

from __future__ import annotations

import torch

from vpipe_lab.runtime.model.trace.problems import CaptureError


def is_size(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat))


def size_recipes(unit: int, needed: list[torch.fx.Node], reads: list[torch.fx.Node]
                  ) -> list[tuple[torch.fx.Node, torch.fx.Node | None, int]]:
    """How a unit recomputes the sizes (symbolic batch size, sequence length) that earlier units computed, so that
    only tensors cross stage boundaries: a size is read off a tensor the unit already receives whose shape has it
    (the hidden state carries batch and length), else off the tensor it was measured on (which the unit then
    receives too); a size computed from sizes is computed again. Returns (size node, tensor or None to copy the
    node, dimension) in graph order; ``reads`` may grow."""
    found: dict[torch.fx.Node, tuple[torch.fx.Node | None, int]] = {}

    def visit(node: torch.fx.Node) -> None:
        if node in found:
            return
        if node.target is torch.ops.aten.sym_size.int:
            expr = node.meta["val"].node.expr
            for tensor in reads:
                val = tensor.meta.get("val")
                for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
                    if isinstance(size, torch.SymInt) and size.node.expr == expr:
                        found[node] = (tensor, d)
                        return
            source = node.args[0]
            assert isinstance(source, torch.fx.Node)
            if source not in reads:
                reads.append(source)
            found[node] = (source, int(node.args[1]))  # type: ignore[arg-type]
            return
        inputs = node.all_input_nodes
        if not all(is_size(i) for i in inputs):
            raise CaptureError(f"size {node.name!r} of a later unit ({unit}) is computed from tensors of an earlier one; "
                               "split the model elsewhere")
        for i in inputs:
            visit(i)
        found[node] = (None, 0)

    for node in needed:
        visit(node)
    order = {n: i for i, n in enumerate(next(iter(found)).graph.nodes)} if found else {}
    return [(n, *found[n]) for n in sorted(found, key=order.__getitem__)]
