"""Chapter 31's stretch exercises, with reference solutions for instructors.

    python experiments/ch31.py free-order         tail-first against head-first freeing: what each keeps cached
                                                  (a simulation: no model runs)
    python experiments/ch31.py radix              a radix tree over blocks against the flat hash map
                                                  (a simulation: no model runs)
    python experiments/ch31.py cache-stats        per-step prefix-cache statistics on a multi-turn chat,
                                                  and the hit rate as the pool grows
    python experiments/ch31.py cache-aware        admit the request with the longest cached prefix first
                                                  (longest-prefix-match), against first come first served
    python experiments/ch31.py recompute-vs-swap  a pool too small for the work: preemption by recompute
                                                  vs by swap, prefix caching on and off

Every command runs the 2-layer test model on a CPU in well under a minute. Common options:
``--plot PATH`` saves a figure, ``--impl engine`` runs YOUR engine instead of the reference,
``--seed`` changes the workload, ``--threads`` sets torch's CPU threads (default 1: the test model's
matmuls are so small that more threads only add overhead), ``--model DIR`` and ``--device`` run a
real checkpoint (for example Qwen3-0.6B on a GPU) where the model matters.

The engine is never modified: statistics are read from the outside (``course.figures.viz.StepTracer`` and
the BlockManager's counters), and the cache-aware policy is a Scheduler subclass defined here.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from engine._impl import add_impl_argument, apply_impl  # noqa: E402

if __name__ == "__main__":  # the switch acts when ``engine.serve`` is first imported, so before the imports
    apply_impl(sys.argv[1:], prog="experiments/ch31.py")

import torch  # noqa: E402

from engine.models import load_model, tiny_model  # noqa: E402
from engine.serve.config import DEFAULT_BLOCK_SIZE  # noqa: E402
from engine.serve import (BlockManager, EngineConfig, EngineCore, Request, SamplingParams,  # noqa: E402
                          Scheduler)
from course.figures.viz import StepRecord, StepTracer  # noqa: E402
from course.bench.workloads import ChatTurn, chat_workload  # noqa: E402

VOCAB = 512  # the test model's vocabulary; workloads draw token ids below this


# ============================================================================= shared pieces
def make_model(model_dir: str | None = None, device: str = "cpu") -> torch.nn.Module:
    """The 2-layer test model, or a checkpoint directory loaded with chapter 17's loader."""
    if model_dir:
        return load_model(model_dir, device=device)
    return tiny_model(seed=0).to(device)


def make_core(model, scheduler_cls: type[Scheduler] | None = None, **config) -> EngineCore:
    """An EngineCore; with ``scheduler_cls``, its scheduler is replaced (before any request) by an
    instance of that subclass, keeping the engine's ``on_finish`` hook."""
    core = EngineCore(model, EngineConfig(**config))
    if scheduler_cls is not None:
        old = core.scheduler
        core.scheduler = scheduler_cls(core.config.scheduler_config(), core.blocks)
        core.scheduler.on_finish = old.on_finish
    return core


def rand_tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list: the smallest value with at least
    q% of the values at or below it."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def save_figure(fig, path: str | None) -> None:
    if path:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        print(f"figure saved to {path}")


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


# ============================================================================= admissions
class AdmissionTracer(StepTracer):
    """A StepTracer that watches admissions: which waiting requests each step admitted, and how
    many of their tokens the prefix cache supplied.

    Why not the BlockManager's ``hit_rate``? It counts each admission once (re-admissions after a
    preemption included), which mixes first visits with returns. Here a request counts once, at
    its FIRST admission: ``hit_rate`` = cached tokens / tokens of
    those requests, the figure a user of the cache cares about. Re-admissions after a recompute
    preemption, which often find the request's own blocks, are counted apart
    (``resume_cached_tokens`` of ``resume_tokens``); swap-ins don't consult the cache at all.
    ``step_cached`` / ``step_admitted`` cover every admission of the last step.
    """

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self.first_step: dict[str, int] = {}
        self.admitted_tokens = self.cached_tokens = 0
        self.resume_tokens = self.resume_cached_tokens = 0
        self.step_admitted = self.step_cached = 0
        self._waiting: dict[str, tuple[int, bool]] = {}

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.admitted_tokens if self.admitted_tokens else 0.0

    def step(self) -> list:
        self._waiting = {r.request_id: (r.num_computed_tokens, r.swapped_out) for r in self.core.scheduler.waiting}
        self.step_admitted = self.step_cached = 0
        return super().step()

    def on_plan(self, plan) -> None:
        for req, _ in plan.scheduled:
            before = self._waiting.get(req.request_id)
            if before is None or before[1]:  # was running, or comes back from host memory
                continue
            cached = req.num_computed_tokens - before[0]
            self.step_admitted += req.num_tokens
            self.step_cached += cached
            if req.request_id in self.first_step:
                self.resume_tokens += req.num_tokens
                self.resume_cached_tokens += cached
            else:
                self.first_step[req.request_id] = len(self.records) + 1
                self.admitted_tokens += req.num_tokens
                self.cached_tokens += cached


