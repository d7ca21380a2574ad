"""What a user sees besides our own output: nothing. The quickstart run by nbconvert (a
frontend without our extension) leaves no third-party progress bar, warning or stderr in
its cells, and nothing of ours in nbconvert's log."""

import json
import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import wait_gone

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
JUPYTER = str(Path(sys.executable).parent / "jupyter")
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's "  0%|          | 0/2 [...]"


def test_the_quickstart_under_nbconvert_shows_only_what_it_printed(tmp_path):
    out = tmp_path / "quickstart.ipynb"
    # The kernel nbconvert starts leaves its session (jupyter_client starts it in a new one):
    # what this test started is found by a mark in the environment every process inherits.
    mark = f"quiet-{uuid.uuid4().hex}"
    proc = subprocess.Popen([JUPYTER, "nbconvert", "--to", "notebook", "--execute", "--output", str(out),
                             str(ROOT / "examples" / "quickstart.ipynb")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JUPYTER_SCALE_TEST_MARK=mark))
    seen: set[int] = set()  # what carried the mark while it ran: the check at the end has something to find
    stop = threading.Event()

    def watch():
        while not stop.wait(0.5):
            seen.update(p.pid for p in _marked(mark))
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _, log = proc.communicate(timeout=300)
    finally:
        stop.set()
        watcher.join(timeout=30)
        if proc.poll() is None:
            for p in _marked(mark):
                p.kill()  # what this test started, by pid
            proc.communicate(timeout=30)
    assert proc.returncode == 0, log
    # The kernel opens no comm of ours (nbconvert would log "No handler found for comm
    # target"); our cluster's connection is authenticated by CurveZMQ, not "insecure".
    assert "comm target" not in log and "Message signing is disabled" not in log, log
    cells = [c for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code"]
    outputs = [o for c in cells for o in c["outputs"]]
    assert any("steps/s" in "".join(o.get("text", "")) for o in outputs)  # our progress line is there
    assert [o for o in outputs if o.get("name") == "stderr"] == []
    assert not any(PROGRESS_BAR.search("".join(o.get("text", ""))) for o in outputs)
    assert {o["output_type"] for o in outputs} <= {"stream", "execute_result"}  # no widget a text frontend cannot show
    assert len(seen) >= 4  # nbconvert, its kernel, the controller, the workers
    assert wait_gone(_marked(mark)) == [], "the notebook's kernel left processes behind"


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("JUPYTER_SCALE_TEST_MARK") == mark:
                found.append(p)
        except (psutil.Error, OSError):
            pass  # gone, or not ours to read
    return found
