"""A real JupyterLab and a real Chromium for browser tests and benchmarks: start the server on a notebook, open it,
run cells, and read back what the page drew (not what Python holds)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_notebook(path: Path, cells: Sequence[str]) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@dataclass
class Lab:
    url: str
    root: Path
    runtime: Path


@contextlib.contextmanager
def jupyterlab(root: Path, timeout: float = 90) -> Iterator[Lab]:
    """A JupyterLab server on ``root`` (no token, loopback), stopped with everything it started on exit."""
    port = free_port()
    runtime = root / ".runtime"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime), "JUPYTER_CONFIG_DIR": str(root / ".config")}
    log = open(root / ".lab.log", "wb")  # closed below, after the server
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--ServerApp.port={port}",
         "--ServerApp.ip=127.0.0.1", "--ServerApp.token=", "--ServerApp.password=",
         "--ServerApp.disable_check_xsrf=True", "--LabApp.expose_app_in_browser=True",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("JupyterLab did not start:\n" + (root / ".lab.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield Lab(url, root, runtime)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A page in headless Chromium (Debian's: Playwright cannot download browsers here)."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium), as .ci/run "
                           "does")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """Busy processes competing for the CPU (another job on the machine)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def open_notebook(page: Any, lab: Lab, name: str) -> None:
    """Open ``name`` in a fresh workspace and wait for its kernel; accept the kernel dialog, decline the news toast."""
    page.goto(f"{lab.url}/lab/workspaces/t{uuid.uuid4().hex[:8]}/tree/{name}?reset", timeout=120_000)
    page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget && "
                           "window.jupyterapp.shell.currentWidget.sessionContext", timeout=120_000)
    select = page.locator(".jp-Dialog button.jp-mod-accept")
    if select.count() and select.first.is_visible():
        select.first.click()
    page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel", timeout=120_000)
    dismiss_news(page)


def dismiss_news(page: Any) -> None:
    news = page.locator(".jp-Notification-Toast button", has_text="No")  # the "Jupyter news?" toast
    if news.count() and news.first.is_visible():
        news.first.click()


def run_cells(page: Any, command: str = "notebook:run-all-cells", below: int | None = None) -> None:
    """Run the notebook's cells (all, or from cell ``below`` on) from the page, as a user's Run All does."""
    page.evaluate("""async ([command, below]) => {
        const panel = window.jupyterapp.shell.currentWidget;
        if (below !== null) panel.content.activeCellIndex = below;
        await window.jupyterapp.commands.execute(command);
    }""", [command, below])


def wait_cells_done(page: Any, timeout: float) -> None:
    """Until every code cell ran and none is running or queued."""
    page.wait_for_function("""() => window.jupyterapp.shell.currentWidget.content.widgets.every(c =>
        c.model.type !== 'code' || (c.model.executionCount !== null && c.model.executionState !== 'running'
                                    && !c.node.querySelector('.jp-InputArea-prompt')?.textContent.includes('*')))""",
                           timeout=timeout * 1000, polling=500)


def cell_finished(page: Any, index: int) -> bool:
    """Cell ``index`` ran and is neither running nor queued."""
    return bool(page.evaluate("""(i) => { const c = window.jupyterapp.shell.currentWidget.content.widgets[i];
        const prompt = c.node.querySelector('.jp-InputArea-prompt')?.textContent || '';
        return c.model.executionCount !== null && !prompt.includes('*'); }""", index))


# What every live view on the page drew, read from the DOM plotly built: line segments in the timeline, bars with a
# height in the memory chart, points of the loss line, the experts' heatmap (hidden for a dense model); and whether
# each panel, its plot and its legend lie inside the output area that holds them.
LIVE_REPORT_JS = """() => [...document.querySelectorAll('[data-testid="live"]')].map(root => {
  const rect = (el) => { const r = el.getBoundingClientRect(); return {x: r.left, y: r.top, w: r.width, h: r.height}; };
  const area = root.closest('.jp-OutputArea-output') || root.parentElement;
  const out = {frame: Number(root.dataset.frame || 0), draws: Number(root.dataset.draws || 0), role: root.dataset.role,
               header: root.querySelector('[data-testid="live-header"]')?.textContent || '',
               area: rect(area), panels: {}};
  for (const name of ['timeline', 'memory', 'series', 'experts']) {
    const panel = root.querySelector(`[data-testid="live-${name}"]`);
    const hidden = !panel || panel.classList.contains('empty') || panel.getBoundingClientRect().height === 0;
    const svg = panel?.querySelector('svg.main-svg');
    const legend = panel?.querySelector('g.legend');
    const title = panel?.querySelector('.gtitle')?.textContent || '';
    let count = 0;
    if (name === 'timeline') {
      for (const p of panel?.querySelectorAll('.scatterlayer .trace path.js-line') || [])
        count += ((p.getAttribute('d') || '').match(/M/g) || []).length;
    } else if (name === 'memory') {
      for (const p of panel?.querySelectorAll('.barlayer .point path') || [])
        if (p.getBoundingClientRect().height > 0.5) count += 1;
    } else if (name === 'experts') {  // the heatmap's image, and a row label per layer
      count = panel?.querySelectorAll('.heatmaplayer image').length || 0;
    } else {
      const loss = panel?.querySelector('.scatterlayer .trace path.js-line');
      count = ((loss?.getAttribute('d') || '').match(/[ML]/g) || []).length;
    }
    out.panels[name] = {count, title, hidden, drawn: panel?.dataset.drawn === '1',
                        panel: panel ? rect(panel) : null, svg: svg ? rect(svg) : null,
                        legend: legend ? rect(legend) : null,
                        legendItems: panel ? panel.querySelectorAll('g.legend g.traces').length : 0,
                        ticks: [...(panel?.querySelectorAll('g.ytick text') || [])].map(t => t.textContent),
                        tickLeft: Math.min(...[...(panel?.querySelectorAll('g.ytick text') || [])]
                                                 .map(t => t.getBoundingClientRect().left))};
  }
  return out;
})"""


