"""The grading run against checkouts that try to break the grader itself (fast, crafted): one checkout
can fail only itself (an exception in the grader gives it an error row, every other grade and the CSV
are written), scratch folders of any depth are removed, files read back from a sandbox are never
followed through a symlink nor block on a named pipe, a hang at start-up costs one start-up limit per
run, what a learner sees is short and printable, bad arguments give one line, and the CSV says status,
seed, time and a hash of what was graded."""
from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import pytest

import course.grading.grade as g
from course.isolation import watchdog
from course.isolation.sandbox import Limits, read_capped, remove_tree

from test_grade_outputs import fake_doc


# --- scratch cleanup --------------------------------------------------------------------------------

def deep_chain(fd: int, depth: int = 1200) -> int:
    """``depth`` nested folders "d" under the folder open as ``fd`` (closed): the deepest, open.
    By file descriptors: deeper than Python's recursion limit, and than PATH_MAX as one path."""
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    return fd


def test_remove_tree_takes_a_1200_deep_folder_and_never_follows_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("the instructor's")
    # a tmpfs where there is one: ext4 here takes ~5 ms per rmdir under load (the grader's own 6 s)
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    top = Path(tempfile.mkdtemp(prefix="deep-", dir=base))
    fd = deep_chain(os.open(top, os.O_RDONLY))
    os.symlink(str(outside), "link", dir_fd=fd)
    os.mkfifo("pipe", dir_fd=fd)
    os.mkdir("locked", dir_fd=fd)
    os.chmod("locked", 0, dir_fd=fd)
    os.close(fd)
    remove_tree(top)
    assert not top.exists()
    assert (outside / "keep.txt").read_text() == "the instructor's"


# --- reading back what a sandbox wrote ----------------------------------------------------------------

