"""``python run.py core``: the chapter benchmark — chapter 24's slot engine against the core.

The workload is ``shared_prefix_workload``: by default 16 requests on the 2-layer test model, all
opening with one 192-token system prompt, then a private 8-48-token question, each asking for
8-40 new tokens. It is served three times, one JSON line per run: by chapter 24's engine (room for
8 requests of at most 320 tokens), by the core with a pool sized from memory (far larger than the
workload needs), and by the core held to 24 blocks (384 tokens), so that it must preempt. ``tok_s``
is the fastest of --repeat timed runs; ``matches_ch24`` says whether a run's greedy tokens equal
chapter 24's. --backend and --no-prefix-caching switch one ingredient of the core runs off, to
show what it contributes.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from course.bench import CoreRunner, RunResult, SlotRunner, Workload, run_workload
from engine.models import tiny_model
from engine.serve import EngineConfig
from course.workloads import WorkItem, shared_prefix_workload
from engine._impl import add_impl_argument


def best_of(make_runner: Callable[[], object], work: list[WorkItem], repeat: int) -> RunResult:
    """Serve ``work`` on ``repeat`` fresh engines (empty prefix caches); the fastest run."""
    runs = [run_workload(make_runner(), Workload("shared", [work])) for _ in range(repeat)]
    return min(runs, key=lambda r: r.seconds)


def json_line(label: str, res: RunResult, core: bool) -> dict:
    line = {"engine": label, "kv_slots": res.kv_slots, "output_tokens": res.output_tokens,
            "tok_s": res.output_tok_s, "steps": res.steps}
    if core:
        line.update(prefix_hit_rate=res.hit_rate, preemptions=res.preemptions)
    return line


def core_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.py core", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="how many requests share the system prompt (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload's random prompts and lengths (default 0)")
    add_impl_argument(ap)
    ap.add_argument("--model", default=None, help="an HF-format checkpoint directory instead of the test model")
    ap.add_argument("--backend", default=None, help="attention backend of the core runs (default: the chapter's "
                    "'reference' under --impl engine, EngineConfig's otherwise)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="run the core runs with the prefix cache off (to see what it contributes)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="time each run this many times on a fresh engine and report the fastest (default 3)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (default 1: the test model's matmuls are too small to gain "
                         "from more, and extra threads only add contention)")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model:
        from engine.models import load_model

        model = load_model(args.model)
    else:
        model = tiny_model(seed=0)
    work = shared_prefix_workload(args.requests, seed=args.seed, vocab_size=model.cfg.vocab_size)
    backend = args.backend or ("reference" if args.impl == "engine" else EngineConfig().attention_backend)
    print(json.dumps({"impl": args.impl, "attention_backend": backend, "flat_model": EngineConfig().flat_model}),
          flush=True)  # which code ran: yours (engine) runs your own attention and FlatModel
    caching = {"enable_prefix_caching": not args.no_prefix_caching}
    slots = lambda: SlotRunner(model, num_slots=8, max_len=320)  # noqa: E731
    # Warm up the kernels both engines use, so neither pays first-call costs in its timing.
    best_of(lambda: CoreRunner(model, backend, **caching), work[:2], 1)
    best_of(slots, work[:2], 1)

    ref = best_of(slots, work, args.repeat)
    print(json.dumps(json_line("ch24 slots", ref, core=False)), flush=True)
    for label, config in (("ch31 core, ample pool", {}), ("ch31 core, 24-block pool", {"num_blocks": 24})):
        res = best_of(lambda: CoreRunner(model, backend, **caching, **config), work, args.repeat)
        line = json_line(label, res, core=True)
        line["matches_ch24"] = res.outputs == ref.outputs
        print(json.dumps(line), flush=True)
    return 0
