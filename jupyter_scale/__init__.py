"""jupyter_scale: run a PyTorch training cell on N workers with %%distribute.

    %load_ext jupyter_scale

registers `%%distribute` and `%scale` and starts nothing. `wrap`, `shard`, `prepare` and
`report` work inside `%%distribute` cells and, as no-ops or local recording, outside them.
"""

from __future__ import annotations

from ._version import __version__
from .batchnorm import sync_batchnorm
from .checkpoint import load_checkpoint, save_checkpoint
from .errors import (
    CellTimeout,
    ClusterError,
    DistributeError,
    RemoteError,
    ShippingError,
    WorkerCallFailed,
    WorkerDied,
    WorkerLost,
)
from .explicit import prepare, shard, wrap
from .libraries import rebuild_on_workers
from .metrics import report
from .sharding import shard_model

_session = None


def get_session():
    """This kernel's Session (created on first use)."""
    global _session
    if _session is None:
        from IPython import get_ipython

        from .session import ScaleSession

        shell = get_ipython()
        _session = ScaleSession(shell=shell, parent=shell) if shell is not None else ScaleSession()
        if shell is not None and _session not in shell.configurables:
            shell.configurables.append(_session)  # %config ScaleSession.rendezvous_address = "..."
    return _session


def history(as_frame: bool = False):
    """The points of the last %%distribute run (or of local `report` calls).

    A list of dicts (`rank`, `step`, `time`, `epoch` when given, and each reported name);
    a pandas DataFrame with `as_frame=True`.
    """
    if _session is not None and _session.runs:
        return _session.history(as_frame=as_frame)
    from .metrics import local_recorder
    from .records import points_frame

    points = list(local_recorder.points)
    return points_frame(points) if as_frame else points


def load_ipython_extension(ip) -> None:
    from . import cellstart
    from .libraries import watch
    from .magics import ScaleMagics
    from .sidebar import SidebarChannel

    # Before the notebook builds a Trainer or an Accelerator: what it was built with is what
    # rebuilds it on the workers.
    watch()
    session = get_session()
    session.record_cells()  # what %scale export slices
    cellstart.attach(session)  # and where each cell started, while ScaleSession.export_keep_start is on
    session.warm_up()  # the engine's fork server starts importing while the user works
    ip.register_magics(ScaleMagics(ip, session))
    if not any(isinstance(o, SidebarChannel) for o in session.observers):
        SidebarChannel(session).register(ip)  # the JupyterLab sidebar, where a frontend is attached
    # So the same cell also runs without %%distribute: `report` records locally there.
    ip.user_ns.setdefault("report", report)


def unload_ipython_extension(ip) -> None:
    from . import patches
    from .libraries import unwatch

    try:
        if _session is not None:
            _session.stop()
    finally:
        unwatch()
        patches.remove_all()  # nothing of ours stays patched in the kernel


__all__ = [
    "__version__", "get_session", "history", "report", "prepare", "shard", "shard_model", "sync_batchnorm", "wrap",
    "save_checkpoint",
    "load_checkpoint", "rebuild_on_workers",
    "DistributeError", "ClusterError", "RemoteError", "ShippingError", "WorkerDied", "CellTimeout",
    "WorkerLost", "WorkerCallFailed",
]
