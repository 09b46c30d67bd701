"""Instructor-seeded scenarios: lists of calls on chapter 31's public names, answered in plain data.

The grader draws scenarios from a secret seed (``make_scenarios``), so a checkout cannot know them in
advance. The same list runs twice: on the learner's engine inside the sandbox and on the reference in a
trusted process (``course/grading/verify.py`` compares). Each scenario is a dict:

    {"id": "hash_block/0", "kind": "hash_block", "holes": ["hash_block"], "deps": [], "args": {...}}

``holes``: the holes whose central behaviour the scenario checks; ``deps``: holes it also runs, which
must verify on their own for a failure here to count against ``holes``. ``run_scenario`` (inside
the child) returns JSON-able data only: ints, floats, strings, lists, dicts — never objects, never
pickle. A ``block_ops`` scenario returns one record per call, each naming its hole, so that the first
call that differs is the one blamed.

    python -m course.grading.scenarios SPECS.json RESULTS.jsonl    # the child: one JSON line per scenario
"""
from __future__ import annotations

import json
import os
import random
import sys

BLOCK_HOLES = ["BlockManager.find_cached_prefix", "BlockManager.allocate_slots",
               "BlockManager.cache_full_blocks", "BlockManager.free"]
MODEL_HOLES = ["build_batch", "write_kv", "ReferenceBackend.forward", "FlatModel.attention", "FlatModel.forward"]
ENGINE_DEPS = [*MODEL_HOLES, "hash_block", *BLOCK_HOLES, "Scheduler.schedule", "EngineCore.check_stop"]
# step()'s scenarios run the default attention backend, as its tests do: not write_kv, not ReferenceBackend
STEP_DEPS = [h for h in ENGINE_DEPS if h not in ("write_kv", "ReferenceBackend.forward")]
CHECK_DEPS = [*STEP_DEPS, "Scheduler._preempt", "EngineCore.step"]
# The milestone's four set-ups (EngineConfig keywords), as in the chapter's milestone test.
MILESTONE = {
    "small chunks, tight budget": dict(block_size=16, max_num_batched_tokens=24, long_prefill_token_threshold=10),
    "12-block pool, recompute": dict(block_size=16, num_blocks=12, preemption_mode="recompute"),
    "12-block pool, swap": dict(block_size=16, num_blocks=12, preemption_mode="swap"),
    "no prefix cache, 2 seqs": dict(block_size=16, enable_prefix_caching=False, max_num_seqs=2),
}
VOCAB = 512  # the test model's vocabulary
# build_batch's rules, one scenario each: the flat token rows, the slots, the metadata, the sample rows
BATCH_ASPECTS = {"tokens": ["input_ids", "positions", "dtypes", "error"], "slots": ["slot_mapping", "dtypes"],
                 "meta": ["query_start_loc", "seq_lens", "block_table", "max_query_len", "max_seq_len", "dtypes"],
                 "samples": ["logits_indices", "sample_counts", "prompt_spans", "request_ids"]}
# Scheduler._preempt's rules, one scenario each (as its four tests): recompute forgets, swap keeps and
# restores, the victim goes to the front of the queue, the priority policy's victim and requeue
# direct, direct-priority: _preempt called by hand (fcfs, priority): the oldest running request, then the newest
PREEMPT_RULES = ("recompute", "swap", "front", "priority", "direct", "direct-priority")
HASH_ASPECTS = ("alone", "chain", "extra")  # hash_block: tokens only; parent digests; the cache key too


