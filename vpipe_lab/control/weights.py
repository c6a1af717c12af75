"""The trained model back out: ``Session.state_dict()`` as ``model.state_dict()`` has it, and ``Session.export()``
in the form the model's library loads.

Nothing here is needed to train. A caller who asks for tensors has torch, so it is imported only then (as in
``wire/tensors.py``); ``export`` also builds the model once in this process, to load the weights into it the way
the user would and to save it with its library's own writer.
"""

from __future__ import annotations

import copy
import importlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vpipe_lab.wire.events import Tensors
from vpipe_lab.wire.tensors import decode


def assemble(answers: Iterable[Tensors]) -> OrderedDict[str, Any]:
    """Every stage's STATE answer as one ``model.state_dict()``: its keys in its order, a tied weight under each of
    its names (one tensor), non-persistent buffers left out (the workers do not send them)."""
    out: dict[str, Any] = {}
    place: dict[str, int] = {}
    for answer in answers:
        values = decode(answer.tensors, answer.buffers)
        for meta in answer.tensors:
            for alias, where in meta.aliases or [(meta.key, len(place))]:
                out.setdefault(alias, values[meta.key])  # a weight tied across stages: every copy is equal
                place.setdefault(alias, where)
    return OrderedDict(sorted(out.items(), key=lambda kv: place[kv[0]]))


def build(model: Any, seed: int = 0) -> Any:
    """A fresh model of the kind the job trains: from its factory (seeded, as the workers build it), a copy of the
    instance it was given, or a bundled example's."""
    torch = importlib.import_module("torch")  # on request only: see the module docstring
    if isinstance(model, str):
        from vpipe_lab import examples

        model = examples.get(model).model
    if isinstance(model, torch.nn.Module):
        return copy.deepcopy(model)
    if not callable(model):
        raise TypeError(f"cannot build a model from {type(model).__name__}: give its factory (export(path, model=...))")
    torch.manual_seed(seed)
    return model()


def export(state: Mapping[str, Any], model: Any, path: str | Path, seed: int = 0) -> Path:
    """Load ``state`` into a fresh build of ``model`` (strictly: every key) and write it where ``path`` says: a
    transformers model as a folder that ``from_pretrained(path)`` reads, anything else as a ``torch.save`` of its
    state dict (``path``, or ``path/model.pt`` for a folder). Returns what was written."""
    torch = importlib.import_module("torch")
    built = build(model, seed)
    built.load_state_dict(dict(state), strict=True)
    target = Path(path)
    if hasattr(built, "save_pretrained"):
        built.save_pretrained(target)
        return target
    if target.is_dir() or not target.suffix:
        target.mkdir(parents=True, exist_ok=True)
        target = target / "model.pt"
    torch.save(built.state_dict(), target)
    return target
