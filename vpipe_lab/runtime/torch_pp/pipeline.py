"""An export bundle trained by torch.distributed.pipelining: this rank's ``PipelineStage``s and torch's schedule.

``torch_pipeline(model, bundle, rank, ...)`` builds the stages the bundle gives ``rank`` from the user's own model:
an ``nn.Sequential`` by its children's names, any other model with torch's ``pipeline(model, mb_args,
split_spec={split_at: SplitPoint.BEGINNING})``, which keeps the model's own parameter names in each stage. Modules
the plan recomputes are wrapped with ``checkpoint_wrapper`` (non-reentrant, the RNG state replayed); modules it
offloads run under ``torch.autograd.graph.save_on_cpu``. The schedule is torch's class of the bundle's name when one
runs exactly the lab's order, else ``_PipelineScheduleRuntime`` loaded from ``schedule.csv`` (``use_csv=True`` always
loads the CSV). A weight the model ties between modules on different ranks (a GPT's embedding and LM head) is
copied into each stage by torch's split; ``step`` sums its gradient across those ranks after the backward, as
one process's single tensor gets it, so the copies stay equal under any optimizer.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vpipe_lab.core.interop.bundle import Bundle, StageSpec
from vpipe_lab.runtime.engine.shards import like
from vpipe_lab.runtime.memory.ledger import local_tensor
from vpipe_lab.runtime.model.capture import args_kwargs
from vpipe_lab.runtime.torch_pp.sharded_pipeline import Mesh, mesh_of, shard_module, tie_grads, whole_state
from vpipe_lab.wire import bundle_files

log = logging.getLogger(__name__)
WRAPPERS = ("_checkpoint_wrapped_module.", "_offloaded.")  # prefixes our wrappers add to parameter names


class Offloaded(nn.Module):
    """Runs a module with the tensors its forward saves for backward kept in host memory until the backward."""

    def __init__(self, module: nn.Module, pin_memory: bool) -> None:
        super().__init__()
        self._offloaded = module
        self.pin_memory = pin_memory

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory):
            return self._offloaded(*args, **kwargs)


@dataclass(frozen=True)
class Action:
    """One compute action torch ran: its stage, op (F, B, I, W), micro-batch and when (``TorchPipeline.record``)."""

    stage: int
    op: str
    microbatch: int
    start: float
    end: float

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"


def _wrap_method(stage: Any, name: str, op: Callable[[tuple[Any, ...], dict[str, Any]], str], pipe: TorchPipeline,
                 clock: Callable[[], float]) -> None:
    """Note each call of ``stage.name`` (its first argument is the micro-batch) in ``pipe.actions``, and the call
    under way in ``pipe.running`` (left set when it raises: a failure names it)."""
    inner = getattr(stage, name)
    sink = pipe.actions
    assert sink is not None

    def noted(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        letter = op(args, kwargs)
        pipe.running = (stage.stage_index, letter, int(args[0]))
        try:
            out = inner(*args, **kwargs)
        finally:
            sink.append(Action(stage.stage_index, letter, int(args[0]), start, clock()))
        pipe.running = None
        return out

    setattr(stage, name, noted)


def _backward_letter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, ...)``: a full backward (B) or only the
    input's gradient (I)."""
    full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
    return "B" if full else "I"


def plain_name(name: str) -> str:
    """A parameter's name in the user's model: without the prefixes the recompute and offload wrappers add."""
    for prefix in WRAPPERS:
        name = name.replace(prefix, "")
    return name


def _wrap(root: nn.Module, fqn: str, make: Callable[[nn.Module], nn.Module]) -> None:
    parent_path, _, leaf = fqn.rpartition(".")
    try:
        parent = root.get_submodule(parent_path) if parent_path else root
        child = getattr(parent, leaf)
    except AttributeError:
        raise ValueError(f"the stage has no module {fqn!r} to wrap: the bundle was exported for another model") from None
    setattr(parent, leaf, make(child))


