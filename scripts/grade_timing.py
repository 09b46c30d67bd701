"""How much ``run.py grade --jobs N`` saves: N complete checkouts graded serially, then with --jobs.

    python scripts/grade_timing.py [--checkouts 20] [--jobs 2] [--scenarios 2]
    python scripts/grade_timing.py --hang      # what a hung hole costs with the defaults

Both sittings share one seed; prints each wall time, the ratio, and the CPU it ran on. The machine's
load matters (a shared machine gives a noisy ratio): the load average is printed beside the figures.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from course.machine import machine_line  # noqa: E402
from course.testrun import reference_files, workspace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkouts", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--scenarios", type=int, default=2)
    ap.add_argument("-k", dest="keyword", default="")
    ap.add_argument("--hang", action="store_true", help="grade a complete checkout and one whose check_stop hangs")
    args = ap.parse_args()
    if args.hang:
        return hang_cost()
    with tempfile.TemporaryDirectory(prefix="grade-timing-") as tmp:
        paths = [str(workspace(Path(tmp) / f"learner{i}" / "ch31", reference_files())) for i in range(args.checkouts)]
        print(f"machine: {machine_line()} (before)")
        walls = {}
        for jobs in (1, args.jobs):
            cmd = [sys.executable, "run.py", "grade", *paths, "--out", str(Path(tmp) / f"out{jobs}"), "--jobs", str(jobs),
                   "--seed", "11", "--scenarios", str(args.scenarios), *(["-k", args.keyword] if args.keyword else [])]
            start = time.monotonic()
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            walls[jobs] = time.monotonic() - start
            print(f"--jobs {jobs}: {walls[jobs]:.0f} s for {args.checkouts} checkouts; load {os.getloadavg()}", flush=True)
        print(f"--jobs {args.jobs} / serial: {walls[args.jobs] / walls[1]:.2f}")
    return 0


def hang_cost() -> int:
    """One session, the grader's defaults: a complete checkout, then the same with check_stop hung."""
    from course.grade import Options, Session, grade

    with tempfile.TemporaryDirectory(prefix="grade-hang-") as tmp:
        files = reference_files()
        done = workspace(Path(tmp) / "complete" / "ch31", files)
        body = "        p = request.params\n        num_output = request.num_output_tokens\n"
        files["serve/engine.py"] = files["serve/engine.py"].replace(body, "        while True:\n            pass\n")
        hung = workspace(Path(tmp) / "hung" / "ch31", files)
        session = Session(Options(seed=11))
        print(f"load before: {os.getloadavg()}")
        walls = {}
        for name, path in (("complete", done), ("hung check_stop", hung)):
            start = time.monotonic()
            doc = grade(path, session)
            walls[name] = time.monotonic() - start
            print(f"{name}: {walls[name]:.0f} s, {doc['score']:g}/{doc['max_score']:g}; load {os.getloadavg()}", flush=True)
        print(f"the hung hole cost {walls['hung check_stop'] - walls['complete']:.0f} s more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