# ============================================================================= 3. cache-stats
@dataclass
class CacheStep:
    """One step's prefix-cache traffic, in tokens: ``computed`` went through the model;
    ``cached`` were supplied by the prefix cache to the requests admitted this step, whose token
    lists hold ``admitted`` tokens; ``evicted`` lost their cached K/V (the step's growth of
    ``num_evicted``: here always a block handed out again, since the chat driver never calls
    ``reset_prefix_cache``, which counts there too)."""

    step: int
    computed: int
    cached: int
    admitted: int
    evicted: int
    running: int
    waiting: int
    in_use: int
    cached_free: int


class CacheStatsTracer(AdmissionTracer):
    """Per-step ``CacheStep`` records; evictions come from the BlockManager's ``num_evicted``."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self.cache_steps: list[CacheStep] = []
        self._evicted_before = 0

    def step(self) -> list:
        self._evicted_before = self.core.blocks.num_evicted
        return super().step()

    def on_step_done(self, record: StepRecord) -> None:
        bm = self.core.blocks
        self.cache_steps.append(CacheStep(
            step=record.step, computed=record.tokens, cached=self.step_cached, admitted=self.step_admitted,
            evicted=(bm.num_evicted - self._evicted_before) * bm.block_size, running=record.running,
            waiting=record.waiting, in_use=record.in_use, cached_free=record.cached_free))


def chat(num_convs: int = 8, turns: int = 4, seed: int = 0, vocab_size: int = VOCAB):
    """Exercise 3's chat: short messages and answers so that many turns fit a small pool."""
    return chat_workload(num_convs, turns, seed=seed, vocab_size=vocab_size, message_len=(8, 24),
                         output_len=(12, 20))


def chat_longest(system: list[int], rounds: list[list[ChatTurn]]) -> int:
    """Upper bound on the workload's longest request (a last turn's prompt + answer): the pool
    must hold it."""
    return len(system) + max(sum(len(r[c].message) + r[c].max_tokens for r in rounds)
                             for c in range(len(rounds[0])))


def run_chat(core: EngineCore, system: list[int], rounds: list[list[ChatTurn]],
             tracer: StepTracer | None = None) -> dict[str, list[int]]:
    """Serve every conversation turn by turn: turn t+1's prompt is turn t's prompt, the answer the
    engine gave, and the next message. Each conversation moves on as soon as its own answer is
    done (no waiting for the others). Returns every answer by request id "c{conv}/t{turn}"."""
    tracer = tracer or StepTracer(core)
    live: dict[str, tuple[int, int, list[int]]] = {}
    answers: dict[str, list[int]] = {}

    def submit(conv: int, turn: int, history: list[int]) -> None:
        entry = rounds[turn][conv]
        rid = f"c{conv}/t{turn}"
        prompt = history + entry.message
        core.add_request(rid, prompt, SamplingParams(max_tokens=entry.max_tokens, ignore_eos=True, temperature=0.0))
        live[rid] = (conv, turn, prompt)

    for conv in range(len(rounds[0])):
        submit(conv, 0, list(system))
    while core.has_unfinished():
        for out in tracer.step():
            if out.finished:
                conv, turn, prompt = live.pop(out.request_id)
                answers[out.request_id] = out.output_token_ids
                if turn + 1 < len(rounds):
                    submit(conv, turn + 1, prompt + out.output_token_ids)
    return answers


