"""Real browser, real JupyterLab: the live dashboard draws every panel in every display while training runs on a
loaded CPU, fits the output area, and survives %vpipe stop; under interleaved 1F1B each stage's lane holds a lane per
chunk; in the quickstart a partition boundary is dragged with the mouse and applied, and the engine runs the new
partition from the next iteration. Keeps screenshots in artifacts/browser/."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.lab import (
    LIVE_REPORT_JS,
    Lab,
    ask,
    cell_finished,
    chromium,
    clipped,
    cpu_load,
    jupyterlab,
    kernel_client,
    live_views,
    open_notebook,
    run_cells,
    wait_cells_done,
    write_notebook,
)

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "browser"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """One JupyterLab for the module's tests (each opens a notebook of its own, with its own kernel)."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", root / "01_quickstart.ipynb")
    with jupyterlab(root) as running:
        yield running


DISPLAYS = [
    "%load_ext vpipe_lab",
    "%vpipe start gpt-tiny --stages 2 --microbatches 4 --device cpu --run forever",
    "%vpipe dashboard",
    "_ = session.wait(session.iteration + 3, timeout=300)",
    "%vpipe dashboard",
    "_ = session.wait(session.iteration + 3, timeout=300)",
    "%vpipe dashboard",
    "%vpipe editor",
    "_ = session.wait(session.iteration + 3, timeout=300)",
    "%vpipe stop",
]


def drawn(view: dict) -> bool:  # type: ignore[type-arg]
    """Every panel drew real content: spans in the timeline, a bar per stage, a loss line."""
    p = view["panels"]
    return p["timeline"]["count"] >= 8 and p["memory"]["count"] >= 2 and p["series"]["count"] >= 2


def python_frames(kc) -> list[int]:  # type: ignore[no-untyped-def]
    text = ask(kc, "from vpipe_lab.jupyter.magics import _MAGICS\n"
                   "print([v.widget.frame for v in _MAGICS[-1].views if hasattr(v, 'refreshes')])")
    return json.loads(text.strip().splitlines()[-1])


