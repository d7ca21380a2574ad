"""When a framework's cell needs fresh workers, and which cells a framework may run.

Neither TensorFlow nor PaddlePaddle forms its group twice in one process, and both lose it
when torch's group is formed anew (a failed cell cuts it). `FrameworkGroups` follows which
frameworks' groups the workers hold and which can no longer go on; the session asks it
before each cell whether the workers must be restarted first.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ..errors import DistributeError


class FrameworkGroups:
    """The frameworks whose group the workers formed, and those whose group cannot go on."""

    def __init__(self) -> None:
        self.formed: set[str] = set()
        self.spent: set[str] = set()
        # Names a cell of another framework than torch bound on the workers -> that framework:
        # a later cell that reads them (and imports nothing) is that framework's too.
        self.bound_by: dict[str, str] = {}

    def held(self, free: Iterable[str], namespace: Collection[str]) -> set[str]:
        """The frameworks of the workers' own names a cell reads (not the notebook's)."""
        return {self.bound_by[n] for n in free if n in self.bound_by and n not in namespace}

    def restart_reason(self, framework: str, group_ready: bool) -> str:
        """Why a cell of `framework` needs fresh workers first ('' when it does not)."""
        # torch's group formed anew (a cell destroyed it) cuts the framework's connections too
        if framework in self.spent or framework in self.formed and not group_ready:
            return f"the workers' {framework} group cannot go on after the failed cell (it forms once per process)"
        if framework == "paddle" and "tensorflow" in self.formed:
            return "PaddlePaddle crashes a process that has imported TensorFlow"
        return ""

    def cell_started(self, framework: str) -> None:
        if framework != "torch":
            self.formed.add(framework)

    def group_cut(self) -> None:
        """torch's group is formed anew, or a cell failed: their sockets go with it."""
        self.spent |= self.formed

    def names_bound(self, names: Iterable[str], framework: str) -> None:
        for name in names:
            if framework == "torch":
                self.bound_by.pop(name, None)
            else:
                self.bound_by[name] = framework

    def after_interrupt(self) -> str:
        """What an interrupted cell's message adds: which cells start fresh workers."""
        if not self.formed:
            return ""
        return (f"; the next {' or '.join(sorted(self.formed))} cell starts fresh workers "
                "(the group forms once per process)")


def refuse_unsafe(framework: str, shard: bool | dict, connected: bool, allow_unauthenticated: bool) -> None:
    """Raise DistributeError for a cell of `framework` (not torch) that must not run here."""
    if shard:
        raise DistributeError(f"--shard is for torch cells (FSDP2), not {framework} ones")
    if connected:
        raise DistributeError(f"{framework} cells run on workers this session starts: a connected cluster's "
                              "processes outlive the session, and a framework's group formed in them with them")
    if not allow_unauthenticated:
        what = {"tensorflow": "TensorFlow's server (TF_CONFIG) runs any graph anyone sends it, and listens on "
                              "every interface",
                "paddle": "PaddlePaddle's store (PADDLE_MASTER) serves anyone, who can then stall or break "
                          "the group, and listens on every interface",
                "horovod": "Horovod's gloo rendezvous and connections take anyone, who can then join or break "
                           "the group"}[framework]
        raise DistributeError(
            f"{what}: on a machine that others use, they could reach it. "
            "Where every user and host is trusted: %config ScaleSession.allow_unauthenticated_servers = True "
            "(see README, Frameworks)")
