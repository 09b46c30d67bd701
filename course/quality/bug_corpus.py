"""The learner-bug corpus: bugs a learner makes filling the holes from their docstrings, and how the
chapter's tests catch each one.

``course/quality/mutants.py`` holds the bugs the chapter's tests must kill at their own hole (each one a
test was written for). This corpus is the other half of that check: bugs invented by playing a
learner who has read only the handout (``make handout``), one realistic mistake at a time, over
every hole — off-by-ones, a wrong field, a wrong order, a missed case, a counter not kept, a
failure path not taken, state not reset — to measure how many the tests catch, where, and
whether the first failure's message points at the cause. A bug (a record of
``course/quality/data/bug_corpus.toml``) is a ``Mutant`` (one exact text
replacement in the reference; the same ``check_applies`` / ``apply_mutant`` / ``workspace``
machinery) plus its class, a few cause words, and, for a bug that cannot change behaviour,
``equivalent`` with why.

Each bug runs in a workspace (a temporary copy of the repository; the working tree is never
touched) under ``--impl engine``, stopping at the first failure:
(a) the owning hole's own tests (``--hole X``: the reference fills every other hole) -> caught by
the hole; (b) if none failed, the whole chapter file, every hole the learner's -> caught by the
chapter. "Names the cause": the first failure's message contains one of the bug's cause words.

    python -m course.quality.bug_corpus                         # run all, print the table (2 workers)
    python -m course.quality.bug_corpus --table docs/bug-corpus.md   # ... and write the committed table
    python -m course.quality.bug_corpus --list                  # names, holes, classes
    python -m course.quality.bug_corpus bb-positions-from-zero  # some bugs only
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from course.bench.machine import machine_line
from course.quality.mutants import Mutant, apply_mutant, check_applies
from course.learner.testrun import CHAPTER_TESTS, run_pytest, workspace
from course.learner.warm import WarmPool
from course.quality.records import DATA, FILE_OF, REQUIRED, RecordError, filled, hole_body, load

# The rates the corpus must reach over its non-equivalent bugs (tests/test_bug_corpus.py).
MIN_BY_CHAPTER = 0.95
MIN_BY_HOLE = 0.90

KINDS = ("off-by-one", "wrong field", "wrong order", "missed case", "counter", "failure path", "state not reset",
         "wrong formula", "wrong container")


@dataclass(frozen=True)
class Bug(Mutant):
    """A corpus bug: a ``Mutant`` (its ``holes`` hold the one owning hole) plus ``kind`` (a class of
    KINDS), ``cause`` (words a message naming the cause would contain) and ``equivalent`` (why it
    cannot change behaviour; empty for a real bug)."""

    kind: str = ""
    cause: tuple[str, ...] = ()
    equivalent: str = ""


def _bug(r: dict) -> Bug:
    return Bug(r["name"], FILE_OF[r["hole"]], (r["hole"],), r["find"], r["replace"], r["why"], keyword=r["keyword"],
               kind=r["kind"], cause=r["cause"], equivalent=r["equivalent"])


def load_bugs(table: str, path: Path = DATA / "bug_corpus.toml") -> list[Bug]:
    """The ``[[table]]`` bugs of ``path`` (its head says what each field means), checked by
    ``records.load``; a kind outside KINDS is an error too."""
    fields = {"name": (str, REQUIRED), "hole": (str, REQUIRED), "kind": (str, REQUIRED), "why": (str, REQUIRED),
              "find": (str, REQUIRED), "replace": (str, REQUIRED), "cause": (tuple, ()), "equivalent": (str, ""),
              "keyword": (str, "")}
    records = load(path, table, fields, lambda r: (hole_body(r["hole"]), f"the reference body of {r['hole']}"))
    odd = [r["name"] for r in records if r["kind"] not in KINDS]
    if odd:
        raise RecordError(f"{path.name}: [[{table}]] {odd}: kind must be one of {KINDS}")
    return [_bug(r) for r in records]


BUGS: list[Bug] = load_bugs("bug")
# Held out: invented after the chapter tests were strengthened against BUGS, and never used to write
# a test: a fresh walk-through's check that the tests were not fitted to the corpus. Not part of the
# rates the test asserts; `--held-out` runs them and the table reports them apart.
HELD_OUT: list[Bug] = load_bugs("held_out")


@dataclass
class BugResult:
    bug: Bug
    status: str  # "ok" | "stale" | "broken"
    by_hole: bool = False
    by_chapter: bool = False
    test: str = ""
    message: str = ""
    names_cause: bool = False
    seconds: float = 0.0

    @property
    def counted(self) -> bool:
        """Part of the rates: a real (non-equivalent) bug that ran."""
        return self.status == "ok" and not self.bug.equivalent


def _names_cause(bug: Bug, message: str) -> bool:
    words = bug.cause or (bug.holes[0].rsplit(".", 1)[-1].lstrip("_"),)
    low = message.lower()
    return any(w.lower() in low for w in words)


def in_a_hole_body(bug: Bug) -> bool:
    """The bug's text lies in its hole's reference body (solutions/), not in given code."""
    return bug.old in hole_body(bug.holes[0])


def run_bug(bug: Bug, timeout: float = 600, warm: WarmPool | None = None) -> BugResult:
    """Apply one bug to the reference in a workspace; run its hole's tests, then (if they all pass)
    the whole chapter file, each stopping at the first failure."""
    files = filled()
    stale = check_applies(bug, files) or (None if in_a_hole_body(bug) else "its text is not in a hole's body")
    if stale:
        return BugResult(bug, "stale", message=stale)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"bug-{bug.name}-") as tmp:
        bed = workspace(Path(tmp) / "repo", apply_mutant(bug, files))
        base = ["-x", "-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS]
        stages = [("hole", [*base, *[f"--hole={h}" for h in bug.holes],
                            *(["-k", bug.keyword] if bug.keyword else [])]), ("chapter", base)]
        for stage, args in stages:
            run = run_pytest(args, cwd=bed, timeout=timeout, per_test_timeout=60, warm=warm)
            failed = run.first_failure()
            if failed is not None:
                res = BugResult(bug, "ok", by_hole=stage == "hole", by_chapter=True, test=failed.name,
                                message=failed.message.strip(), seconds=round(time.monotonic() - start, 1))
                res.names_cause = _names_cause(bug, res.message)
                return res
            if not (run.returncode == 0 and run.tests and all(t.passed for t in run.tests)):
                why = run.collect_errors[0]["message"][-300:] if run.collect_errors else run.output[-300:]
                return BugResult(bug, "broken", message=f"{stage} run: {why.strip()}",
                                 seconds=round(time.monotonic() - start, 1))
    return BugResult(bug, "ok", seconds=round(time.monotonic() - start, 1))


def run_all(bugs: list[Bug], workers: int = 2, progress=None, warm: bool = True) -> list[BugResult]:
    """Every bug, ``workers`` sessions at a time (forked from warm servers unless ``warm=False``)."""
    with WarmPool() as servers, ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = []
        for f in [pool.submit(run_bug, b, 600, servers if warm else None) for b in bugs]:
            results.append(f.result())
            if progress:
                progress(results[-1])
        return results


@dataclass
class Summary:
    total: int
    equivalent: int
    counted: int
    by_hole: int
    by_chapter: int
    names_cause: int
    stale: list[str]
    broken: list[str]
    equivalent_caught: list[str]

    @property
    def hole_rate(self) -> float:
        return self.by_hole / self.counted if self.counted else 0.0

    @property
    def chapter_rate(self) -> float:
        return self.by_chapter / self.counted if self.counted else 0.0

    @property
    def cause_rate(self) -> float:
        return self.names_cause / self.by_chapter if self.by_chapter else 0.0

    @property
    def holds(self) -> bool:
        return (not self.stale and not self.broken and not self.equivalent_caught
                and self.chapter_rate >= MIN_BY_CHAPTER and self.hole_rate >= MIN_BY_HOLE)


def summarize(results: list[BugResult]) -> Summary:
    counted = [r for r in results if r.counted]
    return Summary(
        total=len(results), equivalent=sum(1 for r in results if r.bug.equivalent), counted=len(counted),
        by_hole=sum(r.by_hole for r in counted), by_chapter=sum(r.by_chapter for r in counted),
        names_cause=sum(r.names_cause for r in counted if r.by_chapter),
        stale=[r.bug.name for r in results if r.status == "stale"],
        broken=[r.bug.name for r in results if r.status == "broken"],
        equivalent_caught=[r.bug.name for r in results if r.status == "ok" and r.bug.equivalent and r.by_chapter])


def summary_lines(s: Summary) -> list[str]:
    lines = [f"- bugs: {s.total}, of which {s.equivalent} equivalent (cannot change behaviour) and "
             f"{s.counted} real",
             f"- caught by the owning hole's own tests: {s.by_hole}/{s.counted} = {s.hole_rate:.1%} "
             f"(target {MIN_BY_HOLE:.0%})",
             f"- caught by the chapter file: {s.by_chapter}/{s.counted} = {s.chapter_rate:.1%} "
             f"(target {MIN_BY_CHAPTER:.0%})",
             f"- the first failure's message names the cause: {s.names_cause}/{s.by_chapter} = {s.cause_rate:.1%}"]
    if s.stale or s.broken or s.equivalent_caught:
        lines.append(f"- stale: {s.stale or 'none'}; broken: {s.broken or 'none'}; "
                     f"claimed equivalent but caught: {s.equivalent_caught or 'none'}")
    return lines


def _cell(text: str, width: int = 110) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"


def _rows(results: list[BugResult]) -> list[str]:
    out = ["| bug | hole | class | by hole | by chapter | names cause | first failure / why equivalent |",
           "|---|---|---|---|---|---|---|"]
    for r in results:
        b = r.bug
        mark = lambda v: "yes" if v else "**no**"  # noqa: E731
        if r.status != "ok":
            row = (r.status, "", "", r.message)
        elif b.equivalent:
            row = ("(equiv.)", "(equiv.)" if not r.by_chapter else "**CAUGHT**", "", "equivalent: " + b.equivalent)
        else:
            detail = f"`{r.test}`: {r.message}" if r.by_chapter else "ESCAPED: " + b.why
            row = (mark(r.by_hole), mark(r.by_chapter), mark(r.names_cause) if r.by_chapter else "", detail)
        out.append(f"| {b.name} | {b.holes[0]} | {b.kind} | {row[0]} | {row[1]} | {row[2]} | {_cell(row[3])} |")
    return out


def format_markdown(results: list[BugResult], held: list[BugResult], note: str) -> str:
    s = summarize(results)
    h = summarize(held)
    return "\n".join([
        "# The learner-bug corpus: what the chapter's tests catch", "",
        "Regenerate with `make bug-corpus` (= `python -m course.quality.bug_corpus --table docs/bug-corpus.md`; "
        "with bug names it reruns only those rows). The bugs are the records of "
        "`course/quality/data/bug_corpus.toml`, run by `course/quality/bug_corpus.py`. Each bug is one exact "
        "replacement in the reference, run under `--impl engine` in a temporary workspace: first the owning hole's own tests (`--hole X`), then, if they all pass, the "
        "whole of `tests/test_ch31_engine_v2.py`, each stopping at the first failure. \"Names cause\": the first "
        "failure's message contains one of the bug's cause words (`cause` in the records).", "",
        "## Summary", "", *summary_lines(s), f"- {note}", "",
        "Held out (`HELD_OUT`, a walk-through invented after the tests were strengthened; no test was written "
        "for them):", "", *summary_lines(h), "",
        "## The corpus, per bug", "", *_rows(results), "",
        "## Held out, per bug", "", *_rows(held), ""])


def _save(path: Path, results: list[BugResult], held: list[BugResult], note: str) -> None:
    data = {"note": note, "results": [{k: v for k, v in vars(r).items() if k != "bug"} | {"name": r.bug.name}
                                      for r in results + held]}
    path.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    path.write_text(format_markdown(results, held, note))


def _load(path: Path) -> tuple[dict[str, BugResult], str]:
    side = path.with_suffix(".json")
    if not side.exists():
        return {}, ""
    data = json.loads(side.read_text())
    known = {b.name: b for b in BUGS + HELD_OUT}
    rows = {}
    for rec in data["results"]:
        name = rec.pop("name")
        if name in known:
            rows[name] = BugResult(known[name], **rec)
    return rows, data.get("note", "")


def _verdict(r: BugResult) -> str:
    if r.status != "ok":
        return r.status
    if r.by_chapter:
        return ("EQUIV?!" if r.bug.equivalent else "") + ("hole" if r.by_hole else "chapter")
    return "equiv" if r.bug.equivalent else "ESCAPED"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run only these bugs (default: all, then the held-out ones)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--table", type=Path, help="write the markdown table here (and its .json beside it); with "
                                               "names, only their rows are rerun and replaced")
    ap.add_argument("--list", action="store_true", help="list the bugs and exit")
    ap.add_argument("--held-out", action="store_true", help="run only the held-out bugs (HELD_OUT)")
    args = ap.parse_args(argv)
    if args.list:
        for b in BUGS + HELD_OUT:
            print(f"{b.name:45s} {b.holes[0]:32s} {b.kind:16s} {'(equivalent) ' if b.equivalent else ''}{b.why}")
        return 0
    by_name = {b.name: b for b in BUGS + HELD_OUT}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"unknown bug(s) {unknown}; --list names them", file=sys.stderr)
        return 2
    if args.names:
        chosen = [by_name[n] for n in args.names]
    else:
        chosen = HELD_OUT if args.held_out else BUGS + ([] if args.table is None else HELD_OUT)
    start = time.monotonic()
    from tqdm import tqdm

    with tqdm(total=len(chosen), desc="bug corpus", unit="bug", dynamic_ncols=True) as bar:
        def progress(r: BugResult) -> None:  # one line per bug above the bar: done/total, elapsed, ETA
            bar.write(f"  {_verdict(r):8s} {r.bug.name:45s} {r.test} {r.message[:90]!r}")
            bar.update(1)

        results = run_all(chosen, args.workers, progress=progress)
    seconds = time.monotonic() - start
    corpus = [r for r in results if r.bug in BUGS]
    print("\n".join(summary_lines(summarize(corpus))) + f"\n- wall time: {seconds:.0f} s")
    if args.table:
        if args.names:
            rows, note = _load(args.table)
            rows.update({r.bug.name: r for r in results})
            missing = [b.name for b in BUGS + HELD_OUT if b.name not in rows]
            if missing:
                print(f"no earlier row for {missing}: run without names first", file=sys.stderr)
                return 2
            note += f"; then {len(results)} rows rerun ({seconds:.0f} s): " + ", ".join(args.names)
            merged = [rows[b.name] for b in BUGS]
            held = [rows[b.name] for b in HELD_OUT]
        else:
            merged, held = corpus, [r for r in results if r.bug in HELD_OUT]
            note = f"wall time of the full run: {seconds:.0f} s, 2 workers, {machine_line()}"
        _save(args.table, merged, held, note)
        print(f"wrote {args.table} and {args.table.with_suffix('.json')}")
        corpus = merged
    return 0 if summarize(corpus).holds else 1


if __name__ == "__main__":
    sys.exit(main())