def test_every_dashboard_display_draws_fits_and_survives_stop_on_a_loaded_machine(lab: Lab) -> None:
    write_notebook(lab.root / "displays.ipynb", DISPLAYS)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with cpu_load(1), chromium(1400, 1000) as page:  # one busy process beside the job (CI's suite runs another file too)
        open_notebook(page, lab, "displays.ipynb")
        run_cells(page, "notebook:run-all-above", below=len(DISPLAYS) - 1)  # everything but the stop cell
        deadline = time.monotonic() + 420
        while not cell_finished(page, len(DISPLAYS) - 2) and time.monotonic() < deadline:
            time.sleep(1)
        # Every display of the session draws every panel, while training runs and the CPU is busy.
        page.wait_for_function(f"""() => {{ const views = ({LIVE_REPORT_JS})().filter(v => v.role === "dashboard");
            return views.length === 3 && views.every(v => v.panels.timeline.count >= 8 && v.panels.memory.count >= 2
                                                         && v.panels.series.count >= 2); }}""", timeout=120_000)
        views = live_views(page)
        assert len(views) == 3 and all(drawn(v) for v in views), views
        assert all("running" in v["header"] and "iteration" in v["header"] for v in views)
        assert all("bottleneck: stage" in v["header"] and "pipeline bubble" in v["header"] for v in views), views
        assert all(v["panels"]["timeline"]["ticks"] == ["stage 0", "stage 1"] for v in views), views
        assert all(v["panels"]["experts"]["hidden"] for v in views)  # a dense model: no experts' panel
        # ... and keeps updating, at most 10 frames a second, drawing the newest frame (no backlog).
        kc = kernel_client(lab, "displays.ipynb")
        try:
            before = [v["frame"] for v in live_views(page)]
            time.sleep(4)
            after = [v["frame"] for v in live_views(page)]
            sent = python_frames(kc)
            assert all(b < a for b, a in zip(before, after)), (before, after)
            assert all(a - b <= 10 * 4 + 2 for b, a in zip(before, after))
            # The page draws the newest frame it has, so it reaches what the kernel had sent by then. How soon rests
            # on the loaded machine's websocket and renderer (7 frames behind after 1.5 s seen under CI's load), so
            # wait for it, up to 15 s, instead of timing it: a page that queued every frame falls further behind.
            page.wait_for_function(f"""() => {{ const drawn = ({LIVE_REPORT_JS})().filter(v => v.role === "dashboard")
                                                                      .map(v => v.frame);
                return drawn.length === {len(sent)} && drawn.every((f, i) => f >= {sent}[i] - 2); }}""", timeout=15_000)
            # Nothing is clipped: in the lab's default output width at a 1400 px window, and narrower.
            for width in (1400, 900):
                page.set_viewport_size({"width": width, "height": 1000})
                # Plotly re-lays a plot out on the window's resize event; with the CPU loaded and three dashboards
                # redrawing that can take past 1.5 s (a 478 px plot seen in a 468 px panel once), so wait for the
                # layout to settle, up to 10 s, and then require nothing clipped.
                settle = time.monotonic() + 10
                page.wait_for_timeout(1500)
                views = live_views(page)
                while any(clipped(v) for v in views) and time.monotonic() < settle:
                    page.wait_for_timeout(500)
                    views = live_views(page)
                assert all(drawn(v) for v in views)
                assert [clipped(v) for v in views] == [[], [], []], f"at {width} px"
                page.screenshot(path=str(ARTIFACTS / f"dashboards-{width}.png"), full_page=True)
            wide, narrow = views[0]["panels"]["memory"]["panel"], views[0]["panels"]["series"]["panel"]
            assert narrow["y"] > wide["y"] + wide["h"] - 1  # at 900 px the memory and loss panels stack
            # Both views survive %vpipe stop: the dashboards keep their last frame and say the session ended.
            run_cells(page, "notebook:run-cell", below=len(DISPLAYS) - 1)
            wait_cells_done(page, 120)
            page.wait_for_function("""() => [...document.querySelectorAll('[data-role="dashboard"] [data-testid="live-state"]')]
                                          .every(e => e.textContent === 'stopped')""", timeout=60_000)
            page.wait_for_timeout(1000)
            views = live_views(page)
            assert len(views) == 3 and all(drawn(v) for v in views) and all("frozen" in v["header"] for v in views)
            status = page.locator('[data-testid="status"]').text_content() or ""
            assert "session ended" in status and page.locator('[data-testid="layer-7"]').is_visible()
            page.screenshot(path=str(ARTIFACTS / "dashboards-stopped.png"), full_page=True)
            assert "no running session" in ask(kc, "%vpipe status") or "stopped" in ask(kc, "print(session.status)")
        finally:
            kc.stop_channels()


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_interleaved_stages_draw_a_lane_per_chunk(lab: Lab, schedule: str) -> None:
    """Two chunks per stage draw two lanes per stage; under ZBV the editor colours the V: stage 0 holds the first
    and the last two layers, stage 1 the middle four."""
    cells = ["%load_ext vpipe_lab",
             f"%vpipe start gpt-tiny --stages 2 --microbatches 4 --schedule {schedule} --device cpu --run 40",
             "%vpipe dashboard", "%vpipe editor", "%vpipe stop"]  # all but the last run from the page
    name = f"chunks-{schedule}.ipynb"
    write_notebook(lab.root / name, cells)
    lanes = ["stage 0 · c0", "stage 0 · c1", "stage 1 · c0", "stage 1 · c1"]  # two chunks per stage by default
    with chromium(1400, 1000) as page:
        open_notebook(page, lab, name)
        run_cells(page, "notebook:run-all-above", below=len(cells) - 1)
        page.wait_for_function(f"""() => {{ const views = ({LIVE_REPORT_JS})().filter(v => v.role === 'dashboard');
            return views.length === 1 && views[0].panels.timeline.count >= 16
                   && views[0].panels.timeline.ticks.length === 4; }}""", timeout=180_000)
        page.locator('[data-testid="layer-7"]').wait_for(state="attached", timeout=60_000)
        page.wait_for_timeout(1000)
        view = live_views(page)[0]
        timeline = view["panels"]["timeline"]
        assert timeline["ticks"] == lanes and drawn(view) and clipped(view) == []
        assert timeline["tickLeft"] >= timeline["svg"]["x"]  # the lanes' names fit in the plot's margin
        stages = page.evaluate("[...Array(8).keys()].map(i => document.querySelector(`[data-testid=\"layer-${i}\"]`)"
                               ".dataset.stage)")
        assert stages == (list("00110011") if schedule == "interleaved-1f1b" else list("00111100"))
        page.screenshot(path=str(ARTIFACTS / f"{schedule}.png"), full_page=True)
    kc = kernel_client(lab, name)
    try:
        assert "no worker process is left" in ask(kc, "%vpipe stop")
    finally:
        kc.stop_channels()


