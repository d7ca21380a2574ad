"""Drive a real IPython kernel (a separate process) cell by cell, with deadlines."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from jupyter_client.manager import KernelManager


@dataclass
class CellResult:
    stdout: str = ""
    stderr: str = ""
    error: dict | None = None  # ename, evalue, traceback
    result: str | None = None  # text/plain of the execute_result
    displays: list = field(default_factory=list)
    comms: list = field(default_factory=list)  # comm_open / comm_msg / comm_close contents, in order
    payload: list = field(default_factory=list)  # the execute reply's payloads
    prompts: list = field(default_factory=list)  # the kernel's input requests' prompts, in order
    answered: list = field(default_factory=list)  # (prompt, answer) of those answered

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def error_text(self) -> str:
        if not self.error:
            return ""
        return "\n".join([self.error["ename"], self.error["evalue"], *self.error["traceback"]])


class Kernel:
    """A kernel with `%load_ext jupyter_scale` run; `cell()` runs code and collects output."""

    def __init__(self, startup_timeout: float = 60, backend: str | None = None):
        import os

        env = dict(os.environ)
        env.pop("JUPYTER_SCALE_BACKEND", None)
        if backend:  # the documented way to pick the default engine
            env["JUPYTER_SCALE_BACKEND"] = backend
        self.backend = backend or "ipyparallel"
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(extra_arguments=["--HistoryManager.enabled=False"], env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=startup_timeout)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def cell(self, code: str, timeout: float = 180, on_stream=None, on_comm=None, history: bool = False,
             stdin=None) -> CellResult:
        """Run `code`; `on_stream(name, text)` is called for each output as it arrives,
        `on_comm(msg_type, content)` for each comm message. `history`: the cell counts as
        a notebook cell (In [n], what %scale export reads); else it leaves no trace there.
        `stdin(prompt)`: answers the kernel's input requests, as a frontend's input box does
        (without it the kernel is told that this frontend answers none)."""
        msg_id = self.client.execute(code, store_history=history, allow_stdin=stdin is not None)
        out = self._collect(msg_id, code, timeout, on_stream, on_comm, stdin)
        out.payload = self._reply(msg_id, timeout=30)["content"].get("payload", [])
        return out

    def _reply(self, msg_id: str, timeout: float) -> dict:
        """The shell channel's reply to `msg_id` (earlier replies nobody read are skipped)."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = self.client.get_shell_msg(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg
        raise TimeoutError(f"no reply to {msg_id} within {timeout} s")

    def comm_open(self, target: str, data: dict | None = None, timeout: float = 60) -> tuple[str, CellResult]:
        """Open a comm to `target` as a frontend does; the comm id and what the kernel answered."""
        import uuid

        comm_id = uuid.uuid4().hex
        msg = self.client.session.msg("comm_open", {"comm_id": comm_id, "target_name": target, "data": data or {}})
        self.client.shell_channel.send(msg)
        return comm_id, self._collect(msg["header"]["msg_id"], f"comm_open {target}", timeout)

    def comm_send(self, comm_id: str, data: dict, timeout: float = 120) -> CellResult:
        """Send a comm message as a frontend does; what the kernel answered while handling it."""
        msg = self.client.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.client.shell_channel.send(msg)
        return self._collect(msg["header"]["msg_id"], f"comm_msg {data}", timeout)

    def _collect(self, msg_id: str, code: str, timeout: float, on_stream=None, on_comm=None, stdin=None) -> CellResult:
        out = CellResult()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.manager.interrupt_kernel()
                raise TimeoutError(f"cell did not finish within {timeout} s:\n{code}\n--- so far:\n{out.stdout}{out.stderr}")
            try:
                msg = self.client.get_iopub_msg(timeout=min(remaining, 0.05 if stdin is not None else 1.0))
            except queue.Empty:
                # Input requests are answered once the output before them is read, as a
                # frontend shows it above its input box.
                if stdin is not None:
                    self._answer_input(out, stdin)
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if on_stream is not None:
                    on_stream(content["name"], content["text"])
                if content["name"] == "stdout":
                    out.stdout += content["text"]
                else:
                    out.stderr += content["text"]
            elif kind == "error":
                out.error = content
            elif kind == "execute_result":
                out.result = content["data"].get("text/plain")
            elif kind in ("display_data", "update_display_data"):
                out.displays.append(content["data"])
            elif kind in ("comm_open", "comm_msg", "comm_close"):
                out.comms.append(dict(content, msg_type=kind))
                if on_comm is not None:
                    on_comm(kind, content)
            elif kind == "status" and content["execution_state"] == "idle":
                return out

    def _answer_input(self, out: CellResult, stdin) -> None:
        try:
            request = self.client.get_stdin_msg(timeout=0)
        except queue.Empty:
            return
        prompt = request["content"]["prompt"]
        out.prompts.append(prompt)
        answer = stdin(prompt)
        if answer is not None:  # None: no answer (the caller interrupts the kernel instead)
            out.answered.append((prompt, answer))
            self.client.input(answer)

    def ok(self, code: str, timeout: float = 180, history: bool = False) -> CellResult:
        """Run a cell that must succeed; fail the test with its error otherwise."""
        result = self.cell(code, timeout, history=history)
        assert result.ok, f"cell failed:\n{code}\n---\n{result.error_text}\n{result.stdout}\n{result.stderr}"
        return result

    def value(self, expr: str, timeout: float = 60):
        """Evaluate `expr` in the kernel and return it (via repr/literal_eval)."""
        import ast

        result = self.ok(f"print(repr(({expr})))", timeout)
        return ast.literal_eval(result.stdout.strip().splitlines()[-1])

    def descendants(self) -> list:
        """Live processes started (directly or not) by the kernel process, but its fork server
        itself (started at %load_ext, ended by %scale stop; the workers forked from it count)
        and its watcher (jupyter_scale.processes: lives as long
        as the kernel)."""
        import psutil

        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and not _is_resource_tracker(p) and not _is_fork_server_or_watcher(p, self.pid)]

    def shutdown(self) -> None:
        try:
            self.client.stop_channels()
        finally:
            self.manager.shutdown_kernel(now=False)


def _is_fork_server_or_watcher(process, kernel: int) -> bool:
    """The kernel's child that is multiprocessing's fork server (the workers are its forks) or
    the kernel's watcher (jupyter_scale.processes)."""
    import psutil

    from jupyter_scale import processes

    try:
        if process.ppid() != kernel:
            return False
        command = process.cmdline()
        return processes.__file__ in command or "from multiprocessing.forkserver import main" in command[-1]
    except (psutil.Error, IndexError):
        return False


def _is_resource_tracker(process) -> bool:
    """multiprocessing's resource tracker: started once per kernel when Dask's nanny spawns
    workers, holds no port, and exits with the kernel (which the fixtures check)."""
    import psutil

    try:
        return any("multiprocessing.resource_tracker" in part for part in process.cmdline())
    except psutil.Error:
        return False
