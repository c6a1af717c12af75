"""The editor's layer blocks: each layer's share of the bar, moved only part of the way toward each re-measure."""

from __future__ import annotations

from typing import Any

from vpipe_lab.core.profile import ModelProfile

EASE = 0.35  # how far one re-measure moves a block's width toward its new share


def steady_weights(previous: list[float] | None, measured: list[float]) -> list[float]:
    """Each block's share of the bar. A re-measure (after every Apply) moves the shares only part of the way toward
    the new measurement, so the scale the user drags on does not jump (the front end eases each step in); a model
    with another number of units starts over."""
    total = sum(max(0.0, m) for m in measured)
    shares = [max(0.0, m) / total for m in measured] if total > 0 else [1.0 / max(1, len(measured))] * len(measured)
    if previous is None or len(previous) != len(shares):
        return shares
    return [p + EASE * (s - p) for p, s in zip(previous, shares)]


def block_docs(profile: ModelProfile, previous: list[float] | None) -> tuple[list[dict[str, Any]], list[float]]:
    """Each layer's block as the editor's ``layers`` trait holds it, and the shares drawn: by measured time (by
    parameters before anything was measured), eased from ``previous`` (``steady_weights``)."""
    measured = [x.forward_s + x.backward_s for x in profile.layers]
    if not any(measured):  # nothing measured yet: size blocks by parameters instead of time
        measured = [float(x.param_bytes) for x in profile.layers]
    weights = steady_weights(previous, measured)
    return [{"name": x.name, "weight": w, "forward_ms": 1e3 * x.forward_s, "backward_ms": 1e3 * x.backward_s,
             "activation_bytes": float(x.activation_bytes)} for x, w in zip(profile.layers, weights)], weights