def test_a_mixture_of_experts_model_shows_its_experts_load_as_a_heatmap_per_layer(lab: Lab) -> None:
    """moe-tiny (five MoE layers of 8 experts over two stages): the dashboard's fourth panel draws a heatmap with a
    row per MoE layer, named with its stage, inside the output area at two widths; the same numbers are in
    ``session.metrics.experts``."""
    cells = ["%load_ext vpipe_lab", "%vpipe start moe-tiny --stages 2 --microbatches 4 --device cpu --run 30",
             "%vpipe dashboard", "_ = session.wait(12, timeout=300)", "%vpipe stop"]
    write_notebook(lab.root / "experts.ipynb", cells)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    rows = [f"model.layers.{i}.mlp (stage {0 if i < 3 else 1})" for i in range(1, 6)]
    with chromium(1400, 1000) as page:
        open_notebook(page, lab, "experts.ipynb")
        run_cells(page, "notebook:run-all-above", below=len(cells) - 1)
        page.wait_for_function(f"""() => {{ const v = ({LIVE_REPORT_JS})().filter(v => v.role === 'dashboard')[0];
            return v && !v.panels.experts.hidden && v.panels.experts.count === 1
                   && v.panels.experts.ticks.length === 5 && v.panels.timeline.count >= 8; }}""", timeout=240_000)
        kc = kernel_client(lab, "experts.ipynb")
        try:
            for width in (1400, 900):
                page.set_viewport_size({"width": width, "height": 1000})
                page.wait_for_timeout(1500)
                view = live_views(page)[0]
                experts = view["panels"]["experts"]
                assert sorted(experts["ticks"]) == rows and experts["title"].startswith("experts' load"), experts
                assert drawn(view) and clipped(view) == [], f"at {width} px: {clipped(view)}"
                page.screenshot(path=str(ARTIFACTS / f"experts-{width}.png"), full_page=True)
            frame = ask(kc, "f = session.metrics.experts; print(sorted(set(f.layer)), f.groupby(['iteration', "
                            "'layer']).tokens.sum().unique().tolist())")
            layers, totals = frame.strip().splitlines()[-1].split("] [")
            assert layers.count("mlp") == 5 and totals.rstrip("]") == "4096"  # 32 x 64 tokens, top-2 each
        finally:
            kc.stop_channels()
    kc = kernel_client(lab, "experts.ipynb")
    try:
        assert "no worker process is left" in ask(kc, "%vpipe stop")
    finally:
        kc.stop_channels()


