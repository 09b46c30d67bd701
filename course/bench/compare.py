"""``python run.py bench``: the engines side by side, and how the core scales with concurrency.

Engines, all on the same weights and the same greedy requests (every request decodes its full
``max_tokens``, as with ``ignore_eos``):
- ``ch24 slots``: chapter 24's SlotEngine (one static cache row per request);
- ``core/reference``: chapter 31's EngineCore with the reference attention backend (a Python loop);
- ``core/cpu`` (``core/triton`` on CUDA; ``core/torch`` without a C++ compiler): the core with the
  fast backend and ``flat_model="fused"`` (FusedFlatModel: merged projections, fused elementwise ops);
- ``HF generate``: transformers' ``generate`` on static, left-padded batches (skipped, with a
  message, when transformers is not installed).
Workloads: ``shared`` (the chapter's 16 requests behind one 192-token system prompt), ``random``
(nano-vllm's benchmark scaled for a CPU: 64 independent random prompts and output lengths) and
``chat`` (8 conversations x 4 turns; each turn's prompt is the previous prompt + its answer + a
new message, so turns run round by round); on request, ``text`` (16 real-text prompts behind Psalm 23
as a shared system prompt, on the repository's ``models/qwen3-kjv-tiny`` unless ``--model`` names
another checkpoint; it prints one completion, so you can read what the engines computed).

The scaling table runs R requests at once, decode-heavy, for R = 16, 64, 256, and splits the core's
step into schedule / build batch / forward / sample / bookkeeping (medians over the timed steps).
Under it, the limit: each point's roofline on this machine (``course.bench.roofline``: measured peak GEMM
FLOP/s and memory bandwidth against the step's FLOPs and bytes) and the fraction reached.
``--dtype bfloat16`` builds the preset in bfloat16; ``--preset qwen3-0.6b`` (Qwen3-0.6B's shape)
brings workloads, engines and scaling points sized for 2 cores (``SIZED_WORKLOADS``, ``SIZED_SCALING``).
The model is a random seeded Qwen3 (``--preset small``, the default, or ``test``) or a checkpoint;
the text workload needs a tokenizer, so it runs on a checkpoint (the KJV model in float32 by default).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from engine.serve import EngineConfig, EngineCore, SamplingParams
from engine.fast.choose import FASTEST_FLAT_MODEL, fastest_options
from engine.fast import cpu_decode_variant, cpu_elementwise, cpu_linear, cpu_prefill, linear_layout
from engine.fast.fused import default_linear_dtype, numerics_note
from engine.slots import SlotEngine
from course.bench.workloads import (OPENINGS, ChatTurn, WorkItem, chat_workload, random_workload, shared_prefix_workload,
                              text_workload)
from engine._impl import add_impl_argument
from course.bench.machine import machine_info, machine_line

WORKLOADS = ("shared", "random", "chat")  # the default set: token ids, any model
TEXT = "text"  # real text through a checkpoint's tokenizer (models/qwen3-kjv-tiny by default)
SCALING_POINTS = (16, 64, 256)
SIZED_SCALING = (1, 16)  # --preset qwen3-0.6b: R = 1 is the time per output token of a lone request
# Random seeded Qwen3 models the bench can build (``--preset``), as overrides of the test model's
# config. "small" (the default) is Qwen3-0.6B's shape scaled down (4 layers, hidden 512, 8 query /
# 4 kv heads of 64, SwiGLU 3x): enough arithmetic per op that the engines differ by what they
# compute, as on real checkpoints. "test" is the 2-layer, 128-wide model the tests use: quick, but
# its step is ~300 ops on tiny tensors, so per-op dispatch, not arithmetic, is most of every
# engine's time.
MODEL_PRESETS: dict[str, dict] = {
    "test": {},
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
    # Qwen3-0.6B's own shape (596 M parameters: 2.38 GB in float32, 1.19 GB in bfloat16), random
    # weights: with the workloads of SIZED_WORKLOADS, and for memory and start-up (``--memory``); a 2-core machine
    # prefills ~50-100 tokens/s at this size.
    "qwen3-0.6b": dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       rope_theta=1_000_000.0, max_position_embeddings=40_960),
}
SPLIT = ("schedule", "build", "forward", "sample", "bookkeeping")


# ----- workloads ------------------------------------------------------------------------------
@dataclass
class Workload:
    """Rounds of requests; a round starts when the previous one has finished. A ``ChatTurn``'s
    prompt is its conversation's history (previous prompt + answer) plus its message."""

    name: str
    rounds: list[list[WorkItem | ChatTurn]]
    system: list[int] = field(default_factory=list)

    def round_items(self, k: int, history: dict[int, list[int]]) -> list[WorkItem]:
        items = []
        for entry in self.rounds[k]:
            if isinstance(entry, ChatTurn):
                prompt = history.get(entry.conversation, self.system) + entry.message
                items.append(WorkItem(f"c{entry.conversation}t{k}", prompt, entry.max_tokens))
            else:
                items.append(entry)
        return items


