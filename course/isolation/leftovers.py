"""What a grader leaves on the machine while it works, named so that the next grading run can remove
what a dead grader left (SIGKILL, a power cut) and never touch a live one's.

A grader makes three kinds of things outside its own process, and names each after its owner, the
process that made it: its pid and that process's start time (clock ticks after boot, field 22 of
``/proc/<pid>/stat``), so a pid the kernel hands out again later is not mistaken for the owner:

- run folders in the temporary folder (``run_folder``): ``ch31-<kind>-<pid>-<start>-<random>``, kind
  ``grade`` (one checkout's workspace and scratch folders, its scratch tmpfs mounted inside, as root)
  or ``ref`` (the reference's scenario answers). Each also holds ``owner.lock``, locked (``flock``)
  by its owner until the folder is gone: the kernel drops the lock when the owner dies, whatever
  killed it, and a grader in another PID namespace that shares the temporary folder holds it too;
- memory cgroups (``sandbox.MemoryCgroup``): ``ch31-sandbox-<pid>-<start>-<n>`` and the probe
  ``ch31-probe-<pid>-<start>``, under this process's own memory cgroup;
- the scratch tmpfs mounts, always inside a run folder.

``clean_dead()`` (run once at the start of every grading session, ``grade.Session``) removes a run
folder only when its owner is gone (no process with that pid and start time) AND its lock is free,
unmounting what is mounted inside first; and a cgroup only when its owner is gone, killing what is
still inside (a dead grader's sandbox). Anything else is left alone: other names, a live grader's
folders and cgroups, folders whose lock is held.
"""
from __future__ import annotations

import fcntl
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from course.isolation.sandbox import MemoryCgroup, memory_cgroup_parent, mounts_under, owner_tag, remove_tree, start_time

LOCK_NAME = "owner.lock"
KINDS = ("grade", "ref")
_FOLDER = re.compile(r"ch31-(?:grade|ref)-(\d+)-(\d+)-[A-Za-z0-9_]+")
_CGROUP = re.compile(r"ch31-(?:sandbox-(\d+)-(\d+)-\d+|probe-(\d+)-(\d+))")


def alive(pid: int, start: int) -> bool:
    """Whether the process that made a leftover (pid and start time) still runs."""
    return start_time(pid) == start


@contextmanager
def run_folder(kind: str):
    """A fresh folder ``ch31-<kind>-<owner>-<random>`` in the temporary folder, locked by this process
    while it is used, removed afterwards (``sandbox.remove_tree``: mounts inside unmounted first, never
    recursive; a failure is a warning on the console, never an exception)."""

    if kind not in KINDS:
        raise ValueError(f"run_folder kind {kind!r}: one of {', '.join(KINDS)}")
    path = Path(tempfile.mkdtemp(prefix=f"ch31-{kind}-{owner_tag()}-"))
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        try:
            remove_tree(path)  # what a sandbox wrote may be deep or odd: never recursive, never fatal
        except OSError as exc:
            print(f"warning: could not remove the scratch folder {path}: {exc}", file=sys.stderr)
        finally:
            os.close(fd)


def _lock_free(folder: Path) -> bool:
    """Whether nobody holds ``folder``'s owner lock (a folder without one: free)."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the lock we may have taken


@dataclass
class Cleaned:
    """What ``clean_dead`` removed (and what it found but could not remove)."""

    folders: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.folders or self.cgroups or self.failed)


def dead_folders(where: Path | None = None) -> list[Path]:
    """Run folders in ``where`` (the temporary folder) whose owner is gone and whose lock is free."""
    where = Path(where or tempfile.gettempdir())
    out = []
    try:
        names = os.listdir(where)
    except OSError:
        return []
    for name in names:
        m = _FOLDER.fullmatch(name)
        path = where / name
        if m and not alive(int(m[1]), int(m[2])) and not path.is_symlink() and path.is_dir() and _lock_free(path):
            out.append(path)
    return out


def dead_cgroups() -> list[Path]:
    """This grader's kind of memory cgroups (beside the ones it would make) whose owner is gone."""

    where = memory_cgroup_parent()
    if where is None:
        return []
    out = []
    try:
        names = os.listdir(where[1])
    except OSError:
        return []
    for name in names:
        m = _CGROUP.fullmatch(name)
        if m:
            pid, start = (int(m[1]), int(m[2])) if m[1] else (int(m[3]), int(m[4]))
            if not alive(pid, start):
                out.append(where[1] / name)
    return out


def clean_dead(where: Path | None = None) -> Cleaned:
    """Remove every leftover of a dead grader (run folders in ``where``, default the temporary folder,
    with the mounts inside them; memory cgroups); see the module's docstring for what counts as dead."""

    if start_time(os.getpid()) is None:  # no /proc to tell the living from the dead: touch nothing
        return Cleaned()
    done = Cleaned()
    for folder in dead_folders(where):
        mounted = mounts_under(folder)
        try:
            remove_tree(folder)
            done.folders.append(str(folder))
            done.mounts += mounted
        except OSError as exc:
            done.failed.append(f"{folder}: {exc}")
    kind = (memory_cgroup_parent() or ("v1", None))[0]
    for path in dead_cgroups():
        MemoryCgroup(kind, path).remove()
        if path.exists():
            done.failed.append(f"{path}: still there")
        else:
            done.cgroups.append(str(path))
    return done


_cleaned_once: list[Cleaned] = []


def clean_dead_once() -> Cleaned:
    """``clean_dead`` the first time a process calls it (a grading session's start); one line on
    stderr when it removed something."""
    if not _cleaned_once:
        done = clean_dead()
        _cleaned_once.append(done)
        if done:
            print(f"grader: removed what a dead grader left: {len(done.folders)} folder(s), {len(done.mounts)} "
                  f"mount(s), {len(done.cgroups)} cgroup(s)"
                  + (f"; could not remove: {'; '.join(done.failed)}" if done.failed else ""), file=sys.stderr)
    return _cleaned_once[0]
