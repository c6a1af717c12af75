"""Sharded stages planned: each stage's sharding chosen around the planner's search, and N devices split into
stages x shards x replicas for a global batch, fastest by the cost model (standard library only)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vpipe_lab.core import checks
from vpipe_lab.core.cost import scaling
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.shared_bytes import SharedBytes
from vpipe_lab.core.errors import InfeasiblePlan, PlanError
from vpipe_lab.core.planning.planner import PlanResult, _fastest, search
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.report import mesh_words
from vpipe_lab.core.sharding import Sharding

Shape = tuple[int, int, int]  # stages, shards, replicas


@dataclass(frozen=True, repr=False)
class MeshResult:
    """The fastest plan over every mesh tried (``result.plan`` carries its stages, shards and replicas), each mesh's
    iteration time (None: nothing fit), and the fastest pipeline of whole devices (shards = 1), if any fit."""

    result: PlanResult
    tried: tuple[tuple[Shape, float | None], ...]
    pipeline_only: PlanResult | None

    @property
    def shape(self) -> Shape:
        plan = self.result.plan
        return plan.stages, plan.shards, plan.replicas

    def __repr__(self) -> str:  # a notebook shows it: the choice in a line, not every plan tried in full
        fit = sum(t is not None for _, t in self.tried)
        whole = (f"{self.pipeline_only.estimate.iteration_s * 1e3:.2f} ms" if self.pipeline_only is not None
                 else "none fits")
        return (f"MeshResult({mesh_words(*self.shape)}: {self.result.estimate.iteration_s * 1e3:.2f} ms per "
                f"iteration; {fit} of {len(self.tried)} meshes fit; best pipeline of whole devices: {whole})")


def search_sharded(profile: ModelProfile, cluster: Cluster, *, shards: int, replicas: int = 1,
                   **options: Any) -> PlanResult:
    """``planner.search`` on ``shards`` ranks per stage (and ``replicas``) choosing each stage's sharding too: every
    sharding on every stage, each a whole search of the partition, policies and micro-batch count; then, stage by
    stage, another sharding wherever the estimate is faster and still fits. Not proven optimal across shardings."""
    checks.count(shards, "shards", error=PlanError)
    checks.count(replicas, "replicas", error=PlanError)
    if shards == 1:
        return search(profile, cluster, mesh=(1, replicas, ()), **options)
    modes = options.pop("shardings", tuple(Sharding))
    best, _, closest = _fastest(
        (mode, functools.partial(search, profile, cluster, mesh=(shards, replicas, (mode,) * cluster.stages),
                                 **options)) for mode in modes)
    if best is None:
        assert closest is not None
        raise InfeasiblePlan(f"no sharding of {shards} ranks per stage fits: {closest}", stage=closest.stage,
                             missing_bytes=closest.missing_bytes, suggestions=closest.suggestions)
    return refine(best, profile, cluster, modes)


def refine(found: PlanResult, profile: ModelProfile, cluster: Cluster,
           modes: Sequence[Sharding] = tuple(Sharding)) -> PlanResult:
    """Each stage's sharding changed, one stage at a time, where the estimate is faster and every stage fits."""
    plan, est = found.plan, found.estimate
    at = scaling.at(profile, found.microbatch_size) if found.microbatch_size else profile
    chosen = [plan.sharding_of(s) for s in range(plan.stages)]
    for s in range(plan.stages):
        for mode in modes:
            if mode is chosen[s]:
                continue
            trial = plan.with_mesh(sharding=[*chosen[:s], mode, *chosen[s + 1:]])
            got = estimate(trial, at, cluster)
            if got.feasible and got.iteration_s < est.iteration_s:
                plan, est, chosen[s] = trial, got, mode
    return replace(found, plan=plan, estimate=est, proven_optimal=False)


def shapes(devices: int, layers: int, batch_size: int) -> list[Shape]:
    """Every (stages, shards, replicas) over exactly ``devices`` with a stage per layer at most and the batch
    splitting evenly over shards x replicas."""
    checks.count(devices, "devices", error=PlanError)
    out = []
    for stages in range(1, min(devices, layers) + 1):
        if devices % stages:
            continue
        rest = devices // stages
        out += [(stages, shards, rest // shards) for shards in range(1, rest + 1)
                if rest % shards == 0 and batch_size % rest == 0]
    return out


def choose(profile: ModelProfile, cluster_of: Cluster | Callable[[int], Cluster], *, devices: int, batch_size: int,
           shapes_to_try: Sequence[Shape] | None = None, **options: Any) -> MeshResult:
    """The fastest plan of ``devices`` devices for a global batch of ``batch_size``, over every mesh ``shapes``
    allows (or ``shapes_to_try``): each runs ``batch_size / (shards x replicas)`` samples per pipeline in the
    micro-batch count the planner chooses, on ``cluster_of(stages)`` (a Cluster: its device, its first stage's
    budget, any number of them), its stages' sharding chosen by ``search_sharded``. A pipeline of whole devices is
    among the meshes, so the choice is never slower by the cost model than the best one."""
    checks.count(batch_size, "batch_size", error=PlanError)
    if isinstance(cluster_of, Cluster):
        device = cluster_of
        cluster_of = lambda stages: replace(device, stages=stages, memory_bytes=device.budgets[0])
    candidates = list(shapes_to_try) if shapes_to_try is not None else shapes(devices, len(profile), batch_size)
    if not candidates:
        raise PlanError(f"no mesh of {devices} devices splits a batch of {batch_size} evenly over its data-parallel "
                        "ranks: give a batch size with more divisors, or another device count")
    tried: list[tuple[Shape, float | None]] = []
    best: PlanResult | None = None
    whole: PlanResult | None = None
    closest: InfeasiblePlan | None = None
    # every rank holds at least its share of the model's static bytes (a tie counted once)
    static = sum(layer.static_bytes for layer in profile.layers) - SharedBytes(profile.shared).extra(0, len(profile))[0]
    for stages, shards, replicas in candidates:
        if static / (stages * shards) > min(cluster_of(stages).budgets):
            tried.append(((stages, shards, replicas), None))  # its static bytes alone are over every budget
            continue
        try:
            found = search_sharded(profile, cluster_of(stages), shards=shards, replicas=replicas,
                                   batch_size=batch_size // (shards * replicas), **options)
        except InfeasiblePlan as exc:
            tried.append(((stages, shards, replicas), None))
            closest = exc if closest is None or exc.missing_bytes < closest.missing_bytes else closest
            continue
        except PlanError:  # fewer layers than stages, a schedule that needs more micro-batches: not this mesh
            tried.append(((stages, shards, replicas), None))
            continue
        tried.append(((stages, shards, replicas), found.estimate.iteration_s))
        if best is None or found.estimate.iteration_s < best.estimate.iteration_s:
            best = found
        if shards == 1 and (whole is None or found.estimate.iteration_s < whole.estimate.iteration_s):
            whole = found
    if best is None:
        detail = f": the closest, {closest}" if closest is not None else ""
        raise InfeasiblePlan(f"no mesh of {devices} devices fits a batch of {batch_size}{detail}",
                             stage=closest.stage if closest else 0,
                             missing_bytes=closest.missing_bytes if closest else 0,
                             suggestions=closest.suggestions if closest else ())
    return MeshResult(best, tuple(tried), whole)
