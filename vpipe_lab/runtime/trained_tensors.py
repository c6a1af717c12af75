"""A stage's trained tensors in the wire's tensor format (``wire/tensors.py``), named as ``model.state_dict()``."""

from __future__ import annotations

from vpipe_lab.runtime.engine.shards import whole
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model.capture import Chain
from vpipe_lab.wire.tensors import TensorMeta, encode


def pack_state(stage: Stage, chain: Chain | None = None) -> tuple[list[TensorMeta], list[bytes]]:
    """The stage's parameters and buffers, each once, by canonical name in layer order, each with every name
    ``model.state_dict()`` gives it and that name's place there (``aliases``: a tied weight has several); the
    tensors ``model.state_dict()`` leaves out (non-persistent buffers, and constants the capture lifted into a unit's
    graph, which are no tensor of the model's) stay out. Without a chain: canonical names. A sharded stage's
    parameters are gathered whole, so every shard of the stage calls this together."""
    meta, buffers = [], []
    seen: set[str] = set()
    place = {key: i for i, key in enumerate(chain.state_keys)} if chain is not None else {}
    for index in stage.owned:
        for name in stage.layers[index].names:
            if name in seen or (chain is not None and (name in chain.non_persistent or name not in chain.aliases)):
                continue
            seen.add(name)
            m, b = encode(name, whole(stage.tensors[name]))  # a sharded parameter gathered whole (collective)
            names = chain.aliases.get(name, [name]) if chain is not None else [name]
            m.aliases = [(alias, place.get(alias, len(place))) for alias in names]
            meta.append(m)
            buffers.append(b)
    return meta, buffers
