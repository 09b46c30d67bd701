"""Warm pytest sessions for the runs that start hundreds of them (mutants, the bug corpus).

A session of the chapter's tests that stops at its first failure lasts about three seconds on a
Zen 2 core, and two of them go to importing torch. The mutant and bug-corpus runs start some 300
such sessions, so most of their time was spent importing the same library again. A ``WarmPool``
keeps, per worker thread, one server process (``warm_server.py``) that has imported torch, NumPy
and pytest once and forks a child per session: the child is a fresh process for everything of
this repository (it imports the workspace's ``engine``, ``course`` and ``tests`` itself, since the
server imported none of them), with the environment, working folder, ``sys.path`` and output a
``python -m pytest`` started there would have.

What a warm session shares with its server is only what was imported before the fork (torch,
NumPy, pytest and their own start-up state; the server runs no torch op, so no thread pool exists
to be inherited). A session that runs past its time limit is killed with its whole process group,
as ``subprocess.run``'s timeout would kill a cold one.

    with WarmPool() as pool:
        run_pytest(args, cwd=bed, warm=pool)   # testrun.run_pytest, the same TestRun back
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVER = Path(__file__).with_name("warm_server.py")
# Variables read when torch, its OpenMP/oneDNN runtimes or the interpreter itself start: a forked
# session keeps its server's values, so a session that asks for others is started cold instead.
LOAD_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "DNNL_", "ONEDNN_", "TORCH_", "ATEN_", "LD_", "MALLOC_",
                      "PYTHON")
PER_SESSION = ("PYTHONPATH",)  # set by the child itself (sys.path), as ``python -m`` would


def load_time_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that takes effect only when a process starts (see LOAD_TIME_PREFIXES)."""
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES) and k not in PER_SESSION}


def _kill_group(pid: int) -> None:
    """SIGKILL a session's whole process group (its child made itself the group's leader)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class WarmServer:
    """One server process; ``run`` is one session at a time (``WarmPool`` gives each thread its own)."""

    def __init__(self, python: str = sys.executable) -> None:
        env = {k: v for k, v in os.environ.items() if k != "ENGINE_IMPL"}
        self.load_time = load_time_env(env)
        self.proc = subprocess.Popen([python, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=tempfile.gettempdir())
        self._buf = b""

    def _line(self, deadline: float | None) -> dict | None:
        """The server's next answer, or None if ``deadline`` (time.monotonic) passes first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the warm pytest server ended (exit {self.proc.poll()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, args: list[str], cwd: Path, env: dict[str, str],
            timeout: float | None) -> tuple[int, str, bool]:
        """``python -m pytest ARGS`` in ``cwd`` with ``env`` as its environment, forked from the
        server -> (exit code, stdout and stderr together, whether ``timeout`` ended it)."""
        with tempfile.TemporaryDirectory(prefix="ch31-warm-") as tmp:
            out = Path(tmp) / "output.txt"
            req = {"cwd": str(cwd), "args": list(args), "env": dict(env), "out": str(out)}
            try:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
            except OSError as exc:  # a server that died since its last session
                raise RuntimeError(f"the warm pytest server ended (exit {self.proc.poll()})") from exc
            pid = self._line(None)["pid"]
            try:
                deadline = None if timeout is None else time.monotonic() + timeout
                answer = self._line(deadline)
                timed_out = answer is None
                if timed_out:
                    _kill_group(pid)
                    answer = self._line(None)
            except RuntimeError:  # the server died under its session: end the session too
                _kill_group(pid)
                raise
            output = out.read_text(errors="replace") if out.exists() else ""
            return (-1 if timed_out else int(answer["rc"])), output, timed_out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


class WarmPool:
    """A ``WarmServer`` per thread that asks, started on its first session, all closed on exit."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self._local = threading.local()
        self._servers: list[WarmServer] = []
        self._lock = threading.Lock()

    def serves(self, python: str, env: dict[str, str]) -> bool:
        """Whether a session of ``python`` with environment ``env`` may be forked from this pool's
        servers: the same interpreter, and the same start-up variables as the server started with."""
        return python == self.python and load_time_env(env) == self.server().load_time

    def server(self) -> WarmServer:
        srv = getattr(self._local, "server", None)
        if srv is None or srv.proc.poll() is not None:
            srv = self._local.server = WarmServer(self.python)
            with self._lock:
                self._servers.append(srv)
        return srv

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            for srv in self._servers:
                srv.close()
            self._servers.clear()
