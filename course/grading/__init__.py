"""The instructor's grader: ``run.py grade`` and the Gradescope bundle.

Who runs it: instructors. A learner's checkout is run only inside a sandbox (``sandbox``, with the
parent-side limits of ``watchdog``); points come from ``scenarios`` compared with the reference by
``verify``; ``copycheck`` flags copies; ``grade`` writes the outputs; ``gradescope`` packs the bundle.
Threat model: ``docs/grading.md``.
"""