def cache_stats(pool_sizes: Sequence[int] = (14, 20, 24, 32, 40, 48, 64, 96), num_convs: int = 8,
                turns: int = 4, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0, show_pool: int | None = 20,
                show_steps: int = 30, model=None, plot: str | None = None, quiet: bool = False) -> dict:
    """Exercise 3: per-step cache statistics for one pool size, and the hit rate across sizes."""
    model = model if model is not None else make_model()
    system, rounds = chat(num_convs, turns, seed, model.cfg.vocab_size)
    longest = chat_longest(system, rounds)
    smallest = -(-longest // block_size)
    sizes = [n for n in pool_sizes if n >= smallest]
    if not sizes:
        raise ValueError(f"every pool size is below {smallest} blocks, the longest request's need")
    summary, traces, reference = [], {}, None
    for num_blocks in sizes:
        core = make_core(model, block_size=block_size, num_blocks=num_blocks)
        tracer = CacheStatsTracer(core)
        answers = run_chat(core, system, rounds, tracer)
        reference = reference or answers
        steps = tracer.cache_steps
        summary.append({
            "pool_blocks": num_blocks, "hit_rate": round(tracer.hit_rate, 3), "steps": core.steps,
            "computed": sum(s.computed for s in steps), "cached": tracer.cached_tokens,
            "resume_cached": tracer.resume_cached_tokens, "evicted": sum(s.evicted for s in steps),
            "preemptions": core.preemptions,
            "same_answers": answers == reference})
        traces[num_blocks] = steps
    if not quiet:
        print(f"multi-turn chat: {num_convs} conversations x {turns} turns, a {len(system)}-token system "
              f"prompt, longest request {longest} tokens ({smallest} blocks of {block_size})\n")
        shown = show_pool if show_pool in traces else sizes[0]
        print(f"per step, pool of {shown} blocks (tokens; first {show_steps} steps):")
        print_table([asdict(s) for s in traces[shown][:show_steps]],
                    ["step", "computed", "cached", "admitted", "evicted", "running", "waiting", "in_use",
                     "cached_free"])
        print("\nhit rate by pool size:")
        print_table(summary, list(summary[0]))
    if plot:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
        ax1.plot([s["pool_blocks"] for s in summary], [s["hit_rate"] for s in summary], marker="o")
        ax1.set_xlabel(f"pool size (blocks of {block_size} tokens)")
        ax1.set_ylabel("prefix-cache hit rate (tokens)")
        ax1.set_ylim(0, 1)
        ax1.set_title("multi-turn chat: hit rate vs pool size")
        shown = traces[show_pool if show_pool in traces else sizes[0]]
        x = [s.step for s in shown]
        ax2.bar(x, [s.computed for s in shown], width=1.0, label="computed", color="#55a868")
        ax2.bar(x, [s.cached for s in shown], width=1.0, bottom=[s.computed for s in shown],
                label="served by the cache", color="#f2b134")
        ax2.bar(x, [-s.evicted for s in shown], width=1.0, label="evicted (below 0)", color="#c44e52")
        ax2.axhline(0, color="black", linewidth=0.6)
        ax2.set_xlabel("step")
        ax2.set_ylabel("tokens")
        ax2.set_title(f"per step, pool of {show_pool if show_pool in traces else sizes[0]} blocks")
        ax2.legend(fontsize=8)
        save_figure(fig, plot)
    return {"summary": summary, "per_step": {k: [asdict(s) for s in v] for k, v in traces.items()}}


# ============================================================================= 5. recompute vs swap
def long_output_workload(num_requests: int = 8, system_len: int = 32, question_len: tuple[int, int] = (8, 24),
                         output_len: tuple[int, int] = (64, 96), seed: int = 0,
                         vocab: int = VOCAB) -> list[tuple[str, list[int], int]]:
    """Requests with a short shared system prompt and long answers: (id, prompt, max_tokens)."""
    rng = random.Random(seed)
    system = rand_tokens(rng, system_len, vocab)
    return [(f"r{i}", system + rand_tokens(rng, rng.randint(*question_len), vocab), rng.randint(*output_len))
            for i in range(num_requests)]


class PreemptionTracer(AdmissionTracer):
    """Counts the blocks each step copies out to and back from host memory."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0

    def on_plan(self, plan) -> None:
        super().on_plan(plan)
        self.blocks_swapped_out += sum(len(b) for _, b in plan.swap_out)
        self.blocks_swapped_in += sum(len(b) for _, b in plan.swap_in)


def timed_run(core: EngineCore, work: list[tuple[str, list[int], int]]) -> tuple[dict, dict[str, list[int]]]:
    """Serve ``work`` (all arriving at once) and time every output token.

    Time per output token (TPOT) of a request = (last token time - first token time) / (tokens - 1);
    the inter-token gaps of all requests together give the tail a user notices as a stall.
    """
    tracer = PreemptionTracer(core)
    for rid, prompt, max_tokens in work:
        core.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    times: dict[str, list[float]] = {rid: [] for rid, _, _ in work}
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while core.has_unfinished():
        outs = tracer.step()
        now = time.perf_counter()
        for out in outs:
            times[out.request_id] += [now] * len(out.new_token_ids)
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    total = time.perf_counter() - start
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    n_out = sum(len(v) for v in outputs.values())
    return {
        "total_s": round(total, 3), "tok_s": round(n_out / total, 1), "steps": core.steps,
        "preemptions": core.preemptions,
        "tpot_mean_ms": round(1e3 * sum(tpot) / len(tpot), 3), "tpot_p99_ms": round(1e3 * percentile(tpot, 99), 3),
        "itl_p99_ms": round(1e3 * percentile(gaps, 99), 3),
        "computed_tokens": sum(r.tokens for r in tracer.records),
        "recomputed_tokens": sum(r.recompute for r in tracer.records),
        "blocks_swapped": tracer.blocks_swapped_out + tracer.blocks_swapped_in,
        "prefix_hit_rate": round(tracer.hit_rate, 3),
        "resume_hit_rate": round(tracer.resume_cached_tokens / tracer.resume_tokens, 3) if tracer.resume_tokens else 0.0,
    }, outputs


def recompute_vs_swap(num_requests: int = 8, num_blocks: int = 20, block_size: int = DEFAULT_BLOCK_SIZE,
                      output_len: tuple[int, int] = (64, 96), seed: int = 0, repeats: int = 2, model=None,
                      backend: str | None = None, plot: str | None = None, quiet: bool = False) -> dict:
    """Exercise 5: the same over-full workload under both preemption modes, caching on and off."""
    model = model if model is not None else make_model()
    work = long_output_workload(num_requests, output_len=output_len, seed=seed, vocab=model.cfg.vocab_size)
    need = sum(len(p) + m for _, p, m in work)
    # Warm-up (first calls pay one-off costs), then each configuration `repeats` times; keep the
    # fastest run, the usual way to time on a shared machine.
    extra = {"attention_backend": backend} if backend else {}
    timed_run(make_core(model, block_size=block_size, num_blocks=num_blocks, **extra), work[:2])
    rows, outputs = [], {}
    for mode in ("recompute", "swap"):
        for caching in (True, False):
            runs = []
            for _ in range(repeats):
                core = make_core(model, block_size=block_size, num_blocks=num_blocks, preemption_mode=mode,
                                 enable_prefix_caching=caching, **extra)
                runs.append(timed_run(core, work))
            stats, out = min(runs, key=lambda r: r[0]["total_s"])
            label = f"{mode}, caching {'on' if caching else 'off'}"
            rows.append({"config": label, **stats})
            outputs[label] = out
    first = next(iter(outputs.values()))
    for row in rows:
        row["same_tokens"] = outputs[row["config"]] == first
    if not quiet:
        print(f"{num_requests} requests needing {need} token slots in a pool of {num_blocks * block_size} "
              f"({num_blocks} blocks of {block_size}); device {next(model.parameters()).device}\n")
        print_table(rows, ["config", "total_s", "tok_s", "steps", "preemptions", "tpot_mean_ms", "tpot_p99_ms",
                           "itl_p99_ms", "recomputed_tokens", "blocks_swapped", "prefix_hit_rate",
                           "resume_hit_rate", "same_tokens"])
    if plot:
        import matplotlib.pyplot as plt

        for row in rows:
            row["tokens_copied"] = row["blocks_swapped"] * block_size
        fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
        labels = [r["config"].replace(", ", "\n") for r in rows]
        for ax, key, name in zip(axes, ("total_s", "tpot_p99_ms", "recomputed_tokens", "tokens_copied"),
                                 ("total time (s)", "p99 time per output token (ms)", "tokens recomputed",
                                  "tokens copied to and from host")):
            ax.bar(labels, [r[key] for r in rows], color=["#c44e52", "#e8a0a0", "#4c72b0", "#a0b4d8"])
            ax.set_title(name, fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
        save_figure(fig, plot)
    return {"rows": rows}


# ============================================================================= 4. cache-aware
class CacheAwareScheduler(Scheduler):
    """Longest-prefix-match admission: before each step, the waiting queue is reordered so that
    the request with the most tokens already in the prefix cache is admitted first.

    Everything else is the chapter's scheduler. Order key: swapped-out requests first (their K/V
    is waiting in host memory), then requests that have waited ``max_wait_steps`` or more (aging,
    which bounds starvation; None = never), then the longest cached prefix, then the usual order.
    """

    max_wait_steps: int | None = None

    def __init__(self, config, block_manager: BlockManager) -> None:
        super().__init__(config, block_manager)
        self.steps_scheduled = 0
        self.enqueued_at: dict[str, int] = {}

    def add(self, request: Request) -> None:
        super().add(request)
        self.enqueued_at[request.request_id] = self.steps_scheduled

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens ``find_cached_prefix`` would give ``request`` now, without counting the lookup in
        the hit statistics (only admissions should count)."""
        bm = self.blocks
        queries, hits = bm.num_queries, bm.num_hits
        found = len(bm.find_cached_prefix(request)) * bm.block_size
        bm.num_queries, bm.num_hits = queries, hits
        return found

    def admission_key(self, request: Request) -> tuple:
        waited = self.steps_scheduled - self.enqueued_at.get(request.request_id, self.steps_scheduled)
        aged = self.max_wait_steps is not None and waited >= self.max_wait_steps
        return (not request.swapped_out, not aged, -self.cached_prefix_tokens(request), self.order_key(request))

    def schedule(self):
        self.steps_scheduled += 1
        if len(self.waiting) > 1:
            keys = {r.request_id: self.admission_key(r) for r in self.waiting}
            self.waiting.sort(key=lambda r: keys[r.request_id])
        return super().schedule()


