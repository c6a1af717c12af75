"""A profile at another micro-batch size: time from measured points, memory in proportion.

A layer's time is not linear in the micro-batch size: small micro-batches leave the hardware idle (kernel launches,
thin matrix products), so a sample costs less on a larger micro-batch until the device saturates. vPipe's gains come
from exactly that: by swapping and recomputing per layer it fits larger micro-batches. A profile measured at
``microbatch_size`` with extra points in each layer's ``times`` is rescaled here: forward and backward times are
interpolated linearly between measured sizes; above the largest the per-sample time of the largest is used (no
efficiency gain is invented beyond what was measured); below the smallest the line through the two smallest points
is extended (a micro-batch keeps its fixed cost: launches, transfers, Python), between the proportional time and the
smallest point's own time. Activation, recompute-input and boundary bytes are
proportional to the micro-batch size; parameters and optimizer state do not change.
"""

from __future__ import annotations

from vpipe_lab.core import checks
from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.profile import LayerCost, ModelProfile


def _time(points: list[tuple[int, float]], size: int) -> float:
    """Seconds at ``size`` from (size, seconds) points sorted by size."""
    lo_size, lo_t = points[0]
    if size <= lo_size:
        linear = lo_t * size / lo_size
        if len(points) < 2:
            return linear
        # Below the smallest measured size the fixed per-micro-batch cost stays: extend the line through the two
        # smallest points, between the proportional time (no fixed cost) and the smallest point's own time.
        (s1, t1), (s2, t2) = points[0], points[1]
        affine = t1 - (s1 - size) * (t2 - t1) / (s2 - s1)
        return min(lo_t, max(linear, affine))
    for hi_size, hi_t in points[1:]:
        if size <= hi_size:
            w = (size - lo_size) / (hi_size - lo_size)
            return lo_t + w * (hi_t - lo_t)
        lo_size, lo_t = hi_size, hi_t
    return lo_t * size / lo_size


def layer_at(layer: LayerCost, reference: int, size: int) -> LayerCost:
    """``layer`` (costs per micro-batch of ``reference`` samples) at micro-batch size ``size``."""
    measured = {reference: (layer.forward_s, layer.backward_s)}
    for b, f, w in layer.times:
        measured.setdefault(b, (f, w))
    sizes = sorted(measured)
    fwd = _time([(b, measured[b][0]) for b in sizes], size)
    bwd = _time([(b, measured[b][1]) for b in sizes], size)
    scale = size / reference
    return LayerCost(layer.name, fwd, bwd, round(layer.activation_bytes * scale), round(layer.input_bytes * scale),
                     round(layer.output_bytes * scale), layer.param_bytes, layer.optimizer_bytes,
                     tuple((b, *measured[b]) for b in sizes),
                     # the weight step keeps its measured share of the backward at the new size
                     None if layer.weight_grad_s is None or layer.backward_s <= 0
                     else bwd * layer.weight_grad_s / layer.backward_s,
                     round(layer.transient_bytes * scale), layer.step_bytes)


def at(profile: ModelProfile, size: int) -> ModelProfile:
    """``profile`` rescaled to micro-batches of ``size`` samples."""
    checks.count(size, "a micro-batch size", error=ProfileError)
    reference = profile.microbatch_size
    if reference < 1:
        raise ProfileError(f"profile {profile.name or '(unnamed)'} does not say at which micro-batch size it was "
                           "measured (microbatch_size), so it cannot be rescaled: profile a running session "
                           "(Session.profile() records it) or set ModelProfile.microbatch_size")
    if size == reference:
        return profile
    return ModelProfile(tuple(layer_at(layer, reference, size) for layer in profile.layers), profile.name, size,
                        profile.source, profile.shared)  # a parameter's bytes do not scale with the micro-batch


def throughput_curve(profile: ModelProfile, sizes: list[int]) -> list[tuple[int, float]]:
    """(micro-batch size, samples per second of the whole model's forward and backward on one device): the
    efficiency curve the planner sees."""
    out = []
    for size in sizes:
        scaled = at(profile, size)
        seconds = sum(layer.forward_s + layer.backward_s for layer in scaled.layers)
        out.append((size, size / seconds if seconds > 0 else float("inf")))
    return out


def measured_sizes(profile: ModelProfile) -> list[int]:
    """Every micro-batch size some layer was measured at."""
    sizes = {profile.microbatch_size} if profile.microbatch_size else set()
    for layer in profile.layers:
        sizes.update(b for b, _, _ in layer.times)
    return sorted(sizes)
