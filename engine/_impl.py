"""The ``--impl`` switch: one package name, two implementations of the chapter's files.

Tests and ``run.py`` always ``import engine``. When the environment variable ``ENGINE_IMPL`` is
``solution`` at import time, a meta-path finder serves every module ``engine.X.Y`` for which
``solutions/X/Y.py`` exists from that file instead of ``engine/X/Y.py``. Modules without a
reference copy (earlier chapters, files without holes) are always the ones in ``engine/``.
The default, ``engine``, is the learner's code. ``ENGINE_SOLUTIONS_DIR`` (tools only) replaces
``solutions/`` with another directory of the same layout.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

ENV_VAR = "ENGINE_IMPL"
IMPLS = ("engine", "solution")
ROOT = Path(__file__).resolve().parent.parent
# ENGINE_SOLUTIONS_DIR points the switch at another copy of solutions/ (tools/mutants.py patches a
# temporary copy one bug at a time, never the working tree).
SOLUTIONS_DIR = Path(os.environ.get("ENGINE_SOLUTIONS_DIR") or ROOT / "solutions").resolve()


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
    """Serves ``engine.*`` modules from ``solutions/`` when a reference copy exists."""

    def find_spec(self, fullname, path=None, target=None):
        src = solution_path(fullname)
        if src is None:
            return None
        return importlib.util.spec_from_file_location(fullname, src)


def install_reference_finder() -> None:
    """Serve the chapter's files from ``solutions/`` in this process, whatever ``ENGINE_IMPL`` says.

    The test suite's per-hole isolation (tests/learner_holes.py) uses this: it loads the reference
    as ``engine`` and patches the learner's hole functions into it, while subprocesses still see
    ``ENGINE_IMPL=engine``.
    """
    if not any(isinstance(f, _SolutionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SolutionFinder())


def install_impl_switch() -> None:
    if current_impl() == "solution":
        install_reference_finder()
