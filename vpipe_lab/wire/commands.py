"""The commands a controller sends rank 0 (which broadcasts them to every rank at an iteration boundary), one typed
body each. ``id`` ties a command to its acknowledgement and answers; the controller's request layer sets it."""

from __future__ import annotations

from typing import Any

from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.codec import Body, register


class Command(Body):
    """A command: every one carries the id its acknowledgement and answers repeat."""

    id: int


@register
class Run(Command):
    """Train ``iterations`` more iterations (None: until stopped)."""

    TYPE = P.RUN
    id: int = 0
    iterations: int | None = None


@register
class Pause(Command):
    TYPE = P.PAUSE
    id: int = 0


@register
class Resume(Command):
    TYPE = P.RESUME
    id: int = 0


@register
class Stop(Command):
    TYPE = P.STOP
    id: int = 0


@register
class Ping(Command):
    TYPE = P.PING
    id: int = 0


@register
class Apply(Command):
    """Migrate to ``plan`` (``Plan.to_dict()``) as plan ``version``, after a checkpoint at ``checkpoint`` if given;
    ``schedules``: a file in the controller's job directory holding schedule kinds registered after the job started,
    which every rank registers before it reads the plan (a local file, never a pickle on a socket)."""

    TYPE = P.APPLY
    plan: dict[str, Any]
    id: int = 0
    version: int | None = None
    checkpoint: str | None = None
    schedules: str | None = None


@register
class Profile(Command):
    """Every stage answers with its layers' measured costs (``Layers``); ``reset`` starts the measurements anew."""

    TYPE = P.PROFILE
    id: int = 0
    reset: bool = False


@register
class State(Command):
    """Every stage answers with its tensors (``Tensors``)."""

    TYPE = P.STATE
    id: int = 0


@register
class Save(Command):
    """A checkpoint ``name`` under ``path``, keeping the newest ``keep`` there."""

    TYPE = P.SAVE
    path: str
    id: int = 0
    name: str | None = None
    keep: int | None = None


@register
class SetModel(Command):
    """Switch to the model the pickled factory at ``path`` (in the job directory) builds, as plan ``version``;
    ``mapping`` new layer -> old layer (by string index), ``plan`` where the new layers go."""

    TYPE = P.MODEL
    path: str
    id: int = 0
    version: int | None = None
    plan: dict[str, Any] | None = None
    mapping: dict[str, int | None] | None = None
    checkpoint: str | None = None


@register
class Telemetry(Command):
    """Record per-micro-batch spans (``spans``) or only the iteration's totals."""

    TYPE = P.TELEMETRY
    id: int = 0
    spans: bool = True


@register
class Evaluate(Command):
    """An evaluation pass over ``batches`` batches of ``data`` ("job:" the job's own evaluation data, else a
    ``file:`` reference the controller wrote), answered with ``Evaluated``."""

    TYPE = P.EVAL
    data: str
    id: int = 0
    batches: int = 1
