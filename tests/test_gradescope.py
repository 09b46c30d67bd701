"""The Gradescope bundle from a fresh clone in a simulated /autograder layout: run_autograder grades
the submission in the sandbox and writes results.json where Gradescope reads it, in its spec's shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from course.grading.gradescope import check_results, write
from course.learner.testrun import reference_files, workspace

ROOT = Path(__file__).resolve().parent.parent


def test_run_autograder_from_a_fresh_clone_writes_results_json(tmp_path):
    top = tmp_path / "autograder"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(top / "source")], check=True)
    write(top / "source" / "gradescope")
    workspace(top / "submission", reference_files())  # a complete submission
    env = {**os.environ, "AUTOGRADER_ROOT": str(top), "PYTHON": sys.executable,
           "GRADE_ARGS": "-k 'worked_example or check_stop_rules' --scenarios 1 --seed 5"}
    env.pop("ENGINE_IMPL", None)
    proc = subprocess.run(["bash", str(top / "source/gradescope/run_autograder")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((top / "results/results.json").read_text())
    check_results(doc)
    rows = {t["name"]: t for t in doc["tests"]}
    assert rows["build_batch"]["score"] == 3 and rows["EngineCore.check_stop"]["score"] == 1, rows
    assert rows["instructor notes (hidden)"]["visibility"] == "hidden"
    assert all(t["visibility"] == "visible" for n, t in rows.items() if n != "instructor notes (hidden)")
