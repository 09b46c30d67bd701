"""How much ``run.py grade --jobs N`` saves: N complete checkouts graded serially, then with --jobs.

    python scripts/grade_timing.py [--checkouts 20] [--jobs 2] [--scenarios 2]

Both sittings share one seed; prints each wall time, the ratio, and the CPU it ran on. The machine's
load matters (a shared machine gives a noisy ratio): the load average is printed beside the figures.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from course.testrun import reference_files, workspace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkouts", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--scenarios", type=int, default=2)
    ap.add_argument("-k", dest="keyword", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grade-timing-") as tmp:
        paths = [str(workspace(Path(tmp) / f"learner{i}" / "ch31", reference_files())) for i in range(args.checkouts)]
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   platform.processor())
        print(f"cpu: {cpu}, {os.cpu_count()} cores; load before: {os.getloadavg()}")
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


if __name__ == "__main__":
    sys.exit(main())
