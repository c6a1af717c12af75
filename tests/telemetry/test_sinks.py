"""Metrics sinks: the scalars an iteration logs, TensorBoard files read back, a failing sink never stops training."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.messages import report
from vpipe_lab.telemetry import sinks


def test_scalars_of_an_iteration() -> None:
    record = {"iteration": 3, "loss": 1.5, "grad_norm": 0.7, "lr": None, "samples_per_s": float("nan"),
              "time_s": 0.2, "plan_version": 1}
    parts = [report(3, 0, start=1.0, end=1.25), report(3, 1, start=1.1, end=1.2)]
    out = sinks.scalars(record, [{"stage": 1, "peak": 100}], parts)
    assert out == {"loss": 1.5, "grad_norm": 0.7, "time_s": 0.2, "plan_version": 1.0, "stage0/time_s": 0.25,
                   "stage1/time_s": pytest.approx(0.1), "stage1/peak_bytes": 100.0}


def test_tensorboard_files_hold_scalars_and_events(tmp_path: Path) -> None:
    sink = sinks.open_sink(f"tensorboard:{tmp_path / 'tb'}")
    assert sink is not None
    sink.scalars(0, {"loss": 2.0})
    sink.scalars(1, {"loss": 1.0})
    sink.event(1, "plan", "moved layer 3")
    sink.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 2.0), (1, 1.0)]
    assert "plan" in acc.Tags()["tensors"]


def test_mlflow_run_gets_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()  # a file store (mlflow-skinny has no SQL backend)
    sink = sinks.open_sink(f"mlflow:{uri}")
    assert isinstance(sink, sinks.MLflow)
    sink.scalars(0, {"loss": 2.0, "stage0/time_s": 0.1})
    sink.scalars(1, {"loss": 1.0})
    sink.close()
    history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(sink.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 2.0), (1, 1.0)]


def test_wandb_offline_run_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = sinks.open_sink("wandb:vpipe-test")
    assert sink is not None
    sink.scalars(0, {"loss": 2.0})
    sink.close()
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_bad_specs_are_refused() -> None:
    for spec in ("tensorboard", "influx:x", "wandb:", 3):
        with pytest.raises(ValueError, match="log="):
            sinks.check(spec)
    sinks.check(print)
    sinks.check(None)


def test_a_failing_sink_is_logged_once_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Any] = []

    def broken(record: dict[str, Any]) -> None:
        calls.append(record)
        raise OSError("disk full")

    logger = sinks.Logger(sinks.open_sink(broken))
    with caplog.at_level(logging.ERROR):
        logger.iteration({"iteration": 0, "loss": 1.0}, [], [])
        logger.iteration({"iteration": 1, "loss": 1.0}, [], [])
    assert len(calls) == 1 and logger.sink is None
    assert "disk full" in caplog.text


def test_moe_layers_log_their_imbalance_and_dropped_tokens() -> None:
    from vpipe_lab.telemetry.sinks import scalars

    rows = [{"layer": "m.layers.1.mlp", "tokens": [6, 2, 0, 0], "dropped": None},
            {"layer": "m.layers.2.mlp", "tokens": [2, 2, 2, 2], "dropped": [1, 0, 0, 2]}]
    got = scalars({"loss": 1.0}, experts=rows)
    assert got["experts/m.layers.1.mlp/imbalance"] == 3.0  # the busiest expert took 3x the mean
    assert got["experts/m.layers.2.mlp/imbalance"] == 1.0 and got["experts/m.layers.2.mlp/dropped"] == 3.0
    assert "experts/m.layers.1.mlp/dropped" not in got