def test_read_capped_refuses_a_pipe_and_a_symlink_and_caps_a_plain_file(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"tests": "the instructor's"}))
    (tmp_path / "link.json").symlink_to(secret)
    os.mkfifo(tmp_path / "pipe.json")
    (tmp_path / "big").write_bytes(b"x" * 5000)
    done = {}
    t = threading.Thread(target=lambda: done.update(pipe=read_capped(tmp_path / "pipe.json", 100),
                                                    link=read_capped(tmp_path / "link.json", 100)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "reading a named pipe blocked the grader"
    assert done == {"pipe": None, "link": None}
    assert read_capped(tmp_path / "big", 1000) == b"x" * 1000
    assert read_capped(tmp_path / "missing", 10) is None
    assert watchdog._read_json(tmp_path / "pipe.json") == {} and watchdog._lines(tmp_path / "link.json") == []


# --- the watchdog covers start-up ----------------------------------------------------------------------

def _bed(tmp_path: Path, conftest: str) -> Path:
    bed = tmp_path / "bed"
    plugin = bed / watchdog.PLUGIN_REL
    plugin.mkdir(parents=True)
    shutil.copy(Path(watchdog.__file__).resolve().parents[1] / "learner" / "pytest_plugins" / "ch31_report.py", plugin)
    (bed / "tests").mkdir()
    (bed / "tests" / "test_x.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    (bed / "conftest.py").write_text("def pytest_addoption(parser):\n    parser.addoption('--impl')\n" + conftest)
    return bed


IDS = ["tests/test_x.py::test_a", "tests/test_x.py::test_b"]


def test_a_sleep_at_import_costs_one_startup_limit_and_says_so(tmp_path):
    bed = _bed(tmp_path, "import time\ntime.sleep(120)\n")
    top = tmp_path / "top"
    top.mkdir()
    w = watchdog.run_tests(bed, top, None, IDS, {IDS[0]: "a", IDS[1]: "b"}, 300, 300, Limits(), 1, [], startup=2)
    assert w.runs == 1, "a second run would sleep again: one start-up limit per group"
    assert "start-up" in w.startup_hang and not w.killed and not w.records
    assert all("start-up" in w.skipped[n] for n in IDS)


def test_a_named_pipe_as_the_report_never_blocks_the_grader(tmp_path):
    bed = _bed(tmp_path, "import os\ndef pytest_unconfigure(config):\n"  # after the plugin's last write
                         "    p = config.getoption('--report-json')\n    os.remove(p)\n    os.mkfifo(p)\n")
    top = tmp_path / "top"
    top.mkdir()
    w = watchdog.run_tests(bed, top, None, IDS, {IDS[0]: "a", IDS[1]: "b"}, 300, 300, Limits(), 1, [], startup=60)
    assert not w.records  # nothing read through the pipe counts
    assert set(w.killed) | set(w.skipped) == set(IDS)


def test_a_sleep_at_import_of_the_scenario_child_costs_one_startup_limit(tmp_path):
    bed = tmp_path / "bed"
    (bed / "course" / "grading").mkdir(parents=True)
    (bed / "course" / "grading" / "scenarios.py").write_text(
        "import time\ntime.sleep(120)\ndef child_main(argv):\n    return 0\n")
    top = tmp_path / "top"
    top.mkdir()
    specs = [{"id": f"s{i}", "group": f"g{i}", "kind": "unit", "holes": []} for i in range(3)]
    w = watchdog.run_scenarios(bed, top, None, specs, 300, 300, Limits(), 1, (), startup=2)
    assert w.runs == 1 and "start-up" in w.startup_hang
    assert {s: r["error"] for s, r in w.records.items()} == {"s0": "hung", "s1": "hung", "s2": "hung"}


# --- one checkout can fail only itself ------------------------------------------------------------------

class FakeSession:
    def __init__(self, opts):
        self.opts, self.seed, self.bwrap = opts, 7, "bwrap"


def _class(tmp_path: Path, names: list[str]) -> Path:
    folder = tmp_path / "class"
    for n in names:
        (folder / n / "engine").mkdir(parents=True)
    return folder


def _csv(out: Path) -> dict[str, dict]:
    with open(out / "grades.csv", newline="") as f:
        return {r["id"]: r for r in csv.DictReader(f)}


def test_an_exception_grading_one_checkout_gives_it_an_error_row_and_the_rest_is_written(tmp_path, monkeypatch, capsys):
    folder = _class(tmp_path, ["alice", "deep", "zed"])

    def fake_grade(checkout, session, jobs=1):
        if checkout.name == "deep":
            raise RecursionError("maximum recursion depth exceeded")
        return fake_doc(checkout, 1.0)

    monkeypatch.setattr(g, "Session", FakeSession)
    monkeypatch.setattr(g, "grade", fake_grade)
    out = tmp_path / "grades"
    assert g.grade_main(["--folder", str(folder), "--out", str(out), "--jobs", "2"]) == 0
    rows = {r["checkout"].rsplit("/", 1)[-1]: r for r in _csv(out).values()}
    assert set(rows) == {"alice", "deep", "zed"}
    assert rows["deep"]["status"] == "error" and rows["deep"]["score"] == "0"
    assert "RecursionError" in rows["deep"]["problems"]
    assert rows["alice"]["status"] == rows["zed"]["status"] == "ok" and rows["alice"]["score"] == "50"
    for cid in _csv(out):
        results = json.loads((out / cid / "results.json").read_text())
        assert results["tests"] and json.loads((out / cid / "grade.json").read_text())["checkout"]
    assert "ERROR" in capsys.readouterr().out


def test_gradescope_writes_results_json_whatever_the_grader_raises(tmp_path, monkeypatch):
    from course.grading import gradescope

    (tmp_path / "submission" / "engine").mkdir(parents=True)
    monkeypatch.setenv("AUTOGRADER_ROOT", str(tmp_path))

    def boom(argv):
        raise MemoryError("the grader ran out")

    monkeypatch.setattr(g, "grade_main", boom)
    assert gradescope.run([]) == 0
    doc = json.loads((tmp_path / "results" / "results.json").read_text())
    gradescope.check_results(doc)
    assert doc["score"] == 0


# --- what a learner sees --------------------------------------------------------------------------------

def test_feedback_is_short_printable_and_carries_no_long_integers_or_paths():
    leak = int("7" * 1700)
    doc = fake_doc(Path("/x/alice"), 0.5)
    doc["holes"][0]["feedback"] = [f"build_batch: expected 3, got {leak}",
                                   "path /home/instructor/course/tests/secret_test.py was \x1b[2Kread"]
    doc["holes"][0]["failures"] = [{"test": "t\x1b]0;x\x07", "outcome": "failed", "message": "m" * 5000}]
    doc["problems"] = ["\x1b[1A\x1b[2K" * 50]
    res = g.gradescope(doc)
    visible = [t["output"] for t in res["tests"] if t["visibility"] == "visible"] + [res["output"]]
    lines = [ln for text in visible for ln in text.splitlines()]
    assert lines and all(len(ln) <= g.FEEDBACK_CAP and ln.isprintable() for ln in lines)
    text = "\n".join(visible)
    assert "7" * 13 not in text and "/home/instructor" not in text and "\x1b" not in text
    assert "secret_test.py" in text  # the file's own name is kept: the learner can still tell what failed
    assert g.clean("12345678901234") == "123456...(14 digits)"


def test_names_with_terminal_escapes_are_escaped_on_the_console_and_in_the_csv(tmp_path, monkeypatch, capsys):
    folder = _class(tmp_path, ["eve\x1b[2K\x1b[1A\r=cmd"])
    monkeypatch.setattr(g, "Session", FakeSession)
    monkeypatch.setattr(g, "grade", lambda checkout, session, jobs=1: fake_doc(checkout, 1.0))
    out = tmp_path / "grades"
    assert g.grade_main(["--folder", str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "\x1b" not in printed.out + printed.err and "\r" not in printed.out + printed.err
    raw = (out / "grades.csv").read_text()
    assert "\x1b" not in raw and "\r=" not in raw and "\\x1b[2K" in raw


# --- bad arguments ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing", "file", "empty"])
def test_a_bad_folder_is_one_line_and_never_grades_the_instructors_tree(tmp_path, monkeypatch, case):
    target = tmp_path / "x"
    if case == "file":
        target.write_text("not a folder")
    elif case == "empty":
        target.mkdir()

    def never(opts):
        raise AssertionError("a session started")

    monkeypatch.setattr(g, "Session", never)
    with pytest.raises(ValueError) as err:
        g.grade_main(["--folder", str(target), "--out", str(tmp_path / "out")])
    assert "--folder" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_run_py_says_a_bad_path_in_one_line(tmp_path):
    import subprocess

    root = Path(g.__file__).resolve().parents[2]
    got = subprocess.run([sys.executable, str(root / "run.py"), "grade", str(tmp_path / "nope"), "--unsafe"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert got.stderr.strip().count("\n") == 0 and "no engine/" in got.stderr


# --- the CSV an instructor can trust -----------------------------------------------------------------------

def test_the_csv_has_status_by_kind_seed_time_and_a_hash_of_the_graded_files(tmp_path, monkeypatch):
    folder = _class(tmp_path, ["copy", "contra", "honest"])
    flags = {"copy": ["2 hole(s) equal to the reference after normalisation: write_kv, free"],
             "contra": ["hash_block: the tests reported a pass, the verified scenarios disagree (0/2 matched)"],
             "honest": []}

    def fake_grade(checkout, session, jobs=1):
        doc = fake_doc(checkout, 1.0)
        doc.update(flags=list(flags[checkout.name]), graded_at="2026-12-04T01:00:00", seed=session.seed,
                   files_sha256=g.files_sha256({"a.py": checkout.name}))
        return doc

    monkeypatch.setattr(g, "Session", FakeSession)
    monkeypatch.setattr(g, "grade", fake_grade)
    out = tmp_path / "grades"
    assert g.grade_main(["--folder", str(folder), "--out", str(out)]) == 0
    rows = {r["checkout"].rsplit("/", 1)[-1]: r for r in _csv(out).values()}
    assert {n: r["status"] for n, r in rows.items()} == {"copy": "copy", "contra": "contradiction", "honest": "ok"}
    assert all(r["seed"] == "7" and r["graded_at"] == "2026-12-04T01:00:00" for r in rows.values())
    hashes = {r["files_sha256"] for r in rows.values()}
    assert len(hashes) == 3 and all(len(h) == 64 for h in hashes)
    assert rows["copy"]["flags"].startswith("copy: ")


def test_files_sha256_depends_on_every_name_and_text():
    base = g.files_sha256({"a.py": "x", "b.py": "y"})
    assert base == g.files_sha256({"b.py": "y", "a.py": "x"})
    assert len({base, g.files_sha256({"a.py": "x", "b.py": "z"}), g.files_sha256({"a.py": "xb.py", "": "y"}),
                g.files_sha256({"c.py": "x", "b.py": "y"})}) == 4


def test_a_chapter_file_not_a_plain_file_is_graded_as_the_skeleton_and_one_over_the_cap_is_an_error(tmp_path):
    from course.isolation.parsing import CheckoutError
    from course.learner.testrun import chapter_files, skeleton_files

    rels = sorted(chapter_files())
    (tmp_path / "engine").mkdir()
    big, pipe = tmp_path / "engine" / rels[0], tmp_path / "engine" / rels[1]
    big.parent.mkdir(parents=True, exist_ok=True)
    pipe.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(pipe)
    files, problems, _ = g.read_checkout(tmp_path)
    assert files[rels[1]] == skeleton_files()[rels[1]] and any(rels[1] in p for p in problems)
    big.write_text("x = [" + "1, " * (g.MAX_CHAPTER_FILE // 3 + 10) + "]\n")
    with pytest.raises(CheckoutError, match="MiB"):
        g.read_checkout(tmp_path)


# --- parsing happens in a limited child (course/isolation/parsing.py) --------------------------------------

def _hostile_class(tmp_path: Path) -> Path:
    """Four checkouts: a 20 MiB chapter file, a 600-term expression, a 3 GiB file outside the chapter
    files (read by the check for files changed outside them), and the course's own files."""
    from course.learner.testrun import skeleton_files

    folder = tmp_path / "class"
    sk = skeleton_files()
    rel = "serve/blocks.py"
    texts = {"huge": {rel: sk[rel] + "\nBIG = [" + "1, " * ((20 << 20) // 3) + "]\n"},
             "deep": {rel: sk[rel] + "\n\ndef _helper():\n    return " + "+".join(["1"] * 600) + "\n"},
             "fine": {}}
    for name, files in {**texts, "bigtest": {}}.items():
        for r, text in {**sk, **files}.items():
            (folder / name / "engine" / r).parent.mkdir(parents=True, exist_ok=True)
            (folder / name / "engine" / r).write_text(text)
    (folder / "bigtest" / "tests").mkdir()
    with open(folder / "bigtest" / "tests" / "conftest.py", "wb") as f:  # a course file, 3 GiB, sparse: no disk
        f.truncate(3 << 30)
    return folder


def test_a_20_mib_file_a_600_term_expression_and_a_3_gib_file_are_error_rows_and_the_rest_still_grade(tmp_path, monkeypatch):
    """The whole run (grade_main), the sandboxed runs replaced: the 20 MiB file, the expression too deep
    for the syntax tree and the 3 GiB file each give their own checkout an error row with a one-line reason, the
    grader's own peak memory grows by far less than 1 GiB (parsing is in the child), and the course's
    own files grade as usual."""
    import resource

    from course.isolation import watchdog as wd

    class Session(FakeSession):
        def __init__(self, opts):
            super().__init__(opts)
            self.specs, self.reference, self.tests, self.lock = [], {}, [], threading.Lock()

    def small_bed(top, files):
        for rel, text in files.items():
            (top / "repo" / "engine" / rel).parent.mkdir(parents=True, exist_ok=True)
            (top / "repo" / "engine" / rel).write_text(text)
        return top / "repo"

    folder = _hostile_class(tmp_path)
    monkeypatch.setattr(g, "Session", Session)
    monkeypatch.setattr(g, "place_chapter_files", small_bed)
    monkeypatch.setattr(wd, "run_tests", lambda *a, **k: wd.Watched())
    monkeypatch.setattr(wd, "run_scenarios", lambda *a, **k: wd.Watched())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    out = tmp_path / "grades"
    assert g.grade_main(["--folder", str(folder), "--out", str(out), "--unsafe"]) == 0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < (1 << 20), f"the grader's own peak memory grew by {grown >> 10} MiB"
    rows = {r["checkout"].rsplit("/", 1)[-1]: r for r in _csv(out).values()}
    assert rows["huge"]["status"] == "error" and "MiB" in rows["huge"]["problems"]
    assert rows["deep"]["status"] == "error" and "too deep" in rows["deep"]["problems"]
    assert rows["bigtest"]["status"] == "error" and "MemoryError" in rows["bigtest"]["problems"]
    assert "\n" not in rows["huge"]["problems"] + rows["deep"]["problems"] + rows["bigtest"]["problems"]
    assert rows["fine"]["status"] != "error" and rows["fine"]["score"] == "0"


def test_the_parsing_child_has_a_time_and_a_memory_limit():
    from course.isolation.parsing import CheckoutError, ParseLimits, analyse
    from course.learner.testrun import skeleton_files

    sk = skeleton_files()
    rel = "serve/blocks.py"
    files = {**sk, rel: sk[rel] + "\nBIG = [" + "1, " * 300_000 + "]\n"}  # 0.9 MB: a few hundred MB of tree
    with pytest.raises(CheckoutError, match="limit"):
        analyse(files, sk, limits=ParseLimits(seconds=0.5))
    with pytest.raises(CheckoutError, match="MemoryError|memory"):
        analyse(files, sk, limits=ParseLimits(memory_bytes=128 << 20, seconds=600, cpu_seconds=600))


def test_grade_after_a_startup_hang_gives_the_scenarios_a_short_start_and_removes_a_deep_scratch(tmp_path, monkeypatch):
    """grade() itself, the sandboxed runs replaced: the test run 'hangs at start-up' and leaves a
    1,200-deep folder in the scratch; the scenario run gets the short start-up limit, the hang is a
    problem in the grader's words, and the grader's temporary folder is gone."""
    from course.isolation import watchdog as wd

    seen, tops = {}, []

    def fake_tests(bed, top, *a, startup):
        tops.append(top)
        os.close(deep_chain(os.open(top, os.O_RDONLY)))
        return wd.Watched(startup_hang="the test session hung at start-up")

    def fake_scenarios(bed, top, *a, startup):
        seen["startup"] = startup
        return wd.Watched()

    def small_bed(top, files):  # the chapter files alone: the whole repository's copy takes seconds
        for rel, text in files.items():
            (top / "repo" / "engine" / rel).parent.mkdir(parents=True, exist_ok=True)
            (top / "repo" / "engine" / rel).write_text(text)
        return top / "repo"

    monkeypatch.setattr(g, "place_chapter_files", small_bed)
    monkeypatch.setattr(wd, "run_tests", fake_tests)
    monkeypatch.setattr(wd, "run_scenarios", fake_scenarios)
    session = FakeSession(g.Options(unsafe=True))
    session.specs, session.reference, session.tests = [], {}, []
    monkeypatch.setattr(tempfile, "tempdir", str(Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path))
    (tmp_path / "c" / "engine").mkdir(parents=True)
    doc = g.grade(tmp_path / "c", session)
    assert seen["startup"] == g.Options().startup_after_hang < g.Options().startup_timeout
    assert "the test session hung at start-up" in doc["problems"]
    assert tops and not tops[0].exists()
    assert len(doc["files_sha256"]) == 64


# --- the sandbox's view is an allow-list (course/isolation/allowlist.py) ----------------------------------

def test_the_grading_workspace_holds_only_the_allow_list_and_no_line_of_the_reference(tmp_path):
    """The workspace the sandbox sees (the grader's own ``place_chapter_files``), without a sandbox: no
    solutions/, .git or grades, no test file but the learner-facing ones, and no line of a reference
    body that given code does not also have (tests/test_sandbox.py walks it from inside a sandbox)."""
    from course.isolation.allowlist import ROOT as COURSE
    from course.learner.testrun import skeleton_files

    bed = g.place_chapter_files(tmp_path, skeleton_files())
    rels = sorted(p.relative_to(bed).as_posix() for p in bed.rglob("*") if p.is_file())
    assert not [r for r in rels if r.split("/", 1)[0] in ("solutions", ".git", "grades")], rels
    assert {r for r in rels if r.startswith("tests/")} == {
        "tests/conftest.py", "tests/ch31_helpers.py", "tests/test_ch31_engine_v2.py", "tests/test_isolation.py",
        "tests/test_reliability.py"}
    given = "\n".join(p.read_text() for p in [*(COURSE / "engine").rglob("*.py"), *(COURSE / "tests").glob("*.py")])
    needles = {line.strip() for p in (COURSE / "solutions").rglob("*.py") for line in p.read_text().splitlines()
               if len(line.strip()) >= 30 and not line.strip().startswith(("#", '"', "def ", "class "))}
    needles = {n for n in needles if n not in given}
    assert len(needles) > 50
    texts = {r: (bed / r).read_text(errors="replace") for r in rels}
    assert not [(r, n) for r, t in texts.items() for n in needles if n in t]


def test_the_checkout_walks_take_a_1200_deep_folder(tmp_path):
    """The copy check's walks of a checkout (symlinks, files changed outside the chapter) use an
    explicit stack: a 1,200-deep folder in the checkout is walked, not a RecursionError (issue 34)."""
    from course.copies import copycheck
    from course.isolation.sandbox import remove_tree

    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    top = Path(tempfile.mkdtemp(prefix="deep-checkout-", dir=base))
    try:
        (top / "engine").mkdir()
        (top / "engine" / "extra.py").write_text("x = 1\n")
        os.symlink("/etc", top / "engine" / "out")
        os.close(deep_chain(os.open(top / "engine", os.O_RDONLY)))
        assert copycheck.symlinks(top) == ["engine/out -> /etc (OUTSIDE the checkout)"]
        assert copycheck.changed_outside(top, []) == ["engine/extra.py (a file the course does not have)"]
    finally:
        remove_tree(top)
