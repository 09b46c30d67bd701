"""Can the chapter's tests grade? Every named mutant (tools/mutants.py) must be killed.

Each mutant is a realistic bug applied to a temporary copy of solutions/ (never the working tree)
and run against its hole's tests plus the milestone in a subprocess, two at a time; the same
run as `make mutants`, which also prints the table. A survivor means the tests cannot see that
bug: strengthen tests/test_ch31_engine_v2.py (keep the hole marker and naming conventions).
"""
from __future__ import annotations

from learner_holes import all_holes
from tools.mutants import MUTANTS, format_table, run_all


def test_every_mutant_is_killed_by_the_chapter_tests():
    assert len(MUTANTS) >= 14 and len({m.name for m in MUTANTS}) == len(MUTANTS), "names must be unique"
    holes = {h.qualname for h in all_holes()}
    unknown = {m.name: [h for h in m.holes if h not in holes] for m in MUTANTS if not set(m.holes) <= holes}
    assert not unknown, f"mutants select tests of holes that don't exist: {unknown}"
    results = run_all(MUTANTS, workers=2)
    bad = [r for r in results if r.status != "killed"]
    assert not bad, (f"{len(bad)} of {len(results)} mutants were not killed "
                     f"(SURVIVED: strengthen the tests; stale: update the mutant's text; broken: see detail):\n"
                     + format_table(results))
