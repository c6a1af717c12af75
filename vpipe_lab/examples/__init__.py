"""Bundled examples: models and deterministic data factories, importable without torch (they build in workers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXAMPLES = ("mlp", "gpt-tiny")


@dataclass(frozen=True)
class Example:
    """What a bundled example provides; each attribute is a callable that builds in the worker."""

    model: Any
    data: Any
    loss: Any
    optimizer: Any
    description: str


def get(name: str) -> Example:
    """The bundled example called ``name`` (see ``EXAMPLES``)."""
    if name == "mlp":
        from vpipe_lab.examples import mlp

        return Example(mlp.model, mlp.data, mlp.loss, mlp.optimizer,
                       "a 10-block MLP with deliberately uneven widths, fitting a fixed random teacher")
    if name == "gpt-tiny":
        from vpipe_lab.examples import gpt

        return Example(gpt.model, gpt.data, gpt.loss, gpt.optimizer,
                       "a character-level GPT on Python's own standard-library source text")
    raise ValueError(f"unknown example {name!r}: bundled examples are {', '.join(EXAMPLES)}")
