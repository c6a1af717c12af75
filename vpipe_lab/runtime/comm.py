"""Point-to-point transfers between neighbouring stages and the small collectives of the iteration boundary.

Activations and gradients go directly between workers with plain ``isend``/``irecv``, each preceded by a fixed-size
header of shapes and dtypes so a receiver needs no prior knowledge of them. A value that is not a tensor or a tuple
of tensors (a dict, a tuple with ``None`` or numbers in it) travels with its structure as JSON in a first uint8
tensor, flagged in the header, and arrives as it was sent. Every wait has the process group's timeout. Control blobs
cross as JSON in uint8 tensors: nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vpipe_lab.runtime.batches import describe, rebuild

TAG_FORWARD, TAG_BACKWARD, TAG_MIGRATE, TAG_TARGET = 1, 2, 3, 4
MAX_TENSORS = 32
_DIMS = 8
_SLOT = 3 + _DIMS
_HEAD = 2  # [tensor count, 1 if the first tensor is the JSON structure of the value]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]
_CODE = {dt: i for i, dt in enumerate(DTYPES)}


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


def _posted(what: str, rank: int) -> Any:
    """Run a torch.distributed call, turning gloo's errors (raised when posting, too) into CommError."""
    class _Guard:
        def __enter__(self) -> None:
            return None

        def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
            if isinstance(exc, RuntimeError) and not isinstance(exc, CommError):
                raise CommError(f"rank {rank}: {what} failed: {exc}") from None
            return False

    return _Guard()


class Peer:
    """Transfers for one rank, on ``device`` (CPU for gloo, the stage's GPU for NCCL)."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        # Sends in flight, with the tensors they read: 1F1B has neighbours sending to each other at once (activations
        # one way, gradients the other), so a send must not wait for the receiver before the next action runs.
        self._pending: list[tuple[Any, list[torch.Tensor], str]] = []

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: {what} failed or timed out after {self.timeout}: {exc}") from None

    def send(self, value: Any, dst: int, tag: int) -> None:
        """Send a tensor, a tuple of tensors, or any structure of tensors and JSON-able values (dicts, None)."""
        structured = not _plain(value)
        if structured:
            try:
                desc, leaves = describe(value)
            except TypeError as exc:
                raise CommError(f"cannot send this value between stages: {exc}") from None
            tensors: tuple[torch.Tensor, ...] = (_json_tensor(desc), *leaves)
        else:
            tensors = as_tensors(value)
        if len(tensors) > MAX_TENSORS:
            raise CommError(f"a boundary carries at most {MAX_TENSORS} tensors, this one {len(tensors)}")
        header = torch.zeros(_HEAD + MAX_TENSORS * _SLOT, dtype=torch.int64)
        header[0], header[1] = len(tensors), int(structured)
        for i, t in enumerate(tensors):
            if t.dim() > _DIMS or t.dtype not in _CODE:
                raise CommError(f"cannot send a {t.dim()}-d {t.dtype} tensor between stages")
            base = _HEAD + i * _SLOT
            header[base] = _CODE[t.dtype]
            header[base + 1] = int(t.requires_grad)
            header[base + 2] = t.dim()
            header[base + 3:base + 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        header = header.to(self.device)
        payload = [t.detach().to(self.device).contiguous() for t in tensors]
        keep = [header, *payload]
        what = f"send to rank {dst}"
        with _posted(what, self.rank):
            self._pending.append((dist.isend(header, dst, tag=tag), keep, what))
            for p in payload:
                self._pending.append((dist.isend(p, dst, tag=tag), keep, what))

    def flush(self) -> None:
        """Wait for every send in flight (end of an iteration, before a migration)."""
        pending, self._pending = self._pending, []
        for work, _, what in pending:
            self._wait(work, what)

    def recv(self, src: int, tag: int) -> Any:
        """A tuple of tensors, or the structure the sender sent when it was not one."""
        header = torch.zeros(_HEAD + MAX_TENSORS * _SLOT, dtype=torch.int64, device=self.device)
        with _posted(f"receive from rank {src}", self.rank):
            work = dist.irecv(header, src, tag=tag)
        self._wait(work, f"receive from rank {src}")
        header = header.cpu()
        out = []
        for i in range(int(header[0])):
            base = _HEAD + i * _SLOT
            shape = [int(x) for x in header[base + 3:base + 3 + int(header[base + 2])]]
            t = torch.empty(shape, dtype=DTYPES[int(header[base])], device=self.device)
            with _posted(f"receive from rank {src}", self.rank):
                work = dist.irecv(t, src, tag=tag)
            self._wait(work, f"receive from rank {src}")
            out.append(t)
        if int(header[1]):
            return rebuild(json.loads(bytes(out[0].cpu().numpy())), out[1:])
        return tuple(out)

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src`` sends ``obj`` as JSON to every rank; everyone returns it."""
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        data = b""
        if self.rank == src:
            data = json.dumps(obj).encode()
            length[0] = len(data)
        with _posted("boundary broadcast", self.rank):
            work = dist.broadcast(length, src, async_op=True)
        self._wait(work, "boundary broadcast")
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        with _posted("boundary broadcast", self.rank):
            work = dist.broadcast(buf, src, async_op=True)
        self._wait(work, "boundary broadcast")
        return obj if self.rank == src else json.loads(bytes(buf.cpu().numpy()))

    def _all_reduce(self, values: Sequence[float], op: Any) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        with _posted("boundary all-reduce", self.rank):
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

    def send_tree(self, tree: Any, dst: int, tag: int) -> None:
        """Any structure of tensors and JSON-able values (targets): its description, then its tensors."""
        desc, tensors = describe(tree)
        self.send_json(desc, dst, tag)
        if tensors:
            self.send(tuple(tensors), dst, tag)

    def recv_tree(self, src: int, tag: int, device: torch.device | None = None) -> Any:
        desc = self.recv_json(src, tag)
        count = sum(1 for slot in desc["slots"] if "shape" in slot)
        tensors = list(self.recv(src, tag)) if count else []
        if device is not None:
            tensors = [t.to(device) for t in tensors]
        return rebuild(desc, tensors)

    def all_reduce_sum(self, tensor: torch.Tensor, group: Any = None) -> None:
        """Sum ``tensor`` in place over ``group`` (the ranks that hold a tied parameter)."""
        with _posted("tied-parameter all-reduce", self.rank):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._wait(work, "tied-parameter all-reduce")

    def barrier(self) -> None:
        self.all_max([0.0])
