"""The grader's comparison of scenario answers (course/grading/verify.py), on hand-made answers: blame goes to
the first call that differs, a failure behind a failing dependency is "unverified", and nothing the
learner's process returned reaches a message unless it is a plain number."""
from __future__ import annotations

from course.grading.scenarios import make_scenarios
from course.grading.verify import compare, verdicts

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
    from course.learner.holes import all_holes

    a, b = make_scenarios(1), make_scenarios(2)
    assert a == make_scenarios(1) and a != b
    covered = {h for s in a for h in s["holes"]}
    assert {h.qualname for h in all_holes()} | {"milestone", "engine checks"} == covered


def _learner_answers(files: dict[str, str], specs: list[dict], tmp) -> dict[str, dict]:
    """The scenarios answered by a workspace whose chapter files are ``files`` (no sandbox: these are ours)."""
    import json
    import os
    import subprocess
    import sys

    from course.learner.testrun import workspace
    from course.grading.verify import read_results

    bed = workspace(tmp / "repo", files)
    spec_file, out = tmp / "specs.json", tmp / "answers.jsonl"
    spec_file.write_text(json.dumps(specs))
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
           "ENGINE_IMPL": "engine", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(bed)}
    subprocess.run([sys.executable, "-m", "course.grading.scenarios", str(spec_file), str(out)], cwd=bed, env=env,
                   timeout=600, check=True, capture_output=True)
    return read_results(out)


def test_a_bug_in_one_rule_costs_only_the_scenarios_of_that_rule(tmp_path):
    """The cap is fine-grained: a reference with preemption by recompute broken (the mutant
    recompute-keeps-stale-num-computed) fails the preemption scenarios of that rule only (one of four
    rules, and the preemptions made by hand by recompute), and of the engine checks only the configurations that preempt by recompute (which are
    then unverified, preemption having failed its own). With one scenario per row (the grader
    before) both rows were all or nothing: 2 of 4 and 0 of 1."""
    from course.quality.mutants import MUTANTS
    from course.learner.testrun import reference_files
    from course.grading.verify import reference_results

    specs = [s for s in make_scenarios(11) if s["group"] in ("Scheduler._preempt", "engine checks")]
    mutant = next(m for m in MUTANTS if m.name == "recompute-keeps-stale-num-computed")
    files = reference_files()
    files[mutant.file] = files[mutant.file].replace(mutant.old, mutant.new)
    rows = verdicts(specs, reference_results(specs), _learner_answers(files, specs, tmp_path))
    pre, checks = rows["Scheduler._preempt"], rows["engine checks"]
    recompute = [s for s in specs if s["group"] == "engine checks"
                 and s["args"]["config"].get("preemption_mode", "recompute") == "recompute"
                 and s["args"]["config"].get("num_blocks", 200) < 40]
    assert checks["verified"] == "unverified" and checks["unverified_because"] == ["Scheduler._preempt"], checks
    assert checks["total"] >= 10, checks
    assert checks["total"] - len(recompute) <= checks["matched"] < checks["total"], (checks, len(recompute))
    # the scenarios that look at a recompute victim: its rule's, and the preemptions made by hand by recompute
    seen = [s for s in specs if s["group"] == "Scheduler._preempt" and (s["args"]["rule"] == "recompute" or (
        s["args"]["rule"].startswith("direct") and s["args"]["config"]["preemption_mode"] == "recompute"))]
    assert pre["verified"] == "fail" and pre["matched"] == pre["total"] - len(seen) < pre["total"], pre


def test_an_unverified_row_gets_only_the_scenarios_that_matched():
    """No row keeps points it did not verify: a row whose scenarios failed behind a failing dependency
    gets the share of its scenarios that matched, whatever its tests reported (an honest buggy checkout
    and a forged report alike); a forged pass whose dependency's tests lied is also flagged."""
    from course.grading.grade import Row, apply_verdict

    verdict = {"verified": "unverified", "matched": 1, "total": 4, "messages": [],
               "unverified_because": ["build_batch"]}
    honest = Row("engine checks", "", 20, 37, "partial", 10, 5.41)
    apply_verdict(honest, verdict, [], contradicted=set())
    assert honest.score == 2.5
    forged, flags = Row("engine checks", "", 37, 37, "pass", 10, 10.0), []
    apply_verdict(forged, verdict, flags, contradicted={"build_batch"})
    assert forged.score == 2.5 and forged.status == "flagged" and flags