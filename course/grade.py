"""Grade checkouts hole by hole: ``python run.py grade [CHECKOUT ...] [--folder DIR]``.

Honest by construction: a checkout contributes ONLY its chapter files (engine/serve/batch.py,
attention.py, flat.py, blocks.py, scheduler.py, engine.py). They are copied into a workspace — a
temporary copy of THIS repository, the instructor's tests, conftest, tools and given code
(``course.testrun.workspace``) — and the tests run there under ``--impl engine``, whatever the
learner did to their own tests/. A test that runs longer than ``--per-test-timeout`` fails alone
(pytest-timeout); a test that kills the test process is counted failed and the rest run on.

What runs: the chapter's tests (each hole's own tests, the milestone) and the engine checks that
run the learner's engine alone (``ENGINE_CHECKS``: tenant isolation, state machines, recompute).
Score: each row is worth its weight in ``WEIGHTS`` times the fraction of its tests that passed;
the holes add up to 30 points, the milestone to 10, the engine checks to 10 (50 in all). A hole's
status is pass / partial / fail / not started (every test failed with that hole's
NotImplementedError, the skeleton as handed out).

Writes, per checkout, ``<out>/<name>/grade.json`` (everything) and ``<out>/<name>/results.json``
(Gradescope's format); for several checkouts also ``<out>/grades.csv`` with one line each, and
prints one table. An edit a learner made outside the holes is listed (the tests run it).
The exit status is 0 whenever grading itself worked, however many holes fail.
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course.holes import all_holes, outside_hole_edits
from course.testrun import (CHAPTER_TESTS, ROOT, TestRecord, TestRun, chapter_files, run_pytest, skeleton_files,
                            workspace)

PASS, PARTIAL, NOT_STARTED, FAIL, NO_TESTS = "pass", "partial", "not started", "fail", "no tests"
ENGINE_CHECKS = ("tests/test_isolation.py", "tests/test_reliability.py")
WEIGHTS = {"build_batch": 3, "write_kv": 1, "ReferenceBackend.forward": 2, "FlatModel.attention": 2,
           "FlatModel.forward": 1, "hash_block": 1, "BlockManager.find_cached_prefix": 2,
           "BlockManager.allocate_slots": 3, "BlockManager.cache_full_blocks": 2, "BlockManager.free": 2,
           "Scheduler.schedule": 4, "Scheduler._preempt": 2, "EngineCore.check_stop": 1, "EngineCore.step": 4,
           "milestone": 10, "engine checks": 10}


@dataclass
class Row:
    """One line of the grade: a hole (or the milestone, or the engine checks) and its tests."""

    name: str
    file: str
    passed: int
    total: int
    status: str
    weight: float = 0.0
    score: float = 0.0
    failures: list[dict] = field(default_factory=list)  # {"test", "outcome", "message"} per failed test


def status_of(name: str, tests: list[TestRecord]) -> str:
    if not tests:
        return NO_TESTS
    passed = sum(t.passed for t in tests)
    if passed == len(tests):
        return PASS
    if passed:
        return PARTIAL
    unfilled = all("NotImplementedError" in t.message and "is a hole" in t.message
                   and (name in ("milestone", "engine checks") or f"{name} is a hole" in t.message) for t in tests)
    return NOT_STARTED if unfilled else FAIL


def _first_line(t: TestRecord) -> str:
    line = t.message.splitlines()[0] if t.message else ""
    return line + " (an endless loop in your code?)" if "Timeout >" in line else line


def make_row(name: str, file: str, tests: list[TestRecord]) -> Row:
    failures = [{"test": t.name, "outcome": t.outcome, "message": _first_line(t)} for t in tests if not t.passed]
    weight = WEIGHTS.get(name, 1)
    passed = sum(t.passed for t in tests)
    score = round(weight * passed / len(tests), 2) if tests else 0.0
    return Row(name, file, passed, len(tests), status_of(name, tests), weight, score, failures)


def run_surviving_crashes(args: list[str], cwd: Path, per_test_timeout: float, timeout: float) -> TestRun:
    """Run the tests; if the test process dies mid-run (a crash, os._exit), count the test it was
    running as failed and run the rest again, up to ten times."""
    run = run_pytest(args, cwd=cwd, timeout=timeout, per_test_timeout=per_test_timeout)
    for _ in range(10):
        left = [t for t in run.tests if t.outcome == "not run"]
        if run.timed_out or not left or run.returncode in (0, 1):
            break
        left[0].outcome, left[0].message = "failed", f"the test process died during this test (exit {run.returncode})"
        rest = run_pytest(["-q", "--tb=line", "--impl", "engine", *[t.nodeid for t in left[1:]]], cwd=cwd,
                          timeout=timeout, per_test_timeout=per_test_timeout)
        done = {t.nodeid: t for t in rest.tests}
        run.tests = [done.get(t.nodeid, t) for t in run.tests]
        run.returncode, run.timed_out = rest.returncode, rest.timed_out
    return run


def grade(checkout: Path, per_test_timeout: float = 60, timeout: float = 1800, keyword: str = "") -> dict:
    """Grade one checkout's chapter files with this repository's tests (the JSON document);
    ``keyword`` (pytest ``-k``) grades only some tests (for trying the grader out)."""
    problems: list[str] = []
    files = {}
    for rel in chapter_files():
        path = checkout / "engine" / rel
        if path.is_file():
            files[rel] = path.read_text()
        else:
            problems.append(f"engine/{rel} is missing: graded as the skeleton")
            files[rel] = skeleton_files()[rel]
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        bed = workspace(Path(tmp) / "repo", files)
        edits = outside_hole_edits(bed / "engine", copy=lambda rel: (ROOT / "engine" / rel).read_text())
        select = ["-k", keyword] if keyword else []
        run = run_surviving_crashes(["-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS, *ENGINE_CHECKS, *select],
                                    bed, per_test_timeout, timeout)
        if run.engine_file and not Path(run.engine_file).resolve().is_relative_to((bed / "engine").resolve()):
            problems.append(f"the tests imported {run.engine_file}, not the graded engine/")
    chapter = [t for t in run.tests if t.nodeid.startswith(CHAPTER_TESTS)]
    by_hole: dict[str, list[TestRecord]] = {h.qualname: [] for h in all_holes()}
    for t in chapter:
        for name in t.holes:
            by_hole.setdefault(name, []).append(t)
    official = {h.qualname: h.file for h in all_holes()}
    holes = [make_row(name, official.get(name, "?"), tests) for name, tests in by_hole.items()]
    milestone = make_row("milestone", CHAPTER_TESTS, [t for t in chapter if t.milestone])
    checks = make_row("engine checks", " ".join(ENGINE_CHECKS), [t for t in run.tests if t not in chapter])
    problems += [f"could not collect {e['nodeid'] or 'the tests'}: {e['message'].strip().splitlines()[-1]}"
                 for e in run.collect_errors]
    if run.timed_out:
        problems.append(f"the test run was stopped after {timeout:.0f} s; tests it didn't reach count as failed")
    if not run.tests and not problems:
        problems.append("no test ran: " + (run.output.strip().splitlines() or ["(no output)"])[-1])
    rows = [*holes, milestone, checks]
    return {
        "checkout": str(checkout),
        "commit": _commit(checkout),
        "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seconds": run.seconds,
        "holes": [asdict(r) for r in holes],
        "milestone": asdict(milestone),
        "engine_checks": asdict(checks),
        "holes_passed": sum(r.status == PASS for r in holes),
        "holes_total": len(holes),
        "score": round(sum(r.score for r in rows), 2),
        "max_score": float(sum(r.weight for r in rows)),
        "edits_outside_holes": edits,
        "problems": problems,
    }


def _commit(checkout: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _rows(doc: dict) -> list[dict]:
    return [*doc["holes"], doc["milestone"], doc["engine_checks"]]


def gradescope(doc: dict) -> dict:
    """Gradescope's results.json: one entry per hole / milestone / engine checks."""
    tests = [{"name": r["name"], "score": r["score"], "max_score": r["weight"], "visibility": "visible",
              "output": f"{r['passed']}/{r['total']} tests passed ({r['status']})"
                        + "".join(f"\n- {f['test']}: {f['message']}" for f in r["failures"][:5])}
             for r in _rows(doc)]
    notes = [*(f"edit outside the holes: {e}" for e in doc["edits_outside_holes"]), *doc["problems"]]
    return {"score": doc["score"], "max_score": doc["max_score"], "tests": tests, "output": "\n".join(notes)}


