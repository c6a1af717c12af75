"""The run report's summary on a case with a known answer: the steady iterations' median against the prediction, the
measured bottleneck (the stage whose work bounds the iteration) beside the predicted one, and what produced it."""

from __future__ import annotations

import pandas as pd

from vpipe_lab.cli.html_report import Provenance, summary
from vpipe_lab.core.plan import Estimate
from vpipe_lab.core.timeline import Span, Timeline


def test_summary_of_a_run_with_a_known_answer() -> None:
    # Two warm-up iterations, then 20, 30 and 40 ms: the median of the steady ones is 30 ms.
    frame = pd.DataFrame({"iteration": [0, 1, 2, 3, 4], "loss": [2.0, 1.5, 1.2, 1.1, 1.0],
                          "time_s": [0.5, 0.4, 0.02, 0.03, 0.04], "samples_per_s": [10.0, 12.0, 400.0, 300.0, 200.0]})
    # Stage 1 computes 3 ms per micro-batch, stage 0 one: stage 1 bounds the iteration.
    spans = [Span(0, "forward", m, None, 0.001 * m, 0.001 * m + 0.001) for m in range(2)] + [
        Span(1, "forward", m, None, 0.002 + 0.003 * m, 0.005 + 0.003 * m) for m in range(2)]
    est = Estimate(0.025, (0.001, 0.003), (10, 10), (100, 100), 0.1, True)
    lines = summary(frame, Timeline(spans), est)
    assert lines[0] == "iterations: 5 (to iteration 4)"
    assert lines[1] == "loss:       2.0000 -> 1.0000"
    assert lines[2] == "iteration:  measured 30.00 ms (median), predicted 25.00 ms (measured/predicted 1.20)"
    assert lines[3] == "throughput: 300.0 samples/s"
    assert lines[4] == "bottleneck: stage 1 measured, stage 1 predicted"


def test_provenance_says_what_produced_the_run() -> None:
    lines = Provenance("vpipe-lab run --model mlp", "mlp", "1f1b M=2 [0:5]KKKKK [5:10]KKKKK", 3,
                       "2026-12-07T08:00:00+00:00").lines()
    assert lines[0] == "command:   vpipe-lab run --model mlp" and lines[2].startswith("plan:      v3 1f1b M=2")
    assert lines[3].startswith("finished:  2026-12-07T08:00:00+00:00  (vpipe_lab ")
