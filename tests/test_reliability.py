"""Reliability: invariants after every step, randomized workloads, aborts at every moment, determinism.

Two property-based state machines (hypothesis, derandomized so every run is the same):
- over ``BlockManager`` alone, against a small list-based model of the pool (tables, LRU free
  queue, hash map), with the bookkeeping checked after every operation;
- over ``EngineCore``, on random configurations (block size, pool down to barely enough, budget,
  chunking and threshold, fcfs/priority, recompute/swap, caching on/off): add requests with shared
  prefixes, n > 1, priorities, seeds and tenants' cache keys; abort at random moments; step; run a
  step whose forward pass fails at a layer (``course.quality.faults``), perhaps aborting after it. The
  whole engine is checked after every rule (``course.quality.invariants``); every greedy request that
  finishes normally must equal ``generate()`` and every seeded sampled one an independent sampler;
  at idle nothing may be left over.
``course/quality/soak.py`` (``make soak``) runs the same kind of workload for 20,000 operations.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from ch31_helpers import model64, oracle, run_checked
from engine.serve import BlockManager, EngineConfig, EngineCore, Request, SamplingParams, Status
from course.quality import oracle as oracle_lib
from course.quality.faults import PLACES, InjectedFault, forward_fault
from course.quality.invariants import (block_violations, check_engine_invariants, check_idle, engine_violations,
                                     idle_violations)

MAX_NEW = 8  # the longest output a random request asks for
ENGINE_EXAMPLES = 12  # hypothesis examples per engine configuration (the soak runs far more)
# Derandomized: every run draws the same examples. No shrinking: shrinking an engine workload takes
# minutes, and the unshrunk failing steps (printed by hypothesis) plus the message are enough.
SETTINGS = dict(derandomize=True, database=None, deadline=None, phases=(Phase.explicit, Phase.generate),
                suppress_health_check=list(HealthCheck))




# ----- prompts and oracles ---------------------------------------------------------------------
def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


PREFIXES = [[], _tokens(100, 4), _tokens(101, 9), _tokens(102, 16)]  # shared system prompts
SUFFIXES = [_tokens(200 + i, n) for i, n in enumerate((1, 2, 3, 5, 7, 11))]
LONGEST = max(map(len, PREFIXES)) + max(map(len, SUFFIXES)) + MAX_NEW


def greedy_oracle(prompt: tuple[int, ...]) -> list[int]:
    return oracle(prompt, MAX_NEW)


@functools.lru_cache(maxsize=None)
def stepwise_oracle(prompt: tuple[int, ...], temperature: float, top_k: int, top_p: float, seed: int | None,
                    masked: tuple[int, ...], min_tokens: int) -> list[int]:
    """Token by token on the plain float64 model, no engine involved (``course.quality.oracle``)."""
    return oracle_lib.stepwise(model64(), prompt, MAX_NEW, temperature, top_k, top_p, seed, masked, min_tokens)


cut_at_stop = oracle_lib.cut_at_stop


def expected_output(prompt: tuple[int, ...], p: SamplingParams, eos: int | None) -> tuple[list[int], str] | None:
    """The oracle's answer, or None for unseeded sampling (no oracle can predict it)."""
    return oracle_lib.expected_output(prompt, p, eos, greedy_oracle, stepwise_oracle)


