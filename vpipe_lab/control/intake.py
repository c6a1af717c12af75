"""Message intake: what the workers send the controller, filed where it belongs (runs on the hub's thread).

READY reports fill the job state; per-stage ITERATION reports are combined into one record per iteration once every
rank has reported it (telemetry/metrics.py); acknowledgements and answers go to the waiting request; evaluations and
migrations become metrics and events; errors go to the failure monitor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vpipe_lab.control.events import Events
from vpipe_lab.control.monitor import FailureMonitor
from vpipe_lab.control.requests import Requests
from vpipe_lab.control.state import JobState
from vpipe_lab.core.timeline import Span
from vpipe_lab.telemetry.metrics import IterationParts, Metrics
from vpipe_lab.telemetry.sinks import Logger
from vpipe_lab.wire import protocol as P


class Intake:
    def __init__(self, stages: int, replicas: int, state: JobState, metrics: Metrics, requests: Requests,
                 monitor: FailureMonitor, events: Events, logger: Logger, cond: threading.Condition) -> None:
        self.state, self.metrics, self.requests, self.monitor = state, metrics, requests, monitor
        self.events, self.logger, self.cond = events, logger, cond
        self.parts = IterationParts(stages, replicas)

    def receive(self, msg: P.Message) -> None:
        body = msg.body
        logged: Callable[[], None] | None = None  # the sink writes outside the lock: it may be slow
        with self.cond:
            if msg.type == P.READY:
                self.state.ready[int(body["rank"])] = body
            elif msg.type == P.UNITS:
                self.state.units = [str(n) for n in body["names"]]
            elif msg.type == P.ITERATION:
                done = self.parts.add(body)
                if done is not None:
                    self.metrics.add(done.record, done.spans, done.memory)
                    if done.replicas:
                        self.metrics.add_replicas(done.replicas)
                    self.state.iteration = max(self.state.iteration, done.iteration + 1)
                    self.events.publish({"type": "iteration", **done.record, "spans": done.spans,
                                         "memory": done.memory})
                    logged = lambda: self.logger.iteration(done.record, done.memory, done.ranks)
            elif msg.type == P.ACK:
                self.requests.acknowledged(body)
            elif msg.type in (P.LAYERS, P.TENSORS):
                self.requests.answered(msg)
            elif msg.type == P.EVALUATED:
                if body.get("id"):
                    self.requests.answered(msg)
                if not body.get("error"):
                    record = {k: body[k] for k in ("iteration", "loss", "batches", "seconds")}
                    self.metrics.add_evaluation(record)
                    self.events.publish({"type": "evaluated", **record})
                    logged = lambda: self.logger.evaluation(record)
            elif msg.type == P.MIGRATED:
                start, end = body["span"]
                replica, stage = divmod(int(body["rank"]), self.parts.stages)  # ranks are replica-major
                span = Span(stage, "migrate", -1, None, float(start), float(end), int(body["iteration"]), replica)
                self.metrics.add_spans([span])
                self.events.publish({"type": "migrated", **body})
                if int(body["rank"]) == 0:
                    text = f"plan version {body['version']}: layers in {body['layers_in']}, out {body['layers_out']}"
                    logged = lambda: self.logger.event(int(body["iteration"]), "plan", text)
            elif msg.type == P.ERROR:
                self.monitor.on_error(body)
            self.cond.notify_all()
        if logged is not None:
            logged()
        if msg.type == P.ACK:  # the acknowledged command's own type is its "command"
            self.events.emit({**body, "type": P.ACK, "command": body.get("type")})
        elif msg.type == P.ERROR:
            self.events.emit({**body, "type": P.ERROR})
