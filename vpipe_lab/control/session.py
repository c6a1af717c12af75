"""``launch()`` and the ``Session``: start stage workers in the background and drive them from Python or a notebook.

The Session holds no tensors and needs no torch: workers talk to each other directly (torch.distributed) and to the
Session over an authenticated ZeroMQ channel. Commands go to rank 0, which broadcasts them to every rank at the next
iteration boundary; the Session learns from rank 0's acknowledgement at which iteration a command took effect.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vpipe_lab.control import protocol as P
from vpipe_lab.control.checkpoint import LATEST
from vpipe_lab.control.errors import BudgetError, SessionClosed, WorkerError
from vpipe_lab.control.jobspec import JobSpec
from vpipe_lab.control.launcher import Launcher
from vpipe_lab.control.live import LiveMixin
from vpipe_lab.control.metrics import Metrics, combine, per_replica, spans_from_wire
from vpipe_lab.control.sinks import Logger
from vpipe_lab.core.model import Cluster, LayerCost, ModelProfile, Plan
from vpipe_lab.core.timeline import Span

log = logging.getLogger(__name__)
EventCallback = Callable[[dict[str, Any]], None]


class Session(LiveMixin):
    """A running pipeline. Every method is safe to call while training goes on in the background."""

    def __init__(self, spec: JobSpec, hub: Any, launcher: Launcher | None, job_dir: Path | None,
                 attached: bool = False) -> None:
        self.spec = spec
        self.stages = spec.stages
        self.replicas = spec.replicas
        self.workers = spec.stages * spec.replicas  # worker processes (ranks)
        self._hub = hub
        self._launcher = launcher
        self._job_dir = job_dir
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._ready: dict[int, dict[str, Any]] = {}
        self._acks: dict[int, dict[str, Any]] = {}
        self._replies: dict[int, list[P.Message]] = {}
        self._partial: dict[int, dict[int, dict[str, Any]]] = {}
        self._callbacks: list[EventCallback] = []
        self._fatal: WorkerError | None = None
        self._budget: BudgetError | None = None
        self._closed = False
        self._stopping = False
        self.metrics = Metrics()
        self._iteration = spec.start_iteration
        self._target: int | None = spec.start_iteration
        self._plan: Plan | None = None
        self.plan_version = 0
        self.names: list[str] = []
        self._pending_events: list[dict[str, Any]] = []
        self._reports: dict[int, dict[str, Any]] = {}  # stage -> its error report
        self._refusals: dict[int, dict[str, Any]] = {}  # plan version -> a stage's refusal to take layers
        self._apply_lock = threading.Lock()
        self._migrating: int | None = None
        self.last_checkpoint: Path | None = None
        self.last_migration: dict[str, Any] | None = None
        self.last_mapping: dict[int, int | None] | None = None
        self._autoplan: Any = None
        self._profile_cache: dict[int, LayerCost] = {}  # last measurement of each layer that had samples
        self._trouble_since = 0.0
        self.logger = Logger(None)  # launch(log=...) sets the sink (control/sinks.py)
        self._monitor = threading.Thread(target=self._watch, name="vpipe-monitor", daemon=True)
        self._monitor.start()
        if not attached:
            hub._on_message = self._handle

    # --- messages from workers (hub thread) ---------------------------------------------------------------------
    def _handle(self, msg: P.Message) -> None:
        body = msg.body
        logged: Callable[[], None] | None = None  # the sink writes outside the lock: it may be slow
        with self._cond:
            if msg.type == P.READY:
                self._ready[int(body["rank"])] = body
            elif msg.type == P.ITERATION:
                done = self._on_iteration(body)
                if done is not None:
                    logged = lambda: self.logger.iteration(*done)
            elif msg.type == P.ACK:
                self._acks[int(body.get("id") or 0)] = body
            elif msg.type in (P.LAYERS, P.TENSORS):
                self._replies.setdefault(int(body.get("id") or 0), []).append(msg)
            elif msg.type == P.EVALUATED:
                if body.get("id"):
                    self._replies.setdefault(int(body["id"]), []).append(msg)
                if not body.get("error"):
                    record = {k: body[k] for k in ("iteration", "loss", "batches", "seconds")}
                    self.metrics.add_evaluation(record)
                    self._pending_events.append({"type": "evaluated", **record})
                    logged = lambda: self.logger.evaluation(record)
            elif msg.type == P.MIGRATED:
                start, end = body["span"]
                span = Span(int(body["rank"]), "migrate", -1, None, float(start), float(end), int(body["iteration"]))
                self.metrics.add_spans([span])
                self._pending_events.append({"type": "migrated", **body})
                if int(body["rank"]) == 0:
                    text = f"plan version {body['version']}: layers in {body['layers_in']}, out {body['layers_out']}"
                    logged = lambda: self.logger.event(int(body["iteration"]), "plan", text)
            elif msg.type == P.ERROR:
                self._on_error(body)
            self._cond.notify_all()
        if logged is not None:
            logged()
        event = {"type": msg.type, **body} if msg.type in (P.ERROR, P.ACK) else None
        if event:
            self._emit(event)

    def _on_iteration(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                              list[dict[str, Any]]] | None:
        """Keep a stage's report; once every stage reported the iteration, its (record, memory, reports)."""
        it = int(body["iteration"])
        parts = self._partial.setdefault(it, {})
        parts[int(body.get("replica", 0)) * self.stages + int(body["stage"])] = body
        if len(parts) < self.workers:
            return None
        del self._partial[it]
        everyone = list(parts.values())
        ranks = [parts[s] for s in range(self.stages)]  # the timeline and memory show the first replica's stages
        record = combine(it, everyone)
        if self.replicas > 1:
            self.metrics.add_replicas(per_replica(it, everyone))
        spans = [s for b in ranks for s in spans_from_wire(int(b["stage"]), it, b.get("spans", []))]
        memory = [{"iteration": it, "stage": int(b["stage"]), **b["memory"]} for b in ranks]
        self.metrics.add(record, spans, memory)
        self._iteration = max(self._iteration, it + 1)
        self._pending_events.append({"type": "iteration", **record, "spans": spans, "memory": memory})
        return record, memory, ranks

    def _on_error(self, body: dict[str, Any]) -> None:
        stage = int(body.get("stage", -1))
        if body.get("kind") == "migration":
            self._refusals[int(body.get("version", 0))] = body
            return
        if body.get("kind") == "budget":
            self._budget = BudgetError(stage, int(body["used"]), int(body["budget"]),
                                       [tuple(x) for x in body.get("layers", [])], int(body.get("iteration", -1)))
            return
        if not self._stopping:
            self._reports[stage] = body
            self._trouble_since = self._trouble_since or time.monotonic()

    def _emit(self, event: dict[str, Any]) -> None:
        for cb in list(self._callbacks):
            try:
                cb(event)
            except Exception:  # a broken callback must not take the session down with it
                log.exception("an on_event callback raised; it stays registered")

    def _watch(self) -> None:
        """Monitor thread: deliver events, notice dead workers within ~0.1 s, stop the others on any failure."""
        while not self._closed:
            with self._cond:
                events, self._pending_events = self._pending_events, []
            for ev in events:
                self._emit(ev)
            if self._launcher is not None and not self._stopping and self._fatal is None:
                if any(rc != 0 for _, rc in self._launcher.exited()):
                    self._trouble_since = self._trouble_since or time.monotonic()
                # Gather evidence for a moment: a killed stage makes its neighbours fail too, and the root cause
                # (the stage that died or raised first-hand) should be what the user reads.
                if self._trouble_since and time.monotonic() - self._trouble_since > 0.5:
                    with self._cond:
                        self._fatal = self._root_cause()
                        self._cond.notify_all()
            if self._fatal is not None and self._launcher is not None and self._launcher.alive():
                log.error("%s; stopping the other workers", str(self._fatal).splitlines()[0])
                self._launcher.terminate(timeout=2.0)
                self._emit({"type": "error", "stage": self._fatal.stage, "cause": self._fatal.cause})
            time.sleep(0.05)

    def _root_cause(self) -> WorkerError:
        """A stage's own exception beats a stage that died without a word, which beats a broken connection."""
        workers = {w.rank: w for w in self._launcher.workers} if self._launcher else {}

        def tail(stage: int) -> str:
            return workers[stage].tail() if stage in workers else ""

        ckpt = None
        if self._migrating is not None and self._job_dir is not None:
            path = self._job_dir / "checkpoints" / f"plan-v{self._migrating}"
            ckpt = str(path) if (path / LATEST).exists() else (
                str(self.last_checkpoint) if self.last_checkpoint else None)
        def secondhand(body: dict[str, Any]) -> bool:  # a broken connection: the effect of another stage's failure
            cause = str(body.get("cause", ""))
            return cause.startswith("CommError") or any(
                text in cause for text in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))

        own = {s: b for s, b in self._reports.items() if not secondhand(b)}
        if own:
            stage = min(own)
            return WorkerError(stage, str(own[stage].get("cause")), traceback=str(own[stage].get("traceback", "")),
                               log_tail=tail(stage), checkpoint=ckpt)
        dead = [(w, rc) for w, rc in (self._launcher.exited() if self._launcher else []) if w.rank not in self._reports]
        if dead:
            w, rc = dead[0]
            cause = f"the worker process was killed by signal {-rc}" if rc < 0 else f"the worker process exited with code {rc}"
            if rc == -9:
                cause += " (SIGKILL: out of memory, or killed from outside)"
            return WorkerError(w.rank, cause, log_tail=w.tail(), exit_code=rc, checkpoint=ckpt)
        silent = [w.rank for w in (self._launcher.workers if self._launcher else [])
                  if w.rank not in self._reports and w.popen.poll() is None]
        if silent:  # neighbours timed out waiting for a stage that is alive but says nothing: it is stuck
            stage, (waiter, body) = silent[0], min(self._reports.items())
            return WorkerError(stage, f"stage {stage} stopped responding: stage {waiter} gave up waiting for it "
                                      f"({str(body.get('cause')).splitlines()[0]}); it is alive but stuck (a hang in "
                                      "user code, a deadlock): its stack is in its log (kill -USR1 dumps it)",
                               log_tail=tail(stage), checkpoint=ckpt)
        stage = min(self._reports)
        body = self._reports[stage]
        return WorkerError(stage, str(body.get("cause")), traceback=str(body.get("traceback", "")), log_tail=tail(stage),
                           checkpoint=ckpt)

    # --- helpers -----------------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise SessionClosed("this session was stopped; start a new one with vpipe_lab.launch()")
        if self._budget is not None:
            err, self._budget = self._budget, None
            raise err

    def _command(self, kind: str, body: dict[str, Any] | None = None, timeout: float | None = None,
                 wait: bool = True) -> dict[str, Any]:
        self._check()
        cid = next(self._ids)
        self._hub.send("rank0", P.Message(kind, body={"id": cid, **(body or {})}))
        if not wait:
            return {}
        deadline = time.monotonic() + (timeout if timeout is not None else self.spec.timeout_s)
        with self._cond:
            while cid not in self._acks:
                if self._fatal is not None:
                    raise self._fatal
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank 0 did not acknowledge {kind!r} within the timeout; it acts at the next "
                                       f"iteration boundary, so a long iteration delays it")
                self._cond.wait(min(left, 0.1))
            return self._acks.pop(cid)

    def _gather(self, kind: str, body: dict[str, Any] | None = None, timeout: float | None = None,
                answers: int | None = None) -> list[P.Message]:
        """A command every rank answers (or ``answers`` of them); returns the answers ordered by rank."""
        self._check()
        cid = next(self._ids)
        self._hub.send("rank0", P.Message(kind, body={"id": cid, **(body or {})}))
        deadline = time.monotonic() + (timeout if timeout is not None else self.spec.timeout_s)
        with self._cond:
            while len(self._replies.get(cid, [])) < (answers or self.stages):
                if self._fatal is not None:
                    raise self._fatal
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"not every stage answered {kind!r} within the timeout")
                self._cond.wait(min(left, 0.1))
            replies = self._replies.pop(cid)
        return sorted(replies, key=lambda m: int(m.body["rank"]))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._ready) < self.workers:
                if self._fatal is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.workers)) - set(self._ready))
                    self._fatal = WorkerError(missing[0] % self.stages,
                                              f"ranks {missing} did not start within {timeout:.0f} s")
                    break
                self._cond.wait(min(left, 0.1))
        if self._fatal is not None:
            err = self._fatal
            self.stop()
            raise err
        first = self._ready[0]
        self._plan = Plan.from_dict(first["plan"])
        self.names = list(first["names"])
        self._iteration = int(first.get("iteration", self._iteration))
        self._target = self._iteration

    # --- public API -------------------------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        """Iterations completed so far."""
        return self._iteration

    @property
    def plan(self) -> Plan:
        assert self._plan is not None
        return self._plan

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def running(self) -> bool:
        return not self._closed and self._fatal is None and (self._target is None or self._iteration < self._target)

    def cluster(self) -> Cluster:
        """The running hardware as the planners see it: the stage budgets (or this machine's memory split evenly),
        and the slowest measured host-copy and stage-to-stage bandwidths."""
        ready = [self._ready[r] for r in sorted(self._ready)]
        swap = min(float(b.get("swap_bandwidth", 1e10)) for b in ready)
        link = min(float(b.get("link_bandwidth", 1e10)) for b in ready)
        latency = max(float(b.get("link_latency_s", 0.0)) for b in ready) / 2  # probes time a round trip
        if self.spec.memory_budget:
            budgets: int | tuple[int, ...] = tuple(self.spec.memory_budget)
        else:
            import psutil  # only to size a default budget; the Session itself needs nothing beyond the stdlib + zmq

            budgets = int(psutil.virtual_memory().total // self.stages)
        return Cluster(self.stages, budgets, swap, link if link != float("inf") else 1e12, latency, False,
                       f"{self.stages} x {ready[0].get('device', '?')} (measured)")

    def on_event(self, callback: EventCallback) -> Callable[[], None]:
        """Call ``callback(event)`` (from a background thread) for every iteration, error and ack; returns an
        unsubscribe function. Iteration events carry the iteration's spans and per-stage memory."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def run(self, iterations: int | None = None) -> int | None:
        """Train ``iterations`` more iterations (None: until stopped) in the background; returns the target."""
        if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int)
                                       or iterations < 0):
            raise ValueError(f"iterations must be a whole number >= 0 or None, got {iterations!r}")
        ack = self._command(P.RUN, {"iterations": iterations})
        self._target = ack.get("target")
        return self._target

    def wait(self, iteration: int | None = None, timeout: float | None = None) -> int:
        """Block until ``iteration`` iterations are done (default: the target of the last run()); returns the count."""
        goal = iteration if iteration is not None else self._target
        if goal is None:
            raise ValueError("run() was asked to train until stopped: give wait() an iteration to wait for")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._iteration < goal:
                self._check()
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"iteration {goal} not reached within {timeout} s (at {self._iteration})")
                self._cond.wait(0.1)
        self._check()
        return self._iteration

    def pause(self) -> int:
        """Pause at the next iteration boundary; returns the iteration it paused before."""
        return int(self._command(P.PAUSE)["iteration"])

    def resume(self) -> int:
        return int(self._command(P.RESUME)["iteration"])

    def set_telemetry(self, spans: bool) -> int:
        """Stream per-action spans (for timelines) or not, from the next iteration; returns that iteration.
        Iteration summaries and memory are always reported."""
        return int(self._command(P.TELEMETRY, {"spans": bool(spans)})["iteration"])

    def profile(self, reset: bool = False) -> ModelProfile:
        """Every layer's measured costs per micro-batch (averaged over the iterations since the last reset)."""
        layers: dict[int, LayerCost] = {}
        for msg in self._gather(P.PROFILE, {"reset": reset}):
            for doc in msg.body["layers"]:
                index = int(doc["index"])
                cost = LayerCost.from_dict(doc, f"layer {index}")
                cached = self._profile_cache.get(index)
                if doc.get("samples", 0) == 0 and cached is not None and cached.name == cost.name:
                    # Not run since it moved or the plan changed: its last measurement is the best we know.
                    cost = LayerCost(cost.name, cached.forward_s, cached.backward_s,
                                     max(cost.activation_bytes, cached.activation_bytes), cached.input_bytes,
                                     cached.output_bytes, cost.param_bytes, cost.optimizer_bytes or cached.optimizer_bytes,
                                     cost.times or cached.times)
                elif doc.get("samples", 0) > 0:
                    self._profile_cache[index] = cost
                layers[index] = cost
        return ModelProfile(tuple(layers[i] for i in sorted(layers)), name="measured",
                            microbatch_size=self.microbatch_size())

    def microbatch_size(self) -> int:
        """Samples per micro-batch in the latest iteration (0 before the first): what a profile is measured at."""
        latest = self.metrics.latest()
        if not latest or not latest.get("samples") or not latest.get("microbatches"):
            return 0
        return int(latest["samples"]) // (int(latest["microbatches"]) * self.replicas)

    def evaluate(self, data: Any = None, batches: int = 1, timeout: float | None = None) -> float:
        """The mean loss of a forward-only pass over ``batches`` batches of ``data`` (like ``launch``'s data: a
        function of the batch index, an iterable, a bundled example name or 'package.module:attribute'; default: the
        job's ``eval_data``, else its training data from its first batch), with the model in eval mode. It runs at
        the next iteration boundary, between two training iterations, and changes nothing of training's state."""
        from vpipe_lab.control.evaluation import data_ref

        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"batches must be a whole number >= 1, got {batches!r}")
        ref = data_ref(self, data)
        reply = self._gather(P.EVAL, {"data": ref, "batches": batches}, timeout, answers=1)[0]
        if reply.body.get("error"):
            raise ValueError(f"the workers cannot evaluate on {data!r}: {reply.body['error']}")
        return float(reply.body["loss"])

    def state_dict(self, timeout: float | None = None) -> Any:
        """The whole model's parameters and buffers, gathered from every stage, keyed by their names in the model (a
        tied weight once, under its first name), in layer order."""
        from vpipe_lab.control.tensorwire import rebuild

        out: dict[str, Any] = {}
        for msg in sorted(self._gather(P.STATE, {}, timeout), key=lambda m: int(m.body["rank"])):
            for key, value in rebuild(msg.body["tensors"], list(msg.buffers)).items():
                out.setdefault(key, value)  # a weight tied across stages: every copy is equal
        return out

    def detach(self) -> None:
        """Let go of an attached job without stopping it (``attach`` again any time). Idempotent."""
        if self._closed:
            return
        if self._launcher is not None:
            raise RuntimeError("this session started its workers itself: stop() it; only attached sessions detach")
        self._closed = True
        if self._autoplan is not None:
            self._autoplan.stop()
        self._monitor.join(timeout=2)
        self._hub.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the workers (gracefully, then SIGTERM, then SIGKILL) and release everything. Idempotent."""
        if self._closed:
            return
        self._stopping = True
        if self._autoplan is not None:
            self._autoplan.stop()
        if self._launcher is not None:
            if self._fatal is None and self._launcher.alive():
                try:
                    self._hub.send("rank0", P.Message(P.STOP, body={"id": next(self._ids)}))
                except Exception:  # the hub may already be gone; the signals below still work
                    pass
                self._launcher.wait(timeout / 2)
            self._launcher.terminate(timeout=timeout / 2)
        elif self._fatal is None:  # attached: ask rank 0 to end the job, and wait for its acknowledgement
            try:
                self._command(P.STOP, timeout=timeout)
            except Exception as exc:  # the job may be gone already; detaching is all that is left
                log.warning("the attached job did not acknowledge stop: %s", exc)
        self._closed = True
        self._monitor.join(timeout=2)
        self._hub.close()
        self.logger.close()
        if self._job_dir is not None and self._fatal is None:
            shutil.rmtree(self._job_dir, ignore_errors=True)

    close = stop

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._closed else "failed" if self._fatal else "running" if self.running else "idle"
        plan = self._plan.describe() if self._plan else "?"
        return f"<vpipe_lab.Session {state}: {self.stages} stages, iteration {self._iteration}, plan {plan}>"
