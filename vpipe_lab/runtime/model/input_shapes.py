"""Which input shapes a captured graph takes: the model is exported with the dimensions of its inputs free to vary
(all of them, but an image's spatial sizes: ``free_dims``), torch.export keeps symbolic what the model's code lets
vary (batch size, sequence length) and specialises the rest, and a new micro-batch is checked against what it kept
before it runs.

The rule is the exported graph's own: each input dimension is a number (specialised: must be equal) or a symbol
(any value in the symbol's range; the same symbol means the same size, e.g. ``input_ids`` and ``attention_mask``
share the sequence length). As torch does when it checks an exported program's inputs, sizes 0 and 1 are allowed for
a symbol whose recorded lower bound is the default 2 (torch.export specialises an example's 0/1 sizes, so it records
2, yet the graph it traced does not depend on that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

SPATIAL_FROM = 4  # float inputs of this many dimensions or more are images or videos: their spatial sizes stay fixed


def free_dims(leaf: torch.Tensor) -> range:
    """The dimensions of an input tensor left to the model (``Dim.AUTO``): all of them (token ids, masks, sequences of
    features: a padding collator gives every batch its own length), except the spatial sizes of images and videos
    (float inputs of 4+ dimensions), of which only the batch is free. Symbolic spatial sizes cost minutes of torch's
    shape reasoning in windowed models (a tiny Swin's capture took 54 s with them, 1 s without) and are rarely
    wanted: an image of another size is captured again for it (``recapture.py``)."""
    if leaf.is_floating_point() and leaf.dim() >= SPATIAL_FROM:
        return range(1)
    return range(leaf.dim())


def dynamic_spec(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch.export's ``dynamic_shapes`` with the input dimensions ``free_dims`` says left to the model."""
    shapes = torch.export.ShapesCollection()
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            shapes[leaf] = {d: torch.export.Dim.AUTO for d in free_dims(leaf)}
    return shapes.dynamic_shapes(model, args, kwargs)


@dataclass
class InputRule:
    """What each flattened input of a captured graph must be: per tensor its dtype and per dimension a size or a
    symbol; per other value (a flag, None) the value itself."""

    slots: list[tuple[str, Any, Any]] = field(default_factory=list)  # ("tensor", dtype, dims) | ("value", value, None)
    ranges: dict[Any, tuple[int, float]] = field(default_factory=dict)  # symbol -> (lower, upper)

    @classmethod
    def of_graph(cls, graph_module: torch.fx.GraphModule, leaves: list[Any], ranges: dict[Any, Any]) -> InputRule:
        """The rule of an exported graph's inputs (its placeholders' fake values, in order) for the example ``leaves``
        it was captured on."""
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]  # one per flattened input
        slots: list[tuple[str, Any, Any]] = []
        for node, leaf in zip(placeholders, leaves):
            if isinstance(leaf, torch.Tensor):
                fake = node.meta.get("val")
                dims = tuple(_dim(d) for d in (fake.shape if isinstance(fake, torch.Tensor) else leaf.shape))
                slots.append(("tensor", leaf.dtype, dims))
            else:
                slots.append(("value", leaf, None))
        bounds = {}
        for symbol, window in ranges.items():
            upper = window.upper
            bounds[symbol] = (int(window.lower), float(upper) if upper.is_finite else float("inf"))
        return cls(slots, bounds)

    @classmethod
    def exactly(cls, leaves: list[Any]) -> InputRule:
        """A graph specialised to these inputs' shapes (captured without symbolic dimensions)."""
        return cls([("tensor", t.dtype, tuple(int(s) for s in t.shape)) if isinstance(t, torch.Tensor)
                    else ("value", t, None) for t in leaves])

    def problem(self, described: list[tuple[str, Any, Any]]) -> str | None:
        """Why inputs described as ``[("tensor", dtype, shape) | ("value", value, None)]`` do not fit; None if they do."""
        if len(described) != len(self.slots):
            return f"{len(described)} inputs, captured with {len(self.slots)}"
        bound: dict[Any, int] = {}
        for i, ((kind, what, dims), (got_kind, got, shape)) in enumerate(zip(self.slots, described)):
            if kind != got_kind:
                return f"input {i} is a {got_kind}, captured as a {kind}"
            if kind == "value":
                if got != what:
                    return f"input {i} is {got!r}, captured as {what!r}"
                continue
            if got != what:
                return f"input {i} has dtype {got}, captured as {what}"
            if len(shape) != len(dims):
                return f"input {i} has {len(shape)} dimensions, captured with {len(dims)}"
            for d, (size, rule) in enumerate(zip(shape, dims)):
                if isinstance(rule, int):
                    if size != rule:
                        return f"input {i} has size {size} in dimension {d}, where the graph is specialised to {rule}"
                    continue
                lower, upper = self.ranges.get(rule, (2, float("inf")))
                if size > upper or (size < lower and (lower > 2 or size > 1)):
                    return f"input {i} has size {size} in dimension {d}, outside the graph's range [{lower}, {upper}]"
                if bound.setdefault(rule, size) != size:
                    return f"input {i} has size {size} in dimension {d}, which the graph ties to a size of {bound[rule]}"
        return None


def _dim(size: Any) -> Any:
    """A dimension of an exported placeholder: an int (specialised), or the symbol it is (sympy)."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    return int(expr) if expr.is_number else expr


def describe_leaves(leaves: list[Any]) -> list[tuple[str, Any, Any]]:
    """What ``InputRule.problem`` reads of actual inputs."""
    return [("tensor", t.dtype, tuple(int(s) for s in t.shape)) if isinstance(t, torch.Tensor) else ("value", t, None)
            for t in leaves]
