"""Mixture-of-experts layers in a captured model, and the tokens each of their experts receives.

An MoE layer is a module with a child called ``experts`` (transformers' Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3,
GPT-OSS, Llama 4, ...; a ``ModuleList``/``ModuleDict`` of experts, or one module holding them stacked in 3-D weights).
Its router is the last ``topk`` (else ``argmax``) inside it over a last dimension of the expert count: the indices it
picks are the experts each token goes to (DeepSeek's group top-k, over groups, is passed over). ``instrument`` adds,
after that node of the captured unit graph, a call that counts the picks per expert into device tensors; nothing is
read back until the iteration ends (``take``), so a GPU is not synchronised mid-iteration. Only a training forward
counts (``counting``): a recompute's second forward, a micro-batch-size probe and evaluation passes do not.

Where the layer declares a capacity (``expert_capacity`` on it or its router, as Switch Transformer's), tokens an
expert receives beyond it are dropped: per sequence where the router picks over ``[batch, sequence]`` (Switch
ranks tokens by their position within each sequence), per micro-batch where it picks over a flat list of tokens.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MoeLayer", "Tally", "counting", "find", "instrument", "take", "tally"]


@dataclass(frozen=True)
class MoeLayer:
    """One mixture-of-experts layer: its module path, expert count, experts per token and capacity (None: none)."""

    module: str
    experts: int
    top_k: int = 1
    capacity: int | None = None
    unit: int = -1  # the partition unit it runs in (``instrument`` sets it)


def _expert_count(experts: nn.Module) -> int | None:
    count = getattr(experts, "num_experts", None)
    if isinstance(count, int) and count > 0:
        return count
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)) and len(experts) > 0:
        return len(experts)
    stacked = [p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3]
    return stacked[0] if stacked else None


def find(model: nn.Module) -> dict[str, tuple[int, int | None]]:
    """Module path -> (expert count, capacity) of every MoE layer of ``model`` (module docstring)."""
    found: dict[str, tuple[int, int | None]] = {}
    for path, module in model.named_modules():
        experts = module._modules.get("experts")
        if experts is None:
            continue
        count = _expert_count(experts)
        if count is None:
            continue
        capacity = next((c for m in module.modules() if isinstance(c := getattr(m, "expert_capacity", None), int)
                         and not isinstance(c, bool)), None)
        found[path] = (count, capacity)
    return found


def _inside(node: torch.fx.Node, path: str) -> bool:
    return any(value[0] == path for value in (node.meta.get("nn_module_stack") or {}).values())


def _last_dim(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dim() > 0:
        size = val.shape[-1]
        return size if isinstance(size, int) else None
    return None


def instrument(units: list[nn.Module], layers: dict[str, tuple[int, int | None]]) -> list[MoeLayer]:
    """Add the counting call after each MoE layer's router in the unit graphs that run it; returns the layers
    found, in order (a layer whose router is not found is left out)."""
    out: list[MoeLayer] = []
    for index, unit in enumerate(units):
        gm = getattr(unit, "graph", None)
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        changed = False
        for path, (count, capacity) in layers.items():
            picks = [n for n in gm.graph.nodes if n.op == "call_function" and _inside(n, path)
                     and str(n.target) in ("aten.topk.default", "aten.argmax.default")
                     and _last_dim(n.args[0]) == count]
            if not picks:
                continue
            pick = picks[-1]
            topk = str(pick.target) == "aten.topk.default"
            k = int(pick.args[1]) if topk else 1
            with gm.graph.inserting_after(pick):
                indices = gm.graph.call_function(operator.getitem, (pick, 1)) if topk else pick
            with gm.graph.inserting_after(indices):
                gm.graph.call_function(tally, (indices, path, count, capacity, topk))
            changed = True
            out.append(MoeLayer(path, count, k, capacity, index))
        if changed:
            gm.recompile()
    return out


class Tally:
    """This process's counts since the last ``take``: layer -> tokens per expert, and tokens dropped."""

    def __init__(self) -> None:
        self.active = False
        self.tokens: dict[str, torch.Tensor] = {}
        self.dropped: dict[str, torch.Tensor] = {}


TALLY = Tally()


@contextmanager
def counting() -> Iterator[None]:
    """Count the picks of the forwards run inside (a training forward; not its recompute, probes or evaluation)."""
    before, TALLY.active = TALLY.active, True
    try:
        yield
    finally:
        TALLY.active = before


def tally(indices: torch.Tensor, layer: str, experts: int, capacity: int | None, flat_k: bool) -> None:
    """Called from the graph with a router's picks: ``[..., k]`` expert indices from a top-k (``flat_k``), else
    ``[...]`` from an argmax."""
    if not TALLY.active:
        return
    with torch.no_grad():
        picks = indices.detach()
        if capacity is None:  # the common case, in one or two ops: a router's picks are always below the count
            flat = picks.reshape(-1).long()
            if flat.device.type == "cpu":
                counts = torch.bincount(flat, minlength=experts)
            else:  # bincount sizes its output from the largest pick, which would synchronise the GPU
                counts = torch.zeros(experts, dtype=torch.long, device=flat.device).index_add_(
                    0, flat, torch.ones_like(flat))
            total = TALLY.tokens.get(layer)
            TALLY.tokens[layer] = counts if total is None else total.add_(counts)
            return
        # groups a capacity applies to: each sequence of a [batch, sequence(, k)] pick, else the whole micro-batch
        grouped = picks.dim() >= (3 if flat_k else 2)
        rows = (picks.reshape(picks.shape[0], -1) if grouped else picks.reshape(1, -1)).long()
        counts = torch.zeros(rows.shape[0], experts, dtype=torch.long, device=rows.device)
        counts.scatter_add_(1, rows, torch.ones_like(rows))
        got = counts.clamp(max=capacity).sum(0)
        over = (counts - capacity).clamp(min=0).sum(0)
        total, dropped = TALLY.tokens.get(layer), TALLY.dropped.get(layer)
        TALLY.tokens[layer] = got if total is None else total.add_(got)
        TALLY.dropped[layer] = over if dropped is None else dropped.add_(over)


def take() -> dict[str, dict[str, Any]]:
    """Everything counted since the last call, read back once (one copy to the host): layer -> {"tokens": [per
    expert], "dropped": [per expert] or None (no capacity)}; and start again."""
    tokens, dropped = TALLY.tokens, TALLY.dropped
    TALLY.tokens, TALLY.dropped = {}, {}
    if not tokens:
        return {}
    names = list(tokens)
    parts = [tokens[n] for n in names] + [dropped[n] for n in names if n in dropped]
    flat = [int(x) for x in torch.cat(parts).cpu()]
    out: dict[str, dict[str, Any]] = {}
    offset = 0
    for n in names:
        size = tokens[n].numel()
        out[n] = {"tokens": flat[offset:offset + size], "dropped": None}
        offset += size
    for n in names:
        if n in dropped:
            size = dropped[n].numel()
            out[n]["dropped"] = flat[offset:offset + size]
            offset += size
    return out
