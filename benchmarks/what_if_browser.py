"""The what-if as a user meets it: in JupyterLab, per schedule, drag a boundary in the editor, read the what-if it
shows, Apply, and compare with the iteration time the change then measured.

    python benchmarks/what_if_browser.py [--schedules gpipe 1f1b interleaved-1f1b zb-h1 zbv] [--iterations 30]
                                         [--settle 15] [--after 150] [--repeat 1]

One JupyterLab in headless Chromium; per schedule a notebook starts gpt-tiny on 2 CPU stages training without end,
waits ``--iterations``, measures a profile, opens ``%vpipe editor``. ``--settle`` seconds after the editor's first
draw (a user reading it; the page's load over) the first boundary is dragged one layer to the left with the mouse;
the editor's "what-if: X ms per iteration" is read off the page (and its calibration off the summary's hover); Apply;
with the page still open (the machine the what-if was calibrated on), the session's record gives the median over the
``--after`` iterations from the one the change came into force (about 9 s here: a steadier truth than a couple of
seconds on a machine the browser shares). ``--repeat`` drags each schedule that many times (a new notebook each). The
table gives the plain simulation's error beside the calibrated what-if's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the browser harness lives with the tests

from tests.integration.lab import ask, chromium, jupyterlab, kernel_client, open_notebook, run_cells, write_notebook

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"]


def drag_first_boundary_left(page: Any) -> None:
    """Move the first boundary one layer to the left, with the mouse, as a user does."""
    handle = page.locator('[data-testid="boundary-1"]')
    handle.scroll_into_view_if_needed()
    first_of_next = page.evaluate("[...document.querySelectorAll('.vpipe-layer')].findIndex(b => b.dataset.chunk === '1')")
    target = page.locator(f'[data-testid="layer-{first_of_next - 1}"]').bounding_box()
    start = handle.bounding_box()
    assert start and target
    page.mouse.move(start["x"] + start["width"] / 2, start["y"] + start["height"] / 2)
    page.mouse.down()
    for frac in (0.3, 0.6, 1.0):
        page.mouse.move(start["x"] + (target["x"] - start["x"]) * frac, start["y"] + start["height"] / 2, steps=5)
    page.mouse.up()


def one(lab: Any, schedule: str, iterations: int, settle: float, after: int, run: int = 0) -> dict[str, Any]:
    name = f"what-if-{schedule}-{run}.ipynb"
    write_notebook(lab.root / name, [
        "%load_ext vpipe_lab",
        f"%vpipe start gpt-tiny --stages 2 --microbatches 4 --schedule {schedule} --device cpu --run forever",
        f"_ = session.wait(session.iteration + {iterations}, timeout=300)\n_ = session.profile()",
        "%vpipe editor"])
    with chromium(1400, 1000) as page:
        open_notebook(page, lab, name)
        run_cells(page)
        page.locator('[data-testid="boundary-1"]').wait_for(state="visible", timeout=300_000)
        page.wait_for_function("document.querySelector('[data-testid=\"summary\"]')?.textContent.length > 0",
                               timeout=120_000)
        page.wait_for_timeout(settle * 1000)  # a user reads the editor before dragging; the page's load is over
        drag_first_boundary_left(page)
        page.wait_for_function("/what-if: [\\d.]+ ms/.test(document.querySelector('[data-testid=\"summary\"]')"
                               ".textContent)", timeout=60_000)  # the draft's own, after the profile re-measured
        shown = page.locator('[data-testid="summary"]').text_content() or ""
        found = re.search(r"what-if: ([\d.]+) ms per iteration", shown)
        assert found, shown
        calibration = page.locator('[data-testid="summary"]').get_attribute("title") or ""  # how it was scaled
        page.locator('[data-testid="apply"]').click()
        page.wait_for_function("document.querySelector('[data-testid=\"status\"]').textContent.includes('applied at')",
                               timeout=180_000)
        kc = kernel_client(lab, name)  # measured with the page still open, as it was before the drag
        try:
            text = ask(kc, f"import json\n_ = session.wait(session.iteration + {after}, timeout=300)\n"
                           "row = session.record.rows()[-1]\n"
                           "print(json.dumps({k: row[k] for k in ('source', 'plan', 'median_s', 'predicted_s')}))\n"
                           "session.stop()")
        finally:
            kc.stop_channels()
    row = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    return {"schedule": schedule, "shown_ms": float(found[1]), "calibration": calibration, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--settle", type=float, default=15.0, help="seconds between the editor's first draw and the drag")
    ap.add_argument("--after", type=int, default=150, help="iterations measured after the change came into force")
    ap.add_argument("--repeat", type=int, default=1, help="drags per schedule")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, jupyterlab(Path(tmp)) as lab:
        for run in range(args.repeat):
            for schedule in args.schedules:
                rows.append(one(lab, schedule, args.iterations, args.settle, args.after, run))
                print(rows[-1], flush=True)
    print("\n| schedule | plan after the drag | measured after Apply (ms) | simulated (ms) | error | "
          "editor's what-if, calibrated (ms) | error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        measured = 1e3 * r["median_s"]
        factor = re.match(r"calibrated x([\d.]+)", r["calibration"])
        simulated = r["shown_ms"] / float(factor[1]) if factor else r["shown_ms"]  # the what-if before calibration
        print(f"| {r['schedule']} | {r['plan']} | {measured:.2f} | {simulated:.2f} | {measured / simulated - 1:+.1%} | "
              f"{r['shown_ms']:.2f} | {measured / r['shown_ms'] - 1:+.1%} |")


if __name__ == "__main__":
    main()
