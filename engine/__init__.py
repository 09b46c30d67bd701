"""Your engine: the LLM serving engine built chapter by chapter.

Earlier chapters are complete here. Chapter 31's files under ``engine/serve`` hold holes
(functions whose docstring says ``(Your engine: Chapter 31)``) for you to fill in.
``ENGINE_IMPL=solution`` (``pytest --impl solution``, ``run.py ... --impl solution``) puts the
reference answers from ``solutions/`` into them instead: see ``engine/_impl.py``.
"""
