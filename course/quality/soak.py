"""Soak test: a long random workload against the engine core, checking everything after every step.

    python -m course.quality.soak                 # 20,000 random operations against the reference
    python -m course.quality.soak --operations 2000 --seed 3 --impl engine
    python -m course.quality.soak --path compiled # the same workload on another forward path (see PATHS)

Each episode builds an ``EngineCore`` with a random configuration (block size, pool size down to
barely enough for one request, token budget, chunking and its threshold, fcfs or priority,
recompute or swap, prefix caching on or off, max_num_seqs), then runs random operations on it:
add a request (prompts drawn from a few shared prefixes, n > 1, priorities, tenants' cache keys,
greedy or sampled, seeded or not, stop tokens, min_tokens), abort one (waiting, mid-prefill,
decoding, preempted, swapped, or an unknown id), step, reset the prefix cache, or run a step whose
forward pass fails at a random layer (``course.quality.faults``; ``--faults`` sets how often), perhaps
followed at once by an abort. After every step, failed ones included,
the whole engine is checked (``course.quality.invariants``). Every greedy request that finishes
normally must equal ``generate()`` on its prompt alone (cut where its stop rules say; token by
token with the EOS and stop ids masked while ``min_tokens`` holds them back), every seeded sampled
request must equal an independent token-by-token sampler with the same seed (both:
``course.quality.oracle``), and
its streamed tokens must add up to its final output. Each episode ends by running to idle, where
every block must be free and every per-request structure empty.

``--path`` picks the forward pass every episode runs (``PATHS``): the plain flat model on the
reference backend (the default), or the fast flat model (``flat_model="fused"``) on the torch or cpu
backend, or compiled (``flat_model="compiled"``, cpu backend; one graph, compiled in the first episode). On
the fast paths the failing steps fail inside the attention backend (``course.quality.faults.backend_fault``),
since those models never call the modules the plain model's hooks sit on.

Prints the number of operations run and of violations found; exits 1 on any violation.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 10  # the longest output any soak request asks for
NUM_PREFIXES = (0, 5, 16, 23)  # lengths of the shared prefixes (0 = no shared prefix)
NUM_SUFFIXES = 8
STALL_STEPS = 2000  # draining with no request finishing for this long counts as a livelock
# --path: the EngineConfig fields that select each forward path.
PATHS = {"reference": {},
         "torch": {"attention_backend": "torch", "flat_model": "fused"},
         "cpu": {"attention_backend": "cpu", "flat_model": "fused"},
         "compiled": {"attention_backend": "cpu", "flat_model": "compiled"}}


@dataclass
class Tracked:
    """What the soak remembers about one live request id (a child for n > 1)."""

    prompt: tuple[int, ...]
    params: object  # SamplingParams of this child
    parent: str
    streamed: list[int] = field(default_factory=list)


class Soak:
    """Drives random episodes and counts violations; ``run(num_ops)`` returns the violations."""

    def __init__(self, seed: int = 0, verbose: bool = False, fault_rate: float = 0.05, path: str = "reference") -> None:
        import torch

        if path not in PATHS:
            raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
        self.path = path

        from engine.models.tiny import tiny_model

        self.torch = torch
        torch.set_num_threads(1)  # the test model is tiny: one thread beats two that wait on each other
        self.rng = random.Random(seed)
        self.verbose = verbose
        self.fault_rate = fault_rate  # share of operations that are a step whose forward pass fails
        self.model = tiny_model(seed=0, dtype=torch.float64)
        vocab = self.model.cfg.vocab_size
        prng = random.Random(1234)  # the prompt families are the same in every run
        self.prefixes = [[prng.randrange(vocab) for _ in range(n)] for n in NUM_PREFIXES]
        self.suffixes = [[prng.randrange(vocab) for _ in range(1 + 2 * j % 13)] for j in range(NUM_SUFFIXES)]
        self.greedy_cache: dict[tuple[int, ...], list[int]] = {}
        self.sampled_cache: dict[tuple, list[int]] = {}
        self.violations: list[str] = []
        self.ops = 0  # random operations (add, abort, step, reset)
        self.drain_steps = 0  # steps run to bring each episode to idle
        self.episodes = 0
        self.counts = {"finished": 0, "compared": 0, "aborted": 0, "preemptions": 0, "rejected": 0,
                       "faults": 0, "mismatches": 0}
        self.abort_kinds: dict[str, int] = {}  # aborted requests by the state they were in

    # ----- oracles -------------------------------------------------------------------------
    def greedy(self, prompt: tuple[int, ...]) -> list[int]:
        from engine.generate import generate

        if prompt not in self.greedy_cache:
            self.greedy_cache[prompt] = generate(self.model, list(prompt), MAX_NEW)
        return self.greedy_cache[prompt]

    def continuation(self, *key) -> list[int]:
        """``course.quality.oracle.stepwise`` on the soak's model, cached per (prompt, sampling, mask)."""
        from course.quality import oracle

        if key not in self.sampled_cache:
            prompt, *rest = key
            self.sampled_cache[key] = oracle.stepwise(self.model, prompt, MAX_NEW, *rest)
        return self.sampled_cache[key]

    # ----- one episode ---------------------------------------------------------------------
    def random_config(self):
        from engine.serve.config import EngineConfig

        r = self.rng
        bs = r.choice((1, 2, 4, 8, 16))
        longest = max(NUM_PREFIXES) + max(len(s) for s in self.suffixes) + MAX_NEW
        barely = -(-longest // bs)
        num_blocks = r.choice((max(1, barely - 1), barely, barely, barely, barely + 1, barely + r.randrange(1, 3 * barely + 2), 4 * barely))
        chunked = r.random() < 0.75
        budget = r.choice((1, 3, 8, 16, 40, 2048)) if chunked else r.choice((40, 64, 2048))
        return EngineConfig(
            block_size=bs, num_blocks=num_blocks, max_num_batched_tokens=budget,
            max_num_seqs=r.choice((1, 2, 3, 8, 256)), enable_chunked_prefill=chunked,
            long_prefill_token_threshold=r.choice((0, 0, 2, 5)) if chunked else 0,
            policy=r.choice(("fcfs", "priority")), preemption_mode=r.choice(("recompute", "swap")),
            enable_prefix_caching=r.random() < 0.8, seed=r.randrange(100), **PATHS[self.path])

    def violation(self, msg: str) -> None:
        self.violations.append(f"[episode {self.episodes}, op {self.ops}] {msg}")
        if self.verbose:
            print("VIOLATION", self.violations[-1], flush=True)

    def check(self, core) -> bool:
        from course.quality.invariants import engine_violations

        bad = engine_violations(core)
        for b in bad:
            self.violation(b)
        return not bad

    def episode(self, num_ops: int) -> None:
        from engine.serve.engine import EngineCore
        from course.quality.invariants import idle_violations

        self.episodes += 1
        cfg = self.random_config()
        eos = self.rng.choice((None, self.greedy(tuple(self.prefixes[1] + self.suffixes[0]))[2]))
        core = EngineCore(self.model, cfg, eos_token_id=eos)
        if hasattr(core.flat, "wait_compiled"):  # the compiled path: the graph, not the eager fallback
            assert core.flat.wait_compiled(), f"the layer graph did not compile: {core.flat.graphs.error!r}"
            core.flat.eager_rows = 1  # every step through the graph but one-row ones (a size it specialises)
        self.core, self.eos, self.tracked = core, eos, {}
        self.parents: dict[str, list[str]] = {}
        self.aborted: set[str] = set()
        self.done: set[str] = set()  # ids step() reported finished
        self.next_id = 0
        ok = True
        end = self.ops + num_ops
        while ok and self.ops < end:
            self.ops += 1
            x = self.rng.random()
            try:
                if x < 0.32:
                    self.add()
                elif x < 0.40:
                    self.abort()
                elif x < 0.41:
                    core.blocks.reset_prefix_cache()
                elif x < 0.41 + self.fault_rate:
                    ok = self.failed_step()
                else:
                    ok = self.step()
            except Exception as e:  # an engine crash is a violation; the episode ends with it
                self.violation(f"{type(e).__name__}: {e}  (config {cfg})")
                return
        idle_for = 0  # drain steps since a request last finished
        while ok and core.has_unfinished() and idle_for < STALL_STEPS:
            self.drain_steps += 1
            before = len(self.done)
            try:
                ok = self.step()
            except Exception as e:
                self.violation(f"{type(e).__name__} while draining: {e}  (config {cfg})")
                return
            idle_for = 0 if len(self.done) > before else idle_for + 1
        if not ok:
            return
        if core.has_unfinished():
            self.violation(f"no request finished in {STALL_STEPS} steps (livelock?) with config {cfg}")
            return
        for b in idle_violations(core):
            self.violation(f"at idle: {b}  (config {cfg})")
        unfinished = set(self.tracked) - self.aborted - self.done
        if unfinished:
            self.violation(f"requests never reported finished: {sorted(unfinished)[:5]}")
        self.counts["preemptions"] += core.preemptions

    def add(self) -> None:
        from engine.serve.params import SamplingParams

        r, core = self.rng, self.core
        prompt = tuple(r.choice(self.prefixes) + r.choice(self.suffixes))
        max_tokens = r.randint(1, MAX_NEW)
        kind = r.random()
        kw: dict = {}
        if kind < 0.25:
            kw = dict(temperature=r.choice((0.7, 1.3)), top_k=r.choice((0, 20)), top_p=r.choice((1.0, 0.9)),
                      seed=r.choice((None, r.randrange(50))))
        if r.random() < 0.3:
            kw["stop_token_ids"] = [self.greedy(prompt)[r.randrange(MAX_NEW)]]
        if r.random() < 0.2:
            kw["min_tokens"] = r.randint(0, max_tokens)
        if r.random() < 0.1:
            kw["ignore_eos"] = True
        n = r.choice((1, 1, 1, 2, 3))
        params = SamplingParams(n=n, max_tokens=max_tokens, **{"temperature": 0.0, **kw})
        rid = f"q{self.next_id}"
        self.next_id += 1
        cache_key = r.choice(((), (), ("tenant-a",), ("tenant-b", 7)))
        cfg = core.config
        need = len(prompt) + max_tokens
        expect_reject = (need > cfg.cache.num_blocks * cfg.cache.block_size
                         or (not cfg.scheduler.enable_chunked_prefill and len(prompt) > cfg.scheduler.max_num_batched_tokens))
        try:
            ids = core.add_request(rid, list(prompt), params, priority=r.choice((-1, 0, 0, 1, 2)),
                                   cache_key=cache_key)
        except ValueError as e:
            if not expect_reject:
                self.violation(f"add_request rejected a valid request: {e}")
            self.counts["rejected"] += 1
            return
        if expect_reject:
            self.violation(f"add_request accepted a request that can never run: {need} tokens, config {cfg}")
        for i, cid in enumerate(ids):
            child = SamplingParams(**{**params.__dict__, "n": 1,
                                      "seed": None if params.seed is None else params.seed + i})
            self.tracked[cid] = Tracked(prompt, child, rid)
        self.parents[rid] = ids
        self.check(core)

    def abort(self) -> None:
        from engine.serve.request import Status

        r, core = self.rng, self.core
        sched = core.scheduler
        groups = {
            "waiting": [q for q in sched.waiting if q.status is Status.WAITING],
            "preempted": [q for q in sched.waiting if q.status is Status.PREEMPTED and not q.swapped_out],
            "swapped": [q for q in sched.waiting if q.swapped_out],
            "prefill": [q for q in sched.running if q.num_computed_tokens < q.num_prompt_tokens],
            "decoding": [q for q in sched.running if q.num_computed_tokens >= q.num_prompt_tokens],
        }
        # Only states present now: preempted and swapped-out requests rarely last more than a step.
        choice = r.choice([k for k, reqs in groups.items() if reqs] + ["parent", "unknown"])
        if choice == "unknown":
            done = [i for i in self.tracked if i not in sched.requests]  # finished or aborted: harmless
            core.abort_request(r.choice(done + ["nope", f"q{self.next_id + 5}"]))
        elif choice == "parent":
            live = [p for p, ids in self.parents.items() if any(i in sched.requests for i in ids)]
            if live:
                parent = r.choice(live)
                core.abort_request(parent)
                self.aborted.update(self.parents[parent])
        elif groups[choice]:
            victim = r.choice(groups[choice])
            core.abort_request(victim.request_id)
            self.aborted.add(victim.request_id)
            self.counts["aborted"] += 1
            self.abort_kinds[choice] = self.abort_kinds.get(choice, 0) + 1
        for rid in self.aborted:
            if rid in sched.requests:
                self.violation(f"aborted request {rid!r} is still in the scheduler")
        self.check(core)

    def failed_step(self) -> bool:
        """A step whose forward pass raises at a random layer (before or after that layer writes
        its K/V); half the time an abort follows at once. Nothing may be reported, and every later
        output must still match its oracle."""
        from course.quality.faults import PLACES, InjectedFault, backend_fault, forward_fault

        r, core = self.rng, self.core
        layer, where = r.randrange(core.model.cfg.num_hidden_layers), r.choice(PLACES)
        self.counts["faults"] += 1
        fault = backend_fault(core, layer, where) if core.config.flat_model != "flat" else forward_fault(core.model, layer, where)
        try:
            with fault:
                outs = core.step()
        except InjectedFault:
            outs = None
        if outs is not None and outs:  # an empty plan runs no forward pass, so nothing fails
            self.violation(f"step() reported {len(outs)} outputs although its forward pass was to fail")
        ok = self.check(core)
        if ok and r.random() < 0.5:
            self.abort()
        return ok

    def step(self) -> bool:
        core = self.core
        for out in core.step():
            t = self.tracked.get(out.request_id)
            if t is None:
                self.violation(f"step reported unknown request {out.request_id!r}")
                continue
            t.streamed.extend(out.new_token_ids)
            if out.finished:
                self.finished(out, t)
        return self.check(core)

    def finished(self, out, t: Tracked) -> None:
        self.counts["finished"] += 1
        rid, p = out.request_id, t.params
        if rid in self.done:
            self.violation(f"{rid}: reported finished twice")
        self.done.add(rid)
        if t.streamed != out.output_token_ids:
            self.violation(f"{rid}: streamed tokens {t.streamed} != final output {out.output_token_ids}")
        if out.finish_reason == "abort" or rid in self.aborted:
            self.violation(f"{rid}: an aborted request was reported by step() as {out.finish_reason}")
            return
        from course.quality import oracle

        expected = oracle.expected_output(t.prompt, p, self.eos, self.greedy, self.continuation)
        if expected is not None:
            want, reason = expected
        else:  # unseeded sampling: only the shape of the answer can be checked
            got = out.output_token_ids
            if not 1 <= len(got) <= p.max_tokens or out.finish_reason not in ("stop", "length"):
                self.violation(f"{rid}: {len(got)} tokens, finish_reason {out.finish_reason!r}")
            return
        self.counts["compared"] += 1
        if out.output_token_ids != want or out.finish_reason != reason:
            self.counts["mismatches"] += 1
            self.violation(
                f"{rid} (prompt {len(t.prompt)} tokens, {p}) gave {out.output_token_ids} "
                f"({out.finish_reason}); expected {want} ({reason}); config {self.core.config}")

    def run(self, num_ops: int, progress: bool = False) -> list[str]:
        """``num_ops`` operations in episodes; ``progress``: a tqdm bar on stderr (operations done,
        rate, ETA), updated after each episode. The bar draws nothing from the random stream."""
        from tqdm import tqdm

        with tqdm(total=num_ops, desc="soak", unit="op", disable=not progress, dynamic_ncols=True) as bar:
            while self.ops < num_ops:
                before = self.ops
                self.episode(min(num_ops - self.ops, self.rng.randint(50, 600)))
                bar.update(self.ops - before)
                bar.set_postfix(violations=len(self.violations), refresh=False)
        return self.violations


def main(argv: list[str] | None = None) -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from engine._impl import add_impl_argument, apply_impl

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--operations", "--ops", dest="ops", type=int, default=20_000,
                    help="random operations to run (default 20,000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    add_impl_argument(ap)
    ap.add_argument("--faults", type=float, default=0.05,
                    help="share of operations that are a step whose forward pass fails (default 0.05)")
    ap.add_argument("--path", choices=sorted(PATHS), default="reference",
                    help="the forward path: reference (plain model, reference backend; the default), "
                         "torch / cpu (flat_model='fused' on that backend), compiled (flat_model='compiled', cpu backend)")
    ap.add_argument("--verbose", action="store_true", help="print each violation as it is found")
    args = ap.parse_args(argv)
    if args.ops < 1:
        ap.error("--operations must be >= 1")
    if not 0.0 <= args.faults <= 0.5:
        ap.error("--faults must be in [0, 0.5]")
    apply_impl(["--impl", args.impl])  # before anything imports engine.serve
    start = time.monotonic()
    soak = Soak(args.seed, args.verbose, args.faults, args.path)
    violations = soak.run(args.ops, progress=True)
    elapsed = time.monotonic() - start
    for v in violations[:20]:
        print("violation:", v)
    if len(violations) > 20:
        print(f"... and {len(violations) - 20} more")
    c = soak.counts
    print(f"soak ({args.path} path): {soak.ops} operations (+{soak.drain_steps} steps draining to idle) in {soak.episodes} "
          f"episodes, {elapsed:.0f} s; "
          f"{c['finished']} requests finished ({c['compared']} compared with an oracle, "
          f"{c['mismatches']} mismatches), "
          f"{c['aborted']} aborted {soak.abort_kinds}, {c['rejected']} rejected, {c['preemptions']} preemptions, "
          f"{c['faults']} failed steps (forward fault injected); "
          f"{len(violations)} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
