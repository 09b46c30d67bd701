"""Mutants: named, realistic bugs applied to the reference one at a time; the tests must catch each.

A test suite that passes the reference says little until it FAILS on the mistakes learners
actually make. Each mutant below is one exact text replacement in a chapter file whose holes are
filled from ``solutions/`` (``course.learner.testrun.reference_files``). It plays a learner who filled
every hole exactly as the reference, except for this one bug: a workspace
(``course.learner.testrun.workspace``, a temporary copy of the repository; the working tree is never
touched) gets those files in engine/ with the mutant applied, and the chapter's tests run
there in a subprocess under ``--impl engine`` — the learner's own route — restricted to the tests
of the holes the bug lives in plus the milestone, hole tests first, stopping at the first failure.
A mutant is
- killed: a test of its own hole failed (or, for a mutant marked ``own=False`` whose hole's
  contract cannot see it alone, any selected test); the table shows which, and its first line;
- LATE: only the milestone caught a bug its own hole's tests should have caught;
- SURVIVED: every selected test passed — the tests can't see this bug; strengthen them;
- stale: its text no longer matches the reference exactly once — update the mutant;
- broken: the run errored before any test failed (e.g. the mutated file doesn't import).

    python -m course.quality.mutants                 # all mutants, 2 workers; exit 1 unless all are killed
    python -m course.quality.mutants --list          # names and descriptions
    python -m course.quality.mutants slot-off-by-one-at-block-boundary eos-before-min-tokens
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from course.learner.testrun import CHAPTER_TESTS, ROOT, reference_files, run_pytest, workspace


@dataclass(frozen=True)
class Mutant:
    """One bug: replace ``old`` (which must occur exactly once) by ``new`` in ``engine/<file>``
    with every hole filled.
    ``holes`` names the holes whose tests should catch it (the milestone always runs too);
    ``keyword``, when set, narrows those tests further (pytest ``-k``) to skip slow ones; ``own``
    says a test of one of ``holes`` must be the one to catch it."""

    name: str
    file: str
    holes: tuple[str, ...]
    old: str
    new: str
    why: str
    keyword: str = ""
    own: bool = True


_ADMISSION_LOOP = (  # the reference's admission loop, which two mutants below rewrite
    "        while (not out.preempted and self.waiting and budget > 0\n"
    "               and len(self.running) < cfg.max_num_seqs):\n"
    "            req = self.waiting[0]\n"
    "            cached: list[int] = []\n"
    "            if not req.swapped_out and req.num_computed_tokens == 0:\n"
    "                cached = self.blocks.find_cached_prefix(req)\n"
    "            num_cached = len(cached) * self.blocks.block_size\n"
    "            need = req.num_tokens_with_spec - req.num_computed_tokens - num_cached\n"
    "            if (not cfg.enable_chunked_prefill and need > budget\n"
    "                    and need <= cfg.max_num_batched_tokens):\n"
    "                break\n"
    "            n = min(need, budget)\n"
    "            if cfg.enable_chunked_prefill and cfg.long_prefill_token_threshold > 0:\n"
    "                n = min(n, cfg.long_prefill_token_threshold)\n"
    "            if not self.blocks.allocate_slots(req, n, cached):\n"
    "                break\n"
    "            del self.waiting[0]\n"
)


def _skipping(loop: str, stop: str) -> str:
    """``loop`` (the admission loop) rewritten to skip a waiting request at ``stop`` (the ``break``
    after that condition) and go on to the next one, instead of stopping admission there."""
    loop = loop.replace("        while (not out.preempted and self.waiting and budget > 0\n",
                        "        skipped = 0\n        while (not out.preempted and len(self.waiting) > skipped and budget > 0\n")
    loop = loop.replace("self.waiting[0]", "self.waiting[skipped]")
    return loop.replace(stop + "\n                break\n", stop + "\n                skipped += 1\n                continue\n")


MUTANTS: list[Mutant] = [
    # ---- the six the chapter's milestone must catch -----------------------------------------------
    Mutant("slot-off-by-one-at-block-boundary", "serve/batch.py", ("build_batch",),
           "slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]",
           "slots += [table[(p - 1) // block_size] * block_size + p % block_size for p in range(c, c + n)]",
           "the first position of each block is written into the previous block's table entry"),
    Mutant("recompute-keeps-stale-num-computed", "serve/scheduler.py", ("Scheduler._preempt",),
           "        else:\n            request.num_computed_tokens = 0\n",
           "        else:\n            pass  # forgets to reset: resumes as if its K/V were still there\n",
           "a request preempted by recompute resumes with a stale num_computed_tokens"),
    Mutant("cached-prefix-includes-last-token-block", "serve/blocks.py", ("BlockManager.find_cached_prefix",),
           "limit = min((request.num_tokens - 1) // self.block_size, len(hashes))",
           "limit = min(request.num_tokens // self.block_size, len(hashes))",
           "a cached block is adopted without leaving a token to compute (the last token's block matched)"),
    Mutant("swap-in-into-wrong-blocks", "serve/scheduler.py", ("Scheduler._preempt", "Scheduler.schedule"),
           "out.swap_in.append((req, self.blocks.req_blocks[req.request_id][:num_saved]))",
           "out.swap_in.append((req, self.blocks.req_blocks[req.request_id][-num_saved:]))",
           "a swapped-out request's saved K/V is restored into the LAST blocks of its new table"),
    Mutant("logits-from-first-row-of-span", "serve/batch.py", ("build_batch",),
           "        sample_rows += range(start + n - k, start + n)",
           "        sample_rows += range(start, start + k)",
           "logits are taken from the first (mid-prompt) row of a span instead of its last"),
    Mutant("mid-prompt-chunk-samples", "serve/batch.py", ("build_batch",),
           "k = min(n, max(0, c + n - (req.num_tokens - 1)))",
           "k = 1",
           "every span samples one row, even a chunk that stops mid-prompt"),
    Mutant("abort-leaks-blocks", "serve/scheduler.py", ("EngineCore.step",),
           "        self.finish(request, Status.FINISHED_ABORTED)\n        return request\n",
           "        (self.running if request in self.running else self.waiting).remove(request)\n"
           "        request.status = Status.FINISHED_ABORTED\n"
           "        self.requests.pop(request_id, None)\n        return request\n",
           "an aborted request leaves the queues but keeps its blocks", keyword="abort"),
    Mutant("preempt-leaks-blocks", "serve/scheduler.py", ("Scheduler._preempt",),
           "        self.blocks.free(request)\n        request.status = Status.PREEMPTED\n",
           "        request.status = Status.PREEMPTED\n",
           "a preempted request keeps holding its blocks"),
    # ---- block manager -----------------------------------------------------------------------
    Mutant("head-first-free", "serve/blocks.py", ("BlockManager.free",),
           "self._release(reversed(table))",
           "self._release(table)",
           "freed blocks join the queue head first, so shared prefix blocks are evicted first"),
    Mutant("reused-block-keeps-old-hash", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "            del self.free_queue[b]\n            self._evict(b)  # its old content is about to be overwritten\n",
           "            del self.free_queue[b]\n",
           "a block handed out again keeps its old hash: a later request adopts someone else's K/V"),
    Mutant("running-request-never-grows", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "        if num_new == 0 and not cached_blocks and table:",
           "        if not cached_blocks and table:",
           "a request that already holds blocks gets no new one when its last block fills"),
    Mutant("cached-free-adoption-not-counted", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "if num_new + len(reclaimed) > self.num_free:",
           "if num_new > self.num_free:",
           "adopting a cached-free block is not counted against the free blocks left"),
    Mutant("allocate-from-queue-back", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "fresh = list(itertools.islice(self.free_queue, num_new))",
           "fresh = list(itertools.islice(reversed(self.free_queue), num_new))",
           "new blocks come from the BACK of the free queue: the most recently freed are reused first"),
    Mutant("publish-partial-block", "serve/blocks.py", ("BlockManager.cache_full_blocks",),
           "full = min(num_tokens // self.block_size, len(request.block_hashes), len(table))",
           "full = min(self.blocks_for(num_tokens), len(request.block_hashes) + 1, len(table))",
           "a block that isn't full yet is published under the next hash"),
    Mutant("last-writer-wins", "serve/blocks.py", ("BlockManager.cache_full_blocks",),
           "if h not in self.cached and self.block_hash[b] is None:",
           "if self.block_hash[b] is None:",
           "a duplicate block overwrites the cached entry of the block that published first"),
    Mutant("hash-ignores-parent", "serve/blocks.py", ("hash_block",),
           "h.update(ROOT_HASH if parent is None else parent)",
           "h.update(ROOT_HASH)",
           "a block's hash doesn't chain its parent: equal blocks after different prefixes collide"),
    Mutant("hash-ignores-cache-key", "serve/blocks.py", ("hash_block",),
           "    if extra:\n        h.update(b\"\\x00extra\\x00\")\n        h.update(encode_cache_key(extra))\n",
           "",
           "the cache key (tenant, adapter, image) is left out of the hash: tenants share K/V"),
    # ---- scheduler ----------------------------------------------------------------------------
    Mutant("admit-after-preemption", "serve/scheduler.py", ("Scheduler.schedule",),
           "while (not out.preempted and self.waiting and budget > 0",
           "while (self.waiting and budget > 0",
           "waiting requests are admitted in a step that just preempted (the pool is full)"),
    Mutant("chunk-cap-ignored-at-admission", "serve/scheduler.py", ("Scheduler.schedule",),
           "            if cfg.enable_chunked_prefill and cfg.long_prefill_token_threshold > 0:\n"
           "                n = min(n, cfg.long_prefill_token_threshold)\n",
           "",
           "a newly admitted prompt's chunk is not capped at long_prefill_token_threshold"),
    Mutant("chunk-cap-ignored-when-running", "serve/scheduler.py", ("Scheduler.schedule",),
           "        if self.config.enable_chunked_prefill and self.config.long_prefill_token_threshold > 0:\n"
           "            n = min(n, self.config.long_prefill_token_threshold)\n",
           "",
           "a running request's later prefill chunks are not capped at long_prefill_token_threshold"),
    Mutant("preempted-requeued-at-back", "serve/scheduler.py", ("Scheduler._preempt",),
           "            self.waiting.insert(0, request)",
           "            self.waiting.append(request)",
           "a preempted request goes to the BACK of the waiting queue and starves"),
    Mutant("preempt-first-running", "serve/scheduler.py", ("Scheduler.schedule", "Scheduler._preempt"),
           "self._preempt(self.running[-1], out)",
           "self._preempt(self.running[0], out)",
           "the oldest running request is preempted instead of the newest"),
    Mutant("no-publish-at-admission", "serve/scheduler.py", ("Scheduler.schedule",),
           "            self.blocks.cache_full_blocks(req, req.num_computed_tokens + n)\n"
           "            out.scheduled.append((req, n))\n            budget -= n\n        return out\n",
           "            out.scheduled.append((req, n))\n            budget -= n\n        return out\n",
           "blocks are published only after the step: a request admitted later in the same step can't share"),
    Mutant("swap-keeps-nothing", "serve/scheduler.py", ("Scheduler._preempt",),
           "keep_kv = self.config.preemption_mode == \"swap\" and request.num_computed_tokens > 0",
           "keep_kv = False",
           "swap mode silently recomputes (no swap_out, K/V forgotten)"),
    # ---- prompt logprobs, stop rules, step -----------------------------------------------------
    Mutant("prompt-logprob-rows-mixed-into-sample-rows", "serve/batch.py", ("build_batch",),
           "                prompt_rows.extend(range(start, start + end - c))",
           "                sample_rows.extend(range(start, start + end - c))",
           "prompt-logprob rows are interleaved with sample rows instead of coming after all of them"),
    Mutant("eos-before-min-tokens", "serve/engine.py", ("EngineCore.check_stop",),
           "        if num_output >= p.min_tokens:\n            if last in p.stop_token_ids:",
           "        if not p.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:\n"
           "            return Status.FINISHED_STOPPED\n"
           "        if num_output >= p.min_tokens:\n            if last in p.stop_token_ids:",
           "EOS ends a request before it has min_tokens outputs"),
    Mutant("context-limit-ignored", "serve/engine.py", ("EngineCore.check_stop",),
           "if num_output >= p.max_tokens or request.num_tokens >= self.max_model_len:",
           "if num_output >= p.max_tokens:",
           "a request runs past max_model_len"),
    Mutant("step-reports-mid-prompt-chunks", "serve/engine.py", ("EngineCore.step",),
           "            if new or status is not None:\n                outputs.append(self._output(req, new))",
           "            outputs.append(self._output(req, new))",
           "a chunk that produced no token is reported anyway"),
    # ---- issue 11's list: bugs that once passed every chapter test -------------------------------
    Mutant("find-cached-prefix-continues-past-miss", "serve/blocks.py", ("BlockManager.find_cached_prefix",),
           "        return [self.cached[h] for h in hashes[:matched]]\n",
           "        return [self.cached[h] for h in hashes[:limit] if h in self.cached]\n",
           "the prefix walk skips a miss and adopts later blocks without the K/V in front of them"),
    Mutant("admitted-appended-to-running", "serve/scheduler.py", ("Scheduler.schedule",),
           "            self._insert_sorted(self.running, req)\n",
           "            self.running.append(req)\n",
           "an admitted request is appended to running instead of inserted at its (priority, arrival) place"),
    Mutant("step-samples-indexed-by-request", "serve/engine.py", ("EngineCore.step",),
           "        row = 0\n        for (req, n), k in zip(plan.scheduled, batch.sample_counts):\n"
           "            start = req.num_computed_tokens\n            req.num_computed_tokens += n\n"
           "            new = tokens[row:row + k]\n            row += k\n",
           "        for i, ((req, n), k) in enumerate(zip(plan.scheduled, batch.sample_counts)):\n"
           "            start = req.num_computed_tokens\n            req.num_computed_tokens += n\n"
           "            new = tokens[i:i + k]\n",
           "request r takes sampled token r instead of its own sample rows (wrong once a mid-prompt chunk precedes)"),
    Mutant("prompt-logprob-targets-ignore-c", "serve/batch.py", ("build_batch",),
           "req.prompt_token_ids[c + 1:end + 1]",
           "req.prompt_token_ids[1:end - c + 1]",
           "prompt-logprob targets of a later chunk start at the prompt's start instead of after c"),
    Mutant("hash-extra-with-python-hash", "serve/blocks.py", ("hash_block",),
           "        h.update(encode_cache_key(extra))\n",
           "        h.update(repr(hash(extra)).encode())\n",
           "the cache key is hashed with Python's hash(), which differs from process to process"),
    Mutant("free-without-blocks-is-a-no-op", "serve/blocks.py", ("BlockManager.free",),
           "        table = self.req_blocks.pop(request.request_id, [])\n",
           "        table = self.req_blocks.pop(request.request_id, None)\n        if table is None:\n"
           "            return\n",
           "free() of a request without blocks returns early and leaves its pending_lookups entry"),
    Mutant("pending-lookup-kept-after-admission", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "        self.pending_lookups.pop(rid, None)  # admitted: its lookup stays counted\n",
           "",
           "a request admitted by allocate_slots keeps its pending_lookups entry"),
    Mutant("num-published-leaks", "serve/blocks.py", ("BlockManager.free",),
           "        self.num_published.pop(request.request_id, None)\n",
           "",
           "free() keeps the request's num_published entry"),
    Mutant("num-published-not-set-on-adoption", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "        if cached_blocks or rid not in self.num_published:\n"
           "            self.num_published[rid] = len(cached_blocks)",
           "        if rid not in self.num_published:\n            self.num_published[rid] = 0",
           "adopted blocks are not counted as published in num_published"),
    Mutant("prompt-logprobs-duplicated-after-recompute", "serve/engine.py", ("EngineCore.step",),
           "req.prompt_logprobs = (req.prompt_logprobs or [])[:start] + ",
           "req.prompt_logprobs = (req.prompt_logprobs or []) + ",
           "after a recompute preemption the re-prefilled prompt's logprobs are appended a second time"),
    # ---- more bugs a learner may write, reading each docstring ----------------------------------
    Mutant("seq-len-without-computed", "serve/batch.py", ("build_batch",),
           "        seq_lens.append(c + n)\n",
           "        seq_lens.append(n)\n",
           "seq_len is the step's n instead of c + n (attention would not see earlier K/V)"),
    Mutant("prompt-logprob-rows-include-last-position", "serve/batch.py", ("build_batch",),
           "end = min(c + n, req.num_prompt_tokens - 1)",
           "end = min(c + n, req.num_prompt_tokens)",
           "the prompt's last row (which predicts no prompt token) gets a prompt-logprob row too"),
    Mutant("v-pool-gets-k", "serve/attention.py", ("write_kv",),
           "for pool, rows in ((k_cache, k), (v_cache, v)):",
           "for pool, rows in ((k_cache, k), (v_cache, k)):",
           "K is written into the V pool"),
    Mutant("attention-ignores-block-table", "serve/attention.py", ("ReferenceBackend.forward",),
           "slots = tables[r, pos // bs].long() * bs + pos % bs  # [L]",
           "slots = pos  # [L]",
           "a request's K/V are read from slots 0..L-1 instead of through its block table"),
    Mutant("flat-attention-ignores-window", "serve/flat.py", ("FlatModel.attention",),
           "o = backend.forward(q, kv_cache, meta, scale=attn.scale, window=self.cfg.sliding_window)",
           "o = backend.forward(q, kv_cache, meta, scale=attn.scale)",
           "the model's sliding window is not passed to the backend: every query sees its whole context"),
    Mutant("find-cached-prefix-without-update-hashes", "serve/blocks.py", ("BlockManager.find_cached_prefix",),
           "        self.update_hashes(request)\n        hashes = request.block_hashes\n",
           "        hashes = request.block_hashes\n",
           "find_cached_prefix walks request.block_hashes without filling them in first"),
    Mutant("cache-full-blocks-without-update-hashes", "serve/blocks.py", ("BlockManager.cache_full_blocks",),
           "        self.update_hashes(request)\n        full = min(",
           "        full = min(",
           "cache_full_blocks publishes from request.block_hashes without filling them in first"),
    Mutant("v-written-as-k", "serve/flat.py", ("FlatModel.attention",),
           "backend.write(kv_cache, k, v, meta)",
           "backend.write(kv_cache, k, k, meta)",
           "the V pool receives this step's keys instead of its values"),
    Mutant("rope-by-row-index", "serve/flat.py", ("FlatModel.forward",),
           "cos, sin = rope_cos_sin(positions, ",
           "cos, sin = rope_cos_sin(torch.arange(input_ids.shape[0]), ",
           "RoPE uses the row number in the batch instead of each row's position"),
    Mutant("tokens-packed-as-int32", "serve/blocks.py", ("hash_block",),
           'packed = array("q", tokens)',
           'packed = array("i", tokens)',
           "token ids are packed as 32-bit instead of 64-bit integers"),
    Mutant("hits-counted-in-blocks", "serve/blocks.py", ("BlockManager.find_cached_prefix",),
           "self.record_lookup(request, matched * self.block_size)",
           "self.record_lookup(request, matched)",
           "prefix-cache hits are counted in blocks, queries in tokens"),
    Mutant("prompt-logprob-requests-use-the-cache", "serve/blocks.py", ("BlockManager.find_cached_prefix",),
           "if wants_prompt_logprobs or not self.enable_prefix_caching:",
           "if not self.enable_prefix_caching:",
           "a request that wants prompt logprobs adopts cached blocks, so those rows never produce them"),
    Mutant("publish-ignores-num-tokens", "serve/blocks.py", ("BlockManager.cache_full_blocks",),
           "        if num_tokens is None:\n            num_tokens = request.num_computed_tokens\n",
           "        num_tokens = request.num_computed_tokens\n",
           "cache_full_blocks ignores its num_tokens argument (the scheduler's publish-at-allocation)"),
    Mutant("admitted-flag-never-set", "serve/scheduler.py", ("Scheduler.schedule",),
           "req.admitted, req.num_cached_tokens = True, num_cached",
           "req.num_cached_tokens = num_cached",
           "admitted is never set: num_cached_tokens is overwritten at every readmission"),
    Mutant("swapped-out-not-cleared", "serve/scheduler.py", ("Scheduler.schedule",),
           "                req.swapped_out = False\n",
           "",
           "a swapped-in request stays marked swapped_out"),
    Mutant("status-not-set-running", "serve/scheduler.py", ("Scheduler.schedule",),
           "            req.status = Status.RUNNING\n",
           "",
           "an admitted request keeps status WAITING / PREEMPTED"),
    Mutant("max-num-seqs-off-by-one", "serve/scheduler.py", ("Scheduler.schedule",),
           "and len(self.running) < cfg.max_num_seqs",
           "and len(self.running) <= cfg.max_num_seqs",
           "one request more than max_num_seqs runs"),
    Mutant("admission-not-charged-to-budget", "serve/scheduler.py", ("Scheduler.schedule",),
           "            out.scheduled.append((req, n))\n            budget -= n\n        return out\n",
           "            out.scheduled.append((req, n))\n        return out\n",
           "admitted requests' tokens are not taken from the step's budget"),
    Mutant("preemption-not-counted-on-request", "serve/scheduler.py", ("Scheduler._preempt",),
           "        request.num_preemptions += 1\n",
           "",
           "the request's num_preemptions is not counted"),
    Mutant("stop-token-before-min-tokens", "serve/engine.py", ("EngineCore.check_stop",),
           "        if num_output >= p.min_tokens:\n            if last in p.stop_token_ids:",
           "        if last in p.stop_token_ids:\n            request.stop_reason = last\n"
           "            return Status.FINISHED_STOPPED\n        if num_output >= p.min_tokens:\n"
           "            if last in p.stop_token_ids:",
           "a stop token ends a request before it has min_tokens outputs"),
    Mutant("max-tokens-off-by-one", "serve/engine.py", ("EngineCore.check_stop",),
           "if num_output >= p.max_tokens or request.num_tokens >= self.max_model_len:",
           "if num_output > p.max_tokens or request.num_tokens >= self.max_model_len:",
           "a request produces max_tokens + 1 tokens"),
    # ---- attention and the flat model ---------------------------------------------------------
    Mutant("padding-written-to-slot-zero", "serve/attention.py", ("write_kv",),
           "slots = slot_mapping.masked_fill(slot_mapping < 0, scratch_slot)",
           "slots = slot_mapping.masked_fill(slot_mapping < 0, 0)",
           "padding rows overwrite the first slot of block 0 instead of the scratch block"),
    Mutant("queries-at-first-positions", "serve/attention.py", ("ReferenceBackend.forward",),
           "q_pos = k_pos[seq_len - (end - start):]",
           "q_pos = k_pos[:end - start]",
           "a request's queries are placed at the first positions of its context, not the last"),
    Mutant("sliding-window-ignored", "serve/attention.py", ("ReferenceBackend.forward",),
           "scale=scale, window=window)",
           "scale=scale, window=0)",
           "the sliding window is dropped: every key is visible"),
    Mutant("kv-written-after-attention", "serve/flat.py", ("FlatModel.attention",),
           "        backend.write(kv_cache, k, v, meta)\n"
           "        o = backend.forward(q, kv_cache, meta, scale=attn.scale, window=self.cfg.sliding_window)\n",
           "        o = backend.forward(q, kv_cache, meta, scale=attn.scale, window=self.cfg.sliding_window)\n"
           "        backend.write(kv_cache, k, v, meta)\n",
           "this step's K/V reach the pool only after attention read it: rows miss their own chunk's keys"),
    Mutant("layer-reads-first-pool", "serve/flat.py", ("FlatModel.forward",),
           "kv_caches[i], meta, backend)",
           "kv_caches[0], meta, backend)",
           "every layer writes and reads layer 0's pool, so layers overwrite each other's K/V"),
    Mutant("final-norm-skips-residual", "serve/flat.py", ("FlatModel.forward",),
           "        out, _ = add_norm(hidden, residual, m.norm)\n",
           "        out = m.norm(hidden)\n",
           "the last layer's residual is dropped before the final norm"),
    # ---- issue 23: escape classes of the learner walk-through ----------------------------------
    Mutant("min-tokens-exclusive", "serve/engine.py", ("EngineCore.check_stop",),
           "        if num_output >= p.min_tokens:\n",
           "        if num_output > p.min_tokens:\n",
           "a stop token or EOS at exactly min_tokens outputs does not stop the request"),
    Mutant("length-checked-before-stop-rules", "serve/engine.py", ("EngineCore.check_stop",),
           "        if num_output >= p.min_tokens:\n            if last in p.stop_token_ids:",
           "        if num_output >= p.max_tokens or request.num_tokens >= self.max_model_len:\n"
           "            return Status.FINISHED_LENGTH\n"
           "        if num_output >= p.min_tokens:\n            if last in p.stop_token_ids:",
           "a stop token on the last allowed token finishes LENGTH (the length rules checked first)"),
    Mutant("ignore-eos-skips-stop-tokens", "serve/engine.py", ("EngineCore.check_stop",),
           "            if last in p.stop_token_ids:\n",
           "            if last in p.stop_token_ids and not p.ignore_eos:\n",
           "ignore_eos switches stop_token_ids off too"),
    Mutant("eos-checked-before-stop-tokens", "serve/engine.py", ("EngineCore.check_stop",),
           "            if last in p.stop_token_ids:\n                request.stop_reason = last\n"
           "                return Status.FINISHED_STOPPED\n"
           "            if not p.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:\n"
           "                return Status.FINISHED_STOPPED\n",
           "            if not p.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:\n"
           "                return Status.FINISHED_STOPPED\n"
           "            if last in p.stop_token_ids:\n                request.stop_reason = last\n"
           "                return Status.FINISHED_STOPPED\n",
           "EOS is checked before stop_token_ids: an EOS listed there finishes with no stop_reason"),
    Mutant("step-without-recovery", "serve/engine.py", ("EngineCore.step",),
           "            self.recover_failed_step(plan)\n",
           "            pass\n",
           "a step that fails never calls recover_failed_step: blocks published for it stay in the cache"),
    Mutant("step-recovers-only-from-exception", "serve/engine.py", ("EngineCore.step",),
           "        except BaseException:  # out of memory",
           "        except Exception:  # out of memory",
           "a Ctrl-C (KeyboardInterrupt) in the forward pass skips recover_failed_step"),
    Mutant("empty-plan-counted-as-step", "serve/engine.py", ("EngineCore.step",),
           "            if not plan.scheduled:\n                return []",
           "            if not plan.scheduled:\n                self.steps += 1\n                return []",
           "a step with an empty plan (no forward pass) is counted in steps"),
    Mutant("first-block-without-root-hash", "serve/blocks.py", ("hash_block",),
           "h.update(ROOT_HASH if parent is None else parent)",
           "h.update(parent or b\"\")",
           "the first block's digest leaves out ROOT_HASH"),
    Mutant("extra-without-separator", "serve/blocks.py", ("hash_block",),
           "        h.update(b\"\\x00extra\\x00\")\n",
           "",
           "the cache key's bytes follow the tokens without the separator the docstring names"),
    Mutant("lookup-miss-not-counted", "serve/blocks.py", ("BlockManager.find_cached_prefix",),
           "        self.record_lookup(request, matched * self.block_size)\n",
           "        if matched:\n            self.record_lookup(request, matched * self.block_size)\n",
           "a prefix lookup that finds nothing is not counted, so the hit rate only sees hits"),
    Mutant("lookup-counted-when-switched-off", "serve/blocks.py", ("BlockManager.find_cached_prefix",),
           "        if wants_prompt_logprobs or not self.enable_prefix_caching:\n            return []\n",
           "        if wants_prompt_logprobs or not self.enable_prefix_caching:\n"
           "            self.record_lookup(request, 0)\n            return []\n",
           "a lookup with caching off or prompt logprobs wanted is counted as a miss"),
    Mutant("cached-blocks-adopted-into-a-held-table", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "        if cached_blocks and table:\n",
           "        if False:\n",
           "allocate_slots adopts cached_blocks for a request that already holds blocks"),
    Mutant("num-published-not-raised", "serve/blocks.py", ("BlockManager.cache_full_blocks",),
           "        self.num_published[rid] = max(full, self.num_published.get(rid, 0))\n",
           "",
           "cache_full_blocks never raises num_published: every call walks the blocks again"),
    Mutant("admission-skips-a-blocked-head", "serve/scheduler.py", ("Scheduler.schedule",),
           _ADMISSION_LOOP, _skipping(_ADMISSION_LOOP, "            if not self.blocks.allocate_slots(req, n, cached):"),
           "a waiting head whose blocks don't fit is skipped and a later request admitted ahead of it"),
    Mutant("chunking-off-skips-a-waiting-prompt", "serve/scheduler.py", ("Scheduler.schedule",),
           _ADMISSION_LOOP, _skipping(_ADMISSION_LOOP, "                    and need <= cfg.max_num_batched_tokens):"),
           "chunking off: a prompt too long for the budget left is skipped and a later one admitted ahead of it"),
    Mutant("resumed-history-waits-forever", "serve/scheduler.py", ("Scheduler.schedule",),
           "                    and need <= cfg.max_num_batched_tokens):",
           "                    ):",
           "chunking off: a resumed history longer than the whole budget waits forever"),
    Mutant("resumed-request-skips-prefix-lookup", "serve/scheduler.py", ("Scheduler.schedule",),
           "if not req.swapped_out and req.num_computed_tokens == 0:",
           "if not req.admitted:",
           "a request readmitted after a recompute preemption is not looked up in the prefix cache"),
    Mutant("num-cached-tokens-overwritten-on-readmission", "serve/scheduler.py", ("Scheduler.schedule",),
           "            if not req.admitted:  # the first admission records what the prefix cache saved it\n"
           "                req.admitted, req.num_cached_tokens = True, num_cached\n",
           "            req.admitted, req.num_cached_tokens = True, num_cached\n",
           "num_cached_tokens is overwritten when a preempted request is admitted again"),
    Mutant("scheduler-preemptions-not-counted", "serve/scheduler.py", ("Scheduler._preempt",),
           "        self.num_preemptions += 1\n",
           "",
           "the scheduler's num_preemptions is never incremented"),
    Mutant("swap-without-computed-tokens", "serve/scheduler.py", ("Scheduler._preempt",),
           "keep_kv = self.config.preemption_mode == \"swap\" and request.num_computed_tokens > 0",
           "keep_kv = self.config.preemption_mode == \"swap\"",
           "swap mode marks a request with nothing computed swapped_out and lists an empty swap_out"),
    Mutant("tables-mapping-read-in-its-own-order", "serve/batch.py", ("build_batch",),
           "table = block_tables[req.request_id] if by_id else block_tables[i]",
           "table = (list(block_tables.values()) if by_id else block_tables)[i]",
           "a mapping of block tables is read in its own order instead of by request id"),
    Mutant("sample-count-from-prompt-length", "serve/batch.py", ("build_batch",),
           "k = min(n, max(0, c + n - (req.num_tokens - 1)))",
           "k = min(n, max(0, c + n - (req.num_prompt_tokens - 1)))",
           "sample rows counted from the prompt's end: a resumed history samples one row per output"),
    Mutant("empty-prompt-span-entry", "serve/batch.py", ("build_batch",),
           "            if end > c:\n",
           "            if True:\n",
           "a span that predicts no prompt token still gets a prompt_spans entry"),
]


@dataclass
class Result:
    mutant: Mutant
    status: str  # "killed" | "SURVIVED" | "stale" | "broken"
    killer: str = ""
    detail: str = ""
    seconds: float = 0.0


def check_applies(mutant: Mutant, files: dict[str, str] | None = None) -> str | None:
    """None if the mutant's text occurs exactly once in its filled chapter file, else why not."""
    files = files or reference_files()
    if mutant.file not in files:
        return f"engine/{mutant.file} is not a chapter file"
    count = files[mutant.file].count(mutant.old)
    return None if count == 1 else f"its text occurs {count} times in the filled engine/{mutant.file} (want exactly 1)"


