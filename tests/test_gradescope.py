"""The Gradescope bundle from a fresh clone: ``gradescope zip`` writes autograder.zip; unpacked in a
simulated /autograder layout, its run_autograder grades a submission in the sandbox and writes
results.json where Gradescope reads it, in its spec's shape: for an honest submission (no copy flag)
and for a copied one (similar to an earlier submission whose fingerprints the bundle carries, one hole
equal to the reference), the flags in the hidden instructor notes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import copy_cases as cases
from course.grading.gradescope import check_results
from course.learner.testrun import reference_files, workspace

ROOT = Path(__file__).resolve().parent.parent
OWN = {"EngineCore.check_stop", "write_kv", "hash_block"}  # the honest submission's holes
EARLIER = {"BlockManager.allocate_slots", "BlockManager.cache_full_blocks", "EngineCore.step",
           "Scheduler._preempt"}  # an earlier submission's holes, copied with junk lines


def _grade(top: Path, files: dict[str, str]) -> dict:
    sub = top / "submission"
    if sub.exists():
        subprocess.run(["rm", "-rf", str(sub)], check=True)
    workspace(sub, files)
    env = {**os.environ, "AUTOGRADER_ROOT": str(top), "PYTHON": sys.executable,
           "GRADE_ARGS": "-k 'worked_example or check_stop_rules' --scenarios 1 --seed 5"}
    env.pop("ENGINE_IMPL", None)
    proc = subprocess.run(["bash", str(top / "source/run_autograder")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((top / "results/results.json").read_text())
    check_results(doc)
    return {t["name"]: t for t in doc["tests"]}


def test_the_zip_from_a_fresh_clone_grades_an_honest_and_a_copied_submission(tmp_path):
    clone, top = tmp_path / "clone", tmp_path / "autograder"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    earlier = tmp_path / "earlier"
    workspace(earlier / "2025-alice", cases.learner(EARLIER))
    proc = subprocess.run([sys.executable, "-m", "course.grading.gradescope", "zip", str(tmp_path / "autograder.zip"),
                           "--prior", str(earlier)], cwd=clone, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "autograder.zip") as z:
        assert {"setup.sh", "run_autograder", "prior_fingerprints.json"} <= set(z.namelist())
        z.extractall(top / "source")
    for name in ("setup.sh", "run_autograder"):
        (top / "source" / name).chmod(0o755)  # zipfile keeps no modes on extraction (Gradescope's unzip does)

    rows = _grade(top, cases.learner(OWN))
    notes = rows["instructor notes (hidden)"]
    assert notes["visibility"] == "hidden" and notes["output"].startswith("status trial"), notes["output"][:300]
    assert "copy:" not in notes["output"], notes["output"][:2000]
    assert rows["EngineCore.check_stop"]["score"] == 1 and rows["build_batch"]["score"] == 0, rows
    assert all(t["visibility"] == "visible" for n, t in rows.items() if n != "instructor notes (hidden)")

    ref = reference_files()
    copied = cases.renamed_with_junk(cases.learner(EARLIER, {**cases.skeleton_files(), "serve/batch.py":
                                                             ref["serve/batch.py"]}))
    rows = _grade(top, copied)
    out = rows["instructor notes (hidden)"]["output"]
    assert "copy: 1 hole(s) equal to the reference after normalisation: build_batch" in out, out[:2000]
    assert "similar to 2025-alice (an earlier submission)" in out, out[:2000]
    assert rows["build_batch"]["score"] == 3, rows  # a flag is for a human: the points stand