def aged_scheduler(max_wait_steps: int) -> type[CacheAwareScheduler]:
    """A CacheAwareScheduler class whose requests jump the queue after ``max_wait_steps`` steps."""
    return type(f"CacheAwareAged{max_wait_steps}", (CacheAwareScheduler,), {"max_wait_steps": max_wait_steps})


def multi_prompt_workload(num_requests: int = 48, num_prompts: int = 4, system_len: int = 96,
                          question_len: tuple[int, int] = (8, 24), output_len: tuple[int, int] = (6, 12),
                          hot_share: float = 0.55, seed: int = 0,
                          vocab: int = VOCAB) -> list[tuple[str, int, list[int], int]]:
    """Requests on several system prompts: (id, which prompt, prompt tokens, max_tokens). Prompt 0
    is "hot" (``hot_share`` of the requests); the others share the rest evenly."""
    rng = random.Random(seed)
    systems = [rand_tokens(rng, system_len, vocab) for _ in range(num_prompts)]
    weights = [hot_share] + [(1 - hot_share) / (num_prompts - 1)] * (num_prompts - 1)
    work = []
    for i in range(num_requests):
        s = rng.choices(range(num_prompts), weights)[0]
        work.append((f"q{i}", s, systems[s] + rand_tokens(rng, rng.randint(*question_len), vocab),
                     rng.randint(*output_len)))
    return work