# ------------------------------------------------------------------------------ drawing (grader side)
def make_scenarios(seed: int, size: int = 2) -> list[dict]:
    """The scenario list for one grading session: ``size`` of each per-hole kind, the milestone's four
    set-ups and the engine checks, drawn from ``seed``."""
    rnd = random.Random(seed)
    toks = lambda n: [rnd.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    out: list[dict] = []

    def add(kind, holes, deps, args, group=None):
        out.append({"id": f"{kind}/{sum(s['kind'] == kind for s in out)}", "kind": kind, "holes": holes,
                    "deps": deps, "group": group or holes[0], "args": args})

    for _ in range(size):
        for aspect, fields in BATCH_ASPECTS.items():  # one rule of the docstring per scenario, fresh inputs each
            add("build_batch", ["build_batch"], [], {"batches": _batches(rnd, toks), "fields": fields,
                                                     "aspect": aspect})
        add("write_kv", ["write_kv"], [], _write_kv_args(rnd))
        bs = rnd.choice([2, 4])
        spans = []
        for _ in range(rnd.randint(1, 3)):
            seq = rnd.randint(1, 9)
            spans.append({"seq_len": seq, "q_len": rnd.randint(1, seq),
                          "table": rnd.sample(range(8), (seq + bs - 1) // bs)})
        # a second call: decodes among prefills, padding requests, a window and the caller's own scale
        mixed = []
        for _ in range(rnd.randint(2, 4)):
            seq = rnd.randint(2, 9)
            mixed.append({"seq_len": seq, "q_len": rnd.choice([1, 1, rnd.randint(1, seq)]),
                          "table": rnd.sample(range(8), (seq + bs - 1) // bs)})
        mixed.insert(rnd.randrange(len(mixed) + 1), {"seq_len": 0, "q_len": 1, "table": []})
        mixed.append({"seq_len": 0, "q_len": 1, "table": []})
        add("attention", ["ReferenceBackend.forward"], [], {"block_size": bs, "spans": spans, "heads": 4, "kv_heads": 2,
                                                            "dim": 4, "window": rnd.choice([0, 0, 3]),
                                                            "seed": rnd.randrange(1 << 30),
                                                            "mixed": mixed, "mixed_window": rnd.choice([2, 3]),
                                                            "mixed_scale": rnd.choice([0.25, 0.7])})
        lens = [rnd.randint(3, 20) for _ in range(rnd.randint(1, 3))]
        add("flat", ["FlatModel.attention", "FlatModel.forward"], ["write_kv", "ReferenceBackend.forward"],
            {"prompts": [toks(n) for n in lens], "chunk": rnd.randint(2, 8), "moe": rnd.random() < 0.3,
             "rope_theta": rnd.choice([None, 1_000_000.0, 500.0])},
            group="FlatModel")
        for aspect in HASH_ASPECTS:  # its tests' split: tokens alone, then parents, then the cache key
            chain = [{"parent": None if i == 0 or aspect == "alone" or rnd.random() < 0.3 else rnd.randrange(i),
                      "tokens": toks(rnd.randint(1, 16)),
                      "extra": rnd.choice([[], ["salt", rnd.randrange(9)], ["adapter", 3]]) if aspect == "extra" else []}
                     for i in range(rnd.randint(3, 6))]
            if aspect == "extra":
                chain[0]["extra"] = ["tenant", rnd.randrange(9)]
            add("hash_block", ["hash_block"], [], {"chain": chain, "aspect": aspect})
        runs = [_block_ops(rnd, toks), _block_ops(rnd, toks)]
        runs[0]["caching"], runs[1]["caching"] = True, rnd.random() < 0.3  # caching on; mostly off
        add("block_ops", BLOCK_HOLES, ["hash_block"], {"runs": runs}, group="BlockManager")
        # a roomy pool; one that just fits the largest request (preemptions); chunked prefill off
        for how in ("roomy", "tight", "whole", "whole-swap"):
            add("schedule", ["Scheduler.schedule"], ["hash_block", *BLOCK_HOLES], _sched_args(rnd, toks, how))
        for rule in PREEMPT_RULES:
            add("preempt", ["Scheduler._preempt"], ["hash_block", *BLOCK_HOLES, "Scheduler.schedule"],
                _preempt_args(rnd, toks, rule))
        cases = []
        for _ in range(30):  # each rule of the docstring, its order and its edges (min_tokens, the context limit)
            plen, nout = rnd.randint(1, 6), rnd.randint(0, 6)
            at_limit = rnd.random() < 0.3  # a context of max_model_len 12, one less or one more
            if at_limit:
                plen = max(1, 12 - nout + rnd.choice([-1, 0, 0, 1]))
            stop = rnd.choice([[], [rnd.randrange(VOCAB)], [11, 12], [7]])
            outputs = toks(nout)
            if nout and rnd.random() < 0.6:
                outputs[-1] = rnd.choice([7, 11, 12, *stop])
            if nout > 1 and rnd.random() < 0.3:  # a stop token or EOS earlier in the output, not last
                outputs[0] = rnd.choice([7, 11, 12])
            most = 7 if at_limit else rnd.randint(1, 7)
            cases.append({"prompt": toks(plen), "outputs": outputs, "eos": rnd.choice([None, 7, 7]),
                          "params": {"max_tokens": most,
                                     "min_tokens": min(most, rnd.choice([0, 0, 1, nout, rnd.randint(0, nout + plen)])),
                                     "stop_token_ids": stop, "ignore_eos": rnd.random() < 0.25}})
        cases[0]["outputs"] = cases[0]["outputs"][:1] + [7]
        add("check_stop", ["EngineCore.check_stop"], [], {"max_model_len": 12, "cases": cases})
    for _ in range(size):  # EngineCore.step, streamed: chunked steps, n children with prompt logprobs, MoE
        for what in ("chunks", "children", "moe", "failure", "seeded"):
            add("engine", ["EngineCore.step"], STEP_DEPS, _engine_args(rnd, toks, what))
    ps = [toks(n) for n in (9, 40, 57, 70, 23)]
    ps[3][:32] = ps[1][:32]
    ps[4] = ps[1][:32]
    for name, cfg in MILESTONE.items():
        add("engine", ["milestone"], [], {"config": cfg, "prompts": ps, "max_tokens": [14, 30, 20, 26, 18]},
            group="milestone")
    # The engine checks, one scenario per configuration, as tests/test_isolation.py and
    # tests/test_reliability.py split them: tenant pairs, an abort at each moment of a request's life,
    # drawn engine configurations with arrivals and an abort, and a reused id.
    # Like those tests they run the engine's default attention backend ("torch", given code), not the
    # chapter's ReferenceBackend and write_kv (the milestone runs those).
    # A failure counts against them only where the holes they run verified on their own (CHECK_DEPS).
    checks = lambda args: add("engine", ["engine checks"], CHECK_DEPS,  # noqa: E731
                              {**args, "config": {"attention_backend": "torch", **args["config"]}}, group="engine checks")
    for _ in range(2 * size):
        checks(_isolation_args(rnd, toks))
    for moment in MOMENTS:
        checks(_moment_args(rnd, toks, moment))
    for _ in range(2 * size):
        checks(_config_args(rnd, toks))
    checks({"config": {"block_size": 4, "num_blocks": 20}, "reuse": True,
            "reqs": [{"id": "a", "prompt": toks(rnd.randint(5, 14)), "max_tokens": 3}]})
    # Drawn last, so that every scenario above stays the same for a seed: more schedule traces, and block
    # calls that adopt blocks other requests still hold.
    for _ in range(size):
        for how in ("roomy", "tight", "roomy"):
            add("schedule", ["Scheduler.schedule"], ["hash_block", *BLOCK_HOLES], _sched_args(rnd, toks, how))
    add("block_ops", BLOCK_HOLES, ["hash_block"], {"runs": [_held_ops(rnd, toks)]}, group="BlockManager")
    cases = []  # check_stop: a stop token or EOS earlier in the output, the last token ordinary (or not)
    for _ in range(20):
        stop = rnd.choice([[11], [11, 12], [rnd.randrange(VOCAB)]])
        outputs = toks(rnd.randint(2, 5))
        outputs[rnd.randrange(len(outputs) - 1)] = rnd.choice([7, *stop])
        cases.append({"prompt": toks(rnd.randint(1, 4)), "outputs": outputs, "eos": rnd.choice([None, 7]),
                      "params": {"max_tokens": 7, "min_tokens": rnd.choice([0, 1]), "stop_token_ids": stop,
                                 "ignore_eos": rnd.random() < 0.25}})
    add("check_stop", ["EngineCore.check_stop"], [], {"max_model_len": 12, "cases": cases})
    # Drawn after all of the above (which stays the same for a seed): a request resumed after a recompute,
    # its history over the whole budget but what it still needs under it, behind a newcomer (chunking off);
    # a request's hashes left behind by the engine's own steps, then looked up again on readmission; a cached
    # chain with a gap, and an empty req_blocks entry; and a step whose plan puts a capped prompt chunk (no
    # sample row) before requests that do sample.
    for _ in range(size):
        add("schedule", ["Scheduler.schedule"], ["hash_block", *BLOCK_HOLES], _resumed_args(rnd, toks))
    add("block_ops", BLOCK_HOLES, ["hash_block"], {"runs": [_resumed_ops(rnd, toks)]}, group="BlockManager")
    add("block_ops", BLOCK_HOLES, ["hash_block"], {"runs": [_gap_ops(rnd, toks)]}, group="BlockManager")
    for _ in range(size):
        add("engine", ["EngineCore.step"], STEP_DEPS, _engine_args(rnd, toks, "capped"))
    # And after those: build_batch's edges (one scenario per rule), write_kv into a pool of another dtype,
    # the flat model with the model's own sliding window, check_stop with stop tokens before min_tokens, a
    # step where a request with prompt logprobs is preempted by recompute and one whose prompt is one token,
    # preemptions by hand of requests that came in with a cache hit, and a resumed request without a cache.
    for aspect, fields in BATCH_ASPECTS.items():
        add("build_batch", ["build_batch"], [], {"batches": _edge_batches(rnd, toks), "fields": fields,
                                                 "aspect": aspect})
    add("write_kv", ["write_kv"], [], {**_write_kv_args(rnd), "pool_dtype": "float32"})
    lens = [rnd.randint(8, 20) for _ in range(rnd.randint(1, 3))]  # longer than the window
    add("flat", ["FlatModel.attention", "FlatModel.forward"], ["write_kv", "ReferenceBackend.forward"],
        {"prompts": [toks(n) for n in lens], "chunk": rnd.randint(2, 8), "moe": False, "rope_theta": None,
         "sliding_window": rnd.choice([2, 3])}, group="FlatModel")
    cases = []
    for _ in range(20):
        stop = [rnd.randrange(VOCAB), 11]
        outputs = toks(rnd.randint(1, 4))
        outputs[-1] = rnd.choice(stop)
        cases.append({"prompt": toks(rnd.randint(1, 4)), "outputs": outputs, "eos": rnd.choice([None, 7]),
                      "params": {"max_tokens": 7, "min_tokens": rnd.choice([len(outputs) + 1, len(outputs) + 2,
                                                                            len(outputs)]),
                                 "stop_token_ids": stop, "ignore_eos": rnd.random() < 0.25}})
    add("check_stop", ["EngineCore.check_stop"], [], {"max_model_len": 12, "cases": cases})
    add("engine", ["EngineCore.step"], STEP_DEPS, _engine_args(rnd, toks, "recompute"))
    add("preempt", ["Scheduler._preempt"], ["hash_block", *BLOCK_HOLES, "Scheduler.schedule"],
        _preempt_args(rnd, toks, "direct-shared"))
    add("schedule", ["Scheduler.schedule"], ["hash_block", *BLOCK_HOLES], {**_resumed_args(rnd, toks), "caching": False})
    return out


def _resumed_args(rnd, toks) -> dict:
    """Chunking off, the priority policy, a budget B: request a runs its prompt and some decodes until its
    history N is over B, is preempted by recompute (by the grader, ``preempt``: what _preempt's docstring
    says for recompute under the priority policy, so that only schedule runs learner code), and c, a
    newcomer of a better priority whose prompt leaves less of the budget than a still needs, arrives. a's full blocks are still
    cached, so what it needs (N less its cached prefix) fits the whole budget: it waits for room for all of
    it (the docstring's rule looks at what a request still needs, not at its history), then runs whole.
    With ``caching`` False (set by the caller) it needs its whole history, more than the budget: it runs in
    pieces of the budget left."""
    bs = 4
    budget = rnd.choice([8, 12])
    total = rnd.choice([n for n in range(budget + 1, budget + 2 * bs + 1) if n % bs in (0, 2, 3)])
    need = total - bs * ((total - 1) // bs)  # after the cached prefix: 2 to 4 tokens
    plen = rnd.randint(max(1, total - 2 * bs), budget)
    steps = total - plen  # the prompt's step, then decodes: total tokens, total - 1 computed
    clen = rnd.randint(budget - need + 1, budget - 1)  # leaves 1 .. need - 1 of the budget
    reqs = [{"id": "a", "prompt": toks(plen), "max_tokens": steps + 3, "priority": 1, "at": 0},
            {"id": "c", "prompt": toks(clen), "max_tokens": rnd.randint(1, 3), "priority": 0, "at": steps}]
    cfg = {"max_num_batched_tokens": budget, "max_num_seqs": 8, "long_prefill_token_threshold": rnd.choice([0, 3]),
           "policy": "priority", "preemption_mode": "recompute", "enable_chunked_prefill": False}
    return {"config": cfg, "num_blocks": 16, "block_size": bs, "reqs": reqs, "steps": 40,
            "preempt": {str(steps): ["a"]}, "linger": []}


def _gap_ops(rnd, toks) -> dict:
    """A cached chain with a hole in it: g1's first two blocks are private duplicates (prompt logprobs:
    no lookup) of g0's, its third is published; g0's copies are then evicted, so a lookup of that
    prefix misses at block 0 while block 2 is still cached (the walk stops at the first miss). Then a
    request given room for 0 tokens first (its ``req_blocks`` entry exists, empty: it holds no blocks),
    looked up and admitted with the cached blocks of a prefix."""
    bs = rnd.choice([2, 4])
    head, other = toks(3 * bs), toks(2 * bs)
    nb = rnd.randint(10, 14)
    ops = [["admit", "g0", head[:2 * bs] + toks(1), 2 * bs + 1], ["admit", "g1", head + toks(1), 3 * bs + 1, 1],
           ["free", "g0"], ["fill", "g2", toks(nb * bs)], ["free", "g2"],
           ["admit", "g3", head + toks(rnd.randint(1, bs)), 3 * bs + 1], ["free", "g1"], ["free", "g3"],
           ["admit", "g4", other + toks(1), 2 * bs + 1],
           ["empty", "g5", other[:rnd.choice([bs, 2 * bs])] + toks(rnd.randint(1, bs)), 2 * bs], ["free", "g5"],
           ["free", "g4"]]
    return {"num_blocks": nb, "block_size": bs, "caching": True, "ops": ops}


def _resumed_ops(rnd, toks) -> dict:
    """Requests run by the engine's own steps (``decode``: publish up to the step's end, then the sampled
    token appended, hashed only when a later call brings the hashes up to date) until a sampled token
    fills a block; then freed (a recompute preemption) and readmitted (``retry``): the lookup must first
    bring their hashes up to date (what a lookup did to the hashes is compared, ``_block_run``)."""
    bs = rnd.choice([2, 4])
    ops = []
    for i in range(rnd.randint(2, 3)):
        rid = f"d{i}"
        prompt = toks(rnd.randint(1, 3 * bs))
        ops += [["admit", rid, prompt, len(prompt)], ["decode", rid, rnd.randint(1, 2 * bs)]]
    ops += [["free", f"d{i}"] for i in range(len(ops) // 2)]
    ops += [op for i in range(len(ops) // 3) for op in (["retry", f"d{i}", 1], ["free", f"d{i}"])]
    return {"num_blocks": 64, "block_size": bs, "caching": True, "ops": ops}


def _write_kv_args(rnd) -> dict:
    nb, bs = rnd.randint(3, 6), rnd.choice([2, 4])
    n = rnd.randint(2, min(8, nb * bs))
    slots = rnd.sample(range(nb * bs), n)
    slots[rnd.randrange(n)] = -1
    if 0 not in slots:  # block 0's first slot is a real slot: only -1 is padding
        slots[next(i for i, s in enumerate(slots) if s != -1)] = 0
    return {"num_blocks": nb, "block_size": bs, "heads": 2, "dim": 3, "slots": slots, "seed": rnd.randrange(1 << 30)}


def _edge_batches(rnd, toks) -> list[dict]:
    """build_batch's edges: a table too short for the step's positions (the docstring's ValueError); no
    request at all, only dummies ([R, 0] block_table); a request with prompt logprobs that is past its
    prompt (a decode: no prompt_spans entry)."""
    short = _batch_args(rnd, toks)
    q = rnd.choice(short["reqs"])
    if (q["computed"] + q["n"] + short["block_size"] - 1) // short["block_size"] > 1:
        q["table"] = q["table"][:-1]
    else:  # a one-block request: it needs a second block for one more token
        q["outputs"], q["n"] = q["outputs"] + toks(short["block_size"]), q["n"] + short["block_size"]
    dummies = {"block_size": rnd.choice([4, 8]), "reqs": [], "pad_to": rnd.randint(1, 3)}
    decode = _batch_args(rnd, toks)
    bs = decode["block_size"]
    for q in decode["reqs"][:2]:
        q["outputs"] = q["outputs"] or toks(rnd.randint(1, 3))
        q["plp"] = rnd.choice([1, 2])
        q["computed"] = len(q["prompt"]) + len(q["outputs"]) - 1
        q["n"] = 1
        q["table"] = rnd.sample(range(1, 60), (q["computed"] + 1 + bs - 1) // bs)
    return [short, dummies, decode]


def _held_ops(rnd, toks) -> dict:
    """A prefix computed by one request and adopted by others while it still runs (ref counts 1 -> 2 -> 3,
    no block taken twice from the free queue), then freed in turn and adopted again from the free queue."""
    bs = rnd.choice([2, 4])
    head = toks(3 * bs)
    ops = [["admit", "y0", head + toks(1), 3 * bs + 1], ["admit", "y1", head + toks(rnd.randint(1, bs)), 3 * bs],
           ["admit", "y2", head[:2 * bs] + toks(rnd.randint(1, bs)), 2 * bs], ["grow", "y1", bs + 1, False],
           ["free", "y0"], ["admit", "y3", head + toks(bs), 3 * bs], ["free", "y1"], ["free", "y2"], ["free", "y3"],
           ["admit", "y4", head + toks(2), 3 * bs + 2], ["free", "y4"]]
    return {"num_blocks": rnd.randint(10, 14), "block_size": bs, "caching": True, "ops": ops}


def _batch_args(rnd, toks) -> dict:
    bs = rnd.choice([4, 8, 16])
    reqs = []
    for i in range(rnd.randint(2, 4)):
        plen = rnd.randint(1, 3 * bs)
        outs = rnd.randint(0, 3) if rnd.random() < 0.5 else 0
        total = plen + outs
        computed = rnd.randint(0, total - 1)
        n = rnd.randint(1, total - computed)
        nblocks = (computed + n + bs - 1) // bs
        reqs.append({"id": f"q{i}", "prompt": toks(plen), "outputs": toks(outs), "computed": computed, "n": n,
                     "table": rnd.sample(range(1, 40), nblocks)})
    return {"block_size": bs, "reqs": reqs, "pad_to": len(reqs) + rnd.choice([0, 0, 2])}


def _batches(rnd, toks) -> list[dict]:
    """One build_batch scenario's batches: a plain one; one with drafts, prompt logprobs and a resumed
    request; one padded (``pad_to``) whose tables come as a read-only mapping in another order; and
    one that asks a request for more tokens than it has (the docstring's ValueError)."""
    plain = _batch_args(rnd, toks)
    rich = _batch_args(rnd, toks)
    bs = rich["block_size"]
    for q in rich["reqs"]:
        kind = rnd.choice(["drafts", "plp", "resumed", "plp"])
        plen = len(q["prompt"])
        if kind == "drafts":  # a decode with k drafts: its span is the last token and the drafts
            q["outputs"] = q["outputs"] or toks(rnd.randint(1, 3))
            q["drafts"] = toks(rnd.randint(1, 3))
            q["computed"] = plen + len(q["outputs"]) - 1
            q["n"] = 1 + len(q["drafts"])
        elif kind == "plp":  # a prompt chunk, perhaps the one at its last token, with prompt logprobs
            q["outputs"] = []
            q["plp"] = rnd.choice([1, 2])
            q["computed"] = rnd.randint(0, plen - 1)
            q["n"] = rnd.randint(1, plen - q["computed"])
        else:  # recomputed after a preemption: prompt and outputs run again from 0 (or from a cache hit)
            q["outputs"] = q["outputs"] or toks(rnd.randint(1, 3))
            total = plen + len(q["outputs"])
            q["computed"] = rnd.choice([0, (plen // bs) * bs]) if plen < total else 0
            q["n"] = rnd.randint(max(1, total - 1 - q["computed"]), total - q["computed"])
        need = (q["computed"] + q["n"] + bs - 1) // bs
        q["table"] = rnd.sample(range(1, 60), need)
    padded = _batch_args(rnd, toks)
    padded["pad_to"] = len(padded["reqs"]) + rnd.randint(1, 3)
    padded["by_id"] = True
    bad = _batch_args(rnd, toks)
    q = rnd.choice(bad["reqs"])
    q["n"] = len(q["prompt"]) + len(q["outputs"]) - q["computed"] + rnd.randint(1, 3)
    q["table"] = rnd.sample(range(1, 90), (q["computed"] + q["n"] + bad["block_size"] - 1) // bad["block_size"])
    return [plain, rich, padded, bad]


def _preempt_args(rnd, toks, rule: str) -> dict:
    """Running requests that fill the pool at admission (or nearly: each must fit it alone), so that a
    decode step soon needs a block there is none of: the first preemption is observed under one rule of the docstring.
    "front" and "priority" add two requests that wait (max_num_seqs is full) to check the queue."""
    bs = rnd.choice([2, 4])
    reqs = [{"id": f"p{i}", "prompt": toks(rnd.randint(1, 3 * bs)), "max_tokens": bs + 2,
             "priority": rnd.randint(0, 3)} for i in range(rnd.randint(2, 3))]
    waiting = [{"id": f"w{i}", "prompt": toks(rnd.randint(1, bs)), "max_tokens": 2, "priority": rnd.randint(0, 3)}
               for i in range(2 if rule in ("front", "priority", "direct", "direct-priority") else 0)]
    if rule == "direct-shared":  # each after the first starts with the first's full blocks: a cache hit
        head = reqs[0]["prompt"][:bs * (len(reqs[0]["prompt"]) // bs)] or toks(bs)
        reqs[0]["prompt"] = head + reqs[0]["prompt"][len(head):]
        for q in reqs[1:]:
            q["prompt"] = head + toks(rnd.randint(1, bs))
    mode = {"recompute": "recompute", "swap": "swap", "direct-shared": "recompute"}.get(rule) \
        or rnd.choice(["recompute", "swap"])
    policy = "priority" if rule in ("priority", "direct-priority") else "fcfs"
    cfg = {"max_num_batched_tokens": 64, "max_num_seqs": len(reqs), "policy": policy, "preemption_mode": mode}
    if rule.startswith("direct"):  # two victims in one step (the oldest running, then the newest), one again later
        chunk = rnd.randint(1, 3 * bs)
        return {"rule": rule, "config": cfg, "block_size": bs, "reqs": reqs, "late": waiting, "num_blocks": 64,
                "chunk": 4 * bs if rule == "direct-shared" else chunk, "victims": [0, -1]}
    return {"rule": rule, "config": cfg, "block_size": bs, "reqs": reqs, "late": waiting,
            "num_blocks": max(sum((len(q["prompt"]) + bs - 1) // bs for q in reqs),
                              max((len(q["prompt"]) + q["max_tokens"] + bs - 1) // bs for q in reqs))}


def _shared_prompts(rnd, toks, n: int, suffix=(1, 8)) -> list[list[int]]:
    heads = [[], toks(4), toks(9), toks(16)]
    return [rnd.choice(heads) + toks(rnd.randint(*suffix)) for _ in range(n)]


def _engine_args(rnd, toks, what: str) -> dict:
    prompts = _shared_prompts(rnd, toks, rnd.randint(2, 4))
    reqs = [{"id": f"r{i}", "prompt": p, "max_tokens": rnd.randint(2, 8), "at": rnd.choice([0, 0, 1, 3])}
            for i, p in enumerate(prompts)]
    cfg = {"block_size": rnd.choice([4, 8, 16]), "num_blocks": 64, "attention_backend": "torch"}
    if what in ("chunks", "failure"):
        cfg["max_num_batched_tokens"] = rnd.choice([6, 10, 16])
        reqs[rnd.randrange(len(reqs))]["plp"] = rnd.choice([1, 2])  # its entries come chunk by chunk
    if what == "children":
        reqs[0]["n"] = 2
        reqs[-1]["plp"] = rnd.choice([1, 2])
    if what == "capped":  # a chunk cap: a long prompt's capped chunk (no sample row) comes first in the
        # plan, and requests that sample follow it in the same step (each takes its own rows)
        cap = cfg["long_prefill_token_threshold"] = rnd.choice([2, 3, 4])
        cfg["max_num_batched_tokens"] = rnd.choice([12, 16])
        reqs[0].update(prompt=toks(rnd.randint(3 * cap + 1, 20)), at=0)
        reqs[1].update(prompt=toks(rnd.randint(1, cap)), at=0)
    if what == "recompute":  # a tight pool, preempting by recompute: the newest request (prompt logprobs)
        # is the victim and computes its prompt again (its entries rewritten from 0, not appended); and a
        # one-token prompt that asks for prompt logprobs (it has none: [])
        bs = cfg["block_size"] = 4
        reqs[:] = [{"id": "r2", "prompt": toks(1), "max_tokens": 2, "plp": 1, "at": 0},
                   {"id": "r0", "prompt": toks(rnd.randint(5, 8)), "max_tokens": rnd.randint(10, 12), "at": 0},
                   {"id": "r1", "prompt": toks(rnd.randint(5, 7)), "max_tokens": 8, "plp": rnd.choice([1, 2]), "at": 0}]
        cfg["num_blocks"] = max((len(q["prompt"]) + q["max_tokens"] + bs - 1) // bs for q in reqs) + 1
        cfg["preemption_mode"] = "recompute"
    if what == "seeded":  # sampled, not greedy: a seeded request draws from its own generator; chunked, so
        # that mid-prompt chunks (no sample row) sit among requests of other temperatures
        cfg["max_num_batched_tokens"] = rnd.choice([6, 10])
        for q in reqs:
            q["temperature"] = rnd.choice([0.0, 1.0, 0.7])
            q["seed"] = rnd.choice([None, rnd.randrange(1 << 20)])
        reqs[0]["temperature"], reqs[0]["seed"], reqs[0]["n"] = 1.0, rnd.randrange(1 << 20), 2
    args = {"config": cfg, "reqs": reqs, "stream": True, "moe": what == "moe"}
    if what == "failure":  # the forward pass raises at two of the first steps: the engine must recover
        args["fail_at"] = sorted(rnd.sample(range(1, 6), 2))
        args["fail_kind"] = rnd.choice(["RuntimeError", "KeyboardInterrupt", "MemoryError"])
    return args


CACHE_KEYS = [[], ["tenant", 1], ["tenant", 2], ["adapter", 3]]


def _isolation_args(rnd, toks) -> dict:
    key_a = rnd.choice(CACHE_KEYS)
    key_b = key_a if rnd.random() < 0.4 else rnd.choice([k for k in CACHE_KEYS if k != key_a])
    prompt = toks(rnd.choice([17, 21, 25]))
    staggered = rnd.random() < 0.5
    return {"config": {"block_size": 4, "num_blocks": 40},
            "reqs": [{"id": "a", "prompt": prompt, "max_tokens": 6, "key": key_a},
                     {"id": "b", "prompt": prompt, "max_tokens": 6, "key": key_b, "at": 1 if staggered else 0}]}


# moment -> the config that brings a request there (tests/test_reliability.py's aborts at every moment)
MOMENTS = {"waiting": {"max_num_seqs": 1}, "mid-prefill": {"max_num_batched_tokens": 4}, "decoding": {},
           "preempted": {"num_blocks": 9, "preemption_mode": "recompute"},
           "swapped": {"num_blocks": 9, "preemption_mode": "swap"}}


def _moment_args(rnd, toks, moment: str) -> dict:
    head = toks(16)
    reqs = [{"id": f"r{i}", "prompt": head + toks(rnd.randint(1, 7)), "max_tokens": 6} for i in range(4)]
    return {"config": {"block_size": 4, "num_blocks": 40, **MOMENTS[moment]}, "reqs": reqs, "abort_when": moment}


def _config_args(rnd, toks) -> dict:
    bs = rnd.choice([2, 4, 8, 16])
    prompts = _shared_prompts(rnd, toks, rnd.randint(3, 5), suffix=(1, 11))
    most = max(map(len, prompts)) + 8
    cfg = {"block_size": bs, "num_blocks": rnd.choice([(most + bs - 1) // bs + 1, 200]),
           "max_num_batched_tokens": rnd.choice([8, 20, 2048]), "long_prefill_token_threshold": rnd.choice([0, 2, 5]),
           "max_num_seqs": rnd.choice([1, 2, 4, 256]), "policy": rnd.choice(["fcfs", "priority"]),
           "preemption_mode": rnd.choice(["recompute", "swap"]), "enable_prefix_caching": rnd.random() < 0.7}
    if rnd.random() < 0.25 and cfg["max_num_batched_tokens"] >= most:
        cfg["enable_chunked_prefill"] = False
    reqs = [{"id": f"r{i}", "prompt": p, "max_tokens": rnd.randint(1, 8), "at": rnd.choice([0, 0, 2, 5]),
             "priority": rnd.randint(0, 3)} for i, p in enumerate(prompts)]
    return {"config": cfg, "reqs": reqs, "abort_after": rnd.randint(1, 6), "abort": f"r{rnd.randrange(len(reqs))}"}


def _block_ops(rnd, toks) -> dict:
    bs = rnd.choice([2, 4])
    shared = toks(3 * bs)
    nb = rnd.randint(6, 12)
    ops, live, dead, grown = [], [], [], []
    for i in range(10):
        if live and rnd.random() < 0.35:
            dead.append(live.pop(rnd.randrange(len(live))))
            ops.append(["free", dead[-1]])
            if rnd.random() < 0.3:
                ops.append(["refree", dead[-1]])
            continue
        rid = f"b{i}"
        roll = rnd.random()
        if roll < 0.12:  # more blocks than the pool has: refused, then asked again later
            ops.append(["admit", rid, toks(nb * bs + rnd.randint(1, bs)), nb * bs])
            ops.append(["retry", rid, 1])
            continue
        prompt = (shared[: rnd.choice([bs, 2 * bs, 3 * bs])] if rnd.random() < 0.6 else []) + toks(rnd.randint(1, 2 * bs))
        if roll < 0.3 and not any(o[0] == "fill" for o in ops):
            ops.append(["fill", rid, toks(nb * bs)])
            live.append(rid)
            continue
        if roll < 0.4:  # looked up (or not, with prompt logprobs), never admitted
            ops.append(["lookup", rid, prompt])
            continue
        ops.append(["admit", rid, prompt, rnd.randint(1, len(prompt)), rnd.choice([None, None, None, 1])])
        live.append(rid)
        if rnd.random() < 0.5:
            ops.append(["grow", rid, rnd.randint(bs, 2 * bs + 1), rnd.random() < 0.3])
            grown.append(rid)
        if rnd.random() < 0.2:
            ops.append(["readopt", rid])
    ops += [["free", r] for r in live]
    again = ([r for r in live if r in grown] + [r for r in live if r not in grown])[:2]
    ops += [["retry", r, rnd.randint(1, 2 * bs)] for r in again]  # readmitted: their own blocks (outputs too) cached
    ops += [["free", r] for r in again]
    # A private duplicate (prompt logprobs: no lookup) of a cached prefix; the cached copy is evicted; the
    # duplicate then fills a new block: only its new blocks are offered (from num_published on).
    dup = toks(2 * bs)
    ops += [["admit", "x0", dup, len(dup)], ["admit", "x1", dup + toks(1), 2 * bs + 1, 1], ["free", "x0"],
            ["fill", "x2", toks(nb * bs)], ["free", "x2"], ["grow", "x1", bs + 1], ["free", "x1"]]
    return {"num_blocks": nb, "block_size": bs, "caching": rnd.random() < 0.8, "ops": ops}


def _sched_args(rnd, toks, how: str) -> dict:
    """Requests with shared prefixes arriving over a few steps (several at once), under a drawn
    configuration: ``roomy`` (a big pool, chunked prefill), ``tight`` (a pool that just fits the largest
    request, so that it preempts, mostly by swapping), ``whole`` / ``whole-swap`` (chunked prefill off, a
    budget at or a little above the longest prompt, a chunk cap that must not apply, a tight pool,
    preempting by recompute / by swap). Each request stays running one step past its last token
    (``linger``: the plan after that must skip it)."""
    bs = 4
    prompts = _shared_prompts(rnd, toks, rnd.randint(3, 5) if how == "roomy" else rnd.randint(4, 5), suffix=(1, 10))
    reqs = [{"id": f"s{i}", "prompt": p, "max_tokens": rnd.randint(2, 6), "priority": rnd.randint(0, 3),
             "at": 0 if i == 0 else rnd.choice([0, 2, 2, 3])} for i, p in enumerate(prompts)]
    whole = how.startswith("whole")
    cfg = {"max_num_batched_tokens": rnd.choice([8, 16, 64]), "max_num_seqs": rnd.choice([2, 8]),
           "long_prefill_token_threshold": rnd.choice([0, 5]), "policy": rnd.choice(["fcfs", "priority"]),
           "preemption_mode": {"tight": rnd.choice(["recompute", "swap", "swap"]), "whole": "recompute",
                               "whole-swap": "swap"}.get(how, rnd.choice(["recompute", "swap"])),
           "enable_chunked_prefill": not whole}
    if whole:  # every prompt must fit the budget then (Scheduler.check)
        budget = cfg["max_num_batched_tokens"] = max(len(q["prompt"]) for q in reqs) + rnd.choice([0, 0, 2])
        cfg["long_prefill_token_threshold"] = rnd.choice([3, 5])
        cfg["policy"] = "priority"
        # the first: nearly the whole budget, the lowest priority (the victim), so that it comes back needing
        # more than the budget left; the last: exactly the whole budget, arriving while others run
        reqs[0].update(prompt=toks(budget - 1), priority=3, max_tokens=6)
        reqs[-1].update(prompt=toks(budget), priority=0, at=2)
    most = max((len(q["prompt"]) + q["max_tokens"] + bs - 1) // bs for q in reqs)
    return {"config": cfg, "num_blocks": 64 if how == "roomy" else most + rnd.choice([0, 0, 1]), "block_size": bs,
            "reqs": reqs, "steps": 40, "linger": [q["id"] for q in reqs]}


# ------------------------------------------------------------------------------ running (child side)
def run_scenario(spec: dict):
    """Run one scenario on whatever ``engine`` this process imports; plain data back (only the
    ``fields`` the scenario checks, where it names them)."""
    got = globals()["_run_" + spec["kind"]](spec["args"])
    fields = spec["args"].get("fields")
    return {k: got[k] for k in fields} if fields and spec["kind"] != "build_batch" else got


def _request(rid, prompt, outputs=(), computed=0, **params):
    from engine.serve import Request, SamplingParams

    r = Request(rid, list(prompt), SamplingParams(**{"temperature": 0.0, **params}))
    for t in outputs:
        r.append(int(t))
    r.num_computed_tokens = computed
    return r


def _ints(t) -> list:
    return [int(x) for x in t.reshape(-1).tolist()]


def _floats(t) -> list:
    return [float(x) for x in t.reshape(-1).tolist()]


def _run_build_batch(a):
    """Every batch of the scenario, each reduced to the scenario's ``fields`` (``dtypes``: the tensors'
    dtypes; ``error``: the exception's kind, where the docstring asks for one)."""
    return {"batches": [_one_batch(b, a["fields"]) for b in a["batches"]]}


def _one_batch(a, fields):
    import types

    from engine.serve import build_batch

    reqs = []
    for q in a["reqs"]:
        r = _request(q["id"], q["prompt"], q["outputs"], q["computed"],
                     **({"prompt_logprobs": q["plp"]} if q.get("plp") else {}))
        r.spec_token_ids = list(q.get("drafts", []))
        reqs.append(r)
    scheduled = [(r, q["n"]) for r, q in zip(reqs, a["reqs"])]
    if a.get("by_id"):  # a read-only mapping, its order the reverse of the plan's
        tables = types.MappingProxyType({q["id"]: q["table"] for q in reversed(a["reqs"])})
    else:
        tables = [q["table"] for q in a["reqs"]]
    try:
        batch = build_batch(scheduled, tables, a["block_size"], pad_to=a["pad_to"])
    except ValueError:
        return {"error": "ValueError"} if "error" in fields else {}
    m = batch.meta
    got = {"input_ids": _ints(batch.input_ids), "positions": _ints(batch.positions),
           "query_start_loc": _ints(m.query_start_loc), "seq_lens": _ints(m.seq_lens),
           "slot_mapping": _ints(m.slot_mapping), "block_table": [_ints(row) for row in m.block_table],
           "logits_indices": _ints(batch.logits_indices), "sample_counts": [int(x) for x in batch.sample_counts],
           "max_query_len": int(m.max_query_len), "max_seq_len": int(m.max_seq_len), "error": None,
           "request_ids": [str(x) for x in batch.request_ids],
           "prompt_spans": [[str(r.request_id), int(c), [int(x) for x in ts]] for r, c, ts in batch.prompt_spans]}
    dtypes = {"tokens": {"input_ids": batch.input_ids, "positions": batch.positions},
              "slots": {"slot_mapping": m.slot_mapping},
              "meta": {"query_start_loc": m.query_start_loc, "seq_lens": m.seq_lens, "block_table": m.block_table}}
    aspect = next((k for k, v in dtypes.items() if set(BATCH_ASPECTS[k]) == set(fields)), None)
    got["dtypes"] = {k: str(v.dtype) for k, v in dtypes.get(aspect, {}).items()}
    return {k: got[k] for k in fields}


def _run_write_kv(a):
    import torch

    from engine.serve import write_kv

    g = torch.Generator().manual_seed(a["seed"])
    shape = (a["num_blocks"] + 1, a["block_size"], a["heads"], a["dim"])
    pool = getattr(torch, a.get("pool_dtype", "float64"))  # the rows stay float64: written cast to the pool's
    k_cache, v_cache = torch.zeros(shape, dtype=pool), torch.zeros(shape, dtype=pool)
    n = len(a["slots"])
    k = torch.randn(n, a["heads"], a["dim"], generator=g, dtype=torch.float64)
    v = torch.randn(n, a["heads"], a["dim"], generator=g, dtype=torch.float64)
    write_kv(k_cache, v_cache, k, v, torch.tensor(a["slots"], dtype=torch.int64))
    return {"k_cache": _floats(k_cache), "v_cache": _floats(v_cache)}


def _meta(spans, block_size):
    """BatchMeta built here from plain numbers (not by the learner's build_batch)."""
    import torch

    from engine.serve import BatchMeta

    starts = [0]
    for s in spans:
        starts.append(starts[-1] + s["q_len"])
    width = max(1, max(len(s["table"]) for s in spans))
    table = torch.tensor([s["table"] + [0] * (width - len(s["table"])) for s in spans], dtype=torch.int32)
    slots = []
    for s in spans:
        if s["seq_len"] == 0:  # a padding request: one row, written to the scratch slot
            slots.append(-1)
            continue
        for p in range(s["seq_len"] - s["q_len"], s["seq_len"]):
            slots.append(s["table"][p // block_size] * block_size + p % block_size)
    qsl = torch.tensor(starts, dtype=torch.int32)
    seq = torch.tensor([s["seq_len"] for s in spans], dtype=torch.int32)
    return BatchMeta(qsl, seq, table, torch.tensor(slots, dtype=torch.int64), block_size, qsl.clone(), seq.clone(),
                     max(s["q_len"] for s in spans), max(s["seq_len"] for s in spans))


def _run_attention(a):
    import torch

    from engine.serve import ReferenceBackend

    g = torch.Generator().manual_seed(a["seed"])
    meta = _meta(a["spans"], a["block_size"])
    shape = (8 + 1, a["block_size"], a["kv_heads"], a["dim"])
    cache = (torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64))
    q = torch.randn(int(meta.query_start_loc[-1]), a["heads"], a["dim"], generator=g, dtype=torch.float64)
    out = ReferenceBackend().forward(q, cache, meta, window=a["window"])
    got = {"out": _floats(out)}
    if a.get("mixed"):
        meta = _meta(a["mixed"], a["block_size"])
        q = torch.randn(int(meta.query_start_loc[-1]), a["heads"], a["dim"], generator=g, dtype=torch.float64)
        scribble = torch.full_like(q, 7.0)  # freed just before: an output left uninitialised (empty_like) most
        del scribble  # likely gets this memory back, so its padding rows show 7.0, not zeros by chance
        got["mixed"] = _floats(ReferenceBackend().forward(q, cache, meta, scale=a["mixed_scale"],
                                                          window=a["mixed_window"]))
    return got


def _run_flat(a):
    import torch

    from engine.models import tiny_model
    from engine.serve import FlatModel, ReferenceBackend

    model = tiny_model(seed=0, moe=a["moe"], dtype=torch.float64,
                       **({"rope_theta": a["rope_theta"]} if a.get("rope_theta") else {}),
                       **({"sliding_window": a["sliding_window"]} if a.get("sliding_window") else {}))
    flat = FlatModel(model)
    layers, kv_heads, head_dim = flat.kv_spec()
    bs, backend = 4, ReferenceBackend()
    blocks_each = [(len(p) + bs - 1) // bs for p in a["prompts"]]
    caches = [backend.allocate((sum(blocks_each) + 1, bs, kv_heads, head_dim), torch.float64, "cpu")
              for _ in range(layers)]
    tables, first = [], 0
    for n in blocks_each:
        tables.append(list(range(first, first + n)))
        first += n
    done, rows = [0] * len(a["prompts"]), []
    while any(d < len(p) for d, p in zip(done, a["prompts"])):
        spans, ids, pos = [], [], []
        for i, p in enumerate(a["prompts"]):
            if done[i] < len(p):
                n = min(a["chunk"], len(p) - done[i])
                spans.append({"seq_len": done[i] + n, "q_len": n, "table": tables[i]})
                ids += p[done[i]:done[i] + n]
                pos += list(range(done[i], done[i] + n))
                done[i] += n
        hidden = flat.forward(torch.tensor(ids), torch.tensor(pos), caches, _meta(spans, bs), backend)
        rows.append(_floats(hidden[-1]))
    return {"last_rows": rows}


def _run_hash_block(a):
    from engine.serve import hash_block

    digests = []
    for link in a["chain"]:
        parent = None if link["parent"] is None else digests[link["parent"]]
        digests.append(hash_block(parent, link["tokens"], tuple(link["extra"])))
    return {"digests": [bytes(d).hex() for d in digests]}


def _blocks_state(bm, reqs=None) -> dict:
    return {"ref_count": [int(x) for x in bm.ref_count], "num_free": int(bm.num_free),
            "free_order": [int(b) for b in bm.free_queue],  # so a wrong order is free()'s, not the next allocation's
            "req_blocks": {str(k): [int(b) for b in v] for k, v in sorted(bm.req_blocks.items())},
            "cached": sorted([bytes(h).hex(), int(b)] for h, b in bm.cached.items()),
            "block_hash": [None if h is None else bytes(h).hex() for h in bm.block_hash],
            "num_published": {str(k): int(v) for k, v in sorted(bm.num_published.items())},
            "pending_lookups": {str(k): [int(x) for x in v] for k, v in sorted(bm.pending_lookups.items())},
            "counters": [int(bm.num_queries), int(bm.num_hits), int(bm.num_evicted)]}


def _call(fn, *args):
    """A hole's return, or the kind of the exception it raised (a docstring's error is behaviour too)."""
    try:
        return fn(*args), None
    except (ValueError, RuntimeError) as exc:
        return None, type(exc).__name__


def _run_block_ops(a):
    """One or more managers (``runs``: e.g. prefix caching on, then off), each through its call sequence."""
    return {"records": [r for run in a.get("runs", [a]) for r in _block_run(run)["records"]]}


def _block_run(a):
    from engine.serve import BlockManager

    bm = BlockManager(a["num_blocks"], a["block_size"], a["caching"])
    reqs, records = {}, []

    def rec(hole, ret, **more):
        records.append({"hole": hole, "ret": ret, "state": {**_blocks_state(bm, reqs), **more}})

    def lookup(r):
        """find_cached_prefix, recorded with what it did to the request's hashes: brought up to date on
        a lookup, left as they were when it returns [] at once (prompt logprobs, caching off). Only
        there: cache_full_blocks may bring them up to date on every call or only when a block fills."""
        before = len(r.block_hashes)
        cached, err = _call(bm.find_cached_prefix, r)
        if a["caching"] and r.params.prompt_logprobs is None:
            full = (r.num_tokens - r.num_placeholders) // a["block_size"]
            hashes = "up to date" if len(r.block_hashes) == full else "behind"
        else:
            hashes = "left as they were" if len(r.block_hashes) == before else "changed"
        rec("BlockManager.find_cached_prefix", err or [int(b) for b in cached or []], hashes=hashes)
        return cached

    def admit(r, n, open_count=False) -> None:
        cached = lookup(r) or []
        r.num_computed_tokens = 0
        hit = len(cached) * a["block_size"]
        n = max(1, min(n, r.num_tokens - hit))
        ok, err = _call(bm.allocate_slots, r, n, cached)
        rec("BlockManager.allocate_slots", err or bool(ok))
        if open_count:  # the docstring sets num_published at a request's FIRST allocation only; adopting into
            # an empty entry later may set it or not (cache_full_blocks, next, makes them agree again)
            records[-1]["state"]["num_published"].pop(r.request_id, None)
        if ok:
            r.num_computed_tokens = hit + n
            rec("BlockManager.cache_full_blocks", _call(bm.cache_full_blocks, r)[1])

    for op in a["ops"]:
        if op[0] == "admit":
            rid, prompt, n = op[1:4]
            r = reqs[rid] = _request(rid, prompt, max_tokens=64, **({"prompt_logprobs": op[4]} if op[4:] and op[4] else {}))
            admit(r, n)
        elif op[0] == "fill":  # a prompt that needs exactly the blocks still free (the last one included)
            rid, tokens = op[1:3]
            r = reqs[rid] = _request(rid, tokens[:max(1, bm.num_free) * a["block_size"]], max_tokens=64)
            admit(r, r.num_tokens)
        elif op[0] == "retry":  # the same request asks again (after a failed allocation, or once more)
            _, rid, n = op
            if rid in reqs and rid not in bm.req_blocks:
                admit(reqs[rid], n)
        elif op[0] == "lookup":  # looked up, never admitted, then dropped
            _, rid, prompt = op
            r = reqs[rid] = _request(rid, prompt, max_tokens=64)
            lookup(r)
            rec("BlockManager.free", _call(bm.free, r)[1])
        elif op[0] == "readopt":  # cached blocks offered to a request that holds blocks: a ValueError
            rid = op[1]
            if rid in bm.req_blocks and bm.req_blocks[rid]:
                rec("BlockManager.allocate_slots", _call(bm.allocate_slots, reqs[rid], 1, bm.req_blocks[rid][:1])[1])
        elif op[0] == "grow":
            rid, n = op[1:3]
            r = reqs[rid]
            if rid not in bm.req_blocks or r.num_computed_tokens == 0:
                continue
            for _ in range(n):
                if r.num_computed_tokens >= r.num_tokens:
                    r.append((r.num_tokens * 31) % VOCAB)
                    bm.update_hashes(r)
                ok, err = _call(bm.allocate_slots, r, 1)
                rec("BlockManager.allocate_slots", err or bool(ok))
                if not ok:
                    break
                r.num_computed_tokens += 1
                if op[3:] and op[3] and r.num_computed_tokens % a["block_size"] == 0:
                    # the scheduler's call: publish up to a count given (here: every known token)
                    rec("BlockManager.cache_full_blocks", _call(bm.cache_full_blocks, r, r.num_tokens)[1])
                else:
                    rec("BlockManager.cache_full_blocks", _call(bm.cache_full_blocks, r)[1])
        elif op[0] == "empty":  # room for 0 tokens first (an entry, empty), then its lookup and admission
            rid, prompt, n = op[1:4]
            r = reqs[rid] = _request(rid, prompt, max_tokens=64)
            ok, err = _call(bm.allocate_slots, r, 0)
            rec("BlockManager.allocate_slots", err or bool(ok))
            admit(r, n, open_count=True)
        elif op[0] == "decode":  # the engine's steps: publish to the step's end, compute, append the sample
            rid, k = op[1:3]
            r = reqs[rid]
            if rid not in bm.req_blocks or r.num_computed_tokens == 0:
                continue
            steps = 0
            while steps < k or r.num_tokens % a["block_size"]:  # ends on a sample that fills a block
                if r.num_computed_tokens >= r.num_tokens:
                    r.append((r.num_tokens * 29) % VOCAB)
                    if steps >= k and not r.num_tokens % a["block_size"]:
                        break
                n = r.num_tokens - r.num_computed_tokens  # the rest of its prompt, or its newest token
                ok, err = _call(bm.allocate_slots, r, n)
                rec("BlockManager.allocate_slots", err or bool(ok))
                if not ok:
                    break
                rec("BlockManager.cache_full_blocks", _call(bm.cache_full_blocks, r, r.num_computed_tokens + n)[1])
                r.num_computed_tokens += n
                steps += 1
        elif op[0] == "free":
            rec("BlockManager.free", _call(bm.free, reqs[op[1]])[1])
        elif op[0] == "refree":  # a stale table freed again: its blocks are at 0 already (a RuntimeError)
            rid, stale = op[1], [b for b in range(bm.num_blocks) if bm.ref_count[b] == 0][:1]
            if rid in reqs and rid not in bm.req_blocks and stale:
                bm.req_blocks[rid] = stale
                rec("BlockManager.free", _call(bm.free, reqs[rid])[1])
                bm.req_blocks.pop(rid, None)
    return {"records": records}


def _run_schedule(a):
    from engine.serve import BlockManager, Scheduler, SchedulerConfig

    from engine.serve import Status

    s = Scheduler(SchedulerConfig(**a["config"]), BlockManager(a["num_blocks"], a["block_size"], a.get("caching", True)))
    reqs, pending, lingered = [], list(enumerate(a["reqs"])), set()
    plans = []
    for step in range(a["steps"]):
        for i, q in [x for x in pending if x[1].get("at", 0) <= step]:
            pending.remove((i, q))
            r = _request(q["id"], q["prompt"], max_tokens=q["max_tokens"])
            r.priority, r.arrival_time = q["priority"], float(i)
            s.add(r)
            reqs.append(r)
        for rid in a.get("preempt", {}).get(str(step), []):  # a recompute preemption, done here by the
            victim = next((r for r in s.running if r.request_id == rid), None)  # grader (not the learner's _preempt)
            if victim is not None:
                s.running.remove(victim)
                victim.num_computed_tokens = 0
                s.blocks.free(victim)
                victim.status = Status.PREEMPTED
                victim.num_preemptions += 1
                s.num_preemptions += 1
                s._insert_sorted(s.waiting, victim)
        if not s.has_unfinished():
            if not pending:
                break
            continue
        plan = s.schedule()
        ids = lambda rs: [r.request_id for r in rs]  # noqa: E731
        plans.append({"scheduled": [[r.request_id, int(n)] for r, n in plan.scheduled],
                      "preempted": sorted(r.request_id for r in plan.preempted),
                      "computed": {r.request_id: int(r.num_computed_tokens) for r in reqs},
                      "cached": {r.request_id: int(r.num_cached_tokens) for r in reqs},
                      "status": {r.request_id: str(r.status.name) for r in reqs},
                      "waiting": ids(s.waiting), "running": ids(s.running),
                      "swap_in": [[r.request_id, [int(b) for b in bl]] for r, bl in plan.swap_in],
                      "swap_out": [[r.request_id, [int(b) for b in bl]] for r, bl in plan.swap_out],
                      "published": sorted(int(b) for b in s.blocks.cached.values())})
        for r in list(s.running):  # kept one step past its last token (that plan skipped it): finished now
            if r.request_id in lingered:
                s.finish(r, Status.FINISHED_LENGTH)
        _advance(s, plan, linger=a.get("linger", ()), lingered=lingered)
    return {"plans": plans}


def _advance(s, plan, linger=(), lingered=None) -> None:
    """What the engine does after a forward pass (no model): count the tokens, append a sample, finish
    (a request in ``linger`` stays running one step more, with nothing left to compute)."""
    from engine.serve import Status

    for r, n in plan.scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens >= r.num_tokens:
            r.append((r.num_tokens * 17) % VOCAB)
            s.blocks.cache_full_blocks(r)
            if r.num_output_tokens >= r.params.max_tokens:
                if r.request_id in linger and lingered is not None and r.request_id not in lingered:
                    lingered.add(r.request_id)
                else:
                    s.finish(r, Status.FINISHED_LENGTH)


def _run_preempt(a):
    """The first preemption, observed under one rule (``a["rule"]``), then (recompute, swap) the
    victim's return once the others finish."""
    from engine.serve import BlockManager, Scheduler, SchedulerConfig, Status

    s = Scheduler(SchedulerConfig(**a["config"]), BlockManager(a["num_blocks"], a["block_size"]))
    reqs = []

    def add(q, when):
        r = _request(q["id"], q["prompt"], max_tokens=q["max_tokens"])
        r.priority, r.arrival_time = q["priority"], float(when)
        s.add(r)
        reqs.append(r)

    for i, q in enumerate(a["reqs"]):
        add(q, i)
    if a["rule"].startswith("direct"):
        return _preempt_direct(s, a, add, reqs)
    _advance(s, s.schedule())
    for i, q in enumerate(a["late"]):
        add(q, len(reqs) + i)
    plan = None
    for _ in range(4 * a["block_size"] + 4):
        plan = s.schedule()
        if plan.preempted:
            break
        _advance(s, plan)
    if plan is None or not plan.preempted:
        return {"preempted": []}
    ids = lambda rs: [r.request_id for r in rs]  # noqa: E731
    got = {"preempted": ids(plan.preempted), "waiting": ids(s.waiting),
           "scheduled": [[r.request_id, int(n)] for r, n in plan.scheduled]}
    if a["rule"] in ("front", "priority"):
        return got
    victim = plan.preempted[0]
    got.update(status=str(victim.status.name), computed=int(victim.num_computed_tokens),
               holds_blocks=victim.request_id in s.blocks.req_blocks, running=ids(s.running),
               num_preemptions=int(victim.num_preemptions), swapped_out=bool(victim.swapped_out),
               swap_out=[[r.request_id, [int(b) for b in bl]] for r, bl in plan.swap_out])
    for r in list(s.running):  # the others finish: the victim comes back
        s.finish(r, Status.FINISHED_LENGTH)
    back = s.schedule()
    got["back"] = {"scheduled": [[r.request_id, int(n)] for r, n in back.scheduled],
                   "swap_in": [[r.request_id, [int(b) for b in bl]] for r, bl in back.swap_in],
                   "swapped_out": bool(victim.swapped_out)}
    return got


def _preempt_direct(s, a, add, reqs):
    """Victims preempted by hand (``Scheduler._preempt`` alone): two in one step, with requests waiting
    of drawn priorities; then one victim readmitted and preempted again."""
    from engine.serve import SchedulerOutput

    s.config.long_prefill_token_threshold = a["chunk"]  # some requests mid-prefill, some with outputs
    for _ in range(2):
        _advance(s, s.schedule())
    for i, q in enumerate(a["late"]):
        add(q, 10 + i)
    ids = lambda rs: [r.request_id for r in rs]  # noqa: E731

    def look(out) -> dict:
        return {"preempted": ids(out.preempted), "waiting": ids(s.waiting), "running": ids(s.running),
                "swap_out": [[r.request_id, [int(b) for b in bl]] for r, bl in out.swap_out],
                "count": int(s.num_preemptions), "free": int(s.blocks.num_free),
                "reqs": {r.request_id: [str(r.status.name), int(r.num_computed_tokens), int(r.num_preemptions),
                                        bool(r.swapped_out), r.request_id in s.blocks.req_blocks, bool(r.admitted),
                                        int(r.num_cached_tokens)] for r in reqs}}

    got, out = [], SchedulerOutput()
    for v in a["victims"]:
        if s.running:
            s._preempt(s.running[v % len(s.running)], out)
            got.append(look(out))
    again = out.preempted[0] if out.preempted else None
    for _ in range(6):
        if again is None or again in s.running:
            break
        _advance(s, s.schedule())
    if again is not None and again in s.running:
        out = SchedulerOutput()
        s._preempt(again, out)
        got.append(look(out))
    return {"direct": got}


def _run_check_stop(a):
    import torch

    from engine.models import tiny_model
    from engine.serve import EngineConfig, EngineCore

    e = EngineCore(tiny_model(seed=0, dtype=torch.float64), EngineConfig(max_model_len=a["max_model_len"]))
    got = []
    for c in a["cases"]:
        r = _request("r", c["prompt"], c["outputs"], **c["params"])
        r.eos_token_id = c["eos"]
        status = e.check_stop(r)
        got.append([None if status is None else str(getattr(status, "name", status)), r.stop_reason])
    return {"results": got}


# a request at each moment of its life (tests/test_reliability.py's aborts at every moment)
def _at_moment(r, moment: str) -> bool:
    from engine.serve import Status

    return {"waiting": lambda: r.status is Status.WAITING and r.num_computed_tokens == 0,
            "mid-prefill": lambda: r.status is Status.RUNNING and 0 < r.num_computed_tokens < r.num_prompt_tokens,
            "decoding": lambda: r.status is Status.RUNNING and r.num_output_tokens >= 2,
            "preempted": lambda: r.status is Status.PREEMPTED,
            "swapped": lambda: bool(r.swapped_out)}[moment]()


def _run_engine(a):
    """A whole engine (the test model, float64, greedy): requests arriving at given steps, perhaps one
    abort (after a step, or of the first request found at a moment), perhaps an id reused at idle.
    Back: every request's tokens, finish reason and cached tokens; blocks shared across cache keys;
    what is left at idle; with ``stream``, which request produced how many tokens at each step."""
    import torch

    from engine.models import tiny_model
    from engine.serve import EngineConfig, EngineCore, SamplingParams

    e = EngineCore(tiny_model(seed=0, moe=a.get("moe", False), dtype=torch.float64),
                   EngineConfig(**{"attention_backend": "reference", **a["config"]}))
    reqs = a.get("reqs") or [{"id": f"r{i}", "prompt": p, "max_tokens": m}
                             for i, (p, m) in enumerate(zip(a["prompts"], a["max_tokens"]))]
    keys, sampled = {}, []
    real_sampler = e.sampler

    def sampler(logits, reqs, generators):  # the rows each step hands the sampler (0 rows: called all the same)
        sampled.append([int(logits.shape[0]), len(reqs)])
        return real_sampler(logits, reqs, generators)

    e.sampler = sampler

    def add(q) -> None:
        key = tuple(q.get("key", ()))
        params = SamplingParams(max_tokens=q["max_tokens"], temperature=q.get("temperature", 0.0), ignore_eos=True,
                                n=q.get("n", 1), prompt_logprobs=q.get("plp"), seed=q.get("seed"))
        for rid in e.add_request(q["id"], q["prompt"], params, priority=q.get("priority", 0), cache_key=key):
            keys[rid] = key

    done, reasons, cached, plps, stream, shared, aborted, failures = {}, {}, {}, {}, [], 0, [], []
    if a.get("fail_at"):  # the forward pass (the runner's execute) raises on these calls
        real, calls = e.runner.execute, [0]
        kind = {"RuntimeError": RuntimeError, "KeyboardInterrupt": KeyboardInterrupt,
                "MemoryError": MemoryError}[a["fail_kind"]]

        def execute(batch):
            calls[0] += 1
            if calls[0] in a["fail_at"]:
                raise kind("injected by the scenario")
            return real(batch)

        e.runner.execute = execute

    def run(pending: list) -> None:
        nonlocal shared
        steps = 0
        while (pending or e.has_unfinished()) and steps < 600:
            for q in [q for q in pending if q.get("at", 0) <= steps]:
                pending.remove(q)
                add(q)
            try:
                outs = e.step()
            except (RuntimeError, KeyboardInterrupt, MemoryError) as exc:
                if "fail_at" not in a:
                    raise
                failures.append([steps, type(exc).__name__, int(e.steps), len(e.blocks.cached),
                                 sorted([r.request_id, int(r.num_computed_tokens)]
                                        for r in [*e.scheduler.running, *e.scheduler.waiting])])
                outs = []
            steps += 1
            if a.get("stream"):
                stream.append(sorted([o.request_id, len(o.new_token_ids), bool(o.finished)] for o in outs))
            for o in outs:
                if o.finished:
                    done[o.request_id] = [int(t) for t in o.output_token_ids]
                    reasons[o.request_id], cached[o.request_id] = o.finish_reason, int(o.num_cached_tokens)
                    if o.prompt_logprobs is not None:
                        plps[o.request_id] = [sorted([int(t), float(v)] for t, v in d.items())
                                              for d in o.prompt_logprobs]
            tables = e.blocks.req_blocks
            live = sorted(r for r in tables if r in keys)
            shared += sum(len(set(tables[x]) & set(tables[y])) for i, x in enumerate(live) for y in live[i + 1:]
                          if keys[x] != keys[y])
            victim = None
            if "abort_when" in a and not aborted:
                victim = next((r.request_id for r in [*e.scheduler.waiting, *e.scheduler.running]
                               if _at_moment(r, a["abort_when"])), None)
            elif steps == a.get("abort_after"):
                victim = a["abort"]
            if victim is not None:
                aborted.append([steps, victim])
                e.abort_request(victim)
                e.abort_request(victim)  # a second abort is harmless

    run([dict(q) for q in reqs])
    if a.get("reuse"):  # a finished id and an unknown one aborted (harmless), then the id again with 2 children
        e.abort_request(reqs[0]["id"])
        e.abort_request("never-added")
        run([{**reqs[0], "n": 2, "max_tokens": reqs[0]["max_tokens"] + 2, "at": 0}])
    got = {"outputs": dict(sorted(done.items())), "finish_reasons": dict(sorted(reasons.items())),
           "idle": not e.has_unfinished(), "free_blocks_at_idle": int(e.blocks.num_free),
           "pool_blocks": int(len(e.blocks.ref_count)), "aborted": aborted, "shared_across_keys": shared,
           "cached_tokens": dict(sorted(cached.items())), "prompt_logprobs": dict(sorted(plps.items())),
           "steps": int(e.steps), "failures": failures, "sampler_rows": sampled}
    if a.get("stream"):
        got["stream"] = stream
    return got


def child_main(argv: list[str]) -> int:
    """Run every scenario in SPECS.json, appending ``{"start": id}`` then ``{"id", "result"|"error"}``."""
    specs = json.loads(open(argv[0]).read())
    if os.environ.get("ENGINE_COURSE_COPY"):  # a chapter file that does not import: the course's copy instead,
        from course.learner.holes import import_engine  # as in the test session (it fails only its own holes)

        try:
            import_engine()
        except BaseException:  # noqa: BLE001 - every scenario then records the import error itself
            pass
    with open(argv[1], "a") as out:
        for spec in specs:
            out.write(json.dumps({"start": spec["id"]}) + "\n")
            out.flush()
            try:
                line = {"id": spec["id"], "result": run_scenario(spec)}
            except BaseException as exc:  # noqa: BLE001 - the learner's code may raise anything
                line = {"id": spec["id"], "error": type(exc).__name__}
            out.write(json.dumps(line) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
