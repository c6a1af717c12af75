"""Saved-tensor hooks that account for (and, for swapped layers, move) what each layer saves for backward.

Every layer's forward runs under ``saved_tensors_hooks``: a saved tensor's bytes are counted under its (micro-batch,
layer) in the stage's ``Ledger``, and for a swapped layer it becomes a ``Handle``, a view of its storage's ``Span``.
SWAP_OUT moves the spans to the host store and SWAP_IN brings them back before the layer's backward. On CUDA the
copies run on a side stream into pinned buffers and the compute stream waits on their events only when it needs the
data; on CPU they are real copies into a separate host store, and the ledger moves their bytes from device to host.
Parameters are never swapped. Pinned buffers come from torch's caching host allocator (``pin_memory=True``), so the
same pinned blocks are reused from one micro-batch to the next instead of being registered with the driver each
time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vpipe_lab.runtime.memory.ledger import Ledger, local_tensor, tensor_bytes


class Span:
    """What one layer saved of one storage (in one dtype) for one micro-batch: the element ranges its saved views
    cover, swapped as one copy of the range from the first to the last, so views that share bytes (a tensor and its
    transpose, q, k and v cut from one projection) move and come back once. ``anchor`` addresses the storage: a saved
    view until the swap out, then the copy brought back (whose element 0 is the storage's ``shift``)."""

    __slots__ = ("anchor", "event", "host", "nbytes", "ranges", "shift")

    def __init__(self, tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        self.anchor: torch.Tensor | None = tensor.detach()
        self.ranges = ranges  # [start, end) in elements, shared with the recording's count of the storage
        self.nbytes = 0  # the bytes the ledger counted for it: the union of the ranges
        self.shift = 0
        self.host: torch.Tensor | None = None
        self.event: Any = None


class Handle:
    """One saved tensor: a view of a ``Span``, rebuilt from it when the backward unpacks it."""

    __slots__ = ("offset", "shape", "span", "stride")

    def __init__(self, span: Span, tensor: torch.Tensor) -> None:
        self.span, self.offset = span, tensor.storage_offset()
        self.shape, self.stride = tuple(tensor.shape), tuple(tensor.stride())


def covered(ranges: list[tuple[int, int]]) -> int:
    """Elements in the union of [start, end) ranges."""
    total, end = 0, None
    for lo, hi in sorted(ranges):
        if end is None or lo > end:
            total, end = total + hi - lo, hi
        elif hi > end:
            total, end = total + hi - end, hi
    return total


def extent(t: torch.Tensor) -> tuple[int, int]:
    """The element range of its storage a strided tensor reaches, [start, end)."""
    start, n = t.storage_offset(), t.numel()
    if n == 0 or t.is_contiguous():  # most saved tensors: their elements, one after another
        return start, start + n
    return start, start + 1 + sum((size - 1) * step for size, step in zip(t.shape, t.stride()))


class SwapEngine:
    """Owns the spans of one stage and the copy stream that moves them."""

    def __init__(self, device: torch.device, ledger: Ledger) -> None:
        self.device = device
        self.ledger = ledger
        self.handles: dict[tuple[int, int], list[Span]] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.param_storages: set[int] = set()
        # A sharded stage's gathered parameters (``engine/shards.py`` keeps this set as it gathers and reshards):
        # weights too, though their storages come and go within the iteration.
        self.gathered: set[int] = set()

    def set_parameters(self, module: torch.nn.Module) -> None:
        self.param_storages = {local_tensor(p).untyped_storage().data_ptr() for p in module.parameters()}

    @contextmanager
    def recording(self, mb: int, layer: int, swapped: bool = True, held: frozenset[int] = frozenset()
                  ) -> Iterator[None]:
        """Run a layer's forward with its saved tensors counted under (mb, layer); a ``swapped`` layer's are also
        registered (spans that can move them to the host), but for those whose storage is in ``held``: the
        segment's input, which the stage keeps for the backward whatever happens to the layer's copy, so moving it
        would free nothing and cost a copy each way (the cost model keeps it resident: ``CostModel.stage_cost``).
        Others are not held by a span: autograd frees each as the backward consumes it, which a span kept to the
        segment's end would prevent (a recomputed layer's rebuild held 2.1 MB more through its backward than the same
        layer kept, on moe-tiny). A layer counts the bytes its saved views cover, each storage's once: T5's blocks
        save views that share bytes (a tensor beside its transpose), 16% of what counting each view would say."""
        counted: dict[tuple[int, torch.dtype], list[tuple[int, int]]] = {}
        spans: dict[tuple[int, torch.dtype], Span] = {}
        registered = self.handles.setdefault((mb, layer), []) if swapped else []

        def pack(t: torch.Tensor) -> Any:
            ptr = t.untyped_storage().data_ptr()
            if ptr in self.param_storages or ptr in self.gathered or t.device != self.device:
                return t
            if t.layout is not torch.strided:  # no storage ranges to merge: counted whole, never moved
                self.ledger.add(mb, layer, tensor_bytes(t))
                return t
            # A micro-batch chunk is a view of the whole batch: a tensor counts the range it reaches, not its storage.
            key, reach = (ptr, t.dtype), extent(t)
            ranges = counted.get(key)
            if ranges is None:  # the first view of this storage (most are): it counts whole
                ranges = counted[key] = [reach]
                nbytes = (reach[1] - reach[0]) * t.element_size()
            else:
                before = covered(ranges)
                ranges.append(reach)
                nbytes = (covered(ranges) - before) * t.element_size()
            self.ledger.add(mb, layer, nbytes)
            if not swapped or ptr in held:
                return t
            span = spans.get(key)
            if span is None:
                span = spans[key] = Span(t, ranges)
                registered.append(span)
            span.nbytes += nbytes
            return Handle(span, t)

        def unpack(h: Any) -> torch.Tensor:
            if isinstance(h, torch.Tensor):
                return h
            span = h.span
            base = span.anchor if span.anchor is not None else self._fetch(span)
            if span.event is not None:
                torch.cuda.current_stream(self.device).wait_event(span.event)
                span.event = None
            return base.as_strided(h.shape, h.stride, h.offset - span.shift)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _fetch(self, span: Span) -> torch.Tensor:
        """Not prefetched: bring the span back now, synchronously."""
        assert span.host is not None
        span.anchor, span.host = span.host.to(self.device), None
        return span.anchor

    def swap_out(self, mb: int, layer: int) -> int:
        """Move the layer's saved tensors of micro-batch ``mb`` to the host store; returns bytes moved."""
        moved = 0
        spans = self.handles.get((mb, layer), [])
        if self.stream is not None and spans:
            # The copies start once the compute that produced the tensors is done, and run beside what follows.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for span in spans:
            if span.anchor is None:  # out already (a span is on the device or on the host, never both)
                continue
            lo, hi = min(a for a, _ in span.ranges), max(b for _, b in span.ranges)
            flat = span.anchor.as_strided((hi - lo,), (1,), lo)  # the storage's bytes from the first view to the last
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                    flat.record_stream(self.stream)  # the allocator may reuse the memory only after the copy
                span.host = host
            else:
                span.host = flat.clone()  # a real copy into the host store
            span.anchor, span.shift = None, lo
            moved += span.nbytes
        if moved:
            self.ledger.to_host(mb, layer, moved)
        return moved

    def swap_in(self, mb: int, layer: int) -> int:
        """Start bringing the layer's saved tensors back to the device; returns bytes moved."""
        moved = 0
        for span in self.handles.get((mb, layer), []):
            if span.host is None:
                continue
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    span.anchor = span.host.to(self.device, non_blocking=True)
                    span.event = torch.cuda.Event()
                    span.event.record(self.stream)
            else:
                span.anchor = span.host.clone()
            span.host = None
            moved += span.nbytes
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
