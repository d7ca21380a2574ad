"""The wheel carries the prebuilt JupyterLab extension: installed where there is no node,
JupyterLab lists it enabled and OK, and JupyterLab's own browser check passes with it."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def run(cmd, **kwargs) -> str:
    """Run a command to completion (15 min at most); its output, stdout and stderr together."""
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-5000:]}"
    return done.stdout


def playwright_browsers(package_dir: Path, where: Path) -> Path:
    """A Playwright browsers folder whose Chromium is Debian's /usr/bin/chromium.

    Playwright downloads its own browsers, which cannot work on this project's machines
    (no network but the package registries). It takes a browser as installed when its
    folder holds the executable and an INSTALLATION_COMPLETE marker; the executables here
    start Debian's chromium headless. ffmpeg (video recording, unused) is a stub that fails.
    """
    browsers = json.loads((package_dir / "node_modules" / "playwright-core" / "browsers.json").read_text())
    revision = {b["name"]: b["revision"] for b in browsers["browsers"]}
    chromium = ("#!/bin/sh\nexec /usr/bin/chromium --headless --disable-gpu --disable-background-networking "
                "--disable-component-update --disable-sync --no-first-run \"$@\"\n")
    entries = {
        f"chromium-{revision['chromium']}/chrome-linux64/chrome": chromium,
        f"chromium_headless_shell-{revision['chromium-headless-shell']}/chrome-headless-shell-linux64/"
        "chrome-headless-shell": chromium,
        f"ffmpeg-{revision['ffmpeg']}/ffmpeg-linux": "#!/bin/sh\necho 'no ffmpeg here' >&2\nexit 1\n",
    }
    for relative, script in entries.items():
        path = where / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script)
        path.chmod(0o755)
        (where / relative.split("/")[0] / "INSTALLATION_COMPLETE").touch()
    return where


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)")
def test_the_wheel_installs_without_node_and_jupyterlab_loads_the_extension(tmp_path):
    # Build the wheel (isolated build: hatch-jupyter-builder builds the extension with npm
    # when the prebuilt one is missing or older than labextension/src).
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)])
    wheel = next((tmp_path / "dist").glob("jupyter_scale-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    prefix = "jupyter_scale-" + wheel.name.split("-")[1] + ".data/data/share/jupyter/labextensions/jupyter-scale/"
    assert prefix + "package.json" in names and prefix + "install.json" in names
    assert any(n.startswith(prefix + "static/remoteEntry.") for n in names)

    # A fresh environment whose PATH has no node or npm: installing needs neither.
    venv = tmp_path / "fresh"
    run([sys.executable, "-m", "venv", str(venv)])
    bin_dir = venv / "bin"
    no_node = {**os.environ, "PATH": str(bin_dir)}
    no_node.pop("PYTHONPATH", None)
    assert shutil.which("node", path=no_node["PATH"]) is None and shutil.which("npm", path=no_node["PATH"]) is None
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet"]
    run([*pip, "torch==2.13.0"], env=no_node)  # first and pinned: the CPU build on disk
    run([*pip, str(wheel), "jupyterlab"], env=no_node)
    listed = run([str(bin_dir / "jupyter"), "labextension", "list"], env=no_node)
    line = next(listed_line for listed_line in listed.splitlines() if "jupyter-scale" in listed_line)
    assert "v" + json.loads((ROOT / "labextension" / "package.json").read_text())["version"] in line
    assert "enabled" in line and "OK" in line, line
    assert "(python, jupyter_scale)" in line

    # JupyterLab's own browser check (node + Playwright, with Debian's chromium) loads the
    # page with the extension and fails on any error it logs. It installs Playwright into
    # <app dir>/browser_test unless that has node_modules: prepare it the same way.
    check_dir = venv / "share" / "jupyter" / "lab" / "browser_test"
    check_dir.mkdir(parents=True)
    run(["npm", "init", "-y"], cwd=check_dir)
    run(["npm", "install", "--no-audit", "--no-fund", "playwright@^1.9.2"], cwd=check_dir)
    browsers = playwright_browsers(check_dir, tmp_path / "browsers")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PLAYWRIGHT_BROWSERS_PATH": str(browsers),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    env.pop("PYTHONPATH", None)
    out = run([str(bin_dir / "python"), "-m", "jupyterlab.browser_check", "--allow-root"], env=env,
              cwd=tmp_path)
    assert "Browser test complete" in out and "Exiting normally" in out
