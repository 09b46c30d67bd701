"""Grade a checkout hole by hole: ``python run.py grade [PATH] [--json OUT]``.

Runs that checkout's chapter tests against its own engine (``--impl engine``, so each hole's
tests use the learner's version of that hole and the reference for the others) in a subprocess,
with this repository's Python. Prints one row per hole — tests passed / total and a status — plus
the milestone, and writes the same as JSON (default ``grades/<checkout name>.json``). A status is
- pass: every test of the hole passed;
- partial: some passed;
- not started: every test failed with the hole's NotImplementedError (the skeleton as handed out);
- fail: none passed, and the hole was attempted.
The exit status is 0 whenever grading itself worked, however many holes fail.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.skeleton import all_holes
from tools.testrun import CHAPTER_TESTS, ROOT, TestRecord, run_pytest

PASS, PARTIAL, NOT_STARTED, FAIL, NO_TESTS = "pass", "partial", "not started", "fail", "no tests"


@dataclass
class Row:
    """One line of the grade: a hole (or the milestone) and its tests' outcome."""

    name: str
    file: str
    passed: int
    total: int
    status: str
    failures: list[dict] = field(default_factory=list)  # {"test", "message"} for each failed test


def status_of(name: str, tests: list[TestRecord]) -> str:
    if not tests:
        return NO_TESTS
    passed = sum(t.passed for t in tests)
    if passed == len(tests):
        return PASS
    if passed:
        return PARTIAL
    unfilled = all("NotImplementedError" in t.message and "is a hole" in t.message
                   and (name == "milestone" or f"{name} is a hole" in t.message) for t in tests)
    return NOT_STARTED if unfilled else FAIL


def make_row(name: str, file: str, tests: list[TestRecord]) -> Row:
    failures = [{"test": t.name, "outcome": t.outcome, "message": t.message.splitlines()[0] if t.message else ""}
                for t in tests if not t.passed]
    return Row(name, file, sum(t.passed for t in tests), len(tests), status_of(name, tests), failures)


def grade(checkout: Path, per_test_timeout: float = 120, timeout: float = 1800) -> dict:
    """Run the checkout's chapter tests and summarise them per hole (the JSON document)."""
    run = run_pytest(["-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS,
                      "--per-test-timeout", str(per_test_timeout)], cwd=checkout, timeout=timeout)
    official = {h.qualname: h.file for h in all_holes()}
    by_hole: dict[str, list[TestRecord]] = {name: [] for name in official}
    for t in run.tests:
        for name in t.holes:
            by_hole.setdefault(name, []).append(t)
    holes = [make_row(name, official.get(name, "?"), tests) for name, tests in by_hole.items()]
    milestone = make_row("milestone", CHAPTER_TESTS, [t for t in run.tests if t.milestone])
    given = make_row("given", CHAPTER_TESTS, [t for t in run.tests if t.given])
    problems = [f"could not collect {e['nodeid'] or 'the tests'}: {e['message'].strip().splitlines()[-1]}"
                for e in run.collect_errors]
    if run.timed_out:
        problems.append(f"the test run was stopped after {timeout:.0f} s; tests it didn't reach count as failed")
    if not run.tests and not problems:
        problems.append("no test ran: " + (run.output.strip().splitlines() or ["(no output)"])[-1])
    expected = (checkout / "engine").resolve()
    if run.engine_file and not Path(run.engine_file).resolve().is_relative_to(expected):
        problems.append(f"the tests imported {run.engine_file}, not the checkout's engine/")
    return {
        "checkout": str(checkout),
        "commit": _commit(checkout),
        "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seconds": run.seconds,
        "holes": [asdict(r) for r in holes],
        "milestone": asdict(milestone),
        "given": asdict(given),
        "holes_passed": sum(r.status == PASS for r in holes),
        "holes_total": len(holes),
        "problems": problems,
    }


def _commit(checkout: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def format_report(doc: dict) -> str:
    rows = [("hole", "file", "tests", "status", "first failure (partial or fail)")]
    for r in [*doc["holes"], doc["milestone"], doc["given"]]:
        first = r["failures"][0] if r["failures"] and r["status"] in (PARTIAL, FAIL) else None
        note = f"{first['test']}: {first['message']}" if first else ""
        rows.append((r["name"], r["file"].removeprefix("engine/"), f"{r['passed']}/{r['total']}", r["status"],
                     note[:90]))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4] for row in rows]
    lines.insert(1, "-" * max(len(line) for line in lines[:1]))
    lines.insert(len(doc["holes"]) + 2, "")
    lines.append("")
    lines.append(f"{doc['holes_passed']}/{doc['holes_total']} holes pass; milestone {doc['milestone']['status']} "
                 f"({doc['milestone']['passed']}/{doc['milestone']['total']}); {doc['seconds']:.0f} s")
    lines += [f"problem: {p}" for p in doc["problems"]]
    return "\n".join(lines)


def grade_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.py grade", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", default=str(ROOT), help="the checkout to grade (default: this repository)")
    ap.add_argument("--json", dest="json_path", default=None,
                    help="where to write the JSON (default: grades/<checkout name>.json in this repository)")
    ap.add_argument("--per-test-timeout", type=float, default=120, help="seconds before one test counts as hung")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole test run")
    args = ap.parse_args(argv)
    checkout = Path(args.path).resolve()
    if not (checkout / CHAPTER_TESTS).is_file() or not (checkout / "engine").is_dir():
        print(f"{checkout} is not a checkout of this course: it has no {CHAPTER_TESTS} or engine/", file=sys.stderr)
        return 2
    print(f"grading {checkout} (chapter 31, --impl engine) ...", flush=True)
    doc = grade(checkout, args.per_test_timeout, args.timeout)
    print(format_report(doc))
    out = Path(args.json_path) if args.json_path else ROOT / "grades" / f"{checkout.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(grade_main())