def run_arrivals(core: EngineCore, work: list[tuple[str, int, list[int], int]], rate: float) -> dict:
    """Requests arrive at ``rate`` per step (1.5: three every two steps) until all have; returns
    the hit rate and the waits, in steps from arrival to first being scheduled."""
    tracer = AdmissionTracer(core)
    arrived: dict[str, int] = {}
    pending = deque(work)
    due = 0.0
    while pending or core.has_unfinished():
        due += rate
        while pending and due >= 1.0:
            due -= 1.0
            rid, _, prompt, max_tokens = pending.popleft()
            step = len(tracer.records) + 1  # the step about to run
            core.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                             arrival_time=float(step))
            arrived[rid] = step
        tracer.step()
    waits = {rid: tracer.first_step[rid] - arrived[rid] for rid in arrived}
    prompt_of = {rid: s for rid, s, _, _ in work}
    worst = max(waits, key=waits.get)
    cold = [w for rid, w in waits.items() if prompt_of[rid] != 0]
    return {"hit_rate": round(tracer.hit_rate, 3), "steps": core.steps, "preemptions": core.preemptions,
            "mean_wait": round(sum(waits.values()) / len(waits), 1), "max_wait": waits[worst],
            "max_wait_cold": max(cold, default=0), "worst_request": f"{worst} (prompt {prompt_of[worst]})"}


def cache_aware(num_requests: int = 48, num_prompts: int = 6, num_blocks: int = 40, block_size: int = DEFAULT_BLOCK_SIZE,
                max_num_seqs: int = 4, rate: float = 0.5, max_wait_steps: int = 20, seed: int = 0,
                model=None, plot: str | None = None, quiet: bool = False) -> dict:
    """Exercise 4: FCFS vs longest-prefix-match admission (and LPM with aging) on several prompts."""
    model = model if model is not None else make_model()
    work = multi_prompt_workload(num_requests, num_prompts, seed=seed, vocab=model.cfg.vocab_size)
    rows = []
    for label, cls in (("fcfs", None), ("cache-aware", CacheAwareScheduler),
                       (f"cache-aware, aging {max_wait_steps}", aged_scheduler(max_wait_steps))):
        core = make_core(model, cls, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs)
        rows.append({"policy": label, **run_arrivals(core, work, rate)})
    if not quiet:
        print(f"{num_requests} requests on {num_prompts} system prompts (prompt 0 is hot), {rate} "
              f"arriving per step; pool {num_blocks} blocks of {block_size}, max_num_seqs {max_num_seqs}\n")
        print_table(rows, list(rows[0]))
    if plot:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
        labels = [r["policy"].replace(", ", "\n") for r in rows]
        ax1.bar(labels, [r["hit_rate"] for r in rows], color="#f2b134")
        ax1.set_ylim(0, 1)
        ax1.set_title("prefix-cache hit rate", fontsize=10)
        ax2.bar(labels, [r["max_wait"] for r in rows], color="#c44e52", label="max wait")
        ax2.bar(labels, [r["mean_wait"] for r in rows], color="#4c72b0", label="mean wait")
        ax2.set_title("steps from arrival to admission", fontsize=10)
        ax2.legend(fontsize=8)
        save_figure(fig, plot)
    return {"rows": rows}


# ============================================================================= 2. radix tree
class RadixNode:
    """One full block in the tree: its tokens (the edge from the parent), the pool block holding
    their K/V, the requests using it (``ref``) and the last time one did."""

    __slots__ = ("tokens", "block", "parent", "children", "ref", "last_used")

    def __init__(self, tokens: tuple[int, ...], block: int | None, parent: RadixNode | None) -> None:
        self.tokens = tokens
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.ref = 0
        self.last_used = 0


