import json
import subprocess
import sys
from pathlib import Path

import pytest

from vpipe_lab.cli import main
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.workloads import random_chain


def test_plan_prints_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "bert-48", "--stages", "8", "--microbatches", "16", "--method", "optimal", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "stage" in text and "iteration" in text and "proven optimal" in text
    plan = Plan.from_json(out)
    assert plan.stages == 8 and plan.num_layers == 97


def test_plan_from_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    random_chain(16, seed=2).save(path)
    assert main(["plan", str(path), "-k", "4", "-m", "8", "--memory", "64GiB", "--method", "pipedream"]) == 0
    assert "fits in memory" in capsys.readouterr().out


def test_simulate_writes_html_and_trace(tmp_path: Path) -> None:
    html, trace = tmp_path / "t.html", tmp_path / "t.json"
    assert main(["simulate", "transformer-6-6", "-k", "4", "-m", "8", "--html", str(html), "--trace", str(trace)]) == 0
    assert "plotly" in html.read_text()[:200000].lower()
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "forward" for e in events)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "nope", "-k", "2", "-m", "2"], "neither a profile file nor a bundled workload"),
        (["plan", "{bad}", "-k", "2", "-m", "2"], "neither a profile file"),
        (["plan", "bert-24", "-k", "99", "-m", "2"], "cannot split 49 layers into 99 stages"),
        (["plan", "bert-24", "-k", "2", "-m", "2", "--memory", "1MiB"], "found no plan that fits"),
    ],
)
def test_bad_input_is_one_line_not_a_traceback(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bad_profile_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kind": "profile", "layers": [{"name": "a", "forward_s": -1}]}))
    proc = subprocess.run([sys.executable, "-m", "vpipe_lab.cli", "plan", str(path), "-k", "1", "-m", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "layers[0].forward_s must be finite and >= 0" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_chooses_the_microbatch_count_for_a_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "bert-24", "--stages", "4", "--batch-size", "32", "--memory", "11GiB"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches x size for a batch of 32: 1 x 32:" in out and "chosen" in out
    with pytest.raises(SystemExit):  # argparse: one or the other
        main(["plan", "bert-24", "--stages", "4", "--batch-size", "32", "-m", "4"])