# Workloads sized for a preset whose default-sized workloads would not fit a 2-core machine's
# afternoon: at Qwen3-0.6B's shape one core prefills ~100 tokens/s and decodes 5-25 tokens/s, so
# the default random workload (4,800 output tokens) would take over an hour per engine. There:
# 16 requests of 128 prompt tokens wanting 32 tokens each, all behind one 96-token prefix
# (shared) or each its own (random); chat: 4 conversations x 2 turns.
SIZED_WORKLOADS = {"qwen3-0.6b": ("shared", "random")}  # the preset's default workloads


def make_workload(name: str, vocab_size: int, seed: int = 0, scale: float = 1.0, tokenizer=None,
                  preset: str | None = None) -> Workload:
    """The named workload; ``scale`` < 1 shrinks request counts (quick runs and tests).
    ``tokenizer`` (an ``engine.tokenizer.Tokenizer``) is needed by ``text`` only; ``preset``
    (a key of ``SIZED_WORKLOADS``) picks that preset's smaller sizes."""
    count = lambda n: max(2, round(n * scale))  # noqa: E731
    if preset in SIZED_WORKLOADS and name != TEXT:
        if name == "shared":
            return Workload(name, [shared_prefix_workload(count(16), seed=seed, vocab_size=vocab_size, system_len=96,
                                                          question_len=(32, 32), output_len=(32, 32))])
        if name == "random":
            return Workload(name, [random_workload(count(16), seed=seed, vocab_size=vocab_size,
                                                   prompt_len=(128, 128), output_len=(32, 32))])
        if name == "chat":
            system, rounds = chat_workload(count(4), num_turns=2, seed=seed, vocab_size=vocab_size, system_len=64,
                                           message_len=(32, 32), output_len=(16, 16))
            return Workload(name, rounds, system)
    if name == "shared":
        return Workload(name, [shared_prefix_workload(count(16), seed=seed, vocab_size=vocab_size)])
    if name == "random":
        return Workload(name, [random_workload(count(64), seed=seed, vocab_size=vocab_size)])
    if name == "chat":
        system, rounds = chat_workload(count(8), seed=seed, vocab_size=vocab_size)
        return Workload(name, rounds, system)
    if name == TEXT:
        if tokenizer is None:
            raise ValueError("the text workload needs the checkpoint's tokenizer (a random preset model has none)")
        return Workload(name, [text_workload(tokenizer, count(16), seed=seed)])
    raise ValueError(f"unknown workload {name!r}: choose from {WORKLOADS + (TEXT,)}")


