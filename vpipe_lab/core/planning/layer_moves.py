"""Layer moves between two partitions, the bytes they carry and how long the transfer takes under the cost model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vpipe_lab.core.profile import Cluster, ModelProfile


@dataclass(frozen=True, order=True)
class LayerMove:
    """Layer ``layer`` leaves stage ``src`` for stage ``dst``."""

    layer: int
    src: int
    dst: int

    def __str__(self) -> str:
        return f"layer {self.layer}: stage {self.src} -> {self.dst}"


def owners(boundaries: Sequence[int], stages: int | None = None, placement: Sequence[int] = ()) -> list[int]:
    """The stage of every layer; with ``stages`` the boundaries may cut chunks (virtual stages), chunk ``c`` on stage
    ``placement[c]`` when given (``Plan.placement``: ZBV's V), else ``c % stages`` (looped)."""
    out: list[int] = []
    for c in range(len(boundaries) - 1):
        where = placement[c] if placement else c % stages if stages else c
        out.extend([where] * (boundaries[c + 1] - boundaries[c]))
    return out


def layer_moves(old: Sequence[int], new: Sequence[int], stages: int | None = None,
                placements: tuple[Sequence[int], Sequence[int]] = ((), ())) -> tuple[LayerMove, ...]:
    """Every layer whose stage differs between two partitions of the same layers and stages (``stages``: the
    partitions cut chunks, as many per stage as each says, possibly different; ``placements``: the old and the new
    plan's stage of each chunk, where not looped)."""
    same = len(old) == len(new) if stages is None else (len(old) - 1) % stages == (len(new) - 1) % stages == 0
    if old[-1] != new[-1] or not same:
        raise ValueError(
            f"partitions {list(old)} and {list(new)} differ in layers or stages; migration moves layers between the "
            "same stages, so both need the same first and last boundary and the same number of stages"
        )
    was, now = owners(old, stages, placements[0]), owners(new, stages, placements[1])
    return tuple(LayerMove(i, a, b) for i, (a, b) in enumerate(zip(was, now)) if a != b)


def moved_bytes(moves: Sequence[LayerMove], profile: ModelProfile) -> int:
    """Parameters and optimizer state of the moving layers; gradients are zero at an iteration boundary."""
    return sum(profile.layers[m.layer].param_bytes + profile.layers[m.layer].optimizer_bytes for m in moves)


def migration_time_s(moves: Sequence[LayerMove], profile: ModelProfile, cluster: Cluster) -> float:
    """Transfer time if every stage sends and receives at link bandwidth, all stages at once."""
    if not moves:
        return 0.0
    load: dict[int, int] = {}
    for m in moves:
        size = profile.layers[m.layer].param_bytes + profile.layers[m.layer].optimizer_bytes
        load[m.src] = load.get(m.src, 0) + size
        load[m.dst] = load.get(m.dst, 0) + size
    pairs = {(m.src, m.dst) for m in moves}
    return cluster.link_latency_s * len(pairs) + max(load.values()) / cluster.link_bandwidth


def match_layers(old: Sequence[str], new: Sequence[str]) -> dict[int, int | None]:
    """For each layer of a changed model, the old layer whose state it keeps (None: a new layer).

    Layers are matched by signature (e.g. class and parameter shapes) along a longest common subsequence, so layers
    inserted, removed or replaced anywhere leave every other layer matched to itself, in order.
    """
    n, m = len(old), len(new)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best[i][j] = best[i + 1][j + 1] + 1 if old[i] == new[j] else max(best[i + 1][j], best[i][j + 1])
    mapping: dict[int, int | None] = dict.fromkeys(range(m))
    i = j = 0
    while i < n and j < m:
        if old[i] == new[j]:
            mapping[j] = i
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return mapping
