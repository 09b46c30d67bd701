"""``python run.py core``: the chapter benchmark — chapter 24's slot engine against the core.

The workload is ``shared_prefix_workload``: by default 16 requests on the 2-layer test model, all
opening with one 192-token system prompt, then a private 8-48-token question, each asking for
8-40 new tokens. It is served three times, one JSON line per run: by chapter 24's engine (room for
8 requests of at most 320 tokens), by the core with a pool sized from memory (far larger than the
workload needs), and by the core held to 24 blocks (384 tokens), so that it must preempt. ``tok_s``
is the fastest of --repeat timed runs; ``matches_ch24`` says whether a run's greedy tokens equal
chapter 24's. --backend and --no-prefix-caching switch one ingredient of the core runs off, to
show what it contributes. Under ``--impl engine`` each core run is followed by a line comparing its
exact figures (output tokens, steps, hit rate, preemptions, and the tokens themselves) with the
reference's on the same workload, served in this process through the one switch
(``engine/_impl.py``), with which differ and what that suggests.

``--rounds N`` measures instead what each ingredient is worth, as a ratio to chapter 24 measured
in this one process: every round serves the workload on four ample-pool cores (torch backend with
and without the prefix cache, reference backend with and without), each on a fresh engine and
each between two runs of chapter 24's engine; a core's ratio divides its tok/s by the mean of the
two chapter-24 runs beside it. It prints the median and the range of each ratio over the rounds,
by wall clock and by CPU time, and the machine they ran on. A ratio from two separate processes
is noise on a shared machine; one from neighbouring runs in one process much less so.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from course.bench.compare import CoreRunner, RunResult, SlotRunner, Workload, run_workload
from engine.models import tiny_model
from engine.serve import EngineConfig
from course.bench.workloads import WorkItem, shared_prefix_workload
from engine._impl import add_impl_argument
from course.bench.machine import machine_line

# The ingredients --rounds measures: (label, attention backend, prefix caching).
RATIO_VARIANTS = (("torch + cache", "torch", True), ("torch, no cache", "torch", False),
                  ("reference + cache", "reference", True), ("reference, no cache", "reference", False))


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


def ratio_rounds(model, work: list[WorkItem], rounds: int, variants=RATIO_VARIANTS,
                 log: Callable[[str], None] = print) -> dict[str, dict[str, list[float]]]:
    """Interleaved rounds on fresh engines: chapter 24, then each ample-pool core variant with a
    chapter-24 run after it (ch24, A, ch24, B, ch24, ...). Each variant's ratio divides its speed by
    the mean of the two chapter-24 runs beside it, by wall clock ("wall") and by this process's CPU
    time ("cpu": what a run costs when other jobs take turns on the cores), so a slow spell of a
    shared machine lands on both sides of a ratio. Returns label -> {"wall": ratios by round,
    "cpu": ...}, and "ch24" -> {"wall": chapter 24's tok/s per run, "cpu": its tok/s of CPU time}.
    Every run must give chapter 24's tokens."""
    slots = lambda: SlotRunner(model, num_slots=8, max_len=320)  # noqa: E731
    cores = {label: (lambda b=backend, c=cache: CoreRunner(model, b, enable_prefix_caching=c))
             for label, backend, cache in variants}
    for make in (slots, *cores.values()):  # warm-up: first calls pay allocator and kernel start-up
        best_of(make, work[:2], 1)
    out: dict[str, dict[str, list[float]]] = {"ch24": {"wall": [], "cpu": []},
                                              **{label: {"wall": [], "cpu": []} for label in cores}}

    def ch24() -> RunResult:
        res = best_of(slots, work, 1)
        out["ch24"]["wall"].append(res.output_tok_s)
        out["ch24"]["cpu"].append(res.output_tokens / res.cpu_seconds)
        return res

    for k in range(rounds):
        before = ch24()
        parts = [f"ch24 {before.output_tok_s:.0f} tok/s"]
        for label, make in cores.items():
            res = best_of(make, work, 1)
            after = ch24()
            if res.outputs != before.outputs:
                raise RuntimeError(f"{label}: greedy tokens differ from chapter 24's")
            out[label]["wall"].append((before.seconds + after.seconds) / 2 / res.seconds)
            out[label]["cpu"].append((before.cpu_seconds + after.cpu_seconds) / 2 / res.cpu_seconds)
            parts.append(f"{label} {out[label]['wall'][-1]:.2f} (cpu {out[label]['cpu'][-1]:.2f})")
            before = after
        log(f"round {k + 1}: " + ", ".join(parts))
    return out


# What a figure that differs from the reference's suggests (the workload is greedy and deterministic,
# so every one of these is exact: any difference is a difference in behaviour, not noise).
SUGGESTS = {
    ("output_tokens", "more"): "a request ran past its limit: check_stop (max_tokens, max_model_len)",
    ("output_tokens", "fewer"): "a request stopped early or lost tokens: check_stop (min_tokens, the stop rules), "
                                "or step() not appending a request's sample",
    ("steps", "more"): "more steps for the same work: a step with an empty plan counted (step), chunks smaller "
                       "than the budget allows or requests admitted later than they could be (schedule: budget, "
                       "chunk cap, max_num_seqs), or resumed requests recomputing what the prefix cache holds",
    ("steps", "fewer"): "fewer steps than the reference: more tokens per step than the budget allows (schedule "
                        "charges every admitted request to the budget), or admissions in a step that preempted",
    ("prefix_hit_rate", "higher"): "a higher hit rate: lookups that find nothing not counted (find_cached_prefix "
                                   "must call record_lookup for a miss too), or the block of a prompt's last token "
                                   "matched (find_cached_prefix)",
    ("prefix_hit_rate", "lower"): "a lower hit rate: hits counted in blocks instead of tokens, a request resumed "
                                  "after recompute not looked up again "
                                  "(schedule), blocks not published as soon as they are allocated "
                                  "(cache_full_blocks, schedule), lookups counted with caching off or prompt "
                                  "logprobs wanted, or shared blocks evicted first (free must release tail first)",
    ("preemptions", "more"): "more preemptions: the wrong victim (the LAST running request), admissions in a step "
                             "that preempted, blocks never returned (free, _preempt), or new blocks taken before "
                             "the last one is full (allocate_slots)",
    ("preemptions", "fewer"): "fewer preemptions: _preempt not adding one to the scheduler's num_preemptions, or "
                              "admission that waits when it could run",
}
COMPARED = ("output_tokens", "steps", "prefix_hit_rate", "preemptions")


def reference_lines(model, work: list[WorkItem], backend: str, runs) -> dict[str, dict] | str:
    """The reference's figures for the same ``runs`` ((label, config) pairs), served once each in this
    process with every hole switched to its reference (``engine/_impl.py``'s Switch, as ``--impl
    solution`` does) and switched back after; a string saying why not when there is no reference (a
    handout)."""
    from engine._impl import Switch

    switch = Switch()
    try:
        switch.use_reference(switch.holes)
    except ValueError as exc:  # no solutions/: a handout
        return f"no reference to compare with: {exc}"
    try:
        lines = {}
        for label, config in runs:
            res = best_of(lambda: CoreRunner(model, backend, **config), work, 1)
            lines[label] = {**json_line(label, res, core=True), "outputs": res.outputs}
        return lines
    finally:
        switch.restore()


def compare_with_reference(mine: dict, ref: dict) -> dict:
    """One JSON line: which deterministic figures of ``mine`` differ from ``ref`` and what that suggests."""
    differs = {k: {"yours": mine[k], "reference": ref[k]} for k in COMPARED if mine[k] != ref[k]}
    suggests = []
    for k, v in differs.items():
        up = v["yours"] > v["reference"]
        suggests.append(SUGGESTS[(k, ("higher" if up else "lower") if k == "prefix_hit_rate" else ("more" if up else "fewer"))])
    same_tokens = mine["outputs"] == ref["outputs"]
    if not same_tokens:
        wrong = sorted(r for r in ref["outputs"] if mine["outputs"].get(r) != ref["outputs"][r])
        suggests.append(f"{len(wrong)} request(s) ({', '.join(wrong[:4])}{', ...' if len(wrong) > 4 else ''}) got other "
                        "greedy tokens than the reference: run pytest tests/test_ch31_engine_v2.py, whose hole tests "
                        "say which hole")
    line = {"engine": mine["engine"], "vs_reference": "same" if not differs and same_tokens else "differs",
            "differs": differs, "same_tokens": same_tokens}
    if suggests:
        line["suggests"] = suggests
    return line


def summarize(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}, range {min(values):.2f}-{max(values):.2f}"


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
    ap.add_argument("--rounds", type=int, default=0,
                    help="instead of the three runs: N interleaved rounds of chapter 24 and four ample-pool cores "
                         "(torch/reference backend x prefix cache on/off); prints each core's tok/s over "
                         "chapter 24's, median and range")
    args = ap.parse_args(argv)
    if args.rounds < 0:
        ap.error("--rounds must be >= 0")
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
    if args.rounds:
        print(f"ample-pool core tok/s / chapter 24 tok/s, {args.rounds} interleaved rounds, {len(work)} requests; "
              f"{machine_line(args.threads)}", flush=True)
        ratios = ratio_rounds(model, work, args.rounds, log=lambda line: print(line, flush=True))
        ch24 = ratios.pop("ch24")
        print(f"chapter 24: {min(ch24['wall']):.0f}-{max(ch24['wall']):.0f} tok/s "
              f"({min(ch24['cpu']):.0f}-{max(ch24['cpu']):.0f} per CPU second)")
        print("core / chapter 24      by wall clock                    by CPU time")
        for label, by in ratios.items():
            print(f"{label:22s} {summarize(by['wall']):32s} {summarize(by['cpu'])}")
        return 0
    backend = args.backend or ("reference" if args.impl == "engine" else EngineConfig().attention_backend)
    print(json.dumps({"impl": args.impl, "attention_backend": backend, "flat_model": EngineConfig().flat_model}),
          flush=True)  # which code ran: yours (engine) runs your own attention and FlatModel
    caching = {"enable_prefix_caching": not args.no_prefix_caching}
    slots = lambda: SlotRunner(model, num_slots=8, max_len=320)  # noqa: E731

    def attempt(label: str, run: Callable[[], RunResult]) -> RunResult | None:
        """``run()``; under --impl engine a failure of your engine (other than a hole left to fill,
        which run.py reports) is one JSON line, and the comparison with the reference goes on."""
        try:
            return run()
        except NotImplementedError:
            raise
        except Exception as exc:
            if args.impl != "engine":
                raise
            print(json.dumps({"engine": label, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            return None

    # Warm up the kernels both engines use, so neither pays first-call costs in its timing.
    attempt("ch31 core, warm-up", lambda: best_of(lambda: CoreRunner(model, backend, **caching), work[:2], 1))
    best_of(slots, work[:2], 1)

    ref = best_of(slots, work, args.repeat)
    print(json.dumps(json_line("ch24 slots", ref, core=False)), flush=True)
    runs = [(label, {**caching, **config}) for label, config in
            (("ch31 core, ample pool", {}), ("ch31 core, 24-block pool", {"num_blocks": 24}))]
    mine = {}
    for label, config in runs:
        res = attempt(label, lambda: best_of(lambda: CoreRunner(model, backend, **config), work, args.repeat))
        if res is None:
            mine[label] = None
            continue
        line = json_line(label, res, core=True)
        line["matches_ch24"] = res.outputs == ref.outputs
        print(json.dumps(line), flush=True)
        mine[label] = {**line, "outputs": res.outputs}
    if args.impl == "engine":  # your engine: its exact figures beside the reference's, served the same way
        refs = reference_lines(model, work, backend, runs)
        if isinstance(refs, str):
            print(json.dumps({"vs_reference": "not compared", "why": refs}), flush=True)
        else:
            lines = []
            for label, _ in runs:
                if mine[label] is None:
                    figures = {k: refs[label][k] for k in COMPARED}
                    lines.append({"engine": label, "vs_reference": "yours failed", "reference": figures})
                else:
                    lines.append(compare_with_reference(mine[label], refs[label]))
            ample, small = lines
            if ample.get("vs_reference") == "same" and small.get("vs_reference") == "differs":
                small["suggests"].insert(0, "only the run that must preempt differs, so look at preemption and "
                                            "resumption first: _preempt, and schedule's readmission (a request "
                                            "resumed after recompute looks up its own blocks again; a swapped one "
                                            "gets swap_in)")
            for line in lines:
                print(json.dumps(line), flush=True)
    return 1 if any(m is None for m in mine.values()) else 0
