"""The learner layer's contract: skeleton and reference stay in step, the tests can grade, and a
learner's work is never at risk.

Maintainer checks, on engine/ as it is — they run on a pristine skeleton (a fresh clone, CI) and
stand aside on a learner's checkout (some hole filled or helper added), because there engine/ is
the learner's work, not the skeleton. Under CI (``CI=true``, as .ci/run runs) a non-pristine
engine/ is an error instead.
(a) engine/ is exactly the skeleton course/skeleton.py generates from solutions/;
(b) every signature in the reference is the same in engine/.
Checks that never depend on the learner's files (they use a workspace: a temporary copy of this
repository with chosen chapter files, ``course.testrun.workspace``):
(c) engine/ never imports solutions/;
(d) on the fresh skeleton every hole's tests fail with THAT hole's NotImplementedError (no false
    pass on a fresh clone), every hole has tests, every test is of one hole, the milestone or given,
    and ``--hole NAME`` selects exactly that hole's tests;
(e) with every hole filled with the reference, the tests pass the learner's way (--impl engine);
(f) ``make skeleton`` keeps a file with filled holes or helpers (or, forced, backs it up first);
(g) an edit outside the holes is reported, and the tests run it (one engine everywhere);
(h) a learner file that does not import fails only its own holes' tests (and the milestone);
(j) grading uses the instructor's tests whatever the checkout's tests/ say, and a hung hole costs
    only its own tests;
(i) holes written from their docstrings alone (tests/learner_fill.py) pass the chapter's tests and
    the engine checks: no test checks what no docstring says.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from learner_holes import all_holes, skeleton_tool
from course.testrun import CHAPTER_TESTS, reference_files, run_pytest, skeleton_files, workspace

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
SPOT_MILESTONE = "12-block pool, swap"  # the milestone config (e) runs: preemption and swap-in


def rel_files() -> list[str]:
    return [p.relative_to(SOLUTIONS).as_posix() for p in skeleton_tool().solution_files()]


def maintainer_check_applies() -> None:
    """Skip on a learner's checkout (fail under CI, where engine/ must be the pristine skeleton)."""
    if skeleton_tool().is_learner_checkout():
        reason = ("engine/ holds filled holes or helpers (a learner's checkout): this maintainer check "
                  "compares engine/ with the skeleton, so it does not apply; nothing to do")
        if os.environ.get("CI"):
            pytest.fail("under CI engine/ must be the pristine skeleton, but " + reason.split(":")[0], pytrace=False)
        pytest.skip(reason)


# ---------------------------------------------------------------------------------------- (a)
def test_skeleton_is_exactly_what_the_generator_makes():
    maintainer_check_applies()
    stale = skeleton_tool().generate(check=True)
    assert stale == [], f"{stale} differ from the skeleton generated from solutions/ (maintainers: run `make skeleton`)"


# ---------------------------------------------------------------------------------------- (b)
def signatures(tree: ast.Module) -> dict[str, str]:
    """'Class.method' / 'function' / 'Class' -> its decorators, arguments and return annotation."""
    found: dict[str, str] = {}

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = " ".join("@" + ast.unparse(d) for d in node.decorator_list)
                returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
                found[prefix + node.name] = f"{decorators} def({ast.unparse(node.args)}){returns}".strip()
            elif isinstance(node, ast.ClassDef):
                decorators = " ".join("@" + ast.unparse(d) for d in node.decorator_list)
                found[prefix + node.name] = f"{decorators} class({', '.join(map(ast.unparse, node.bases))})".strip()
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return found


@pytest.mark.parametrize("rel", rel_files())
def test_skeleton_and_reference_have_the_same_signatures(rel):
    maintainer_check_applies()
    ref = signatures(ast.parse((SOLUTIONS / rel).read_text()))
    mine = signatures(ast.parse((ROOT / "engine" / rel).read_text()))
    changed = {name: (mine.get(name), ref[name]) for name in ref if mine.get(name) != ref[name]}
    assert not changed, f"engine/{rel}: signatures differ from the reference (engine, reference): {changed}"
    extra = sorted(set(mine) - set(ref))
    assert not extra, f"engine/{rel} defines names the reference lacks: {extra}"


# ---------------------------------------------------------------------------------------- (c)
def test_engine_never_imports_solutions():
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue  # a file being edited; the tests of its holes say so
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str) \
                    and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__"):
                names = [node.args[0].value]
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                          if n == "solutions" or n.startswith("solutions.")]
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
def test_all_holes_filled_pass_the_learners_way(skeleton_run, tmp_path):
    first_of_each: dict[str, str] = {}
    for t in skeleton_run.tests:
        for name in t.holes:
            first_of_each.setdefault(name, t.nodeid)
    milestone = [t.nodeid for t in skeleton_run.tests if t.milestone and SPOT_MILESTONE in t.nodeid]
    given = [t.nodeid for t in skeleton_run.tests if t.given]
    assert milestone, f"no milestone test named {SPOT_MILESTONE!r}"
    selected = [*first_of_each.values(), *milestone, *given]
    bed = workspace(tmp_path / "repo", reference_files())
    run = run_pytest(["-q", "--tb=short", "--impl", "engine", *selected], cwd=bed)
    failed = [f"{t.name}: {t.message}" for t in run.tests if not t.passed]
    assert len(run.tests) == len(selected) and not failed, \
        "with every hole filled from solutions/ these failed under --impl engine:\n" + "\n".join(failed) + \
        f"\n{run.output[-3000:]}"


