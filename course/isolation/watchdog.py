"""The grader's watchdog: learner code runs in a sandboxed child; time limits live in the parent.

``run_tests`` runs the chapter's tests (pytest, inside the sandbox) and ``run_scenarios`` the
verification scenarios. Both watch the child from the grader's process: a test (or scenario) that
runs past its limit gets the child's whole process group killed, whatever the child does about
signals or exit codes; a child that ends mid-test (a crash, ``os._exit``, a memory limit) is noticed
the same way. The test or scenario that was running is counted failed with the grader's own message,
the rest of its hang group (one hole's tests; the milestone and the engine checks together, since
they run the same engine) is not run and says why, and a fresh child runs everything else. So a
hung hole costs at most one limit per hang group that reaches it.

Start-up is watched too: a child that has not started its first test (or scenario) within
``startup`` seconds (code at import that sleeps or loops) is killed, and nothing more of that run
is retried, so a hang at import costs one start-up limit per run (the grader gives the scenario run a
shorter one once the test run hung at start-up); ``startup_hang`` says so in the grader's words. Every file read back from a scratch folder goes through
``sandbox.read_capped`` (no symlinks followed, no blocking on a named pipe, a plain file only,
capped in size).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.isolation.sandbox import (Finished, Limits, Sandbox, prepare_dirs, read_capped, release_mounts,
                                    run_watched)
from course.learner.testrun import LEAN, PLUGIN_DIR

PLUGIN_REL = PLUGIN_DIR.relative_to(Path(__file__).resolve().parents[2])  # course/learner/pytest_plugins


@dataclass
class Watched:
    """What came back from the watched runs: the child's own records (advisory) and the parent's notes."""

    records: dict[str, dict] = field(default_factory=dict)  # nodeid (or scenario id) -> record
    killed: dict[str, str] = field(default_factory=dict)  # id -> "hung" | "died"
    skipped: dict[str, str] = field(default_factory=dict)  # id -> why it never ran
    runs: int = 0
    seconds: float = 0.0
    output: str = ""  # the children's output, for the instructor only
    startup_hang: str = ""  # the grader's message when a run hung before its first test / scenario


STARTUP_TIMEOUT = 90.0  # seconds a child may take to start its first test or scenario (course.grading.grade.Options)
REPORT_CAP = 16 << 20  # bytes of report.json the grader reads (an honest one: ~100 KB)
RESULTS_CAP = 64 << 20  # bytes of results.jsonl the grader reads


COURSE_COPY_DIR = ".course-copy"  # inside a workspace: the instructor's chapter files (course.grading.grade.place_chapter_files)


def child_env(scratch: Path, plugin_dir: Path | None, threads: int, course_copy: Path | None = None) -> dict[str, str]:
    """The child's whole environment; ``course_copy``: a folder whose engine/ holds the course's own
    chapter files (``ENGINE_COURSE_COPY``: a chapter file that does not import is served from it, so
    it fails only its own holes' tests)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "MALLOC_ARENA_MAX": "2",
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "ENGINE_IMPL": "engine",
           "TORCH_EXTENSIONS_DIR": str(scratch / "torch_extensions")}
    if plugin_dir is not None:
        env["PYTHONPATH"] = str(plugin_dir)
    if course_copy is not None and course_copy.is_dir():
        env["ENGINE_COURSE_COPY"] = str(course_copy)
    return env


def _launch(sandbox: Sandbox | None, cmd: list[str], cwd: Path, env: dict, limits: Limits, watch, timeout: float) -> Finished:
    if sandbox is None:  # --unsafe: limits only, no isolation
        from course.isolation.sandbox import unsafe_preexec

        return run_watched(cmd, cwd, env, unsafe_preexec(limits), watch, timeout)
    return sandbox.run(cmd, cwd, env, limits, watch, timeout)


