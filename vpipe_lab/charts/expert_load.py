"""The experts' load as a heatmap: mixture-of-experts layers by experts, each cell the share of the layer's token
picks its expert received over the last iterations (1/E everywhere would be a perfectly balanced layer).

Bounded like the other panels: at most ``MAX_LAYERS`` x ``MAX_EXPERTS`` cells are drawn (DeepSeek-V3 has 58 MoE layers
of 256 experts); beyond that, neighbouring experts are summed into one column ("experts 0-7") and neighbouring
layers into one row, so the figure's size stays the same whatever the model. Shares are rounded to 4 digits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Fig = dict[str, Any]
MAX_LAYERS, MAX_EXPERTS = 64, 64
TITLE = "experts' load (share of each layer's tokens)"


def load_matrix(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[int], list[list[int]], list[int]]:
    """Layers in the order the model runs them, their stages, tokens per expert summed over ``rows``
    (``Metrics.expert_records``) and dropped tokens per layer."""
    layers: dict[str, list[int]] = {}
    stages: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for r in rows:
        name = str(r["layer"])
        got = layers.setdefault(name, [0] * len(r["tokens"]))
        layers[name] = [a + b for a, b in zip(got, r["tokens"])] if len(got) == len(r["tokens"]) else list(r["tokens"])
        stages[name] = int(r["stage"])
        if r.get("dropped") is not None:
            dropped[name] = dropped.get(name, 0) + sum(r["dropped"])
    names = list(layers)
    return names, [stages[n] for n in names], [layers[n] for n in names], [dropped.get(n, 0) for n in names]


def _bins(count: int, most: int) -> list[tuple[int, int]]:
    """``count`` items in at most ``most`` consecutive bins of equal width (the last may be shorter)."""
    width = -(-count // most)
    return [(lo, min(lo + width, count)) for lo in range(0, count, width)]


def experts_spec(rows: Sequence[Mapping[str, Any]], *, title: str = TITLE) -> Fig:
    """The heatmap of ``rows`` (an empty figure, with no traces, for a model without MoE layers)."""
    names, stages, tokens, dropped = load_matrix(rows)
    layout: dict[str, Any] = {"title": {"text": title}, "height": 330, "autosize": True, "uirevision": "experts",
                              "margin": {"l": 56, "r": 16, "t": 40, "b": 48},
                              "xaxis": {"title": {"text": "expert"}, "automargin": True},
                              "yaxis": {"automargin": True, "autorange": "reversed"}}
    if not names:
        return {"data": [], "layout": layout}
    experts = max(len(t) for t in tokens)
    columns = _bins(experts, MAX_EXPERTS)
    groups = _bins(len(names), MAX_LAYERS)
    z, labels, text = [], [], []
    for lo, hi in groups:
        row = [sum(sum(tokens[i][c0:c1]) for i in range(lo, hi)) for c0, c1 in columns]
        total = sum(row) or 1
        z.append([round(v / total, 4) for v in row])
        lost = sum(dropped[lo:hi])
        label = names[lo] if hi - lo == 1 else f"{names[lo]} .. {names[hi - 1]}"
        labels.append(f"{label} (stage {stages[lo]})")
        text.append([f"{v} tokens" + (f"; {lost} dropped in the layer" if lost else "") for v in row])
    xs = [str(c0) if c1 - c0 == 1 else f"{c0}-{c1 - 1}" for c0, c1 in columns]
    heat = {"type": "heatmap", "z": z, "x": xs, "y": labels, "text": text, "colorscale": "Viridis", "zmin": 0,
            "hovertemplate": "%{y}<br>expert %{x}: %{z:.1%} of the picks, %{text}<extra></extra>",
            "colorbar": {"title": {"text": "share"}, "tickformat": ".0%", "thickness": 12}}
    layout["xaxis"]["type"] = "category"
    layout["height"] = max(330, 120 + 22 * len(labels))
    return {"data": [heat], "layout": layout}