def apply_policies(module: nn.Module, spec: StageSpec, device: torch.device) -> nn.Module:
    """Wrap the stage's recompute modules with ``checkpoint_wrapper`` and its offload modules with ``Offloaded``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for fqn in spec.recompute:
        _wrap(module, fqn, lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                        preserve_rng_state=True))
    for fqn in spec.offload:
        _wrap(module, fqn, lambda m: Offloaded(m, pin_memory=device.type == "cuda"))
    return module


class TorchPipeline:
    """One rank's part of a bundle on torch.distributed.pipelining: its stages, their modules and the schedule."""

    def __init__(self, bundle: Bundle, rank: int, stages: list[Any], modules: list[nn.Module], schedule: Any,
                 ties: list[tuple[tuple[str, ...], Any]], mesh: Mesh | None = None) -> None:
        self.bundle, self.rank = bundle, rank  # rank: this rank's place in its pipeline (its stage's rank)
        self.mesh = mesh  # a sharded or replicated bundle's: its place in the data-parallel mesh
        self.stages, self.modules, self.schedule = stages, modules, schedule
        self._ties = ties  # (this rank's names of the tied weight, the process group of the ranks holding it)
        self.actions: list[Action] | None = None  # what ran, once ``record()`` was called
        self.running: tuple[int, str, int] | None = None  # (stage, op, micro-batch) of the action under way

    def record(self, clock: Callable[[], float] = time.perf_counter) -> list[Action]:
        """From now on, note every compute action torch's schedule runs on this rank, in order, with its start and
        end (``clock()``): ``Action(stage, op, micro-batch, start, end)``, op "F", "B" (a full backward), "I" (input
        gradient) or "W" (weight gradients), torch's own letters. The list is ``actions``; clear it as you read."""
        self.actions = []
        for stage in self.stages:
            _wrap_method(stage, "forward_one_chunk", lambda a, k: "F", self, clock)
            _wrap_method(stage, "backward_one_chunk", _backward_letter, self, clock)
            _wrap_method(stage, "backward_weight_one_chunk", lambda a, k: "W", self, clock)
        return self.actions

    @property
    def first(self) -> bool:
        """Whether this rank runs the first stage (it is given the inputs)."""
        return any(s.stage == 0 for s in self.bundle.stages_of(self.rank))

    @property
    def last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss, so it is given the targets)."""
        return any(s.stage == len(self.bundle.stages) - 1 for s in self.bundle.stages_of(self.rank))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the user's model, each once."""
        seen: set[int] = set()
        for module in self.modules:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield plain_name(name), p

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the user's model's names, whole (a sharded stage's gathered: its
        shards call this together)."""
        return whole_state(self.modules, plain_name)

    def tensors(self) -> dict[str, torch.Tensor]:
        """This rank's own parameters and buffers under the model's names, as they are (a sharded stage's DTensors):
        what DCP writes and reads in place."""
        out: dict[str, torch.Tensor] = {}
        for module in self.modules:
            for name, t in module.state_dict(keep_vars=False).items():
                out.setdefault(plain_name(name), t)
        return out

    def step(self, inputs: Any = None, target: Any = None, losses: list[Any] | None = None) -> list[Any] | None:
        """One training iteration: torch's schedule over this rank's stages (``inputs`` go in on the first stage's
        rank, ``target`` on the last's: give both everywhere, each rank takes what it needs; with data-parallel ranks
        (shards, replicas) each takes its share of the global batch, as the lab's do), then the tied weights'
        gradients summed across the ranks that hold a copy. Returns the last stage's micro-batch losses."""
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if self.mesh is not None:
            inputs, target = self.mesh.share(inputs, "inputs"), self.mesh.share(target, "targets")
        if self.first and inputs is not None:
            args, kwargs = args_kwargs(inputs)
        if self.last:
            losses = [] if losses is None else losses
            self.schedule.step(*args, target=target, losses=losses, **kwargs)
        else:
            self.schedule.step(*args, **kwargs)
        self.sync_ties()
        return losses if self.last else None

    def sync_ties(self) -> None:
        """Give every copy of each tied weight the sum of the copies' gradients: over this rank's stages, then
        over the ranks that hold one (one all-reduce per tie)."""
        for names, group in self._ties:
            local = list({id(p): p for m in self.modules for n, p in m.named_parameters()
                          if plain_name(n) in names}.values())
            grads = tie_grads(local)
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(local_tensor(local[0]))
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in local:  # every copy gets the sum (a sharded one, its shard of it)
                if p.grad is None:
                    p.grad = like(total.clone(), p)
                else:
                    local_tensor(p.grad).copy_(total)


def _example(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if example is None:
        raise ValueError("tracing the model needs one micro-batch of its inputs: give example= (a tensor, a tuple "
                         "or a dict of keyword arguments, as the data gives them)")
    return args_kwargs(example)


def skips(split_gm: torch.fx.GraphModule) -> list[str]:
    """Values torch's split passes past a neighbouring stage (stage ``i`` reading what stage ``j < i - 1`` made, or a
    model input past the first stage): torch's multi-stage schedules refuse those."""
    index = {n.name: i for i, n in enumerate(n for n in split_gm.graph.nodes if n.op == "call_module")}
    out = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        me = index[node.name]
        for arg in node.all_input_nodes:
            src = arg.args[0] if arg.op == "call_function" and arg.args else arg
            made = index.get(getattr(src, "name", ""), -1 if getattr(src, "op", "") == "placeholder" else None)
            if made is not None and made < me - 1 and (made >= 0 or me > 0):
                out.append(f"{'the input ' + src.name if made < 0 else f'stage {made}'} -> stage {me}")
    return list(dict.fromkeys(out))


def _sequential_stage(model: nn.Sequential, spec: StageSpec) -> nn.Module:
    children = dict(model.named_children())
    missing = [m for m in spec.modules if m not in children]
    if missing:
        raise ValueError(f"the model has no children {missing[:3]}: the bundle was exported for another model "
                         f"(its children are {', '.join(list(children)[:6])})")
    return nn.Sequential(OrderedDict((m, children[m]) for m in spec.modules))


def _tie_groups(model: nn.Module, every: dict[int, nn.Module], bundle: Bundle) -> list[tuple[tuple[str, ...], list[int]]]:
    """The model's tied weights that the split copied: (all their names, the ranks holding a copy), for every weight
    with more than one copy over all stages (torch's split replicates a weight two stages use)."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    tie_of = {n: tuple(names) for names in aliases.values() if len(names) > 1 for n in names}
    copies: dict[tuple[str, ...], dict[int, set[int]]] = {}
    for s in bundle.stages:
        for name, p in every[s.stage].named_parameters():
            key = tie_of.get(plain_name(name))
            if key is not None:
                copies.setdefault(key, {}).setdefault(s.rank, set()).add(id(p))
    return [(key, sorted(by_rank)) for key, by_rank in copies.items() if sum(map(len, by_rank.values())) > 1]


def torch_pipeline(model: nn.Module, bundle: str | Path | Bundle, rank: int | None = None, *, example: Any = None,
                   loss_fn: Callable[..., torch.Tensor] | None = None, device: torch.device | str | None = None,
                   group: Any = None, use_csv: bool = False, trace: bool | None = None,
                   schedule: str | None = None) -> TorchPipeline:
    """Build ``rank``'s part of the bundle (default: this process's rank in ``group``) from ``model`` (built the
    same way on every rank), ready to train: ``pp.step(inputs, target=..., losses=...)`` then the optimizer's step
    on ``pp.parameters()``. ``example`` is one micro-batch of inputs (needed to trace any model but an
    ``nn.Sequential``); ``loss_fn(output, target)`` is per micro-batch, and gradients are of the micro-batches'
    mean, as the lab trains (``scale_grads``). ``trace`` forces torch's ``pipeline()`` split (or the split by
    module names); ``use_csv`` runs ``schedule.csv`` even where a torch class runs the same order; ``schedule``
    names a ``get_schedule_class`` class to run the bundle's split with instead of the lab's order (torch's own
    schedule on the same stages: it must place stages as the plan does)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    path = None
    if not isinstance(bundle, Bundle):
        path, bundle = Path(bundle), bundle_files.read(bundle)
    if schedule is not None:
        style = "v" if get_schedule_class(schedule).__name__ in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") else "loop"
        if style != bundle.style:
            raise ValueError(f"torch's {schedule} places stages {style}-style, the bundle's plan {bundle.style}-style: "
                             "export the plan under a schedule with that placement")
    if rank is None:
        rank = dist.get_rank(group)
    world = dist.get_world_size(group) if dist.is_initialized() else bundle.ranks
    dev = torch.device(device) if device is not None else torch.device("cpu")
    mesh = None
    if bundle.plan.data_parallel > 1:  # sharded stages or replicas: the lab's mesh, this rank's pipeline in it
        mesh = mesh_of(bundle.plan, rank, world, dev)
        rank, group = mesh.stage, mesh.pipeline_group
    elif world != bundle.ranks:
        raise ValueError(f"the bundle is for {bundle.ranks} pipeline ranks but the process group has {world}: start "
                         f"{bundle.ranks} ranks (torchrun --nproc-per-node {bundle.ranks})")
    mine = bundle.stages_of(rank)
    ready = (lambda module: shard_module(module, mesh, bundle.plan)) if mesh is not None else (lambda module: module)
    total = len(bundle.stages)
    if trace is None:
        trace = not isinstance(model, nn.Sequential)
    if trace:
        every, modules, stages = _traced_stages(model, bundle, mine, example, dev, group, schedule, use_csv, ready)
    else:
        if not isinstance(model, nn.Sequential):
            raise ValueError("only an nn.Sequential splits by module names alone; trace any other model")
        from torch.distributed.pipelining import PipelineStage

        every = {s.stage: _sequential_stage(model, s) for s in bundle.stages}
        modules = {spec.stage: ready(apply_policies(every[spec.stage], spec, dev).to(dev)) for spec in mine}
        stages = [PipelineStage(modules[spec.stage], spec.stage, total, dev, group=group) for spec in mine]
    # Every rank sees every stage's module (torch's split builds them all), so every rank makes the same process
    # groups for the tied weights, in the same order.
    ties: list[tuple[tuple[str, ...], Any]] = []
    pipelines = mesh.place.dps if mesh is not None else 1  # a group per data-parallel pipeline, made by every rank
    for aliases, ranks in _tie_groups(model, every, bundle):
        for dp in range(pipelines):
            members = [dp * bundle.ranks + r for r in ranks]
            pg = dist.new_group(members) if len(ranks) > 1 and dist.is_initialized() else None
            if rank in ranks and (mesh is None or mesh.place.dp == dp):
                ties.append((aliases, pg))
                log.info("stage rank %d sums the gradients of the tied weight %s (ranks %s)", rank, list(aliases),
                         members)
    runner = _runner(bundle, path, stages, schedule or bundle.schedule, use_csv, loss_fn)
    return TorchPipeline(bundle, rank, stages, [modules[s.stage] for s in mine], runner, ties, mesh)


def _traced_stages(model: nn.Module, bundle: Bundle, mine: list[StageSpec], example: Any, dev: torch.device,
                   group: Any, schedule: str | None, use_csv: bool, ready: Callable[[nn.Module], nn.Module]
                   ) -> tuple[dict[int, nn.Module], dict[int, nn.Module], list[Any]]:
    """torch's ``pipeline()`` split at the bundle's split points: every stage's module, this rank's (with their
    policies) and its ``PipelineStage``s. Refuses a split torch's runtime cannot run (inputs read after the first
    stage; values skipping a stage under a multi-stage schedule)."""
    from torch.distributed.pipelining import SplitPoint, pipeline
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    args, kwargs = _example(example)
    split_spec = {s.split_at: SplitPoint.BEGINNING for s in bundle.stages if s.split_at}
    pipe = pipeline(model, args, kwargs or None, split_spec=split_spec)
    if pipe.num_stages != len(bundle.stages):
        raise ValueError(f"torch split the model into {pipe.num_stages} stages, the bundle has {len(bundle.stages)}: "
                         "its split points do not all run in the model's forward")
    passed = skips(pipe.split_gm)
    late = [p for p in passed if p.startswith("the input")]
    if late:
        raise ValueError(f"torch.distributed.pipelining gives the model's inputs to its first stage only, and this "
                         f"model reads some in a later one ({'; '.join(late[:3])}): pass those as the loss's "
                         "targets instead (labels: data returns (inputs, labels) and the loss compares the "
                         "logits), or train it with vpipe_lab's engine")
    runs = schedule or bundle.schedule
    if passed and (use_csv or not runs or not issubclass(get_schedule_class(runs), PipelineScheduleSingle)):
        raise ValueError(f"torch split this model with values that skip a stage ({'; '.join(passed[:3])}), and "
                         "torch.distributed.pipelining's multi-stage schedules (every CSV schedule among them) "
                         "run only stage-to-next-stage transfers; export a plan with one stage per rank under GPipe "
                         "or 1F1B (torch's single-stage schedules pass skipped values on), or train it in the lab")
    every = {s.stage: pipe.get_stage_module(s.stage) for s in bundle.stages}
    modules = {spec.stage: ready(apply_policies(every[spec.stage], spec, dev)) for spec in mine}  # sharded in place
    return every, modules, [pipe.build_stage(spec.stage, dev, group) for spec in mine]


def _runner(bundle: Bundle, path: Path | None, stages: list[Any], name: str | None, use_csv: bool,
            loss_fn: Callable[..., torch.Tensor] | None) -> Any:
    """torch's schedule class ``name`` over this rank's stages, or its CSV runtime running the bundle's
    ``schedule.csv`` (the lab's exact order) when there is no class or ``use_csv``."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        _PipelineScheduleRuntime,
        get_schedule_class,
    )

    if name and not use_csv:
        cls = get_schedule_class(name)
        first = stages[0] if issubclass(cls, PipelineScheduleSingle) else stages
        return cls(first, bundle.microbatches, loss_fn=loss_fn, scale_grads=True)
    runner = _PipelineScheduleRuntime(stages, bundle.microbatches, loss_fn=loss_fn, scale_grads=True)
    csv = bundle_files.csv_path(path, bundle) if path is not None else None
    if csv is None or not csv.exists():
        raise ValueError("the bundle's schedule.csv is not found next to its pipeline.json: give the bundle "
                         "directory, not a Bundle object, to run its CSV")
    runner._load_csv(str(csv))
    return runner
