"""Message intake: what the workers send the controller, filed where it belongs (runs on the hub's thread).

READY reports fill the job state; per-stage ITERATION reports are combined into one record per iteration once every
rank has reported it (telemetry/metrics.py); acknowledgements and answers go to the waiting request; evaluations and
migrations become metrics and events; errors go to the failure monitor.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vpipe_lab.control.requests import Requests
from vpipe_lab.control.state import JobState
from vpipe_lab.control.subscriptions import Events
from vpipe_lab.control.workers.monitor import FailureMonitor
from vpipe_lab.core.timeline import Span
from vpipe_lab.telemetry.metrics import IterationParts, Metrics, evaluation_record
from vpipe_lab.telemetry.sinks import Logger
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.codec import decode
from vpipe_lab.wire.events import Ack, Evaluated, Failure, IterationReport, Layers, Migrated, Ready, Tensors, Units

_malformed = P.RateLimitedLog(logging.getLogger(__name__))


class Intake:
    def __init__(self, stages: int, replicas: int, state: JobState, metrics: Metrics, requests: Requests,
                 monitor: FailureMonitor, events: Events, logger: Logger, cond: threading.Condition) -> None:
        self.state, self.metrics, self.requests, self.monitor = state, metrics, requests, monitor
        self.events, self.logger, self.cond = events, logger, cond
        self.parts = IterationParts(stages, replicas)
        # After a restart (control/workers/restarts.py): a replayed iteration's loss and the first run's
        self.on_replay: Callable[[int, float | None, float | None], None] | None = None
        self.recorded = 0  # iterations below this were recorded before the newest restart: they run again
        self.observer: Callable[[P.Message], None] | None = None  # a headless run's metrics.jsonl (telemetry/runlog.py)

    def forget_partial(self, stages: int | None = None) -> None:
        """The workers were replaced (under ``cond``), by ``stages`` stages when the job went on with fewer: what the
        ended ones reported of unfinished iterations is dropped, and the iterations recorded so far are not recorded
        again when the new ones replay them."""
        self.parts = IterationParts(stages or self.parts.stages, self.parts.replicas)
        self.recorded = self.state.iteration

    def _replayed(self, iteration: int, loss: float | None) -> None:
        """An iteration recorded before a restart ran again: recorded once; its loss is compared with the first."""
        first = next((r for r in self.metrics.records(last=self.state.iteration - iteration)
                      if r["iteration"] == iteration), None)
        if self.on_replay is not None:
            self.on_replay(iteration, loss, first.get("loss") if first else None)

    def receive(self, msg: P.Message) -> None:
        if self.observer is not None:
            self.observer(msg)
        try:
            body = decode(msg)
        except P.ProtocolError as exc:  # signed by a holder of the key, so a version mismatch or a bug: say so
            _malformed.warning("dropped a %r message from %s: %s", msg.type, msg.src, exc)
            return
        logged: Callable[[], None] | None = None  # the sink writes outside the lock: it may be slow
        with self.cond:
            if isinstance(body, Ready):
                self.state.ready[body.rank] = body
            elif isinstance(body, Units):
                self.state.units = list(body.names)
                self.state.refused = body.refused or None
            elif isinstance(body, IterationReport):
                done = self.parts.add(body)
                if done is not None and done.iteration < self.recorded:
                    self._replayed(done.iteration, done.record.get("loss"))
                elif done is not None:
                    self.metrics.add(done.record, done.spans, done.memory, done.experts)
                    if done.replicas:
                        self.metrics.add_replicas(done.replicas)
                    self.state.iteration = max(self.state.iteration, done.iteration + 1)
                    self.events.publish({"type": "iteration", **done.record, "spans": done.spans,
                                         "memory": done.memory})
                    logged = lambda: self.logger.iteration(done.record, done.memory, done.ranks, done.experts)
            elif isinstance(body, Ack):
                self.requests.acknowledged(body)
            elif isinstance(body, (Layers, Tensors)):
                self.requests.answered(body)
            elif isinstance(body, Evaluated):
                if body.id:
                    self.requests.answered(body)
                if not body.error:
                    record = evaluation_record(body)
                    self.metrics.add_evaluation(record)
                    self.events.publish({"type": "evaluated", **record})
                    logged = lambda: self.logger.evaluation(record)
            elif isinstance(body, Migrated):
                start, end = body.span
                span = Span(body.stage, "migrate", -1, None, start, end, body.iteration, 0)  # replica 0 reports
                self.metrics.add_spans([span])
                self.events.publish({"type": "migrated", **body.to_dict()})
                if body.stage == 0:
                    text = f"plan version {body.version}: layers in {body.layers_in}, out {body.layers_out}"
                    logged = lambda: self.logger.event(body.iteration, "plan", text)
            elif isinstance(body, Failure):
                self.monitor.on_error(body)
            self.cond.notify_all()
        if logged is not None:
            logged()
        if isinstance(body, Ack):  # the acknowledged command's own type is its "command"
            self.events.emit({**body.to_dict(), "type": P.ACK})
        elif isinstance(body, Failure):
            self.events.emit({**body.to_dict(), "type": P.ERROR})