def _next_run(w: Watched, top: Path, label: str, bed: Path, bwrap: str | None, limits: Limits,
              hide: tuple[Path, ...] = ()) -> tuple[Path, Sandbox | None]:
    """A fresh scratch folder (and sandbox) for the next child: nothing carries over between runs.
    The previous run's scratch (read by now) is released: as root it is a tmpfs, unmounted here."""
    if w.runs and bwrap:
        release_mounts(top / f"scratch-{label}-{w.runs}")
    w.runs += 1
    scratch = top / f"scratch-{label}-{w.runs}"
    prepare_dirs(top, scratch, limits if bwrap else None)  # --unsafe: a plain folder
    return scratch, (Sandbox(bwrap, bed, scratch, limits.processes, hide, limits.tmp_bytes) if bwrap else None)


def run_tests(bed: Path, top: Path, bwrap: str | None, nodeids: list[str], group_of: dict[str, str],
              per_test: float, total: float, limits: Limits, threads: int, extra_args: list[str],
              startup: float = STARTUP_TIMEOUT) -> Watched:
    """Run ``nodeids`` (the instructor's own collection) in the sandbox, restarting after each kill."""
    w = Watched()
    left = list(nodeids)
    deadline = time.monotonic() + total
    while left and time.monotonic() < deadline:
        scratch, sandbox = _next_run(w, top, "tests", bed, bwrap, limits)
        report = scratch / "report.json"
        cmd = [sys.executable, "-m", "pytest", "-p", "ch31_report", "--report-json", str(report), *LEAN,
               "-q", "--tb=line", "--impl", "engine", *extra_args, *left]
        launched, began = time.monotonic(), [False]

        def watch() -> str:
            data = _read_json(report)
            since = data.get("current_since") if isinstance(data, dict) else None
            if isinstance(since, (int, float)) and time.time() - since > per_test:
                return "hung"
            if not began[0]:
                began[0] = isinstance(data, dict) and (data.get("current") is not None or any(
                    isinstance(t, dict) and t.get("outcome") != "not run" for t in data.get("tests") or []))
                if not began[0] and time.monotonic() - launched > startup:
                    return "startup"
            return ""

        fin = _launch(sandbox, cmd, bed, child_env(scratch, bed / PLUGIN_REL, threads, bed / COURSE_COPY_DIR), limits,
                      watch, max(1.0, deadline - time.monotonic()))
        w.seconds += fin.seconds
        w.output += f"\n--- run {w.runs} (exit {fin.returncode}{', killed: ' + fin.killed if fin.killed else ''})\n" \
                    + fin.output[-20000:]
        data = _read_json(report)
        tests = data.get("tests", []) if isinstance(data, dict) else []
        for t in tests if isinstance(tests, list) else []:
            if isinstance(t, dict) and t.get("nodeid") in group_of and t.get("outcome") != "not run":
                w.records[t["nodeid"]] = t
        current = data.get("current") if isinstance(data, dict) else None
        left = [n for n in left if n not in w.records]
        if not left:
            break
        if fin.killed == "startup":
            w.startup_hang = (f"the test session hung at start-up (no test began within {startup:g} s): "
                              "code that runs when your chapter files are imported?")
            for n in left:
                w.skipped[n] = "never ran: the test session hung at start-up (importing your chapter files?)"
            left = []
            break
        culprit = current if current in left else None
        if culprit is None and fin.killed:
            culprit = left[0]
        if culprit is None:
            if fin.returncode in (0, 1) and not fin.killed:
                for n in left:  # pytest ended without running them (deselected, collection error)
                    w.skipped[n] = "never ran: the test session ended before reaching it"
                break
            culprit = left[0]
        w.killed[culprit] = "hung" if fin.killed == "hung" else "died"
        group = group_of[culprit]
        for n in left:
            if n != culprit and group_of[n] == group:
                w.skipped[n] = f"never ran: an earlier test of the same group {'hung' if w.killed[culprit] == 'hung' else 'ended the test process'}"
        left = [n for n in left if n != culprit and group_of[n] != group]
    for n in left:
        w.skipped.setdefault(n, "never ran: the grading time for this checkout ran out")
    return w


