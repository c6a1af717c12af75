"""Keep torchvision's pure-Python models importable when its compiled ops cannot load.

A torchvision wheel built against CUDA torch, installed next to a CPU-only torch (what pip gives for
``torch==2.13.0+cpu`` and ``torchvision==0.28.0`` from the package index), fails to load its ``_C`` library; its
import then dies registering fake kernels for ``torchvision::nms``/``qnms``, which do not exist, and takes
``transformers`` (which imports it when installed) down too. The models themselves (ResNet, ...) are plain torch.
If, and only if, the library fails to load, declare those two operator schemas so the import goes through; calling
the detection ops still fails, as it would anyway without the library.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_library: torch.library.Library | None = None


def allow_torchvision_without_ops() -> bool:
    """Returns True when the schemas had to be declared (torchvision present, its compiled ops not loadable)."""
    global _library
    if _library is not None or "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    lib = next(iter(Path(spec.origin).parent.glob("_C*.so")), None)
    if lib is not None:
        try:
            torch.ops.load_library(str(lib))
            return False
        except OSError as exc:
            log.info("torchvision's compiled ops do not load (%s); its models still work", exc)
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        _library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True
