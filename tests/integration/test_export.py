"""Plans taken out of the lab: an exported bundle trained by torch.distributed.pipelining on 2 CPU ranks, from the
bundle alone, equals the lab's run of the same plan (losses, every parameter and buffer), and torch runs exactly the
lab's compute order, whether its own schedule class or the bundle's CSV drives it (torchtitan's schedule builder
reading the bundle's ``torchtitan.toml`` included)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import vpipe_lab
from tests.integration import torch_jobs
from tests.runtime import reference
from vpipe_lab import Plan
from vpipe_lab.core.interop import torch_schedules
from vpipe_lab.wire import bundle_files

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def fork_server() -> Iterator[None]:
    """The torch ranks of every test here fork from one server (``torch_jobs.run``), ended with the module."""
    yield
    torch_jobs.stop_fork_server()

# The four plans, and DualPipeV, on the MLP (no dropout: torch and the lab seed dropout differently), 2 ranks,
# 4 micro-batches.
PLANS = {
    "1f1b-recompute": Plan((0, 4, 10), tuple("kkrkkkkkkk"), 4, "1f1b"),  # torch's 1F1B class runs it
    "interleaved": Plan((0, 2, 5, 7, 10), tuple("kkkskkkkkk"), 4, "interleaved-1f1b", 2),  # its Interleaved1F1B
    "zb-h1": Plan((0, 4, 10), tuple("kkkkkrkkkk"), 4, "zb-h1"),  # no class runs the lab's ZB-H1 at M=4: the CSV
    "zbv": Plan((0, 2, 5, 7, 10), tuple("k" * 10), 4, "zbv", 2),  # its ZBVZeroBubble
    "dualpipev": Plan((0, 2, 5, 7, 10), tuple("kkkkkkrkkk"), 4, "dualpipev", 2),  # its DualPipeV (overlapped pairs)
}


def lab_run(plan: Plan, bundle: Path, iterations: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, schedule=plan.schedule, plan=plan, device="cpu",
                          virtual_stages=plan.virtual_stages, timeout=60) as session:
        session.run(iterations)
        session.wait(timeout=120)
        session.export_plan(bundle)
        return list(session.metrics.iterations["loss"]), session.state_dict()


def test_exported_plans_train_on_torch_as_in_the_lab(tmp_path: Path) -> None:
    lab = {name: lab_run(plan, tmp_path / name) for name, plan in PLANS.items()}
    assert [bundle_files.read(tmp_path / n).schedule for n in PLANS] == ["1F1B", "Interleaved1F1B", None,
                                                                        "ZBVZeroBubble", "DualPipeV"]
    # two iterations each: the second shows the optimizer's step and the schedule's order repeat as in the lab
    jobs = [torch_jobs.Job(str(tmp_path / name), iterations=2) for name in PLANS]
    jobs += [torch_jobs.Job(str(tmp_path / "1f1b-recompute"), iterations=2, use_csv=True),  # the CSV beside a class
             torch_jobs.Job(str(tmp_path / "zb-h1"), iterations=2, torchtitan=True),  # torchtitan's builder, its toml
             torch_jobs.Job(str(tmp_path / "zbv"), iterations=2, torchtitan=True)]
    results = torch_jobs.run(jobs, tmp_path)
    for job, got in zip(jobs, results):
        name = Path(job.bundle).name
        losses, state = lab[name]
        assert got.losses == pytest.approx(losses, rel=1e-5), job
        assert set(got.state) == set(state), job
        for key, value in state.items():
            torch.testing.assert_close(got.state[key], value, msg=lambda m, key=key, job=job: f"{job} {key}: {m}")
        # what torch ran, action by action, is the lab's order (each iteration of it)
        rows = torch_schedules.rows(PLANS[name])
        assert got.orders == {r: rows[r] * job.iterations for r in range(2)}, job


def test_a_traced_model_with_tied_weights_trains_on_torch_as_in_the_lab(tmp_path: Path) -> None:
    """GPT-2 (embedding and LM head tied, on different ranks) split by torch's ``pipeline()`` at the units' module
    names, a block recomputed: the lab's run, torch's run of the export and plain PyTorch agree."""
    plan = Plan((0, 3, 6), tuple("kkrkkk"), 4, "1f1b")
    with vpipe_lab.launch(torch_jobs.gpt2, torch_jobs.gpt2_data, stages=2, microbatches=4, plan=plan,
                          loss=torch_jobs.gpt2_loss, optimizer=torch_jobs.gpt2_optimizer, device="cpu",
                          timeout=90) as session:
        session.run(3)
        session.wait(timeout=120)
        path = session.export_plan(tmp_path / "gpt2")
        lab_losses, lab_state = list(session.metrics.iterations["loss"]), session.state_dict()
    stages = bundle_files.read(path).stages
    assert [s.split_at for s in stages] == [None, "transformer.h.2"]
    assert stages[0].recompute == ("transformer.h.1",)
    got = torch_jobs.run([torch_jobs.Job(str(path), model="gpt2")], tmp_path)[0]
    plain, plain_losses = reference.train(torch_jobs.gpt2, torch_jobs.gpt2_data, torch_jobs.gpt2_loss,
                                          torch_jobs.gpt2_optimizer, iterations=3, microbatches=4)
    assert got.losses == pytest.approx(lab_losses, rel=1e-5) and lab_losses == pytest.approx(plain_losses, rel=1e-5)
    expected = plain.state_dict()
    # the tied weight under both names: one value, as one process has it (Adam turns reordered sums of tiny
    # gradients into differences of a few 1e-6)
    for key, value in expected.items():
        torch.testing.assert_close(got.state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
        torch.testing.assert_close(lab_state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


def test_a_mixture_of_experts_plan_trains_on_torch_as_in_the_lab_and_torchtitan_is_told_its_moe_layers(
        tmp_path: Path) -> None:
    """Qwen3-MoE (every decoder layer four experts, top-2), a layer's experts recomputed: torch's ``pipeline()``
    split at the bundle's module names trains it equal to the lab and to one process; the bundle's units and
    torchtitan's settings name each stage's MoE layers."""
    import tomllib

    plan = Plan((0, 3, 6), tuple("kkrkkk"), 4, "1f1b")
    with vpipe_lab.launch(torch_jobs.moe, torch_jobs.gpt2_data, stages=2, microbatches=4, plan=plan,
                          loss=torch_jobs.gpt2_loss, optimizer=torch_jobs.gpt2_optimizer, device="cpu",
                          timeout=120) as session:
        session.run(3)
        session.wait(timeout=300)
        path = session.export_plan(tmp_path / "moe")
        lab_losses, lab_state = list(session.metrics.iterations["loss"]), session.state_dict()
    bundle = bundle_files.read(path)
    assert [m.module for u in bundle.units for m in u.moe] == [f"model.layers.{i}.mlp" for i in range(4)]
    assert bundle.units[1].moe[0].experts == 4 and bundle.units[1].moe[0].top_k == 2
    settings = tomllib.loads((path / "torchtitan.toml").read_text())["parallelism"]
    assert settings["expert_parallel_degree"] == 1
    text = (path / "torchtitan.toml").read_text()
    assert "#   part 0: model.layers.0.mlp (4 experts, top-2), model.layers.1.mlp" in text
    assert "#   part 1: model.layers.2.mlp (4 experts, top-2), model.layers.3.mlp" in text
    from torchtitan.config.configs import ParallelismConfig

    ParallelismConfig(**settings)  # torchtitan takes the settings as they are
    got = torch_jobs.run([torch_jobs.Job(str(path), model="moe")], tmp_path)[0]
    plain, plain_losses = reference.train(torch_jobs.moe, torch_jobs.gpt2_data, torch_jobs.gpt2_loss,
                                          torch_jobs.gpt2_optimizer, iterations=3, microbatches=4)
    assert got.losses == pytest.approx(lab_losses, rel=1e-5) and lab_losses == pytest.approx(plain_losses, rel=1e-5)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(got.state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
        torch.testing.assert_close(lab_state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")



def test_an_exported_sharded_plan_trains_on_torch_pipelining_with_fully_shard_as_in_the_lab(tmp_path: Path) -> None:
    """2 stages x 2 shards (4 ranks): the lab trains it and exports the bundle; torch.distributed.pipelining with
    fully_shard over the bundle's mesh (as torchtitan composes them) trains it from the bundle alone, equal to the
    lab; the bundle's torchtitan settings carry the mesh."""
    import tomllib

    plan = Plan((0, 4, 10), tuple("kkrkkkkkkk"), 4, "1f1b", shards=2, sharding=("hold", "regather"))
    with vpipe_lab.launch("mlp", stages=2, shards=2, microbatches=4, plan=plan, device="cpu", timeout=60) as session:
        session.run(3)
        session.wait(timeout=120)
        session.export_plan(tmp_path / "sharded")
        losses, state = list(session.metrics.iterations["loss"]), session.state_dict()
    settings = tomllib.loads((tmp_path / "sharded" / "torchtitan.toml").read_text())["parallelism"]
    assert (settings["data_parallel_shard_degree"], settings["data_parallel_replicate_degree"]) == (2, 1)
    got = torch_jobs.run([torch_jobs.Job(str(tmp_path / "sharded"))], tmp_path, world=4)[0]
    assert got.losses == pytest.approx(losses, rel=1e-5)
    assert set(got.state) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(got.state[key], value, msg=lambda m, key=key: f"{key}: {m}")


def test_the_torchrun_script_in_the_docs_trains_a_bundle_as_the_lab_did(tmp_path: Path) -> None:
    """docs/interop.md's whole script, as written there, under torchrun on 2 ranks: the lab's losses."""
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "interop.md").read_text()
    script = re.search(r"<!-- script: train_bundle.py -->\n```python\n(.*?)```", page, re.S)
    assert script is not None, "the script block in docs/interop.md"
    (tmp_path / "train_bundle.py").write_text(script.group(1))
    losses, _ = lab_run(PLANS["1f1b-recompute"], tmp_path / "bundle")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "train_bundle.py"), str(tmp_path / "bundle"), "vpipe_lab.examples.mlp", "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [float(m) for m in re.findall(r"iteration \d+: loss ([\d.]+)", proc.stdout)]
    assert printed == pytest.approx(losses, rel=1e-5)