def run_scenarios(bed: Path, top: Path, bwrap: str | None, specs: list[dict], per_scenario: float, total: float,
                  limits: Limits, threads: int, hide: tuple[Path, ...], startup: float = STARTUP_TIMEOUT) -> Watched:
    """Run the scenarios in the sandbox (``hide``: folders it must not see, the reference's first)."""
    w = Watched()
    left = list(specs)
    deadline = time.monotonic() + total
    while left and time.monotonic() < deadline:
        scratch, sandbox = _next_run(w, top, "scenarios", bed, bwrap, limits, hide)
        spec_file, out = scratch / "specs.json", scratch / "results.jsonl"
        spec_file.write_text(json.dumps(left))
        cmd = [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
               "from course.grading.scenarios import child_main; sys.exit(child_main(sys.argv[1:]))",
               str(bed), str(spec_file), str(out)]
        started: dict[str, float] = {}
        launched = time.monotonic()

        def watch() -> str:
            current = None
            lines = _lines(out)
            if not lines and time.monotonic() - launched > startup:
                return "startup"
            for item in lines:
                if "start" in item:
                    current = item["start"]
                elif item.get("id") == current:
                    current = None
            if current is None:
                return ""
            return "hung" if time.time() - started.setdefault(current, time.time()) > per_scenario else ""

        fin = _launch(sandbox, cmd, bed, child_env(scratch, None, threads, bed / COURSE_COPY_DIR), limits, watch,
                      max(1.0, deadline - time.monotonic()))
        w.seconds += fin.seconds
        w.output += f"\n--- scenarios run {w.runs} (exit {fin.returncode}{', killed: ' + fin.killed if fin.killed else ''})\n" \
                    + fin.output[-20000:]
        from course.grading.verify import read_results

        if fin.killed == "startup" and not _lines(out):
            w.startup_hang = (f"the scenario run hung at start-up (no scenario began within {startup:g} s): "
                              "code that runs when your chapter files are imported?")
            for s in left:
                w.records[s["id"]] = {"id": s["id"], "error": "hung"}
            break
        safe = top / f"results-{w.runs}.jsonl"  # the grader's own copy, outside the sandbox's view
        safe.write_bytes(read_capped(out, RESULTS_CAP) or b"")
        got = read_results(safe)
        ids = [s["id"] for s in left]
        culprit = None
        for sid in ids:
            item = got.get(sid)
            if item is None:
                continue
            if item.get("error") == "died":
                culprit = sid
            else:
                w.records[sid] = item
        if culprit is None and fin.killed:
            culprit = next((s for s in ids if s not in w.records), None)
        if culprit is None:
            left = [s for s in left if s["id"] not in w.records]
            if left and fin.returncode == 0:
                culprit = left[0]["id"]  # an exit 0 before the end: os._exit(0) between scenarios
            elif not left:
                break
            else:
                culprit = left[0]["id"]
        kind = "hung" if fin.killed == "hung" else "died"
        w.killed[culprit] = kind
        w.records[culprit] = {"id": culprit, "error": kind}
        gkind = _hang_group(next(s for s in specs if s["id"] == culprit))
        rest = [s for s in left if s["id"] not in w.records]
        for s in rest:
            if _hang_group(s) == gkind:
                w.records[s["id"]] = {"id": s["id"], "error": "not_run"}
        left = [s for s in rest if _hang_group(s) != gkind]
    return w


def _hang_group(spec: dict) -> str:
    """Scenarios that run the whole engine share one hang group (the same learner code runs in each)."""
    return "engine" if spec["kind"] == "engine" else spec["group"]


def _read_json(path: Path):
    raw = read_capped(path, REPORT_CAP)
    try:
        return json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        return {}


def _lines(path: Path) -> list[dict]:
    raw = read_capped(path, RESULTS_CAP)
    if raw is None:
        return []
    text = raw.decode(errors="replace")
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(item, dict):
            out.append(item)
    return out
