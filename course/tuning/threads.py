"""``python -m course.tuning.threads``: does a second thread pay? The fast core on one workload at
one and two torch threads, interleaved rounds, each run a fresh ``run.py bench`` process.

Each round runs, per dtype and OpenMP spin policy, one thread then two (the order alternates from
round to round, so a slow spell of a shared machine does not always land on the same count). A
process per run, because the spin policy is read once, when torch loads its OpenMP runtime
(``engine/fast/openmp.py``): ``probe`` leaves the choice to ``run.py``'s probe of the load; any
other policy is ``VAR=VALUE[,VAR=VALUE]`` set in the run's environment (``GOMP_SPINCOUNT=300000``
is libgomp's default). Printed per run: wall and CPU seconds, the load average before and after,
the CPU the machine's other processes used just before it (``openmp.others_busy``, in cores: the
load average also counts this tool's own previous run) and during it (the machine's busy time less
the run's own, per second: a run that shared its cores says so), the policy the run had; then per dtype and policy the medians, tokens per wall-second and per
CPU-second, and the two-thread ratios as the median of each round's pair (ratios taken side by
side, the figure that survives a shared machine best). Issue 40's target: two threads at least
1.7x one thread's tokens per wall-second on the random workload, on a machine with both cores free.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course.bench.machine import machine_line
from engine.fast import openmp

ROOT = Path(__file__).resolve().parents[2]


def policy_env(policy: str) -> dict[str, str]:
    """``probe`` -> {} (run.py decides); ``VAR=VALUE[,VAR=VALUE]`` -> those variables; ValueError otherwise."""
    if policy == "probe":
        return {}
    env = {}
    for part in policy.split(","):
        name, eq, value = part.partition("=")
        if not eq or name not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
            raise ValueError(f"spin policy {policy!r}: 'probe' or GOMP_SPINCOUNT=N / OMP_WAIT_POLICY=PASSIVE|ACTIVE")
        env[name] = value
    return env


QUIET_CORES = 0.25  # --quiet-wait: a run starts once the other processes use less than this (cores)


def wait_quiet(seconds: float) -> float | None:
    """Sample the other processes' CPU (``openmp.others_busy``, cores) until it is below
    ``QUIET_CORES`` or ``seconds`` have passed (0: one sample); returns the last sample."""
    deadline = time.monotonic() + seconds
    while True:
        others = openmp.others_busy()
        if others is None or others < QUIET_CORES or time.monotonic() >= deadline:
            return others
        time.sleep(1.0)


def busy_core_seconds() -> float | None:
    """Core-seconds of non-idle time on all cores since boot (/proc/stat), None where unreadable."""
    ticks = openmp.cpu_ticks()
    return None if ticks is None else ticks[0] / os.sysconf("SC_CLK_TCK")


def one_run(workload: str, preset: str, dtype: str, threads: int, policy: str, scale: float,
            quiet_wait: float = 0.0) -> dict:
    """One ``run.py bench`` process: the fast core on ``workload``; its row, the load, the other
    processes' CPU before it (after waiting up to ``quiet_wait`` s for a quiet machine) and during it
    (the machine's busy core-seconds over the run less the child's own CPU time, per second), and
    the policy it had."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(policy_env(policy))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        others = wait_quiet(quiet_wait)  # this process asleep: the other processes' CPU
        load0 = os.getloadavg()[0]
        busy0, child0, start = busy_core_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "bench", "--workloads", workload, "--engines", "fast",
                               "--scaling", "", "--no-roofline", "--preset", preset, "--dtype", dtype, "--threads",
                               str(threads), "--scale", str(scale), "--json", str(out)],
                              env=env, cwd=ROOT, capture_output=True, text=True)
        busy1, child1, elapsed = busy_core_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - start
        during = None
        if busy0 is not None and busy1 is not None and elapsed > 0:
            mine = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
            during = max(0.0, (busy1 - busy0 - mine) / elapsed)
        if proc.returncode:
            raise RuntimeError(f"run.py bench failed ({dtype}, {threads} threads, {policy}):\n{proc.stderr[-2000:]}")
        report = json.loads(out.read_text())
    (row,) = report["workloads"][workload]
    return {"wall": row["seconds"], "cpu": row["cpu_seconds"], "tokens": row["output_tokens"],
            "load": (load0 + os.getloadavg()[0]) / 2, "others": others, "others_during": during,
            "openmp": report["machine"].get("openmp")}


