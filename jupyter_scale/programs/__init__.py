"""Programs that run as the main of other processes: ipyparallel's engine and controller with
our changes, Ray's head.

Each is a module of this package (linted and type-checked like the rest) that the kernel runs
by path (`command`), or has the fork server run by path (forkserver.fork), not with `-m`:
`-m` imports the `jupyter_scale` package first, and with it torch (a second of CPU, and before
the engine's own try), which a controller or a head must not pay. A program run so finds its
own directory first on sys.path: each puts the working directory there instead
(`sys.path[0] = ""`), as `python -c` did, so that nothing here shadows a module of the user's.
None imports from this package before that.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def path(name: str) -> str:
    """The file of the program `name` (a module of this package)."""
    return os.path.join(HERE, f"{name}.py")


def command(name: str) -> list[str]:
    """`[python, file]`: the start of the command line that runs program `name`."""
    return [sys.executable, path(name)]

