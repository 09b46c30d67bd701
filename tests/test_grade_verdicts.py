"""Points from the grader's own verdicts, and the graded module the grader assembles (issue 34, items 1-2).

Fast: crafted chapter files and hand-made verdicts, no sandbox. ``assemble`` (course/learner/holes.py)
builds the module that is graded: the course's copy of each chapter file with the learner's hole bodies
and inert new definitions put in; ``apply_verdict`` (course/grading/grade.py) scores a row from the
scenarios alone (tests can only lower it); ``copied_holes`` (course/copies/copycheck.py) ignores no-ops.
"""
from __future__ import annotations

import ast

import pytest

from course.copies.copycheck import copied_holes
from course.grading.grade import WEIGHTS, Row, apply_verdict
from course.grading.scenarios import make_scenarios
from course.grading.verify import verdicts
from course.learner.holes import _defs, all_holes, assemble, assemble_files, edits_in, stub_holes
from course.learner.testrun import reference_files, skeleton_files

SKELETON = skeleton_files()
REFERENCE = reference_files()
BATCH = SKELETON["serve/batch.py"]


def _same_tree(a: str, b: str) -> bool:
    return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))


# ------------------------------------------------------------------------ the graded module
def test_the_reference_assembles_to_itself_and_the_skeleton_to_the_skeleton():
    graded, edits = assemble_files(REFERENCE, SKELETON)
    assert edits == [] and all(_same_tree(graded[rel], REFERENCE[rel]) for rel in SKELETON)
    graded, edits = assemble_files(SKELETON, SKELETON)
    assert edits == [] and all(_same_tree(graded[rel], SKELETON[rel]) for rel in SKELETON)