def format_report(doc: dict) -> str:
    rows = [("hole", "file", "tests", "points", "status", "first failure (partial or fail)")]
    for r in _rows(doc):
        first = r["failures"][0] if r["failures"] and r["status"] in (PARTIAL, FAIL) else None
        note = f"{first['test']}: {first['message']}" if first else ""
        rows.append((r["name"], r["file"].removeprefix("engine/")[:40], f"{r['passed']}/{r['total']}",
                     f"{r['score']:g}/{r['weight']:g}", r["status"], note[:90]))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[5] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(doc["holes"]) + 2, "")
    lines.append("")
    lines.append(f"{doc['holes_passed']}/{doc['holes_total']} holes pass; milestone {doc['milestone']['status']}; "
                 f"score {doc['score']:g}/{doc['max_score']:g}; {doc['seconds']:.0f} s")
    lines += [f"edit outside the holes (the tests run it; no hole asks for it): {e}" for e in doc["edits_outside_holes"]]
    lines += [f"problem: {p}" for p in doc["problems"]]
    return "\n".join(lines)


def format_table(docs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per checkout: score, each hole's points, milestone, engine checks, edits, problems."""
    names = [r["name"] for r in _rows(docs[0])]
    header = ["checkout", "score", *names, "edits outside holes", "problems"]
    body = [[Path(d["checkout"]).name, f"{d['score']:g}/{d['max_score']:g}", *(f"{r['score']:g}" for r in _rows(d)),
             str(len(d["edits_outside_holes"])), "; ".join(d["problems"])[:80]] for d in docs]
    return header, body


def grade_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.py grade", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="checkouts to grade (default: this repository)")
    ap.add_argument("--folder", type=Path, default=None, help="grade every checkout (a folder with engine/) in it")
    ap.add_argument("--out", type=Path, default=ROOT / "grades", help="where to write (default: grades/)")
    ap.add_argument("--per-test-timeout", type=float, default=60, help="seconds before one test counts as hung")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for one checkout's whole test run")
    ap.add_argument("-k", dest="keyword", default="", help="grade only the tests matching this pytest -k expression")
    args = ap.parse_args(argv)
    paths = [Path(p).resolve() for p in args.paths]
    if args.folder:
        paths += sorted(p.resolve() for p in args.folder.iterdir() if (p / "engine").is_dir())
    paths = paths or [ROOT]
    bad = [p for p in paths if not (p / "engine").is_dir()]
    if bad:
        print(f"not a checkout of this course (no engine/): {', '.join(map(str, bad))}", file=sys.stderr)
        return 2
    docs = []
    for checkout in paths:
        print(f"grading {checkout} (its chapter files, this repository's tests) ...", flush=True)
        doc = grade(checkout, args.per_test_timeout, args.timeout, args.keyword)
        docs.append(doc)
        out = args.out / checkout.name
        out.mkdir(parents=True, exist_ok=True)
        (out / "grade.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "results.json").write_text(json.dumps(gradescope(doc), indent=1) + "\n")
        if len(paths) == 1:
            print(format_report(doc))
        print(f"wrote {out / 'grade.json'} and {out / 'results.json'}")
    if len(paths) > 1:
        header, body = format_table(docs)
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "grades.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *body])
        short = [h if len(h) <= 12 or "." not in h else
                 "".join(c for c in h.split(".")[0] if c.isupper()) + "." + h.split(".")[1][:10] for h in header]
        widths = [max(len(x) for x in col) for col in zip(short, *body)]
        for row in [short, *body]:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        print(f"wrote {args.out / 'grades.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(grade_main())
