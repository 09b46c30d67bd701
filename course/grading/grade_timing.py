"""How much ``run.py grade --jobs N`` saves: N complete checkouts graded serially, then with --jobs.

    python -m course.grading.grade_timing [--checkouts 20] [--jobs 2] [--scenarios 2]
    python -m course.grading.grade_timing --hang      # what a hung hole costs with the defaults
    python -m course.grading.grade_timing --threads   # the milestone's scenarios on the reference, 1 vs 2 torch threads
    python -m course.grading.grade_timing --phases    # where one complete checkout's time goes
    python -m course.grading.grade_timing --sleep     # what a time.sleep at import costs
    python -m course.grading.grade_timing --parsing   # hostile chapter files: the grader's and the parsing child's cost

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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from course.bench.machine import machine_line  # noqa: E402
from course.learner.testrun import reference_files, workspace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkouts", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--scenarios", type=int, default=2)
    ap.add_argument("-k", dest="keyword", default="")
    ap.add_argument("--hang", action="store_true", help="grade a complete checkout and one whose check_stop hangs")
    ap.add_argument("--threads", action="store_true", help="time the milestone's scenarios with 1 and 2 threads")
    ap.add_argument("--phases", action="store_true", help="the session's set-up, then one complete checkout by phase")
    ap.add_argument("--parsing", action="store_true", help="a 20 MiB file, a 1.9 MiB literal, a 600-term expression")
    ap.add_argument("--sleep", action="store_true", help="a complete checkout, the same with a sleep at import")
    args = ap.parse_args()
    if args.parsing:
        return parsing_cost()
    if args.hang:
        return hang_cost()
    if args.sleep:
        return sleep_cost()
    if args.phases:
        return phase_cost()
    if args.threads:
        return thread_cost()
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


def parsing_cost() -> int:
    """``grade_or_error`` on checkouts whose engine/serve/blocks.py is the course's plus a hostile text
    (the sandboxed runs are never reached): seconds, the grader's own peak RSS growth, the children's."""
    import resource

    import course.grading.grade as g
    from course.learner.testrun import skeleton_files

    class Session:
        opts, seed, bwrap, specs, reference, tests = g.Options(unsafe=True), 1, None, [], {}, []

    sk, rel = skeleton_files(), "serve/blocks.py"
    cases = {"a 20 MiB list literal": sk[rel] + "\nBIG = [" + "1, " * ((20 << 20) // 3) + "]\n",
             "a 1.9 MiB list literal": sk[rel] + "\nBIG = [" + "1, " * ((19 << 20) // 30) + "]\n",
             "a 600-term expression": sk[rel] + "\n\ndef _h():\n    return " + "+".join(["1"] * 600) + "\n"}
    print("| chapter file | MiB | seconds | grader MiB | children's peak MiB | row |")
    for name, text in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            for r, t in {**sk, rel: text}.items():
                (Path(tmp) / "engine" / r).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / "engine" / r).write_text(t)
            before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
            doc = g.grade_or_error(Path(tmp), Session())
            wall = time.monotonic() - start
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
        print(f"| {name} | {len(text) / (1 << 20):.1f} | {wall:.1f} | {grown} | "
              f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss >> 10} | {g.status_of_doc(doc)}: "
              f"{doc['problems'][0][:90] if doc['problems'] else ''} |", flush=True)
    print(f"load {os.getloadavg()}")
    return 0


def hang_cost() -> int:
    """One session, the grader's defaults: a complete checkout, then the same with check_stop hung."""
    from course.grading.grade import Options, Session, grade

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
            with TreeCpu() as cpu:
                doc = grade(path, session)
            walls[name] = time.monotonic() - start
            print(f"{name}: {walls[name]:.0f} s ({cpu.seconds:.0f} CPU-s), {doc['score']:g}/{doc['max_score']:g}; "
                  f"load {os.getloadavg()}", flush=True)
        print(f"the hung hole cost {walls['hung check_stop'] - walls['complete']:.0f} s more")
    return 0


class TreeCpu:
    """CPU seconds (user + system) of this process and every process under it, sandboxed ones included,
    while in use (``with TreeCpu() as cpu: ...; cpu.seconds``). Sampled from /proc every 0.2 s (a
    sandbox's processes are not waited for by the grader, so RUSAGE_CHILDREN misses them); a process
    that lived less than 0.2 s may be missed, and one's last 0.2 s too."""

    def __init__(self) -> None:
        import threading

        self.seen: dict[tuple[int, int], float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.tick = os.sysconf("SC_CLK_TCK")

    def _stat(self, pid: str) -> tuple[int, int, float] | None:
        try:
            raw = Path(f"/proc/{pid}/stat").read_bytes()
            f = raw[raw.rindex(b")") + 2:].split()
            return int(f[1]), int(f[19]), (int(f[11]) + int(f[12])) / self.tick  # ppid, start, utime + stime
        except (OSError, ValueError, IndexError):
            return None

    def _sample(self) -> None:
        stats = {int(p): st for p in os.listdir("/proc") if p.isdigit() and (st := self._stat(p))}
        mine, me = {}, os.getpid()
        for pid in stats:
            chain, p = [], pid
            while p in stats and p != me and p not in mine and len(chain) < 64:
                chain.append(p)
                p = stats[p][0]
            under = p == me or mine.get(p, False)
            for c in chain:
                mine[c] = under
        for pid, under in mine.items():
            if under:
                key = (pid, stats[pid][1])
                self.seen[key] = max(self.seen.get(key, 0.0), stats[pid][2])

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            self._sample()

    def __enter__(self) -> "TreeCpu":
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)
        self.own = r.ru_utime + r.ru_stime
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import resource

        self.stop.set()
        self.thread.join()
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.seconds = r.ru_utime + r.ru_stime - self.own + sum(self.seen.values())


