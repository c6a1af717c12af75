"""torchtitan's pipeline settings from a bundle, and a torchtitan config read back as a plan over the lab's units.

torchtitan (0.2 reads ``--job.config_file x.toml``; 0.3 takes the same ``[parallelism]`` fields on its
``Trainer.Config``) places a pipeline with ``pipeline_parallel_degree`` ranks, ``module_fqns_per_model_part`` (the
modules of each torch stage, looped or V-placed by the schedule's class) or ``pipeline_parallel_layers_per_stage``,
runs ``pipeline_parallel_schedule`` (a ``get_schedule_class`` name) or, when ``pipeline_parallel_schedule_csv`` is
set, that CSV with ``_PipelineScheduleRuntime`` (the schedule name then only says where stages go), and splits each
batch into micro-batches of ``pipeline_parallel_microbatch_size`` samples. Activation checkpointing is per model
(every transformer block, or none; 0.2 also every N-th block): per-layer choices that cannot be said so are listed.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from vpipe_lab.core import checks, schedules
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop import torch_schedules
from vpipe_lab.core.interop.bundle import Bundle, UnitInfo, plan_from_parts
from vpipe_lab.core.plan import MAX_MICROBATCHES, Plan, Policy
from vpipe_lab.core.sharding import Sharding

# torch's schedule classes by how they place stages, and how many each rank holds by default (torchtitan's rule).
SINGLE = ("GPipe", "1F1B", "PipelineScheduleSingle")
MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "PipelineScheduleMulti",
         "_PipelineScheduleRuntime")
# torch's class -> the lab schedule that runs it (for one stage per rank / several), and what to say when none does.
LAB = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved-1f1b", "ZBVZeroBubble": "zbv",
       "DualPipeV": "dualpipev"}
CLOSEST = {"LoopedBFS": "interleaved-1f1b", "InterleavedZeroBubble": "zb-h1"}


def parallelism(bundle: Bundle, csv_path: str) -> dict[str, Any]:
    """The ``[parallelism]`` settings that run ``bundle`` (``csv_path``: where torchtitan finds its schedule CSV)."""
    plan = bundle.plan
    out: dict[str, Any] = {
        "pipeline_parallel_degree": plan.stages,
        # with a CSV the class only places the stages (V or looped); torchtitan then runs the CSV
        "pipeline_parallel_schedule": bundle.schedule or torch_schedules.torch_schedule(plan).name,
        "pipeline_parallel_schedule_csv": "" if bundle.schedule else csv_path,
        "module_fqns_per_model_part": [list(s.modules) for s in bundle.stages],
    }
    if bundle.microbatch_size:
        out["pipeline_parallel_microbatch_size"] = bundle.microbatch_size
    # the mesh: FSDP2 shards each stage over data_parallel_shard_degree ranks, HSDP replicates over the other degree
    out["data_parallel_shard_degree"] = plan.shards
    out["data_parallel_replicate_degree"] = plan.replicas
    if plan.shards > 1:
        out["fsdp_reshard_after_forward"] = reshard_policy(plan)
    if any(moe_modules(bundle)):  # each stage holds every expert of its MoE layers (no expert parallelism)
        out["expert_parallel_degree"] = 1
    return out


def reshard_policy(plan: Plan) -> str:
    """torchtitan's one ``fsdp_reshard_after_forward`` for every stage: "always" where every stage reshards after its
    forward (regather, stream), "never" where none does (hold, scatter); stages that differ take the majority, ties
    "always" (the choice that fits memory). torch's pipelining reduces each stage's gradients once per iteration
    whatever the lab's scatter or stream said: torchtitan cannot do that per micro-batch."""
    resharding = sum(plan.sharding_of(s).reshard_after_forward for s in range(plan.stages))
    return "always" if 2 * resharding >= plan.stages else "never"


def moe_modules(bundle: Bundle) -> list[list[str]]:
    """Per model part (torch stage), the FQNs of the mixture-of-experts layers it runs, in forward order."""
    return [[m.module for i in s.units for m in bundle.units[i].moe] for s in bundle.stages]


def _moe_lines(bundle: Bundle) -> list[str]:
    parts = moe_modules(bundle)
    if not any(parts):
        return []
    layers = {m.module: m for u in bundle.units for m in u.moe}
    lines = ["# mixture-of-experts layers per model part (module_fqns_per_model_part's order); each part holds every",
             "# expert of its layers, so expert_parallel_degree = 1:"]
    for part, modules in enumerate(parts):
        said = ", ".join(f"{m} ({layers[m].experts} experts, top-{layers[m].top_k}"
                         + (f", capacity {layers[m].capacity}" if layers[m].capacity else "") + ")" for m in modules)
        lines.append(f"#   part {part}: {said or 'none (dense layers only)'}")
    return lines


