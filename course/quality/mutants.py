"""Mutants: named, realistic bugs applied to the reference one at a time; the tests must catch each.

A test suite that passes the reference says little until it FAILS on the mistakes learners
actually make. Each mutant (a record of ``course/quality/data/mutants.toml``) is one exact text replacement in a chapter file whose holes are
filled from ``solutions/`` (``course.learner.testrun.reference_files``). It plays a learner who filled
every hole exactly as the reference, except for this one bug: a workspace
(``course.learner.testrun.workspace``, a temporary copy of the repository; the working tree is never
touched) gets those files in engine/ with the mutant applied, and the chapter's tests run
there in a subprocess under ``--impl engine`` — the learner's own route — restricted to the tests
of the holes the bug lives in plus the milestone, hole tests first, stopping at the first failure.
A mutant is
- killed: a test of its own hole failed (or, for a mutant marked ``own=False`` whose hole's
  contract cannot see it alone, any selected test); the table shows which, and its first line;
- LATE: only the milestone caught a bug its own hole's tests should have caught;
- SURVIVED: every selected test passed — the tests can't see this bug; strengthen them;
- stale: its text no longer matches the reference exactly once — update the mutant;
- broken: the run errored before any test failed (e.g. the mutated file doesn't import).

    python -m course.quality.mutants                 # all mutants, 2 workers; exit 1 unless all are killed
    python -m course.quality.mutants --list          # names and descriptions
    python -m course.quality.mutants slot-off-by-one-at-block-boundary eos-before-min-tokens
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from course.learner.testrun import CHAPTER_TESTS, reference_files, run_pytest, workspace
from course.learner.warm import WarmPool
from course.quality.records import DATA, FILE_OF, REQUIRED, filled, load


@dataclass(frozen=True)
class Mutant:
    """One bug: replace ``old`` (which must occur exactly once) by ``new`` in ``engine/<file>``
    with every hole filled.
    ``holes`` names the holes whose tests should catch it (the milestone always runs too);
    ``keyword``, when set, narrows those tests further (pytest ``-k``) to skip slow ones; ``own``
    says a test of one of ``holes`` must be the one to catch it."""

    name: str
    file: str
    holes: tuple[str, ...]
    old: str
    new: str
    why: str
    keyword: str = ""
    own: bool = True


def _file(r: dict) -> str:
    return r["file"] or FILE_OF[r["holes"][0]]  # a record names its file only where it is not its hole's


def load_mutants(path: Path = DATA / "mutants.toml") -> list[Mutant]:
    """The mutants of ``path`` (its head says what each field means), checked by ``records.load``."""
    fields = {"name": (str, REQUIRED), "holes": (tuple, REQUIRED), "file": (str, ""), "why": (str, REQUIRED),
              "find": (str, REQUIRED), "replace": (str, REQUIRED), "keyword": (str, ""), "own": (bool, True)}
    records = load(path, "mutant", fields, lambda r: (filled().get(_file(r), ""), f"the filled engine/{_file(r)}"))
    return [Mutant(r["name"], _file(r), r["holes"], r["find"], r["replace"], r["why"], r["keyword"], r["own"])
            for r in records]


MUTANTS: list[Mutant] = load_mutants()


@dataclass
class Result:
    mutant: Mutant
    status: str  # "killed" | "SURVIVED" | "stale" | "broken"
    killer: str = ""
    detail: str = ""
    seconds: float = 0.0


def check_applies(mutant: Mutant, files: dict[str, str] | None = None) -> str | None:
    """None if the mutant's text occurs exactly once in its filled chapter file, else why not."""
    files = files or filled()
    if mutant.file not in files:
        return f"engine/{mutant.file} is not a chapter file"
    count = files[mutant.file].count(mutant.old)
    return None if count == 1 else f"its text occurs {count} times in the filled engine/{mutant.file} (want exactly 1)"


# The bugs the chapter's milestone section lists, in its order (tests/test_mutants.py checks that
# the milestone alone catches each one).
MILESTONE_MUST_CATCH = ("kv-written-after-attention", "layer-reads-first-pool", "rope-by-row-index",
                        "seq-len-without-computed", "queries-at-first-positions",
                        "slot-off-by-one-at-block-boundary", "mid-prompt-chunk-samples",
                        "step-samples-indexed-by-request", "running-request-never-grows",
                        "cached-free-adoption-not-counted", "reused-block-keeps-old-hash",
                        "swap-in-into-wrong-blocks")


def apply_mutant(mutant: Mutant, files: dict[str, str]) -> dict[str, str]:
    """``files`` (chapter files by path under engine/) with the mutant's one replacement made;
    call ``check_applies`` first."""
    return {**files, mutant.file: files[mutant.file].replace(mutant.old, mutant.new)}


