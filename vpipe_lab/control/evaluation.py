"""How ``Session.evaluate`` names its data to the workers: a reference they can load, never a pickle on a socket."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

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
