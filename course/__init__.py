"""The course's tooling around the engine: benchmarks, workloads, baselines, visualisation, the
invariant checker, fault injection, grading, the skeleton generator and the mutants.

It imports the engine; the engine never imports it (``tests/test_layout.py`` checks). Run from the
repository root: only ``engine`` is an installed package.
"""