def activation(bundle: Bundle) -> tuple[str, list[str]]:
    """torchtitan's activation-checkpoint mode for the plan ("full" or "none") and the per-layer choices it cannot
    express (recomputed or offloaded units it would treat otherwise)."""
    plan, units = bundle.plan, bundle.units
    blocks = [i for i, u in enumerate(units) if u.block_class is not None]
    recomputed = {i for i, p in enumerate(plan.policies) if p is Policy.RECOMPUTE}
    missing = []
    mode = "full" if blocks and set(blocks) <= recomputed else "none"
    covered = set(blocks) if mode == "full" else set()
    for i in sorted(recomputed - covered):
        missing.append(f"recompute {units[i].name} ({', '.join(units[i].modules)})")
    for i, p in enumerate(plan.policies):
        if p is Policy.SWAP:
            missing.append(f"offload {units[i].name} ({', '.join(units[i].modules)}): torchtitan has no activation "
                           "offloading")
    return mode, missing


def _toml_value(value: Any) -> str:
    # JSON's strings, numbers, booleans and arrays are valid TOML values
    return json.dumps(value)


def toml_text(bundle: Bundle, csv_path: str) -> str:
    """``torchtitan.toml``: the ``[parallelism]`` and ``[activation_checkpoint]`` tables (torchtitan 0.2 reads the file
    with ``--job.config_file``; 0.3 takes the same fields, see ``torchtitan_config.py`` beside it)."""
    mode, missing = activation(bundle)
    lines = ["# vpipe_lab's plan for torchtitan: merge these tables into your job's config.",
             f"# {bundle.plan.describe()}", "", "[parallelism]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in parallelism(bundle, csv_path).items()]
    lines += _moe_lines(bundle)
    if not bundle.microbatch_size:
        lines.append("# pipeline_parallel_microbatch_size: batch size / microbatches = "
                     f"batch size / {bundle.microbatches} (the plan was exported without its batch size)")
    lines += ["", "[activation_checkpoint]", f"mode = {_toml_value(mode)}"]
    lines += [f"# not expressible per layer in torchtitan: {m}" for m in missing]
    return "\n".join(lines) + "\n"


def python_text(bundle: Bundle, csv_path: str) -> str:
    """``torchtitan_config.py``: ``apply(config)`` sets the plan on a torchtitan (>= 0.3) ``Trainer.Config``."""
    mode, missing = activation(bundle)
    settings = json.dumps(parallelism(bundle, csv_path), indent=4)
    gaps = "".join(f"#   {m}\n" for m in missing)
    return (f'"""vpipe_lab\'s plan for torchtitan >= 0.3: ``apply(config)`` sets it on your ``Trainer.Config``.\n\n'
            f'{bundle.plan.describe()}\n"""\n\n'
            f"PARALLELISM = {settings}\n"
            f"ACTIVATION_CHECKPOINT = {mode!r}  # 'full': every transformer block; 'none': none\n"
            + (f"# The mixture-of-experts layers of each model part (every expert of a layer on its part):\n"
               f"MOE_MODULES_PER_MODEL_PART = {json.dumps(moe_modules(bundle))}\n" if any(moe_modules(bundle)) else "")
            + (f"# Per-layer choices torchtitan cannot express:\n{gaps}" if gaps else "") +
            "\n\ndef apply(config):\n"
            "    for key, value in PARALLELISM.items():\n"
            "        setattr(config.parallelism, key, value)  # a misspelt field fails here: the config is slotted\n"
            "    if ACTIVATION_CHECKPOINT == 'full':\n"
            "        from torchtitan.distributed.activation_checkpoint import FullAC\n\n"
            "        config.activation_checkpoint = FullAC.Config()\n"
            "    else:\n"
            "        config.activation_checkpoint = None\n"
            "    return config\n")


# --- the way back: a torchtitan config as a plan over the lab's units ----------------------------------------------
def read_toml(text: str, units: Sequence[UnitInfo], **kw: Any) -> Plan:
    """``read`` on a torchtitan TOML job config (its ``[parallelism]``, ``[training]`` and ``[activation_checkpoint]``
    tables)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"not a valid TOML torchtitan config: {exc}") from None
    par = doc.get("parallelism")
    if not isinstance(par, Mapping):
        raise PlanError("the torchtitan config has no [parallelism] table: nothing says how to pipeline the model")
    training: Mapping[str, Any] = doc["training"] if isinstance(doc.get("training"), Mapping) else {}
    ac: Mapping[str, Any] = (doc["activation_checkpoint"] if isinstance(doc.get("activation_checkpoint"), Mapping)
                             else {})
    # A keyword given as None is not given: the config's own values count then (a caller passes every keyword).
    if kw.get("batch_size") is None:
        kw["batch_size"] = training.get("local_batch_size") or training.get("batch_size")
    if kw.get("activation") is None:
        kw["activation"] = ac.get("mode")
    return read(par, units, **kw)


def read(par: Mapping[str, Any], units: Sequence[UnitInfo], *, batch_size: int | None = None,
         microbatches: int | None = None, csv_text: str | None = None, activation: str | None = None) -> Plan:
    """A torchtitan ``[parallelism]`` mapping as a plan over ``units``. The micro-batch count is ``microbatches``, or
    ``batch_size`` / ``pipeline_parallel_microbatch_size``; ``csv_text`` is the schedule CSV the config names (its
    order must be one the lab runs); ``activation`` "full" recomputes every repeated block."""
    _check(par)
    checks.count(batch_size, "batch_size", optional=True, error=PlanError)
    checks.count(microbatches, "microbatches", optional=True, error=PlanError, maximum=MAX_MICROBATCHES)
    degree = par.get("pipeline_parallel_degree") or 1
    name = par.get("pipeline_parallel_schedule") or "1F1B"
    known = {n.lower(): n for n in (*SINGLE, *MULTI)}
    if name.lower() not in known:
        raise PlanError(f"unknown pipeline_parallel_schedule {name!r}: torch knows {', '.join((*SINGLE, *MULTI))}")
    name = known[name.lower()]
    parts = par.get("module_fqns_per_model_part")
    if parts is None:
        parts = _generated_parts(par, units, degree, name)
    if len(parts) % degree:
        raise PlanError(f"{len(parts)} model parts do not divide among pipeline_parallel_degree={degree} ranks")
    virtual = len(parts) // degree
    if microbatches is None:
        size = par.get("pipeline_parallel_microbatch_size", 1)
        if not batch_size:
            raise PlanError("the config gives no batch size, so the number of micro-batches is not known: pass "
                            "batch_size= (training.local_batch_size) or microbatches=")
        if not isinstance(size, int) or size < 1 or batch_size % size:
            raise PlanError(f"pipeline_parallel_microbatch_size={size!r} does not divide the batch of {batch_size}")
        microbatches = batch_size // size
    schedule = _lab_schedule(name, virtual)
    policies = None
    if activation == "full":
        policies = tuple(Policy.RECOMPUTE if u.block_class is not None else Policy.KEEP for u in units)
    csv_given = bool(par.get("pipeline_parallel_schedule_csv"))
    plan = plan_from_parts(parts, units, microbatches=microbatches, schedule=schedule, virtual_stages=virtual,
                           policies=policies)
    if csv_given:
        if csv_text is None:
            raise PlanError("the config names a schedule CSV: pass its text (csv_text=) to read the order it runs")
        plan = _from_csv(csv_text, plan)
    return _with_mesh(plan, par)


def _with_mesh(plan: Plan, par: Mapping[str, Any]) -> Plan:
    """The plan on the config's data-parallel mesh: its shard degree (-1, torchtitan's "the rest", is not known
    without the world size: taken as 1), replicate degree and reshard policy ("default" under PP: "never")."""
    shards = par.get("data_parallel_shard_degree", 1)
    shards = 1 if shards == -1 else shards
    replicas = par.get("data_parallel_replicate_degree", 1)
    policy = par.get("fsdp_reshard_after_forward", "default")
    mode = Sharding.REGATHER if policy == "always" else Sharding.HOLD
    return plan.with_mesh(shards=shards, replicas=replicas,
                          sharding=(mode,) * plan.stages if shards > 1 and policy == "always" else None)


# torchtitan's [parallelism] keys the lab reads, with what each must hold: a config is a file from someone else, read
# before it is used (a wrong type raised TypeError deep in the reader).
_COUNTS = ("pipeline_parallel_degree", "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage")
_LESS = ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers")


def _check(par: Mapping[str, Any]) -> None:
    """Refuse (PlanError naming the key) a ``[parallelism]`` value of the wrong type or range."""
    for key in _COUNTS:
        checks.count(par.get(key), key, optional=True, error=PlanError, maximum=1 << 20)
    for key in _LESS:
        checks.count(par.get(key), key, 0, optional=True, error=PlanError, maximum=1 << 20)
    for key in ("data_parallel_shard_degree", "data_parallel_replicate_degree"):
        value = par.get(key)
        if value is not None and value != -1:
            checks.count(value, key, error=PlanError, maximum=1 << 20)
    if par.get("fsdp_reshard_after_forward", "default") not in ("default", "always", "never"):
        raise PlanError(f"fsdp_reshard_after_forward must be 'default', 'always' or 'never', got "
                        f"{par.get('fsdp_reshard_after_forward')!r:.80}")
    for key in ("pipeline_parallel_schedule", "pipeline_parallel_schedule_csv"):
        if par.get(key) is not None and not isinstance(par.get(key), str):
            raise PlanError(f"{key} must be a string, got {par.get(key)!r:.80}")
    parts = par.get("module_fqns_per_model_part")
    if parts is not None and not (isinstance(parts, list) and parts and all(
            isinstance(part, list) and part and all(isinstance(n, str) for n in part) for part in parts)):
        raise PlanError(f"module_fqns_per_model_part must be a non-empty list of non-empty lists of module names, got "
                        f"{parts!r:.80}")


def _lab_schedule(name: str, virtual: int) -> str:
    if name in LAB and (virtual > 1) == schedules.get(LAB[name]).chunked:
        return LAB[name]
    if name == "InterleavedZeroBubble" and virtual == 1:
        return "zb-h1"  # torch's ZB1P; the lab's ZB-H1 holds one more W back on the first stages (torch_schedules)
    if name in ("PipelineScheduleSingle", "PipelineScheduleMulti", "_PipelineScheduleRuntime"):
        return "1f1b" if virtual == 1 else "interleaved-1f1b"  # placeholders: the CSV decides (``_from_csv``)
    closest = CLOSEST.get(name, LAB.get(name, "1f1b"))
    raise PlanError(f"the lab does not run torch's {name} with {virtual} stage(s) per rank; its closest schedule is "
                    f"{closest!r}: change pipeline_parallel_schedule, or import with another schedule")


def _from_csv(text: str, plan: Plan) -> Plan:
    found = torch_schedules.read_csv(text)
    candidates = [Plan(plan.boundaries, plan.policies, plan.microbatches, k.name, plan.virtual_stages)
                  for k in schedules.kinds() if not k.asynchronous and k.chunked == (plan.virtual_stages > 1)
                  and k.check_virtual(plan.virtual_stages) is None]
    match = torch_schedules.schedule_of_rows(found, candidates)
    if match is None:
        raise PlanError("the schedule CSV runs an order that is none of the lab's schedules "
                        f"({', '.join(c.schedule for c in candidates)}) for these stages and micro-batches: the lab "
                        "cannot run it as it is")
    return match


def _generated_parts(par: Mapping[str, Any], units: Sequence[UnitInfo], degree: int, name: str) -> list[list[str]]:
    """What torchtitan generates without ``module_fqns_per_model_part``: ``pipeline_parallel_layers_per_stage`` (or
    1 stage per rank for single-stage schedules, 2 otherwise) spread over the blocks, the embedding counting as
    ``pipeline_parallel_first_stage_less_layers`` layers and the output as ``..._last_stage_less_layers``."""
    kinds = [("pre" if u.kind == "pre" else "post" if u.kind == "post" else "block") for u in units]
    if not (len(units) >= 3 and kinds[0] == "pre" and kinds[-1] == "post" and set(kinds[1:-1]) == {"block"}):
        raise PlanError("without module_fqns_per_model_part torchtitan spreads transformer layers between an "
                        "embedding and an output; this model's units are not shaped so: list the modules per part")
    layers = len(units) - 2
    first, last = (1 if par.get(key) is None else int(par[key]) for key in _LESS)  # torchtitan's defaults: 1
    per = par.get("pipeline_parallel_layers_per_stage")
    if per is not None:
        stages = math.ceil((layers + first + last) / int(per))
    else:
        stages = degree * (1 if name in SINGLE else 2)
    effective = layers + first + last
    base, extra = divmod(effective, stages)
    if base == 0 or first > base or last > base or stages > effective:
        raise PlanError(f"{stages} stages over {layers} layers (+{first} +{last} for the embedding and output) leave "
                        "a stage without layers: torchtitan would refuse this too")
    counts = []
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        counts.append(n - (first if s == 0 else last if s == stages - 1 else 0))
    parts: list[list[str]] = []
    block = 1
    for s, n in enumerate(counts):
        part = list(units[0].modules) if s == 0 else []
        take = max(0, min(n, len(units) - 1 - block))
        part += [m for u in units[block:block + take] for m in u.modules]
        block += take
        if s == stages - 1:
            part += list(units[-1].modules)
        parts.append(part)
    return parts