class RadixBlockCache:
    """A prefix cache as a radix tree whose edges are whole blocks (SGLang's RadixAttention idea,
    at block granularity), simulated: it tracks which pool block holds which tokens, no K/V.

    - Lookup walks the tree block by block. Where no child matches the next whole block, the child
      sharing the longest token prefix with it gives a PARTIAL match: its first j slots are copied
      into the request's fresh block (``partial=False`` turns this off).
    - As in the chapter, the token whose logits choose the next token is never matched.
    - Eviction takes the least recently used LEAF no request holds; a parent becomes evictable
      only after its children are gone, so a cached chain is never cut in the middle.
    Invariant: every node except the root holds exactly one pool block; ``free`` holds the rest,
    except blocks private to running requests (duplicates and partial tails).
    """

    def __init__(self, num_blocks: int, block_size: int, partial: bool = True) -> None:
        self.block_size = block_size
        self.partial = partial
        self.root = RadixNode((), None, None)
        self.free = list(range(num_blocks))
        self.clock = 0
        self.num_queries = self.num_hits = self.num_partial_hits = self.num_copies = self.num_evicted = 0
        self.held: dict[str, tuple[list[RadixNode], list[int]]] = {}  # rid -> (nodes, private blocks)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def match(self, tokens: Sequence[int]) -> tuple[list[RadixNode], RadixNode | None, int]:
        """(whole-block path, partial-match node or None, tokens matched in it)."""
        bs, limit = self.block_size, len(tokens) - 1
        node, path, pos = self.root, [], 0
        while pos + bs <= limit:
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            path.append(child)
            node, pos = child, pos + bs
        best, best_len = None, 0
        if self.partial:
            want = tokens[pos:min(pos + bs, limit)]
            for child in node.children.values():
                j = 0
                while j < len(want) and child.tokens[j] == want[j]:
                    j += 1
                if j > best_len:
                    best, best_len = child, j
        return path, best, best_len

    def _take_block(self) -> int | None:
        if self.free:
            return self.free.pop()
        leaves = [n for n in self._nodes() if not n.children and n.ref == 0]
        if not leaves:
            return None
        victim = min(leaves, key=lambda n: n.last_used)
        del victim.parent.children[victim.tokens]
        self.num_evicted += 1
        return victim.block

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def admit(self, rid: str, prompt: Sequence[int], tokens: Sequence[int]) -> bool:
        """Admit a request whose K/V will cover ``tokens[:-1]`` (prompt + all but the last output
        token); afterwards its full blocks are in the tree, held until ``finish``."""
        bs = self.block_size
        self.clock += 1
        path, src, j = self.match(prompt)
        for n in path + ([src] if src else []):  # pin what we use while blocks are taken
            n.ref += 1
            n.last_used = self.clock
        need = -(-len(tokens) // bs) - len(path)
        new = []
        for _ in range(need):
            b = self._take_block()
            if b is None:
                self.free += new
                for n in path + ([src] if src else []):
                    n.ref -= 1
                return False
            new.append(b)
        if src is not None:
            src.ref -= 1  # the copy of its first j slots into new[0] is done
            self.num_copies += 1
        self.num_queries += len(prompt)
        self.num_hits += len(path) * bs + j
        self.num_partial_hits += j
        # Insert the request's own full blocks below the matched path.
        node, nodes, private = path[-1] if path else self.root, list(path), []
        full = (len(tokens) - 1) // bs  # blocks whose K/V will be complete
        for i, b in enumerate(new, start=len(path)):
            if i >= full:
                private.append(b)  # the partial tail: not shareable
                continue
            key = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = RadixNode(key, b, node)
            else:
                private.append(b)  # someone cached these tokens already: ours stays private
            child.ref += 1
            child.last_used = self.clock
            nodes.append(child)
            node = child
        self.held[rid] = (nodes, private)
        return True

    def finish(self, rid: str) -> None:
        nodes, private = self.held.pop(rid)
        for n in nodes:
            n.ref -= 1
            n.last_used = self.clock
        self.free += private


class FlatBlockCache:
    """The chapter's BlockManager (or a subclass, ``manager``) driven the same way as
    ``RadixBlockCache``: admit = look up, allocate, publish; finish = free. No model runs."""

    def __init__(self, num_blocks: int, block_size: int, manager: type[BlockManager] = BlockManager) -> None:
        self.bm = manager(num_blocks, block_size)
        self.requests: dict[str, Request] = {}

    @property
    def hit_rate(self) -> float:
        return self.bm.hit_rate

    def admit(self, rid: str, prompt: Sequence[int], tokens: Sequence[int]) -> bool:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max(1, len(tokens) - len(prompt)), temperature=0.0))
        cached = self.bm.find_cached_prefix(req)
        if not self.bm.allocate_slots(req, len(tokens) - len(cached) * self.bm.block_size, cached):
            return False
        for t in tokens[len(prompt):]:
            req.append(t)
        req.num_computed_tokens = len(tokens) - 1
        self.bm.cache_full_blocks(req)
        self.requests[rid] = req
        return True

    def finish(self, rid: str) -> None:
        self.bm.free(self.requests.pop(rid))


