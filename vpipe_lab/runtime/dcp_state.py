"""A stage's state as torch.distributed.checkpoint (DCP) keys: the user's model's own ``state_dict()`` keys at the
top level, the optimizer flattened by parameter name under ``optimizer`` (the layout of torch's
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, which torchtitan saves), the iteration as
``train_state.step``.

So ``dcp.load(model.state_dict(), checkpoint_id=...)`` fills a plain model with no process group, torchtitan loads the
model keys, and a checkpoint resumes onto any partition: every stage asks for its own units' keys, whoever wrote them.
A tied weight is saved under each of its names (DCP keeps one copy per name; its writers agree on the bytes).
Non-tensor values (a parameter group's ``betas``) are read back with ``torch.load(weights_only=True)``, never an
unrestricted unpickle, so a checkpoint from elsewhere cannot run code here.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from vpipe_lab.runtime.engine.stage import Stage

OPTIMIZER, TRAIN = "optimizer", "train_state"
GROUP_SKIP = ("params", "vpipe_unit")  # a parameter group's keys that are not options


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def model_keys(canonical: str, aliases: Mapping[str, list[str]], non_persistent: set[str]) -> list[str]:
    """The ``state_dict()`` keys a tensor is saved under: all its names there; none for a non-persistent buffer; its
    own name where the stage knows no model (a stage built by hand)."""
    if canonical in non_persistent:
        return []
    return list(aliases.get(canonical, [canonical]))


def save_state(stage: Stage, aliases: Mapping[str, list[str]], non_persistent: set[str],
               iteration: int) -> dict[str, Any]:
    """This stage's units as a DCP state dict (see the module docstring)."""
    model: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    params = dict(stage.params())
    for index in stage.owned:
        layer = stage.layers[index]
        for name in dict.fromkeys(layer.names):
            for key in model_keys(name, aliases, non_persistent):
                model[key] = stage.tensors[name].detach()
        for name, state in stage.optimizer_state([n for n in dict.fromkeys(layer.names) if n in params]).items():
            for k, v in state.items():
                flat[f"state.{name}.{k}"] = v
        for group in stage.unit_groups(index):
            for name in group["params"]:
                for k, v in group["options"].items():
                    if k not in GROUP_SKIP:
                        flat[f"param_groups.{name}.{k}"] = v
    return {**model, OPTIMIZER: flat, TRAIN: {"step": torch.tensor(iteration, dtype=torch.int64)}}


def _placeholder(meta: Any) -> Any:
    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    if isinstance(meta, BytesStorageMetadata):
        return None
    raise TypeError(f"cannot read a checkpoint entry described as {type(meta).__name__}")


def load_template(stage: Stage, aliases: Mapping[str, list[str]], non_persistent: set[str],
                  metadata: Metadata) -> tuple[dict[str, Any], list[str]]:
    """What this stage reads from a checkpoint with ``metadata``: its tensors in place (under the first of their
    names the checkpoint has), its parameters' optimizer entries and the step when present; and the persistent
    tensors the checkpoint lacks."""
    keys = metadata.state_dict_metadata
    template: dict[str, Any] = {}
    missing = []
    for index in stage.owned:
        for name in dict.fromkeys(stage.layers[index].names):
            wanted = model_keys(name, aliases, non_persistent)
            found = next((k for k in wanted if k in keys), None)
            if found is not None:
                template[found] = stage.tensors[name].detach()
            elif wanted:
                missing.append(wanted[0])
    params = {n for n, _ in stage.params()}
    flat = {}
    for key, meta in keys.items():
        if key.startswith(f"{OPTIMIZER}.state.") or key.startswith(f"{OPTIMIZER}.param_groups."):
            rest = key[len(OPTIMIZER) + 1:]
            name = _param_of(rest, params)
            if name is not None:
                flat[rest] = _placeholder(meta)
    if flat:
        template[OPTIMIZER] = flat
    if f"{TRAIN}.step" in keys:
        template[TRAIN] = {"step": _placeholder(keys[f"{TRAIN}.step"])}
    return template, list(dict.fromkeys(missing))


def _param_of(key: str, params: set[str]) -> str | None:
    """The parameter a flattened optimizer key ("state.<name>.<k>", "param_groups.<name>.<k>") belongs to, if held
    here (parameter names contain dots, so the longest held prefix wins)."""
    body = key.split(".", 1)[1]
    best = None
    for name in params:
        if body.startswith(name + ".") and (best is None or len(name) > len(best)):
            best = name
    return best


def restore_optimizer(stage: Stage, template: Mapping[str, Any]) -> None:
    """Give the stage's optimizer what ``template``'s ``optimizer`` entries read: each parameter's state and its
    group's options."""
    flat = template.get(OPTIMIZER) or {}
    params = {n for n, _ in stage.params()}
    states: dict[str, dict[str, Any]] = {}
    options: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        name = _param_of(key, params)
        if name is None:
            continue
        section, field = key.split(".", 1)[0], key[len(key.split(".", 1)[0]) + len(name) + 2:]
        (states if section == "state" else options).setdefault(name, {})[field] = value
    stage.load_optimizer(states, [{"options": o, "params": [n]} for n, o in options.items()])
