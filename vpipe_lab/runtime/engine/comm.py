"""Point-to-point transfers between neighbouring stages and the small collectives of the iteration boundary.

A transfer is a fixed-size header of shapes and dtypes followed by one message per tensor. On the pipeline's hot path
(activations, gradients, targets) the header is sent only once per *shape epoch*: the first transfer of each kind
between two ranks after ``reset_shapes`` carries it, and every later one is only its tensors, which the receiver can
then allocate and post ahead of need (``post_recv``), as torch.distributed.pipelining does after its shape
inference. All ranks reset at the same iteration boundary (plan change, new input shapes), so sender and receiver
always agree whether a header comes. Sends and receives are queued and issued together with
``torch.distributed.batch_isend_irecv``, which NCCL needs (it ignores tags and can deadlock on unbatched
bidirectional isend/irecv between the same pair); on gloo, where each operation is its own request anyway, they go
straight to the process group's ``send`` / ``recv``, without the Python wrappers' per-call cost. A value that is
not a tensor or a tuple of tensors (a dict, a tuple with ``None`` or numbers in it) travels with its structure as
JSON in a first uint8 tensor, flagged in the header, and arrives as it was sent. Every wait has the process
group's timeout. Control blobs cross as JSON in uint8 tensors: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vpipe_lab.runtime.engine.loop_thread import QuietLoop
from vpipe_lab.runtime.model.batches import describe, rebuild

TAG_FORWARD, TAG_BACKWARD, TAG_MIGRATE, TAG_TARGET, TAG_EVAL, TAG_EVAL_TARGET = 1, 2, 3, 4, 5, 6
MAX_TENSORS = 32
_DIMS = 8
_SLOT = 3 + _DIMS
_HEAD = 2  # [tensor count, 1 if the first tensor is the JSON structure of the value]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODE = {dt: i for i, dt in enumerate(DTYPES)}


def _on_wire(t: torch.Tensor) -> torch.Tensor:
    """What goes over the wire for ``t``: a complex tensor (Llama 4's rotary ``freqs_cis`` crosses its stages) as
    its real view, which gloo and NCCL carry; a receive into that view fills the complex buffer."""
    return torch.view_as_real(t) if t.is_complex() else t


class CommError(RuntimeError):
    """A transfer between stages failed or timed out."""


def as_tensors(value: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise CommError(f"a stage boundary can carry a tensor or a tuple of tensors, not {type(value).__name__}")


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, tuple) and all(isinstance(v, torch.Tensor)
                                                                                for v in value))


def _json_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


class _Posted:
    """Runs a torch.distributed call, turning gloo's errors (raised when posting, too) into CommError. The hot path's
    is built once per Peer: a guard class defined per transfer cost more than posting the transfer itself."""

    def __init__(self, what: str, rank: int) -> None:
        self.what, self.rank = what, rank

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, RuntimeError) and not isinstance(exc, CommError):
            raise CommError(f"rank {self.rank}: {self.what} failed: {exc}") from None


Slot = tuple[int, bool, tuple[int, ...]]  # dtype code, requires_grad, shape


@dataclass(frozen=True)
class Meta:
    """What a transfer carries: its structure (None for a tensor or tuple of tensors) and each tensor's slot."""

    structure: str | None
    slots: tuple[Slot, ...]


@dataclass
class Incoming:
    """A receive posted (or queued to be): its header or its buffers, and the requests that fill them."""

    src: int
    tag: int
    agreed: bool
    meta: Meta | None = None
    header: torch.Tensor | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)


def _meta(value: Any, exact: bool = False) -> tuple[Meta, tuple[torch.Tensor, ...]]:
    if _plain(value) and not exact:
        tensors = as_tensors(value)
        structure = None
    else:
        try:
            desc, leaves = describe(value)
        except TypeError as exc:
            raise CommError(f"cannot send this value between stages: {exc}") from None
        tensors, structure = tuple(leaves), json.dumps(desc)
    for t in tensors:
        if t.dim() > _DIMS or t.dtype not in _CODE:
            raise CommError(f"cannot send a {t.dim()}-d {t.dtype} tensor between stages")
    return Meta(structure, tuple((_CODE[t.dtype], t.requires_grad, tuple(t.shape)) for t in tensors)), tensors


