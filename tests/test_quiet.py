"""What a user sees besides our own output: nothing. The quickstart run by nbconvert (a
frontend without our extension) leaves no third-party progress bar, warning or stderr in
its cells, and nothing of ours in nbconvert's log."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from conftest import wait_gone

ROOT = Path(__file__).resolve().parent.parent
JUPYTER = str(Path(sys.executable).parent / "jupyter")
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's "  0%|          | 0/2 [...]"


def test_the_quickstart_under_nbconvert_shows_only_what_it_printed(tmp_path):
    out = tmp_path / "quickstart.ipynb"
    proc = subprocess.Popen([JUPYTER, "nbconvert", "--to", "notebook", "--execute", "--output", str(out),
                             str(ROOT / "examples" / "quickstart.ipynb")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, log = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session we started, by its pid
            proc.communicate()
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
    leftovers = [p for p in psutil.process_iter() if _in_session(p, proc.pid)]
    assert wait_gone(leftovers) == [], "the notebook's kernel left processes behind"


def _in_session(p: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid
    except (ProcessLookupError, PermissionError):
        return False
