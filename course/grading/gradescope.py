"""The Gradescope bundle: ``make gradescope`` writes ``setup.sh`` and ``run_autograder`` into
``gradescope/`` (zip them with a clone of this repository as ``source/``).

Gradescope's layout (its autograder spec): the bundle's files in ``/autograder/source``, the student's
upload in ``/autograder/submission``, and the result read from ``/autograder/results/results.json``
(fields: score, execution_time, output, visibility, stdout_visibility, tests[] with score, max_score,
name, output, visibility, status). ``setup.sh`` installs the course (its venv, bubblewrap from
the dev extra, apt's bubblewrap as well when root); ``run_autograder`` grades the submission in the
sandbox and copies its ``results.json`` there. ``AUTOGRADER_ROOT`` moves the whole layout (the tests
simulate it in a temporary folder).

    python -m course.grading.gradescope write [DIR]     # the two scripts (default: gradescope/)
    python -m course.grading.gradescope run             # what run_autograder calls
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VISIBILITY = ("visible", "hidden", "after_due_date", "after_published")

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once when it builds the image: the course, its venv, the sandbox.
set -euo pipefail
A="${AUTOGRADER_ROOT:-/autograder}"
cd "$A/source"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -q && apt-get install -y -q bubblewrap python3-venv || true
fi
make setup
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this for every submission: grade it in the sandbox, write results.json.
set -uo pipefail
A="${AUTOGRADER_ROOT:-/autograder}"
cd "$A/source"
eval "set -- ${GRADE_ARGS:-}"  # extra grader flags, shell-quoted (the course staff's, never a submission's)
"${PYTHON:-.venv/bin/python}" -m course.grading.gradescope run "$@"
"""


def write(dst: Path) -> list[Path]:
    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in (("setup.sh", SETUP), ("run_autograder", RUN)):
        (dst / name).write_text(text)
        (dst / name).chmod(0o755)
        out.append(dst / name)
    return out


def check_results(doc: dict) -> None:
    """``ValueError`` unless ``doc`` has the shape Gradescope's spec gives results.json."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"results.json: {what}")
    need(isinstance(doc.get("score"), (int, float)), "score must be a number")
    need(isinstance(doc.get("execution_time"), int), "execution_time must be whole seconds")
    need(doc.get("visibility") in VISIBILITY and doc.get("stdout_visibility") in VISIBILITY, "visibility values")
    need(isinstance(doc.get("tests"), list) and doc["tests"], "tests must be a non-empty list")
    for t in doc["tests"]:
        need(isinstance(t.get("name"), str) and isinstance(t.get("output"), str), "each test has name and output")
        need(isinstance(t.get("score"), (int, float)) and isinstance(t.get("max_score"), (int, float)),
             "each test has numeric score and max_score")
        need(t.get("visibility") in VISIBILITY, f"test {t.get('name')!r}: visibility")
        need(t.get("status", "passed") in ("passed", "failed"), f"test {t.get('name')!r}: status")


def run(argv: list[str]) -> int:
    from course.grading.grade import grade_main

    root = Path(os.environ.get("AUTOGRADER_ROOT", "/autograder"))
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gs-") as tmp:
        try:
            code = grade_main([str(root / "submission"), "--out", tmp, *argv])
        except Exception as exc:  # noqa: BLE001 - whatever happens, Gradescope gets a results.json
            print(f"the grader failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
            code = 1
        found = sorted(Path(tmp).rglob("results.json"))
        doc = None
        if code == 0 and len(found) == 1:
            try:
                doc = json.loads(found[0].read_text())
                check_results(doc)
            except (OSError, ValueError):
                doc = None
        if doc is None:
            doc = {"score": 0, "execution_time": 0, "visibility": "visible", "stdout_visibility": "hidden",
                   "output": "The grader could not grade this submission; the course staff has been told.",
                   "tests": [{"name": "grading", "score": 0, "max_score": 50, "output": "not graded",
                              "visibility": "visible", "status": "failed"}]}
    check_results(doc)
    (results / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["write"]:
        for p in write(Path(argv[1]) if len(argv) > 1 else ROOT / "gradescope"):
            print(f"wrote {p}")
        return 0
    if argv[:1] == ["run"]:
        return run(argv[1:])
    print(__doc__.strip())
    return 2


if __name__ == "__main__":
    sys.exit(main())
