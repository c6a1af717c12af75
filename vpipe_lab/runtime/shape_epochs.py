"""Shape epochs: the micro-batch shapes an iteration runs, agreed by every rank before it runs.

Only rank 0 reads data. When training starts, when the next batch has other shapes than the epoch began with (a
DataLoader's short last batch, a padding collator's new length) and after a plan change (another micro-batch count),
rank 0 describes the coming micro-batches (how many samples each holds, and their distinct shapes) and broadcasts
that. Every rank then knows each micro-batch's share of the samples (the loss weights of an uneven split) and makes
its chain take those shapes (``recapture.py``). Between changes nothing is exchanged: a job whose shapes never change
pays one broadcast when it starts.
"""

from __future__ import annotations

import json
from typing import Any

from vpipe_lab.runtime.build import bind
from vpipe_lab.runtime.engine.comm import Peer
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model.batches import batch_size, describe, signature, split
from vpipe_lab.runtime.model.capture import Chain, to_meta
from vpipe_lab.runtime.model.data_checks import BadBatch, Layout, layout, mismatch
from vpipe_lab.runtime.recapture import Recaptures
from vpipe_lab.runtime.training.replicas import shard


class ShapeEpochs:
    def __init__(self, peer: Peer, recaptures: Recaptures, replica: int, replicas: int, ranks: int) -> None:
        self.peer, self.recaptures, self.replica, self.replicas, self.ranks = peer, recaptures, replica, replicas, ranks
        self.renew = True  # agree before the next iteration (every rank sets it at the same boundary)
        self.sizes: list[int] | None = None  # samples in each micro-batch of this epoch
        self.agreed: str | None = None  # rank 0: the signature of the batch this epoch began with
        self.example: dict[str, Any] | None = None  # this epoch's first micro-batch, described (set_model captures)
        self.first: Layout | None = None  # rank 0: the first batch's keys, dtypes and shapes (data_checks.py)

    def changed(self, inputs: Any, targets: Any) -> bool:
        """Rank 0: whether the next batch has other shapes than the one this epoch began with."""
        return self.agreed is not None and signature(inputs, targets) != self.agreed

    def start(self) -> None:
        """A new epoch begins at this boundary (new shapes, or commands that may change the plan)."""
        self.renew, self.agreed = True, None

    def describe(self, inputs: Any, microbatches: int, sharded: bool = True, targets: Any = None,
                 with_targets: bool = True) -> dict[str, Any]:
        """Rank 0: the coming micro-batches, or why the batch cannot be split into them or is not like the first
        batch (every rank then raises it, before any stage runs it). ``with_targets=False``: only inputs (evaluation)."""
        now = layout(inputs, targets, with_targets)
        if self.first is None:
            self.first = layout(inputs, targets)
        problem = mismatch(self.first, now, inputs_only=not with_targets)
        if problem:
            return {"error": problem, "bad": True}
        try:
            mine = shard(inputs, self.replica, self.replicas, "inputs") if sharded else inputs
            parts = split(mine, microbatches, "inputs")
            shapes = list(dict.fromkeys(json.dumps(describe(p)[0], sort_keys=True) for p in parts))
        except (ValueError, TypeError) as exc:
            return {"error": str(exc), "bad": isinstance(exc, ValueError)}
        return {"sizes": [batch_size(p) or 0 for p in parts], "shapes": [json.loads(s) for s in shapes]}

    def agree(self, description: dict[str, Any] | None, chain: Chain) -> Chain | None:
        """Every rank: take rank 0's ``description``; returns the chain to run these shapes with when it is not
        ``chain`` (its units still to be bound to the stage's tensors), else None."""
        doc = self.peer.broadcast_json(description) if self.ranks > 1 else description
        assert doc is not None
        if "error" in doc:  # the batch's fault: named as such, once (not "ValueError: ValueError: ...")
            raise (BadBatch if doc.get("bad") else TypeError)(doc["error"])
        self.sizes = [int(n) for n in doc["sizes"]]
        self.example = doc["shapes"][0]
        self.renew = False
        return self.recaptures.chain_for(chain, doc["shapes"])

    def adopt(self, chain: Chain, stage: Stage) -> Chain:
        """Every rank: run ``chain`` from now on. The stage's units take its graphs over their own tensors; the units
        of other stages stay shells (a kept capture may still hold a layer that moved away: let it go)."""
        for index in range(len(chain)):
            if index in stage.layers:
                bind(chain.units[index], chain, index, stage.tensors)
                stage.take_module(index, chain.units[index])
            else:
                to_meta(chain.units[index], chain.tensors[index])
        self.peer.reset_shapes()  # what crosses the stage boundaries is the new graph's carry
        return chain

    @property
    def uneven(self) -> bool:
        return self.sizes is not None and len(set(self.sizes)) > 1
