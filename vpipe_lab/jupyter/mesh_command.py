"""`%vpipe plan --devices N`: stages x shards x replicas for N devices, from the running job's measured profile and
its global batch (core/planning/mesh.py); a new mesh runs after a restart, so it is shown, never applied."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from IPython.core.error import UsageError

from vpipe_lab.core.planning.mesh import choose as choose_mesh
from vpipe_lab.core.report import human_time, mesh_words, plan_table


def plan_mesh(s: Any, args: argparse.Namespace) -> Any:
    """``%vpipe plan --devices N``: the mesh for N devices, from the running job's measured profile and batch."""
    if args.apply:
        raise UsageError("--devices chooses a new mesh, which runs after a restart: drop --apply, then save and "
                         "launch on it (the printout says how)")
    profile = s.newest_profile()
    if not profile.microbatch_size:
        raise UsageError("no iteration has run yet, so the batch is not known: run a few iterations first")
    cluster = s.cluster()
    if args.memory is not None:
        cluster = replace(cluster, memory_bytes=args.memory)
    batch = profile.microbatch_size * s.plan.microbatches * s.plan.data_parallel
    found = choose_mesh(profile, cluster, devices=args.devices, batch_size=batch, method=args.method,
                        schedule=args.schedule or s.plan.schedule)
    plan, est = found.result.plan, found.result.estimate
    ranked = sorted((t, shape) for shape, t in found.tried if t is not None)
    print("meshes (stages x shards x replicas), fastest first: "
          + ", ".join(f"{a}x{b}x{c}: {human_time(t)}" for t, (a, b, c) in ranked[:6]))
    print(plan_table(plan, est))
    whole = found.pipeline_only
    print(f"chosen {mesh_words(*found.shape)} for a batch of {batch}"
          + (f"; the fastest pipeline of whole devices: {human_time(whole.estimate.iteration_s)}" if whole else
             "; no pipeline of whole devices fits")
          + f". To run it: session.save(path), then launch(..., stages={plan.stages}, shards={plan.shards}, "
          f"replicas={plan.replicas}, plan=<this plan>, resume=path)")
    return found
