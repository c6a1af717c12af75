"""Saved-tensor hooks that account for (and, for swapped layers, move) what each layer saves for backward.

Every layer's forward runs under ``saved_tensors_hooks``: a saved tensor becomes a ``Handle`` registered under its
(micro-batch, layer) in the stage's ``Ledger``. For a swapped layer, SWAP_OUT moves the handles' tensors to the host
store and SWAP_IN brings them back before the layer's backward. On CUDA the copies run on a side stream into pinned
buffers and the compute stream waits on their events only when it needs the data; on CPU they are real copies into a
separate host store, and the ledger moves their bytes from device to host. Parameters are never swapped. Pinned
buffers come from torch's caching host allocator (``pin_memory=True``), so the same pinned blocks are reused from one
micro-batch to the next instead of being registered with the driver each time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vpipe_lab.runtime.memory.ledger import Ledger, tensor_bytes


class Handle:
    """One saved tensor of one layer for one micro-batch."""

    __slots__ = ("event", "host", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.nbytes = nbytes
        self.event: Any = None


class SwapEngine:
    """Owns the handles of one stage and the copy stream that moves them."""

    def __init__(self, device: torch.device, ledger: Ledger) -> None:
        self.device = device
        self.ledger = ledger
        self.handles: dict[tuple[int, int], list[Handle]] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.param_storages: set[int] = set()

    def set_parameters(self, module: torch.nn.Module) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}

    @contextmanager
    def recording(self, mb: int, layer: int, swapped: bool = True, held: frozenset[int] = frozenset()
                  ) -> Iterator[None]:
        """Run a layer's forward with its saved tensors counted under (mb, layer); a ``swapped`` layer's are also
        registered (handles that can move them to the host), but for those whose storage is in ``held``: the
        segment's input, which the stage keeps for the backward whatever happens to the layer's copy, so moving it
        would free nothing and cost a copy each way (the cost model keeps it resident: ``CostModel.stage_cost``).
        Others are not held by a handle: autograd frees each as the backward consumes it, which a handle kept to the
        segment's end would prevent (a recomputed layer's rebuild held 2.1 MB more through its backward than the same
        layer kept, on moe-tiny)."""
        seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
        handles = self.handles.setdefault((mb, layer), []) if swapped else []

        def pack(t: torch.Tensor) -> Any:
            ptr = t.untyped_storage().data_ptr()
            if ptr in self.param_storages or t.device != self.device:
                return t
            # A tensor's own bytes (a micro-batch chunk is a view of the whole batch); the same view saved twice by
            # one layer counts once.
            view = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            nbytes = 0 if view in seen else tensor_bytes(t)
            seen.add(view)
            if not swapped or ptr in held:
                self.ledger.add(mb, layer, nbytes)
                return t
            handle = Handle(t, nbytes)
            handles.append(handle)
            self.ledger.add(mb, layer, nbytes)
            return handle

        def unpack(h: Any) -> torch.Tensor:
            if isinstance(h, torch.Tensor):
                return h
            return self._fetch(h)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _fetch(self, h: Handle) -> torch.Tensor:
        if h.tensor is None:  # not prefetched: bring it back now, synchronously
            assert h.host is not None
            h.tensor = h.host.to(self.device)
            h.host = None
        elif h.event is not None:
            torch.cuda.current_stream(self.device).wait_event(h.event)
            h.event = None
        return h.tensor

    def swap_out(self, mb: int, layer: int) -> int:
        """Move the layer's saved tensors of micro-batch ``mb`` to the host store; returns bytes moved."""
        moved = 0
        handles = self.handles.get((mb, layer), [])
        if self.stream is not None and handles:
            # The copies start once the compute that produced the tensors is done, and run beside what follows.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for h in handles:
            if h.tensor is None:
                continue
            t = h.tensor
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t, non_blocking=True)
                    t.record_stream(self.stream)  # the allocator may reuse t's memory only after the copy
                h.host = host
            else:
                h.host = t.detach().clone()  # a real copy into the host store
            h.tensor = None
            moved += h.nbytes
        if moved:
            self.ledger.to_host(mb, layer, moved)
        return moved

    def swap_in(self, mb: int, layer: int) -> int:
        """Start bringing the layer's saved tensors back to the device; returns bytes moved."""
        moved = 0
        for h in self.handles.get((mb, layer), []):
            if h.host is None:
                continue
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    h.tensor = h.host.to(self.device, non_blocking=True)
                    h.event = torch.cuda.Event()
                    h.event.record(self.stream)
            else:
                h.tensor = h.host.clone()
            h.host = None
            moved += h.nbytes
        if moved:
            self.ledger.to_device(mb, layer, moved)
        return moved

    def release(self, mb: int, layer: int) -> None:
        """Forget a layer's saved tensors once its backward has run."""
        self.handles.pop((mb, layer), None)
        self.ledger.release(mb, layer)

    def clear(self) -> None:
        for key in list(self.handles):
            self.release(*key)