# The bugs the chapter's milestone section lists, in its order (tests/test_mutants.py checks that
# the milestone alone catches each one).
MILESTONE_MUST_CATCH = ("kv-written-after-attention", "layer-reads-first-pool", "rope-by-row-index",
                        "seq-len-without-computed", "queries-at-first-positions",
                        "slot-off-by-one-at-block-boundary", "mid-prompt-chunk-samples",
                        "step-samples-indexed-by-request", "running-request-never-grows",
                        "cached-free-adoption-not-counted", "reused-block-keeps-old-hash",
                        "swap-in-into-wrong-blocks")


def apply_mutant(mutant: Mutant, files: dict[str, str]) -> dict[str, str]:
    """``files`` (chapter files by path under engine/) with the mutant's one replacement made;
    call ``check_applies`` first."""
    return {**files, mutant.file: files[mutant.file].replace(mutant.old, mutant.new)}


def run_mutant(mutant: Mutant, timeout: float = 600, milestone_only: bool = False) -> Result:
    """Apply one mutant to the reference in a workspace's engine/ and run its selected tests (``-x``);
    ``milestone_only``: the milestone alone."""
    files = reference_files()
    stale = check_applies(mutant, files)
    if stale:
        return Result(mutant, "stale", detail=stale)
    files = apply_mutant(mutant, files)
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        bed = workspace(Path(tmp) / "repo", files)
        keyword = ["-k", f"({mutant.keyword}) or milestone"] if mutant.keyword else []
        select = [f"--hole={h}" for h in ([] if milestone_only else mutant.holes)] + ["--hole=milestone"]
        run = run_pytest(["-x", "-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS, *select,
                          *([] if milestone_only else keyword)], cwd=bed, timeout=timeout, per_test_timeout=120)
    failed = run.first_failure()
    if failed is not None and failed.outcome == "failed":
        first = failed.message.splitlines()[0] if failed.message else ""
        own = milestone_only or not mutant.own or bool(set(failed.holes) & set(mutant.holes))
        return Result(mutant, "killed" if own else "LATE", failed.name, first, run.seconds)
    if run.returncode == 0 and run.tests and all(t.passed for t in run.tests):
        return Result(mutant, "SURVIVED", detail=f"{len(run.tests)} selected tests passed", seconds=run.seconds)
    why = (failed.message if failed else "") or (run.collect_errors[0]["message"][-300:] if run.collect_errors
                                                 else run.output[-300:])
    if run.timed_out:
        why = f"timed out after {timeout:.0f} s"
    return Result(mutant, "broken", failed.name if failed else "", why.strip().splitlines()[-1] if why.strip() else "",
                  run.seconds)


