"""``python run.py core``: the chapter benchmark — chapter 24's slot engine against the core.

Sixteen requests (by default) share a 192-token system prompt, each adding its own 8-48-token
question and wanting 8-40 output tokens, on the 2-layer test model. Three runs print one JSON line
each: chapter 24's engine with 8 slots of 320 tokens, the core with an ample pool, and the core
with a 24-block (384-token) pool that must preempt; tok_s is the best of --repeat timed runs.
Every run's greedy tokens are compared with chapter 24's (``matches_ch24``).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine.models import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams
from engine.serve.slots import SlotEngine
from engine.workloads import WorkItem, shared_prefix_workload


def run_slots(model, work: list[WorkItem], num_slots: int = 8, max_len: int = 320,
              repeat: int = 1) -> tuple[dict, dict]:
    elapsed = float("inf")
    for _ in range(repeat):  # best of `repeat`: the least disturbed run of the same work
        eng = SlotEngine(model, num_slots=num_slots, max_len=max_len)
        for item in work:
            eng.add_request(item.request_id, item.prompt_token_ids, item.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        out = eng.run_to_completion()
        elapsed = min(elapsed, time.perf_counter() - start)
    n_out = sum(len(v) for v in out.values())
    return {"engine": "ch24 slots", "kv_slots": eng.kv_slots, "output_tokens": n_out,
            "tok_s": round(n_out / elapsed, 1), "steps": eng.steps}, out


def run_core(model, work: list[WorkItem], label: str, config: EngineConfig,
             repeat: int = 1) -> tuple[dict, dict]:
    elapsed = float("inf")
    for _ in range(repeat):  # best of `repeat`, each on a fresh engine (empty prefix cache)
        core = EngineCore(model, config)
        for item in work:
            core.add_request(item.request_id, item.prompt_token_ids,
                             SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))
        start = time.perf_counter()
        out = core.run_until_done()
        elapsed = min(elapsed, time.perf_counter() - start)
    n_out = sum(len(v) for v in out.values())
    return {"engine": label, "kv_slots": core.blocks.num_blocks * core.blocks.block_size,
            "output_tokens": n_out, "tok_s": round(n_out / elapsed, 1), "steps": core.steps,
            "prefix_hit_rate": round(core.blocks.hit_rate, 3), "preemptions": core.preemptions}, out


def core_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.py core", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="how many requests share the system prompt (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload's random prompts and lengths (default 0)")
    ap.add_argument("--impl", choices=("solution", "engine"), default="solution",
                    help="'solution' runs the reference; 'engine' runs the holes you filled in")
    ap.add_argument("--model", default=None, help="an HF-format checkpoint directory instead of the test model")
    ap.add_argument("--backend", default=None, help="attention backend of the core runs (default: EngineConfig's)")
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
    extra = {"attention_backend": args.backend} if args.backend else {}
    # Warm up the kernels both engines use, so neither pays first-call costs in its timing.
    run_core(model, work[:2], "warm-up", EngineConfig(**extra))
    run_slots(model, work[:2])

    line, ref = run_slots(model, work, repeat=args.repeat)
    print(json.dumps(line), flush=True)
    for label, cfg in (("ch31 core, ample pool", EngineConfig(**extra)),
                       ("ch31 core, 24-block pool", EngineConfig(num_blocks=24, **extra))):
        line, out = run_core(model, work, label, cfg, repeat=args.repeat)
        line["matches_ch24"] = out == ref
        print(json.dumps(line), flush=True)
    return 0
