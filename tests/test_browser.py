"""The dashboard in a real JupyterLab, driven by headless Chromium (Playwright).

The screenshot is saved as tests/screenshots/dashboard.png (not committed).
"""

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
                   "    report(loss=1.0 / (i + 1) + 0.1 * rank)\n    time.sleep(0.05)"},
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
    (tmp_path / "dash.ipynb").write_text(json.dumps(NOTEBOOK))
    port, token = free_port(), "jupyter-scale-test"
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         "--ServerApp.open_browser=False", "--allow-root"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "jupyter lab did not start"
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


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)")
def test_dashboard_shows_both_ranks_and_finishes(lab):
    from playwright.sync_api import sync_playwright

    url, token, _ = lab
    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(f"{url}/lab/tree/dash.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            page.click(".jp-Cell .jp-InputArea-editor")
            for _ in range(2):
                page.keyboard.press("Shift+Enter")
            try:
                state = page.wait_for_selector(".jupyter-scale .js-state[data-state='finished']", timeout=90_000)
            except Exception:
                page.screenshot(path=str(SCREENSHOTS / "failure.png"))
                raise
            assert state.inner_text() == "finished"
            chart = page.locator(".jupyter-scale .js-chart")
            assert chart.locator("polyline[data-series='rank 0']").count() == 1
            assert chart.locator("polyline[data-series='rank 1']").count() == 1
            rows = page.locator(".jupyter-scale .js-workers tr[data-rank]")
            assert rows.count() == 2
            assert all("finished" in rows.nth(i).inner_text() for i in range(2))
            assert all(" MB" in rows.nth(i).inner_text() for i in range(2))  # memory column
            page.locator(".jupyter-scale").first.screenshot(path=str(SCREENSHOTS / "dashboard.png"))
        finally:
            browser.close()
