"""Benchmarks: ``run.py core`` (the chapter's), ``run.py bench`` (engines side by side, memory),
their workloads and baselines, the machine's
roofline, and the levers used to find where a step's time goes.

Who runs it: anyone measuring the engine; figures in ``docs/performance.md`` name their command.
"""
