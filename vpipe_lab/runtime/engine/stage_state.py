"""What a stage's units carry when they move or are saved: values, optimizer state and groups (``Stage``'s part)."""

from __future__ import annotations

from typing import Any

import torch

from vpipe_lab.runtime.engine.optim import StageOptimizer
from vpipe_lab.runtime.memory.ledger import local_tensor
from vpipe_lab.runtime.model.units import Layer


class UnitState:
    """Reads and loads the state of the units a ``Stage`` holds, by canonical tensor name."""

    layers: dict[int, Layer]
    tensors: dict[str, torch.Tensor]
    optim: StageOptimizer

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        raise NotImplementedError  # Stage's: each trainable parameter once, by canonical name

    def optimizer_state(self, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Each parameter's optimizer state by canonical name (all held ones unless ``names``)."""
        return self.optim.state([n for n, _ in self.params()] if names is None else names, self.tensors)

    def unit_groups(self, index: int) -> list[dict[str, Any]]:
        """The optimizer groups of one layer: their options and their parameters' names (what migration moves)."""
        return self.optim.unit_groups(index)

    def unit_state(self, index: int) -> dict[str, Any]:
        """What a layer takes with it when it moves or is saved: its parameters and buffers by canonical name, their
        optimizer state, its optimizer groups' options (a learning rate a scheduler set travels too) and its policy."""
        layer = self.layers[index]
        names = list(dict.fromkeys(layer.names))
        return {"tensors": {name: self.tensors[name].detach() for name in names},
                "optimizer": self.optimizer_state(names), "groups": self.unit_groups(index),
                "policy": layer.policy.value}

    def load_values(self, values: dict[str, torch.Tensor], local: bool = False) -> None:
        """Copy saved values into the parameters and buffers this stage holds (by canonical name); ``local``: the
        values are this rank's shards of a sharded stage's parameters, copied into its shards."""
        with torch.no_grad():
            for name, value in values.items():
                (local_tensor(self.tensors[name]) if local else self.tensors[name]).copy_(value)

    def load_optimizer(self, states: dict[str, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        """Restore saved optimizer state and parameter-group options of the layers held here."""
        self.optim.load(states, groups, self.tensors)