def _cores(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _quiet(run: dict) -> bool:
    """Whether the other processes used under ``QUIET_CORES`` during the run (unknown: not quiet)."""
    return run.get("others_during") is not None and run["others_during"] < QUIET_CORES


def summarize(runs: dict[tuple[str, str, int], list[dict]]) -> list[dict]:
    """Per (dtype, policy): medians at each thread count and the two-thread ratios (median of per-round
    pairs); ``x_wall_quiet``: the wall ratio over the rounds whose two runs both ran on a quiet machine
    (``quiet_pairs`` of them; None when none did)."""
    rows = []
    for dtype, policy in dict.fromkeys((d, p) for d, p, _ in runs):
        one, two = runs[(dtype, policy, 1)], runs[(dtype, policy, 2)]
        tokens = one[0]["tokens"]
        row = {"dtype": dtype, "policy": policy, "rounds": len(one)}
        for t, rs in ((1, one), (2, two)):
            row[f"tok_s_{t}"] = round(tokens / statistics.median(r["wall"] for r in rs), 1)
            row[f"tok_cpu_s_{t}"] = round(tokens / statistics.median(r["cpu"] for r in rs), 1)
            row[f"load_{t}"] = round(statistics.median(r["load"] for r in rs), 2)
            for key in ("others", "others_during"):
                seen = [r[key] for r in rs if r.get(key) is not None]
                row[f"{key}_{t}"] = round(statistics.median(seen), 2) if seen else None
        row["x_wall"] = round(statistics.median(a["wall"] / b["wall"] for a, b in zip(one, two)), 3)
        row["x_cpu"] = round(statistics.median(a["cpu"] / b["cpu"] for a, b in zip(one, two)), 3)
        quiet = [a["wall"] / b["wall"] for a, b in zip(one, two) if _quiet(a) and _quiet(b)]
        row["quiet_pairs"] = len(quiet)  # rounds whose two runs both had the cores to themselves
        row["x_wall_quiet"] = round(statistics.median(quiet), 3) if quiet else None
        rows.append(row)
    return rows


def print_summary(rows: list[dict], workload: str) -> None:
    print(f"\n{workload}: two threads against one (medians; x = median of the rounds' 2-thread / 1-thread ratios; "
          "per CPU-s: 1.00x means the second thread cost no extra CPU time; other: cores the other processes used "
          "just before / during a run; x quiet: the wall ratio over the rounds whose runs both had under "
          f"{QUIET_CORES} core of other processes during them)")
    head = (f"{'dtype':9s} {'spin policy':22s} {'1t tok/s':>9s} {'tok/CPU-s':>9s} {'load':>5s} {'other':>9s} "
            f"{'2t tok/s':>9s} {'tok/CPU-s':>9s} {'load':>5s} {'other':>9s} {'x wall':>7s} {'x CPU':>6s} {'x quiet (pairs)':>15s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        quiet = "-" if r.get("x_wall_quiet") is None else f"{r['x_wall_quiet']:.2f}x ({r['quiet_pairs']})"
        other = {t: "/".join("?" if r.get(f"{k}_{t}") is None else f"{r[f'{k}_{t}']:.2f}" for k in ("others", "others_during"))
                 for t in (1, 2)}
        print(f"{r['dtype']:9s} {r['policy']:22s} {r['tok_s_1']:9.1f} {r['tok_cpu_s_1']:9.1f} {r['load_1']:5.2f} {other[1]:>9s} "
              f"{r['tok_s_2']:9.1f} {r['tok_cpu_s_2']:9.1f} {r['load_2']:5.2f} {other[2]:>9s} {r['x_wall']:6.2f}x "
              f"{r['x_cpu']:5.2f}x {quiet:>15s}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.tuning.threads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    ap.add_argument("--spin", default="probe", help="';'-separated spin policies: 'probe' (run.py's choice) or "
                                                    "VAR=VALUE[,VAR=VALUE] (default: probe)")
    ap.add_argument("--workload", default="random", help="the bench workload (default random)")
    ap.add_argument("--preset", default="small", help="the bench preset (default small)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workload's request counts")
    ap.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help=f"before each run wait up to S seconds for the other processes to use under {QUIET_CORES} "
                         "core (issue 40's target is for a machine with both cores free; default 0: no wait)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the runs and the summary as JSON")
    args = ap.parse_args(argv)
    policies = [p for p in args.spin.split(";") if p]
    try:
        for p in policies:
            policy_env(p)
    except ValueError as exc:
        ap.error(str(exc))
    if args.rounds < 1 or not policies:
        ap.error("--rounds must be >= 1 and --spin must name a policy")
    dtypes = [d for d in args.dtypes.split(",") if d]
    print(f"machine: {machine_line()}", flush=True)
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for k in range(args.rounds):
        for dtype in dtypes:
            for policy in policies:
                for threads in ((1, 2) if k % 2 == 0 else (2, 1)):
                    r = one_run(args.workload, args.preset, dtype, threads, policy, args.scale, args.quiet_wait)
                    runs.setdefault((dtype, policy, threads), []).append(r)
                    print(f"round {k} {dtype:9s} {policy:22s} {threads}t: wall {r['wall']:.2f} s, CPU {r['cpu']:.2f} s, "
                          f"load {r['load']:.2f}, other processes {_cores(r['others'])} core(s) before, "
                          f"{_cores(r['others_during'])} during [{r['openmp']}]", flush=True)
    rows = summarize(runs)
    print_summary(rows, args.workload)
    print(f"machine at the end: {machine_line()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "summary": rows,
                       "runs": [{"dtype": d, "policy": p, "threads": t, **r} for (d, p, t), rs in runs.items()
                                for r in rs]}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