# ===== 1. BlockManager against a list-based model =================================================
class PoolModel:
    """The block pool as plain lists: what BlockManager must do, written the slow, obvious way."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bs, self.caching = block_size, caching
        self.free = list(range(num_blocks))  # front = next handed out
        self.hash_of: dict[int, bytes] = {}  # block -> hash, for published blocks
        self.tables: dict[str, list[int]] = {}
        self.published: dict[str, int] = {}

    def refs(self, b: int) -> int:
        return sum(t.count(b) for t in self.tables.values())

    def block_with(self, h: bytes) -> int | None:
        return next((b for b, hb in self.hash_of.items() if hb == h), None)

    def lookup(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        found = []
        for h in hashes[:(num_tokens - 1) // self.bs] if self.caching else []:
            b = self.block_with(h)
            if b is None:
                break
            found.append(b)
        return found

    def allocate(self, rid: str, total_tokens: int, cached: list[int]) -> bool:
        table = self.tables.get(rid, [])
        new = max(0, math.ceil(total_tokens / self.bs) - len(table) - len(cached))
        if new + sum(1 for b in cached if self.refs(b) == 0) > len(self.free):
            return False
        table = self.tables.setdefault(rid, table)
        self.published.setdefault(rid, 0)
        for b in cached:
            if b in self.free:
                self.free.remove(b)
            table.append(b)
        if cached:
            self.published[rid] = len(cached)
        for _ in range(new):
            b = self.free.pop(0)
            self.hash_of.pop(b, None)  # handed out: it leaves the cache
            table.append(b)
        return True

    def publish(self, rid: str, hashes: list[bytes], num_tokens: int) -> None:
        if not self.caching or rid not in self.tables:
            return
        table = self.tables[rid]
        full = min(num_tokens // self.bs, len(hashes), len(table))
        for i in range(self.published[rid], full):
            if self.block_with(hashes[i]) is None and table[i] not in self.hash_of:
                self.hash_of[table[i]] = hashes[i]
        self.published[rid] = max(full, self.published[rid])

    def _release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail first
            if self.refs(b) == 0:
                self.free.append(b)

    def free_request(self, rid: str) -> None:
        self.published.pop(rid, None)
        self._release(self.tables.pop(rid, []))

    def trim(self, rid: str, num_tokens: int) -> None:
        table = self.tables[rid]
        keep = math.ceil(num_tokens / self.bs)
        dropped = table[keep:]
        del table[keep:]
        self.published[rid] = min(self.published[rid], keep)
        self._release(dropped)

    def reset(self) -> int:
        forgotten = [b for b in self.free if b in self.hash_of]
        for b in forgotten:
            del self.hash_of[b]
        return len(forgotten)


BASES = [_tokens(300, 40), _tokens(300, 8) + _tokens(301, 32), _tokens(302, 40)]  # 0 and 1 share 8 tokens


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions (with and without the cache), growth, publishing, trims, frees and resets."""

    @initialize(num_blocks=st.integers(1, 14), block_size=st.sampled_from([1, 2, 3, 4]), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.model = PoolModel(num_blocks, block_size, caching)
        self.reqs: dict[str, tuple[Request, int]] = {}  # rid -> (request, which base it follows)
        self.count = 0

    def _pick(self, i: int) -> tuple[Request, int]:
        return self.reqs[sorted(self.reqs)[i % len(self.reqs)]]

    def _advance(self, req: Request, base: int, n: int) -> None:
        """The step computed n tokens; a sample follows the last one (from the same base, so later
        requests can share the generated blocks too)."""
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append(BASES[base][req.num_tokens % len(BASES[base])])

    @rule(base=st.integers(0, 2), length=st.integers(1, 30), key=st.sampled_from([(), ("tenant",)]),
          use_cache=st.booleans(), frac=st.integers(1, 4), publish=st.booleans())
    def admit(self, base, length, key, use_cache, frac, publish):
        rid = f"r{self.count}"
        self.count += 1
        req = Request(rid, BASES[base][:length], cache_key=key)
        bs = self.bm.block_size
        cached = self.bm.find_cached_prefix(req) if use_cache else []
        self.bm.update_hashes(req)
        want = self.model.lookup(req.block_hashes, req.num_tokens) if use_cache else []
        assert cached == want, f"find_cached_prefix gave {cached}, the model {want}"
        assert len(cached) <= (req.num_tokens - 1) // bs, "matched the block holding the last prompt token"
        for i, b in enumerate(cached):
            assert self.bm.block_hash[b] == req.block_hashes[i], "adopted a block of another prefix or tenant"
        rest = req.num_tokens - len(cached) * bs
        n = max(1, rest * frac // 4)
        ok = self.bm.allocate_slots(req, n, cached)
        assert ok == self.model.allocate(rid, len(cached) * bs + n, cached), "allocate_slots disagrees with the model"
        if not ok:
            assert rid not in self.bm.req_blocks, "a failed allocation must change nothing"
            return
        self.reqs[rid] = (req, base)
        if publish:  # what the scheduler does right after allocating
            self.bm.cache_full_blocks(req, len(cached) * bs + n)
            self.model.publish(rid, req.block_hashes, len(cached) * bs + n)
        self._advance(req, base, len(cached) * bs + n)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 50), n=st.integers(1, 12), compute=st.booleans())
    def grow(self, i, n, compute):
        req, base = self._pick(i)
        n = min(n, req.num_tokens - req.num_computed_tokens) if compute else n
        ok = self.bm.allocate_slots(req, n)
        assert ok == self.model.allocate(req.request_id, req.num_computed_tokens + n, []), \
            "allocate_slots disagrees with the model"
        if ok and compute:
            self._advance(req, base, n)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 50))
    def publish(self, i):
        req, _ = self._pick(i)
        self.bm.cache_full_blocks(req)
        self.bm.update_hashes(req)
        self.model.publish(req.request_id, req.block_hashes, req.num_computed_tokens)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 50), extra=st.integers(0, 8))
    def trim(self, i, extra):
        """Release blocks allocated past the computed tokens (as rejected drafts do)."""
        req, _ = self._pick(i)
        keep = req.num_computed_tokens + extra
        self.bm.trim(req, keep)
        self.model.trim(req.request_id, keep)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 50))
    def free(self, i):
        req, _ = self._pick(i)
        self.bm.free(req)
        self.model.free_request(req.request_id)
        del self.reqs[req.request_id]

    @rule()
    def reset(self):
        assert self.bm.reset_prefix_cache() == self.model.reset()

    @invariant()
    def matches_model(self):
        bm, model = self.bm, self.model
        assert block_violations(bm) == []
        assert bm.req_blocks == model.tables, "block tables differ from the model"
        assert list(bm.free_queue) == model.free, "free queue (LRU order) differs from the model"
        assert {b: h for b, h in enumerate(bm.block_hash) if h is not None} == model.hash_of, \
            "published blocks differ from the model"
        assert bm.num_published == model.published
        for rid, (req, _) in self.reqs.items():
            assert len(bm.req_blocks[rid]) * bm.block_size >= req.num_computed_tokens

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for req, _ in list(self.reqs.values()):
            self.bm.free(req)
        assert self.bm.num_free == self.bm.num_blocks and not any(self.bm.ref_count)
        assert not self.bm.req_blocks and not self.bm.num_published