def run_mutant(mutant: Mutant, timeout: float = 600, milestone_only: bool = False,
               warm: WarmPool | None = None) -> Result:
    """Apply one mutant to the reference in a workspace's engine/ and run its selected tests (``-x``);
    ``milestone_only``: the milestone alone."""
    files = filled()
    stale = check_applies(mutant, files)
    if stale:
        return Result(mutant, "stale", detail=stale)
    files = apply_mutant(mutant, files)
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        bed = workspace(Path(tmp) / "repo", files)
        keyword = ["-k", f"({mutant.keyword}) or milestone"] if mutant.keyword else []
        select = [f"--hole={h}" for h in ([] if milestone_only else mutant.holes)] + ["--hole=milestone"]
        run = run_pytest(["-x", "-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS, *select,
                          *([] if milestone_only else keyword)], cwd=bed, timeout=timeout, per_test_timeout=120, warm=warm)
    failed = run.first_failure()
    if failed is not None and failed.outcome == "failed":
        first = failed.message.splitlines()[0] if failed.message else ""
        own = milestone_only or not mutant.own or bool(set(failed.holes) & set(mutant.holes))
        return Result(mutant, "killed" if own else "LATE", failed.name, first, run.seconds)
    if run.returncode == 0 and run.tests and all(t.passed for t in run.tests):
        return Result(mutant, "SURVIVED", detail=f"{len(run.tests)} selected tests passed", seconds=run.seconds)
    why = (failed.message if failed else "") or (run.collect_errors[0]["message"][-300:] if run.collect_errors
                                                 else run.output[-300:])
    if run.timed_out:
        why = f"timed out after {timeout:.0f} s"
    return Result(mutant, "broken", failed.name if failed else "", why.strip().splitlines()[-1] if why.strip() else "",
                  run.seconds)


def run_all(mutants: list[Mutant], workers: int = 2, progress=None, milestone_only: bool = False,
            warm: bool = True) -> list[Result]:
    """Every mutant, ``workers`` sessions at a time (forked from warm servers unless ``warm=False``);
    results in the order given."""
    with WarmPool() as servers, ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(run_mutant, m, 600, milestone_only, servers if warm else None) for m in mutants]
        results = []
        for f in futures:
            results.append(f.result())
            if progress:
                progress(results[-1])
        return results


def baseline() -> str | None:
    """None if every hole filled with the reference passes every chapter test the mutants' way, else why."""
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        run = run_pytest(["-x", "-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS],
                         cwd=workspace(Path(tmp) / "repo", reference_files()))
    if run.returncode == 0 and run.tests and all(t.passed for t in run.tests):
        return None
    failed = run.first_failure()
    return f"{failed.name}: {failed.message}" if failed else run.output[-500:]


def format_table(results: list[Result]) -> str:
    rows = [("mutant", "file", "status", "killed by", "s")]
    for r in results:
        killer = r.killer + (f"  ({r.detail[:70]})" if r.detail else "")
        rows.append((r.mutant.name, r.mutant.file, r.status, killer, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run only these mutants (default: all)")
    ap.add_argument("--workers", type=int, default=2, help="test subprocesses at a time (default 2)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip checking that the unmutated copy passes")
    args = ap.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:45s} {m.file:20s} {m.why}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"unknown mutant(s) {unknown}; `python -m course.quality.mutants --list` names them", file=sys.stderr)
        return 2
    chosen = [by_name[n] for n in args.names] if args.names else MUTANTS
    start = time.monotonic()
    if not args.no_baseline:
        why = baseline()
        if why:
            print(f"the unmutated reference fails its own tests, so no mutant result means anything:\n  {why}")
            return 1
        print(f"baseline: the unmutated copy passes ({time.monotonic() - start:.0f} s)")
    from tqdm import tqdm

    with tqdm(total=len(chosen), desc="mutants", unit="mutant", dynamic_ncols=True) as bar:
        def progress(r: Result) -> None:  # one line per result above the bar: done/total, elapsed, ETA
            bar.write(f"  {r.status:8s} {r.mutant.name}")
            bar.update(1)

        results = run_all(chosen, args.workers, progress=progress)
    print()
    print(format_table(results))
    bad = [r for r in results if r.status != "killed"]
    print(f"\n{len(results) - len(bad)}/{len(results)} mutants killed in {time.monotonic() - start:.0f} s"
          + (f"; not killed: {', '.join(r.mutant.name + ' (' + r.status + ')' for r in bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