def test_drag_a_boundary_in_the_quickstart_and_apply_it(lab: Lab) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with chromium(1400, 1000) as page:
        open_notebook(page, lab, "01_quickstart.ipynb")
        cells = page.evaluate("window.jupyterapp.shell.currentWidget.content.widgets.length")
        run_cells(page, "notebook:run-all-above", below=cells - 1)  # everything but the final stop cell
        handle = page.locator('[data-testid="boundary-1"]')
        handle.wait_for(state="visible", timeout=240_000)
        page.locator('[data-testid="layer-7"]').wait_for(state="visible", timeout=60_000)
        page.wait_for_function("document.querySelector('[data-testid=\"summary\"]')?.textContent.length > 0",
                               timeout=120_000)
        handle.scroll_into_view_if_needed()
        start = handle.bounding_box()
        target = page.locator('[data-testid="layer-3"]').bounding_box()
        assert start and target
        # Drag the boundary between stage 0 and 1 from after layer 3 to before it: layer 3 moves to stage 1.
        page.mouse.move(start["x"] + start["width"] / 2, start["y"] + start["height"] / 2)
        page.mouse.down()
        for frac in (0.3, 0.6, 1.0):
            page.mouse.move(start["x"] + (target["x"] - start["x"]) * frac, start["y"] + start["height"] / 2,
                            steps=5)
        page.mouse.up()
        assert page.locator('[data-testid="layer-3"]').get_attribute("data-stage") == "1"
        # the draft's own what-if, not "measuring the new draft..." (the editor may re-measure its profile first)
        page.wait_for_function("/what-if: [\\d.]+ ms/.test(document.querySelector('[data-testid=\"summary\"]')"
                               ".textContent)", timeout=60_000)
        dropped = handle.bounding_box()
        # What the page shows for the draft as Apply is clicked (a re-calibration may have moved it since the drag):
        # read and clicked in one turn of the page's event loop, so no newer number can land in between.
        shown = page.evaluate("() => { const text = document.querySelector('[data-testid=\"summary\"]').textContent;"
                              " document.querySelector('[data-testid=\"apply\"]').click(); return text; }")
        what_if = re.search(r"what-if: ([\d.]+) ms per iteration", shown or "")
        assert what_if, shown
        status = page.locator('[data-testid="status"]')
        page.wait_for_function("document.querySelector('[data-testid=\"status\"]').textContent"
                               ".startsWith('plan v1 applied at iteration')", timeout=180_000)
        applied_at = int(status.text_content().split("applied at iteration")[1].split()[0])  # type: ignore[union-attr]
        page.wait_for_timeout(3000)  # the editor re-measures after Apply; its scale must hold steady
        settled = handle.bounding_box()
        # Steady, not frozen: one re-measure moves each block 35% of the way to its new share (steady_weights), and
        # with another test file running beside this one (pytest-xdist) a re-measure can be off by ~30%, so the
        # handle may drift ~10%; a scale that jumped to the new measurement would move it by far more.
        assert dropped and settled and abs(settled["x"] - dropped["x"]) <= 0.15 * dropped["x"], (dropped, settled)
        # Another schedule from the editor's list (the registry's): same chunks, so the partition stays.
        chooser = page.locator('[data-testid="schedule"]')
        assert "zbv" in chooser.locator("option").all_text_contents()
        chooser.select_option("gpipe")
        page.wait_for_function("!document.querySelector('[data-testid=\"apply\"]').disabled", timeout=60_000)
        page.locator('[data-testid="apply"]').click()
        page.wait_for_function("document.querySelector('[data-testid=\"status\"]').textContent"
                               ".startsWith('plan v2 applied at iteration')", timeout=180_000)
        switched_at = int(status.text_content().split("applied at iteration")[1].split()[0])  # type: ignore[union-attr]
        assert chooser.input_value() == "gpipe"
        # The quickstart's dashboard drew too.
        views = live_views(page)
        assert len(views) == 1 and drawn(views[0]) and clipped(views[0]) == []
        page.screenshot(path=str(ARTIFACTS / "quickstart.png"), full_page=True)
    # From the kernel: the workers themselves say which layers they own, and every iteration from the announced
    # one on ran with the new plan version.
    kc = kernel_client(lab, "01_quickstart.ipynb")
    try:
        result = ask(kc, f"""
import json
session.wait({switched_at} + 3, timeout=180)
owned = session.processes.layers()
frame = session.metrics.iterations
print(json.dumps({{"bounds": list(session.plan.boundaries), "owned": owned, "schedule": session.plan.schedule,
                   "sources": [a.source for a in session.applied], "record": session.record.rows()[1],
                   "before": sorted(set(frame[frame.iteration < {applied_at}].plan_version)),
                   "moved": sorted(set(frame[(frame.iteration >= {applied_at}) &
                                             (frame.iteration < {switched_at})].plan_version)),
                   "after": sorted(set(frame[frame.iteration >= {switched_at}].plan_version))}}))
""")
        doc = json.loads(result.strip().splitlines()[-1])
        assert doc["bounds"] == [0, 3, 8] and doc["schedule"] == "gpipe" and doc["sources"] == ["editor", "editor"]
        assert doc["owned"] == [[0, 1, 2], [3, 4, 5, 6, 7]]
        assert doc["before"] == [0] and doc["moved"] in ([1], []) and doc["after"] == [2]
        # The record compares the iterations the dragged plan ran with the what-if the page showed for it: the very
        # number (the page names it in its Apply message; computed again at Apply it once read 79.75 ms against the
        # 158.19 ms shown, where the running plan's calibration crossed its bounds in between, and the newest number
        # Python had sent once read 215.54 ms against the 218.88 ms the page still showed).
        record = doc["record"]
        assert record["source"] == "editor" and "[0:3]" in record["plan"]
        assert record["predicted_s"] * 1e3 == pytest.approx(float(what_if[1]), rel=1e-3, abs=0.01), (record, what_if[1])
        assert record["error"] == pytest.approx(record["median_s"] / record["predicted_s"] - 1)
        assert "no worker process is left" in ask(kc, "%vpipe stop")
    finally:
        kc.stop_channels()


