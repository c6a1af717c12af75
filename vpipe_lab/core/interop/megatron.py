"""Megatron-LM's pipeline layout string for a plan over a transformer stack, and a layout string read back.

Megatron-LM (``--pipeline-model-parallel-layout``, megatron-core's ``PipelineParallelLayerLayout``) writes each
pipeline stage's layers between ``|``: ``E`` the embedding, ``t`` a transformer layer, ``L`` the output layer and loss
(``m`` multi-token prediction), ``x*n`` and ``(...)*n`` for repeats, commas only for the eye. With more stages than
ranks the stages are virtual ones in looped placement (``len(stages) = ranks x virtual``), as the lab's interleaved
1F1B places its chunks. A model fits the string when its units are one embedding part, N repeated blocks of one class
and one output part; Megatron-LM has no V placement, no GPipe and no zero-bubble schedule of these names, and
recomputes the first ``n`` layers of every stage (``--recompute-method block``) or all of them, not any set.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vpipe_lab.core import checks, schedules
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop.bundle import Bundle, UnitInfo
from vpipe_lab.core.plan import Plan, Policy

_SYMBOL = {"pre": "E", "block": "t", "post": "L"}


def stack(units: Sequence[UnitInfo]) -> str | None:
    """Why ``units`` are not a transformer stack Megatron-LM can lay out (None when they are)."""
    classes = {u.block_class for u in units[1:-1]}
    if len(units) < 3 or units[0].kind != "pre" or units[-1].kind != "post" or None in classes or len(classes) != 1:
        shape = ", ".join(u.kind for u in units[:6]) + (", ..." if len(units) > 6 else "")
        return (f"Megatron-LM lays out an embedding, repeated transformer layers of one class and an output layer; "
                f"this model's units are {shape}")
    return None


def layout(plan: Plan, units: Sequence[UnitInfo]) -> str:
    """The ``--pipeline-model-parallel-layout`` string of ``plan`` (PlanError when Megatron-LM cannot place it)."""
    why = stack(units)
    if why is not None:
        raise PlanError(why)
    if plan.placement != tuple(c % plan.stages for c in range(plan.chunks)):
        how = "V placement" if plan.kind.torch is not None and plan.kind.torch.style == "v" else "placement"
        raise PlanError(f"Megatron-LM places virtual stages looped only; {plan.schedule}'s {how} "
                        f"{list(plan.placement)} has no layout string")
    kinds = ["pre"] + ["block"] * (len(units) - 2) + ["post"]
    return "|".join(_compress("".join(_SYMBOL[kinds[i]] for i in plan.chunk_layers(c))) for c in range(plan.chunks))


def _compress(stage: str) -> str:
    """'Etttt' -> 'Et*4': Megatron-LM's own shorthand for a run of three or more layers."""
    return re.sub(r"(t{3,})", lambda m: f"t*{len(m.group(1))}", stage)


def recompute_args(plan: Plan, units: Sequence[UnitInfo]) -> tuple[list[str], list[str]]:
    """Megatron-LM's recompute flags for the plan, and the per-layer choices they cannot express. Megatron-LM's
    ``block`` method recomputes the first ``n`` transformer layers of every stage (all of a stage with fewer)."""
    blocks = range(1, len(units) - 1)
    chunks = [[plan.policies[i] is Policy.RECOMPUTE for i in plan.chunk_layers(c) if i in blocks]
              for c in range(plan.chunks)]
    leading = [flags.index(False) if False in flags else len(flags) for flags in chunks]
    n = max(leading, default=0)
    expressible = all(not any(flags[k:]) and k == min(n, len(flags)) for flags, k in zip(chunks, leading))
    missing = [f"{p.value} {units[i].name}" for i, p in enumerate(plan.policies)
               if p is Policy.SWAP or (p is Policy.RECOMPUTE and (i not in blocks or not expressible))]
    if n == 0 or not expressible:
        return [], missing
    return ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {n}"], missing


