"""`%vpipe plan --devices N` over a job's measured profile and batch: the chosen mesh printed beside the meshes tried
and the fastest pipeline of whole devices, with how to run it; never applied (a new mesh needs a restart)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError

from vpipe_lab.core import workloads
from vpipe_lab.core.cost.scaling import at
from vpipe_lab.core.plan import Plan
from vpipe_lab.jupyter.mesh_command import plan_mesh


def job(memory: int) -> SimpleNamespace:
    """A running job as the command reads it: gpt-cpm-large measured at 4 samples a micro-batch, 2 stages x 2
    shards, 8 micro-batches (a global batch of 4 x 8 x 2 = 64)."""
    profile = at(workloads.workload("gpt-cpm-large", device="h200"), 4)
    plan = Plan((0, 33, 66), ("keep",) * 66, 8, shards=2)
    return SimpleNamespace(newest_profile=lambda: profile, plan=plan,
                           cluster=lambda: workloads.cluster("h200", 2, memory_bytes=memory))


def args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"devices": 8, "memory": None, "apply": False, "method": "vpipe", "schedule": None,
                                 **kw})


def test_the_mesh_for_n_devices_is_printed_with_how_to_run_it(capsys: pytest.CaptureFixture[str]) -> None:
    found = plan_mesh(job(6 << 30), args())
    said = capsys.readouterr().out
    assert found.result.plan.devices == 8 and found.result.estimate.feasible
    assert "meshes (stages x shards x replicas), fastest first: " in said and "for a batch of 64" in said
    assert "no pipeline of whole devices fits" in said and f"shards={found.result.plan.shards}" in said
    assert "resume=path" in said
    bigger = plan_mesh(job(6 << 30), args(memory=80 << 30))  # --memory: more per device, whole stages fit too
    assert bigger.pipeline_only is not None


def test_apply_is_refused_and_an_unmeasured_job_says_so() -> None:
    with pytest.raises(UsageError, match="drop --apply"):
        plan_mesh(job(6 << 30), args(apply=True))
    fresh = job(6 << 30)
    fresh.newest_profile = lambda: workloads.workload("gpt-cpm-large", device="h200").__class__(
        workloads.workload("gpt-cpm-large", device="h200").layers)
    with pytest.raises(UsageError, match="no iteration has run yet"):
        plan_mesh(fresh, args())
