"""Honest checkouts under the sandboxed grader: the reference, the unfilled skeleton and a few mutants
(``course/quality/mutants.py``: one realistic bug each), graded in one session, old rule against new.

    python -m course.grading.grade_table [--seed 11] [--jobs 2] [MUTANT ...]

"old" is what the pytest-only grader gave: each row's weight times the fraction of its tests that
passed. "new" is the grade: that, capped by the fraction of the row's verified scenarios that matched
the reference (``course/grading/grade.py``'s ``apply_verdict``). Every row whose cap bit is listed under the
table with its scenario counts, so each difference can be read off.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from course.bench.machine import machine_line  # noqa: E402
from course.learner.testrun import reference_files, skeleton_files, workspace  # noqa: E402

MUTANTS = ("recompute-keeps-stale-num-computed", "cached-prefix-includes-last-token-block",
           "slot-off-by-one-at-block-boundary", "head-first-free", "eos-before-min-tokens",
           "hash-ignores-cache-key", "abort-leaks-blocks", "v-pool-gets-k")


def old_score(doc: dict) -> float:
    """The pytest-only grade: every row's weight times its tests' pass fraction, uncapped."""
    rows = [*doc["holes"], doc["milestone"], doc["engine_checks"]]
    return round(sum(round(r["weight"] * r["passed"] / r["total"], 2) if r["total"] else 0.0 for r in rows), 2)


def capped_rows(doc: dict) -> list[str]:
    out = []
    for r in [*doc["holes"], doc["milestone"], doc["engine_checks"]]:
        old = round(r["weight"] * r["passed"] / r["total"], 2) if r["total"] else 0.0
        if abs(old - r["score"]) > 1e-9:
            out.append(f"{r['name']} {old:g} -> {r['score']:g} (tests {r['passed']}/{r['total']}; "
                       f"scenarios {r.get('matched', '?')}/{r.get('scenarios', '?')} matched)")
    return out


def main() -> int:
    from course.grading.grade import Options, Session, grade_or_error, status_of_doc
    from course.quality.mutants import MUTANTS as ALL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mutants", nargs="*", default=list(MUTANTS))
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--save", type=Path, default=None, help="write each checkout's grade.json into this folder")
    args = ap.parse_args()
    by_name = {m.name: m for m in ALL}
    unknown = [m for m in args.mutants if m not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutants: {', '.join(unknown)}")
    print(f"machine: {machine_line()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="grade-table-") as tmp:
        checkouts = {"reference": workspace(Path(tmp) / "reference" / "ch31", reference_files()),
                     "skeleton": workspace(Path(tmp) / "skeleton" / "ch31", skeleton_files())}
        for name in args.mutants:
            files = reference_files()
            m = by_name[name]
            files[m.file] = files[m.file].replace(m.old, m.new)
            checkouts[name] = workspace(Path(tmp) / name / "ch31", files)
        start = time.monotonic()
        session = Session(Options(seed=args.seed))
        print(f"session (seed {session.seed}, {len(session.specs)} scenarios): {time.monotonic() - start:.0f} s",
              flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            # grade_or_error: a grader error costs that row only, never the table
            docs = dict(zip(checkouts, pool.map(lambda p: grade_or_error(p, session, jobs=args.jobs),
                                                checkouts.values())))
    if args.save:
        import json

        args.save.mkdir(parents=True, exist_ok=True)
        for name, doc in docs.items():
            (args.save / f"{name}.json").write_text(json.dumps(doc, indent=1))
    print(f"\n| checkout | old (pytest only) | new (verified cap) | difference |\n|---|---:|---:|---:|")
    for name, doc in docs.items():
        old = old_score(doc)
        note = "" if status_of_doc(doc) != "error" else f" (error: {doc['problems'][0]})"
        print(f"| {name} | {old:g} | {doc['score']:g}{note} | {doc['score'] - old:+.2f} |")
    print()
    for name, doc in docs.items():
        for line in capped_rows(doc):
            print(f"{name}: {line}")
        for r in [*doc["holes"], doc["milestone"], doc["engine_checks"]]:
            for f in r["failures"]:
                if "stopped after" in f["message"] or "never ran" in f["message"]:
                    print(f"{name}: {r['name']}: {f['test']}: {f['message']}")
    print(f"\n{time.monotonic() - start:.0f} s in all; load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
