"""Fault injection for the fault tests: ``VPIPE_LAB_FAULT=<point>:<rank>[:<how>][@<iteration>]``.

Points: ``forward`` (inside a stage's forward pass), ``write`` (where a rank's checkpoint files are written),
``snapshot`` (where a rank's snapshot is written), ``save`` (after a rank wrote its layer files, before the
checkpoint is complete), ``migrate`` (halfway through sending layers), ``start`` (a worker starting on a job that begins
at that iteration, before it joins the process group; its number is the device the worker takes, not its rank: a
replacement whose device is gone). How: ``exit`` (the default: exit at once with
code 17), ``kill`` (SIGKILL itself), ``hang`` (sleep forever), ``slow`` (sleep 3 s, then go on), ``enospc`` (raise
the OSError a full disk raises, where no real full file system can be made). ``@N`` fires only from
iteration N on. Unset, nothing here runs on the hot path but a None check. Under torchrun a fault fires in the job's
first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0): a crash that happened once, which its restart then survives.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    point: str
    rank: int
    how: str = "exit"
    iteration: int = 0


def parse(text: str | None = None) -> Fault | None:
    text = os.environ.get("VPIPE_LAB_FAULT", "") if text is None else text
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    spec, _, at = text.partition("@")
    parts = spec.split(":")
    return Fault(parts[0], int(parts[1]), parts[2] if len(parts) > 2 else "exit", int(at) if at else 0)


def hit(fault: Fault | None, point: str, rank: int, iteration: int = 0) -> None:
    """Fire ``fault`` if it is for this point, rank and iteration."""
    if fault is None or fault.point != point or fault.rank != rank or iteration < fault.iteration:
        return
    log.error("fault injection: %s at %s on rank %d, iteration %d", fault.how, point, rank, iteration)
    if fault.how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.how == "hang":
        while True:
            time.sleep(3600)
    elif fault.how == "slow":
        time.sleep(3.0)
    elif fault.how == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"<injected at {point}>")
    else:
        os._exit(17)
