"""The export bundle on disk: a directory that is the contract between the lab and the engines users train with.

``pipeline.json`` (``core/interop/bundle.py``), ``schedule.csv`` (the compute order the lab runs, in
torch.distributed.pipelining's action format), ``torchtitan.toml`` and ``torchtitan_config.py``
(``core/interop/torchtitan.py``), ``megatron.args`` for transformer stacks (``core/interop/megatron.py``) and a
``README.md`` that says what the plan is, what the lab measured and predicted for it and how to run it. The directory
is written beside its destination and moved into place, so a reader never sees half a bundle. A directory there is
replaced only when it is a bundle this lab reads holding nothing but a bundle's files; anything else (a directory with
notes beside a ``pipeline.json``, a file) is refused in one line and left as it was.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from vpipe_lab.core.errors import PlanError, ProfileError
from vpipe_lab.core.interop import megatron, torch_schedules, torchtitan
from vpipe_lab.core.interop.bundle import SCHEMA_FILE, Bundle, csv_name
from vpipe_lab.core.report import human_time, mesh_words
from vpipe_lab.wire import small_file

PIPELINE = "pipeline.json"
FILES = (PIPELINE, "schedule.csv", "torchtitan.toml", "torchtitan_config.py", "megatron.args", "README.md")


def write(path: str | Path, bundle: Bundle) -> Path:
    """Write ``bundle`` as a directory at ``path`` (see the module docstring); returns the directory."""
    root = Path(path).absolute()
    problem = replaceable(root)
    if problem is not None:
        raise FileExistsError(f"{root} {problem}: give a new or empty directory (only a bundle holding nothing but "
                              "bundle files is replaced)")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        csv_path = str(root / bundle.schedule_csv)  # torchtitan opens it relative to its own working directory
        doc = bundle.to_dict()
        check(doc, "the bundle to write")  # what the lab writes keeps the contract it documents
        files = {PIPELINE: json.dumps(doc, indent=1) + "\n",
                 bundle.schedule_csv: torch_schedules.csv_text(bundle.plan),
                 "torchtitan.toml": torchtitan.toml_text(bundle, csv_path),
                 "torchtitan_config.py": torchtitan.python_text(bundle, csv_path)}
        try:
            files["megatron.args"] = megatron.args_text(bundle)
            no_megatron = None
        except PlanError as exc:
            no_megatron = str(exc)
        files["README.md"] = readme(bundle, no_megatron)
        for name, text in files.items():
            (staging / name).write_text(text)
        if root.exists():  # the old bundle steps aside first, so a failure here leaves one of the two whole
            old = Path(tempfile.mkdtemp(prefix=f".{root.name}-old-", dir=root.parent))
            os.replace(root, old / root.name)
            os.replace(staging, root)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root


def replaceable(root: Path) -> str | None:
    """Why ``root`` may not be written over, or None: it does not exist, is an empty directory, or is a bundle this
    lab reads (``pipeline.json`` admitted by the contract) whose entries are all plain files a bundle writes."""
    if not root.exists() and not root.is_symlink():
        return None
    if root.is_symlink() or not root.is_dir():
        return "exists and is not a directory"
    entries = list(root.iterdir())
    if not entries:
        return None
    try:
        found = read(root)
    except ProfileError:
        return "exists and is not an export bundle"
    allowed = {*FILES, found.schedule_csv}
    strangers = sorted(e.name for e in entries if e.name not in allowed or e.is_symlink() or not e.is_file())
    if strangers:
        shown = ", ".join(repr(n) for n in strangers[:3]) + (f" and {len(strangers) - 3} more" if len(strangers) > 3 else "")
        return f"holds {shown} beside its bundle files, which replacing it would delete"
    return None


def read(path: str | Path) -> Bundle:
    """The bundle at ``path`` (a bundle directory or its ``pipeline.json``), checked."""
    target = Path(path)
    if target.is_dir():
        target = target / PIPELINE
    try:
        doc = json.loads(small_file.read_text(target, "the export bundle's pipeline.json"))
    except small_file.TooLarge as exc:
        raise ProfileError(str(exc)) from None
    except OSError as exc:
        raise ProfileError(f"cannot read the export bundle {str(path)[:200]!r}: {exc.strerror}; write one with "
                           "session.export_plan(path) or vpipe-lab export") from None
    except (RecursionError, ValueError) as exc:  # not JSON, not text, nested past the parser, a 5,000-digit number
        raise ProfileError(f"{target} is not a pipeline.json this lab reads: {exc}") from None
    check(doc, str(target))
    return Bundle.from_dict(doc)


@functools.cache
def _validator() -> Any:
    import jsonschema  # a runtime dependency; imported here so the wire's other users do not pay for it

    return jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))


def check(doc: Any, where: str = PIPELINE) -> None:
    """Refuse (ProfileError, one line naming the field) a ``pipeline.json`` document its JSON Schema does not admit."""
    import jsonschema

    try:
        error = jsonschema.exceptions.best_match(_validator().iter_errors(doc))
    except RecursionError:
        raise ProfileError(f"{where} is nested too deeply to be a pipeline.json") from None
    if error is not None:
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        message = error.message if len(error.message) <= 200 else error.message[:200] + "..."
        raise ProfileError(f"{where}: {field or 'the document'}: {message} (the contract: "
                           f"{SCHEMA_FILE.name} in vpipe_lab.core.interop, docs/interop.md)")


def csv_path(path: str | Path, bundle: Bundle) -> Path:
    """The bundle's schedule CSV: always a file inside the bundle directory (``csv_name`` refuses anything else)."""
    root = Path(path)
    return (root if root.is_dir() else root.parent) / csv_name(bundle.schedule_csv)


