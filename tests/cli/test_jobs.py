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
    assert "measured timeline" in html and "loss per iteration" in html and "predicted peak" in html
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
