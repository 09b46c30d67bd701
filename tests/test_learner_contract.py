"""The learner layer's contract: skeleton and reference stay in step, and the tests can grade.

(a) engine/ is exactly the skeleton tools/skeleton.py generates from solutions/;
(b) every signature in the reference is the same in the skeleton;
(c) engine/ never imports solutions/;
(d) on the skeleton as handed out, every hole's tests fail with THAT hole's NotImplementedError
    (no false pass on a fresh clone; it also shows the per-hole isolation at work), every hole has
    tests, and every chapter test is of one hole, the milestone, or given code;
(e) with every hole filled (the learner files pointed at solutions/), the tests pass through the
    same per-hole patching the learner's run uses;
plus an in-process check that the patching puts the learner's function everywhere it is bound
and takes it away again.
On the `solutions` branch (engine/ filled in, marker file .solutions-branch) (a) and (d) do not
apply and are skipped with that reason.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from learner_holes import LearnerHoles, all_holes
from tools.skeleton import HOLE_MARKER, skeleton_of, solution_files
from tools.testrun import CHAPTER_TESTS, run_pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
ON_SOLUTIONS_BRANCH = (ROOT / ".solutions-branch").exists()
SOLUTIONS_BRANCH_REASON = ("this is the `solutions` branch (.solutions-branch): engine/ holds the reference, "
                           "so the skeleton checks do not apply")
SPOT_MILESTONE = "12-block pool, swap"  # the milestone config (e) runs: preemption and swap-in


def rel_files() -> list[str]:
    return [p.relative_to(SOLUTIONS).as_posix() for p in solution_files()]


# ---------------------------------------------------------------------------------------- (a)
def test_skeleton_is_exactly_what_the_generator_makes():
    if ON_SOLUTIONS_BRANCH:
        pytest.skip(SOLUTIONS_BRANCH_REASON)
    from tools.skeleton import generate

    stale = generate(check=True)
    assert stale == [], f"{stale} differ from the skeleton generated from solutions/: run `make skeleton`"


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
    ref = signatures(ast.parse((SOLUTIONS / rel).read_text()))
    mine = signatures(ast.parse((ROOT / "engine" / rel).read_text()))
    missing = sorted(set(ref) - set(mine))
    assert not missing, f"engine/{rel} lacks {missing}, which the reference defines"
    changed = {name: (mine[name], ref[name]) for name in ref if mine[name] != ref[name]}
    assert not changed, f"engine/{rel}: signatures differ from the reference (engine, reference): {changed}"
    extra_public = sorted(n for n in set(mine) - set(ref) if not n.split(".")[-1].startswith("_"))
    assert not extra_public, f"engine/{rel} defines public names the reference lacks: {extra_public} " \
                             "(helpers are fine, but give them a leading underscore)"


# ---------------------------------------------------------------------------------------- (c)
def test_engine_never_imports_solutions():
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
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
def skeleton_run():
    """The chapter's tests against this checkout's engine/ (--impl engine), in a subprocess."""
    run = run_pytest(["-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS])
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


def test_skeleton_fails_every_hole_test_with_that_holes_NotImplementedError(skeleton_run):
    if ON_SOLUTIONS_BRANCH:
        pytest.skip(SOLUTIONS_BRANCH_REASON)
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
def test_all_holes_filled_pass_through_the_per_hole_patching(skeleton_run):
    first_of_each: dict[str, str] = {}
    for t in skeleton_run.tests:
        for name in t.holes:
            first_of_each.setdefault(name, t.nodeid)
    milestone = [t.nodeid for t in skeleton_run.tests if t.milestone and SPOT_MILESTONE in t.nodeid]
    given = [t.nodeid for t in skeleton_run.tests if t.given]
    assert milestone, f"no milestone test named {SPOT_MILESTONE!r}"
    selected = [*first_of_each.values(), *milestone, *given]
    run = run_pytest(["-q", "--tb=short", "--impl", "engine", *selected],
                     env={"ENGINE_LEARNER_DIR": str(SOLUTIONS)})
    failed = [f"{t.name}: {t.message}" for t in run.tests if not t.passed]
    assert len(run.tests) == len(selected) and not failed, \
        "with every hole filled from solutions/ these failed under --impl engine:\n" + "\n".join(failed) + \
        f"\n{run.output[-3000:]}"


# ------------------------------------------------------------------ the patching, in process
def test_patching_binds_the_learners_hole_everywhere_and_restores(tmp_path):
    for rel in rel_files():  # a fresh skeleton, whatever branch this is, plus one learner helper
        text = skeleton_of((SOLUTIONS / rel).read_text(), rel)
        if rel == "serve/blocks.py":
            text = text.replace("class BlockManager:", "def _learner_helper():\n    return 'helper'\n\n\n"
                                "class BlockManager:\n    def _learner_method(self):\n"
                                "        return _learner_helper()\n", 1)
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    serve = importlib.import_module("engine.serve")
    batch_mod, runner_mod, blocks_mod = (importlib.import_module(f"engine.serve.{m}") for m in ("batch", "runner", "blocks"))
    ref_build, ref_alloc = serve.build_batch, serve.BlockManager.allocate_slots
    isolation = LearnerHoles(tmp_path)
    isolation.patch(["build_batch", "BlockManager.allocate_slots"])
    try:
        for where in (serve, batch_mod, runner_mod):
            assert where.build_batch is not ref_build, f"{where.__name__}.build_batch was not patched"
        with pytest.raises(NotImplementedError, match="build_batch is a hole"):
            runner_mod.build_batch([], [], 16)
        bm = serve.BlockManager(4, 4)
        with pytest.raises(NotImplementedError, match="allocate_slots is a hole"):
            bm.allocate_slots(None, 1)
        assert bm._learner_method() == "helper", "a learner's helper method and function must come along"
        assert bm.update_hashes.__func__ is blocks_mod.BlockManager.__dict__["update_hashes"], "non-holes stay"
        assert HOLE_MARKER in serve.BlockManager.allocate_slots.__doc__
    finally:
        isolation.restore()
    assert serve.build_batch is ref_build and batch_mod.build_batch is ref_build and runner_mod.build_batch is ref_build
    assert serve.BlockManager.allocate_slots is ref_alloc
    assert not hasattr(serve.BlockManager, "_learner_method") and not hasattr(blocks_mod, "_learner_helper")
