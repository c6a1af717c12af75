"""The layer rules of docs/architecture.md at run time, and the consistency of environment.yml with pyproject.toml."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fresh_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(proc.stdout.split())


KERNEL_SIDE = ["vpipe_lab", "vpipe_lab.core", "vpipe_lab.wire", "vpipe_lab.telemetry", "vpipe_lab.charts",
               "vpipe_lab.control", "vpipe_lab.jupyter", "vpipe_lab.cli"]


@pytest.mark.parametrize("module", KERNEL_SIDE)
def test_kernel_side_never_imports_torch(module: str) -> None:
    loaded = _fresh_import(module)
    assert "torch" not in loaded, f"importing {module} pulled in torch"


def test_core_is_standard_library_only() -> None:
    loaded = _fresh_import("vpipe_lab.core")
    for banned in ("torch", "IPython", "ipywidgets", "anywidget", "plotly", "pandas", "numpy", "multiprocessing", "zmq"):
        assert banned not in loaded, f"vpipe_lab.core imports {banned}"


def _name(req: str) -> str:
    return re.split(r"[<>=!\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    keys = ("runtime", "jupyter", "test", "tensorboard", "wandb", "mlflow")
    wanted = {_name(r) for key in keys for r in extras[key]}
    conda_names = {"torch": "pytorch"}
    lines = (ROOT / "environment.yml").read_text().splitlines()
    listed = {_name(line.strip()[2:]) for line in lines if line.strip().startswith("- ") and "=" in line}
    missing = {conda_names.get(w, w) for w in wanted} - listed
    assert not missing, f"environment.yml lacks {sorted(missing)} that pyproject.toml needs"
    # Versions agree too, where both give a lower bound.
    for req in (r for key in keys for r in extras[key]):
        name, low = _name(req), req.split(">=")[-1] if ">=" in req else None
        if low:
            line = next(x for x in lines if x.strip().startswith(f"- {conda_names.get(name, name)}>="))
            assert line.strip().endswith(f">={low}"), f"{name}: pyproject wants >={low}, environment.yml has {line}"
