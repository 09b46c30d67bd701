"""Honest checkouts under the sandboxed grader: the reference, the unfilled skeleton and a few mutants
(``course/quality/mutants.py``: one realistic bug each), graded in one session, old rule against new.

    python -m course.quality.grade_table [--seed 11] [--jobs 2] [MUTANT ...]
    python -m course.quality.grade_table --bugs [--seed 11] [--jobs 2] [BUG ...]

``--bugs``: the learner-bug corpus (``course/quality/bug_corpus.py``, the corpus and the held-out bugs)
graded through the grader's own ``grade`` with ``Options(run_tests=False)``: no pytest run, every test
counted as passed, so a row earns exactly its scenarios' share and a bug "loses points at its own hole"
only when the scenarios see it. Only the scenario groups that decide the bug's own row run
(``groups_for``: the groups of the scenarios that check the hole, and of those that check the holes
those scenarios depend on); the verdict is computed on those rows exactly as on the full list
(``verify.verdicts``: a hole's row reads only its own scenarios and its dependencies' own ones).

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


def groups_for(hole: str, specs: list[dict]) -> set[str]:
    """The scenario groups that decide ``hole``'s row: those of the scenarios that check it, and those of
    the scenarios that check the holes they depend on (``verify.verdicts`` counts a failure against a
    hole only where its dependencies verified on their own scenarios)."""
    own = [s for s in specs if hole in s["holes"]]
    deps = {d for s in own for d in s["deps"]}
    return {s["group"] for s in own} | {s["group"] for s in specs if deps & set(s["holes"])}


def bug_rows(session, bugs: list, jobs: int, progress=print) -> list[dict]:
    """Each bug graded by the grader (``grade_or_error``), the scenarios alone, on its own hole's groups:
    {"bug", "hole", "kind", "score", "weight", "matched", "scenarios", "verified", "message", "seconds"}."""
    import copy
    from dataclasses import replace

    from course.grading.grade import grade_or_error
    from course.quality.mutants import apply_mutant, check_applies

    ref = reference_files()

    def one(args) -> dict:
        tmp, b = args
        hole = b.holes[0]
        honest = b.name == "(reference)"  # the reference: every group, every row must be full
        groups = {s["group"] for s in session.specs} if honest else groups_for(hole, session.specs)
        sub = copy.copy(session)  # the same seed, reference answers and test list; fewer scenario rows
        sub.opts = replace(session.opts, run_tests=False, only_groups=tuple(sorted(groups)))
        sub.specs = [s for s in session.specs if s["group"] in groups]
        start = time.monotonic()
        stale = None if honest else check_applies(b, ref)
        if stale:
            return {"bug": b.name, "hole": hole, "kind": b.kind, "stale": stale}
        files = ref if honest else apply_mutant(b, ref)
        doc = grade_or_error(workspace(Path(tmp) / b.name / "ch31", files), sub)
        rows = {r["name"]: r for r in [*doc["holes"], doc["milestone"], doc["engine_checks"]]}
        r = rows.get(hole) or {}
        out = {"bug": b.name, "hole": hole, "kind": b.kind, "score": r.get("score", 0.0),
               "weight": r.get("weight", 0.0), "matched": r.get("matched", 0), "scenarios": r.get("scenarios", 0),
               "verified": r.get("verified", "?"), "message": (r.get("feedback") or [""])[0],
               "error": doc.get("error") or "", "seconds": round(time.monotonic() - start, 1),
               "full": all(x["score"] >= x["weight"] for n, x in rows.items()
                           if {s["group"] for s in sub.specs if n in s["holes"]})}
        progress(f"  {'KEPT' if out['score'] >= out['weight'] else 'lost':4s} {b.name:45s} {hole:32s} "
                 f"{out['matched']}/{out['scenarios']} {out['seconds']:.0f} s")
        return out

    with tempfile.TemporaryDirectory(prefix="grade-bugs-") as tmp, ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, [(tmp, b) for b in bugs]))


def bugs_main(args) -> int:
    """``--bugs``: the corpus through the grader; the table for docs/grading.md."""
    from course.grading.grade import Options, Session
    from course.quality.bug_corpus import BUGS, HELD_OUT, Bug

    every = {b.name: b for b in BUGS + HELD_OUT}
    unknown = [n for n in args.mutants if n not in every]
    if unknown:
        raise SystemExit(f"unknown bugs: {', '.join(unknown)} (python -m course.quality.bug_corpus --list)")
    chosen = [every[n] for n in args.mutants] if args.mutants else [b for b in BUGS + HELD_OUT if not b.equivalent]
    print(f"machine: {machine_line()}", flush=True)
    start = time.monotonic()
    session = Session(Options(seed=args.seed))
    print(f"session (seed {session.seed}, {len(session.specs)} scenarios): {time.monotonic() - start:.0f} s",
          flush=True)
    honest = Bug("(reference)", "serve/batch.py", ("build_batch",), "", "", "the reference itself")
    # the reference through the same mode: every row full, or the mode (or a scenario) is wrong
    ref = bug_rows(session, [honest], 1)[0]
    rows = bug_rows(session, chosen, args.jobs)
    real = [r for r in rows if "stale" not in r and not every[r["bug"]].equivalent]
    lost = [r for r in real if r["score"] < r["weight"]]
    print(f"\nthe reference, every scenario group: {'full points' if ref['full'] else 'NOT FULL'}")
    print(f"real bugs that lose points at their own hole: {len(lost)}/{len(real)} = "
          f"{len(lost) / max(1, len(real)):.1%} (corpus {sum(r['bug'] in {b.name for b in BUGS} for r in lost)}/"
          f"{sum(r['bug'] in {b.name for b in BUGS} for r in real)}, held out "
          f"{sum(r['bug'] in {b.name for b in HELD_OUT} for r in lost)}/"
          f"{sum(r['bug'] in {b.name for b in HELD_OUT} for r in real)})")
    by_hole: dict[str, list[dict]] = {}
    for r in real:
        by_hole.setdefault(r["hole"], []).append(r)
    print("\n| hole | real bugs | lose points | keep full points |\n|---|---:|---:|---|")
    for hole, rs in by_hole.items():
        print(f"| {hole} | {len(rs)} | {sum(r['score'] < r['weight'] for r in rs)} | "
              f"{', '.join(r['bug'] for r in rs if r['score'] >= r['weight'])} |")
    for r in rows:
        if "stale" in r or r.get("error"):
            print(f"{r['bug']}: {r.get('stale') or r['error']}")
    print(f"\n{time.monotonic() - start:.0f} s in all; load {os.getloadavg()}")
    if args.save:
        import json

        args.save.mkdir(parents=True, exist_ok=True)
        (args.save / "bugs.json").write_text(json.dumps({"seed": session.seed, "reference": ref, "rows": rows},
                                                        indent=1))
    from course.quality.bug_corpus import MIN_BY_CHAPTER

    # the bar: at least 95% of the real bugs lose points at their own hole, and the reference is full
    return 0 if ref["full"] and len(lost) >= MIN_BY_CHAPTER * len(real) else 1


def main() -> int:
    from course.grading.grade import Options, Session, grade_or_error, status_of_doc
    from course.quality.mutants import MUTANTS as ALL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mutants", nargs="*", default=[])
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--bugs", action="store_true", help="the bug corpus through the grader, scenarios alone")
    ap.add_argument("--save", type=Path, default=None, help="write each checkout's grade.json into this folder")
    args = ap.parse_args()
    if args.bugs:
        return bugs_main(args)
    args.mutants = args.mutants or list(MUTANTS)
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
