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
    layer = {"name": "a", "forward_s": -1, "backward_s": 0, "activation_bytes": 0, "input_bytes": 0, "output_bytes": 0,
             "param_bytes": 0}
    path.write_text(json.dumps({"kind": "profile", "layers": [layer]}))
    proc = subprocess.run([sys.executable, "-m", "vpipe_lab.cli", "plan", str(path), "-k", "1", "-m", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "layers[0]: layer 'a'.forward_s must be finite and >= 0" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_chooses_the_microbatch_count_for_a_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "bert-24", "--stages", "4", "--batch-size", "32", "--memory", "11GiB"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches x size for a batch of 32: 1 x 32:" in out and "chosen" in out
    with pytest.raises(SystemExit):  # argparse: one or the other
        main(["plan", "bert-24", "--stages", "4", "--batch-size", "32", "-m", "4"])


def test_plan_chooses_the_mesh_of_n_devices_and_says_it_beside_whole_stages(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`vpipe-lab plan --devices N`: every stages x shards x replicas planned; the chosen mesh beside the fastest
    pipeline of whole devices, or that none fits; plan.json carries the mesh and each stage's sharding."""
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-cpm-large", "--devices", "8", "--memory", "6GiB", "--batch-size", "64", "--device",
                 "h200", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "meshes of 8 devices (stages x shards x replicas), fastest first: 1x8x1:" in said
    assert "chosen 1 stage x 8 shards x 1 replica" in said and "no pipeline of whole devices (shards=1) fits" in said
    assert "peak/rank" in said and "(8 devices)" in said
    doc = json.loads(out.read_text())
    assert (doc["stages"], doc["shards"], doc["replicas"]) == (1, 8, 1) and len(doc["sharding"]) == 1
    assert main(["plan", "gpt-cpm-large", "--devices", "8", "--batch-size", "64", "--device", "h200"]) == 0
    assert "the fastest pipeline of whole devices, " in capsys.readouterr().out
    assert main(["plan", "gpt-cpm-large", "--stages", "2", "--shards", "4", "--batch-size", "64", "--device",
                 "h200"]) == 0
    assert "2 stages x 4 shards x 1 replica (8 devices)" in capsys.readouterr().out


def test_plan_devices_needs_a_batch_and_chooses_shards_itself(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt-cpm-large", "--devices", "8", "-m", "4"]) == 2
    assert "give --batch-size" in capsys.readouterr().err
    assert main(["plan", "gpt-cpm-large", "--devices", "8", "--batch-size", "8", "--shards", "2"]) == 2
    assert "--devices chooses shards and replicas itself" in capsys.readouterr().err
