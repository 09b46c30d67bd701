"""The ``--impl`` switch: one package name, two implementations of the chapter's files.

Tests, ``run.py`` and the notebook always ``import engine``. With ``ENGINE_IMPL=solution`` in the
environment at import time, a meta-path finder serves every module ``engine.X.Y`` for which
``solutions/X/Y.py`` exists from that file instead of ``engine/X/Y.py``; every other module (earlier
chapters, files without holes) is always the one in ``engine/``. ``ENGINE_IMPL=engine`` (or unset)
imports the learner's files as they are. docs/learner-layer.md explains the whole layer.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path

ENV_VAR = "ENGINE_IMPL"
IMPLS = ("engine", "solution")
ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS_DIR = ROOT / "solutions"


def current_impl() -> str:
    """Which implementation this process loads: ``"engine"`` (learner) or ``"solution"``."""
    impl = os.environ.get(ENV_VAR, "engine") or "engine"
    if impl not in IMPLS:
        raise ValueError(f"{ENV_VAR}={impl!r}: choose one of {IMPLS}")
    return impl


def solution_path(module_name: str) -> Path | None:
    """``engine.serve.blocks`` -> ``solutions/serve/blocks.py`` when that file exists."""
    parts = module_name.split(".")
    if parts[0] != "engine" or len(parts) < 2:
        return None
    path = SOLUTIONS_DIR.joinpath(*parts[1:]).with_suffix(".py")
    return path if path.is_file() else None


class _SolutionFinder(importlib.abc.MetaPathFinder):
    """Serves ``engine.*`` modules from ``solutions/`` (all of them, or only the named ones)."""

    def __init__(self, only: set[str] | None = None) -> None:
        self.only = only

    def find_spec(self, fullname, path=None, target=None):
        if self.only is not None and fullname not in self.only:
            return None
        src = solution_path(fullname)
        return None if src is None else importlib.util.spec_from_file_location(fullname, src)


def install_reference_finder(only: Iterable[str] | None = None) -> None:
    """Serve the chapter's files from ``solutions/`` in this process (``only``: just these modules;
    the test session uses that for a learner file that does not import)."""
    sys.meta_path.insert(0, _SolutionFinder(None if only is None else set(only)))


def install_impl_switch() -> None:
    if current_impl() == "solution":
        install_reference_finder()
