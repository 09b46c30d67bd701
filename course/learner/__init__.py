"""The learner layer's tools: chapter files read on the syntax tree (filled holes, edits outside
them), the solutions branch and the handout, temporary workspaces that run the chapter's tests on
chosen files, the pytest report plugin, and ``run.py generate``.

Who runs it: every learner, through ``make test-learner``, ``--hole``, ``make handout`` and
``run.py generate``; the grader and the quality tools reuse its workspaces.
"""
