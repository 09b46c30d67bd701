"""The course's tooling around the engine: benchmarks, workloads, baselines, visualisation, the
invariant checker, fault injection, grading, the learner layer's tools (holes, editions) and the mutants.

It imports the engine; the engine never imports it (``tests/test_layout.py`` checks). Run from the
repository root: only ``engine`` is an installed package.
"""