def live_views(page: Any, role: str | None = "dashboard") -> list[dict[str, Any]]:
    """What each live view on the page drew: the dashboards (``role``: "what-if" the editors' views, "history" the
    history panels' comparisons, None all of them)."""
    return [v for v in page.evaluate(LIVE_REPORT_JS) if role is None or v["role"] == role]


def inside(inner: dict[str, float] | None, outer: dict[str, float] | None, slack: float = 1.0) -> bool:
    """``inner`` lies within ``outer`` (both {x, y, w, h}), up to ``slack`` pixels."""
    if inner is None or outer is None:
        return False
    return (inner["x"] >= outer["x"] - slack and inner["y"] >= outer["y"] - slack
            and inner["x"] + inner["w"] <= outer["x"] + outer["w"] + slack
            and inner["y"] + inner["h"] <= outer["y"] + outer["h"] + slack)


def clipped(view: dict[str, Any]) -> list[str]:
    """What of a live view lies outside where it should: panels outside the output area, plots wider than their
    panel, legends outside their plot, lane labels that start left of their plot (cut off at its edge)."""
    problems = []
    for name, p in view["panels"].items():
        if p.get("hidden"):  # an optional panel with nothing to show (the experts' load of a dense model)
            continue
        if p["ticks"] and p["svg"] is not None and p["tickLeft"] < p["svg"]["x"] - 1:
            problems.append(f"{name} labels start at x={p['tickLeft']:.0f}, left of their plot at {p['svg']['x']:.0f}")
        if not inside(p["panel"], view["area"]):
            problems.append(f"{name} panel {p['panel']} outside the output area {view['area']}")
        if not inside(p["svg"], p["panel"]):
            problems.append(f"{name} plot {p['svg']} outside its panel {p['panel']}")
        if p["legendItems"] and not inside(p["legend"], p["svg"]):
            problems.append(f"{name} legend {p['legend']} outside its plot {p['svg']}")
    return problems


def kernel_client(lab: Lab, notebook: str | None = None) -> Any:
    """A client of the running kernel of ``notebook`` (the only one when not given), to ask it what Python holds."""
    import jupyter_client

    sessions = json.load(urllib.request.urlopen(f"{lab.url}/api/sessions", timeout=10))
    ours = [s for s in sessions if notebook is None or s.get("path") == notebook]
    kernel_id = ours[0]["kernel"]["id"]
    kc = jupyter_client.BlockingKernelClient(connection_file=str(lab.runtime / f"kernel-{kernel_id}.json"))
    kc.load_connection_file()
    kc.start_channels()
    # Not wait_for_ready(): it then drains IOPub until 0.2 s of silence, and a live dashboard is never that quiet.
    kc.kernel_info(reply=True, timeout=60)
    return kc


def ask(kc: Any, code: str, timeout: float = 180) -> str:
    """Run ``code`` in the kernel; its printed output (and any error's traceback)."""
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("ERROR " + "\n".join(msg["content"]["traceback"]))

    kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return "".join(out)


# Append a cell, run it, and time from the page itself: when the cell finished (its run command resolved) and when
# its output first drew completely ("live": a live view with all three panels drawn; "figures": three plotly plots).
RUN_AND_TIME_JS = """async ([code, kind, limit_ms]) => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  nb.activeCellIndex = nb.widgets.length - 1;
  await window.jupyterapp.commands.execute('notebook:insert-cell-below');
  const cell = nb.activeCell;
  cell.model.sharedModel.setSource(code);
  let drawn = null;
  const check = () => {
    if (drawn !== null) return;
    const out = cell.node.querySelector('.jp-OutputArea');
    if (!out) return;
    if (kind === 'live') {
      const root = out.querySelector('[data-testid="live"]');
      if (root && root.querySelectorAll('[data-drawn="1"]').length === 3) drawn = performance.now();
    } else if (kind === 'editor') {  // the partition editor's blocks are on screen
      const block = out.querySelector('[data-testid="layer-0"]');
      if (block && block.getBoundingClientRect().width > 0) drawn = performance.now();
    } else if (out.querySelectorAll('.js-plotly-plot .main-svg').length >= 3
               && out.querySelectorAll('.js-plotly-plot .gtitle').length >= 3) {
      drawn = performance.now();
    }
  };
  const observer = new MutationObserver(check);
  observer.observe(cell.node, {subtree: true, childList: true, attributes: true});
  const start = performance.now();
  await window.jupyterapp.commands.execute('notebook:run-cell');
  const finished = performance.now();
  while (drawn === null && performance.now() < finished + limit_ms) {
    check();
    await new Promise(r => setTimeout(r, 10));
  }
  observer.disconnect();
  return {index: nb.widgets.indexOf(cell), run_s: (finished - start) / 1000,
          first_draw_s: drawn === null ? null : (drawn - finished) / 1000};
}"""


def run_and_time(page: Any, code: str, kind: str, limit_s: float = 120) -> dict[str, Any]:
    """Run ``code`` in a new cell; how long the cell ran, and how long after it finished its output first drew."""
    return dict(page.evaluate(RUN_AND_TIME_JS, [code, kind, limit_s * 1000]))


class WireBytes:
    """Bytes the page receives over its websockets (the kernel's channels), counted as they arrive."""

    def __init__(self, page: Any) -> None:
        self.total = 0
        page.on("websocket", lambda ws: ws.on("framereceived", self._add))

    def _add(self, payload: Any) -> None:
        self.total += len(payload.encode() if isinstance(payload, str) else payload)
