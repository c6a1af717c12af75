"""What stops torch.export on models as their libraries build them: turned off where training does not need it (a
generation-time key/value cache), otherwise named (the object or op, and the line of the model's code) with the fix."""

from __future__ import annotations

import logging
import re
import traceback

from torch import nn

log = logging.getLogger(__name__)


class CaptureError(ValueError):
    """The model cannot be cut into pipeline units as asked."""


def generation_cache_off(model: nn.Module) -> None:
    """Training needs no key/value cache, but a transformers model built with its library's default config
    (``use_cache=True``) returns one in training mode too, and torch.export cannot put that object in a graph's
    output: turn it off, as the trainer of a plain model would not notice it."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    turned = [c for c in configs.values() if getattr(c, "use_cache", False) is True]
    for config in turned:
        config.use_cache = False
    if turned:
        log.info("use_cache turned off for training (%s)", type(model).__name__)


def why(exc: BaseException) -> str:
    """What stopped a capture, in words that name it, and the fix."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    found = re.search(r"Found <class '([\w.]+)'> in output", text)
    if found:
        kind = found.group(1).rsplit(".", 1)[-1]
        return (f"its forward returns a {kind} object, and only tensors (in tuples, lists, dicts or ModelOutputs) can "
                f"leave a captured graph; have forward return tensors, or turn off what builds the {kind} "
                "(a key/value cache: use_cache=False)")
    where = _user_frame(exc)
    if re.search(r"data.dependent|GuardOnDataDependent", text, re.IGNORECASE):
        return (f"{type(exc).__name__}: {first}" + (f" (at {where})" if where else "") + ". The model's Python "
                "control flow depends on a tensor's value there, outside any module that could run eagerly inside one "
                "unit (a branch in a block's own modules would), so it has no single graph to cut into stages; "
                "rewrite that branch with torch.cond/torch.where, or give an nn.Sequential of the parts")
    return f"{type(exc).__name__}: {first}" + (f" (at {where})" if where else "")


def shape_independent(exc: BaseException) -> bool:
    """Whether fixed input shapes cannot help: a branch on a tensor's values (an unbacked, data-dependent symbol) or a
    tensor the trace could not follow (a lifted fake constant) fail at any shapes, so a capture for fixed shapes, a
    second whole trace that fails the same way, is skipped (runtime/model/trace/eager.py runs that part eagerly)."""
    seen: set[int] = set()
    step: BaseException | None = exc
    while step is not None and id(step) not in seen:
        seen.add(id(step))
        if _SHAPE_FREE.search(f"{type(step).__name__}: {step}"):
            return True
        step = step.__cause__ or step.__context__
    return False


_SHAPE_FREE = re.compile(r"GuardOnDataDependentSymNode|data-dependent expression|fake tensor in the exported program "
                         r"constant")


def _user_frame(exc: BaseException) -> str | None:
    """The innermost line of the model's own code in the traceback (not torch's, not vpipe_lab's)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not re.search(r"[/\\](torch|vpipe_lab|functorch|sympy)[/\\]", f.filename)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
