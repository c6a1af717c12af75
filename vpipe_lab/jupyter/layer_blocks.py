"""The editor's layer blocks: each layer's share of the bar, moved only part of the way toward each re-measure."""

from __future__ import annotations

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