def _table(bundle: Bundle) -> list[str]:
    rows = ["| stage | rank | split_at | modules | recompute | offload |", "|---|---|---|---|---|---|"]
    for s in bundle.stages:
        def cell(items: Any) -> str:
            names = list(items)
            return ", ".join(f"`{n}`" for n in names[:6]) + (f" (+{len(names) - 6})" if len(names) > 6 else "") or "-"
        rows.append(f"| {s.stage} | {s.rank} | {f'`{s.split_at}`' if s.split_at else '-'} | {cell(s.modules)} | "
                    f"{cell(s.recompute)} | {cell(s.offload)} |")
    return rows


def _mesh(plan: Any) -> list[str]:
    """The README's words on a plan of sharded stages or replicas (nothing for a pipeline of whole devices)."""
    if plan.devices == plan.stages:
        return []
    lines = [f"On {plan.devices} ranks: {mesh_words(plan.stages, plan.shards, plan.replicas)} "
             f"(`WORLD_SIZE` {plan.devices}; the batch split over {plan.data_parallel} data-parallel ranks)."]
    if plan.shards > 1:
        lines[0] += (" Each stage's units are sharded with `fully_shard` over its shards; by stage they gather and "
                     "reduce as: " + ", ".join(f"{s}: `{plan.sharding_of(s).value}`" for s in range(plan.stages))
                     + " (torchtitan: `fsdp_reshard_after_forward`, one for all stages).")
    return [*lines, ""]


def readme(bundle: Bundle, no_megatron: str | None) -> str:
    """The bundle's README: the plan, the lab's numbers for it and how to run it where users train."""
    plan = bundle.plan
    timing = []
    if bundle.measured_s is not None:
        timing.append(f"measured in the lab: {human_time(bundle.measured_s)} per iteration")
    if bundle.predicted_s is not None:
        timing.append(f"predicted by the lab's cost model: {human_time(bundle.predicted_s)} per iteration")
    if not timing:  # a checkpoint or a plan file alone: no profile and no run of this plan came with it
        timing.append("no measurement or prediction: this bundle was made without a run of its plan (export from a "
                      "session, or `vpipe-lab export OUT --run-dir DIR` after `vpipe-lab run --run-dir DIR`)")
    runs = (f"torch's `{bundle.schedule}` runs exactly this order" if bundle.schedule else
            "no torch schedule class runs exactly this order: run `schedule.csv` with `_PipelineScheduleRuntime`")
    lines = [
        "# A vpipe_lab pipeline plan", "",
        f"`{plan.describe()}`: {plan.stages} ranks, {plan.chunks} torch stages ({bundle.style} placement), "
        f"{plan.microbatches} micro-batches" + (f" of {bundle.microbatch_size} samples" if bundle.microbatch_size
                                                 else "") + f", schedule {plan.schedule} ({runs}).", "",
        *([f"- {t}" for t in timing] + [""] if timing else []),
        *_mesh(plan),
        *_table(bundle), "",
        "## Run it with torch.distributed.pipelining", "",
        "```python",
        "from vpipe_lab.export import torch_pipeline",
        "",
        "pp = torch_pipeline(model, \"<this directory>\", rank, example=one_microbatch_of_inputs, loss_fn=loss)",
        "optimizer = torch.optim.AdamW(pp.parameters())",
        "pp.step(inputs, target=targets, losses=losses)   # each rank; then optimizer.step(); optimizer.zero_grad()",
        "```", "",
        "`torch_pipeline` builds this rank's stages with `pipeline(model, split_spec={split_at: SplitPoint.BEGINNING})` "
        "(an `nn.Sequential` by its children's names), wraps `recompute` modules with `checkpoint_wrapper` and "
        "`offload` modules under `torch.autograd.graph.save_on_cpu`, and loads the schedule "
        + (f"class `{bundle.schedule}`" if bundle.schedule else "from `schedule.csv`") + ". Without vpipe_lab: "
        "`_PipelineScheduleRuntime(stages, n_microbatches, loss_fn=...)._load_csv(\"schedule.csv\")` runs the exact "
        "order on stages built from `pipeline.json`.", "",
        "## torchtitan", "",
        "`torchtitan.toml` holds the `[parallelism]` and `[activation_checkpoint]` settings (torchtitan 0.2: "
        "`--job.config_file`); `torchtitan_config.py`'s `apply(config)` sets the same on a torchtitan 0.3 "
        "`Trainer.Config`. The CSV path in them is absolute: change it if you move this directory. torchtitan splits "
        "models whose top-level children are the embedding, a `layers` list and the output; for other models use "
        "`torch_pipeline`.", "",
        "## Megatron-LM", "",
        ("`megatron.args` has the `--pipeline-model-parallel-layout` and recompute flags." if no_megatron is None
         else f"No `megatron.args`: {no_megatron}."), "",
    ]
    if bundle.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in bundle.notes], ""]
    return "\n".join(lines)
