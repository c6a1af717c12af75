"""What leaves a running Session for other tools, and what comes in from them: the trained model's tensors, the
model in its library's own format, the plan as an export bundle, a production config as a plan (mixed into
``control/session.py``'s ``Session``, whose collaborators it uses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vpipe_lab.control import weights
from vpipe_lab.control.changes import interop
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire.commands import State
from vpipe_lab.wire.events import Tensors


class Outward:
    """The Session's exports and imports. They use the Session's own state and methods (``plan``, ``profile()``,
    ``cluster()``, ``apply()``, its requests), which is why this is a mixin and not a collaborator of its own."""

    _spec: Any
    settings: Any
    _model: Any
    _stages: int
    _state: Any
    metrics: Any
    _requests: Any
    plan: Plan
    plan_version: int
    iteration: int
    closed: bool
    _check: Any
    profile: Any
    cluster: Any
    _microbatch_size: Any
    apply: Any

    def state_dict(self, timeout: float | None = None) -> Any:
        """The trained model as ``model.state_dict()`` has it, gathered from every stage: the same keys in the same
        order (a tied weight under each of its names, one tensor; non-persistent buffers left out), so
        ``model.load_state_dict(session.state_dict(), strict=True)`` loads into a fresh build of the model."""
        self._check()
        return weights.assemble(self._requests.gather(State(), Tensors, self._stages, timeout))

    def export(self, path: str | Path, *, model: Any = None, timeout: float | None = None) -> Path:
        """Write the trained model where ``path`` says, in the form its library loads: a transformers model as a
        folder ``from_pretrained(path)`` reads, any other as a ``torch.save``d state dict. It loads the weights into
        a fresh build of ``model`` (default: the one this session trains), so this process imports torch."""
        source = model if model is not None else self._model
        if source is None:
            raise ValueError("this session does not know how to build its model (it was attached): give "
                             "export(path, model=factory)")
        return weights.export(self.state_dict(timeout), source, path, self.settings.seed)

    def export_plan(self, path: str | Path, *, plan: Plan | None = None, microbatch_size: int | None = None) -> Path:
        """Write the export bundle of the plan in force (or ``plan``) to the directory ``path``: ``pipeline.json``
        (torch stages over the model's own module names), ``schedule.csv`` (the exact order, for torch's
        ``_PipelineScheduleRuntime``), torchtitan and Megatron-LM settings and a README with what the lab measured
        and predicts for it (``wire/bundle_files.py``). ``vpipe_lab.export.torch_pipeline`` trains it on torch."""
        plan = plan if plan is not None else self.plan
        measured = interop.measured_s(self.metrics.records(200), self.plan_version) if plan == self.plan else None
        profile = cluster = None
        if self.iteration > 0 and not self.closed:
            profile, cluster = self.profile(), self.cluster()
        bundle = interop.bundle_of(plan, self._state.unit_info, microbatch_size=microbatch_size or self._microbatch_size(),
                                   profile=profile, cluster=cluster, measured=measured)
        return interop.write(path, bundle)

    def import_plan(self, source: Any, *, apply: bool = False, **kw: Any) -> Plan:
        """A production config as a plan over this model's units (``control/interop.import_plan``: a torchtitan TOML
        or ``[parallelism]`` dict, a Megatron-LM layout string, module lists per stage, an export bundle); ``apply``
        runs it from the next iteration (``apply(plan)``)."""
        plan = interop.read(source, self._state.unit_info, self.plan, **kw)
        if apply:
            self.apply(plan)
        return plan