HOSTILE = {
    "decorator": "@(lambda f: (f(), f)[1])\ndef _helper():\n    open('/tmp/x', 'w')\n",
    "default": "def _helper(x=open('/tmp/x', 'w')):\n    return x\n",
    "statement": "import os\nos.environ['ENGINE_IMPL'] = 'solution'\n",
    "call": "print('at import')\n",
    "computed constant": "BLOB = bytes.fromhex('00ff')\n",
    "class body": "class _Mine:\n    X = print('at import')\n    def ok(self):\n        return 1\n",
    "metaclass": "class _Mine(metaclass=type):\n    pass\n",
    "computed base": "class _Mine(type('B', (), {})):\n    pass\n",
    "subclass hook": "class _Base:\n    def __init_subclass__(cls):\n        print('hook')\n",
    "rebinding": "def PAD_SLOT():\n    return print('x')\n",
    "course import": "import course.grading.grade\n",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_code_that_would_run_at_import_is_listed_and_left_out(kind):
    added = HOSTILE[kind]
    graded, edits = assemble(BATCH + "\n\n" + added, BATCH, "serve/batch.py")
    assert edits and all("serve/batch.py" in e for e in edits), (kind, edits)
    for bad in ("open(", "print(", "ENGINE_IMPL", "fromhex", "metaclass", "type('B'", "course.grading"):
        assert bad not in graded or bad in BATCH, (kind, bad)
    if kind not in ("class body", "subclass hook", "statement"):  # those keep their inert rest
        assert _same_tree(graded, BATCH), kind


def test_the_local_edit_list_names_a_decorated_or_defaulted_new_helper():
    for kind in ("decorator", "default", "metaclass", "subclass hook"):
        assert edits_in(BATCH + "\n\n" + HOSTILE[kind], BATCH, "serve/batch.py"), kind


def test_the_learners_own_definitions_and_imports_are_put_in():
    mine = REFERENCE["serve/blocks.py"]
    extra = ("\n\nimport math\n\nSCALE = (1, -2.5, 'x')\n\n\ndef _my_helper(n: int = 3, *, k=None) -> float:\n"
             "    return math.pi * n\n\n\nclass _Mine:\n    LIMIT = 4\n\n    @staticmethod\n    def twice(x):\n"
             "        return 2 * x\n")
    mine = mine.replace("    def check_invariants(self)", "    def _my_method(self, n=2):\n        return n\n\n"
                        "    def check_invariants(self)", 1) + extra
    graded, edits = assemble(mine, SKELETON["serve/blocks.py"], "serve/blocks.py")
    assert edits == [], edits
    defs = _defs(ast.parse(graded))
    assert {"_my_helper", "_Mine", "_Mine.twice", "BlockManager._my_method"} <= set(defs)
    space: dict = {}
    exec(compile(graded, "blocks.py", "exec"), space)  # the assembled module imports and works
    assert space["_my_helper"](2) == pytest.approx(2 * 3.141592653589793) and space["_Mine"].twice(3) == 6
    assert space["SCALE"] == (1, -2.5, "x") and space["BlockManager"](4, 2)._my_method() == 2


def test_a_hole_keeps_the_courses_signature_and_given_code_is_the_courses():
    text = REFERENCE["serve/batch.py"]
    assert text.count("\ndef build_batch(") == 1
    changed = text.replace("\ndef build_batch(", "\n@print\ndef build_batch(")
    graded, edits = assemble(changed, BATCH, "serve/batch.py")
    assert any("signature of hole build_batch" in e for e in edits) and "@print" not in graded, edits
    assert _same_tree(graded, text)


def test_a_file_that_does_not_parse_is_graded_as_the_courses_copy():
    graded, edits = assemble(BATCH + "\ndef (:\n", BATCH, "serve/batch.py")
    assert graded == BATCH and edits and "does not parse" in edits[0]


def test_stub_holes_are_the_skeletons_and_none_of_the_references():
    assert stub_holes(SKELETON) == {h.qualname for h in all_holes()}
    assert stub_holes(REFERENCE) == set()
    one = dict(REFERENCE, **{"serve/blocks.py": SKELETON["serve/blocks.py"]})
    assert stub_holes(one) == {h.qualname for h in all_holes() if h.file == "engine/serve/blocks.py"}


# ------------------------------------------------------------------------ points from verdicts
def test_every_row_has_scenarios_in_a_full_run():
    covered = {h for s in make_scenarios(7, 1) for h in s["holes"]}
    assert covered >= set(WEIGHTS) and set(WEIGHTS) == {h.qualname for h in all_holes()} | {"milestone", "engine checks"}


def _rows(passed_all_but_one: bool) -> dict[str, Row]:
    return {name: Row(name, "", 9 if passed_all_but_one and name in ("build_batch", "hash_block") else 10, 10,
                      "pass", w, round(w * (0.9 if passed_all_but_one and name in ("build_batch", "hash_block") else 1), 2))
            for name, w in WEIGHTS.items()}


def test_a_forged_report_over_failing_scenarios_earns_nothing():
    """The attack: every scenario fails, the report claims every test but one per independent hole passed
    (so no row is 'contradicted' by a full claimed pass there). Today's 32/50 becomes 0."""
    specs = make_scenarios(11, 1)
    reference = {s["id"]: {"result": {"x": 1}} for s in specs}
    learner = {s["id"]: {"error": "NotImplementedError"} for s in specs}
    checked = verdicts(specs, reference, learner)
    for stub in (True, False):  # whether or not the holes are still stubs
        rows, flags = _rows(True), []
        for row in rows.values():
            apply_verdict(row, checked.get(row.name), flags, set(), stub=stub and row.name not in
                          ("milestone", "engine checks"))
        assert sum(r.score for r in rows.values()) == 0, {n: r.score for n, r in rows.items() if r.score}


def test_a_stub_scores_zero_whatever_the_scenarios_say():
    row = Row("hash_block", "", 5, 5, "pass", 1, 1.0)
    apply_verdict(row, {"verified": "ok", "matched": 3, "total": 3, "messages": [], "unverified_because": []},
                  [], stub=True)
    assert row.score == 0 and row.status == "not started"


def test_points_need_the_graders_scenarios_and_tests_only_lower_them():
    ok = {"verified": "ok", "matched": 4, "total": 4, "messages": [], "unverified_because": []}
    none = Row("write_kv", "", 3, 3, "pass", 1, 1.0)
    apply_verdict(none, None, [])
    assert none.score == 0
    lower = Row("Scheduler.schedule", "", 2, 4, "partial", 4, 2.0)
    apply_verdict(lower, ok, [])
    assert lower.score == 2.0
    full, flags = Row("Scheduler.schedule", "", 4, 4, "pass", 4, 4.0), []
    apply_verdict(full, ok, flags)
    assert full.score == 4.0 and not flags
    half, flags = Row("Scheduler.schedule", "", 4, 4, "pass", 4, 4.0), []
    apply_verdict(half, {**ok, "verified": "fail", "matched": 2, "messages": ["m"]}, flags)
    assert half.score == 2.0 and half.status == "flagged" and flags


# ------------------------------------------------------------------------ copies
def test_the_reference_with_no_op_lines_is_a_copy():
    assert len(copied_holes(REFERENCE)) == len(all_holes())
    padded = {}
    for rel, text in REFERENCE.items():
        tree, lines = ast.parse(text), text.splitlines(keepends=True)
        at = []
        for h in all_holes():
            if h.file == f"engine/{rel}":
                first = _defs(tree)[h.qualname].body[1]  # the statement after the docstring
                pad = " " * first.col_offset
                at.append((first.lineno - 1, f"{pad}_ = None\n{pad}pass\n{pad}12345\n{pad}unused_name = 'x'\n"))
        for i, junk in sorted(at, reverse=True):
            lines[i:i] = [junk]
        padded[rel] = "".join(lines)
    assert len(copied_holes(padded)) == len(all_holes())


def test_a_different_body_is_not_a_copy():
    text = REFERENCE["serve/engine.py"]
    fn = _defs(ast.parse(text))["EngineCore.check_stop"]
    body = fn.body[1]
    lines = text.splitlines(keepends=True)
    lines[body.lineno - 1:body.lineno - 1] = [" " * body.col_offset + "self = self or None\n"]
    assert "EngineCore.check_stop" not in copied_holes(dict(REFERENCE, **{"serve/engine.py": "".join(lines)}))


def test_a_class_cannot_rebind_an_allowed_decorator():
    added = "class _Mine:\n    def property(f):\n        print('at import')\n\n    @property\n    def x(self):\n        return 1\n"
    graded, edits = assemble(BATCH + "\n\n" + added, BATCH, "serve/batch.py")
    assert "print(" not in graded and any("rebinds property" in e for e in edits), edits


def test_a_body_too_deep_to_read_is_graded_as_the_courses_copy():
    deep = BATCH + "\n\nX = " + "1 + " * 20000 + "1\n"
    graded, edits = assemble(deep, BATCH, "serve/batch.py")
    assert graded == BATCH and edits and "serve/batch.py" in edits[0]
    assert copied_holes({"serve/batch.py": deep}) == []
