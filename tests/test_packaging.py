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


def _tutorial_imports() -> dict[str, set[str]]:
    """Top-level modules each tutorial imports, outside the standard library."""
    import ast
    import json

    from IPython.core.inputtransformer2 import TransformerManager

    python = TransformerManager()  # magics become Python, as the kernel runs them
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for node in ast.walk(ast.parse(python.transform_cell("".join(cell["source"])))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "vpipe_lab":
                        found.setdefault(top, set()).add(path.name)
    return found


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution installing ``requirements`` brings, as installed here (extras of vpipe_lab followed)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        name = req.name.lower().replace("_", "-")
        if name == "vpipe-lab":
            todo += [r for extra in req.extras for r in extras[extra]]
            continue
        if name in seen:
            continue
        seen.add(name)
        for sub in metadata.requires(req.name) or []:
            parsed = Requirement(sub)
            if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return seen


def test_readme_command_one_installs_every_package_a_tutorial_imports() -> None:
    from importlib import metadata

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = _closure(extras["all"])
    providers = metadata.packages_distributions()
    imports = _tutorial_imports()
    assert {"torch", "transformers", "plotly"} <= set(imports)  # the check reads what the tutorials really use
    missing = {module: sorted(notebooks) for module, notebooks in imports.items()
               if not {d.lower().replace("_", "-") for d in providers.get(module, [module])} & installed}
    assert not missing, f"tutorials import packages that pip install -e '.[all]' does not install: {missing}"
