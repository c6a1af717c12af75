"""The page stays light over a long run: three dashboards, the editor and the history panel open in JupyterLab while
training goes on for minutes, the page's JavaScript heap sampled (after a garbage collection) and its slope checked
against the first quarter's level, and every view still drawing at the end.

    VPIPE_LAB_SOAK_MINUTES=30 .ci/venv/bin/python -m pytest -m soak tests/integration/test_page_memory.py -s

Skipped unless the minutes are given (marker ``soak``); benchmarks/RESULTS.md records the runs made by hand.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

from tests.integration.lab import (
    LIVE_REPORT_JS,
    ask,
    chromium,
    jupyterlab,
    kernel_client,
    live_views,
    open_notebook,
    run_cells,
    write_notebook,
)

MINUTES = float(os.environ.get("VPIPE_LAB_SOAK_MINUTES", "0"))
pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.browser,
              pytest.mark.skipif(not MINUTES, reason="a soak runs for minutes: set VPIPE_LAB_SOAK_MINUTES")]
CELLS = ["%load_ext vpipe_lab",
         "%vpipe start gpt-tiny --stages 2 --microbatches 4 --device cpu --run forever",
         "%vpipe dashboard", "%vpipe dashboard", "%vpipe dashboard", "%vpipe editor", "%vpipe history"]


@pytest.mark.timeout(int(MINUTES * 60 + 600))
def test_the_page_heap_stays_flat_with_three_dashboards_open(tmp_path) -> None:  # type: ignore[no-untyped-def]
    write_notebook(tmp_path / "long.ipynb", CELLS)
    samples: list[tuple[float, float]] = []  # (minutes, MiB)
    with jupyterlab(tmp_path) as lab, chromium(1400, 1000) as page:
        cdp = page.context.new_cdp_session(page)
        open_notebook(page, lab, "long.ipynb")
        run_cells(page)
        page.wait_for_function(f"() => ({LIVE_REPORT_JS})().filter(v => v.role === 'dashboard').length === 3",
                               timeout=300_000)
        start = time.monotonic()
        while time.monotonic() - start < MINUTES * 60:
            time.sleep(20)
            cdp.send("HeapProfiler.collectGarbage")
            used = cdp.send("Runtime.getHeapUsage")["usedSize"] / 2**20
            minutes = (time.monotonic() - start) / 60
            samples.append((minutes, used))
            print(f"{minutes:5.1f} min: JS heap {used:.1f} MiB", flush=True)
        views = live_views(page, None)
        frames = [v["frame"] for v in live_views(page)]
        page.wait_for_timeout(3000)
        assert all(b > a for a, b in zip(frames, [v["frame"] for v in live_views(page)]))  # still drawing
        assert {v["role"] for v in views} == {"dashboard", "what-if", "history"}
        kc = kernel_client(lab, "long.ipynb")
        try:
            iterations = ask(kc, "print(session.iteration)").strip().splitlines()[-1]
            assert "no worker process is left" in ask(kc, "%vpipe stop")
        finally:
            kc.stop_channels()
    warm = samples[len(samples) // 4:]
    slope = statistics.linear_regression([m for m, _ in warm], [h for _, h in warm]).slope  # MiB per minute
    level = statistics.median(h for _, h in warm)
    print(f"page heap: {MINUTES:g} min, {iterations} iterations, {warm[0][1]:.1f} -> {warm[-1][1]:.1f} MiB "
          f"(median {level:.1f}), slope {slope * 60:+.2f} MiB/hour after the first quarter")
    assert slope * 60 < 0.1 * level  # under 10% of the heap per hour: flat but for noise
