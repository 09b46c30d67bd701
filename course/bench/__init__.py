"""Benchmarks: ``run.py core`` (the chapter's), ``run.py bench`` (engines side by side, memory),
their workloads and baselines, the machine's
roofline (the levers that find where a step's time goes are ``course/tuning``).

Who runs it: anyone measuring the engine; figures in ``docs/performance.md`` name their command.
"""
