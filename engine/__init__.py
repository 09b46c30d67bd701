"""Your engine: the LLM serving engine built chapter by chapter.

Earlier chapters are complete here. Chapter 31's files under ``engine/serve`` hold holes
(functions whose docstring says ``(Your engine: Chapter 31)``) for you to fill in.

``ENGINE_IMPL=solution`` (or ``pytest --impl solution`` / ``run.py --impl solution``) makes this
same package load each chapter file from ``solutions/`` instead: see ``engine/_impl.py``.
"""
from engine._impl import install_impl_switch

install_impl_switch()
