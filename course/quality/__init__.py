"""The tests' own quality: named mutants and the learner-bug corpus (data in ``course/quality/data``)
that the chapter's tests must catch, the invariant checker run after every step, fault injection,
the soak, the own-words overlap check, the house plan read from the code, and the rooms a
construction walks through (``python -m course.quality.rooms``).

Who runs it: maintainers and CI (``make mutants``, ``make bug-corpus``, ``make soak``, ``make test-course``).
"""
