"""Do the chapter's tests catch what a learner gets wrong? The learner-bug corpus (course/quality/bug_corpus.py).

Every bug of the corpus is applied to the reference in a workspace (a temporary copy of the
repository; never the working tree) and run against its hole's own tests, then, if those pass,
against the whole chapter file: the same run as `make bug-corpus`, which also writes
docs/bug-corpus.md. Of the bugs that can change behaviour, at least 95% must be caught by the
chapter file and 90% by the owning hole's tests; a bug marked equivalent must pass every test (else
its claim is wrong); no bug may be stale (its text must still occur exactly once in a hole's body).
"""
from __future__ import annotations

from course.quality.bug_corpus import BUGS, FILE_OF, KINDS, MIN_BY_CHAPTER, MIN_BY_HOLE, run_all, summarize, summary_lines
from course.learner.holes import all_holes
from course.quality.mutants import MUTANTS


def test_the_corpus_covers_every_hole_and_repeats_no_mutant():
    holes = {h.qualname for h in all_holes()}
    assert set(FILE_OF) == holes, f"the corpus's holes differ from the chapter's: {set(FILE_OF) ^ holes}"
    assert {b.holes[0] for b in BUGS} == holes, "every hole needs bugs of its own"
    assert len({b.name for b in BUGS}) == len(BUGS) and len(BUGS) >= 130, "at least 130 bugs, unique names"
    assert all(b.kind in KINDS and len(b.holes) == 1 for b in BUGS), "each bug: one owning hole, a known class"
    mutants = {(m.file, m.old, m.new) for m in MUTANTS}
    assert not [b.name for b in BUGS if (b.file, b.old, b.new) in mutants], "a corpus bug repeats a mutant"


def test_the_chapter_tests_catch_the_corpus():
    results = run_all(BUGS, workers=2)
    s = summarize(results)
    report = "\n".join(summary_lines(s))
    assert not s.stale, f"stale bugs (update their text to the reference): {s.stale}\n{report}"
    assert not s.broken, f"bugs whose run broke before any test failed: {s.broken}\n{report}"
    assert not s.equivalent_caught, f"bugs claimed equivalent that a test caught (the claim is wrong): " \
                                    f"{s.equivalent_caught}\n{report}"
    escaped = [r.bug.name for r in results if r.counted and not r.by_chapter]
    late = [r.bug.name for r in results if r.counted and r.by_chapter and not r.by_hole]
    assert s.chapter_rate >= MIN_BY_CHAPTER, f"{report}\nescaped every chapter test: {escaped}"
    assert s.hole_rate >= MIN_BY_HOLE, f"{report}\ncaught only outside their hole's tests: {late}"
