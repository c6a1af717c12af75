"""The torchvision guard in the user's own process: ``import vpipe_lab`` is enough, and it imports no torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vpipe_lab import import_guard

ROOT = Path(__file__).resolve().parents[1]


def python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (the guard acts on a process's first torchvision lookup)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240,
                          cwd=ROOT)


def ops_load() -> bool:
    """Whether this environment's torchvision loads its compiled ops on its own (then there is nothing to guard)."""
    return python("import torchvision").returncode == 0


def test_importing_the_package_arms_the_guard_without_importing_torch() -> None:
    done = python("""
        import sys
        import vpipe_lab
        from vpipe_lab.import_guard import TorchvisionGuard
        assert "torch" not in sys.modules, "import vpipe_lab must stay light"
        assert isinstance(sys.meta_path[0], TorchvisionGuard)
        import json  # other imports pass the guard by
        assert isinstance(sys.meta_path[0], TorchvisionGuard) and "torch" not in sys.modules
    """)
    assert done.returncode == 0, done.stderr


def test_transformers_and_torchvision_import_in_the_users_process_after_import_vpipe_lab() -> None:
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torchvision") is None:
        pytest.skip("needs transformers and torchvision installed")
    done = python("""
        import sys
        import vpipe_lab
        from transformers import BertConfig, BertModel, ViTConfig, ViTModel  # transformers probes torchvision
        import torchvision
        from vpipe_lab.import_guard import TorchvisionGuard
        assert not any(isinstance(f, TorchvisionGuard) for f in sys.meta_path)  # it ran once and left
        net = torchvision.models.resnet18(num_classes=3)
        bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
        vit = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8))
        print(type(net).__name__, type(bert).__name__, type(vit).__name__)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ResNet", "BertModel", "ViTModel"]


def test_without_the_guard_this_environment_fails_as_users_saw() -> None:
    """The case the guard exists for, shown real here: without vpipe_lab, torchvision's import dies on its ops."""
    if ops_load():
        pytest.skip("this torchvision loads its compiled ops: nothing to guard here")
    done = python("import torchvision")
    assert done.returncode != 0 and "torchvision::nms does not exist" in done.stderr


def test_arming_is_idempotent_and_the_guard_answers_for_nothing() -> None:
    saved = list(sys.meta_path)
    try:
        import_guard.disarm()
        armed = import_guard.arm()
        if "torchvision" in sys.modules:  # this test process imported it already: nothing to arm
            assert not armed
            return
        assert armed and not import_guard.arm()
        guard = sys.meta_path[0]
        assert isinstance(guard, import_guard.TorchvisionGuard) and guard.find_spec("json", None) is None
    finally:
        sys.meta_path[:] = saved
