"""`vpipe-lab export` and `vpipe-lab import` from the shell: a plan JSON over a model cut here, a checkpoint's plan,
and the errors that say what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from vpipe_lab.cli import main
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire import bundle_files as files


def test_export_a_plan_over_a_bundled_model_and_import_it_back(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(Plan((0, 3, 8), tuple("kkrkkkkk"), 4).to_json())
    assert main(["export", str(tmp_path / "b"), "--model", "gpt-tiny", "--plan", str(plan_file)]) == 0
    bundle = files.read(tmp_path / "b")
    assert bundle.stages[1].split_at == "3" and bundle.stages[0].recompute == ("2",)
    assert "exported to" in capsys.readouterr().out
    out = tmp_path / "back.json"
    assert main(["import", str(tmp_path / "b"), "--bundle", str(tmp_path / "b"), "-o", str(out)]) == 0
    assert Plan.from_json(out) == bundle.plan
    out.unlink()
    assert main(["import", str(tmp_path / "b"), "-o", str(out)]) == 0  # a bundle as it is: its own units
    assert Plan.from_json(out) == bundle.plan


def test_what_is_missing_is_said(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["export", str(tmp_path / "x")]) == 2
    assert "no plan: give --plan" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "x"), "--model", "mlp"]) == 2
    assert "no plan: give --plan" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "x"), "--checkpoint", str(tmp_path / "none")]) == 2
    assert "is not a complete vpipe_lab checkpoint" in capsys.readouterr().err
    # every argument is read before a model is captured: the missing plan file, not the model nobody can import
    assert main(["export", str(tmp_path / "x"), "--model", "no_such_package.models:build", "--plan",
                 str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "x"), "--run-dir", str(tmp_path)]) == 2
    assert "no checkpoints/ in it (vpipe-lab run --run-dir DIR leaves one)" in capsys.readouterr().err
    assert main(["import", "Et|tL", "--model", "mlp", "--ranks", "2"]) == 2
    assert "does not say the number of micro-batches: give microbatches= (--microbatches)" in capsys.readouterr().err
    assert main(["import", "Et|tL", "--model", "mlp", "--ranks", "2", "-m", "2"]) == 2
    assert "Megatron-LM lays out an embedding" in capsys.readouterr().err


def test_export_over_a_directory_that_is_more_than_a_bundle_is_refused_and_touches_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/security.md: `vpipe-lab export DIR` with a pipeline.json among the user's files deletes nothing."""
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(Plan((0, 3, 8), tuple("kkkkkkkk"), 4).to_json())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "pipeline.json").write_text("{}")
    (mine / "notes.md").write_text("precious")
    assert main(["export", str(mine), "--model", "gpt-tiny", "--plan", str(plan_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not an export bundle" in err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.md", "pipeline.json"]
    assert (mine / "notes.md").read_text() == "precious"
    # a bundle the lab wrote is replaced; once a file of the user's sits in it, it is not
    assert main(["export", str(tmp_path / "b"), "--model", "gpt-tiny", "--plan", str(plan_file)]) == 0
    assert main(["export", str(tmp_path / "b"), "--model", "gpt-tiny", "--plan", str(plan_file)]) == 0
    (tmp_path / "b" / "results.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "b"), "--model", "gpt-tiny", "--plan", str(plan_file)]) == 2
    assert "'results.txt' beside its bundle files" in capsys.readouterr().err
    assert (tmp_path / "b" / "results.txt").read_text() == "mine"


def test_import_of_a_file_that_never_ends_is_refused_in_one_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """docs/security.md: a TOML symlinked to /dev/zero is refused, not read until memory runs out."""
    (tmp_path / "job.toml").symlink_to("/dev/zero")
    assert main(["import", str(tmp_path / "job.toml"), "--model", "mlp", "-m", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a regular file" in err
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * ((16 << 20) + 1))
    assert main(["import", str(big), "--model", "mlp", "-m", "2"]) == 2
    assert "larger than 16 MiB" in capsys.readouterr().err