# ---------------------------------------------------------------------------------------- (f)
def test_make_skeleton_never_overwrites_a_learners_work(tmp_path):
    tool = skeleton_tool()
    engine = tmp_path / "engine"
    files = skeleton_files()
    files["serve/blocks.py"] = reference_files()["serve/blocks.py"]  # every hole of this file filled
    files["serve/batch.py"] += "\n\ndef _my_helper():\n    return 1\n"  # a helper, no hole filled yet
    files["serve/flat.py"] = files["serve/flat.py"].replace("#", "# stale comment,", 1)  # an old skeleton
    for rel, text in files.items():
        (engine / rel).parent.mkdir(parents=True, exist_ok=True)
        (engine / rel).write_text(text)
    said: list[str] = []
    tool.generate(engine_dir=engine, say=said.append)
    assert (engine / "serve/blocks.py").read_text() == files["serve/blocks.py"], "a filled file was overwritten"
    assert (engine / "serve/batch.py").read_text() == files["serve/batch.py"], "a learner's helper was overwritten"
    assert (engine / "serve/flat.py").read_text() == skeleton_files()["serve/flat.py"], "a stale skeleton is regenerated"
    kept = [s for s in said if s.startswith("kept")]
    assert len(kept) == 2 and "filled" in kept[0] + kept[1] and "helper _my_helper" in "".join(kept), said
    said.clear()
    tool.generate(engine_dir=engine, force=True, say=said.append)
    backups = sorted((tmp_path / tool.BACKUP_DIR).rglob("*.py"))
    assert [b.name for b in backups] == ["batch.py", "blocks.py"], "--force backs the learner's files up first"
    assert backups[1].read_text() == files["serve/blocks.py"] and any(str(backups[1]) in s for s in said), said


# ---------------------------------------------------------------------------------------- (g)
EDIT_OUTSIDE = ("            del self.cached[h]\n", "            pass  # keeps the stale hash entry\n")


def test_an_edit_outside_the_holes_is_reported_and_runs_everywhere(tmp_path):
    files = reference_files()
    assert files["serve/blocks.py"].count(EDIT_OUTSIDE[0]) == 1
    files["serve/blocks.py"] = files["serve/blocks.py"].replace(*EDIT_OUTSIDE)  # in BlockManager._forget_hash
    files["serve/batch.py"] += "\n\nimport math\n\n\ndef _my_helper():\n    return math.pi\n"  # allowed
    bed = workspace(tmp_path / "repo", files)
    edits = skeleton_tool().outside_hole_edits(bed / "engine")
    assert edits == ["engine/serve/blocks.py: BlockManager._forget_hash (given code) differs from the chapter's"], edits
    run = run_pytest(["-q", "--impl", "engine", CHAPTER_TESTS, "-k", "evicts_the_old_hash"], cwd=bed)
    assert "edit(s) OUTSIDE the holes" in run.output and "BlockManager._forget_hash" in run.output, run.output[-2000:]
    assert run.tests and not any(t.passed for t in run.tests), "the tests must run the learner's _forget_hash too"


def test_a_learner_who_drops_an_unused_import_still_gets_the_reference_elsewhere(tmp_path):
    from learner_fill import BODIES

    files = reference_files()
    mine = skeleton_tool().replace_bodies(files["serve/blocks.py"], "serve/blocks.py",
                                          {"hash_block": BODIES["serve/blocks.py"]["hash_block"]})
    for line in ("import sys\n", "from array import array\n"):  # unused by this hash_block: an editor drops them
        assert mine.count(line) == 1
        mine = mine.replace(line, "")
    files["serve/blocks.py"] = mine
    bed = workspace(tmp_path / "repo", files)
    assert skeleton_tool().outside_hole_edits(bed / "engine") == []
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
    from learner_fill import BODIES

    tool = skeleton_tool()
    files = reference_files()
    for rel, bodies in BODIES.items():
        files[rel] = tool.replace_bodies(files[rel], rel, bodies)
    bed = workspace(tmp_path / "repo", files)
    run = run_pytest(["-q", "--tb=short", "--impl", "engine", CHAPTER_TESTS, "tests/test_isolation.py"], cwd=bed,
                     per_test_timeout=120)
    failed = [f"{t.name}: {t.message}" for t in run.tests if not t.passed]
    assert run.tests and not failed, "holes filled from their docstrings alone fail:\n" + "\n".join(failed)


# ---------------------------------------------------------------------------------------- (j)
def test_grading_ignores_the_checkouts_tests_and_survives_a_hung_hole(tmp_path):
    import shutil

    from course.grade import Options, grade

    files = reference_files()
    body = "        p = request.params\n        num_output = request.num_output_tokens\n"
    assert files["serve/engine.py"].count(body) == 1
    files["serve/engine.py"] = files["serve/engine.py"].replace(body, "        while True:  # hangs\n            pass\n")
    checkout = workspace(tmp_path / "learner", files)
    shutil.rmtree(checkout / "tests")
    (checkout / "tests").mkdir()
    (checkout / "tests" / "conftest.py").write_text("")
    (checkout / "tests" / "test_ch31_engine_v2.py").write_text("def test_everything():\n    assert True\n")
    doc = grade(checkout, opts=Options(per_test_timeout=5, per_scenario_timeout=5, keyword="check_stop or worked_example",
                                       seed=1, scenario_size=1, only_groups=("build_batch", "EngineCore.check_stop")))
    rows = {r["name"]: r for r in doc["holes"]}
    stop = rows["EngineCore.check_stop"]
    assert stop["status"] == "fail" and "stopped after 5 s" in stop["failures"][0]["message"], stop
    assert rows["build_batch"]["status"] == "pass" and rows["build_batch"]["total"] >= 1, rows["build_batch"]
    assert doc["score"] < doc["max_score"] and not doc["problems"], doc["problems"]
