"""Where a job's metrics go besides the Session: TensorBoard, Weights & Biases, MLflow or a function of yours.

``launch(..., log="tensorboard:DIR" | "wandb:PROJECT" | "mlflow:URI" | callable)`` and ``vpipe-lab worker --log``
(the same strings). Each completed iteration logs ``loss``, ``grad_norm``, ``lr``, ``samples_per_s``, ``time_s``,
``plan_version``, every stage's ``stage{k}/time_s`` and ``stage{k}/peak_bytes`` and every mixture-of-experts layer's
``experts/{module}/imbalance`` (and ``/dropped`` where it has a capacity); an evaluation logs ``eval/loss``;
a plan change is an event (a text record in TensorBoard, a ``plan`` table row in W&B, a tag in MLflow). The libraries
are optional extras (``pip install vpipe-lab[tensorboard]`` and so on) and are imported only when asked for. A
failing sink logs the error once and stops logging; it never stops training.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vpipe_lab.wire.events import IterationReport

log = logging.getLogger(__name__)


def scalars(record: dict[str, Any], memory: list[dict[str, Any]] | None = None,
            parts: list[IterationReport] | None = None, experts: list[dict[str, Any]] | None = None
            ) -> dict[str, float]:
    """The numbers one iteration logs, by name (absent and NaN values left out); per mixture-of-experts layer its
    load imbalance (the busiest expert's tokens over the mean) and the tokens it dropped over its capacity."""
    out: dict[str, float] = {}
    for key in ("loss", "grad_norm", "lr", "samples_per_s", "time_s", "plan_version", "loss_scale"):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    for body in parts or []:
        out[f"stage{body.stage}/time_s"] = body.end - body.start
    for row in memory or []:  # per stage: the first pipeline replica's (the others hold the same layers)
        if int(row.get("replica", 0)) == 0 and isinstance(row.get("peak"), (int, float)):
            out[f"stage{int(row['stage'])}/peak_bytes"] = float(row["peak"])
    for row in experts or []:
        tokens = row["tokens"]
        if tokens and sum(tokens):
            out[f"experts/{row['layer']}/imbalance"] = max(tokens) * len(tokens) / sum(tokens)
        if row.get("dropped") is not None:
            out[f"experts/{row['layer']}/dropped"] = float(sum(row["dropped"]))
    return out


class Sink:
    """One destination; subclasses write ``scalars`` at a step and ``event`` texts."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def event(self, step: int, name: str, text: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoard(Sink):
    """Event files through tensorboard's own writer (the one torch.utils.tensorboard uses), with no torch."""

    def __init__(self, directory: str) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(directory).mkdir(parents=True, exist_ok=True)
        self._event, self._summary = event_pb2, summary_pb2
        self._writer = EventFileWriter(directory)

    def _write(self, step: int, summary: Any) -> None:
        self._writer.add_event(self._event.Event(summary=summary, wall_time=time.time(), step=step))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        S = self._summary.Summary
        self._write(step, S(value=[S.Value(tag=k, simple_value=v) for k, v in values.items()]))
        self._writer.flush()

    def event(self, step: int, name: str, text: str) -> None:
        S = self._summary
        meta = S.SummaryMetadata(plugin_data=S.SummaryMetadata.PluginData(plugin_name="text"))
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                                        tensor_shape=tensor_shape_pb2.TensorShapeProto())
        self._write(step, S.Summary(value=[S.Summary.Value(tag=name, metadata=meta, tensor=tensor)]))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB(Sink):
    def __init__(self, project: str) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, reinit="create_new")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def event(self, step: int, name: str, text: str) -> None:
        self._run.log({name: self._wandb.Html(f"<pre>{text}</pre>")}, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflow(Sink):
    def __init__(self, uri: str) -> None:
        import mlflow

        self._client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name("vpipe_lab")
        eid = experiment.experiment_id if experiment else self._client.create_experiment("vpipe_lab")
        self.run_id = self._client.create_run(eid).info.run_id

    def scalars(self, step: int, values: dict[str, float]) -> None:
        import mlflow.entities

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            mlflow.entities.Metric(k.replace("/", "."), v, now, step) for k, v in values.items()])

    def event(self, step: int, name: str, text: str) -> None:
        self._client.set_tag(self.run_id, f"{name}.{step}", text[:5000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class Callback(Sink):
    """Your function, called with ``{"type": "scalars", "step": ..., **values}`` and ``{"type": "event", ...}``."""

    def __init__(self, fn: Callable[[dict[str, Any]], Any]) -> None:
        self._fn = fn

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._fn({"type": "scalars", "step": step, **values})

    def event(self, step: int, name: str, text: str) -> None:
        self._fn({"type": "event", "step": step, "name": name, "text": text})


def check(spec: Any) -> None:
    """Refuse a ``log=`` value that cannot work, before anything starts."""
    from vpipe_lab.core.settings import check_log

    check_log("log", spec)


def open_sink(spec: Any) -> Sink | None:
    """The sink ``spec`` names (see ``check``); a library that is not installed is an error naming the extra."""
    check(spec)
    if spec is None:
        return None
    if callable(spec):
        return Callback(spec)
    kind, _, target = spec.partition(":")
    try:
        return {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}[kind](target)
    except ImportError as exc:
        raise ValueError(f"log={spec!r} needs the {kind} package ({exc.name} is missing): pip install "
                         f"'vpipe-lab[{kind}]'") from None


class Logger:
    """A sink that never breaks training: the first failure is logged with its cause and logging stops."""

    def __init__(self, sink: Sink | None) -> None:
        self.sink = sink

    def _guard(self, call: Callable[[], None]) -> None:
        if self.sink is None:
            return
        try:
            call()
        except Exception as exc:  # a full disk, a dead tracking server: training must go on
            log.error("metrics logging stopped after an error in %s: %s: %s", type(self.sink).__name__,
                      type(exc).__name__, exc)
            self.sink = None

    def iteration(self, record: dict[str, Any], memory: list[dict[str, Any]], parts: list[IterationReport],
                  experts: list[dict[str, Any]] | None = None) -> None:
        self._guard(lambda: self.sink.scalars(int(record["iteration"]), scalars(record, memory, parts, experts)))  # type: ignore[union-attr]

    def evaluation(self, record: dict[str, Any]) -> None:
        self._guard(lambda: self.sink.scalars(int(record["iteration"]), {"eval/loss": float(record["loss"])}))  # type: ignore[union-attr]

    def event(self, step: int, name: str, text: str) -> None:
        self._guard(lambda: self.sink.event(step, name, text))  # type: ignore[union-attr]

    def close(self) -> None:
        self._guard(lambda: self.sink.close())  # type: ignore[union-attr]
        self.sink = None