def tree_workload(apps: int = 3, templates: int = 3, users: int = 3, turns: int = 3, seed: int = 0,
                  vocab: int = VOCAB) -> list[tuple[str, list[int], list[int]]]:
    """A tree of shared prefixes: app system prompts -> few-shot templates -> users' multi-turn
    chats. Lengths are random, so branch points fall mid-block. Returns (id, prompt, prompt +
    answer) in arrival order: conversations interleave, each conversation's turns stay in order."""
    rng = random.Random(seed)
    convs = []
    for a in range(apps):
        system = rand_tokens(rng, rng.randint(70, 130), vocab)
        for t in range(templates):
            template = rand_tokens(rng, rng.randint(20, 60), vocab)
            for u in range(users):
                convs.append((f"a{a}t{t}u{u}", system + template))
    histories = {cid: list(prefix) for cid, prefix in convs}
    work = []
    for turn in range(turns):
        order = list(histories)
        rng.shuffle(order)
        for cid in order:
            prompt = histories[cid] + rand_tokens(rng, rng.randint(10, 30), vocab)
            answer = rand_tokens(rng, rng.randint(10, 30), vocab)
            work.append((f"{cid}/t{turn}", prompt, prompt + answer))
            histories[cid] = prompt + answer
    return work


def simulate(cache, work: list[tuple[str, list[int], list[int]]], concurrency: int) -> float:
    """Admit requests in order, ``concurrency`` at a time (the oldest finishes when a new one
    arrives beyond that); returns the cache's hit rate."""
    live: deque[str] = deque()
    for rid, prompt, tokens in work:
        if len(live) >= concurrency:
            cache.finish(live.popleft())
        if not cache.admit(rid, prompt, tokens):
            raise ValueError(f"{rid}: the pool cannot hold {concurrency} requests at once; give it more blocks")
        live.append(rid)
    while live:
        cache.finish(live.popleft())
    return cache.hit_rate


