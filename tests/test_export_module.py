"""``vpipe_lab.export``: the bundle's API without torch (writing and reading a bundle imports no torch) and
``torch_pipeline`` when called."""

from __future__ import annotations

import subprocess
import sys


def test_bundles_need_no_torch_and_torch_pipeline_is_torchs() -> None:
    code = ("import sys, vpipe_lab.export as e; assert 'torch' not in sys.modules; "
            "from vpipe_lab.runtime.torch_pp.pipeline import torch_pipeline; assert callable(e.torch_pipeline)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