def run_all(mutants: list[Mutant], workers: int = 2, progress=None, milestone_only: bool = False) -> list[Result]:
    """Every mutant, ``workers`` subprocesses at a time; results in the order given."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(run_mutant, m, 600, milestone_only) for m in mutants]
        results = []
        for f in futures:
            results.append(f.result())
            if progress:
                progress(results[-1])
        return results


def baseline() -> str | None:
    """None if every hole filled with the reference passes every chapter test the mutants' way, else why."""
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        run = run_pytest(["-x", "-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS],
                         cwd=workspace(Path(tmp) / "repo", reference_files()))
    if run.returncode == 0 and run.tests and all(t.passed for t in run.tests):
        return None
    failed = run.first_failure()
    return f"{failed.name}: {failed.message}" if failed else run.output[-500:]


def format_table(results: list[Result]) -> str:
    rows = [("mutant", "file", "status", "killed by", "s")]
    for r in results:
        killer = r.killer + (f"  ({r.detail[:70]})" if r.detail else "")
        rows.append((r.mutant.name, r.mutant.file, r.status, killer, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run only these mutants (default: all)")
    ap.add_argument("--workers", type=int, default=2, help="test subprocesses at a time (default 2)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip checking that the unmutated copy passes")
    args = ap.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:45s} {m.file:20s} {m.why}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"unknown mutant(s) {unknown}; `python -m course.quality.mutants --list` names them", file=sys.stderr)
        return 2
    chosen = [by_name[n] for n in args.names] if args.names else MUTANTS
    start = time.monotonic()
    if not args.no_baseline:
        why = baseline()
        if why:
            print(f"the unmutated reference fails its own tests, so no mutant result means anything:\n  {why}")
            return 1
        print(f"baseline: the unmutated copy passes ({time.monotonic() - start:.0f} s)")
    from tqdm import tqdm

    with tqdm(total=len(chosen), desc="mutants", unit="mutant", dynamic_ncols=True) as bar:
        def progress(r: Result) -> None:  # one line per result above the bar: done/total, elapsed, ETA
            bar.write(f"  {r.status:8s} {r.mutant.name}")
            bar.update(1)

        results = run_all(chosen, args.workers, progress=progress)
    print()
    print(format_table(results))
    bad = [r for r in results if r.status != "killed"]
    print(f"\n{len(results) - len(bad)}/{len(results)} mutants killed in {time.monotonic() - start:.0f} s"
          + (f"; not killed: {', '.join(r.mutant.name + ' (' + r.status + ')' for r in bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
