"""`vpipe-lab run` and `vpipe-lab worker`'s arguments: the bundled examples and a user's own model headless, what a
run leaves in its run directory, resuming from it onto another stage count, and the report."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vpipe_lab.cli import main


@pytest.mark.slow
def test_run_trains_prints_a_summary_and_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Interleaved 1F1B (two chunks per stage by default), planned by vPipe from the profile measured on the workers."""
    report = tmp_path / "run.html"
    assert main(["run", "--model", "mlp", "--stages", "2", "--microbatches", "2", "--iterations", "4",
                 "--schedule", "interleaved-1f1b", "--device", "cpu", "--plan", "auto", "--report", str(report)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "vpipe planned from the measured profile" in out and "interleaved-1f1b V=2" in out
    assert "4 iterations: loss" in out and "samples/s" in out and "stage 1:" in out
    assert "4/4" in captured.err.replace("\r", "\n").splitlines()[-1]  # the progress bar ends full
    html = report.read_text()
    assert "measured timeline" in html and "loss and throughput per iteration" in html and "predicted peak" in html
    assert "command:   vpipe-lab run --model mlp" in html and "bottleneck: stage" in html
    assert "measured/predicted" in html and '"MiB"' in html  # a CPU toy's memory in MiB, not 0.01 GiB
    assert "; peak predicted" in out and ", measured" in out  # the planner's peak beside the allocator's, per stage
    header = next(line for line in html.splitlines() if "time/mb" in line).split("<pre>")[-1]
    assert header.split() == ["stage", "layers", "policies", "time/mb", "peak", "memory", "budget", "note"]


def test_run_rejects_a_bad_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"kind": "plan", "boundaries": [0, 3], "policies": ["keep"], "microbatches": 2}')
    assert main(["run", "--model", "mlp", "--plan", str(bad)]) == 2
    assert "plan:" in capsys.readouterr().err


def test_gpu_check_skips_cleanly_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run benchmarks/gpu_check.py itself")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and '"skipped": "no CUDA device' in proc.stdout




@pytest.mark.slow
def test_your_own_model_headless_resumed_onto_three_stages_equal_to_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`vpipe-lab run --model package.module:factory` with the user's data, loss, optimizer and split, leaving its run
    directory; `--resume` from it onto 3 stages; the checkpoint, read by dcp.load into a plain model, and every
    iteration's loss in metrics.jsonl equal plain training of the same model; `export --run-dir` and `import` of the
    bundle as it is close the loop."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tests.integration import user_parts
    from tests.runtime.reference import assert_state_matches, train
    from vpipe_lab.core.plan import Plan
    from vpipe_lab.core.profile import ModelProfile
    from vpipe_lab.wire import bundle_files as files
    from vpipe_lab.wire.checkpoint_format import Manifest, resolve

    (tmp_path / "shelljob_models.py").write_text(Path(user_parts.__file__).read_text())
    monkeypatch.chdir(tmp_path)  # the workers import the user's module from here, as python -m would
    monkeypatch.syspath_prepend(str(tmp_path))
    parts = ["--model", "shelljob_models:build", "--data", "shelljob_models:data", "--loss", "shelljob_models:loss",
             "--optimizer", "shelljob_models:sgd", "--microbatches", "2", "--device", "cpu", "--run-dir", "run"]
    assert main(["run", *parts, "--stages", "2", "--split", "blocks.1,blocks.3", "-n", "3"]) == 0
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} >= {"checkpoints", "metrics.jsonl", "plan.json", "profile.json",
                                               "cluster.json", "run.json"}
    plan = Plan.from_json(run / "plan.json")
    units = Manifest.read(run / "checkpoints").units
    assert plan.stages == 2 and [u["name"] for u in units][1].startswith("blocks.1")  # the split given
    assert len(ModelProfile.from_json(run / "profile.json").layers) == len(units) == 4  # and the head
    about = json.loads((run / "run.json").read_text())
    assert about["model"] == "shelljob_models:build" and about["iteration"] == 3 and about["measured_s"] > 0
    assert "--split blocks.1,blocks.3" in about["command"]
    assert main(["run", *parts, "--stages", "3", "--resume", "run/checkpoints", "-n", "2"]) == 2
    assert "resume with the split it was saved with" in capsys.readouterr().err  # six units by default, not four
    assert main(["run", *parts, "--stages", "3", "--split", "blocks.1,blocks.3", "--resume", "run/checkpoints",
                 "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "stage 2:" in out and "plan, profile, checkpoint and metrics in run" in out

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    iterations = [r for r in rows if r["kind"] == "iteration"]
    assert [r["iteration"] for r in iterations] == [0, 1, 2, 3, 4]  # the resumed run goes on in the same file
    starts = [r["iteration"] for r in rows if r["kind"] == "start"]
    assert starts[0] == 0 and starts[-1] == 3  # each start says so (the refused one too)
    users = importlib.import_module("shelljob_models")
    model, losses = train(users.build, users.data, users.loss, users.sgd, iterations=5, microbatches=2)
    assert [r["loss"] for r in iterations] == pytest.approx(losses, rel=1e-5)
    torch.manual_seed(99)  # other initial values: everything must come from the checkpoint
    fresh = users.build()
    dcp.load(fresh.state_dict(), checkpoint_id=str(resolve(run / "checkpoints")))  # fills the model in place
    assert Manifest.read(run / "checkpoints").iteration == 5
    assert_state_matches(fresh.state_dict(), model)

    assert main(["export", "bundle", "--run-dir", "run"]) == 0
    bundle = files.read(tmp_path / "bundle")
    assert bundle.plan.stages == 3 and bundle.measured_s is not None and bundle.predicted_s is not None
    readme = (tmp_path / "bundle" / "README.md").read_text()
    assert "measured in the lab:" in readme and "predicted by the lab's cost model:" in readme
    assert main(["import", "bundle", "-o", "back.json"]) == 0
    assert Plan.from_json(tmp_path / "back.json") == bundle.plan


def test_what_is_wrong_on_the_command_line_is_said_before_a_worker_starts(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    assert main(["run", "--model", "no_such_package.models:build", "--data", "mlp"]) == 2
    assert "there is no module 'no_such_package'" in capsys.readouterr().err
    assert main(["run", "--model", "mlp", "--loss", "mlp.py"]) == 2
    assert "unknown example 'mlp.py'" in capsys.readouterr().err
    assert main(["run", "--model", "mlp", "--loss", "a-b:c"]) == 2
    assert "write 'package.module:attribute'" in capsys.readouterr().err
    assert main(["run", "--model", "mlp", "--resume", str(tmp_path / "none")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["run", "--model", "mlp", "--run-dir", str(tmp_path / "file")]) == 2
    assert "that is a file; give a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--model", "mlp", "--split", "h.1,,h.3"])
    assert "give module names separated by commas" in capsys.readouterr().err
