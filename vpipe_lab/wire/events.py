"""What the workers (and a broker) send back, one typed body each: start-up reports, per-iteration reports,
acknowledgements and answers to commands, migrations, evaluations and failures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vpipe_lab.core.profile import LayerCost
from vpipe_lab.core.settings import Settings
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.codec import RAW, Body, register
from vpipe_lab.wire.jobspec import JobSpec
from vpipe_lab.wire.tensors import TensorMeta


@register
class Hello(Body):
    """A worker process is up (before it builds anything)."""

    TYPE = P.HELLO
    rank: int
    pid: int
    host: str


@register
class Units(Body):
    """Rank 0, started alone (``JobSpec.scout``): the model's partition units, before the others start; or
    (``refused``) why the job cannot run, in one line: a first batch its data-parallel ranks cannot share."""

    TYPE = P.UNITS
    rank: int
    names: list[str]
    refused: str = ""


@register
class Ready(Body):
    """A rank built its stage: where it sits, the plan and layers it holds, and its measured bandwidths."""

    TYPE = P.READY
    rank: int
    stage: int
    replica: int
    layers: int
    names: list[str]
    plan: dict[str, Any]
    device: str
    backend: str
    iteration: int
    swap_bandwidth: float
    link_bandwidth: float
    link_latency_s: float
    update_s_per_byte: float = 0.0  # the optimizer's step per parameter byte (PipeDream's per-micro-batch cost)
    copy_s_per_byte: float = 0.0  # a copy of the weights per byte (PipeDream moving its live weights)
    shard_bandwidth: float = 0.0  # a sharded stage's all-gathers over its shards, bytes/s (0: not sharded)
    units: list[dict[str, Any]] = field(default_factory=list)  # core.interop.bundle.UnitInfo documents, per unit


@register
class IterationReport(Body):
    """One rank's iteration: its time span, its micro-batches' losses (last stage), memory, spans
    (``[kind index, micro-batch, layer or -1, start, end, chunk]``, chunk: the stage's virtual stage) and its optimizer
    step's figures."""

    TYPE = P.ITERATION
    iteration: int
    stage: int
    start: float
    end: float
    losses: list[float]
    memory: dict[str, Any]
    spans: list[tuple[int, int, int, float, float, int]]
    microbatches: int
    plan_version: int = 0
    replica: int = 0
    samples: int | None = None
    sizes: list[int] | None = None
    grad_norm: float | None = None
    lr: float | None = None
    loss_scale: float | None = None
    skipped: bool | None = None
    loss_sum: bool = False  # the losses are micro-batches' shares of the batch's loss (items counted): their sum is it
    # mixture-of-experts layers this rank ran: module -> {"tokens": [per expert], "dropped": count or None}
    experts: dict[str, Any] | None = None


@dataclass
class Refusal(Body):
    """A stage that would not take the layers a plan sends it: it would need ``needed`` bytes of its ``budget``."""

    stage: int
    needed: int
    budget: int


@register
class Ack(Body):
    """Rank 0 took ``command`` (command ``id``) at ``iteration``; the other fields answer particular commands (run:
    ``target``; save: ``path``, ``ok``, ``error``; apply and set_model: ``ok``, ``error``, ``refused`` and the
    migration's figures; set_model: the new ``names``, ``plan`` and ``mapping`` new -> old)."""

    TYPE = P.ACK
    id: int
    command: str
    iteration: int
    target: int | None = None
    ok: bool | None = None
    error: str | None = None
    path: str | None = None
    refused: Refusal | None = None
    moved_bytes: int | None = None
    pause_s: float | None = None
    version: int | None = None
    layers: int | None = None
    names: list[str] | None = None
    plan: dict[str, Any] | None = None
    mapping: dict[str, int | None] | None = None
    units: list[dict[str, Any]] | None = None  # set_model: the new model's units (UnitInfo documents)


@dataclass
class LayerMeasure(Body):
    """One layer's costs as its stage measured them since the last reset (``cost``: the core's own ``LayerCost``,
    with ``times`` per micro-batch size), with its global ``index`` and how many forwards were timed (``samples``). A
    weight tied between layers counts with each of them, and is named in ``shared`` (canonical name -> [its bytes,
    its optimizer state's bytes]). Under a zero-bubble schedule ``cost.backward_s`` is B plus W and
    ``cost.weight_grad_s`` is W."""

    index: int
    cost: LayerCost
    samples: int
    deferrable: float = 1.0  # the share of its parameter elements a split backward defers to W
    shared: dict[str, list[int]] = field(default_factory=dict)


@register
class Layers(Body):
    """A stage's answer to ``Profile``: what it measured of each layer it holds."""

    TYPE = P.LAYERS
    id: int
    stage: int
    layers: list[LayerMeasure]


@register
class Tensors(Body):
    """A stage's answer to ``State``: its tensors' metadata (``wire/tensors.py``) and their raw bytes."""

    TYPE = P.TENSORS
    id: int
    stage: int
    tensors: list[TensorMeta]
    buffers: list[bytes] = field(default_factory=list, metadata=RAW)


@register
class Evaluated(Body):
    """An evaluation's mean ``loss`` over ``batches`` batches (``losses`` per batch), or the ``error`` that stopped it;
    ``id`` is the asking command's (0: a periodic evaluation nobody asked for)."""

    TYPE = P.EVALUATED
    stage: int
    id: int = 0
    iteration: int = 0
    loss: float | None = None
    losses: list[float] = field(default_factory=list)
    batches: int = 0
    seconds: float = 0.0
    error: str = ""


@register
class Migrated(Body):
    """A rank finished a live migration to plan ``version``: what moved and how long training paused."""

    TYPE = P.MIGRATED
    stage: int
    version: int
    iteration: int
    moved_bytes: int
    pause_s: float
    transfer_s: float
    layers_in: list[int]
    layers_out: list[int]
    span: tuple[float, float]


@register
class Failure(Body):
    """Something went wrong on a stage. ``kind`` says what: "exception" (``cause``, ``traceback``: the process
    exits; ``iteration``, ``microbatch`` (-1: none) and ``action`` say where it happened), "budget" (an iteration
    used ``used`` bytes over its ``budget``: dropped, training paused; ``taken`` when its updates were made already,
    under PipeDream, so it counts), "data" (``iteration``'s batch is not like the first, ``cause`` says how: paused
    before it ran), "loss" (``microbatch``'s loss of ``iteration`` is ``cause``, NaN or infinite: paused before the
    step, nothing changed; ``taken`` under PipeDream) or "migration" (the stage refused layers needing ``needed``
    bytes over its ``budget``: nothing moved)."""

    TYPE = P.ERROR
    kind: str
    stage: int
    rank: int | None = None
    replica: int = 0
    iteration: int = -1
    cause: str = ""
    traceback: str = ""
    used: int = 0
    budget: int = 0
    needed: int = 0
    incoming: int = 0
    version: int = 0
    layers: list[list[Any]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    taken: bool = False
    microbatch: int = -1
    action: str = ""


@register
class Current(Body):
    """Rank 0's view of the job as it changes (run state, plan in force), kept by a broker for clients that attach."""

    TYPE = P.CURRENT
    plan: dict[str, Any]
    plan_version: int
    names: list[str]
    iteration: int
    running: bool
    target: int | None
    units: list[dict[str, Any]] = field(default_factory=list)  # core.interop.bundle.UnitInfo documents, per unit
    paused: bool = False  # paused by the user or by an over-budget iteration


@register
class Heartbeat(Body):
    TYPE = P.HEARTBEAT


@register
class Attach(Body):
    TYPE = P.ATTACH


@register
class Detach(Body):
    TYPE = P.DETACH


@dataclass
class JobInfo(Body):
    """What a client attaching to a torchrun job needs to build its Session (``to_spec``)."""

    session_id: str
    settings: dict[str, Any]  # the job's Settings (core/settings.py) as the job file holds them
    master_addr: str = ""
    master_port: int = 0

    def to_spec(self, key: str, address: str) -> JobSpec:
        return JobSpec(session_id=self.session_id, key=key, address=address, master_addr=self.master_addr,
                       master_port=self.master_port, settings=Settings.from_json(self.settings))


@register
class Welcome(Body):
    """A broker's answer to a client's attach: the job, every rank's ``Ready``, the job's ``Current`` view (None until
    rank 0 reported) and how many recorded events follow (the replay)."""

    TYPE = P.WELCOME
    job: JobInfo
    ready: list[Ready]
    current: Current | None
    replay: int
