"""Can the chapter's tests grade? Every named mutant (course/quality/mutants.py) must be killed.

Each mutant is a realistic bug applied to the reference in a workspace's engine/ (a temporary copy
of the repository; never the working tree), as a learner who made exactly that bug, and run against
its hole's tests plus the milestone in a subprocess, two at a time; the same run as `make mutants`,
which also prints the table. A survivor (or a LATE kill, by the milestone only) means the hole's
tests cannot see that bug: strengthen tests/test_ch31_engine_v2.py (keep the marker conventions).
"""
from __future__ import annotations

from course.learner.holes import all_holes
from course.quality.mutants import MILESTONE_MUST_CATCH, MUTANTS, format_table, run_all


# Bugs that once passed every chapter test (issues 11 and 23): each must stay a named mutant.
ONCE_SURVIVED = ("find-cached-prefix-continues-past-miss", "admitted-appended-to-running",
                 "step-samples-indexed-by-request", "prompt-logprob-targets-ignore-c", "hash-extra-with-python-hash",
                 "free-without-blocks-is-a-no-op", "pending-lookup-kept-after-admission", "num-published-leaks",
                 "prompt-logprobs-duplicated-after-recompute",
                 # issue 23's learner walk-through: each passed every hole test (two only the milestone saw)
                 "min-tokens-exclusive", "length-checked-before-stop-rules", "ignore-eos-skips-stop-tokens",
                 "eos-checked-before-stop-tokens", "step-without-recovery", "step-recovers-only-from-exception",
                 "empty-plan-counted-as-step", "first-block-without-root-hash", "extra-without-separator",
                 "lookup-miss-not-counted", "lookup-counted-when-switched-off", "cached-blocks-adopted-into-a-held-table",
                 "num-published-not-raised", "admission-skips-a-blocked-head", "chunking-off-skips-a-waiting-prompt",
                 "resumed-history-waits-forever", "resumed-request-skips-prefix-lookup",
                 "num-cached-tokens-overwritten-on-readmission", "scheduler-preemptions-not-counted",
                 "swap-without-computed-tokens", "tables-mapping-read-in-its-own-order", "sample-count-from-prompt-length",
                 "empty-prompt-span-entry")


def test_every_mutant_is_killed_by_the_chapter_tests():
    assert len(MUTANTS) >= 14 and len({m.name for m in MUTANTS}) == len(MUTANTS), "names must be unique"
    missing = [n for n in ONCE_SURVIVED if n not in {m.name for m in MUTANTS}]
    assert not missing, f"mutants for bugs that once survived were removed: {missing}"
    holes = {h.qualname for h in all_holes()}
    unknown = {m.name: [h for h in m.holes if h not in holes] for m in MUTANTS if not set(m.holes) <= holes}
    assert not unknown, f"mutants select tests of holes that don't exist: {unknown}"
    results = run_all(MUTANTS, workers=2)
    bad = [r for r in results if r.status != "killed"]
    assert not bad, (f"{len(bad)} of {len(results)} mutants were not killed "
                     f"(SURVIVED: strengthen the tests; stale: update the mutant's text; broken: see detail):\n"
                     + format_table(results))


def test_the_milestone_alone_exposes_the_bugs_the_chapter_names():
    chosen = [m for m in MUTANTS if m.name in MILESTONE_MUST_CATCH]
    assert len(chosen) == len(MILESTONE_MUST_CATCH)
    results = run_all(chosen, workers=2, milestone_only=True)
    bad = [r for r in results if r.status != "killed"]
    assert not bad, "the milestone alone must catch these bugs (the chapter promises it):\n" + format_table(results)
