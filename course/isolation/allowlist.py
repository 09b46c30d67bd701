"""What of the course a sandbox sees: an explicit allow-list of given files, nothing else.

A grading workspace (``sandbox_workspace``) is NOT a copy of the instructor's tree. It holds exactly
``ALLOWED`` — the engine's given code (engine/, whose chapter files are then replaced by the
grader's assembled modules), the learner-facing tests the feedback run needs (the chapter's tests,
the engine checks and their helper and conftest), the pytest settings, and the course modules the
sandboxed children import (the report plugin, the holes' reader that the conftest and the scenario
child use, the invariants and faults the tests use, the scenario runner) — each of them a file the
learner's own checkout already has. Never in it: ``solutions/`` (the reference), ``.git``, the
instructor-only tests and tools (mutants, the bug corpus, the grader's own tests), ``grades/``, and
the reference's scenario answers (they stay in the grader's process). ``tests/test_sandbox.py`` has a
hole body walk everything the sandbox can see and checks that none of it is there.
"""
from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Folders copied whole (``__pycache__`` left out), then single files; paths relative to the root.
ALLOWED_TREES = ("engine", "course/learner/pytest_plugins")
ALLOWED_FILES = (
    "pyproject.toml",  # pytest's settings: rootdir, pythonpath
    "tests/conftest.py", "tests/ch31_helpers.py",
    "tests/test_ch31_engine_v2.py", "tests/test_isolation.py", "tests/test_reliability.py",
    "course/__init__.py", "course/learner/__init__.py", "course/learner/holes.py",
    "course/quality/__init__.py", "course/quality/invariants.py", "course/quality/faults.py",
    "course/quality/oracle.py",
    "course/grading/__init__.py", "course/grading/scenarios.py",
)
NEVER = ("solutions", ".git", "grades")  # checked: no allowed path starts with one of these


def allowed_paths() -> list[str]:
    """Every file (relative to the root) that a grading workspace holds, before the chapter files."""
    out = list(ALLOWED_FILES)
    for tree in ALLOWED_TREES:
        out += sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / tree).rglob("*")
                      if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts)
    bad = [p for p in out if p.split("/", 1)[0] in NEVER]
    if bad:
        raise RuntimeError(f"the sandbox's allow-list names instructor-only paths: {bad}")
    return out


def sandbox_workspace(dst: Path, chapter_files: dict[str, str]) -> Path:
    """A workspace at ``dst``: the allow-listed files, with ``engine/<rel>`` = ``chapter_files[rel]``."""
    for rel in allowed_paths():
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, target)
    for rel, text in chapter_files.items():
        (dst / "engine" / rel).write_text(text)
    return dst
