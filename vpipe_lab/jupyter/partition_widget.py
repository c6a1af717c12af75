"""The partition editor: an anywidget (front end in extension/, bundled into static/partition.js).

Layers are blocks coloured by stage; dragging a boundary (committed on release), clicking a layer (keep -> swap ->
recompute) or, in a sharded job, a stage's sharding (hold -> regather -> scatter -> stream) edits a draft; the
simulator previews the draft's iteration time and per-stage memory against the budget; Apply hands the draft to
``Session.change`` and the widget shows pending, then "applied at iteration N", or the error. When the session ends
the editor stays on screen, frozen, saying so.

The browser tells Python what the user did with anywidget custom messages, whose contract is written once, as a JSON
schema in ``extension/src/messages.ts`` (TypeScript derives its types from it; the build writes it to
``static/editor_messages.schema.json``, which every incoming message is validated against here). Python owns every
trait; the front end only reads them. Widget messages can arrive on a subshell thread while a cell runs (JupyterLab >=
4.4, ipykernel 7), so the message handler only turns a message into the typed ``Change`` the magics and the Python API
also make and queues it; one worker thread computes previews and applies changes. A preview is computed once per (plan,
profile) under the profile in hand; that profile is measured again after each Apply, every ``reprofile_s`` while
training goes on, and before a draft is previewed when it is older than ``fresh_s`` (the layers' costs as they are when
the user drags, not as they were while the page loaded).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anywidget
import ipywidgets as widgets
import jsonschema
import traitlets

from vpipe_lab.core import schedules
from vpipe_lab.core.change import Change
from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.errors import VpipeError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.jupyter.layer_blocks import block_docs
from vpipe_lab.jupyter.previews import Previews, Shown, calibrated
from vpipe_lab.jupyter.what_if import WhatIf

if TYPE_CHECKING:
    from vpipe_lab.control.session import Session

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
MESSAGES = jsonschema.Draft202012Validator(json.loads((STATIC / "editor_messages.schema.json").read_text()))


class PartitionEditor(anywidget.AnyWidget):
    """Edit a plan by hand, see the simulator's what-if, apply it live to a Session (or hand it to ``on_apply``)."""

    _esm = STATIC / "partition.js"
    layers = traitlets.List(traitlets.Dict()).tag(sync=True)
    boundaries = traitlets.List(traitlets.Int()).tag(sync=True)
    stages = traitlets.Int(1).tag(sync=True)  # with virtual stages, boundaries cut chunks; chunk c on placement[c]
    placement = traitlets.List(traitlets.Int()).tag(sync=True)  # each chunk's stage (Plan.placement)
    policies = traitlets.List(traitlets.Unicode()).tag(sync=True)
    schedule = traitlets.Unicode().tag(sync=True)
    schedules = traitlets.List(traitlets.Unicode()).tag(sync=True)  # the registry's names, when the editor opened
    draft_boundaries = traitlets.List(traitlets.Int()).tag(sync=True)
    draft_policies = traitlets.List(traitlets.Unicode()).tag(sync=True)
    draft_schedule = traitlets.Unicode().tag(sync=True)
    draft_placement = traitlets.List(traitlets.Int()).tag(sync=True)  # each draft chunk's stage
    sharding = traitlets.List(traitlets.Unicode()).tag(sync=True)  # each stage's (a sharded job's; else empty)
    draft_sharding = traitlets.List(traitlets.Unicode()).tag(sync=True)
    preview = traitlets.Dict().tag(sync=True)
    status = traitlets.Dict({"state": "idle", "message": ""}).tag(sync=True)

    def __init__(self, session: Session | None = None, *, plan: Plan | None = None,
                 profile: ModelProfile | None = None, cluster: Cluster | None = None,
                 on_apply: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if session is None and (plan is None or profile is None or cluster is None):
            raise ValueError("PartitionEditor needs a session, or a plan with a profile and a cluster to preview")
        self.session, self.on_apply = session, on_apply
        self.applied: list[int] = []
        self._plan = plan if plan is not None else session.plan  # type: ignore[union-attr]
        self._profile = profile
        self._cluster = self._base_cluster = cluster
        self._work: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._previews = Previews()  # each plan's estimate and simulated iteration under the profile in hand
        self._budget: int | None = None  # the user's budget per stage (the what-if's box); None: the cluster's
        self._calibration: Calibration | None = None  # what the what-if shows is scaled by (core/cost/calibration.py)
        self._shown = Shown()  # the drafts' what-ifs sent to the page
        self.reprofile_s = 30.0  # while training, measure the profile again this often (0: only after an Apply)
        self.fresh_s = 10.0  # a draft previewed with a profile older than this measures it again first (_freshen)
        self.fresh_wait_s = 2.0  # ... waiting at most this for the next iteration boundary (else the one in hand)
        self._opened, self._profiled = time.monotonic(), -float("inf")  # when this editor last measured a profile
        self.what_if = WhatIf(lambda budget: self._work.put(("budget", budget)),
                              lambda: self._work.put(("preview", None)), self._plan.shards)
        self.panel = widgets.VBox([self, self.what_if.widget])  # what a cell shows: the editor above its what-if
        self._weights: list[float] | None = None  # the blocks' shares of the bar, as last drawn
        self._names: list[str] = []
        self._closed = False
        self._lock = threading.Lock()
        self._load(self._plan)
        if session is not None and not self.layers:  # blocks at once, of equal size, until the profile sizes them
            self.layers = [{"name": name, "weight": 1.0} for name in session.names]
        self.ended = False
        self.on_msg(lambda _widget, content, _buffers: self.receive(content))
        self._worker = threading.Thread(target=self._run, name="vpipe-editor", daemon=True)
        self._worker.start()
        self._unsubscribe = session.on_event(self._on_session_event) if session is not None else None
        self._work.put(("refresh", False))

    # --- state --------------------------------------------------------------------------------------------------
    def _load(self, plan: Plan) -> None:
        with self.hold_sync():
            self._show(plan)
            self._show_draft(plan)

    def _show(self, plan: Plan) -> None:
        """``plan`` as the plan in force (the committed traits)."""
        self.boundaries = list(plan.boundaries)
        self.stages = plan.stages
        self.placement = list(plan.placement)
        self.policies = [p.value for p in plan.policies]
        self.schedule = plan.schedule
        self.sharding = [m.value for m in plan.stage_sharding] if plan.shards > 1 else []  # whole devices: none
        self.schedules = list(schedules.names())  # a schedule registered since shows at the next refresh

    def _show_draft(self, plan: Plan) -> None:
        self.draft_boundaries = list(plan.boundaries)
        self.draft_policies = [p.value for p in plan.policies]
        self.draft_schedule = plan.schedule
        self.draft_placement = list(plan.placement)
        self.draft_sharding = [m.value for m in plan.stage_sharding] if plan.shards > 1 else []

    def _layer_docs(self, profile: ModelProfile) -> list[dict[str, Any]]:
        names = [x.name for x in profile.layers]
        previous = self._weights if names == self._names else None  # another model (set_model): start over
        docs, self._weights = block_docs(profile, previous)
        self._names = names
        return docs

    def draft(self) -> Plan:
        return self.draft_change().on(self._plan)

    def draft_change(self) -> Change:
        """The draft as the change it asks of the running plan."""
        schedule = self.draft_schedule if self.draft_schedule != self._plan.schedule else None
        sharding = self.draft_sharding if self.draft_sharding != self.sharding else None
        return Change.of(boundaries=self.draft_boundaries, policies=self.draft_policies, schedule=schedule,
                         source="editor", sharding=sharding)

    # --- messages from the browser: on whatever thread delivers them; they only queue work ------------------------
    def receive(self, message: Any) -> None:
        """One message from the front end (see extension/src/messages.ts): a new draft, or apply a draft."""
        problem = next(iter(MESSAGES.iter_errors(message)), None)
        if problem is not None:  # a front end of another version, or a hand-made message: say so, change nothing
            log.warning("partition editor: ignored a message that breaks the contract: %s", problem.message)
            self.status = {"state": "error", "message": f"ignored a malformed editor message: {problem.message}"}
            return
        if self.ended:
            return
        schedule = message.get("schedule") or self.draft_schedule
        # Another schedule than the draft's: Python cuts the layers into its chunks (Change.on) unless they fit.
        boundaries = message["boundaries"] if schedule == self.draft_schedule else None
        try:
            sharding = message.get("sharding")  # a sharded job's stages, hold -> regather -> scatter -> stream
            change = Change.of(boundaries=boundaries, policies=message["policies"], source="editor",
                               schedule=schedule if schedule != self._plan.schedule else None,
                               sharding=sharding if sharding and sharding != self.sharding else None)
        except VpipeError as exc:  # e.g. an unknown policy: the same words the magics and the API get
            self.status = {"state": "error", "message": f"{type(exc).__name__}: {exc}"}
            return
        self._work.put(("apply", (change, message.get("shown_s"))) if message["kind"] == "apply"
                       else ("draft", change))

    def _on_session_event(self, event: dict[str, Any]) -> None:
        if event.get("type") in ("plan", "model"):  # applied elsewhere (magics, auto-replan): follow it
            self._work.put(("follow", event))
        elif event.get("type") in ("closed", "failed"):
            self._work.put(("ended", event))

    # --- the worker thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            try:
                kind, payload = self._work.get(timeout=0.5)
            except queue.Empty:
                if self._stale():
                    kind, payload = "refresh", True  # training went on: the what-if takes the newest costs
                elif self._drifted():
                    kind, payload = "preview", None  # the running plan's recent iterations moved the calibration
                else:
                    continue
            try:
                if kind == "refresh":
                    self._refresh(payload)
                elif kind == "draft":
                    self._freshen()
                    self._set_draft(payload)
                elif kind == "preview":
                    self._preview()
                elif kind == "apply":
                    change, shown_s = payload
                    seen = self._shown.seen(shown_s)  # what the page showed as the user clicked: what they acted on
                    self._freshen()
                    self._set_draft(change)
                    self._apply(change, seen)
                elif kind == "follow":
                    self._follow(payload)
                elif kind == "ended":
                    self._end(payload)
                elif kind == "budget":
                    self._budget = payload
                    self._refresh()
            except Exception as exc:  # shown in the widget; the thread keeps serving
                log.exception("partition editor: %s failed", kind)
                self.status = {"state": "error", "message": f"{type(exc).__name__}: {exc}"}

    def _stale(self) -> bool:
        """The profile in hand is older than ``reprofile_s`` while the session trains: time to measure again (the
        workers' per-layer times are medians over their profiling iterations, so one noisy iteration moves nothing)."""
        return (self.session is not None and not self.ended and self.reprofile_s > 0
                and time.monotonic() - max(self._opened, self._profiled) >= self.reprofile_s
                and self.session.status == "running")

    def _freshen(self) -> None:
        """Before a draft is previewed: a profile in hand older than ``fresh_s`` while the session trains is measured
        again, waiting at most ``fresh_wait_s`` for the workers' next iteration boundary (a longer iteration: the one
        in hand serves). The workers' medians then weigh the iterations since the page loaded, which a profile taken
        while JupyterLab and the browser shared the cores with the job did not (benchmarks/what_if_browser.py)."""
        if (self.session is None or self.ended or self.session.status != "running"
                or time.monotonic() - self._profiled < self.fresh_s):
            return
        try:
            profile = self._measure(self.fresh_wait_s)
        except Exception as exc:  # a long iteration (TimeoutError), workers being replaced: best effort only
            log.info("partition editor: no fresh profile (%s); the what-if uses the one in hand", exc)
            return
        self._previews.clear()
        self._profile = profile
        self.layers = self._layer_docs(profile)

    def _measure(self, timeout: float | None = None) -> ModelProfile:
        assert self.session is not None
        profile = self.session.profile(timeout=timeout)
        self._profiled = time.monotonic()
        return profile

    def _drifted(self) -> bool:
        """The running plan's newest iterations would calibrate the what-if over 1% off what it shows (or could
        calibrate an uncalibrated one): cheap, no profile is asked for, checked whenever the editor is idle."""
        current = self.preview.get("current")
        if self.session is None or self.ended or not current:
            return False
        found = self.session.record.calibration(current.get("simulated_s", current["iteration_s"]))
        shown = self._calibration
        return found is not None and (shown is None or abs(found.factor / shown.factor - 1) > 0.01)

    def _refresh(self, measure: bool = False) -> None:
        """Take the session's plan, cluster and profile: the newest one measured, or (``measure``, after an Apply)
        a new measurement, so the blocks show what the moved layers cost where they now run."""
        if self.session is not None:
            profile = self._measure() if measure else self.session.newest_profile()
            cluster = self.session.cluster()
        else:
            profile, cluster = self._profile, self._base_cluster
        if self._budget is not None and cluster is not None:  # the user's budget, for every stage
            cluster = dataclasses.replace(cluster, memory_bytes=self._budget)
        if profile is not None and cluster is not None:
            if profile is not self._profile or cluster != self._cluster:
                self._previews.clear()  # estimates under the old costs
            self._profile, self._cluster = profile, cluster
            if self.session is not None:
                self._plan = self.session.plan
        assert self._profile is not None
        with self.hold_sync():
            self.layers = self._layer_docs(self._profile)
            self._load(self._plan)
        self._preview()

    def _set_draft(self, change: Change) -> None:
        try:
            draft = change.on(self._plan)
        except VpipeError as exc:  # e.g. an unknown schedule: the what-if says so, the draft stays
            self.preview = {**self.preview, "error": str(exc)}
            return
        with self.hold_sync():  # the draft and its preview reach the browser in one message (it waits for both)
            self._show_draft(draft)
            self._preview(draft)

    def _end(self, event: dict[str, Any]) -> None:
        """The session ended: keep showing the last state, refuse edits, say why."""
        self.ended = True
        how = "failed" if event.get("type") == "failed" else str(event.get("status", "stopped"))
        self.status = {"state": "ended", "message": f"session ended ({how}): this editor is frozen at its last plan"}
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _preview(self, draft: Plan | None = None) -> None:
        """The plan in force and ``draft`` (default: the draft traits' plan) under the profile in hand."""
        if self._profile is None or self._cluster is None:
            return
        docs: dict[str, Any] = {}
        shown, stages = draft or self.draft(), self._cluster.stages
        try:
            docs["current"] = self._previews.doc(self._plan.validate(len(self._profile), stages), self._profile,
                                                 self._cluster)
            shown, profile = self.what_if.on_mesh(shown, self._profile)  # the shard count the what-if prices
            docs["draft"] = self._previews.doc(shown.validate(len(self._profile), stages), profile, self._cluster)
        except VpipeError as exc:
            docs["error"] = str(exc)
        self.preview = self._calibrated(docs)
        if "draft" in self.preview:  # the number the page shows for this draft (its Apply records it)
            self._shown.sent(shown, float(self.preview["draft"]["iteration_s"]))
        self._draw_what_if(shown if "draft" in docs else None)

    def _draw_what_if(self, draft: Plan | None) -> None:
        """The what-if view: the last measured iteration (or the running plan simulated) beside the draft simulated,
        both plans' predicted peaks against the budget, the session's record of measured against predicted."""
        assert self._cluster is not None
        running = self._previews.timeline(self._plan)
        if running is None:
            return
        measured = self.session.metrics.timeline(1) if self.session is not None else None
        now = self.preview.get("current", {}).get("peak_bytes", [])
        drafted = self.preview["draft"]["peak_bytes"] if draft is not None else None
        record = self.session.record.rows() if self.session is not None else []
        self.what_if.draw(measured, running, self._previews.timeline(draft),
                          (now, drafted), list(self._cluster.budgets), record, self._calibration)

    def _calibrated(self, docs: dict[str, Any]) -> dict[str, Any]:
        """Both plans' simulated iterations scaled by the running plan's recent measured median against its own
        simulation (``core/cost/calibration.py``), the session's ``predicted_s`` for the same change; the raw
        simulation kept as ``simulated_s``. Unchanged without a session or before enough iterations."""
        self._calibration = (self.session.record.calibration(docs["current"]["iteration_s"])
                             if self.session is not None and "current" in docs else None)
        return calibrated(docs, self._calibration)

    def _shown_s(self, plan: Plan, seen: tuple[Plan, float] | None = None) -> float | None:
        """The what-if this editor showed for ``plan``: ``seen`` (the page's as the user clicked) or the number last
        sent to the page for it, else its simulation calibrated as the page would show it; None where it shows none."""
        for shown in (seen, self._shown.last):
            if shown is not None and shown[0] == plan and shown[1] > 0:
                return shown[1]
        if self._profile is None or self._cluster is None:
            return None
        try:
            simulated = self._previews.doc(plan.validate(len(self._profile), self._cluster.stages), self._profile,
                                           self._cluster)["iteration_s"]
        except VpipeError:
            return None
        shown = self._calibration.apply(simulated) if self._calibration is not None else simulated
        return float(shown) if shown > 0 else None

    def _apply(self, change: Change, seen: tuple[Plan, float] | None = None) -> None:
        if (problem := self.what_if.mesh_problem()) is not None:
            self.status = {"state": "error", "message": problem}
            return
        self.status = {"state": "pending", "message": "pending: waiting for the next iteration boundary"}
        try:
            plan = change.on(self._plan)
            if self.session is not None:
                done = self.session.change(dataclasses.replace(change, predicted_s=self._shown_s(plan, seen)))
                plan, iteration, message = done.plan, done.iteration, done.describe()
            else:
                iteration = self.on_apply(plan) if self.on_apply is not None else 0
                message = "applied"
        except VpipeError as exc:
            self.status = {"state": "error", "message": f"{type(exc).__name__}: {exc}"}
            return
        self._plan = plan
        self.applied.append(int(iteration or 0))
        with self.hold_sync():
            self._show(plan)
            self.status = {"state": "applied", "message": message, "iteration": int(iteration or 0)}
        self._work.put(("refresh", True))

    def _follow(self, event: dict[str, Any]) -> None:
        plan = event.get("plan")
        if isinstance(plan, Plan) and plan != self._plan:
            self._plan = plan
            self._refresh()
            self.status = {"state": "applied", "message": f"plan v{event.get('version')} applied at iteration "
                           f"{event.get('iteration')} (from the session)", "iteration": event.get("iteration")}

    def close(self) -> None:
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        if threading.current_thread() is not self._worker:  # a measurement it started ends before close returns
            self._worker.join(timeout=5.0)
        self.what_if.close()
        self.panel.close()
        super().close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """A cell shows the editor with its what-if view under it (``panel``)."""
        return self.panel._repr_mimebundle_(**kwargs)
