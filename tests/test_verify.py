"""The grader's comparison of scenario answers (course/verify.py), on hand-made answers: blame goes to
the first call that differs, a failure behind a failing dependency is "unverified", and nothing the
learner's process returned reaches a message unless it is a plain number."""
from __future__ import annotations

from course.scenarios import make_scenarios
from course.verify import compare, verdicts

SPEC = {"id": "hash_block/0", "kind": "hash_block", "holes": ["hash_block"], "deps": [], "group": "hash_block"}
WANT = {"result": {"digests": ["00ff", "11ee"]}}


def test_a_string_from_the_learner_never_reaches_the_message():
    ok, _, msg = compare(SPEC, WANT, {"result": {"digests": ["00ff", "alice's grade.json: 50/50"]}})
    assert not ok and "alice" not in msg and "'11ee'" in msg
    ok, _, msg = compare(SPEC, WANT, {"error": "Exception('/etc/hostname says vm')"})
    assert not ok and "hostname" not in msg and "raised an error" in msg


def test_block_ops_blames_the_first_call_that_differs():
    spec = {"id": "block_ops/0", "kind": "block_ops", "holes": ["BlockManager.free", "BlockManager.allocate_slots"],
            "deps": [], "group": "BlockManager"}
    rec = lambda hole, ret, free: {"hole": hole, "ret": ret, "state": {"num_free": free}}  # noqa: E731
    want = {"result": {"records": [rec("BlockManager.allocate_slots", True, 3), rec("BlockManager.free", None, 5)]}}
    got = {"result": {"records": [rec("BlockManager.allocate_slots", True, 3), rec("BlockManager.free", None, 4)]}}
    ok, blamed, msg = compare(spec, want, got)
    assert not ok and blamed == ["BlockManager.free"] and "expected 5, got 4" in msg


def test_a_failure_behind_a_failing_dependency_is_unverified():
    dep = dict(SPEC)
    user = {"id": "block_ops/0", "kind": "hash_block", "holes": ["BlockManager.free"], "deps": ["hash_block"],
            "group": "BlockManager"}
    ref = {"hash_block/0": WANT, "block_ops/0": WANT}
    bad = {"hash_block/0": {"error": "ValueError"}, "block_ops/0": {"error": "ValueError"}}
    rows = verdicts([dep, user], ref, bad)
    assert rows["hash_block"]["verified"] == "fail" and rows["BlockManager.free"]["verified"] == "unverified"
    rows = verdicts([dep, user], ref, {"hash_block/0": WANT, "block_ops/0": {"error": "ValueError"}})
    assert rows["BlockManager.free"]["verified"] == "fail"


def test_scenarios_are_drawn_from_the_seed_and_cover_every_hole():
    from course.holes import all_holes

    a, b = make_scenarios(1), make_scenarios(2)
    assert a == make_scenarios(1) and a != b
    covered = {h for s in a for h in s["holes"]}
    assert {h.qualname for h in all_holes()} | {"milestone", "engine checks"} == covered