# ----- engines --------------------------------------------------------------------------------
def release_memory() -> None:
    """Collect finished engines (an EngineCore sits in a reference cycle) and their device memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class CoreRunner:
    """EngineCore with one attention backend; kept across rounds, so chat turns hit the cache."""

    def __init__(self, model, backend: str, label: str | None = None, **config) -> None:
        self.label = label or f"core/{backend}"
        release_memory()  # the previous engine's pool must be gone before this one sizes its own
        if model.model.embed_tokens.weight.device.type == "cuda":
            config.setdefault("gpu_memory_utilization", 0.5)  # leave room for the other engines' runs
        self.core = EngineCore(model, EngineConfig(attention_backend=backend, **config))
        wait_compiled(self.core)
        self._since = (0, 0, 0, 0)  # steps, preemptions, prefix-cache queries, hits at the last fresh()

    def fresh(self) -> CoreRunner:
        """This engine, kept warm, made to start the next ``serve`` as a new one would: an empty
        prefix cache (``reset_prefix_cache``) and ``stats`` counted from here. What a new engine
        would pay again (its K/V pool's and buffers' first page faults, the allocator's warm-up)
        is not paid: vLLM's engine, kept alive across runs, does not pay it either."""
        core = self.core
        if core.has_unfinished():
            raise ValueError("fresh(): the engine still has requests (a serve that did not finish)")
        core.blocks.reset_prefix_cache()
        self._since = (core.steps, core.preemptions, core.blocks.num_queries, core.blocks.num_hits)
        return self

    def serve(self, items: list[WorkItem]) -> dict[str, list[int]]:
        for item in items:
            self.core.add_request(item.request_id, item.prompt_token_ids,
                                  SamplingParams(max_tokens=item.max_tokens, ignore_eos=True, temperature=0.0))
        return self.core.run_until_done()

    def stats(self) -> dict:
        """Counts since this runner was built, or since its last ``fresh()``."""
        core, blocks = self.core, self.core.blocks
        steps, preemptions, queries, hits = self._since
        queries, hits = blocks.num_queries - queries, blocks.num_hits - hits
        return {"steps": core.steps - steps, "hit_rate": round(hits / queries if queries else 0.0, 3),
                "preemptions": core.preemptions - preemptions, "kv_slots": blocks.num_blocks * blocks.block_size}


class SlotRunner:
    """Chapter 24's SlotEngine: ``num_slots`` static rows of ``max_len`` tokens."""

    label = "ch24 slots"

    def __init__(self, model, num_slots: int, max_len: int) -> None:
        self.engine = SlotEngine(model, num_slots=num_slots, max_len=max_len)

    def serve(self, items: list[WorkItem]) -> dict[str, list[int]]:
        for item in items:
            self.engine.add_request(item.request_id, item.prompt_token_ids, item.max_tokens, ignore_eos=True)
        return self.engine.run_to_completion()

    def stats(self) -> dict:
        return {"steps": self.engine.steps, "hit_rate": None, "preemptions": None,
                "kv_slots": self.engine.kv_slots}


class HFRunner:
    """transformers' generate, static batches of ``batch_size`` requests in arrival order."""

    label = "HF generate"

    def __init__(self, hf, batch_size: int) -> None:
        self.hf = hf
        self.batch_size = batch_size
        self.steps = 0

    def serve(self, items: list[WorkItem]) -> dict[str, list[int]]:
        from course.bench.hf_baseline import generate_static_batch

        out = {}
        for at in range(0, len(items), self.batch_size):
            batch = items[at:at + self.batch_size]
            answers = generate_static_batch(self.hf, [i.prompt_token_ids for i in batch], [i.max_tokens for i in batch])
            out.update({i.request_id: a for i, a in zip(batch, answers)})
            self.steps += max(i.max_tokens for i in batch)
        return out

    def stats(self) -> dict:
        return {"steps": self.steps, "hit_rate": None, "preemptions": None, "kv_slots": None}


@dataclass
class RunResult:
    engine: str
    workload: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float  # wall clock of the serve() calls (best of --repeat runs)
    cpu_seconds: float  # process CPU time of the same calls: on a shared machine, what it would take alone
    steps: int
    hit_rate: float | None
    preemptions: int | None
    kv_slots: int | None
    output_tok_s: float = 0.0
    total_tok_s: float = 0.0
    vs_fastest_peer: float = 0.0  # output tok/s / the fastest OTHER engine's (> 1: this one leads)
    agrees: float | None = None  # share of requests whose tokens equal core/reference's
    startup_s: float | None = None  # the engine's first build + warm-up request (compilation included)
    peak_rss: int | None = None  # the process's peak resident bytes over that build and warm-up (model included)
    outputs: dict[str, list[int]] = field(default_factory=dict, repr=False)


def wait_compiled(core: EngineCore) -> None:
    """Let a flat_model="compiled" engine's background compile finish, so that its timed runs measure the graph."""
    wait = getattr(core.flat, "wait_compiled", None)
    if wait is not None:
        wait()


def reset_peak_rss() -> None:
    """Start this process's peak-RSS count again from its current size (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int | None:
    """This process's peak resident bytes since start or ``reset_peak_rss`` (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_workload(runner, workload: Workload) -> RunResult:
    """Serve every round of ``workload``; only ``serve`` calls are timed."""
    history: dict[int, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    prompt_tokens = seconds = cpu_seconds = 0.0
    for k in range(len(workload.rounds)):
        items = workload.round_items(k, history)
        start, cpu_start = time.perf_counter(), time.process_time()
        got = runner.serve(items)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        # A runner serving in another process (a peer engine) times its own serve: the pipe's
        # round trip is not its engine's time, and this process's CPU clock does not see it.
        wall, cpu = getattr(runner, "timed", None) or (wall, cpu)
        seconds += wall
        cpu_seconds += cpu
        prompt_tokens += sum(len(i.prompt_token_ids) for i in items)
        outputs.update(got)
        for entry, item in zip(workload.rounds[k], items):
            if isinstance(entry, ChatTurn):
                history[entry.conversation] = item.prompt_token_ids + got[item.request_id]
    n_out = sum(len(v) for v in outputs.values())
    res = RunResult(engine=runner.label, workload=workload.name, requests=len(outputs),
                    prompt_tokens=int(prompt_tokens), output_tokens=n_out, seconds=round(seconds, 4),
                    cpu_seconds=round(cpu_seconds, 4),
                    **runner.stats(), outputs=outputs)
    res.output_tok_s = round(n_out / seconds, 1)
    res.total_tok_s = round((n_out + prompt_tokens) / seconds, 1)
    return res


def longest_request(workload: Workload) -> int:
    """Tokens (prompt + output) of the workload's longest request, chat histories included."""
    if not workload.system and all(isinstance(e, WorkItem) for r in workload.rounds for e in r):
        return max(len(e.prompt_token_ids) + e.max_tokens for r in workload.rounds for e in r)
    grown: dict[int, int] = {}
    longest = 0
    for rnd in workload.rounds:
        for e in rnd:
            n = grown.get(e.conversation, len(workload.system)) + len(e.message) + e.max_tokens
            grown[e.conversation] = n
            longest = max(longest, n)
    return longest


def compare_engines(model, workload: Workload, fast_backend: str, engines: list[str], hf=None,
                    hf_batch: int = 64, repeat: int = 1, log: Callable[[str], None] = print,
                    peers: dict[str, Callable[[], object]] | None = None) -> list[RunResult]:
    """Run ``workload`` through each engine: a new engine per run from its factory (the race's
    factories hand out their kept engine, ``fresh()``), after a small warm-up of its own; with
    ``repeat`` > 1 each engine keeps its fastest run (timing noise only ever slows down).
    Repeats go round-robin (every engine once, then every engine again), so a slow spell of a
    shared machine lands on one run of each engine rather than on all runs of one. ``peers`` adds
    engines by name (``course.peers.race``: vLLM in its own process, the core's configurations).
    ``agrees`` compares with core/reference, or when the reference does not run the first
    core/<fast backend> (a label may name a configuration after a "+": core/cpu+fused)."""
    first = workload.rounds[0][0]
    warm = Workload("warm-up", [[WorkItem("warm", first.prompt_token_ids if isinstance(first, WorkItem)
                                          else workload.system + first.message, 4)]])
    max_len = max(320, longest_request(workload))
    slots = 8 if workload.name == "shared" else 16  # the chapter's 8 rows; 16 for the bigger workloads
    factories = {
        "ch24": lambda: SlotRunner(model, slots, max_len),
        "reference": lambda: CoreRunner(model, "reference", max_num_seqs=256),
        "fast": lambda: CoreRunner(model, fast_backend, max_num_seqs=256, **fast_config(fast_backend)),
        "hf": (lambda: HFRunner(hf, hf_batch)) if hf is not None else None,
        **(peers or {}),
    }
    names = [name for name in engines if factories[name] is not None]
    best: dict[str, RunResult] = {}
    started: dict[str, tuple[float, int | None]] = {}
    for name in names:
        reset_peak_rss()
        start = time.perf_counter()
        runner = factories[name]()
        run_workload(runner, warm)
        # A runner that times itself serves in another process: this one's RSS is not its own.
        started[name] = (round(time.perf_counter() - start, 2),
                         None if getattr(runner, "timed", None) is not None else peak_rss())
        del runner
    for _ in range(repeat):
        for name in names:
            res = run_workload(factories[name](), workload)
            if name not in best or res.seconds < best[name].seconds:
                best[name] = res
    results = [best[name] for name in names]
    for name, res in zip(names, results):
        res.startup_s, res.peak_rss = started[name]
    for res in results:
        log(f"  {res.engine:16s} {res.output_tok_s:9.1f} out tok/s  ({res.seconds:.2f} s wall, "
            f"{res.cpu_seconds:.2f} s CPU)")
    oracle = next((r for r in results if r.engine == "core/reference"),
                  next((r for r in results if r.engine.split("+")[0] == f"core/{fast_backend}"), None))
    for r in results:
        peers = [p.output_tok_s for p in results if p is not r]
        r.vs_fastest_peer = round(r.output_tok_s / max(peers), 2) if peers else 1.0
        if oracle is not None:
            r.agrees = round(sum(r.outputs.get(k) == v for k, v in oracle.outputs.items()) / len(oracle.outputs), 3)
    return results


# ----- scaling and the step split -------------------------------------------------------------
class _StepClock:
    """Seconds per part of ``step()``, summed over the steps since ``parts.clear()`` (an observer)."""

    PARTS = {"schedule": "schedule", "prepare": "build", "execute": "forward", "sample": "sample"}

    def __init__(self, core: EngineCore) -> None:
        self.parts: dict[str, float] = {}
        core.observe(self)

    def __call__(self, phase: str, result, seconds: float) -> None:
        part = self.PARTS[phase]
        self.parts[part] = self.parts.get(part, 0.0) + seconds


def scaling_point(model, backend: str, num_requests: int, steps: int = 20, prompt_len: int = 64,
                  seed: int = 0, flat_model: str = "flat") -> dict:
    """``num_requests`` distinct prompts decoding together: median step time, its split, tok/s."""
    rng = random.Random(seed)
    vocab = model.cfg.vocab_size
    release_memory()
    # A pool that holds every request to the end: the point measures R requests decoding, not a
    # preempting scheduler (a memory-sized default pool is too small for R = 256 on bigger models).
    bs = EngineConfig().cache.block_size
    max_tokens = steps + 64
    num_blocks = num_requests * -(-(prompt_len + max_tokens) // bs) + 1  # room for every request's whole length
    core = EngineCore(model, EngineConfig(attention_backend=backend, max_num_seqs=max(256, num_requests),
                                          max_num_batched_tokens=max(2048, num_requests), num_blocks=num_blocks,
                                          flat_model=flat_model))
    wait_compiled(core)
    for i in range(num_requests):
        core.add_request(f"s{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    while any(r.num_computed_tokens < r.num_prompt_tokens - 1 for r in core.scheduler.requests.values()):
        core.step()  # prefill
    for _ in range(3):
        core.step()  # settle into pure decode
    if len(core.scheduler.running) != num_requests or core.preemptions:
        raise RuntimeError(f"scaling point R={num_requests}: only {len(core.scheduler.running)} requests are "
                           f"running ({core.preemptions} preemptions); the pool is too small")
    clock = _StepClock(core)
    rows = []
    for _ in range(steps):
        clock.parts.clear()
        start, cpu_start = time.perf_counter(), time.process_time()
        core.step()
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        row = {p: clock.parts.get(p, 0.0) for p in SPLIT[:-1]}
        row["bookkeeping"] = total - sum(row.values())
        row["step"], row["cpu"] = total, cpu
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) * 1000 for k in rows[0]}
    # Medians of the parts need not add up to the median step: the overhead share is taken over
    # the parts' sum, so that it matches the split printed next to it.
    overhead = 1.0 - med["forward"] / sum(med[p] for p in SPLIT)
    return {"backend": backend, "requests": num_requests, "step_ms": round(med["step"], 3),
            "cpu_ms": round(med["cpu"], 3), "tok_s": round(num_requests / med["step"] * 1000, 1),
            **{f"{p}_ms": round(med[p], 3) for p in SPLIT}, "overhead": round(overhead, 3)}


# ----- reporting ------------------------------------------------------------------------------
def print_results(results: list[RunResult], workload: Workload) -> None:
    print(f"\nworkload {workload.name!r}: {results[0].requests} requests, {results[0].prompt_tokens} prompt "
          f"tokens, {results[0].output_tokens} output tokens, {len(workload.rounds)} round(s)")
    head = f"{'engine':16s} {'out tok/s':>10s} {'total tok/s':>12s} {'wall s':>7s} {'CPU s':>6s} {'steps':>6s} " \
           f"{'hit rate':>9s} {'preempt':>8s} {'kv slots':>9s} {'x fastest peer':>15s} {'agrees':>7s} " \
           f"{'start-up s':>10s} {'peak RSS GiB':>12s}"
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in results:
        print(f"{r.engine:16s} {r.output_tok_s:10.1f} {r.total_tok_s:12.1f} {r.seconds:7.2f} {r.cpu_seconds:6.2f} "
              f"{r.steps:6d} {fmt(r.hit_rate, '9.3f'):>9s} "
              f"{fmt(r.preemptions, '8d'):>8s} {fmt(r.kv_slots, '9d'):>9s} {r.vs_fastest_peer:15.2f} "
              f"{fmt(r.agrees, '7.3f'):>7s} {fmt(r.startup_s, '10.2f'):>10s} "
              f"{fmt(None if r.peak_rss is None else r.peak_rss / 2**30, '12.2f'):>12s}")
    print("start-up: the engine's first build and warm-up request (compilation included); peak RSS: this "
          "process's peak over it, the model included (one process per engine: run.py bench --memory)")


def print_scaling(points: list[dict]) -> None:
    print("\nscaling: R requests decoding together (median step; split of the core's step in ms)")
    head = f"{'backend':10s} {'R':>4s} {'step ms':>8s} {'CPU ms':>7s} {'tok/s':>8s} " \
           + " ".join(f"{p:>11s}" for p in SPLIT) \
           + f" {'overhead':>9s}"
    print(head)
    print("-" * len(head))
    for p in points:
        print(f"{p['backend']:10s} {p['requests']:4d} {p['step_ms']:8.2f} {p['cpu_ms']:7.2f} {p['tok_s']:8.1f} "
              + " ".join(f"{p[f'{s}_ms']:11.3f}" for s in SPLIT) + f" {p['overhead']:9.1%}")
    print("overhead = everything but the forward pass: (schedule + build + sample + bookkeeping) / their sum "
          "with forward; CPU ms = process CPU time per step (all threads)")


def decode_context(prompt_len: int, steps: int) -> int:
    """Tokens each request attends to, on average over ``scaling_point``'s timed steps: its prompt,
    the first token's, 3 settling steps', then the mean of the ``steps`` timed ones' (step k: k more)."""
    return prompt_len + 4 + (steps - 1) // 2


def add_roofline(model, points: list[dict], steps: int, prompt_len: int = 64) -> dict:
    """Put this machine's roofline estimate (``course.bench.roofline``) into every scaling point, as its
    ``roofline`` entry; return the measured limits (peak GEMM FLOP/s, memory bandwidth)."""
    from course.bench.roofline import decode_step_cost, machine_limits, roofline

    dtype = model.model.embed_tokens.weight.dtype
    limits = machine_limits(dtype)
    size = dtype.itemsize
    for p in points:
        cost = decode_step_cost(model.cfg, p["requests"], decode_context(prompt_len, steps), size, size)
        p["roofline"] = roofline(cost, limits, p["step_ms"])
    return limits


def print_roofline(points: list[dict], limits: dict) -> None:
    from course.bench.roofline import describe

    print(f"\nthe limit: this machine's roofline for each decode step ({describe(limits)}); "
          "roofline = max(FLOPs / peak, bytes / bandwidth), bytes = every weight once + the K/V read; "
          "reached = roofline / measured step")
    head = f"{'backend':10s} {'R':>4s} {'GFLOP':>8s} {'MB':>9s} {'compute ms':>11s} {'memory ms':>10s} " \
           f"{'roofline ms':>12s} {'bound':>8s} {'step ms':>8s} {'reached':>8s}"
    print(head)
    print("-" * len(head))
    for p in points:
        r = p["roofline"]
        print(f"{p['backend']:10s} {p['requests']:4d} {r['flops'] / 1e9:8.2f} {(r['weight_bytes'] + r['kv_bytes']) / 1e6:9.1f} "
              f"{r['compute_ms']:11.2f} {r['memory_ms']:10.2f} {r['roofline_ms']:12.2f} {r['bound']:>8s} "
              f"{p['step_ms']:8.2f} {r['fraction']:8.1%}")


def plot(path: str, by_workload: dict[str, list[RunResult]], points: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(by_workload)
    engines = list(dict.fromkeys(r.engine for rs in by_workload.values() for r in rs))
    width = 0.8 / max(1, len(engines))
    for j, eng in enumerate(engines):
        vals = [next((r.output_tok_s for r in by_workload[w] if r.engine == eng), 0.0) for w in names]
        ax1.bar([i + j * width for i in range(len(names))], vals, width, label=eng)
    ax1.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(names))], names)
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("throughput by workload")
    ax1.legend()
    for backend in dict.fromkeys(p["backend"] for p in points):
        pts = [p for p in points if p["backend"] == backend]
        ax2.plot([p["requests"] for p in pts], [p["tok_s"] for p in pts], marker="o", label=f"core/{backend}")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("requests decoding together")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("decode scaling")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----- entry point ----------------------------------------------------------------------------