SLEEP = "\nimport time as _tm\n_tm.sleep(100000)\n"  # tests/test_grading_attacks.py's sleep at import


def sleep_cost() -> int:
    """One session, the grader's defaults, seed 11: a complete checkout; the same with ``time.sleep``
    at the end of serve/batch.py (the attack suite's: module-level code, which the grader's assembled
    module leaves out); and that sleep put back into the assembled module after assembly, as if the
    assembler had let it through: what the start-up watchdog bounds (the test run's 90 s, then the
    scenario run's 30 s)."""
    from course.grading import grade as grading

    with tempfile.TemporaryDirectory(prefix="grade-sleep-") as tmp:
        files = reference_files()
        done = workspace(Path(tmp) / "complete" / "ch31", files)
        slept = workspace(Path(tmp) / "sleep" / "ch31", {**files, "serve/batch.py": files["serve/batch.py"] + SLEEP})
        session = grading.Session(grading.Options(seed=11))
        print(f"machine: {machine_line()}")
        place = grading.place_chapter_files

        def place_with_sleep(parent, graded):
            bed = place(parent, graded)
            with open(bed / "engine" / "serve" / "batch.py", "a") as f:
                f.write(SLEEP)
            return bed

        walls = {}
        for name, path, placer in (("complete", done, place), ("sleep at import (left out)", slept, place),
                                   ("sleep at import, run (the watchdog's bound)", done, place_with_sleep)):
            grading.place_chapter_files = placer
            start = time.monotonic()
            try:
                with TreeCpu() as cpu:
                    doc = grading.grade(path, session)
            finally:
                grading.place_chapter_files = place
            walls[name] = time.monotonic() - start
            print(f"{name}: {walls[name]:.0f} s ({cpu.seconds:.0f} CPU-s), {doc['score']:g}/{doc['max_score']:g}"
                  f"{'; ' + doc['problems'][0][:100] if doc['problems'] else ''}; load {os.getloadavg()}", flush=True)
    return 0


def phase_cost() -> int:
    """The grader's defaults, seed 11: the session's set-up (scenario results on the reference, the
    test collection), then one complete checkout, its sandboxed runs timed one by one."""
    from course.grading import grade as grading
    from course.isolation import watchdog

    spent: dict[str, float] = {}

    def timed(module, name: str) -> None:
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.monotonic() - start
        setattr(module, name, wrapper)

    for name in ("run_tests", "run_scenarios"):
        timed(watchdog, name)
    print(f"machine: {machine_line()}")
    start = time.monotonic()
    session = grading.Session(grading.Options(seed=11))
    print(f"session set-up: {time.monotonic() - start:.1f} s; load {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="grade-phases-") as tmp:
        path = workspace(Path(tmp) / "complete" / "ch31", reference_files())
        start = time.monotonic()
        with TreeCpu() as cpu:
            doc = grading.grade(path, session)
        whole = time.monotonic() - start
    print(f"one complete checkout: {whole:.1f} s ({doc['score']:g}/{doc['max_score']:g}; {cpu.seconds:.1f} CPU-s): the tests "
          f"in the sandbox {spent['run_tests']:.1f} s, the scenarios {spent['run_scenarios']:.1f} s, the rest "
          f"{whole - sum(spent.values()):.1f} s; load {os.getloadavg()}")
    return 0


def thread_cost(rounds: int = 3) -> int:
    """The four milestone scenarios on the reference, each sitting a fresh process, 1 and 2 torch
    threads interleaved: why the grader's children run one thread (Options.threads)."""
    import json
    import statistics

    code = ("import json, sys, time; from course.grading.scenarios import make_scenarios, run_scenario; "
            "specs = [s for s in make_scenarios(11) if s['group'] == 'milestone']; run_scenario(specs[0]); "
            "t = time.monotonic(); [run_scenario(s) for s in specs]; print(json.dumps(time.monotonic() - t))")
    print(f"machine: {machine_line()}")
    walls: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(rounds):
        for n in walls:
            env = {**os.environ, "ENGINE_IMPL": "solution", "OMP_NUM_THREADS": str(n), "PYTHONPATH": str(ROOT)}
            out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                                 check=True).stdout
            walls[n].append(json.loads(out.strip().splitlines()[-1]))
    for n, w in walls.items():
        print(f"{n} thread(s): median {statistics.median(w):.2f} s over {rounds} sittings ({', '.join(f'{x:.2f}' for x in w)})")
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
