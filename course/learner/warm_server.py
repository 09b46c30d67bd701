"""A warm interpreter for pytest sessions: imports torch, NumPy and pytest once, then forks one
child per session it is asked for (``course/learner/warm.py`` is its client; read that first).

This file is run as a script (``python warm_server.py``), never imported from the repository's
packages: the server imports nothing of this repository, so each child imports the workspace's own
``engine``, ``course`` and ``tests`` exactly as a fresh ``python -m pytest`` started there would.

Protocol, one JSON object per line. The client writes a request ``{"cwd", "args", "env", "out"}``;
the server forks, answers ``{"pid": N}``, waits for that child and answers ``{"rc": R}`` (the exit
status, or minus the signal that ended it). The child starts a session of its own (so a kill of
its process group ends whatever it started), takes ``env`` as its whole environment, reads stdin from ``/dev/null``, puts
``cwd`` and ``env["PYTHONPATH"]``'s folders first on ``sys.path`` (as ``python -m`` would), sends
its stdout and stderr to the file ``out`` and runs ``pytest.main(args)``. End of input: the
server exits.
"""
from __future__ import annotations

import json
import os
import sys

# The expensive imports every session makes; nothing here starts a thread, so forking is safe.
import numpy  # noqa: F401
import pytest
import torch  # noqa: F401

try:  # the per-test time limit's plugin, when installed
    import pytest_timeout  # noqa: F401
except ImportError:  # pragma: no cover - the course's requirements install it
    pass

BASE_PATH = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def _child(req: dict) -> int:
    os.setsid()
    os.chdir(req["cwd"])
    env = req["env"]
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *BASE_PATH]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = ["pytest", *req["args"]]
    return int(pytest.main(req["args"]))


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                code = _child(req)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - whatever broke, the child must not return to the loop
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    main()
