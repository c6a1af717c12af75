"""An unattended job's metrics file: one line per iteration once every rank reported, restarts cut what is redone."""

from __future__ import annotations

from pathlib import Path

from tests import messages
from vpipe_lab.telemetry import runlog
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.events import Evaluated


def report(it: int, stage: int, replica: int = 0) -> P.Message:
    return messages.report(it, stage, replica=replica, start=1.0 + stage, end=2.0 + stage,
                           losses=[float(it + replica)] * 2, samples=4, memory={"peak": 10 * (stage + 1)},
                           grad_norm=0.5, lr=0.1).message()


def test_iterations_are_written_when_every_rank_reported_and_a_restart_drops_redone_ones(tmp_path: Path) -> None:
    log = runlog.RunLog(tmp_path, stages=2, start=0, replicas=2)
    for it in range(3):
        for replica in range(2):
            for stage in range(2):
                log.observe(report(it, stage, replica))
    log.observe(Evaluated(1, iteration=2, loss=0.3, batches=1, seconds=0.1).message())
    log.close()
    frame = runlog.read(tmp_path)
    assert list(frame["iteration"]) == [0, 1, 2]
    assert list(frame["loss"]) == [0.5, 1.5, 2.5] and list(frame["samples"]) == [8] * 3  # over both replicas
    assert frame["stages"][0] == [{"stage": 0, "time_s": 1.0, "peak_bytes": 10},
                                  {"stage": 1, "time_s": 1.0, "peak_bytes": 20}]
    with open(tmp_path / runlog.METRICS, "a") as fh:
        fh.write('{"kind": "iteration", "itera')  # a line cut short by a kill
    again = runlog.RunLog(tmp_path, stages=1, start=1, note="a node left")  # resumed after iteration 0, on one stage
    again.close()
    assert list(runlog.read(tmp_path)["iteration"]) == [0]
    starts = runlog.read(tmp_path, "start")
    assert list(starts["iteration"]) == [0, 1] and list(starts["stages"]) == [2, 1] and starts["note"].iloc[1] == "a node left"
    assert runlog.read(tmp_path, "evaluation").empty  # it ran after iteration 2, which is redone


def test_attach_file(tmp_path: Path) -> None:
    import json

    path = runlog.write_attach(tmp_path, "tcp://127.0.0.1:29600", "node7", None)
    assert json.loads(path.read_text())["host"] == "node7"


def test_the_experts_load_of_each_moe_layer_is_a_line_per_iteration(tmp_path: Path) -> None:
    log = runlog.RunLog(tmp_path, stages=2, start=0)
    for it in range(2):
        log.observe(messages.report(it, 0, experts={"m.layers.1.mlp": {"tokens": [3, 1], "dropped": None}}).message())
        log.observe(messages.report(it, 1, losses=[1.0], experts={"m.layers.2.mlp": {"tokens": [0, 4],
                                                                                      "dropped": [0, 2]}}).message())
    log.close()
    frame = runlog.read(tmp_path, "experts")  # as Session.metrics.experts: a row per expert
    assert len(frame) == 2 * 2 * 2
    last = frame[frame.iteration == 1]
    assert last["layer"].tolist() == ["m.layers.1.mlp"] * 2 + ["m.layers.2.mlp"] * 2
    assert last["tokens"].tolist() == [3, 1, 0, 4] and last["dropped"].tolist()[2:] == [0, 2]
    assert list(runlog.read(tmp_path)["iteration"]) == [0, 1]  # the iterations' lines are unchanged