def test_a_sharded_stage_s_sharding_is_clicked_in_the_editor_and_applied(lab: Lab) -> None:
    """The editor over a 2 x 2 sharded plan (no workers: its what-if and Apply only): each stage's chip shows its
    sharding; a click cycles stage 1's, the what-if prices the draft, and Apply hands the kernel that plan."""
    cells = ["from vpipe_lab import Plan\n"
             "from vpipe_lab.core.profile import Cluster\n"
             "from vpipe_lab.core.workloads import random_chain\n"
             "from vpipe_lab.jupyter.partition_widget import PartitionEditor\n"
             "applied = []\n"
             "ed = PartitionEditor(plan=Plan.from_counts([4, 4], 4).with_mesh(shards=2), profile=random_chain(8, seed=4),"
             " cluster=Cluster(2, 10**12, 1e9, 1e9), on_apply=lambda p: applied.append(p) or 3)\n"
             "ed"]
    write_notebook(lab.root / "sharding.ipynb", cells)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with chromium(1400, 900) as page:
        open_notebook(page, lab, "sharding.ipynb")
        run_cells(page)
        chip = page.locator('[data-testid="sharding-1"]')
        chip.wait_for(state="visible", timeout=120_000)
        assert chip.text_content() == "hold" and page.locator('[data-testid="sharding-0"]').text_content() == "hold"
        assert "stage 1's shards: gather the parameters once" in (chip.get_attribute("title") or "")
        chip.click()
        page.wait_for_function("document.querySelector('[data-testid=\"sharding-1\"]')?.textContent === 'regather'"
                               " && /what-if: [\\d.]+ m?s per iteration/.test(document.querySelector("
                               "'[data-testid=\"summary\"]').textContent)", timeout=60_000)
        assert "changed" in (chip.get_attribute("class") or "")
        page.locator('[data-testid="apply"]').click()
        page.wait_for_function("document.querySelector('[data-testid=\"status\"]').textContent === 'applied'",
                               timeout=60_000)
        box, cell = chip.bounding_box(), page.locator('[data-testid="sharding-1"]').locator("xpath=..").bounding_box()
        assert box and cell and box["x"] + box["width"] <= cell["x"] + cell["width"] + 1  # drawn inside its stage
        page.screenshot(path=str(ARTIFACTS / "sharding.png"), full_page=True)
    kc = kernel_client(lab, "sharding.ipynb")
    try:
        said = ask(kc, "print([p.describe() for p in applied], ed.sharding)")
        assert "'1f1b 2x2x1 hold/regather M=4" in said and "['hold', 'regather']" in said, said
    finally:
        kc.stop_channels()


def test_the_history_panel_reverts_and_compares(lab: Lab) -> None:
    """%vpipe history in a notebook: the table lists the plans that ran, choosing entry 0 and clicking Revert brings
    its plan back (a new "revert" row; the workers hold its layers), and the comparison draws both entries' last
    iterations, their splits and the record, inside the output area; the editor's what-if view draws beside it."""
    cells = ["%load_ext vpipe_lab",
             "%vpipe start mlp --stages 2 --microbatches 4 --device cpu --run forever",
             "_ = session.wait(session.iteration + 5, timeout=300)",
             "%vpipe partition 0 3 10",
             "_ = session.wait(session.iteration + 5, timeout=300)",
             "%vpipe history",
             "%vpipe editor"]
    name = "history.ipynb"
    write_notebook(lab.root / name, cells)
    with chromium(1400, 1000) as page:
        open_notebook(page, lab, name)
        run_cells(page)
        table = page.locator("table.vpipe-history")
        table.wait_for(state="visible", timeout=240_000)
        assert [c.strip() for c in table.locator("tbody tr td:nth-child(2)").all_text_contents()] == ["launch", "magic"]
        page.wait_for_function(f"""() => ({LIVE_REPORT_JS})().some(v => v.role === 'history'
            && v.panels.timeline.count >= 8 && v.panels.memory.count >= 4)""", timeout=120_000)
        page.locator(".widget-dropdown", has_text="entry").locator("select").select_option(index=0)
        page.locator("button", has_text="Revert").click()
        page.wait_for_function("""() => [...document.querySelectorAll('table.vpipe-history tbody tr td:nth-child(2)')]
            .map(td => td.textContent.trim()).join(',') === 'launch,magic,revert'""", timeout=180_000)
        status = page.locator(".widget-html", has_text="plan in force from iteration")
        assert "entry 0's plan in force from iteration" in (status.first.text_content() or "")
        page.wait_for_function(f"""() => ({LIVE_REPORT_JS})().some(v => v.role === 'what-if'
            && v.panels.timeline.count >= 8 && v.panels.memory.count >= 2)""", timeout=120_000)
        history = live_views(page, "history")[0]
        what_if = live_views(page, "what-if")[0]
        assert "entry 1 (magic)" in history["header"] and "draft:" in what_if["header"]
        assert clipped(history) == [] and clipped(what_if) == []
        assert history["panels"]["timeline"]["ticks"][0].startswith("entry ")
        assert what_if["panels"]["timeline"]["ticks"][0] == "measured · stage 0"
        page.screenshot(path=str(ARTIFACTS / "history.png"), full_page=True)
    kc = kernel_client(lab, name)
    try:
        owned = ask(kc, "print(session.processes.layers(), list(session.history['source']))")
        assert "[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] ['launch', 'magic', 'revert']" in owned
        assert "no worker process is left" in ask(kc, "%vpipe stop")
    finally:
        kc.stop_channels()


