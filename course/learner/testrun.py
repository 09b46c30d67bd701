"""Run pytest in a subprocess and read back one record per test (outcome, hole markers, message).

The grader (``course/grading/grade.py``), the mutant runner (``course/quality/mutants.py``) and the contract tests
all need "which test of which hole passed, and if not, why" from a separate process — a separate
process so that each run imports its own ``engine``. The records come from the plugin in
``course/learner/pytest_plugins/ch31_report.py``.

``workspace(dst, hole_files)`` makes the one kind of test bed they all use: a copy of THIS
repository (its tests, conftest, tools, answers and given code) whose chapter files under engine/
are replaced by the given texts — a learner's files, the chapter files with every hole filled
(``reference_files``), a mutated one, or the course's own files with their stubs
(``skeleton_files``). A test session there compares its chapter files with THIS repository's
(``ENGINE_COURSE_COPY``) to find edits outside the holes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.learner.warm import WarmPool

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = Path(__file__).resolve().parent / "pytest_plugins"
CHAPTER_TESTS = "tests/test_ch31_engine_v2.py"
# The variable that redirects what a test session imports; a child gets it only when asked to.
REDIRECTS = ("ENGINE_IMPL",)
# What a workspace leaves out of the copy of this repository.
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv", ".venv-peers", "grades", "__pycache__", ".pytest_cache",
                                     ".hypothesis", "*.egg-info", ".skeleton-backup", "bench_results", "notebooks", "chapters")


def chapter_files() -> list[str]:
    """The chapter's files with holes, relative to engine/ ("serve/blocks.py", ...)."""
    from engine._impl import CHAPTER_FILES

    return list(CHAPTER_FILES)


def workspace(dst: Path, hole_files: dict[str, str] | None = None) -> Path:
    """A copy of this repository at ``dst`` whose ``engine/<rel>`` holds ``hole_files[rel]``."""
    shutil.copytree(ROOT, dst, ignore=_NOT_COPIED)
    for rel, text in (hole_files or {}).items():
        (dst / "engine" / rel).write_text(text)
    return dst


def skeleton_files() -> dict[str, str]:
    """Every chapter file as the course hands it out: given code and stubs (a fresh clone)."""
    return {rel: (ROOT / "engine" / rel).read_text() for rel in chapter_files()}


def reference_files() -> dict[str, str]:
    """Every chapter file with every hole filled from solutions/: a learner who wrote the answers."""
    from course.learner.holes import filled_files

    return filled_files(engine_texts=skeleton_files())
# The chapter's tests use neither plugin; hypothesis alone costs ~1.5 s of start-up per run.
LEAN = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio")


@dataclass
class TestRecord:
    """One test's result as the plugin saw it."""

    nodeid: str
    holes: list[str]
    milestone: bool
    given: bool
    outcome: str  # "passed" | "failed" | "error" | "skipped" | "not run"
    message: str
    duration: float

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    @property
    def name(self) -> str:
        return self.nodeid.split("::", 1)[-1]


@dataclass
class TestRun:
    """A finished pytest subprocess: its exit code, wall time, records, and the output's tail."""

    returncode: int
    seconds: float
    tests: list[TestRecord] = field(default_factory=list)
    collect_errors: list[dict] = field(default_factory=list)
    output: str = ""
    timed_out: bool = False
    engine_file: str | None = None  # the engine package the session imported

    def first_failure(self) -> TestRecord | None:
        return next((t for t in self.tests if t.outcome in ("failed", "error")), None)


def run_pytest(args: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None,
               python: str = sys.executable, timeout: float | None = None,
               per_test_timeout: float = 0, warm: WarmPool | None = None) -> TestRun:
    """``python -m pytest ARGS`` in ``cwd`` with the report plugin; ``env`` adds variables.
    With ``warm`` (``course/learner/warm.py``) the session is forked from a server that has
    imported torch already, the same run without the seconds of start-up (cold when ``env`` sets a
    variable read at start-up, or when the server has died).

    ``ENGINE_IMPL`` is not inherited from this process (``--impl`` in args decides). With
    ``per_test_timeout`` a test that runs longer fails alone (pytest-timeout, signal method),
    so a hole stuck in a loop costs its own test, not the run.
    """
    child_env = {k: v for k, v in os.environ.items() if k not in REDIRECTS}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_DIR), child_env.get("PYTHONPATH")]))
    child_env.setdefault("ENGINE_COURSE_COPY", str(ROOT))  # the course's chapter files: this checkout's
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="ch31-report-") as tmp:
        report = Path(tmp) / "report.json"
        limit = ["--timeout", str(per_test_timeout), "--timeout-method", "signal"] \
            if per_test_timeout else []
        cmd = [python, "-m", "pytest", "-p", "ch31_report", "--report-json", str(report), *LEAN, *limit, *args]
        start = time.monotonic()
        forked = None
        if warm is not None and warm.serves(python, child_env):
            try:
                forked = warm.server().run(cmd[3:], cwd, child_env, timeout)
            except RuntimeError:  # the server itself died (killed, out of memory): this session runs cold
                report.unlink(missing_ok=True)
        if forked is not None:
            returncode, output, timed_out = forked
        else:
            try:
                proc = subprocess.run(cmd, cwd=cwd, env=child_env, capture_output=True, text=True, timeout=timeout)
                returncode, output, timed_out = proc.returncode, proc.stdout + proc.stderr, False
            except subprocess.TimeoutExpired as exc:
                out = exc.stdout or b""
                output = out.decode(errors="replace") if isinstance(out, bytes) else out
                returncode, timed_out = -1, True
        run = TestRun(returncode, round(time.monotonic() - start, 2), output=output[-6000:], timed_out=timed_out)
        if report.exists():
            data = json.loads(report.read_text())
            run.tests = [TestRecord(**t) for t in data["tests"]]
            run.collect_errors = data["collect_errors"]
            run.engine_file = data.get("engine_file")
        return run