def default_fast_backend(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The fastest attention backend here (``engine.fast.choose.fastest_options``: ``triton`` on
    a CUDA device with triton installed; ``cpu`` on a CPU whose compiler builds its kernel; else
    ``torch``), saying so when a CPU falls back to ``torch``."""
    from engine.fast.cpu_attention import DTYPES, load_kernel

    backend = fastest_options(device, dtype)["attention_backend"]
    if device.type == "cpu" and backend == "torch" and dtype in DTYPES:
        try:
            load_kernel()  # its failure is remembered: this only reads the reason
        except ValueError as exc:
            print(f"the 'cpu' backend is unavailable ({str(exc).splitlines()[0]}); using 'torch'")
    return backend


def fast_config(fast_backend: str) -> dict:
    """The fast core's other EngineConfig option: the flat model ``fastest_options`` names ("fused":
    merged projections, fused elementwise kernels; the compiled layer graph measured slower on every
    CPU it ran on, and ``run.py bench-peers --core-configs fused,compiled`` races the two)."""
    return {"flat_model": FASTEST_FLAT_MODEL}


def run_bench(model, workloads: list[str], engines: list[str], fast_backend: str | None = None,
              scaling: tuple[int, ...] = SCALING_POINTS, scaling_backends: tuple[str, ...] | None = None,
              scaling_steps: int = 20, scale: float = 1.0, seed: int = 0, hf_batch: int = 64,
              repeat: int = 1, tokenizer=None, preset: str | None = None, roofline: bool = True) -> dict:
    """Everything ``run.py bench`` prints, as a dict (also what ``--json`` writes). ``preset``
    sizes the workloads (``SIZED_WORKLOADS``); ``roofline`` adds each scaling point's limit
    (``course.bench.roofline``) on a CPU."""
    device = model.model.embed_tokens.weight.device
    fast_backend = fast_backend or default_fast_backend(device, model.model.embed_tokens.weight.dtype)
    hf = None
    if "hf" in engines:
        try:
            from course.bench.hf_baseline import to_hf

            hf = to_hf(model)
        except ImportError as exc:
            print(f"HF generate skipped: {exc}")
    cfg = model.cfg
    shape = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
             "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
             "vocab": cfg.vocab_size, "experts": cfg.num_experts}
    print(f"model: {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']}/{shape['kv_heads']} heads "
          f"of {shape['head_dim']}, vocab {shape['vocab']}; {device}, {torch.get_num_threads()} thread(s)", flush=True)
    print(f"machine: {machine_line()}", flush=True)
    model_dtype = model.model.embed_tokens.weight.dtype
    numerics = numerics_note(model_dtype, default_linear_dtype(model_dtype, device))
    if numerics and "fast" in engines:  # the fused engine's tokens may then differ from generate()'s
        print(f"numerics: {numerics}", flush=True)
    by_workload: dict[str, list[RunResult]] = {}
    for name in workloads:
        wl = make_workload(name, model.cfg.vocab_size, seed=seed, scale=scale, tokenizer=tokenizer, preset=preset)
        print(f"running workload {name!r} ...", flush=True)
        by_workload[name] = compare_engines(model, wl, fast_backend, engines, hf, hf_batch, repeat)
        print_results(by_workload[name], wl)
        if name == TEXT and by_workload[name]:
            first = wl.rounds[0][0]  # Psalm 23, then OPENINGS[0]
            said = tokenizer.decode(by_workload[name][0].outputs[first.request_id])
            print(f"  {first.request_id} ({by_workload[name][0].engine}): {OPENINGS[0]}{said}", flush=True)
    points = []
    for backend in scaling_backends or ("reference", fast_backend):
        for r in scaling:
            points.append(scaling_point(model, backend, r, steps=scaling_steps, seed=seed,
                                        **(fast_config(fast_backend) if backend == fast_backend else {})))
            print(f"  scaling {backend} R={r}: {points[-1]['step_ms']:.2f} ms/step", flush=True)
    layouts = linear_layout.chosen_report()
    if layouts:  # which linear kernels the figures came from (measured at load; ENGINE_LINEAR_LAYOUT forces)
        print("linear layouts chosen in this sitting:", *(f"  {line}" for line in layouts), sep="\n", flush=True)
        print(f"  {cpu_elementwise.describe()}", flush=True)  # the fused CPU model ran: its kernels' width
        print(f"  {cpu_linear.describe()}", flush=True)
    prefill_paths = cpu_prefill.chosen_report()
    if prefill_paths:  # which attention served the prefills (measured at the first; ENGINE_ATTENTION_PREFILL forces)
        print("attention prefill paths chosen in this sitting:", *(f"  {line}" for line in prefill_paths), sep="\n",
              flush=True)
    kernel_builds = cpu_decode_variant.chosen_report()
    if kernel_builds:  # which attention kernel build served the rows (measured per shape; ENGINE_ATTENTION_DECODE forces)
        print("attention kernel builds chosen in this sitting:", *(f"  {line}" for line in kernel_builds), sep="\n",
              flush=True)
    limits = None
    if points:
        print_scaling(points)
        if roofline and device.type == "cpu":
            limits = add_roofline(model, points, scaling_steps)
            print_roofline(points, limits)
    return {"device": str(device), "dtype": str(model.model.embed_tokens.weight.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "fast_backend": fast_backend, "model": shape,
            "machine": machine_info(torch.get_num_threads()), "limits": limits,
            "workloads": {w: [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in rs]
                          for w, rs in by_workload.items()},
            "scaling": points, "linear_layouts": layouts, "attention_prefill": prefill_paths,
            "attention_kernel_builds": kernel_builds, "numerics": numerics,
            "_results": by_workload}


def bench_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.py bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=None,
                    help=f"comma-separated, from {WORKLOADS + (TEXT,)} (default: {','.join(WORKLOADS)}; "
                         f"{','.join(SIZED_WORKLOADS['qwen3-0.6b'])}, sized for 2 cores, with --preset qwen3-0.6b); "
                         "'text' runs on a checkpoint: models/qwen3-kjv-tiny unless --model is given")
    ap.add_argument("--engines", default=None,
                    help="comma-separated, from ch24, reference, fast, hf (default: all; reference,fast with "
                         "--preset qwen3-0.6b)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the preset model's dtype (default float32)")
    ap.add_argument("--backend", default=None,
                    help="the fast attention backend (default: triton on CUDA, else cpu; torch without a C++ compiler)")
    ap.add_argument("--scaling", default=None,
                    help=f"concurrency levels of the scaling table ('' to skip it; default "
                         f"{','.join(map(str, SCALING_POINTS))}, or {','.join(map(str, SIZED_SCALING))} with "
                         "--preset qwen3-0.6b)")
    ap.add_argument("--no-roofline", action="store_true",
                    help="skip the roofline estimate under the scaling table (it measures this machine's peak "
                         "GEMM FLOP/s and memory bandwidth, a few seconds)")
    ap.add_argument("--scaling-backends", default=None, help="backends of the scaling table (default: reference and the fast one)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per scaling point (default 20)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workloads' request counts (e.g. 0.25 for a quick run)")
    ap.add_argument("--hf-batch", type=int, default=64, help="HF generate's static batch size (default 64)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per engine and workload; the fastest is kept (default 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the test model's ops are too small to gain from more, "
                         "and OpenMP threads spinning on a busy machine can slow a step a hundredfold; "
                         "0 = torch's default). Every engine runs with the same setting.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=tuple(MODEL_PRESETS), default=None,
                    help="the random model to build: 'small' (4 layers, hidden 512: Qwen3-0.6B's shape "
                         "scaled down; the default without the text workload) or 'test' (2 layers, hidden 128: "
                         "the tests' model, quick, and dominated by per-op overhead) or 'qwen3-0.6b' "
                         "(Qwen3-0.6B's own shape, with workloads sized for 2 cores)")
    ap.add_argument("--memory", action="store_true",
                    help="instead: each engine's start-up and peak RSS, one fresh process per engine "
                         "(course.bench.memory; its options: run.py bench --memory --help)")
    ap.add_argument("--model", default=None, help="an HF-format checkpoint directory instead of a random preset model")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--plot", default=None, metavar="PATH", help="also draw the results as a PNG (needs matplotlib)")
    add_impl_argument(ap)
    args = ap.parse_args(argv)
    sized = args.preset in SIZED_WORKLOADS and not args.model
    if args.workloads is None:
        args.workloads = ",".join(SIZED_WORKLOADS[args.preset] if sized else WORKLOADS)
    if args.engines is None:
        args.engines = "reference,fast" if sized else "ch24,reference,fast,hf"
    if args.scaling is None:
        args.scaling = ",".join(map(str, SIZED_SCALING if sized else SCALING_POINTS))
    workloads = [w for w in args.workloads.split(",") if w]
    engines = [e for e in args.engines.split(",") if e]
    for w in workloads:
        if w not in WORKLOADS + (TEXT,):
            ap.error(f"unknown workload {w!r}: choose from {WORKLOADS + (TEXT,)}")
    if TEXT in workloads and args.preset:
        ap.error("the text workload needs a checkpoint's tokenizer: drop --preset (it then runs on "
                 "models/qwen3-kjv-tiny) or pass --model DIR")
    for e in engines:
        if e not in ("ch24", "reference", "fast", "hf"):
            ap.error(f"unknown engine {e!r}: choose from ch24, reference, fast, hf")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.threads < 0:
        ap.error("--threads must be >= 0")
    if args.memory:  # run.py routes --memory to course.bench.memory before this parser sees it
        ap.error("--memory: run it as `python run.py bench --memory ...`")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = None
    if args.model or (TEXT in workloads and not args.preset):
        from course.train.tiny import DEFAULT_MODEL
        from engine.models import load_model
        from engine.tokenizer import Tokenizer

        # The shipped KJV model runs in float32 (its bfloat16 weights widened), as the presets do.
        model = load_model(args.model or DEFAULT_MODEL, dtype=None if args.model else torch.float32,
                           device=args.device)
        if TEXT in workloads:
            tokenizer = Tokenizer.from_pretrained(args.model or DEFAULT_MODEL)
    else:
        from engine.models import tiny_model

        model = tiny_model(seed=0, **MODEL_PRESETS[args.preset or "small"]).to(args.device, getattr(torch, args.dtype))
    try:
        scaling = tuple(int(x) for x in args.scaling.split(",") if x)
    except ValueError:
        ap.error(f"--scaling: comma-separated integers, got {args.scaling!r}")
    report = run_bench(model, workloads, engines, args.backend, scaling=scaling,
                       scaling_backends=tuple(args.scaling_backends.split(",")) if args.scaling_backends else None,
                       scaling_steps=args.steps, scale=args.scale, seed=args.seed, hf_batch=args.hf_batch,
                       repeat=args.repeat, tokenizer=tokenizer, preset=args.preset if sized else None,
                       roofline=not args.no_roofline)
    results = report.pop("_results")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, results, report["scaling"])
        print(f"wrote {args.plot}")
    return 0
