"""ipyparallel's controller with two changes.

Its heart monitor registers an engine as soon as the engine's heart answers a ping, not at the
ping after (HEARTBEAT_MS later): a new engine is there in ~HEARTBEAT_MS / 2, not up to
2 * HEARTBEAT_MS. (It runs in a process the controller forks, which inherits the change.)

Its connection files are written whole or not at all: local engines start with it and read
them as soon as they exist (IPEngine.wait_for_url_file).

It ends with the kernel through the kernel's watcher (jupyter_scale.processes): engines of a
Slurm job on other nodes cannot watch the kernel, but they shut down once the controller's
heartbeats stop (max_heartbeat_misses), which ends the job.
"""

import json
import os
import sys
import tempfile
from typing import Any


def _save_connection_dict(self: Any, fname: str, cdict: dict) -> None:
    directory = self.profile_dir.security_dir
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".partial-")  # owner-only
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(cdict, indent=2))
    os.replace(partial, os.path.join(directory, fname))


def main() -> None:
    from ipyparallel.controller import app, heartmonitor

    handle = heartmonitor.HeartMonitor.handle_pong

    def handle_pong(self: Any, msg: list) -> None:
        handle(self, msg)
        if msg[0] in self.responses and msg[0] not in self.hearts:
            self.handle_new_hearts({msg[0]})

    app.IPController.save_connection_dict = _save_connection_dict
    heartmonitor.HeartMonitor.handle_pong = handle_pong
    app.main()


if __name__ == "__main__":
    sys.path[0] = ""  # the working directory, as `python -c`, not this one (see programs)
    main()
