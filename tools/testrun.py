"""Run pytest in a subprocess and read back one record per test (outcome, hole markers, message).

The grader (``tools/grade.py``), the mutant runner (``tools/mutants.py``) and the contract tests
all need "which test of which hole passed, and if not, why" from a separate process — a separate
process so that each run imports its own ``engine``. The records come from the plugin in
``tools/pytest_plugins/ch31_report.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = Path(__file__).resolve().parent / "pytest_plugins"
CHAPTER_TESTS = "tests/test_ch31_engine_v2.py"
# Variables that redirect what a test session imports; a child gets them only when asked to.
REDIRECTS = ("ENGINE_IMPL", "ENGINE_SOLUTIONS_DIR", "ENGINE_LEARNER_DIR")
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
               python: str = sys.executable, timeout: float | None = None) -> TestRun:
    """``python -m pytest ARGS`` in ``cwd`` with the report plugin; ``env`` adds variables.

    ``ENGINE_IMPL``, ``ENGINE_SOLUTIONS_DIR`` and ``ENGINE_LEARNER_DIR`` are not inherited from
    this process: pass them in ``env`` when wanted (``--impl`` in args decides the impl anyway).
    """
    child_env = {k: v for k, v in os.environ.items() if k not in REDIRECTS}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_DIR), child_env.get("PYTHONPATH")]))
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="ch31-report-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [python, "-m", "pytest", "-p", "ch31_report", "--report-json", str(report), *LEAN, *args]
        start = time.monotonic()
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
