"""The worker process around a ``Worker``: parse its arguments, watch the controller, join the process group, build
the stage, report READY, serve until STOP, and report any failure with its stage before exiting."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vpipe_lab.runtime.build import unit_names
from vpipe_lab.runtime.engine import faults
from vpipe_lab.runtime.engine.device import pin_cores, select
from vpipe_lab.runtime.model.batches import Source, split
from vpipe_lab.runtime.model.callables import load_callables
from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops
from vpipe_lab.runtime.training.place import Place
from vpipe_lab.runtime.training.replicas import shard
from vpipe_lab.runtime.worker import Worker
from vpipe_lab.wire.channel import Link
from vpipe_lab.wire.events import Failure, Hello, Ready, Units
from vpipe_lab.wire.jobspec import JobSpec

log = logging.getLogger("vpipe_lab.worker")


def watch_parent(fd: int) -> None:
    """Exit as soon as the controller is gone: the pipe's write end closes when its process dies, however it dies."""
    def run() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        log.error("the controller process is gone; exiting")
        os._exit(3)

    threading.Thread(target=run, name="vpipe-parent-watch", daemon=True).start()


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m vpipe_lab.runtime.process")
    ap.add_argument("--config", required=True, help="job spec JSON written by the controller")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--parent-fd", type=int, default=-1, help="pipe whose EOF means the controller died")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps every thread's stack
    if args.parent_fd >= 0:
        watch_parent(args.parent_fd)
    spec = JobSpec.load(Path(args.config))
    world = spec.settings.workers
    return run(spec, args.rank, world, args.rank, world)


def run(spec: JobSpec, rank: int, world: int, local_rank: int, local_world: int,
        worker_cls: type[Worker] | None = None) -> int:
    """A worker started by ``launch()``: connect to the controller, join the process group, serve."""
    # before the link's and torch's threads start
    pin_cores(spec.settings.device, local_rank, local_world, spec.settings.threads)
    torch.set_num_threads(spec.settings.threads)
    link = Link(spec.address, spec.key, f"rank{rank}", session=spec.session_id)
    link.send(Hello(rank, os.getpid(), socket.gethostname()).message())

    def join() -> None:
        # a device that is gone takes down whichever rank is given it: the fault names the device, not the rank
        faults.hit(faults.parse(), "start", spec.devices[local_rank] if spec.devices else local_rank, spec.start_iteration)
        log.info("joining the process group at %s:%d as rank %d of %d", spec.master_addr, spec.master_port, rank, world)
        placement = select(spec.settings.device, local_rank, local_world, spec.devices)
        dist.init_process_group(placement.backend, store=rendezvous(spec.master_addr, spec.master_port, rank, world,
                                                                    spec.settings.timeout),
                                rank=rank, world_size=world, timeout=timedelta(seconds=spec.settings.timeout))

    return serve(spec, rank, world, local_rank, local_world, link, join, worker_cls)


_LISTENERS: list[socket.socket] = []  # rank 0's store socket, kept open for the process's life


def rendezvous(host: str, port: int, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """The job's key-value store, on ``host`` (the session's, loopback unless ``launch(host=...)`` says otherwise):
    rank 0 binds the socket itself and hands it to torch, whose own store would listen on every interface (an
    unauthenticated store anyone on the network could read and write)."""
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(max(64, 2 * world))
    _LISTENERS.append(listener)
    return dist.TCPStore(host, port, world, True, timeout, wait_for_workers=False, master_listen_fd=listener.fileno())


def scout(spec: JobSpec, link: Link) -> None:
    """Rank 0, started alone: cut the model and tell the controller its partition units, so a pipeline the model
    cannot fill is refused before the other ranks start (launch() asks for this when it does not know the model)."""
    fns = load_callables(spec)
    source = Source(fns.data, spec.start_iteration)
    try:  # a first batch the data-parallel ranks cannot share: refused in one line before the others start
        shard(source.peek(spec.start_iteration)[0], 0, spec.settings.data_parallel, "inputs")
    except ValueError as exc:
        link.send(Units(0, [], refused=str(exc)).message())
        return

    def first_inputs() -> Any:
        inputs, _ = source.peek(spec.start_iteration)
        return split(shard(inputs, 0, spec.settings.data_parallel, "inputs"), spec.settings.microbatches, "inputs")[0]

    names = unit_names(fns.model, fns.split, spec.settings.seed, first_inputs)
    log.info("the model has %d partition units", len(names))
    link.send(Units(0, names).message())


def serve(spec: JobSpec, rank: int, world: int, local_rank: int, local_world: int, link: Link,
          join: Any = None, worker_cls: type[Worker] | None = None, on_ready: Any = None) -> int:
    """Build the stage, report READY, run the control loop until STOP; any failure is reported with its stage and
    where it happened (iteration, micro-batch, action)."""
    worker: Worker | None = None
    try:
        allow_torchvision_without_ops()  # user models may import transformers/torchvision (see runtime/model/compat.py)
        if spec.scout and rank == 0:
            scout(spec, link)
        if join is not None:
            join()
        if worker_cls is None and spec.settings.engine == "torch":
            from vpipe_lab.runtime.torch_pp.engine import TorchWorker

            worker_cls = TorchWorker  # type: ignore[assignment]
        worker = (worker_cls or Worker)(spec, rank, world, link, local_rank, local_world)
        worker.peer.barrier()
        bandwidth = worker.probe()
        link.send(Ready(rank, worker.index, worker.replica, worker.num_layers, worker.names, worker.plan.to_dict(),
                        str(worker.placement.device), worker.placement.backend, worker.ctl.iteration,
                        **bandwidth, units=worker.chain.infos()).message())
        if on_ready is not None:
            on_ready(worker)
        worker.loop()
        log.info("stopped cleanly")
        return 0
    except BaseException as exc:  # report anything, even KeyboardInterrupt, with the stage it happened on
        cause = f"{type(exc).__name__}: {exc}"
        place = Place(rank, spec.settings.stages, spec.settings.shards, spec.settings.replicas)
        stage, replica = place.stage, place.dp
        iteration, microbatch, action = _where(worker, spec)
        log.error("%s failed at iteration %s%s (%s): %s", place.describe(), iteration,
                  f", micro-batch {microbatch}" if microbatch >= 0 else "", action, cause)
        link.send(Failure("exception", stage, rank, replica, iteration, cause=cause, traceback=traceback.format_exc(),
                          microbatch=microbatch, action=action).message())
        return 1
    finally:
        link.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the group may be broken by the failure we are reporting
                pass


def _where(worker: Worker | None, spec: JobSpec) -> tuple[int, int, str]:
    """(iteration, micro-batch or -1, what the rank was doing) for a failure report; never raises itself."""
    if worker is None:
        return spec.start_iteration, -1, "building the stage"
    try:
        return worker.where()
    except Exception:  # a half-built worker: the report matters more than its detail
        return -1, -1, ""


def exit_now(code: int) -> None:
    """End the worker process once its work is saved and reported: flush the logs and the standard streams, then
    leave without the interpreter's teardown (collecting a model's and torch's objects one by one took 0.8 s of
    every stop, 2 workers in parallel, for nothing a finished worker needs)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":  # what launch() starts: python -m vpipe_lab.runtime.process
    exit_now(main())