REPORT_JS = """() => [...document.querySelectorAll('.plotly-graph-div')].map(div => {
    const box = e => { if (!e) return null; const r = e.getBoundingClientRect();
                       return {x: r.x, y: r.y, w: r.width, h: r.height}; };
    const texts = sel => [...div.querySelectorAll(sel)].map(e => ({text: e.textContent, box: box(e)}));
    return {title: div.layout.title.text, div: box(div), plot: div._fullLayout._size.h,
            ticks: texts('.xtick text, .ytick text, .y2tick text'),
            titles: texts('.g-xtitle text, .g-ytitle text, .g-y2title text'),
            legend: box(div.querySelector('.legend')), yTitle: (div.querySelector('.g-ytitle text') || {}).textContent};
})"""


def _overlap(a: dict, b: dict | None) -> bool:  # type: ignore[type-arg]
    return b is not None and a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and (
        b["y"] < a["y"] + a["h"])


def test_the_run_report_reads_like_a_report(tmp_path: Path) -> None:
    """`vpipe-lab run --report` at 1400 px: what produced it and a summary above the plan's table; every chart tall
    enough to read (the loss chart was squashed to ~100 px), no tick label cut at the page's edge or written as
    '190.', no axis title over a legend, the memory of a CPU toy in MiB."""
    from vpipe_lab.cli import main

    report = tmp_path / "run.html"
    assert main(["run", "--model", "mlp", "--stages", "2", "--microbatches", "2", "--iterations", "6", "--device",
                 "cpu", "--report", str(report)]) == 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with chromium(1400, 1000) as page:
        page.goto(report.as_uri())
        page.wait_for_function("() => document.querySelectorAll('.plotly-graph-div .main-svg').length >= 6")
        intro = page.locator("pre").first.text_content() or ""
        charts = page.evaluate(REPORT_JS)
        page.screenshot(path=str(ARTIFACTS / "run-report.png"), full_page=True)
    for line in ("command:   vpipe-lab run --model mlp", "model:     mlp", "plan:      v0", "finished:", "loss:",
                 "iteration:  measured", "predicted", "bottleneck: stage", "time/mb"):
        assert line in intro, line
    titles = [c["title"] for c in charts]
    assert len(charts) == 3 and "loss and throughput" in titles[2] and "memory" in titles[1], titles
    memory = charts[1]
    assert memory["yTitle"] == "MiB"
    for chart in charts:
        assert chart["plot"] >= 180, (chart["title"], chart["plot"])  # the plotting area, not the page's margin
        page_box = chart["div"]
        for tick in chart["ticks"]:
            b = tick["box"]
            assert b["x"] >= page_box["x"] - 1 and b["x"] + b["w"] <= page_box["x"] + page_box["w"] + 1, (
                chart["title"], tick)
            assert not tick["text"].endswith("."), (chart["title"], tick["text"])
        for axis_title in chart["titles"]:
            assert not _overlap(axis_title["box"], chart["legend"]), (chart["title"], axis_title["text"])