def args_text(bundle: Bundle) -> str:
    """``megatron.args``: the Megatron-LM arguments that run the bundle's partition, with notes on what they leave."""
    plan, units = bundle.plan, bundle.units
    text = layout(plan, units)
    flags = [f"--pipeline-model-parallel-size {plan.stages}", f'--pipeline-model-parallel-layout "{text}"',
             f"--num-layers {len(units) - 2}"]
    if bundle.microbatch_size:
        flags.append(f"--micro-batch-size {bundle.microbatch_size}")
    recompute, missing = recompute_args(plan, units)
    flags += recompute
    dp = plan.data_parallel
    notes = [f"# {plan.describe()}",
             f"# global batch: --global-batch-size = {plan.microbatches} micro-batches x micro-batch size x data "
             f"parallel size ({dp})",
             f"# data-parallel size {dp}: launch {plan.stages * dp} ranks (--pipeline-model-parallel-size x {dp}); "
             "Megatron-LM takes it from the world size"]
    if plan.shards > 1:  # Megatron's nearest: the optimizer's state sharded over the data-parallel ranks (ZeRO-1)
        flags.append("--use-distributed-optimizer")
        notes.append(f"# the lab sharded each stage's parameters and gradients too, over {plan.shards} ranks (FSDP2): "
                     "Megatron-LM's distributed optimizer shards the optimizer's state and reduce-scatters the "
                     "gradients; its parameters stay whole on every rank")
    runs = "interleaved 1F1B" if plan.virtual_stages > 1 else "1F1B"  # the orders Megatron-LM's layout runs
    if not plan.kind.megatron:
        notes.append(f"# Megatron-LM runs {runs} where the lab ran {plan.schedule}: the same gradients, another order")
    notes += [f"# not expressible per layer in Megatron-LM: {m}" for m in missing]
    return "\n".join(notes + flags) + "\n"


# --- the way back ------------------------------------------------------------------------------------------------------
def parse(text: str) -> list[str]:
    """A layout string as one string of layer symbols per stage (Megatron-LM's grammar, see the module docstring)."""
    body = text.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        body = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), body)
    stages = body.split("|")
    bad = sorted({ch for st in stages for ch in st} - set("EtLm"))
    if bad:
        raise PlanError(f"layout {text!r} has characters {bad} Megatron-LM does not know (E, t, L, m)")
    return stages


def plan_from_layout(text: str, ranks: int, units: Sequence[UnitInfo], *, microbatches: int,
                     schedule: str | None = None) -> Plan:
    """A Megatron-LM layout string over ``ranks`` pipeline ranks as a plan over the lab's ``units`` (interleaved 1F1B
    when it has virtual stages, else ``schedule`` or 1F1B)."""
    why = stack(units)
    if why is not None:
        raise PlanError(why)
    checks.count(ranks, "ranks", error=PlanError, what="pipeline ranks that run the layout's stages")
    stages = parse(text)
    if len(stages) % ranks:
        raise PlanError(f"layout {text!r} has {len(stages)} stages, which {ranks} ranks do not divide")
    flat = "".join(stages)
    if "m" in flat:
        raise PlanError(f"layout {text!r} has multi-token-prediction layers (m), which this model does not have")
    if not flat.startswith("E") or flat.count("E") != 1 or not flat.endswith("L") or flat.count("L") != 1:
        raise PlanError(f"layout {text!r} must begin with the embedding E and end with the loss L, once each")
    if flat.count("t") != len(units) - 2:
        raise PlanError(f"layout {text!r} has {flat.count('t')} transformer layers but the model has {len(units) - 2}")
    if any(not st for st in stages):
        raise PlanError(f"layout {text!r} has an empty stage; every lab stage holds at least one unit")
    bounds = [0]
    for st in stages:
        bounds.append(bounds[-1] + len(st))
    virtual = len(stages) // ranks
    chosen = _runs("interleaved") if virtual > 1 else (schedule or _runs("1f1b"))
    return Plan(tuple(bounds), (Policy.KEEP,) * len(units), microbatches, chosen, virtual).validate(len(units))


def _runs(megatron: str) -> str:
    """The lab's schedule for the order Megatron-LM calls ``megatron`` (the registry entry that says so)."""
    return next(k.name for k in schedules.kinds() if k.megatron == megatron)
