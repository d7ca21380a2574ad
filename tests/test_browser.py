"""The dashboard in a real JupyterLab, driven by headless Chromium (Playwright).

The screenshot is saved as tests/screenshots/dashboard.png (not committed).
"""

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import wait_gone
from jupyter_scale.widgets import PALETTE

pytestmark = pytest.mark.cluster

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).parent / "screenshots"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]

NOTEBOOK = {
    "cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "%load_ext jupyter_scale"},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "%%distribute --workers 2 --steps 60\nimport time\nfor i in range(60):\n"
                   "    report(loss=1.0 / (i + 1) + 0.1 * rank, lr=0.1 * 0.9 ** i)\n"
                   "    if i % 20 == 0:\n        print(f'step {i} on rank {rank}')\n    time.sleep(0.05)"},
    ],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "nbformat": 4, "nbformat_minor": 5,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    yield from _server(tmp_path, "jupyterlab", "LabApp")


@pytest.fixture
def notebook7(tmp_path):
    pytest.importorskip("notebook", minversion="7")
    yield from _server(tmp_path, "notebook", "JupyterNotebookApp")


def _server(tmp_path, module: str, app: str):
    """A Jupyter server of `module` (JupyterLab, or Notebook 7) on 127.0.0.1 serving tmp_path,
    whose dash.ipynb is NOTEBOOK; stopped afterwards with everything it started."""
    (tmp_path / "dash.ipynb").write_text(json.dumps(NOTEBOOK))
    port, token = free_port(), "jupyter-scale-test"
    server = subprocess.Popen(
        [sys.executable, "-m", module, "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         "--ServerApp.open_browser=False", "--allow-root",
         # A workspace and settings of its own: nothing restored from another test's session.
         f"--{app}.workspaces_dir={tmp_path / '.workspaces'}", f"--{app}.user_settings_dir={tmp_path / '.settings'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, f"{module} did not start"
            time.sleep(0.5)
    yield url, token, server
    started = psutil.Process(server.pid).children(recursive=True)
    server.terminate()  # the server shuts its kernels down; each kernel stops its cluster
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    still = wait_gone(started, timeout=30)
    for p in still:
        p.kill()
    assert not still, f"left behind: {still}"


@contextlib.contextmanager
def notebook_page(lab, name: str, width: int = 1200, path: str = "lab/tree"):
    """Headless Chromium showing notebook `name` of the `lab` server (at `path`: Notebook 7's
    is "notebooks"), cells on screen."""
    from playwright.sync_api import sync_playwright

    url, token, _ = lab
    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.goto(f"{url}/{path}/{name}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            yield page
        finally:
            browser.close()


def dismiss_news_prompt(page) -> None:
    """JupyterLab asks whether to fetch its news; answer no (it covers the screenshots)."""
    no = page.locator(".Toastify__toast button", has_text="No")
    try:
        no.first.click(timeout=2_000)
        page.locator(".Toastify__toast").first.wait_for(state="detached", timeout=5_000)
    except Exception:  # not asked this time
        pass


def run_all_cells(page, attempts: int = 4, idle: str = "(ipykernel) | Idle", shown: bool = True) -> None:
    """Run the notebook's two cells; retry while the kernel connection is still coming up
    (key presses before that move the cursor without executing anything). `idle`: the text the
    frontend has once its kernel is connected and idle (`shown`: on screen, not only for
    screen readers)."""
    for _ in range(attempts):
        page.get_by_text(idle).first.wait_for(state="visible" if shown else "attached", timeout=60_000)
        page.locator(".jp-Cell .jp-InputArea-editor").first.click()
        page.keyboard.press("Shift+Enter")
        page.keyboard.press("Shift+Enter")
        try:  # the first cell got an execution count: the run is under way
            page.locator(".jp-Cell").first.locator(".jp-InputPrompt", has_text="[1]").wait_for(timeout=15_000)
            return
        except Exception:
            page.keyboard.press("Escape")
    raise AssertionError("JupyterLab did not execute the cells")


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)")
def test_dashboard_shows_both_ranks_and_finishes(lab):
    with notebook_page(lab, "dash.ipynb") as page:
        run_all_cells(page)
        try:
            state = page.wait_for_selector(".jupyter-scale .js-state[data-state='finished']", timeout=90_000)
        except Exception:
            page.screenshot(path=str(SCREENSHOTS / "failure.png"))
            raise
        assert state.inner_text() == "finished"
        # The cluster's start is one line, updated: "starting ..." became "ready".
        said = [t for t in page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-OutputArea-output").all_inner_texts()
                if t.strip().startswith("jupyter_scale:")]
        assert len(said) == 1 and "2 workers ready" in said[0] and "starting" not in said[0], said
        chart = page.locator(".jupyter-scale .js-chart")
        assert chart.locator("polyline[data-series='rank 0']").count() == 1
        assert chart.locator("polyline[data-series='rank 1']").count() == 1
        assert [chart.locator(f"polyline[data-series='rank {r}']").get_attribute("stroke") for r in (0, 1)] \
            == PALETTE[:2]  # the palette the kernel sends
        rows = page.locator(".jupyter-scale .js-workers tr[data-rank]")
        assert rows.count() == 2
        assert all("finished" in rows.nth(i).inner_text() for i in range(2))
        assert all(" MB" in rows.nth(i).inner_text() for i in range(2))  # memory column
        # Axes with their labels and ticks, and a legend that says which line is which.
        dashboard = page.locator(".jupyter-scale").first
        assert chart.locator(".js-xlabel").text_content() == "step"
        assert chart.locator(".js-ylabel").text_content() == "loss"
        x_ticks = [int(t) for t in chart.locator(".js-xtick").all_text_contents()]
        assert len(x_ticks) >= 3 and x_ticks == sorted(x_ticks) and 0 <= x_ticks[0] and x_ticks[-1] <= 59
        assert len(chart.locator(".js-ytick").all_text_contents()) >= 3
        keys = dashboard.locator(".js-legend .js-key")
        assert keys.all_text_contents() == ["rank 0", "rank 1", "mean of the ranks"]
        swatches = [keys.nth(i).locator("i").evaluate("e => getComputedStyle(e).borderTopColor") for i in range(2)]
        assert swatches == [_rgb(c) for c in PALETTE[:2]]
        page.locator(".jupyter-scale").first.screenshot(path=str(SCREENSHOTS / "dashboard.png"))
        # Every reported scalar can be charted, on a log scale, smoothed; hovering reads the values out.
        dashboard.locator(".js-metric").select_option("lr")
        assert chart.locator(".js-ylabel").text_content() == "lr"
        dashboard.locator(".js-log").check()
        assert chart.locator(".js-ylabel").text_content() == "lr (log)"
        logs = [float(t) for t in chart.locator(".js-ytick").all_text_contents()]
        assert len(logs) >= 2 and all(f"{v:e}"[0] in "125" for v in logs)  # 1, 2, 5 times powers of ten
        dashboard.locator(".js-smooth").check()
        assert chart.locator("polyline[data-raw]").count() == 3  # the raw curves stay, faint
        box = chart.bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.5)
        readout = dashboard.locator(".js-readout").inner_text()
        assert readout.startswith("step ") and "rank 0" in readout and "rank 1" in readout and "mean" in readout
        dashboard.screenshot(path=str(SCREENSHOTS / "dashboard-lr-log-smoothed.png"))
        # The ranks' output, by rank.
        dashboard.locator(".js-output-box summary").click()
        lines = dashboard.locator(".js-output .js-line")
        assert lines.count() == 6 and dashboard.locator(".js-output-count").inner_text() == "6 lines"
        dashboard.locator(".js-output-rank").select_option("1")
        assert lines.all_inner_texts() == [f"[rank 1] step {i} on rank 1" for i in (0, 20, 40)]
        dashboard.screenshot(path=str(SCREENSHOTS / "dashboard-output-rank-1.png"))


def _rgb(hex_color: str) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


LONG_JOB = ("%%distribute\nimport time\nfor i in range(3000):\n"
            "    report(loss=1.0 / (i + 1) + 0.1 * rank)\n    time.sleep(0.05)")


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)")
def test_sidebar_follows_the_job_interrupts_reattaches_after_reload_and_stops_the_cluster(lab, tmp_path):
    server = lab[2]
    notebook = json.loads(json.dumps(NOTEBOOK))
    notebook["cells"].append({"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                              "source": LONG_JOB})
    (tmp_path / "sidebar.ipynb").write_text(json.dumps(notebook))
    with notebook_page(lab, "sidebar.ipynb", width=1400) as page:
        page.locator(".jp-SideBar [data-id='jupyter-scale-sidebar']").click()
        sidebar = page.locator("#jupyter-scale-sidebar")
        sidebar.locator("[data-link='not-loaded']").wait_for(timeout=60_000)  # before %load_ext
        run_all_cells(page)
        try:
            sidebar.locator(".jp-ScalePanel-jobState[data-state='finished']").wait_for(timeout=90_000)
        except Exception:
            page.screenshot(path=str(SCREENSHOTS / "sidebar-failure.png"))
            raise
        rows = sidebar.locator("tr[data-rank]")
        assert rows.count() == 2
        assert "#1 finished · 100%" in sidebar.locator(".jp-ScalePanel-jobState").inner_text()
        assert sidebar.locator(".jp-ScalePanel-chart polyline").count() == 3  # rank 0, rank 1, mean
        assert [sidebar.locator(f".jp-ScalePanel-chart polyline[data-series='rank {r}']").get_attribute("stroke")
                for r in (0, 1)] == PALETTE[:2]
        assert "ipyparallel · 2 workers" in sidebar.locator(".jp-ScalePanel-summary").inner_text()
        assert page.locator(".jp-ScaleStatus").inner_text().startswith("Scale: 2 workers")
        # The sidebar and the cell's dashboard show the same worker processes.
        listed = [sidebar.locator("tr[data-rank]").nth(i).locator("td[data-column='pid']").inner_text()
                  for i in range(2)]
        dashboard = page.locator(".jupyter-scale .js-workers tr[data-rank]")
        assert [dashboard.nth(i).locator("td").nth(2).inner_text() for i in range(2)] == listed
        dismiss_news_prompt(page)
        page.screenshot(path=str(SCREENSHOTS / "sidebar.png"))
        sidebar.screenshot(path=str(SCREENSHOTS / "sidebar-panel.png"))

        # The third cell runs a long job; the sidebar's Interrupt stops it on every rank.
        page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        sidebar.locator(".jp-ScalePanel-jobState[data-state='running']").wait_for(timeout=60_000)
        sidebar.locator("tr[data-rank][data-state='running']").nth(1).wait_for(timeout=30_000)
        sidebar.locator("button[data-action='interrupt']").click()
        sidebar.locator(".jp-ScalePanel-jobState[data-state='interrupted']").wait_for(timeout=60_000)
        assert "#2 interrupted" in sidebar.locator(".jp-ScalePanel-jobState").inner_text()
        assert [sidebar.locator("tr[data-rank]").nth(i).get_attribute("data-state") for i in range(2)] == \
            ["idle", "idle"]  # stopped, and ready for the next cell
        page.locator(".jp-Cell .jp-OutputArea-output", has_text="KeyboardInterrupt").first.wait_for(timeout=30_000)

        # A page reload attaches again to the running kernel and its cluster.
        page.reload()
        sidebar = page.locator("#jupyter-scale-sidebar")
        if not sidebar.is_visible():
            page.locator(".jp-SideBar [data-id='jupyter-scale-sidebar']").click()
        sidebar.locator("tr[data-rank]").nth(1).wait_for(timeout=60_000)
        pids = [int(sidebar.locator("tr[data-rank]").nth(i).locator("td[data-column='pid']").inner_text())
                for i in range(2)]
        kernel = next(c for c in psutil.Process(server.pid).children() if "ipykernel" in " ".join(c.cmdline()))
        workers = [psutil.Process(pid) for pid in pids]
        assert set(pids) <= {c.pid for c in kernel.children(recursive=True)}

        sidebar.locator("button[data-action='stop']").click()
        sidebar.locator(".jp-ScalePanel-cluster[data-running='false']").wait_for(timeout=60_000)
        assert wait_gone(workers, timeout=30) == []  # kernel side: the workers are gone
        assert sidebar.locator("tr[data-rank]").count() == 0


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)")
def test_notebook7_shows_the_dashboard_and_the_sidebar(notebook7):
    with notebook_page(notebook7, "dash.ipynb", width=1400, path="notebooks") as page:
        # The sidebar, opened before %load_ext as a user may: View > Right Sidebar.
        page.locator(".lm-MenuBar-itemLabel", has_text="View").click()
        page.locator(".lm-Menu-itemLabel", has_text="Right Sidebar").hover()
        page.locator(".lm-Menu-itemLabel", has_text="Show Scale").click()
        sidebar = page.locator("#jupyter-scale-sidebar")
        sidebar.locator("[data-link='not-loaded']").wait_for(timeout=60_000)
        run_all_cells(page, idle="Kernel status: Idle", shown=False)
        dashboard = page.locator(".jupyter-scale").first
        try:
            dashboard.locator(".js-state[data-state='finished']").wait_for(timeout=90_000)
            sidebar.locator(".jp-ScalePanel-jobState[data-state='finished']").wait_for(timeout=30_000)
        except Exception:
            page.screenshot(path=str(SCREENSHOTS / "notebook7-failure.png"))
            raise
        chart = dashboard.locator(".js-chart")
        assert chart.locator(".js-xlabel").text_content() == "step"
        assert chart.locator(".js-ylabel").text_content() == "loss"
        assert dashboard.locator(".js-legend .js-key").all_text_contents() == ["rank 0", "rank 1", "mean of the ranks"]
        dashboard.locator(".js-metric").select_option("lr")
        dashboard.locator(".js-log").check()
        assert chart.locator(".js-ylabel").text_content() == "lr (log)"
        assert sidebar.locator("tr[data-rank]").count() == 2
        assert sidebar.locator(".jp-ScalePanel-chart polyline").count() == 3  # rank 0, rank 1, mean
        assert sidebar.locator(".jp-ScalePanel-ylabel").text_content() == "loss"
        assert sidebar.locator(".jp-ScalePanel-key").all_text_contents() == ["rank 0", "rank 1", "mean"]
        sidebar.locator(".jp-ScalePanel-metric").select_option("lr")
        sidebar.locator(".jp-ScalePanel-log").check()
        assert sidebar.locator(".jp-ScalePanel-ylabel").text_content() == "lr (log)"
        assert len(sidebar.locator(".jp-ScalePanel-ytick").all_text_contents()) >= 2
        sidebar.locator(".jp-ScalePanel-smooth").check()
        assert sidebar.locator(".jp-ScalePanel-chart polyline[data-raw]").count() == 3
        box = sidebar.locator(".jp-ScalePanel-chart").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.4)
        readout = sidebar.locator(".jp-ScalePanel-readout").inner_text()
        assert readout.startswith("step ") and "rank 1" in readout and "mean" in readout
        page.screenshot(path=str(SCREENSHOTS / "notebook7.png"))
