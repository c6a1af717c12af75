"""A stage's state as torch.distributed.checkpoint (DCP) keys: the user's model's own ``state_dict()`` keys at the
top level, the optimizer flattened by parameter name under ``optimizer`` (the layout of torch's
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, which torchtitan saves), the iteration as
``train_state.step``.

So ``dcp.load(model.state_dict(), checkpoint_id=...)`` fills a plain model with no process group, torchtitan loads the
model keys, and a checkpoint resumes onto any partition: every stage asks for its own units' keys, whoever wrote them.
A tied weight is saved under each of its names (DCP keeps one copy per name; its writers agree on the bytes).
Non-tensor values (a parameter group's ``betas``) are read back with ``torch.load(weights_only=True)``, and the
``.metadata`` file (which torch's own ``FileSystemReader`` reads with plain ``pickle.load``) with an unpickler that
admits only the classes DCP's metadata is made of (``SafeReader``): never an unrestricted unpickle, so a checkpoint
from elsewhere cannot run code here.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from vpipe_lab.runtime.engine.shards import like
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.memory.ledger import local_tensor
from vpipe_lab.wire.checkpoint_format import DCP_METADATA

OPTIMIZER, TRAIN = "optimizer", "train_state"
GROUP_SKIP = ("params", "vpipe_unit")  # a parameter group's keys that are not options


# What a DCP ``.metadata`` pickle is made of (torch 2.4 - 2.13): its own dataclasses and enum, torch's sizes, dtypes
# and layouts, and the checkpoint's path. Anything else in it is not metadata, and could be code.
_METADATA = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader``, reading ``.metadata`` with an unpickler that admits only what DCP metadata is
    made of: a crafted ``.metadata`` (another job's, a downloaded checkpoint's) is refused, naming what it holds.
    Every file it names for a tensor must be a plain file name inside the checkpoint's own directory (torch joins the
    name to the folder unchecked: ``/etc/...`` or ``../`` would read a file outside it) and, where the checkpoint has
    a manifest (``listed``), one that the manifest checksums; anything else is refused before a tensor is read."""

    def __init__(self, path: str, listed: set[str] | None = None) -> None:
        super().__init__(path)
        self.listed = listed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._unpickled(*args, **kwargs)
        directory = Path(str(self.path))
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = getattr(info, "relative_path", None)
            plain = (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
                     and "\0" not in name)
            if not plain:
                raise ValueError(f"{directory / DCP_METADATA} names the file {str(name)[:200]!r} for its tensors, which "
                                 "is not a plain file name inside the checkpoint; it is not read (a forged or corrupt "
                                 "checkpoint: resume from another version)")
            if self.listed is not None and name not in self.listed:
                raise ValueError(f"{directory / DCP_METADATA} names the file {name!r}, which the checkpoint's manifest "
                                 "does not list with a checksum; it is not read (a forged or corrupt checkpoint)")
            if not (directory / name).is_file():
                raise ValueError(f"{directory / DCP_METADATA} names the file {name!r}, which is not in {directory}")
        return metadata

    def _unpickled(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            try:
                metadata = _MetadataUnpickler(fh).load()
            except pickle.UnpicklingError as exc:
                raise ValueError(f"{path} is not torch.distributed.checkpoint metadata: it names {exc}, which DCP "
                                 "metadata never holds, so it is not loaded (it could run code); use a checkpoint "
                                 "written by torch.distributed.checkpoint or the lab") from None
            except (EOFError, AttributeError, TypeError) as exc:
                raise ValueError(f"{path} is not readable torch.distributed.checkpoint metadata: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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


def _placeholder(meta: Any, param: torch.Tensor | None = None) -> Any:
    """Where a checkpoint entry is read into: a sharded parameter's optimizer state of its shape is read as a DTensor
    laid out like it (DCP reads this rank's slice of it, whatever mesh wrote it), anything else whole."""
    if isinstance(meta, TensorStorageMetadata):
        if param is not None and local_tensor(param) is not param and tuple(meta.size) == tuple(param.shape):
            return like(torch.empty(local_tensor(param).shape, dtype=meta.properties.dtype), param)
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    if isinstance(meta, BytesStorageMetadata):
        return None
    raise TypeError(f"cannot read a checkpoint entry described as {type(meta).__name__}")


def load_template(stage: Stage, aliases: Mapping[str, list[str]], non_persistent: set[str],
                  metadata: Metadata) -> tuple[dict[str, Any], list[str]]:
    """What this stage reads from a checkpoint with ``metadata``: its tensors in place (under the first of their
    names the checkpoint has), its parameters' optimizer entries; and the persistent tensors the checkpoint lacks."""
    wanted = [(model_keys(name, aliases, non_persistent), stage.tensors[name].detach())
              for index in stage.owned for name in dict.fromkeys(stage.layers[index].names)]
    return template(wanted, {n for n, _ in stage.params()}, metadata, dict(stage.params()))


def template(wanted: list[tuple[list[str], torch.Tensor]], params: set[str],
             metadata: Metadata, named: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, Any], list[str]]:
    """A DCP load template: each wanted tensor (filled in place) under the first of its keys the checkpoint has,
    the optimizer entries of ``params`` (read sharded like their parameter in ``named``, where it is a DTensor);
    and the first key of each wanted tensor the checkpoint lacks."""
    keys = metadata.state_dict_metadata
    out: dict[str, Any] = {}
    missing = []
    for names, tensor in wanted:
        found = next((k for k in names if k in keys), None)
        if found is not None:
            out[found] = tensor
        elif names:
            missing.append(names[0])
    flat = {}
    for key, meta in keys.items():
        if key.startswith(f"{OPTIMIZER}.state.") or key.startswith(f"{OPTIMIZER}.param_groups."):
            rest = key[len(OPTIMIZER) + 1:]
            if (name := _param_of(rest, params)) is not None:
                flat[rest] = _placeholder(meta, (named or {}).get(name))
    if flat:
        out[OPTIMIZER] = flat
    return out, list(dict.fromkeys(missing))


def split_optimizer(flat: Mapping[str, Any], params: set[str]) -> tuple[dict[str, dict[str, Any]],
                                                                         dict[str, dict[str, Any]]]:
    """A flattened optimizer's entries as (state by parameter, group options by parameter), for ``params``."""
    states: dict[str, dict[str, Any]] = {}
    options: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        name = _param_of(key, params)
        if name is None:
            continue
        section = key.split(".", 1)[0]
        field = key[len(section) + len(name) + 2:]
        (states if section == "state" else options).setdefault(name, {})[field] = value
    return states, options


def flatten_optimizer(named: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A plain optimizer over ``named`` parameters in torch's flattened layout (``state.<name>.<k>``,
    ``param_groups.<name>.<option>``)."""
    name_of = {id(p): n for n, p in named.items()}
    flat: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = name_of.get(id(p))
            if name is None:
                continue
            for k, v in optimizer.state.get(p, {}).items():
                flat[f"state.{name}.{k}"] = v
            for k, v in group.items():
                if k not in GROUP_SKIP:
                    flat[f"param_groups.{name}.{k}"] = v
    return flat


def load_optimizer(named: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                   flat: Mapping[str, Any], device: torch.device) -> None:
    """Put a flattened optimizer's entries into a plain optimizer over ``named`` parameters."""
    states, options = split_optimizer(flat, set(named))
    for name, state in states.items():
        optimizer.state[named[name]] = {k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() else v
                                        for k, v in state.items()}
    for name, opts in options.items():
        for group in optimizer.param_groups:
            if any(p is named[name] for p in group["params"]):
                group.update(opts)


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
    states, options = split_optimizer(template.get(OPTIMIZER) or {}, {n for n, _ in stage.params()})
    stage.load_optimizer(states, [{"options": o, "params": [n]} for n, o in options.items()])
