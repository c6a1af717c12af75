"""What one `%vpipe dashboard` display costs a browser: bytes on the wire and seconds from the cell finishing to the
first complete draw, with the machine otherwise idle and under load (busy processes beside the training job); and
the same for `%vpipe editor` (its blocks on screen; the what-if view under it counted in its bytes).

Side by side in one JupyterLab page, turns alternating: vpipe_lab's live view, and the same three figures as plotly
`FigureWidget`s in an ipywidgets box (what the dashboard was before: one 5 MB plotly.js per panel). Each display is
closed before the next, so the bytes counted are that display's own.

    python benchmarks/dashboard_load.py [--trials 5] [--load 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the browser harness lives with the tests

from tests.integration.lab import (
    WireBytes,
    ask,
    chromium,
    cpu_load,
    dismiss_news,
    jupyterlab,
    kernel_client,
    open_notebook,
    run_and_time,
    run_cells,
    wait_cells_done,
    write_notebook,
)

SETUP = [
    "%load_ext vpipe_lab",
    "%vpipe start gpt-tiny --stages 2 --microbatches 4 --device cpu --run forever",
    "_ = session.wait(3, timeout=300)",
    "from vpipe_lab.charts.figures import gantt_spec, memory_spec, series_spec\n"
    "from vpipe_lab.jupyter.magics import _MAGICS\n"
    "import ipywidgets, plotly.graph_objects as go",
]
LIVE = "%vpipe dashboard"
# The pre-LiveView dashboard's widgets, holding the same figures (drawn whole at creation: no deltas to lose).
FIGURES = ("_figs = [go.FigureWidget(gantt_spec(session.metrics.timeline(3).with_idle(), stages=2)),\n"
           "        go.FigureWidget(memory_spec(['stage 0', 'stage 1'])),\n"
           "        go.FigureWidget(series_spec(session.metrics.records(last=500)))]\n"
           "_box = ipywidgets.VBox([ipywidgets.HTML('vpipe_lab'), _figs[0], ipywidgets.HBox(_figs[1:])])\n"
           "_box")
CLOSE = {"live": "for _v in _MAGICS[-1].views: _v.close()\n_MAGICS[-1].views.clear()",
         "figures": "_box.close()\nfor _f in _figs: _f.close()"}
CLOSE["editor"] = CLOSE["live"]
CODE = {"live": LIVE, "figures": FIGURES, "editor": "%vpipe editor"}


def trial(page, kc, wire: WireBytes, kind: str) -> dict[str, float | None]:  # type: ignore[no-untyped-def]
    before = wire.total
    timing = run_and_time(page, CODE[kind], kind)
    sent = wire.total - before
    ask(kc, CLOSE[kind])
    time.sleep(1.0)
    return {"bytes": sent, "first_draw_s": timing["first_draw_s"], "run_s": timing["run_s"]}


def spread(values: list[float], unit: str, digits: int = 2) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.{digits}f} {unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summary(rows: list[dict[str, float | None]]) -> list[str]:
    done = [r for r in rows if r["first_draw_s"] is not None]
    blank = len(rows) - len(done)
    return [spread([float(r["bytes"] or 0) / 1e6 for r in rows], "MB"),
            spread([float(r["run_s"] or 0) for r in rows], "s"),
            spread([float(r["first_draw_s"] or 0) for r in done], "s")
            + (f", {blank} of {len(rows)} never drew" if blank else ""),
            spread([float(r["run_s"] or 0) + float(r["first_draw_s"] or 0) for r in done], "s")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="displays of each kind per condition")
    ap.add_argument("--load", type=int, default=2, help="busy processes in the loaded condition")
    args = ap.parse_args()
    results: dict[tuple[str, str], list[dict[str, float | None]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_notebook(root / "bench.ipynb", SETUP)
        with jupyterlab(root) as lab, chromium(1400, 1000) as page:
            wire = WireBytes(page)
            open_notebook(page, lab, "bench.ipynb")
            run_cells(page)
            wait_cells_done(page, 600)
            dismiss_news(page)
            kc = kernel_client(lab)
            try:
                for condition in ("idle", "loaded"):
                    with cpu_load(args.load if condition == "loaded" else 0):
                        time.sleep(2)
                        for t in range(args.trials):
                            kinds = ("live", "figures", "editor") if t % 2 == 0 else ("editor", "figures", "live")
                            for kind in kinds:
                                row = trial(page, kc, wire, kind)
                                results.setdefault((condition, kind), []).append(row)
                                print(condition, kind, row, flush=True)
                ask(kc, "%vpipe stop")
            finally:
                kc.stop_channels()
    print("\nmedian (range) over the trials:\n")
    print("| condition | display | bytes on the wire | cell runs | cell finished -> first complete draw | "
          "cell started -> first complete draw |")
    print("|---|---|---|---|---|---|")
    names = {"live": "vpipe_lab live view", "figures": "3 plotly FigureWidgets", "editor": "partition editor"}
    for (condition, kind), rows in sorted(results.items()):
        print(f"| {condition} | {names[kind]} | " + " | ".join(summary(rows)) + " |")


if __name__ == "__main__":
    main()
