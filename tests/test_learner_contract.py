"""The learner layer's contract: every line once, the one switch, and a learner's work never at risk.

Maintainer checks, on engine/ as it is — they run on the course's own files (a fresh clone, CI)
and stand aside on a learner's checkout (some hole filled), because there engine/ is the learner's
work. Under CI (``CI=true``, as .ci/run runs) a filled engine/ is an error instead.
(a) every hole in engine/ is a stub raising its NotImplementedError; solutions/ answers exactly
    the holes, each with the hole's parameters, and holds no class of its own;
(b) EngineCore and the chapter's files import nothing from backends/ or course/; engine/ never
    imports solutions/.
Checks that never depend on the learner's files (they use a workspace: a temporary copy of this
repository with chosen chapter files, ``course.learner.testrun.workspace``):
(d) on the course's stubs every hole's tests fail with THAT hole's NotImplementedError (no false
    pass on a fresh clone), every hole has tests, every test is of one hole, the milestone or given,
    and ``--hole NAME`` selects exactly that hole's tests;
(e) ``make solutions-branch``, ``git checkout solutions``: the chapter's tests pass with the
    default ``--impl``; ``make handout``: no answers, and its README's commands run;
(g) an edit outside the holes — a given line changed, or a module-level line appended — is
    reported, and the tests run it (one engine everywhere); a helper is not an edit;
(h) a learner file that does not import fails only its own holes' tests (and the milestone);
(i) holes written from their docstrings alone (tests/learner_fill.py) pass the chapter's tests and
    the engine checks: no test checks what no docstring says;
(j) grading uses the instructor's tests whatever the checkout's tests/ say, a hung hole costs
    only its own tests, and a file that does not import only its own holes.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course.learner.holes import all_holes, answers, edits_in, fill, outside_hole_edits, unfilled_holes
from course.learner.testrun import CHAPTER_TESTS, reference_files, run_pytest, skeleton_files, workspace
from engine._impl import CHAPTER_FILES, HOLE_MARKER, holes_of

ROOT = Path(__file__).resolve().parent.parent
SPOT_MILESTONE = "12-block pool, swap"  # the milestone config (e) runs: preemption and swap-in


def maintainer_check_applies() -> None:
    """Skip on a learner's checkout (fail under CI, where engine/ must be the course's own files)."""
    if len(unfilled_holes()) < len(all_holes()):
        reason = ("engine/ holds filled holes (a learner's checkout): this maintainer check compares "
                  "engine/ with the course's stubs, so it does not apply; nothing to do")
        if os.environ.get("CI"):
            pytest.fail("under CI engine/ must hold the course's stubs, but " + reason.split(":")[0], pytrace=False)
        pytest.skip(reason)


def _defs(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {(f"{n.name}." if c is not n else "") + f.name: f
            for n in tree.body for c, f in ([(n, n)] if isinstance(n, ast.FunctionDef) else
                                            [(None, m) for m in n.body if isinstance(m, ast.FunctionDef)]
                                            if isinstance(n, ast.ClassDef) else [])}


# ---------------------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("rel", CHAPTER_FILES)
def test_every_hole_is_a_stub_and_solutions_answers_exactly_the_holes(rel):
    maintainer_check_applies()
    text = (ROOT / "engine" / rel).read_text()
    holes, mine = holes_of(text), _defs(ast.parse(text))
    assert holes and not text.startswith("# GENERATED"), f"engine/{rel}: hand-kept, with holes"
    for q in holes:
        body = mine[q].body[1:]
        want = f'raise NotImplementedError("{q} is a hole: fill it in (Chapter 31, engine/{rel})")'
        assert len(body) == 1 and ast.unparse(body[0]) == ast.unparse(ast.parse(want).body[0]), \
            f"engine/{rel}: hole {q} must be only its docstring and `{want}`"
    ref_tree = ast.parse((ROOT / "solutions" / rel).read_text())
    ref = _defs(ref_tree)
    assert sorted(q for q in ref if "." in q or q in holes) == sorted(holes), \
        f"solutions/{rel} must answer exactly the holes {holes}, got {sorted(ref)}"
    for q in holes:
        args = lambda f: [a.arg for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs]  # noqa: E731
        assert args(ref[q]) == args(mine[q]), f"solutions/{rel}: {q} takes other parameters than the hole"
        assert ast.get_docstring(ref[q]) is None, f"solutions/{rel}: {q}'s contract is the hole's docstring only"
    classes = [n.name for n in ref_tree.body if isinstance(n, ast.ClassDef)]
    assert all(isinstance(m, ast.FunctionDef) and f"{c.name}.{m.name}" in holes
               for c in ref_tree.body if isinstance(c, ast.ClassDef) for m in c.body), \
        f"solutions/{rel}: classes {classes} hold the holes' answers and nothing else"


# ---------------------------------------------------------------------------------------- (b)
def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__"):
            found.append(node.args[0].value)
    return found


def test_engine_core_and_the_chapter_files_import_no_fast_path_and_no_course_tooling():
    offenders = [f"{d}/{rel} imports {name}" for d in ("engine", "solutions") for rel in CHAPTER_FILES
                 for name in _imports(ROOT / d / rel)
                 if name.startswith(("engine.fast", "course", "solutions"))]
    assert not offenders, "the chapter's files must name no fast path and no tooling: " + "; ".join(offenders)
    engine_py = (ROOT / "engine/serve/engine.py").read_text()
    assert "backends" not in engine_py and "fuse" not in engine_py, "EngineCore finds its flat model by name"


def test_engine_never_imports_solutions():
    offenders = [f"{p.relative_to(ROOT)} imports {n}" for p in sorted((ROOT / "engine").rglob("*.py"))
                 for n in _imports(p) if n == "solutions" or n.startswith("solutions.")]
    assert not offenders, "engine/ must not import the reference: " + "; ".join(offenders)


# ---------------------------------------------------------------------------------------- (d)
@pytest.fixture(scope="module")
def skeleton_run(tmp_path_factory):
    """The chapter's tests against a fresh skeleton (--impl engine), in a subprocess."""
    bed = workspace(tmp_path_factory.mktemp("skeleton") / "repo", skeleton_files())
    run = run_pytest(["-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS], cwd=bed)
    assert not run.collect_errors, f"collecting the chapter's tests failed: {run.collect_errors}"
    assert run.tests, f"no chapter test ran:\n{run.output}"
    return run


def test_every_chapter_test_is_of_one_hole_the_milestone_or_given(skeleton_run):
    holes = {h.qualname for h in all_holes()}
    for t in skeleton_run.tests:
        kinds = len(t.holes) + t.milestone + t.given
        assert kinds == 1, f"{t.name}: mark it with exactly one of hole(name), milestone, given (has {t.holes}, " \
                           f"milestone={t.milestone}, given={t.given})"
        assert set(t.holes) <= holes, f"{t.name}: hole marker {t.holes} names no hole; holes are {sorted(holes)}"
    tested = {name for t in skeleton_run.tests for name in t.holes}
    assert holes <= tested, f"holes without a single test: {sorted(holes - tested)}"
    assert any(t.milestone for t in skeleton_run.tests), "the milestone test is missing"


def test_hole_option_selects_exactly_that_holes_tests(skeleton_run):
    """``--hole free`` (the short name) runs the tests marked hole("BlockManager.free"), the whole
    ``tests`` folder through; an ambiguous or unknown name is a usage error listing the holes."""
    want = sorted(t.nodeid for t in skeleton_run.tests if "BlockManager.free" in t.holes)
    got = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "--impl", "solution", "tests", "--hole", "free"],
                         cwd=ROOT, capture_output=True, text=True)
    assert want and sorted(line for line in got.stdout.splitlines() if "::" in line) == want, got.stdout[-2000:]
    for name, why in (("forward", "is ambiguous (ReferenceBackend.forward or FlatModel.forward)"),
                      ("frees", "is not a hole of chapter 31")):
        bad = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", CHAPTER_TESTS, "--hole", name],
                             cwd=ROOT, capture_output=True, text=True)
        assert bad.returncode == pytest.ExitCode.USAGE_ERROR and f"--hole {name!r} {why}" in bad.stderr \
            and "BlockManager.allocate_slots, " in bad.stderr, bad.stderr[-2000:]


