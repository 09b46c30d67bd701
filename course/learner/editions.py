"""Two editions of the course made from this checkout: the solutions branch and the learner handout.

    python -m course.learner.editions solutions-branch   # make solutions-branch: a local git branch `solutions`
    python -m course.learner.editions handout DIR        # make handout DEST=DIR: the learner edition in DIR

``solutions-branch`` commits, on top of HEAD, the chapter files with every hole filled from
``solutions/`` (their reference bodies, and the imports those need) as the branch ``solutions``:
the complete reference engine, where the chapter's tests pass with the default ``--impl engine``.
It is built in a temporary git index from HEAD's files: your working tree, index and branch are
not touched (the branch is replaced if it exists).

``handout`` exports HEAD (``git archive``) into DIR without the answers — ``solutions/``,
``tests/learner_fill.py`` and the files that quote them (``ANSWERS``) — and with ``HANDOUT.md`` as its README: what works there and what
doesn't. DIR must not exist yet.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from course.learner.holes import answers, fill
from engine._impl import CHAPTER_FILES, ROOT

BRANCH = "solutions"
# What a handout leaves out: the answers, and every file that quotes them — the mutant and bug
# records (course/quality/data/) hold reference lines as the text each bug replaces, and the modules
# that run them, their tests and tools import them; the copy cases are built from learner_fill.py.
ANSWERS = ("solutions", "tests/learner_fill.py", "course/quality/data", "course/quality/mutants.py",
           "course/quality/bug_corpus.py", "tests/test_mutants.py", "tests/test_bug_corpus.py",
           "course/quality/grade_table.py", "tests/copy_cases.py", "tests/test_copycheck.py",
           "tests/test_gradescope.py", "tests/test_gradescope_zip.py", "tests/test_grading_attacks.py",
           "tests/test_grade_honest.py")
HANDOUT_README = Path("course") / "learner" / "HANDOUT.md"


def _git(*args: str, env: dict | None = None, data: str | None = None, cwd: Path = ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, input=data,
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise ValueError(f"git {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip()


def solutions_branch(repo: Path = ROOT, branch: str = BRANCH) -> str:
    """Commit HEAD with every hole filled as ``branch``; returns the new commit."""
    with tempfile.TemporaryDirectory(prefix="solutions-index-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git("read-tree", "HEAD", env=env, cwd=repo)
        for rel in CHAPTER_FILES:
            bodies, imports = answers(rel, text=_git("show", f"HEAD:solutions/{rel}", cwd=repo) + "\n")
            text = fill(_git("show", f"HEAD:engine/{rel}", cwd=repo) + "\n", bodies, imports)
            blob = _git("hash-object", "-w", "--stdin", data=text, cwd=repo)
            _git("update-index", "--cacheinfo", f"100644,{blob},engine/{rel}", env=env, cwd=repo)
        tree = _git("write-tree", env=env, cwd=repo)
    commit = _git("commit-tree", tree, "-p", "HEAD", "-m",
                  "The solutions branch: every hole of chapter 31 filled from solutions/ (make solutions-branch)",
                  cwd=repo)
    _git("branch", "-f", branch, commit, cwd=repo)
    return commit


def handout(dest: Path, repo: Path = ROOT) -> Path:
    """HEAD exported to ``dest`` without the answers, with the handout README."""
    if dest.exists():
        raise ValueError(f"{dest} exists: give a new directory")
    data = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=repo, capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    for rel in ANSWERS:
        path = dest / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    shutil.copy(dest / HANDOUT_README, dest / "README.md")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.learner.editions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("solutions-branch", help="the local branch `solutions`: every hole filled")
    out = sub.add_parser("handout", help="the learner edition, without solutions/")
    out.add_argument("dest", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.what == "solutions-branch":
            commit = solutions_branch()
            print(f"branch {BRANCH} at {commit[:12]}: every hole filled from solutions/ "
                  f"(git checkout {BRANCH}; the chapter's tests pass there with the default --impl)")
        else:
            print(f"wrote the handout to {handout(args.dest.resolve())} (no solutions/; see its README.md)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
