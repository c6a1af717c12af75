"""Bundled examples: models and deterministic data factories. Naming one (``launch("gpt-tiny")``) imports nothing
here: the kernel only checks the name and the stage count against what is declared below, and the workers import the
model, which is where torch lives."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bundled:
    """What the controller knows of a bundled example without importing it."""

    module: str
    description: str
    units: int  # partition units the model is cut into: a pipeline has at most this many stages


EXAMPLES: dict[str, Bundled] = {
    "mlp": Bundled("vpipe_lab.examples.mlp", "a 10-block MLP with deliberately uneven widths, fitting a fixed random "
                   "teacher", 10),
    "gpt-tiny": Bundled("vpipe_lab.examples.gpt", "a character-level GPT on Python's own standard-library source "
                        "text", 8),
    "moe-tiny": Bundled("vpipe_lab.examples.moe", "a mixture-of-experts language model (transformers' Qwen3-MoE: "
                        "a dense layer, then five with 8 experts, top-2) on gpt-tiny's characters", 8),
}


@dataclass(frozen=True)
class Example:
    """What a bundled example provides; each attribute is a callable that builds in the worker."""

    model: Any
    data: Any
    loss: Any
    optimizer: Any
    description: str


def check(name: str) -> Bundled:
    """The declaration of the bundled example ``name``, or a ValueError that lists the bundled names."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}: bundled examples are {', '.join(EXAMPLES)}")
    return EXAMPLES[name]


def check_stages(name: str, stages: int) -> None:
    """Refuse a pipeline of more stages than the bundled model ``name`` has partition units."""
    units = check(name).units
    if stages > units:
        raise ValueError(f"{name!r} has {units} partition units, so a pipeline of it has at most {units} stages, not "
                         f"{stages}: use --stages/stages= between 1 and {units}")


def get(name: str) -> Example:
    """The bundled example called ``name`` (imports it: workers only)."""
    bundled = check(name)
    module = importlib.import_module(bundled.module)
    return Example(module.model, module.data, module.loss, module.optimizer, bundled.description)