def test_block_manager_state_machine():
    run_state_machine_as_test(BlockManagerMachine, settings=settings(
        max_examples=150, stateful_step_count=40, **SETTINGS))


# ===== 2. EngineCore on random workloads =========================================================
def _config(bs: int, pool: int | str, budget: int, seqs: int = 256, chunked: bool = True, threshold: int = 0,
            policy: str = "fcfs", mode: str = "recompute", caching: bool = True) -> EngineConfig:
    """``pool`` in blocks, or "barely" (the largest request just fits), "short" (one block less:
    the largest requests are rejected) or "ample"."""
    barely = math.ceil(LONGEST / bs)
    blocks = {"barely": barely, "short": barely - 1, "ample": 6 * barely}.get(pool, pool)
    return EngineConfig(block_size=bs, num_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=seqs,
                        enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold, policy=policy,
                        preemption_mode=mode, enable_prefix_caching=caching)


# Each configuration stresses something different; hypothesis drives the workload on each.
ENGINE_CONFIGS = {
    "bs4-barely-chunks-recompute": _config(4, "barely", 8),
    "bs4-barely-threshold-priority-swap": _config(4, "barely", 8, threshold=5, policy="priority", mode="swap"),
    "bs1-barely-budget3-swap-nocache": _config(1, "barely", 3, seqs=4, mode="swap", caching=False),
    "bs2-tight-threshold2-priority-nocache": _config(2, 20, 20, threshold=2, policy="priority", caching=False),
    "bs8-barely-unchunked-swap": _config(8, "barely", LONGEST, chunked=False, mode="swap"),
    "bs16-barely-unchunked-2seqs-priority": _config(16, "barely", 64, seqs=2, chunked=False, policy="priority"),
    "bs4-short-bigbudget": _config(4, "short", 2048, threshold=3),
    "bs4-ample-budget1-priority-swap": _config(4, "ample", 1, policy="priority", mode="swap"),
    "bs16-ample-1seq": _config(16, "ample", 2048, seqs=1),
}


