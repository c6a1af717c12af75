"""Real browser, real JupyterLab: run the quickstart, drag a partition boundary with the mouse, click Apply, and check
from the kernel side that the engine runs the new partition from the next iteration. Keeps a screenshot in
artifacts/browser/."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "artifacts" / "browser"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", tmp_path / "01_quickstart.ipynb")
    port = _port()
    runtime = tmp_path / "runtime"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime), "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--ServerApp.port={port}",
         "--ServerApp.ip=127.0.0.1", "--ServerApp.token=", "--ServerApp.password=",
         "--ServerApp.disable_check_xsrf=True", "--LabApp.expose_app_in_browser=True",
         f"--ServerApp.root_dir={tmp_path}", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
         "jupyterlab.NeverCheckForUpdate"],
        stdout=open(tmp_path / "lab.log", "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield url, runtime
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)


def kernel_client(url: str, runtime: Path):  # type: ignore[no-untyped-def]
    import jupyter_client

    sessions = json.load(urllib.request.urlopen(f"{url}/api/sessions", timeout=10))
    kernel_id = sessions[0]["kernel"]["id"]
    kc = jupyter_client.BlockingKernelClient(connection_file=str(runtime / f"kernel-{kernel_id}.json"))
    kc.load_connection_file()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return kc


def ask(kc, code: str) -> str:  # type: ignore[no-untyped-def]
    out: list[str] = []

    def hook(msg):  # type: ignore[no-untyped-def]
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("ERROR " + "\n".join(msg["content"]["traceback"]))

    kc.execute_interactive(code, timeout=180, output_hook=hook)
    return "".join(out)


def test_drag_a_boundary_in_the_quickstart_and_apply_it(lab: tuple[str, Path]) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium), as .ci/run does")
    from playwright.sync_api import sync_playwright

    url, runtime = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{url}/lab/workspaces/t{uuid.uuid4().hex[:8]}/tree/01_quickstart.ipynb?reset", timeout=120_000)
            page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget && "
                                   "window.jupyterapp.shell.currentWidget.sessionContext", timeout=120_000)
            # A first start may ask for a kernel: take the notebook's own.
            select = page.locator(".jp-Dialog button.jp-mod-accept")
            if select.count() and select.first.is_visible():
                select.first.click()
            page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel",
                                   timeout=120_000)
            news = page.locator(".jp-Notification-Toast button", has_text="No")  # the "Jupyter news?" toast
            if news.count() and news.first.is_visible():
                news.first.click()
            # Run everything but the final stop cell.
            page.evaluate("""async () => {
                const panel = window.jupyterapp.shell.currentWidget;
                panel.content.activeCellIndex = panel.content.widgets.length - 1;
                await window.jupyterapp.commands.execute('notebook:run-all-above');
            }""")
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
            page.wait_for_function("document.querySelector('[data-testid=\"summary\"]').textContent"
                                   ".includes('what-if')", timeout=60_000)
            page.locator('[data-testid="apply"]').click()
            status = page.locator('[data-testid="status"]')
            page.wait_for_function("document.querySelector('[data-testid=\"status\"]').textContent"
                                   ".startsWith('applied at iteration')", timeout=180_000)
            applied_at = int(status.text_content().split("applied at iteration")[1].split()[0])  # type: ignore[union-attr]
            page.screenshot(path=str(ARTIFACTS / "quickstart.png"), full_page=True)
        finally:
            browser.close()
    # From the kernel: the workers themselves say which layers they own, and every iteration from the announced
    # one on ran with the new plan version.
    kc = kernel_client(url, runtime)
    try:
        result = ask(kc, f"""
import json
session.wait({applied_at} + 3, timeout=180)
owned = session.layers_by_stage()
frame = session.metrics.iterations
print(json.dumps({{"bounds": list(session.plan.boundaries), "owned": owned,
                   "before": sorted(set(frame[frame.iteration < {applied_at}].plan_version)),
                   "after": sorted(set(frame[frame.iteration >= {applied_at}].plan_version))}}))
""")
        doc = json.loads(result.strip().splitlines()[-1])
        assert doc["bounds"] == [0, 3, 8]
        assert doc["owned"] == [[0, 1, 2], [3, 4, 5, 6, 7]]
        assert doc["before"] == [0] and doc["after"] == [1]
        assert "no worker process is left" in ask(kc, "%vpipe stop")
    finally:
        kc.stop_channels()
