"""Bad data reported as bad data: a batch whose keys, dtypes or numbers of dimensions differ from the first batch's.

The model was captured from the first batch (``capture.py``), so a later batch that has another key, float token ids
or a missing dimension cannot run on that graph. Found where rank 0 describes a batch with new shapes
(``shape_epochs.py``), before any stage runs it, the mismatch is named as the data's fault, with what came and what was
expected; new *sizes* of the same layout are not bad data (another length, a short last batch: captured again where
the graph needs it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

# leaf path -> (dtype, or the Python type of a non-tensor leaf; the tensor's shape, or None)
Layout = dict[str, tuple[str, tuple[int, ...] | None]]


class BadBatch(ValueError):
    """A batch's layout differs from the first batch's (keys, dtypes, numbers of dimensions): the data's fault."""


def layout(inputs: Any, targets: Any = None, with_targets: bool = True) -> Layout:
    """Each leaf of the batch by its path (``inputs['input_ids']``, ``targets``): its dtype and shape."""
    out: Layout = {}
    for what, tree in (("inputs", inputs), ("targets", targets)) if with_targets else (("inputs", inputs),):
        for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
            name = what + pytree.keystr(path)
            if isinstance(leaf, torch.Tensor):
                out[name] = (str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape))
            elif leaf is not None:  # None is no value: a batch without targets has no "targets" leaf
                out[name] = (type(leaf).__name__, None)
    return out


def _shown(entry: tuple[str, tuple[int, ...] | None]) -> str:
    kind, shape = entry
    return f"{kind} of shape {list(shape)}" if shape is not None else f"a {kind}"


def mismatch(first: Layout, now: Layout, inputs_only: bool = False) -> str | None:
    """Why a batch laid out as ``now`` is not like the first batch (``first``); None when it is. ``inputs_only``:
    ``now`` has no targets (an evaluation batch's inputs)."""
    expected = {k: v for k, v in first.items() if k.startswith("inputs")} if inputs_only else first
    missing = [k for k in expected if k not in now]
    extra = [k for k in now if k not in expected]
    if missing or extra:
        said = ([f"no {', '.join(missing)}"] if missing else []) + ([f"an unexpected {', '.join(extra)}"] if extra
                                                                    else [])
        return (f"this batch has {' and '.join(said)}; the first batch (which the model was captured from) had "
                f"{', '.join(expected) or 'nothing'}: give every batch the same keys")
    for name, entry in now.items():
        was = expected[name]
        if entry[0] != was[0]:
            captured = " (the model was captured for it)" if name.startswith("inputs") else ""
            return (f"{name} is {_shown(entry)}, where the first batch's was {_shown(was)}{captured}: convert it in "
                    f"the data (e.g. .to(torch.{was[0]}))" if was[1] is not None and entry[1] is not None else
                    f"{name} is {_shown(entry)}, where the first batch's was {_shown(was)}")
        if entry[1] is not None and was[1] is not None and len(entry[1]) != len(was[1]):
            return (f"{name} has {len(entry[1])} dimensions {list(entry[1])}, where the first batch's had "
                    f"{len(was[1])} {list(was[1])}: every batch keeps its batch dimension first, with the same "
                    f"number of dimensions")
    return None