@st.composite
def request_specs(draw) -> dict:
    """One add_request: a prompt (shared prefix + suffix), n, priority, sampling, stops, tenant."""
    return dict(
        prefix=draw(st.sampled_from([3, 2, 1, 0])), suffix=draw(st.integers(0, 5)),
        max_tokens=draw(st.integers(1, MAX_NEW)), n=draw(st.sampled_from([1, 1, 2, 3])),
        priority=draw(st.integers(-1, 2)),
        sampling=draw(st.sampled_from(["greedy", "greedy", "seeded", "unseeded"])), seed=draw(st.integers(0, 2)),
        stop_at=draw(st.sampled_from([None, None, 1, 4])), min_tokens=draw(st.integers(0, 2)),
        key=draw(st.sampled_from([(), ("tenant-a",)])))


ABORT_KINDS = ["swapped", "preempted", "prefill", "decoding", "waiting", "parent", "unknown"]


class EngineMachine(RuleBasedStateMachine):
    """Random adds, aborts and steps on one randomly configured engine."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config

    @initialize(eos_pick=st.sampled_from([None, 0, 3]), initial=st.lists(request_specs(), min_size=2, max_size=8))
    def setup(self, eos_pick, initial):
        # An EOS that greedy continuations really produce, so stops by EOS happen.
        self.eos = None if eos_pick is None else greedy_oracle(tuple(PREFIXES[1] + SUFFIXES[0]))[eos_pick]
        self.core = EngineCore(model64(), self.config, eos_token_id=self.eos)
        self.info: dict[str, tuple[tuple[int, ...], SamplingParams]] = {}  # live or finished child ids
        self.parents: dict[str, list[str]] = {}
        self.streamed: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.done: set[str] = set()
        self.count = 0
        for spec in initial:  # a workload from the start, so every example has concurrency
            self._add(**spec)

    @rule(spec=request_specs())
    def add(self, spec):
        self._add(**spec)

    def _add(self, prefix, suffix, max_tokens, n, priority, sampling, seed, stop_at, min_tokens, key):
        prompt = tuple(PREFIXES[prefix] + SUFFIXES[suffix])
        kw = {}
        if sampling != "greedy":
            kw = dict(temperature=0.9, top_k=20, seed=seed if sampling == "seeded" else None)
        if stop_at is not None:
            kw["stop_token_ids"] = [greedy_oracle(prompt)[stop_at]]
        params = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), **{"temperature": 0.0, **kw})
        rid = f"q{self.count}"
        self.count += 1
        cfg = self.core.config
        never = (len(prompt) + max_tokens > cfg.cache.num_blocks * cfg.cache.block_size
                 or (not cfg.scheduler.enable_chunked_prefill and len(prompt) > cfg.scheduler.max_num_batched_tokens))
        if never:
            with pytest.raises(ValueError):
                self.core.add_request(rid, list(prompt), params, priority=priority, cache_key=key)
            return
        ids = self.core.add_request(rid, list(prompt), params, priority=priority, cache_key=key)
        assert ids == ([rid] if n == 1 else [f"{rid}:{i}" for i in range(n)])
        for i, cid in enumerate(ids):
            self.info[cid] = (prompt, SamplingParams(**{**params.__dict__, "n": 1,
                                                        "seed": None if params.seed is None else params.seed + i}))
            self.streamed[cid] = []
        self.parents[rid] = ids

    @rule(kind=st.integers(0, 6), pick=st.integers(0, 50))
    def abort(self, kind, pick):
        """Abort in the rarest state present now (swapped, preempted, mid-prefill, ...), a whole n > 1
        request, or an id that is unknown or already finished."""
        sched = self.core.scheduler
        groups = {
            "swapped": [r for r in sched.waiting if r.swapped_out],
            "preempted": [r for r in sched.waiting if r.status is Status.PREEMPTED and not r.swapped_out],
            "prefill": [r for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens],
            "decoding": [r for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens],
            "waiting": [r for r in sched.waiting if r.status is Status.WAITING],
        }
        present = [k for k in ABORT_KINDS if k in ("parent", "unknown") or groups[k]]
        kind = present[kind % len(present)]
        if kind == "unknown":  # unknown, finished or already aborted ids: harmless
            ids = sorted(i for i in self.info if i not in sched.requests) + ["never-added"]
            self.core.abort_request(ids[pick % len(ids)])
            return
        if kind == "parent":
            live = sorted(p for p, ids in self.parents.items() if any(i in sched.requests for i in ids))
            if not live:
                return
            parent = live[pick % len(live)]
            self.aborted.update(i for i in self.parents[parent] if i in sched.requests)
            self.core.abort_request(parent)
        elif groups[kind]:
            victim = groups[kind][pick % len(groups[kind])]
            self.aborted.add(victim.request_id)
            self.core.abort_request(victim.request_id)
        assert not (self.aborted & set(sched.requests)), "an aborted request is still queued"

    @rule(steps=st.integers(1, 4), abort_preempted=st.sampled_from([False, False, True]))
    def step(self, steps, abort_preempted):
        """Run a few steps; optionally abort the first request caught preempted or swapped out
        (those states last a step or two, so a separate abort rule rarely meets them)."""
        for _ in range(steps):
            self._one_step()
            caught = [r for r in self.core.scheduler.waiting if r.status is Status.PREEMPTED]
            if abort_preempted and caught:
                self.aborted.add(caught[0].request_id)
                self.core.abort_request(caught[0].request_id)

    @rule()
    def reset_prefix_cache(self):
        self.core.blocks.reset_prefix_cache()

    @rule(layer=st.integers(0, 1), where=st.sampled_from(PLACES), abort_pick=st.sampled_from([None, 0, 3]))
    def failed_step(self, layer, where, abort_pick):
        """A step whose forward pass raises at a layer, perhaps followed by an abort: it reports
        nothing, and every later output must still match its oracle (tests/test_faults.py)."""
        try:
            with forward_fault(self.core.model, layer, where):
                outs = self.core.step()
        except InjectedFault:
            outs = []
        assert outs == [], "a step without a forward pass (empty plan) reported outputs"
        check_engine_invariants(self.core)
        live = sorted(self.core.scheduler.requests)
        if abort_pick is not None and live:
            victim = live[abort_pick % len(live)]
            self.aborted.add(victim)
            self.core.abort_request(victim)

    def _one_step(self):
        for out in self.core.step():
            rid = out.request_id
            assert rid in self.info and rid not in self.aborted and rid not in self.done, \
                f"step() reported {rid!r}, which is unknown, aborted or already finished"
            self.streamed[rid].extend(out.new_token_ids)
            if not out.finished:
                continue
            self.done.add(rid)
            assert self.streamed[rid] == out.output_token_ids, "streamed tokens differ from the final output"
            prompt, p = self.info[rid]
            want = expected_output(prompt, p, self.eos)
            if want is None:
                assert 1 <= len(out.output_token_ids) <= p.max_tokens
                continue
            got = (out.output_token_ids, out.finish_reason)
            assert got == want, (
                f"request {rid!r} (prompt of {len(prompt)} tokens, {p}) finished as {got}, expected {want} "
                f"from {'generate()' if p.greedy else 'a seeded sampler'}; config {self.core.config}")
        check_engine_invariants(self.core)

    @invariant()
    def consistent(self):
        if hasattr(self, "core"):
            check_engine_invariants(self.core)

    def teardown(self):
        if not hasattr(self, "core"):
            return
        for _ in range(2000):
            if not self.core.has_unfinished():
                break
            self._one_step()
        assert not self.core.has_unfinished(), f"engine still busy after 2000 steps (livelock?): {self.core.config}"
        check_idle(self.core)
        missing = set(self.info) - self.done - self.aborted
        assert not missing, f"requests never reported finished: {sorted(missing)}"


@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_engine_state_machine(name):
    config = ENGINE_CONFIGS[name]
    run_state_machine_as_test(lambda: EngineMachine(config), settings=settings(
        max_examples=ENGINE_EXAMPLES, stateful_step_count=25, **SETTINGS))


# ===== 3. Aborts at every moment ===================================================================
MOMENTS = {
    # moment -> (config, how to recognise the victim at that moment)
    "waiting": (dict(max_num_seqs=1), lambda r: r.status is Status.WAITING and r.num_computed_tokens == 0),
    "mid-prefill": (dict(max_num_batched_tokens=4),
                    lambda r: r.status is Status.RUNNING and 0 < r.num_computed_tokens < r.num_prompt_tokens),
    "decoding": ({}, lambda r: r.status is Status.RUNNING and r.num_output_tokens >= 2),
    "preempted": (dict(num_blocks=9, preemption_mode="recompute"), lambda r: r.status is Status.PREEMPTED),
    "swapped": (dict(num_blocks=9, preemption_mode="swap"), lambda r: r.swapped_out),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_abort_at_every_moment_leaves_nothing_behind(moment):
    overrides, is_moment = MOMENTS[moment]
    cfg = EngineConfig(**{**dict(block_size=4, num_blocks=40), **overrides})
    core = EngineCore(model64(), cfg)
    prompts = {f"r{i}": PREFIXES[3] + SUFFIXES[i] for i in range(4)}
    for rid, p in prompts.items():
        seeded = rid == "r3"  # one seeded sampled request: its generator must go too
        core.add_request(rid, p, SamplingParams(max_tokens=MAX_NEW, seed=7 if seeded else None,
                                               temperature=0.5 if seeded else 0.0))
    done, victim = {}, None
    for _ in range(200):
        if not core.has_unfinished():
            break
        for out in core.step():
            assert out.request_id != getattr(victim, "request_id", None), "an aborted request produced output"
            if out.finished:
                done[out.request_id] = out.output_token_ids
        check_engine_invariants(core)
        if victim is None:
            victim = next((r for r in list(core.scheduler.waiting) + core.scheduler.running if is_moment(r)), None)
            if victim is not None:
                core.abort_request(victim.request_id)
                assert victim.status is Status.FINISHED_ABORTED
                check_engine_invariants(core)
                core.abort_request(victim.request_id)  # a second abort is harmless
    assert victim is not None, f"the workload never reached the moment {moment!r}: adjust the test"
    check_idle(core)
    for rid, p in prompts.items():
        if rid != victim.request_id and rid != "r3":
            assert done[rid] == greedy_oracle(tuple(p)), f"{rid} changed after {victim.request_id} was aborted"


def test_finished_id_can_be_reused_and_abort_is_harmless():
    core = EngineCore(model64(), EngineConfig(block_size=4, num_blocks=20))
    p = PREFIXES[2] + SUFFIXES[1]
    core.add_request("a", p, SamplingParams(max_tokens=3, temperature=0.0))
    assert core.run_until_done()["a"] == greedy_oracle(tuple(p))[:3]
    core.abort_request("a")  # finished
    core.abort_request("never-seen")  # unknown
    check_idle(core)
    core.add_request("a", p, SamplingParams(max_tokens=5, n=2, temperature=0.0))  # same id again, now with children
    out = core.run_until_done()
    assert out == {"a:0": greedy_oracle(tuple(p))[:5], "a:1": greedy_oracle(tuple(p))[:5]}
    check_idle(core)


def test_prompt_logprobs_survive_recompute_preemption():
    """A request preempted by recompute prefills its prompt again: its prompt logprobs must be
    replaced, not appended a second time (regression: they used to be duplicated)."""
    def run(num_blocks: int, mode: str):
        core = EngineCore(model64(), EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=6,
                                                  preemption_mode=mode))
        core.add_request("b", SUFFIXES[5], SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        core.add_request("a", PREFIXES[3] + SUFFIXES[2], SamplingParams(max_tokens=MAX_NEW, prompt_logprobs=2, temperature=0.0))
        final = {}
        while core.has_unfinished():
            for out in core.step():
                if out.finished:
                    final[out.request_id] = out
            check_engine_invariants(core)
        return final["a"], core.preemptions

    calm, n0 = run(64, "recompute")
    assert n0 == 0 and len(calm.prompt_logprobs) == len(PREFIXES[3] + SUFFIXES[2]) - 1
    for mode in ("recompute", "swap"):
        tight, n = run(8, mode)
        assert n > 0, "the small pool was meant to force a preemption"
        assert tight.output_token_ids == calm.output_token_ids
        assert len(tight.prompt_logprobs) == len(calm.prompt_logprobs), \
            f"{mode}: {len(tight.prompt_logprobs)} prompt logprob entries for a {len(calm.prompt_logprobs) + 1}-token prompt"
        for got, want in zip(tight.prompt_logprobs, calm.prompt_logprobs):
            assert got.keys() == want.keys()
            assert all(math.isclose(got[t], want[t], rel_tol=1e-9, abs_tol=1e-9) for t in got)


# ===== 4. Determinism of seeded sampling ==========================================================
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_NEW, ignore_eos=True)


def _seeded_run(cfg: EngineConfig, batch_mates: int, delay_victim: bool = False) -> tuple[list[int], int]:
    core = EngineCore(model64(), cfg)
    prompt = PREFIXES[2] + SUFFIXES[3]
    if not delay_victim:
        core.add_request("s", prompt, SEEDED)
    for i in range(batch_mates):  # greedy, unseeded-sampled and other seeded requests around it
        kind = i % 3
        params = SamplingParams(max_tokens=MAX_NEW, **({"temperature": 0.0, **({} if kind == 0 else dict(
            temperature=1.0, seed=None if kind == 1 else 99 + i))}))
        core.add_request(f"m{i}", PREFIXES[i % 4] + SUFFIXES[i % 6], params)
    if delay_victim:  # the newest request is the one preempted first
        core.add_request("s", prompt, SEEDED)
    out = run_checked(core)
    check_idle(core)
    return out["s"], core.preemptions


def test_seeded_sampling_is_the_same_alone_batched_and_preempted():
    want = stepwise_oracle(tuple(PREFIXES[2] + SUFFIXES[3]), SEEDED.temperature, SEEDED.top_k, SEEDED.top_p,
                           SEEDED.seed, (), 0)
    alone, _ = _seeded_run(EngineConfig(block_size=4, num_blocks=64), 0)
    assert alone == want, "a seeded request alone differs from sampling token by token with its seed"
    batched, _ = _seeded_run(EngineConfig(block_size=4, num_blocks=200), 8)
    assert batched == want, "a seeded request's tokens changed with its batch-mates"
    for mode in ("recompute", "swap"):
        tight = EngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=16, preemption_mode=mode)
        pre, n = _seeded_run(tight, 3, delay_victim=True)
        assert n > 0, "the 12-block pool was meant to force preemptions"
        assert pre == want, f"a seeded request's tokens changed after preemption by {mode}"


def test_invariant_checker_catches_corruption():
    """The checker itself must see a leak, a double count and a stray generator."""
    core = EngineCore(model64(), EngineConfig(block_size=4, num_blocks=20))
    core.add_request("a", PREFIXES[2], SamplingParams(max_tokens=4, seed=3, temperature=0.5))
    core.step()
    assert engine_violations(core) == []
    table = core.blocks.req_blocks["a"]
    core.blocks.ref_count[table[0]] += 1
    assert any("ref_count" in v for v in engine_violations(core))
    core.blocks.ref_count[table[0]] -= 1
    core.generators["ghost"] = torch.Generator()
    assert any("generators" in v for v in engine_violations(core))
    del core.generators["ghost"]
    core.run_until_done()
    assert idle_violations(core) == []
    core.blocks.req_blocks["a"] = []
    core.blocks.num_published["a"] = 0
    assert any("req_blocks" in v or "not running" in v for v in idle_violations(core))