def _header(meta: Meta) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The header tensor and the JSON structure tensor (if any) that precede a transfer's tensors."""
    extra = [torch.frombuffer(bytearray(meta.structure.encode()), dtype=torch.uint8)] if meta.structure else []
    slots = [(_CODE[torch.uint8], False, tuple(extra[0].shape))] if extra else []
    slots += list(meta.slots)
    if len(slots) > MAX_TENSORS:
        raise CommError(f"a boundary carries at most {MAX_TENSORS} tensors, this one {len(slots)}")
    header = torch.zeros(_HEAD + MAX_TENSORS * _SLOT, dtype=torch.int64)
    header[0], header[1] = len(slots), int(meta.structure is not None)
    for i, (code, grad, shape) in enumerate(slots):
        base = _HEAD + i * _SLOT
        header[base], header[base + 1], header[base + 2] = code, int(grad), len(shape)
        header[base + 3:base + 3 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return header, extra


def _slots(header: torch.Tensor) -> list[Slot]:
    header = header.cpu()
    out = []
    for i in range(int(header[0])):
        base = _HEAD + i * _SLOT
        shape = tuple(int(x) for x in header[base + 3:base + 3 + int(header[base + 2])])
        out.append((int(header[base]), bool(header[base + 1]), shape))
    return out


def shares_core_with_transport(device: torch.device) -> bool:
    """Whether this process posts gloo transfers from the one CPU core its gloo event-loop thread also runs on (a
    CPU worker pinned to one core: ``device.pin_cores``); then its posts run in a ``loop_thread.QuietLoop``."""
    return device.type != "cuda" and hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1


class Peer:
    """Transfers for one rank, on ``device`` (CPU for gloo, the stage's GPU for NCCL)."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float, base: int = 0,
                 replicas: int = 1) -> None:
        self.rank = rank  # in the whole job: collectives (boundary agreement, broadcasts) span every rank
        self.world = world
        # Point-to-point transfers name *stages* of this rank's pipeline replica: stage s is global rank base + s.
        self.base, self.replicas = base, replicas
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        # Receives may be posted ahead of need on gloo; on NCCL a lone receive posted before a send to the same
        # peer blocks that peer's stream, so there receives are posted only in the batch that needs them.
        self.prepost = device.type != "cuda"
        # Sends in flight, with the tensors they read: 1F1B has neighbours sending to each other at once (activations
        # one way, gradients the other), so a send must not wait for the receiver before the next action runs.
        self._pending: list[tuple[list[Any], list[torch.Tensor], str]] = []
        # P2P operations not issued yet: (send?, tensor, global rank, tag, where the request goes)
        self._queue: list[tuple[bool, torch.Tensor, int, int, list[Any]]] = []
        # On gloo every operation is its own request anyway, and dist.batch_isend_irecv's checks and coalescing
        # (with a guard object built per call) took 0.11 ms to post one send, 0.06 ms straight to the process group;
        # that is on 1F1B's critical path twice per micro-batch. NCCL needs the batch (see above).
        self._direct = device.type != "cuda"
        # the posting window of a worker on one core: gloo's loop thread kept from preempting it (loop_thread.py)
        self._quiet: AbstractContextManager[None] = QuietLoop() if shares_core_with_transport(device) else nullcontext()
        self._guard = _Posted("transfer", rank)
        self._sent: dict[tuple[int, int], Meta] = {}  # (dst, tag) -> what the receiver was told, this shape epoch
        self._known: dict[tuple[int, int], Meta] = {}  # (src, tag) -> what the sender announced, this shape epoch
        self.messages = 0  # point-to-point messages sent, headers included (for tests and benchmarks)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: {what} failed or timed out after {self.timeout}: {exc}") from None

    def reset_shapes(self) -> None:
        """Start a new shape epoch: the next transfer of each kind carries its header again. Every rank calls this
        at the same iteration boundary."""
        self._sent.clear()
        self._known.clear()

    def knows(self, src: int, tag: int) -> bool:
        return (src, tag) in self._known

    # --- queueing and issuing ---------------------------------------------------------------------------------
    def _op(self, send: bool, tensor: torch.Tensor, peer: int, tag: int, sink: list[Any]) -> None:
        self.messages += send
        self._queue.append((send, tensor, self.base + peer, tag, sink))

    def issue(self) -> None:
        """Post every queued send and receive as one batch (on gloo: each straight to the process group)."""
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        with self._guard:
            if self._direct:
                group = dist.group.WORLD
                assert group is not None, "the process group is not initialised"
                with self._quiet:
                    for send, tensor, rank, tag, sink in queue:
                        sink.append(group.send([tensor], rank, tag) if send else group.recv([tensor], rank, tag))
                return
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor, rank, tag=tag)
                                            for send, tensor, rank, tag, _ in queue])
        if len(works) == len(queue):  # one request per operation
            for (*_, sink), work in zip(queue, works):
                sink.append(work)
        else:  # one request for the whole coalesced batch (NCCL)
            for *_, sink in queue:
                sink.extend(works)

    def post_send(self, value: Any, dst: int, tag: int, agreed: bool = False, exact: bool = False) -> None:
        """Queue a send of a tensor, a tuple of tensors, or any structure of tensors and JSON-able values. With
        ``agreed`` the header goes only with the first send of this kind in the shape epoch. A tensor or a tuple of
        tensors arrives as a tuple, unless ``exact`` sends its structure too (then it arrives as it was sent)."""
        meta, tensors = _meta(value, exact)
        key = (dst, tag)
        told = self._sent.get(key) if agreed else None
        if told is None:
            header, extra = _header(meta)
            first = [header, *extra]
            if agreed:
                self._sent[key] = meta
        elif told != meta:
            raise CommError(f"rank {self.rank}: what crosses to rank {dst} changed within an iteration's shape epoch "
                            f"(was {told.slots}, now {meta.slots}) although the input's shapes did not: a stage "
                            "boundary's shapes must follow from the batch's shapes")
        else:
            first = []
        payload = [t.detach().to(self.device).contiguous() for t in tensors]
        first = [t.to(self.device) for t in first]
        sink: list[Any] = []
        self._pending.append((sink, [*first, *payload], f"send to rank {dst}"))
        for t in (*first, *payload):
            self._op(True, _on_wire(t), dst, tag, sink)

    def post_recv(self, src: int, tag: int, agreed: bool = False) -> Incoming:
        """Queue a receive; with ``agreed`` and the shapes known this epoch, straight into fresh buffers."""
        meta = self._known.get((src, tag)) if agreed else None
        inc = Incoming(src, tag, agreed, meta)
        if meta is None:
            inc.header = torch.zeros(_HEAD + MAX_TENSORS * _SLOT, dtype=torch.int64, device=self.device)
            self._op(False, inc.header, src, tag, inc.works)
        else:
            inc.buffers = [torch.empty(shape, dtype=DTYPES[code], device=self.device) for code, _, shape in meta.slots]
            for t in inc.buffers:
                self._op(False, _on_wire(t), src, tag, inc.works)
        return inc

    def wait(self, inc: Incoming) -> Any:
        """The value of a posted receive: a tuple of tensors, or the structure the sender sent when it was not one."""
        what = f"receive from rank {inc.src}"
        self.issue()
        for work in inc.works:
            self._wait(work, what)
        inc.works = []
        if inc.meta is None:  # the header came first: now the structure and the tensors it announces
            assert inc.header is not None
            slots = _slots(inc.header)
            structured = bool(int(inc.header[1].item()))
            buffers = [torch.empty(shape, dtype=DTYPES[code], device=self.device) for code, _, shape in slots]
            for t in buffers:
                self._op(False, _on_wire(t), inc.src, inc.tag, inc.works)
            self.issue()
            for work in inc.works:
                self._wait(work, what)
            structure = bytes(buffers[0].cpu().numpy()).decode() if structured else None
            inc.buffers = buffers[1:] if structured else buffers
            inc.meta = Meta(structure, tuple(slots[1:] if structured else slots))
            if inc.agreed:
                self._known[(inc.src, inc.tag)] = inc.meta
        if inc.meta.structure is not None:
            return rebuild(json.loads(inc.meta.structure), inc.buffers)
        return tuple(inc.buffers)

    # --- plain transfers (control, migration): a header every time ----------------------------------------------
    def send(self, value: Any, dst: int, tag: int) -> None:
        """Send a tensor, a tuple of tensors, or any structure of tensors and JSON-able values (dicts, None)."""
        self.post_send(value, dst, tag)
        self.issue()

    def recv(self, src: int, tag: int) -> Any:
        """A tuple of tensors, or the structure the sender sent when it was not one."""
        return self.wait(self.post_recv(src, tag))

    def flush(self) -> None:
        """Wait for every send in flight (end of an iteration, before a migration)."""
        self.issue()
        pending, self._pending = self._pending, []
        for works, _, what in pending:
            for work in works:
                self._wait(work, what)

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src`` sends ``obj`` as JSON to every rank; everyone returns it."""
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        data = b""
        if self.rank == src:
            data = json.dumps(obj).encode()
            length[0] = len(data)
        with _Posted("boundary broadcast", self.rank):
            work = dist.broadcast(length, src, async_op=True)
        self._wait(work, "boundary broadcast")
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        with _Posted("boundary broadcast", self.rank):
            work = dist.broadcast(buf, src, async_op=True)
        self._wait(work, "boundary broadcast")
        return obj if self.rank == src else json.loads(bytes(buf.cpu().numpy()))

    def _all_reduce(self, values: Sequence[float], op: Any) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        with _Posted("boundary all-reduce", self.rank):
            work = dist.all_reduce(t, op=op, async_op=True)
        self._wait(work, "boundary all-reduce")
        return [float(x) for x in t.cpu()]

    def all_max(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def send_json(self, obj: Any, dst: int, tag: int) -> None:
        data = json.dumps(obj).encode()
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag)

    def recv_json(self, src: int, tag: int) -> Any:
        return json.loads(bytes(self.recv(src, tag)[0].cpu().numpy()))

    def all_reduce_sum(self, tensor: torch.Tensor, group: Any = None) -> None:
        """Sum ``tensor`` in place over ``group`` (the ranks that hold a tied parameter)."""
        with _Posted("tied-parameter all-reduce", self.rank):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._wait(work, "tied-parameter all-reduce")

    def barrier(self) -> None:
        self.all_max([0.0])
