"""Plain-text reports of plans and estimates, shared by the CLI, the magics and reprs."""

from __future__ import annotations

from collections.abc import Sequence

from vpipe_lab.core.plan import Estimate, Plan, Policy
from vpipe_lab.core.profile import ModelProfile


def parse_bytes(text: str) -> int:
    """A size as people write it ("8GiB", "512MiB", "1.5g", "4096") in bytes; ValueError naming the text otherwise."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except (ValueError, IndexError):
        raise ValueError(f"{text!r} is not a size: write bytes or e.g. 10GiB, 512MiB") from None
    if not value >= 0:
        raise ValueError(f"{text!r} is not a size: it must be >= 0")
    return int(value)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _policy_summary(policies: Sequence[Policy]) -> str:
    swap = sum(p is Policy.SWAP for p in policies)
    rec = sum(p is Policy.RECOMPUTE for p in policies)
    parts = [f"{len(policies) - swap - rec} keep"]
    if swap:
        parts.append(f"{swap} swap")
    if rec:
        parts.append(f"{rec} recompute")
    return ", ".join(parts)


def mesh_words(stages: int, shards: int, replicas: int) -> str:
    """"2 stages x 4 shards x 1 replica": a mesh as a sentence says it."""
    def n(count: int, word: str) -> str:
        return f"{count} {word}{'' if count == 1 else 's'}"
    return f"{n(stages, 'stage')} x {n(shards, 'shard')} x {n(replicas, 'replica')}"


def plan_table(plan: Plan, est: Estimate, profile: ModelProfile | None = None) -> str:
    """One row per stage: layers, policies, time per micro-batch, peak memory against the budget (a sharded plan's:
    each rank's, with the stage's sharding)."""
    sharded = plan.shards > 1
    rows = [("stage", "layers", "policies", "time/mb", "peak/rank" if sharded else "peak memory", "budget", "note")]
    for s in range(plan.stages):
        ranges: list[range] = []  # one, or a stage's chunks, neighbouring ones joined (ZBV's turn)
        for c in plan.chunks_of(s):
            r = plan.chunk_layers(c)
            if ranges and ranges[-1].stop == r.start:
                ranges[-1] = range(ranges[-1].start, r.stop)
            else:
                ranges.append(r)
        names = ""
        if profile is not None and len(ranges) == 1:
            first, last = profile.layers[ranges[0].start].name, profile.layers[ranges[0].stop - 1].name
            names = f" ({first}..{last})" if len(ranges[0]) > 1 else f" ({first})"
        over = est.peak_bytes[s] > est.budget_bytes[s]
        rows.append((
            str(s), ", ".join(f"{r.start}:{r.stop}" for r in ranges) + names,
            _policy_summary([plan.policies[i] for i in plan.layers_of(s)]),
            human_time(est.stage_s[s]), human_bytes(est.peak_bytes[s]), human_bytes(est.budget_bytes[s]),
            " ".join(filter(None, (f"{plan.sharding_of(s).value}" if sharded else "",
                                   "OVER BUDGET" if over else ("bottleneck" if s == est.bottleneck else "")))),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    mesh = f"{mesh_words(plan.stages, plan.shards, plan.replicas)} ({plan.devices} devices), " \
        if plan.devices != plan.stages else ""
    lines.append(
        f"{mesh}{plan.schedule}, {plan.microbatches} micro-batches: iteration {human_time(est.iteration_s)}, "
        f"bubble {est.bubble_fraction:.1%}, {'fits' if est.feasible else 'DOES NOT FIT'} in memory"
    )
    return "\n".join(lines)
