"""The wire between controller and workers: messages, the authenticated channel, checkpoint format, job spec,
tensor encoding and private files. No torch: both sides import it."""

from vpipe_lab.core.deprecated import moved
from vpipe_lab.wire import checkpoint_format as _checkpoint_format
from vpipe_lab.wire import snapshot_format as _snapshot_format

# Their names until the workers' runtime/disk/checkpoints.py and snapshots.py made two of each.
moved(f"{__name__}.checkpoint", _checkpoint_format)
moved(f"{__name__}.snapshot", _snapshot_format)
