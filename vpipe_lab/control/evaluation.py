"""``Session.evaluate``: a forward-only pass the workers run between two iterations, on data named by a reference
they can load (never a pickle on a socket)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from vpipe_lab.control.requests import Requests
from vpipe_lab.core import checks
from vpipe_lab.wire.commands import Evaluate
from vpipe_lab.wire.events import Evaluated
from vpipe_lab.wire.private import write_private

_count = itertools.count(1)
JOB_DATA = "job:"  # the workers' own evaluation data, else their training data


def data_ref(job_dir: Path | None, data: Any) -> str:
    """``file:PATH`` of a pickle written into the job directory (a launched session's function or iterable), a
    bundled example name, or 'package.module:attribute'; None is the job's own: its ``eval_data``, else its data."""
    if data is None:
        return JOB_DATA
    if isinstance(data, str):
        return data
    if job_dir is None:
        raise ValueError("an attached session cannot send a function or a DataLoader to the workers; give evaluation "
                         "data as 'package.module:attribute' importable on every node, or a bundled example name")
    import cloudpickle

    path = job_dir / f"eval-{next(_count)}.pkl"
    write_private(path, cloudpickle.dumps(data))
    return f"file:{path}"


def evaluate(requests: Requests, job_dir: Path | None, data: Any, batches: int, timeout: float | None) -> float:
    """The mean loss the workers report for ``batches`` batches of ``data`` (see ``Session.evaluate``)."""
    checks.count(batches, "batches")
    ref = data_ref(job_dir, data)
    reply = requests.gather(Evaluate(ref, batches=batches), Evaluated, 1, timeout)[0]
    if reply.error or reply.loss is None:
        raise ValueError(f"the workers cannot evaluate on {data!r}: {reply.error or 'no loss came back'}")
    return reply.loss