def test_skeleton_fails_every_hole_test_with_that_holes_NotImplementedError(skeleton_run):
    wrong = []
    for t in skeleton_run.tests:
        if t.given:
            if not t.passed:
                wrong.append(f"{t.name} tests given code, so it must pass on the skeleton: {t.outcome}: {t.message}")
            continue
        expected = f"{t.holes[0]} is a hole" if t.holes else "is a hole"
        if t.outcome != "failed" or "NotImplementedError" not in t.message or expected not in t.message:
            wrong.append(f"{t.name}: {t.outcome}: {t.message or '(no message)'} (expected NotImplementedError: "
                         f"'{expected}...')")
    assert not wrong, "on the skeleton every hole's tests must fail with that hole's NotImplementedError:\n" + \
                      "\n".join(wrong)


# ---------------------------------------------------------------------------------------- (e)
def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                         capture_output=True, text=True)
    assert out.returncode == 0, f"git {args}: {out.stderr}"
    return out.stdout


def test_solutions_branch_passes_with_the_default_impl_and_the_handout_has_no_answers(skeleton_run, tmp_path):
    repo = workspace(tmp_path / "repo", skeleton_files())
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "the course")
    tool = [sys.executable, "-m", "course.learner.editions"]
    made = subprocess.run([*tool, "solutions-branch"], cwd=repo, capture_output=True, text=True)
    assert made.returncode == 0 and "branch solutions" in made.stdout, made.stdout + made.stderr
    assert _git(repo, "status", "--porcelain") == "", "the working tree is not touched"
    _git(repo, "checkout", "-q", "solutions")
    first_of_each: dict[str, str] = {}
    for t in skeleton_run.tests:
        for name in t.holes:
            first_of_each.setdefault(name, t.nodeid)
    milestone = [t.nodeid for t in skeleton_run.tests if t.milestone and SPOT_MILESTONE in t.nodeid]
    given = [t.nodeid for t in skeleton_run.tests if t.given]
    selected = [*first_of_each.values(), *milestone, *given]
    assert milestone
    run = run_pytest(["-q", "--tb=short", *selected], cwd=repo)  # the default --impl: the branch's engine/
    failed = [f"{t.name}: {t.message}" for t in run.tests if not t.passed]
    assert len(run.tests) == len(selected) and not failed, \
        "on the solutions branch these failed with the default --impl:\n" + "\n".join(failed) + run.output[-3000:]
    assert "edit(s) OUTSIDE" not in run.output, run.output[-2000:]

    _git(repo, "checkout", "-q", "main")
    dest = tmp_path / "handout"
    out = subprocess.run([*tool, "handout", str(dest)], cwd=repo, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert not (dest / "solutions").exists() and not (dest / "tests/learner_fill.py").exists()
    assert not (dest / "course/quality/data").exists(), "the bug records quote the reference"
    # No file of the handout quotes the answers: the reference's longer lines (40+ characters, not a
    # comment or a bare return) occur at most twice in any file (given code shares a few such lines),
    # nor in any data file.
    answer_lines = {s for p in (repo / "solutions").rglob("*.py") for s in map(str.strip, p.read_text().splitlines())
                    if len(s) >= 40 and not s.startswith(("#", '"""', "def ", "return "))}
    quoting = {str(p.relative_to(dest)): n for p in dest.rglob("*") if p.suffix in (".py", ".toml")
               if (n := sum(line in p.read_text() for line in answer_lines)) > (2 if p.suffix == ".py" else 0)}
    assert not quoting, f"handout files that quote the reference (answer lines in each): {quoting}"
    readme = (dest / "README.md").read_text()
    commands = re.findall(r"^\$ (.+)$", readme, re.M)
    assert commands, "the handout README lists its commands as '$ command' lines"
    for command in commands:  # the README's python is .venv/bin/python: here, this interpreter
        cmd = command.replace(".venv/bin/python", sys.executable)
        got = subprocess.run(cmd, shell=True, cwd=dest, capture_output=True, text=True, timeout=600,
                             env={**{k: v for k, v in os.environ.items() if k != "ENGINE_IMPL"},
                                  "ENGINE_COURSE_COPY": str(dest)})  # the README's commands, as typed
        said = got.stdout + got.stderr
        assert got.returncode in (0, 1, 2) and "Traceback" not in said, f"{command}: exit {got.returncode}\n{said[-2000:]}"
        if "pytest" in command:
            assert "no solutions/ here" in said and "NotImplementedError" in said, said[-2000:]
        if "run.py core" in command:
            assert "Your engine is not finished yet" in said, said[-2000:]


# ---------------------------------------------------------------------------------------- (g)
EDIT_OUTSIDE = ("        owner = self.cached.pop(digest, None)\n", "        owner = self.cached.get(digest)\n")


def test_an_edit_outside_the_holes_is_reported_and_runs_everywhere(tmp_path):
    files = reference_files()
    assert files["serve/blocks.py"].count(EDIT_OUTSIDE[0]) == 1
    files["serve/blocks.py"] = files["serve/blocks.py"].replace(*EDIT_OUTSIDE)  # in BlockManager._forget_hash
    files["serve/batch.py"] += "\n\nimport math\n\n\ndef _my_helper():\n    return math.pi\n"  # allowed
    files["serve/flat.py"] += "\nprint('appended')\n"  # one line at the end of a chapter file
    bed = workspace(tmp_path / "repo", files)
    edits = outside_hole_edits(bed / "engine", copy=lambda rel: (ROOT / "engine" / rel).read_text())
    assert edits == ["engine/serve/flat.py: an added statement in module reaches outside the file "
                     f"(line {files['serve/flat.py'].count(chr(10))}): print('appended')",
                     "engine/serve/blocks.py: BlockManager._forget_hash (given code) differs from the chapter's"], edits
    run = run_pytest(["-q", "--impl", "engine", CHAPTER_TESTS, "-k", "evicts_the_old_hash"], cwd=bed)
    assert "edit(s) OUTSIDE the holes" in run.output and "BlockManager._forget_hash" in run.output \
        and "print('appended')" in run.output, run.output[-2000:]
    assert run.tests and not any(t.passed for t in run.tests), "the tests must run the learner's _forget_hash too"


@pytest.mark.parametrize("line", ["torch.manual_seed = lambda *a: None", "build_batch = print",
                                  "import course.grading.grade", "EXTRA = open('../solutions/serve/batch.py').read()",
                                  "Batch.num_sample_rows = 0"])
def test_an_added_line_that_reaches_out_is_an_edit(line):
    text = (ROOT / "engine/serve/batch.py").read_text()
    assert edits_in(text + "\n" + line + "\n", text, "serve/batch.py"), line
    assert edits_in(text + "\nMY_CONSTANT = 3\n\n\ndef _mine(x):\n    return x\n", text, "serve/batch.py") == []


def test_a_learner_without_the_references_imports_still_gets_the_reference_elsewhere(tmp_path):
    from learner_fill import indented

    files = reference_files()
    mine = fill(files["serve/blocks.py"], {"hash_block": indented("serve/blocks.py")["hash_block"]})
    for line in ("import sys\n", "from array import array\n"):  # the reference hash_block's: this one needs neither
        assert mine.count(line) == 1
        mine = mine.replace(line, "")
    files["serve/blocks.py"] = mine
    bed = workspace(tmp_path / "repo", files)
    run = run_pytest(["-q", "--impl", "engine", CHAPTER_TESTS, "-k", "find_cached_prefix or hash_block"], cwd=bed)
    failed = [f"{t.name}: {t.message}" for t in run.tests if not t.passed]
    assert run.tests and not failed, "the reference hash_block, swapped in for other holes' tests, must still " \
                                     "find the imports it uses:\n" + "\n".join(failed)


# ---------------------------------------------------------------------------------------- (h)
def test_a_learner_file_that_does_not_import_fails_only_its_own_holes(tmp_path):
    files = reference_files()
    files["serve/blocks.py"] = files["serve/blocks.py"].replace("        matched = 0\n",
                                                                "        matched = (\n", 1)
    bed = workspace(tmp_path / "repo", files)
    run = run_pytest(["-q", "--impl", "engine", CHAPTER_TESTS, "-k", "worked_example or find_cached or milestone"],
                     cwd=bed)
    by_kind = {t.name.split("[")[0]: t for t in run.tests}
    assert by_kind["test_build_batch_worked_example"].passed, run.output[-2000:]
    cached = [t for t in run.tests if "find_cached" in t.name]
    assert cached and all(not t.passed and "serve/blocks.py does not import" in t.message for t in cached), \
        [t.message for t in cached]
    assert all(not t.passed for t in run.tests if t.milestone)


# ---------------------------------------------------------------------------------------- (i)
def test_holes_written_from_their_docstrings_pass(tmp_path):
    from learner_fill import BODIES, indented

    files = reference_files()
    for rel in BODIES:
        files[rel] = fill(files[rel], indented(rel))
    bed = workspace(tmp_path / "repo", files)
    run = run_pytest(["-q", "--tb=short", "--impl", "engine", CHAPTER_TESTS, "tests/test_isolation.py"], cwd=bed,
                     per_test_timeout=120)
    failed = [f"{t.name}: {t.message}" for t in run.tests if not t.passed]
    assert run.tests and not failed, "holes filled from their docstrings alone fail:\n" + "\n".join(failed)


# ---------------------------------------------------------------------------------------- (j)
def test_grading_ignores_the_checkouts_tests_and_survives_a_hung_hole_and_a_broken_file(tmp_path):
    import shutil

    from course.grading.grade import Options, grade

    files = reference_files()
    body = "        p = request.params\n        num_output = request.num_output_tokens\n"
    assert files["serve/engine.py"].count(body) == 1
    files["serve/engine.py"] = files["serve/engine.py"].replace(body, "        while True:  # hangs\n            pass\n")
    files["serve/blocks.py"] = files["serve/blocks.py"].replace("        matched = 0\n", "        matched = (\n", 1)
    checkout = workspace(tmp_path / "learner", files)
    shutil.rmtree(checkout / "tests")
    (checkout / "tests").mkdir()
    (checkout / "tests" / "conftest.py").write_text("")
    (checkout / "tests" / "test_ch31_engine_v2.py").write_text("def test_everything():\n    assert True\n")
    doc = grade(checkout, opts=Options(per_test_timeout=5, per_scenario_timeout=5,
                                       keyword="check_stop or worked_example or hash_block", seed=1, scenario_size=1,
                                       only_groups=("build_batch", "EngineCore.check_stop", "hash_block")))
    rows = {r["name"]: r for r in doc["holes"]}
    stop = rows["EngineCore.check_stop"]
    assert stop["status"] == "fail" and "stopped after 5 s" in stop["failures"][0]["message"], stop
    assert rows["build_batch"]["status"] == "pass" and rows["build_batch"]["total"] >= 1, rows["build_batch"]
    # blocks.py does not parse: it is graded as the course's copy (its holes stubs, 0 points), listed as an edit
    assert rows["hash_block"]["status"] == "not started" and rows["hash_block"]["score"] == 0, rows["hash_block"]
    assert any("serve/blocks.py: does not parse" in e for e in doc["edits_outside_holes"]), doc["edits_outside_holes"]
    assert doc["score"] < doc["max_score"] and not doc["problems"], doc["problems"]