def radix(pool_sizes: Sequence[int] = (96, 112, 128, 160, 192, 256, 384), block_size: int = DEFAULT_BLOCK_SIZE,
          concurrency: int = 4, seed: int = 0, work=None, plot: str | None = None, quiet: bool = False) -> dict:
    """Exercise 2: hit rates of the flat hash map and the radix tree (with and without partial
    matches) on a tree-shaped workload, across pool sizes."""
    work = work if work is not None else tree_workload(seed=seed)
    longest = max(-(-len(t) // block_size) for _, _, t in work)
    rows = []
    for num_blocks in pool_sizes:
        if num_blocks < concurrency * longest:
            continue
        radix_cache = RadixBlockCache(num_blocks, block_size)
        flat_cache = FlatBlockCache(num_blocks, block_size)
        row = {"pool_blocks": num_blocks,
               "flat": round(simulate(flat_cache, work, concurrency), 3),
               "radix_whole_blocks": round(simulate(RadixBlockCache(num_blocks, block_size, partial=False),
                                                    work, concurrency), 3),
               "radix": round(simulate(radix_cache, work, concurrency), 3)}
        row["partial_tokens"] = radix_cache.num_partial_hits
        row["evicted_flat"] = flat_cache.bm.num_evicted
        row["evicted_radix"] = radix_cache.num_evicted
        rows.append(row)
    if not rows:
        raise ValueError(f"every pool size is below {concurrency * longest} blocks ({concurrency} longest requests)")
    roomy = no_eviction_pool(work, block_size, concurrency, concurrency * longest)
    if not quiet:
        prompt_tokens = sum(len(p) for _, p, _ in work)
        print(f"tree workload: {len(work)} requests, {prompt_tokens} prompt tokens, block size {block_size}, "
              f"{concurrency} requests in flight (simulated: hit rate = prompt tokens found / looked up)\n")
        print_table(rows, list(rows[0]))
        print(f"\nsmallest pool in which neither cache evicts a block: {roomy} blocks")
    if plot:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        x = [r["pool_blocks"] for r in rows]
        for key, style in (("flat", "o-"), ("radix_whole_blocks", "s--"), ("radix", "^-")):
            ax.plot(x, [r[key] for r in rows], style, label=key.replace("_", " "))
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"pool size (blocks of {block_size} tokens)")
        ax.set_ylabel("prefix-cache hit rate (tokens)")
        ax.set_title("tree-shaped workload: flat hash map vs radix tree")
        ax.legend(fontsize=8)
        save_figure(fig, plot)
    return {"rows": rows, "no_eviction_from": roomy}


def no_eviction_pool(work, block_size: int, concurrency: int, low: int) -> int:
    """The smallest pool (at least ``low`` blocks) in which neither the flat map nor the whole-block
    tree evicts anything on ``work``: from there on both keep everything and must agree."""
    def evicts(n: int) -> bool:
        flat, tree = FlatBlockCache(n, block_size), RadixBlockCache(n, block_size, partial=False)
        simulate(flat, work, concurrency)
        simulate(tree, work, concurrency)
        return flat.bm.num_evicted > 0 or tree.num_evicted > 0
    high = max(low, 1)
    while evicts(high):
        high *= 2
    while low < high:  # evictions only shrink as the pool grows
        mid = (low + high) // 2
        low, high = (mid + 1, high) if evicts(mid) else (low, mid)
    return high


# ============================================================================= 1. free order
class HeadFirstBlockManager(BlockManager):
    """The chapter's BlockManager with one rule reversed: ``free`` returns a request's blocks to
    the queue in table order (first block first), so its first blocks are evicted first."""

    def free(self, request: Request) -> None:
        table = self.req_blocks.get(request.request_id, [])
        super().free(request)  # all the bookkeeping, blocks joining the queue tail first ...
        for b in table:  # ... then re-queue the ones that became free in head-first order
            if b in self.free_queue:
                self.free_queue.move_to_end(b)


def skewed_prompt_workload(num_requests: int = 60, popularity: Sequence[int] = (8, 4, 2, 1),
                           system_len: tuple[int, int] = (96, 160), private_len: tuple[int, int] = (32, 96),
                           seed: int = 0, vocab: int = VOCAB) -> list[tuple[str, list[int], list[int]]]:
    """Requests on a few system prompts of unequal popularity (``popularity``: relative weights),
    each with its own question and answer: (id, prompt, prompt + answer) in arrival order."""
    rng = random.Random(seed)
    systems = [rand_tokens(rng, rng.randint(*system_len), vocab) for _ in popularity]
    work = []
    for i in range(num_requests):
        system = systems[rng.choices(range(len(systems)), weights=popularity)[0]]
        prompt = system + rand_tokens(rng, rng.randint(*private_len), vocab)
        work.append((f"u{i}", prompt, prompt + rand_tokens(rng, rng.randint(*private_len), vocab)))
    return work


def free_order(extra_blocks: Sequence[int] = (0, 12, 24, 36, 48, 72, 96), concurrency: int = 1,
               block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0, work=None, plot: str | None = None,
               quiet: bool = False) -> dict:
    """Exercise 1: hit rate of tail-first freeing (the chapter's rule) against head-first, on
    requests sharing a few system prompts of unequal popularity, served ``concurrency`` at a time,
    in pools from just big enough (``extra_blocks`` = 0) upward. A simulation: no model runs."""
    work = work if work is not None else skewed_prompt_workload(seed=seed)
    smallest = concurrency * max(-(-len(t) // block_size) for _, _, t in work)
    rows = []
    for extra in extra_blocks:
        n = smallest + extra
        tail, head = FlatBlockCache(n, block_size), FlatBlockCache(n, block_size, HeadFirstBlockManager)
        rows.append({"pool_blocks": n, "tail_first": round(simulate(tail, work, concurrency), 3),
                     "head_first": round(simulate(head, work, concurrency), 3),
                     "evicted_tail_first": tail.bm.num_evicted, "evicted_head_first": head.bm.num_evicted})
    if not quiet:
        prompt_tokens = sum(len(p) for _, p, _ in work)
        print(f"{len(work)} requests on system prompts of unequal popularity, {prompt_tokens} prompt tokens, "
              f"{concurrency} at a time, blocks of {block_size} (simulated: hit rate = prompt tokens found / "
              f"looked up)\n")
        print_table(rows, list(rows[0]))
    if plot:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        x = [r["pool_blocks"] for r in rows]
        ax.plot(x, [r["tail_first"] for r in rows], "o-", label="tail first (the chapter's free)")
        ax.plot(x, [r["head_first"] for r in rows], "s--", label="head first")
        ax.set_xlabel(f"pool size (blocks of {block_size} tokens)")
        ax.set_ylabel("prefix-cache hit rate (tokens)")
        ax.set_title("which end of a finished request to evict first")
        ax.legend(fontsize=8)
        save_figure(fig, plot)
    return {"rows": rows}


# ============================================================================= command line
EXPERIMENTS = ("free-order", "radix", "cache-stats", "cache-aware", "recompute-vs-swap")  # the exercises' order


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="experiments/ch31.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=EXPERIMENTS)
    ap.add_argument("--plot", default=None, help="save a figure to this path (PNG, SVG, PDF)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    add_impl_argument(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--model", default=None, help="an HF-format checkpoint directory instead of the test model")
    ap.add_argument("--device", default="cpu", help="where the model runs (default cpu)")
    ap.add_argument("--backend", default=None, help="attention backend of recompute-vs-swap (default: EngineConfig's)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per configuration, fastest kept "
                    "(recompute-vs-swap; default 2)")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        result = run_experiment(args)
    except NotImplementedError as exc:
        print(f"Your engine is not finished yet: {exc}. Fill that hole in, check it with "
              "`pytest tests/test_ch31_engine_v2.py`, or pass --impl solution.", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


def run_experiment(args: argparse.Namespace) -> dict:
    """The chosen experiment with the command line's settings; returns its results."""
    if args.experiment == "radix":
        return radix(seed=args.seed, plot=args.plot)
    if args.experiment == "free-order":
        return free_order(seed=args.seed, plot=args.plot)
    model = make_model(args.model, args.device)
    if args.experiment == "cache-stats":
        return {"summary": cache_stats(seed=args.seed, model=model, plot=args.plot)["summary"]}
    if args.experiment == "recompute-vs-swap":
        return recompute_vs_swap(seed=args.seed, model=model, backend=args.backend, repeats=args.repeats,
                                 plot=args.plot)
    return cache_aware(seed=args.seed, model=model, plot=args.plot)

if __name__ == "__main__":
    sys.exit(main())
