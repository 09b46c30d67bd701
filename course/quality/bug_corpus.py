"""The learner-bug corpus: bugs a learner makes filling the holes from their docstrings, and how the
chapter's tests catch each one.

``course/quality/mutants.py`` holds the bugs the chapter's tests must kill at their own hole (each one a
test was written for). This corpus is the other half of that check: bugs invented by playing a
learner who has read only the handout (``make handout``), one realistic mistake at a time, over
every hole — off-by-ones, a wrong field, a wrong order, a missed case, a counter not kept, a
failure path not taken, state not reset — to measure how many the tests catch, where, and
whether the first failure's message points at the cause. A bug is a ``Mutant`` (one exact text
replacement in the reference; the same ``check_applies`` / ``apply_mutant`` / ``workspace``
machinery) plus its class, a few cause words, and, for a bug that cannot change behaviour,
``equivalent`` with why.

Each bug runs in a workspace (a temporary copy of the repository; the working tree is never
touched) under ``--impl engine``, stopping at the first failure:
(a) the owning hole's own tests (``--hole X``: the reference fills every other hole) -> caught by
the hole; (b) if none failed, the whole chapter file, every hole the learner's -> caught by the
chapter. "Names the cause": the first failure's message contains one of the bug's cause words.

    python -m course.quality.bug_corpus                         # run all, print the table (2 workers)
    python -m course.quality.bug_corpus --table docs/bug-corpus.md   # ... and write the committed table
    python -m course.quality.bug_corpus --list                  # names, holes, classes
    python -m course.quality.bug_corpus bb-positions-from-zero  # some bugs only
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from course.bench.machine import machine_line
from course.quality.mutants import Mutant, apply_mutant, check_applies
from course.learner.testrun import CHAPTER_TESTS, ROOT, reference_files, run_pytest, workspace

# The rates the corpus must reach over its non-equivalent bugs (tests/test_bug_corpus.py).
MIN_BY_CHAPTER = 0.95
MIN_BY_HOLE = 0.90

FILE_OF = {"build_batch": "serve/batch.py", "write_kv": "serve/attention.py",
           "ReferenceBackend.forward": "serve/attention.py", "FlatModel.attention": "serve/flat.py",
           "FlatModel.forward": "serve/flat.py", "hash_block": "serve/blocks.py",
           "BlockManager.find_cached_prefix": "serve/blocks.py", "BlockManager.allocate_slots": "serve/blocks.py",
           "BlockManager.cache_full_blocks": "serve/blocks.py", "BlockManager.free": "serve/blocks.py",
           "Scheduler.schedule": "serve/scheduler.py", "Scheduler._preempt": "serve/scheduler.py",
           "EngineCore.check_stop": "serve/engine.py", "EngineCore.step": "serve/engine.py"}
KINDS = ("off-by-one", "wrong field", "wrong order", "missed case", "counter", "failure path", "state not reset",
         "wrong formula", "wrong container")


@dataclass(frozen=True)
class Bug(Mutant):
    """A corpus bug: a ``Mutant`` (its ``holes`` hold the one owning hole) plus ``kind`` (a class of
    KINDS), ``cause`` (words a message naming the cause would contain) and ``equivalent`` (why it
    cannot change behaviour; empty for a real bug)."""

    kind: str = ""
    cause: tuple[str, ...] = ()
    equivalent: str = ""


def bug(hole: str, kind: str, name: str, old: str, new: str, why: str, cause: tuple[str, ...] = (),
        equivalent: str = "") -> Bug:
    return Bug(name, FILE_OF[hole], (hole,), old, new, why, kind=kind, cause=cause, equivalent=equivalent)


BB, WK, RF, FA, FF = "build_batch", "write_kv", "ReferenceBackend.forward", "FlatModel.attention", "FlatModel.forward"
HB, FCP, AS = "hash_block", "BlockManager.find_cached_prefix", "BlockManager.allocate_slots"
CFB, FR = "BlockManager.cache_full_blocks", "BlockManager.free"
SCH, PRE, CS, ST = "Scheduler.schedule", "Scheduler._preempt", "EngineCore.check_stop", "EngineCore.step"

BUGS: list[Bug] = [
    # ===== build_batch ==========================================================================
    bug(BB, "off-by-one", "bb-positions-from-zero",
        "        positions += range(c, c + n)\n", "        positions += range(n)\n",
        "positions restart at 0 for every span instead of running c .. c+n-1", ("position",)),
    bug(BB, "off-by-one", "bb-positions-shifted-by-one",
        "        positions += range(c, c + n)\n", "        positions += range(c + 1, c + n + 1)\n",
        "positions run c+1 .. c+n (the position of the token each row predicts)", ("position",)),
    bug(BB, "wrong field", "bb-rows-from-the-first-tokens",
        "tokens = (req.token_ids + req.spec_token_ids)[c:c + n]",
        "tokens = (req.token_ids + req.spec_token_ids)[:n]",
        "a span's rows are the request's FIRST n tokens, not tokens c .. c+n-1", ("row", "token")),
    bug(BB, "missed case", "bb-drafts-left-out",
        "tokens = (req.token_ids + req.spec_token_ids)[c:c + n]",
        "tokens = req.token_ids[c:c + n]",
        "speculative draft tokens are not fed after the last token", ("draft", "spec", "verification")),
    bug(BB, "wrong field", "bb-query-start-loc-of-span-start",
        "        query_start_loc.append(start + n)\n", "        query_start_loc.append(start)\n",
        "query_start_loc records where each span starts instead of where it ends", ("query_start_loc",)),
    bug(BB, "wrong formula", "bb-query-start-loc-of-n",
        "        query_start_loc.append(start + n)\n", "        query_start_loc.append(n)\n",
        "query_start_loc holds each span's length, not the running sum", ("query_start_loc",)),
    bug(BB, "missed case", "bb-samples-one-row-past-the-prompt",
        "k = min(n, max(0, c + n - (req.num_tokens - 1)))",
        "k = 1 if c + n >= req.num_prompt_tokens else 0",
        "one sample row once a span reaches the prompt's end: no drafts, and a resumed re-prefill samples early",
        ("sample",)),
    bug(BB, "off-by-one", "bb-sample-count-misses-last-token",
        "k = min(n, max(0, c + n - (req.num_tokens - 1)))",
        "k = min(n, max(0, c + n - req.num_tokens))",
        "the chunk that reaches the last known token samples nothing", ("sample",)),
    bug(BB, "off-by-one", "bb-sample-rows-one-early",
        "        sample_rows += range(start + n - k, start + n)",
        "        sample_rows += range(start + n - k - 1, start + n - 1)",
        "sample rows are taken one row before the end of the span", ("sample",)),
    bug(BB, "wrong formula", "bb-max-seq-len-summed",
        "max_seq_len=max(seq_lens, default=0),", "max_seq_len=sum(seq_lens),",
        "max_seq_len is the sum of the contexts instead of the largest", ("max_seq_len",)),
    bug(BB, "wrong formula", "bb-max-query-len-is-all-rows",
        "max_query_len=max((b - a for a, b in zip(query_start_loc, query_start_loc[1:])), default=0),",
        "max_query_len=len(input_ids),",
        "max_query_len is the number of rows in the batch, not the largest span", ("max_query_len", "decode_only")),
    bug(BB, "wrong field", "bb-tables-padded-with-minus-one",
        "t + [0] * (width - len(t))", "t + [-1] * (width - len(t))",
        "block tables are padded with -1 instead of 0", ("pad", "table")),
    bug(BB, "wrong field", "bb-dummy-seq-len-one",
        "            seq_lens.append(0)\n", "            seq_lens.append(1)\n",
        "padding requests get seq_len 1, so attention treats them as real", ("seq_len", "padding")),
    bug(BB, "wrong field", "bb-dummy-slot-zero",
        "            slots.append(PAD_SLOT)\n", "            slots.append(0)\n",
        "padding rows write block 0's first slot", ("pad_slot", "padding")),
    bug(BB, "off-by-one", "bb-pad-to-counts-dummies-only",
        "        for _ in range(pad_to - len(scheduled)):", "        for _ in range(pad_to):",
        "pad_to dummies are added on top of the real requests", ("pad",)),
    bug(BB, "wrong field", "bb-dummy-samples-a-row",
        "            sample_counts.append(0)\n", "            sample_counts.append(1)\n",
        "a padding request is given a sample row", ("sample", "padding")),
    bug(BB, "wrong field", "bb-prompt-rows-by-position",
        "                prompt_rows.extend(range(start, start + end - c))",
        "                prompt_rows.extend(range(c, end))",
        "prompt-logprob rows are given as positions c .. end-1 instead of batch rows", ("prompt",)),
    bug(BB, "off-by-one", "bb-prompt-targets-are-the-rows-own-tokens",
        "req.prompt_token_ids[c + 1:end + 1]", "req.prompt_token_ids[c:end]",
        "each prompt-logprob row scores its own token instead of the next one", ("prompt", "predict")),
    bug(BB, "wrong order", "bb-prompt-rows-first",
        "logits_indices=torch.tensor(sample_rows + prompt_rows,", "logits_indices=torch.tensor(prompt_rows + sample_rows,",
        "prompt-logprob rows come before the sample rows in logits_indices", ("sample rows", "prompt")),
    bug(BB, "missed case", "bb-no-check-for-missing-tokens",
        "        if len(tokens) < n:\n            raise ValueError(",
        "        if False:\n            raise ValueError(",
        "scheduling more tokens than the request has is not rejected", ("ValueError",)),
    bug(BB, "wrong container", "bb-mapping-taken-as-dict-only",
        "    by_id = isinstance(block_tables, Mapping)\n", "    by_id = isinstance(block_tables, dict)\n",
        "block_tables given as a Mapping other than a dict is indexed by position", ("mapping",)),
    bug(BB, "wrong formula", "bb-slots-of-span-offsets",
        "slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]",
        "slots += [table[p // block_size] * block_size + p % block_size for p in range(n)]",
        "slots are computed for positions 0 .. n-1 instead of c .. c+n-1", ("slot",)),
    bug(BB, "wrong field", "bb-seq-len-of-all-known-tokens",
        "        seq_lens.append(c + n)\n", "        seq_lens.append(req.num_tokens)\n",
        "seq_len is every known token, not the context after this step (c + n)", ("seq_len",)),
    bug(BB, "wrong field", "bb-slot-mapping-int32",
        "slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),",
        "slot_mapping=torch.tensor(slots, dtype=torch.int32, device=device),",
        "slot_mapping is int32 instead of int64", ("int64", "dtype")),
    # ===== write_kv =============================================================================
    bug(WK, "off-by-one", "wk-scratch-first-slot",
        "scratch_slot = k_cache.shape[0] * k_cache.shape[1] - 1",
        "scratch_slot = (k_cache.shape[0] - 1) * k_cache.shape[1]",
        "padding goes to the scratch block's FIRST slot, not the pool's very last", ("last slot", "scratch", "padding")),
    bug(WK, "missed case", "wk-slot-zero-taken-for-padding",
        "masked_fill(slot_mapping < 0, scratch_slot)", "masked_fill(slot_mapping <= 0, scratch_slot)",
        "a real row for slot 0 (block 0, offset 0) is sent to the scratch slot", ("slot 0", "block 0", "scratch")),
    bug(WK, "missed case", "wk-padding-rows-dropped",
        "    slots = slot_mapping.masked_fill(slot_mapping < 0, scratch_slot)\n",
        "    keep = slot_mapping >= 0\n    slots, k, v = slot_mapping[keep], k[keep], v[keep]\n",
        "padding rows are dropped instead of written to the scratch slot", ("padding", "last slot")),
    bug(WK, "state not reset", "wk-writes-into-a-copy",
        "        flat = pool.view(-1, *pool.shape[2:])", "        flat = pool.view(-1, *pool.shape[2:]).clone()",
        "the rows are scattered into a copy of the pool, which is then thrown away", ("slot",)),
    bug(WK, "wrong order", "wk-k-and-v-swapped",
        "for pool, rows in ((k_cache, k), (v_cache, v)):", "for pool, rows in ((k_cache, v), (v_cache, k)):",
        "K goes to the V pool and V to the K pool", ("v_pool", "k_pool", "slot")),
    bug(WK, "wrong formula", "wk-reshape-instead-of-view",
        "        flat = pool.view(-1, *pool.shape[2:])", "        flat = pool.reshape(-1, *pool.shape[2:])",
        "reshape instead of view", (),
        equivalent="a pool is contiguous, so reshape returns a view of it and the write still lands in place"),
    # ===== ReferenceBackend.forward =============================================================
    bug(RF, "wrong formula", "rf-slot-without-block-size",
        "slots = tables[r, pos // bs].long() * bs + pos % bs  # [L]",
        "slots = tables[r, pos // bs].long() + pos % bs  # [L]",
        "a position's slot is block number + offset (the block number is not scaled by block_size)", ("slot",)),
    bug(RF, "missed case", "rf-padding-attended",
        "            if seq_len == 0 or end == start:", "            if end == start:",
        "padding requests (seq_len 0) are attended over an empty context", ("padding", "seq_len 0")),
    bug(RF, "off-by-one", "rf-queries-one-position-early",
        "q_pos = k_pos[seq_len - (end - start):]", "q_pos = k_pos[seq_len - (end - start) - 1:-1]",
        "each query is placed one position early, so it does not see its own key", ("position", "last")),
    bug(RF, "wrong field", "rf-first-requests-table",
        "slots = tables[r, pos // bs].long() * bs + pos % bs  # [L]",
        "slots = tables[0, pos // bs].long() * bs + pos % bs  # [L]",
        "every request reads its K/V through request 0's block table", ("request", "table")),
    bug(RF, "state not reset", "rf-output-starts-as-q",
        "        out = torch.zeros_like(q)\n", "        out = q.clone()\n",
        "the output starts as a copy of q, so padding rows are not zero", ("padding", "zero")),
    bug(RF, "wrong field", "rf-context-is-this-steps-rows",
        "            seq_len = int(meta.seq_lens_cpu[r])\n", "            seq_len = end - start\n",
        "the context is only this step's rows: earlier K/V is never read", ("context", "last")),
    bug(RF, "wrong field", "rf-values-read-from-k-pool",
        "k_flat[slots], v_flat[slots], q_pos", "k_flat[slots], k_flat[slots], q_pos",
        "values are read from the K pool", ("value", "v_pool")),
    bug(RF, "missed case", "rf-scale-dropped",
        "                                              scale=scale, window=window)",
        "                                              window=window)",
        "the caller's scale is ignored (the default 1/sqrt(D) is used)", ("scale",)),
    bug(RF, "missed case", "rf-window-off-for-decodes",
        "scale=scale, window=window)", "scale=scale, window=window if end - start > 1 else 0)",
        "the sliding window is applied to prefill rows only, not to a decode's single row", ("window",)),
    # ===== FlatModel.attention ==================================================================
    bug(FA, "wrong order", "fa-heads-interleaved",
        "return attn.o_proj(o.reshape(x.shape[0], -1))", "return attn.o_proj(o.transpose(1, 2).reshape(x.shape[0], -1))",
        "the output's heads and head dims are interleaved before o_proj", ("o_proj",)),
    bug(FA, "wrong order", "fa-kv-swapped-on-write",
        "backend.write(kv_cache, k, v, meta)", "backend.write(kv_cache, v, k, meta)",
        "K and V are handed to the backend's write the wrong way round", ("pool", "v")),
    bug(FA, "wrong order", "fa-cos-sin-swapped",
        "q, k, v = attn.qkv(x, cos, sin)", "q, k, v = attn.qkv(x, sin, cos)",
        "cos and sin are passed to qkv the wrong way round", ("rope",)),
    bug(FA, "missed case", "fa-scale-left-to-default",
        "o = backend.forward(q, kv_cache, meta, scale=attn.scale, window=self.cfg.sliding_window)",
        "o = backend.forward(q, kv_cache, meta, window=self.cfg.sliding_window)",
        "attn.scale is not passed to the backend", ("scale",),
        equivalent="every Qwen3 layer's attn.scale is head_dim ** -0.5, causal_attention's default scale"),
    # ===== FlatModel.forward ====================================================================
    bug(FF, "wrong field", "ff-rope-tables-in-float32",
        "rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, hidden.dtype)",
        "rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, torch.float32)",
        "the RoPE tables are built in float32 whatever the model's dtype", ("rope", "dtype")),
    bug(FF, "wrong field", "ff-rope-theta-default",
        "rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, hidden.dtype)",
        "rope_cos_sin(positions, self.cfg.head_dim, 10000.0, hidden.dtype)",
        "RoPE uses the textbook theta 10,000 instead of the model's rope_theta", ("rope",)),
    bug(FF, "wrong field", "ff-returns-unnormed-sum",
        "        out, _ = add_norm(hidden, residual, m.norm)\n", "        _, out = add_norm(hidden, residual, m.norm)\n",
        "forward returns hidden + residual before the final norm", ("norm",)),
    bug(FF, "off-by-one", "ff-pools-shifted-by-one-layer",
        "            return self.attention(attn, x, cos, sin, kv_caches[i], meta, backend)",
        "            return self.attention(attn, x, cos, sin, kv_caches[i - 1], meta, backend)",
        "layer i keeps its K/V in pool i - 1", ("pool", "layer"),
        equivalent="a fixed permutation of the layers' pools: each layer still reads back exactly what it wrote, "
                   "and every pool has the same shape"),
    bug(FF, "wrong order", "ff-norm-before-residual-add",
        "        out, _ = add_norm(hidden, residual, m.norm)\n", "        out = m.norm(hidden) + residual\n",
        "the final norm is applied before the last residual add", ("norm", "residual")),
    bug(FF, "wrong field", "ff-embeds-positions",
        "        hidden = m.embed_tokens(input_ids)  # [N, D]", "        hidden = m.embed_tokens(positions)  # [N, D]",
        "the rows' positions are embedded instead of their token ids", ("embed", "token")),
    # ===== hash_block ===========================================================================
    bug(HB, "wrong order", "hb-byteswap-on-little-endian",
        '    if sys.byteorder == "big":', '    if sys.byteorder == "little":',
        "tokens are byte-swapped on little-endian machines (packed big-endian)", ("little-endian",)),
    bug(HB, "wrong field", "hb-64-byte-digest",
        "    h = hashlib.blake2b(digest_size=16)\n", "    h = hashlib.blake2b()\n",
        "the digest is BLAKE2b's default 64 bytes, not 16", ("16-byte", "blake2b")),
    bug(HB, "wrong field", "hb-sha256",
        "    h = hashlib.blake2b(digest_size=16)\n", "    h = hashlib.sha256()\n",
        "SHA-256 instead of 16-byte BLAKE2b", ("blake2b",)),
    bug(HB, "missed case", "hb-empty-extra-hashed",
        "    if extra:\n", "    if extra is not None:\n",
        "an empty cache key is hashed too, so every digest carries the separator", ("extra", "blake2b")),
    bug(HB, "wrong field", "hb-tokens-as-text",
        "    h.update(packed.tobytes())\n", "    h.update(str(list(tokens)).encode())\n",
        "the tokens are hashed as their printed list, not as little-endian int64", ("int64", "little-endian")),
    bug(HB, "wrong formula", "hb-parent-or-root",
        "h.update(ROOT_HASH if parent is None else parent)", "h.update(parent or ROOT_HASH)",
        "`parent or ROOT_HASH` instead of testing for None", (),
        equivalent="a parent digest is 16 bytes, never empty, so `or` picks exactly what `is None` does"),

    bug(HB, "wrong field", "hb-key-by-repr",
        "        h.update(encode_cache_key(extra))\n", "        h.update(repr(extra).encode())\n",
        "the cache key is hashed through its repr(), which a str subclass (or a truncated array) can fake",
        ("repr", "encode_cache_key")),
    bug(HB, "wrong field", "hb-hex-digest",
        "    return h.digest()", "    return h.hexdigest().encode()",
        "the digest is returned as 32 hex characters instead of 16 raw bytes", ("16-byte", "bytes")),
    # ===== BlockManager.find_cached_prefix ======================================================
    bug(FCP, "off-by-one", "fcp-limit-one-block-short",
        "limit = min((request.num_tokens - 1) // self.block_size, len(hashes))",
        "limit = min(request.num_tokens // self.block_size - 1, len(hashes))",
        "the last FULL block is never matched, even when the last token lies beyond it", ("last token", "block")),
    bug(FCP, "counter", "fcp-short-request-not-counted",
        "        matched = 0\n", "        if limit == 0:\n            return []  # too short to match a block\n        matched = 0\n",
        "a request too short to match any block returns before its lookup is counted",
        ("quer", "record_lookup", "num_queries")),
    bug(FCP, "wrong field", "fcp-checks-pool-block-at-index",
        "while matched < limit and hashes[matched] in self.cached:",
        "while matched < limit and self.block_hash[matched] == hashes[matched]:",
        "block i's hash is looked for in POOL block i instead of the cache", ("cache", "match")),
    bug(FCP, "missed case", "fcp-limit-without-hashes-bound",
        "limit = min((request.num_tokens - 1) // self.block_size, len(hashes))",
        "limit = (request.num_tokens - 1) // self.block_size",
        "the walk is not bounded by the number of hashes", (),
        equivalent="update_hashes just gave every full block a hash and a waiting request has no speculative "
                   "placeholders, so len(hashes) >= (num_tokens - 1) // block_size"),
    bug(FCP, "off-by-one", "fcp-hits-one-token-short",
        "self.record_lookup(request, matched * self.block_size)",
        "self.record_lookup(request, max(0, matched * self.block_size - 1))",
        "hits leave out one token, as if the last matched token had to be computed", ("hit",)),
    # ===== BlockManager.allocate_slots ==========================================================
    bug(AS, "missed case", "as-total-ignores-computed",
        "total = request.num_computed_tokens + len(cached_blocks) * self.block_size + n",
        "total = len(cached_blocks) * self.block_size + n",
        "the table is sized for n tokens, forgetting the ones already computed", ("block",)),
    bug(AS, "wrong formula", "as-adopted-counted-twice",
        "num_new = max(0, self.blocks_for(total) - len(table) - len(cached_blocks))",
        "num_new = max(0, self.blocks_for(total) - len(table))",
        "adopted blocks are not subtracted: as many new blocks are taken on top", ("block", "fits")),
    bug(AS, "off-by-one", "as-exact-fit-refused",
        "if num_new + len(reclaimed) > self.num_free:", "if num_new + len(reclaimed) >= self.num_free:",
        "an allocation that uses the last free block is refused", ("fit", "free")),
    bug(AS, "missed case", "as-in-use-adopted-blocks-reclaimed",
        "reclaimed = [b for b in cached_blocks if self.ref_count[b] == 0]", "reclaimed = list(cached_blocks)",
        "adopted blocks still in use are taken out of the free queue too", ("free",)),
    bug(AS, "counter", "as-adopted-ref-count-not-raised",
        "        gained = [*cached_blocks, *fresh]\n        for b in gained:\n",
        "        gained = [*cached_blocks, *fresh]\n        for b in fresh:\n",
        "an adopted block's ref_count is not raised", ("ref_count",)),
    bug(AS, "wrong order", "as-new-blocks-before-adopted",
        "gained = [*cached_blocks, *fresh]", "gained = [*fresh, *cached_blocks]",
        "new blocks come before the adopted ones in the table", ("first", "adopt")),
    bug(AS, "failure path", "as-failed-allocation-drops-lookup",
        "        if num_new + len(reclaimed) > self.num_free:\n            return False\n"
        "        self.pending_lookups.pop(rid, None)  # admitted: its lookup stays counted\n",
        "        self.pending_lookups.pop(rid, None)\n"
        "        if num_new + len(reclaimed) > self.num_free:\n            return False\n",
        "a failed allocation drops the pending lookup, so the retry counts it again", ("pending", "lookup")),
    bug(AS, "failure path", "as-failed-allocation-leaves-table",
        "        if num_new + len(reclaimed) > self.num_free:\n            return False\n",
        "        self.req_blocks.setdefault(rid, table)\n"
        "        if num_new + len(reclaimed) > self.num_free:\n            return False\n",
        "a failed first allocation leaves an empty req_blocks entry", ("req_blocks", "change nothing")),
    bug(AS, "state not reset", "as-num-published-reset-on-growth",
        "        if cached_blocks or rid not in self.num_published:\n"
        "            self.num_published[rid] = len(cached_blocks)",
        "        if True:\n            self.num_published[rid] = len(cached_blocks)",
        "every allocation resets num_published, not only the first", ("num_published",)),
    bug(AS, "counter", "as-reuse-not-counted-as-eviction",
        "            self._evict(b)  # its old content is about to be overwritten\n",
        "            self._forget_hash(b)  # its old content is about to be overwritten\n",
        "a reused block's hash is dropped without counting it in num_evicted", ("num_evicted", "evict")),
    bug(AS, "missed case", "as-reuse-clears-hash-only",
        "            self._evict(b)  # its old content is about to be overwritten\n",
        "            self.block_hash[b] = None  # its old content is about to be overwritten\n",
        "a reused block loses its hash but the cached entry still names it", ("hash", "cached")),
    bug(AS, "wrong order", "as-lowest-numbered-blocks-first",
        "fresh = list(itertools.islice(self.free_queue, num_new))", "fresh = sorted(self.free_queue)[:num_new]",
        "new blocks are the lowest-numbered free ones, not the queue's front", ("front", "queue")),
    bug(AS, "missed case", "as-fast-path-for-any-zero",
        "        if num_new == 0 and not cached_blocks and table:\n", "        if num_new == 0:\n",
        "returns True before the bookkeeping whenever no new block is needed", (),
        equivalent="num_new is 0 only for a request that already holds blocks: n >= 1 tokens after an adopted "
                   "prefix always need a block past it"),
    bug(AS, "state not reset", "as-fresh-blocks-left-in-free-queue",
        "            del self.free_queue[b]\n            self._evict(b)",
        "            self._evict(b)",
        "new blocks are handed out but stay in the free queue", ("free", "queue")),
    # ===== BlockManager.cache_full_blocks =======================================================
    bug(CFB, "missed case", "cfb-publishes-with-caching-off",
        "        if not self.enable_prefix_caching:\n            return\n        rid = request.request_id\n"
        "        table = self.req_blocks.get(rid)\n",
        "        rid = request.request_id\n        table = self.req_blocks.get(rid)\n",
        "blocks are entered in the cache although prefix caching is off", ("caching off", "prefix caching")),
    bug(CFB, "counter", "cfb-num-published-counts-calls",
        "        self.num_published[rid] = max(full, self.num_published.get(rid, 0))\n",
        "        self.num_published[rid] = self.num_published.get(rid, 0) + 1\n",
        "num_published counts calls (one more per call) instead of being raised to the full blocks",
        ("num_published",)),
    bug(CFB, "state not reset", "cfb-starts-from-the-first-block",
        "        for i in range(self.num_published.get(rid, 0), full):\n", "        for i in range(full):\n",
        "every call offers all full blocks again instead of starting at num_published", ("num_published",)),
    bug(CFB, "off-by-one", "cfb-early-return-strict",
        "if num_tokens // self.block_size <= self.num_published.get(rid, 0):",
        "if num_tokens // self.block_size < self.num_published.get(rid, 0):",
        "the early return misses the case of no newly full block", (),
        equivalent="when equal, range(num_published, full) is empty anyway and num_published stays"),
    bug(CFB, "wrong field", "cfb-default-all-tokens",
        "            num_tokens = request.num_computed_tokens\n", "            num_tokens = request.num_tokens\n",
        "by default the blocks of all known tokens are published, computed or not", ("computed",)),
    bug(CFB, "missed case", "cfb-block-hash-not-set",
        "                self.cached[h] = b\n                self.block_hash[b] = h\n",
        "                self.cached[h] = b\n",
        "a published block's block_hash is not set", ("block_hash",)),
    bug(CFB, "missed case", "cfb-only-cache-checked",
        "if h not in self.cached and self.block_hash[b] is None:", "if h not in self.cached:",
        "a block that already has a hash could be entered again", (),
        equivalent="a block in a request's table has no hash (fresh blocks are evicted when handed out) or its "
                   "position's own hash, which is then cached; the second condition never decides"),
    # ===== BlockManager.free ====================================================================
    bug(FR, "state not reset", "fr-pending-lookup-kept",
        "        self.pending_lookups.pop(request.request_id, None)\n        self._release(", "        self._release(",
        "free() keeps the request's pending_lookups entry", ("pending_lookups",)),
    bug(FR, "wrong order", "fr-released-by-block-number",
        "self._release(reversed(table))", "self._release(sorted(table, reverse=True))",
        "freed blocks join the queue highest-numbered first, not in reverse table order", ("tail first", "reverse")),
    bug(FR, "failure path", "fr-no-double-free-check",
        "        self._release(reversed(table))\n",
        "        for b in reversed(table):\n            self.ref_count[b] -= 1\n"
        "            if self.ref_count[b] == 0:\n                self.free_queue[b] = None\n",
        "freeing a block twice is not an error (ref_count goes negative)", ("runtimeerror", "twice")),
    bug(FR, "state not reset", "fr-table-entry-kept",
        "        table = self.req_blocks.pop(request.request_id, [])\n",
        "        table = self.req_blocks.get(request.request_id, [])\n",
        "free() keeps the request's req_blocks entry", ("req_blocks",)),
    bug(FR, "wrong order", "fr-freed-to-the-front",
        "        self._release(reversed(table))\n",
        "        self._release(reversed(table))\n        for b in table:\n"
        "            if self.ref_count[b] == 0:\n                self.free_queue.move_to_end(b, last=False)\n",
        "freed blocks join the FRONT of the queue, so the cache is evicted first", ("back", "queue")),
    bug(FR, "state not reset", "fr-num-published-zeroed",
        "        self.num_published.pop(request.request_id, None)\n", "        self.num_published[request.request_id] = 0\n",
        "free() sets num_published to 0 instead of dropping the entry", ("num_published",)),
    # ===== Scheduler.schedule ===================================================================
    bug(SCH, "counter", "sch-running-not-charged",
        "            out.scheduled.append((req, n))\n            budget -= n\n            i += 1\n",
        "            out.scheduled.append((req, n))\n            i += 1\n",
        "running requests' tokens are not taken from the budget", ("budget",)),
    bug(SCH, "wrong order", "sch-self-preemption-continues",
        "            if not fits:\n                break  # it preempted itself",
        "            if not fits:\n                i += 1\n                continue  # it preempted itself",
        "after a request preempts itself the loop goes on", (),
        equivalent="a request preempts itself only once everything ranked after it is gone, so no running "
                   "request is left to visit"),
    bug(SCH, "missed case", "sch-stops-at-a-request-with-nothing-to-do",
        "            if n == 0:\n                i += 1\n                continue\n",
        "            if n == 0:\n                break\n",
        "a running request with nothing to compute ends the running pass", ("n == 0", "skip")),
    bug(SCH, "missed case", "sch-admits-with-no-budget",
        "        while (not out.preempted and self.waiting and budget > 0\n",
        "        while (not out.preempted and self.waiting\n",
        "waiting requests are admitted after the budget is spent (with n = 0)", ("budget",)),
    bug(SCH, "wrong field", "sch-no-chunking-checks-whole-budget",
        "            if (not cfg.enable_chunked_prefill and need > budget\n",
        "            if (not cfg.enable_chunked_prefill and need > cfg.max_num_batched_tokens\n",
        "with chunking off, a prompt is compared with the whole budget, not what is left", ("budget", "left")),
    bug(SCH, "wrong formula", "sch-cached-count-in-blocks",
        "num_cached = len(cached) * self.blocks.block_size", "num_cached = len(cached)",
        "the cached prefix is counted in blocks, not tokens", ("cached",)),
    bug(SCH, "missed case", "sch-computed-not-advanced-past-cache",
        "            req.num_computed_tokens += num_cached\n", "",
        "an admitted request does not start after its cached prefix", ("cached", "computed")),
    bug(SCH, "wrong formula", "sch-need-includes-cache",
        "need = req.num_tokens_with_spec - req.num_computed_tokens - num_cached",
        "need = req.num_tokens_with_spec - req.num_computed_tokens",
        "the cached tokens are asked for again on top of the prefix", ("cached",)),
    bug(SCH, "off-by-one", "sch-swap-in-full-blocks-only",
        "num_saved = self.blocks.blocks_for(req.num_computed_tokens)",
        "num_saved = req.num_computed_tokens // self.blocks.block_size",
        "a swapped request's partly filled last block is not restored", ("swap", "block")),
    bug(SCH, "missed case", "sch-admission-ignores-budget",
        "            n = min(need, budget)\n", "            n = need\n",
        "an admitted prompt is not cut to the budget left", ("budget", "2,048")),
    bug(SCH, "wrong field", "sch-publishes-running-up-to-n",
        "            self.blocks.cache_full_blocks(req, req.num_computed_tokens + n)\n"
        "            out.scheduled.append((req, n))\n            budget -= n\n            i += 1\n",
        "            self.blocks.cache_full_blocks(req, n)\n"
        "            out.scheduled.append((req, n))\n            budget -= n\n            i += 1\n",
        "a running request's blocks are published up to n tokens, not num_computed_tokens + n", ("publish", "share")),
    bug(SCH, "failure path", "sch-status-set-before-allocation",
        "            if not self.blocks.allocate_slots(req, n, cached):\n                break\n"
        "            del self.waiting[0]\n            req.status = Status.RUNNING\n",
        "            req.status = Status.RUNNING\n"
        "            if not self.blocks.allocate_slots(req, n, cached):\n                break\n"
        "            del self.waiting[0]\n",
        "a request that fails to fit is left marked RUNNING in the waiting queue", ("status", "running")),
    bug(SCH, "missed case", "sch-allocation-after-self-preemption",
        "                fits = req.status is Status.RUNNING and self.blocks.allocate_slots(req, n)\n",
        "                fits = self.blocks.allocate_slots(req, n)\n",
        "after preempting itself a request is allocated (and scheduled) anyway", ("preempt",)),
    bug(SCH, "missed case", "sch-swapped-request-looked-up",
        "if not req.swapped_out and req.num_computed_tokens == 0:", "if req.num_computed_tokens == 0:",
        "the swapped_out test is dropped from the lookup", (),
        equivalent="a request is swapped out only when it has computed tokens, so num_computed_tokens == 0 already "
                   "excludes it"),
    bug(SCH, "missed case", "sch-running-pass-ignores-budget",
        "        while i < len(self.running) and budget > 0:\n", "        while i < len(self.running):\n",
        "the running pass goes on after the budget is spent", (),
        equivalent="with no budget left n = min(..., budget) is 0, and n == 0 is skipped"),
    bug(SCH, "wrong order", "sch-readmission-status-after-insert",
        "            req.status = Status.RUNNING\n            self._insert_sorted(self.running, req)\n",
        "            self._insert_sorted(self.running, req)\n            req.status = Status.RUNNING\n",
        "status set after the insert", (),
        equivalent="nothing reads the status between the two statements"),
    bug(SCH, "wrong field", "sch-cap-applied-without-chunking",
        "            if cfg.enable_chunked_prefill and cfg.long_prefill_token_threshold > 0:\n"
        "                n = min(n, cfg.long_prefill_token_threshold)\n            if not self.blocks",
        "            if cfg.long_prefill_token_threshold > 0:\n"
        "                n = min(n, cfg.long_prefill_token_threshold)\n            if not self.blocks",
        "the chunk cap applies at admission even with chunked prefill off", ("chunk",)),
    bug(SCH, "counter", "sch-admission-charged-what-it-needs",
        "            out.scheduled.append((req, n))\n            budget -= n\n        return out\n",
        "            out.scheduled.append((req, n))\n            budget -= need\n        return out\n",
        "an admitted request is charged all it needs, not the n it got (a capped chunk uses up the budget)",
        ("budget",)),
    bug(SCH, "wrong order", "sch-running-served-newest-first",
        "            req = self.running[i]\n", "            req = self.running[-1 - i]\n",
        "running requests are served from the newest (the end of running) first", ("rank", "order")),
    # ===== Scheduler._preempt ===================================================================
    bug(PRE, "counter", "pre-scheduler-count-of-the-list",
        "        self.num_preemptions += 1\n", "        self.num_preemptions += len(out.preempted)\n",
        "the scheduler's count grows by the step's earlier victims (0 for the first), not by one",
        ("num_preemptions", "preemptions")),
    bug(PRE, "wrong field", "pre-swap-lists-the-whole-table",
        "out.swap_out.append((request, held[:self.blocks.blocks_for(request.num_computed_tokens)]))",
        "out.swap_out.append((request, list(held)))",
        "swap_out lists every block the victim holds, not those of its computed tokens", ("swap",),
        equivalent="a victim ranks after the request that needs room, so it was not scheduled this step and its "
                   "table covers exactly its computed tokens"),
    bug(PRE, "wrong order", "pre-priority-requeued-at-front",
        "        if self.config.policy == \"priority\":\n            self._insert_sorted(self.waiting, request)\n"
        "        else:\n            self.waiting.insert(0, request)",
        "        self.waiting.insert(0, request)",
        "under the priority policy the victim goes to the front instead of its (priority, arrival) place",
        ("priority",)),
    bug(PRE, "wrong order", "pre-fcfs-requeued-by-arrival",
        "        if self.config.policy == \"priority\":\n            self._insert_sorted(self.waiting, request)\n"
        "        else:\n            self.waiting.insert(0, request)",
        "        self._insert_sorted(self.waiting, request)",
        "under fcfs the victim is inserted at its arrival place, not at the front", ("front",)),
    bug(PRE, "wrong order", "pre-freed-before-listing-swap",
        "        self.running.remove(request)\n        keep_kv =",
        "        self.running.remove(request)\n        self.blocks.free(request)\n        keep_kv =",
        "the blocks are freed before the swap-out list is taken, so it is empty", ("swap",)),
    bug(PRE, "wrong field", "pre-status-waiting",
        "        request.status = Status.PREEMPTED\n", "        request.status = Status.WAITING\n",
        "a preempted request is marked WAITING instead of PREEMPTED", ("preempted",)),
    bug(PRE, "missed case", "pre-not-listed-as-preempted",
        "        out.preempted.append(request)\n", "",
        "the victim is not listed in out.preempted", ("preempted",)),
    bug(PRE, "state not reset", "pre-swapped-flag-not-set",
        "        request.swapped_out = keep_kv\n", "        request.swapped_out = False\n",
        "a swapped-out request is not marked swapped_out", ("swapped_out",)),
    bug(PRE, "state not reset", "pre-flag-set-only-on-swap",
        "        request.swapped_out = keep_kv\n",
        "        if keep_kv:\n            request.swapped_out = True\n",
        "swapped_out is set under swap but never cleared under recompute", (),
        equivalent="a running request is never swapped_out (readmission clears it), so under recompute it is "
                   "False already"),
    bug(PRE, "wrong formula", "pre-pops-the-last-running",
        "        self.running.remove(request)\n        keep_kv", "        self.running.pop()\n        keep_kv",
        "the last running request is removed instead of the victim itself", (),
        equivalent="the scheduler's victim is always running[-1] (the newest, or the lowest priority)"),
    # ===== second round (issue 39): the learner's own bugs that once escaped every test =============
    bug(BB, "wrong field", "bb-positions-int32",
        "positions=torch.tensor(positions, dtype=torch.int64, device=device),",
        "positions=torch.tensor(positions, dtype=torch.int32, device=device),",
        "positions are int32 instead of int64", ("int64", "positions")),
    bug(FCP, "wrong field", "fcp-cap-counts-only-the-prompt",
        "limit = min((request.num_tokens - 1) // self.block_size, len(hashes))",
        "limit = min((request.num_prompt_tokens - 1) // self.block_size, len(hashes))",
        "the match's cap counts only the prompt, so a readmitted request cannot adopt blocks of its outputs",
        ("outputs", "num_tokens")),
    bug(FCP, "wrong order", "fcp-hashes-updated-with-caching-off",
        "        if wants_prompt_logprobs or not self.enable_prefix_caching:\n            return []\n"
        "        self.update_hashes(request)\n",
        "        self.update_hashes(request)\n"
        "        if wants_prompt_logprobs or not self.enable_prefix_caching:\n            return []\n",
        "the hashes are brought up to date before the early return for caching off", ("update_hashes", "BEFORE")),
    bug(AS, "counter", "as-held-adopted-block-not-counted",
        "        gained = [*cached_blocks, *fresh]\n        for b in gained:\n            self.ref_count[b] += 1\n",
        "        for b in [*reclaimed, *fresh]:\n            self.ref_count[b] += 1\n"
        "        gained = [*cached_blocks, *fresh]\n",
        "adopting a block another request holds does not raise its ref count", ("ref_count", "shared")),
    bug(SCH, "off-by-one", "sch-admission-stops-at-one-token-left",
        "        while (not out.preempted and self.waiting and budget > 0\n",
        "        while (not out.preempted and self.waiting and budget > 1\n",
        "admission stops when one token of budget is left", ("budget > 0", "one token")),
    bug(SCH, "counter", "sch-cached-tokens-charged-to-budget",
        "            out.scheduled.append((req, n))\n            budget -= n\n        return out\n",
        "            out.scheduled.append((req, n))\n            budget -= n + num_cached\n        return out\n",
        "an admission is charged its cached tokens too", ("cached", "budget")),
    bug(SCH, "wrong field", "sch-whole-budget-rule-on-num-tokens",
        "                    and need <= cfg.max_num_batched_tokens):",
        "                    and req.num_tokens <= cfg.max_num_batched_tokens):",
        "with chunking off, the 'exceeds the whole budget' rule looks at num_tokens, not at what is still needed",
        ("needs", "num_tokens")),
    bug(SCH, "off-by-one", "sch-no-chunking-exact-fit-waits",
        "            if (not cfg.enable_chunked_prefill and need > budget\n",
        "            if (not cfg.enable_chunked_prefill and need >= budget\n",
        "with chunking off, a prompt exactly the size of the budget left waits", ("exactly", "MORE")),
    bug(SCH, "off-by-one", "sch-whole-budget-equal-counts-as-exceeding",
        "                    and need <= cfg.max_num_batched_tokens):",
        "                    and need < cfg.max_num_batched_tokens):",
        "with chunking off, a need equal to the whole budget counts as exceeding it (runs in pieces)",
        ("whole budget", "pieces")),
    bug(PRE, "wrong order", "pre-priority-requeued-behind-its-priority",
        "        out.preempted.append(request)\n        if self.config.policy == \"priority\":\n"
        "            self._insert_sorted(self.waiting, request)\n",
        "        out.preempted.append(request)\n        if self.config.policy == \"priority\":\n"
        "            self.waiting.append(request)\n"
        "            self.waiting.sort(key=lambda r: r.priority)\n",
        "under the priority policy the victim is requeued behind later arrivals of its priority",
        ("arrival", "ahead")),
    bug(PRE, "off-by-one", "pre-swap-out-full-blocks-only",
        "held[:self.blocks.blocks_for(request.num_computed_tokens)]",
        "held[:request.num_computed_tokens // self.blocks.block_size]",
        "a swap-out saves only the full blocks, losing the partly filled last one", ("partly filled", "block")),
    # ===== EngineCore.check_stop ================================================================
    bug(CS, "wrong field", "cs-min-tokens-counts-the-prompt",
        "        if num_output >= p.min_tokens:\n", "        if request.num_tokens >= p.min_tokens:\n",
        "min_tokens is compared with all tokens, prompt included", ("min_tokens",)),
    bug(CS, "missed case", "cs-stop-tokens-need-an-eos",
        "            if last in p.stop_token_ids:\n",
        "            if request.eos_token_id is not None and last in p.stop_token_ids:\n",
        "stop_token_ids are honoured only for a model with an EOS token", ("stop_token_ids", "stop")),
    bug(CS, "wrong field", "cs-eos-sets-stop-reason",
        "            if not p.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:\n"
        "                return Status.FINISHED_STOPPED\n",
        "            if not p.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:\n"
        "                request.stop_reason = last\n                return Status.FINISHED_STOPPED\n",
        "EOS sets stop_reason too", ("stop_reason",)),
    bug(CS, "wrong field", "cs-eos-of-the-engine",
        "last == request.eos_token_id:", "last == self.eos_token_id:",
        "the engine's eos_token_id is used instead of the request's", ("eos",)),
    bug(CS, "off-by-one", "cs-context-limit-strict",
        "request.num_tokens >= self.max_model_len", "request.num_tokens > self.max_model_len",
        "a request may reach max_model_len + 1 tokens", ("max_model_len", "context")),
    bug(CS, "wrong field", "cs-max-tokens-counts-prompt",
        "if num_output >= p.max_tokens or", "if request.num_tokens >= p.max_tokens or",
        "max_tokens is compared with all tokens, prompt included", ("max_tokens",)),
    bug(CS, "wrong field", "cs-any-stop-token-so-far",
        "            if last in p.stop_token_ids:\n",
        "            if any(t in p.stop_token_ids for t in request.output_token_ids):\n",
        "any stop token in the output stops the request, not only the last token", ("last token", "stop")),
    bug(CS, "missed case", "cs-no-guard-for-no-output",
        "        if num_output == 0:\n            return None\n", "",
        "with no output yet, the prompt's last token is checked", (),
        equivalent="step calls check_stop only for a request that just got a token"),
    bug(CS, "missed case", "cs-no-none-guard-for-eos",
        "request.eos_token_id is not None and last == request.eos_token_id", "last == request.eos_token_id",
        "no None check before comparing with eos_token_id", (),
        equivalent="a token id is an int and never equals None"),
    bug(CS, "wrong field", "cs-stop-reason-not-set",
        "                request.stop_reason = last\n", "",
        "a stop token ends the request without setting stop_reason", ("stop_reason",)),
    bug(CS, "off-by-one", "cs-output-count-off-by-one",
        "        num_output = request.num_output_tokens\n", "        num_output = len(request.output_token_ids) - 1\n",
        "the output count leaves out the token just sampled", ("max_tokens", "min_tokens")),
    # ===== EngineCore.step ======================================================================
    bug(ST, "failure path", "st-recovers-from-oom-only",
        "        except BaseException:  # out of memory", "        except torch.OutOfMemoryError:  # out of memory",
        "only an out-of-memory error is recovered from; any other failure (or Ctrl-C) skips recover_failed_step",
        ("recover_failed_step", "baseexception", "recover")),
    bug(ST, "counter", "st-failed-step-counted",
        "            batch = self.runner.prepare(plan.scheduled, self.blocks.req_blocks)  # tables looked up by id\n",
        "            self.steps += 1\n"
        "            batch = self.runner.prepare(plan.scheduled, self.blocks.req_blocks)  # tables looked up by id\n",
        "the step is counted before the forward pass, so a failed one counts too (and every step twice)",
        ("steps",)),
    bug(ST, "wrong order", "st-swap-in-before-swap-out",
        "            for req, blocks in plan.swap_out:\n                self.runner.swap_out(req, blocks)\n"
        "            for req, blocks in plan.swap_in:\n                self.runner.swap_in(req, blocks)\n",
        "            for req, blocks in plan.swap_in:\n                self.runner.swap_in(req, blocks)\n"
        "            for req, blocks in plan.swap_out:\n                self.runner.swap_out(req, blocks)\n",
        "swap-ins are done before swap-outs", (),
        equivalent="a step that preempted admits nobody, so no plan holds both a swap-out and a swap-in"),
    bug(ST, "wrong field", "st-prompt-logprobs-from-all-rows",
        "prompt_lp = self._prompt_logprobs(batch, logits[num_sample:])", "prompt_lp = self._prompt_logprobs(batch, logits)",
        "prompt logprobs are read from the logits' first rows (the sample rows) on", ("prompt", "logprob")),
    bug(ST, "off-by-one", "st-prompt-logprobs-cut-one-early",
        "req.prompt_logprobs = (req.prompt_logprobs or [])[:start] + ",
        "req.prompt_logprobs = (req.prompt_logprobs or [])[:max(0, start - 1)] + ",
        "the entries before this chunk are cut one short, dropping the previous chunk's last", ("prompt", "logprob")),
    bug(ST, "missed case", "st-finished-request-not-freed",
        "                self.scheduler.finish(req, status)\n", "                req.status = status\n",
        "a finished request is marked but not finished in the scheduler (blocks kept)", ("free", "finish")),
    bug(ST, "wrong field", "st-sample-requests-one-per-request",
        "sample_reqs = [req for (req, _), k in zip(plan.scheduled, batch.sample_counts) for _ in range(k)]",
        "sample_reqs = [req for req, _ in plan.scheduled]",
        "the sampler is given one request per scheduled request, not one per sample row", ("sample row", "reqs")),
    bug(ST, "missed case", "st-seeded-generators-not-passed",
        "tokens = self.sampler(logits[:num_sample], sample_reqs, self.generators)",
        "tokens = self.sampler(logits[:num_sample], sample_reqs, {})",
        "seeded requests sample from the engine's generator instead of their own", ("seed", "generator")),
    bug(ST, "missed case", "st-check-stop-for-every-request",
        "            status = self.check_stop(req) if new else None\n", "            status = self.check_stop(req)\n",
        "check_stop runs for a request that got no token too", (),
        equivalent="a request without a new token is in the state an earlier check_stop already passed"),
    bug(ST, "missed case", "st-no-publish-after-the-step",
        "            self.blocks.cache_full_blocks(req)\n", "",
        "the step does not publish the request's newly full blocks", (),
        equivalent="the scheduler already published up to num_computed_tokens + n at allocation, which is all the "
                   "step's call (num_computed_tokens by default) covers"),
    bug(ST, "missed case", "st-finished-without-token-not-reported",
        "            if new or status is not None:\n", "            if new:\n",
        "a request that finished is reported only if it also produced a token", (),
        equivalent="status is None for a request that got no token, so both conditions agree"),
    bug(ST, "wrong order", "st-stop-checked-before-publish",
        "            self.blocks.cache_full_blocks(req)\n            status = self.check_stop(req) if new else None\n"
        "            if status is not None:\n                self.scheduler.finish(req, status)\n",
        "            status = self.check_stop(req) if new else None\n            if status is not None:\n"
        "                self.scheduler.finish(req, status)\n            self.blocks.cache_full_blocks(req)\n",
        "blocks are published after a finished request was freed", (),
        equivalent="the scheduler already published the step's blocks at allocation, so the step's own call adds "
                   "nothing for a request that finishes"),
    bug(ST, "missed case", "st-token-not-appended",
        "            for t in new:\n                req.append(t)\n", "",
        "sampled tokens are reported but never appended to the request", ("append", "token")),
    bug(ST, "wrong field", "st-computed-advanced-by-one",
        "            req.num_computed_tokens += n\n", "            req.num_computed_tokens += 1\n",
        "num_computed_tokens advances by one per step instead of n", ("num_computed_tokens",)),
    bug(ST, "wrong field", "st-prompt-logprobs-when-not-asked",
        "            if req.params.prompt_logprobs is not None:  # a recompute's",
        "            if True:  # a recompute's",
        "every request gets a prompt_logprobs list, asked for or not", ("prompt_logprobs",)),
    bug(ST, "wrong field", "st-prompt-logprobs-looked-up-by-request",
        "prompt_lp.get(req.request_id, [])", "prompt_lp.get(req, [])",
        "this step's prompt-logprob entries are looked up by the request object, not its id", ("prompt", "logprob")),
]


# Held out: invented after the chapter tests above were strengthened against BUGS, and never used to
# write a test: a fresh walk-through's check that the tests were not fitted to the corpus. Not part
# of the rates the test asserts; `--held-out` runs them and the table reports them apart.
HELD_OUT: list[Bug] = [
    bug(BB, "off-by-one", "ho-bb-seq-len-plus-one",
        "        seq_lens.append(c + n)\n", "        seq_lens.append(c + n + 1)\n",
        "seq_len counts one token more than the context", ("seq_len",)),
    bug(RF, "off-by-one", "ho-rf-window-one-wider",
        "scale=scale, window=window)", "scale=scale, window=window + 1 if window else 0)",
        "the sliding window lets one key more through", ("window",)),
    bug(FA, "missed case", "ho-fa-no-o-proj",
        "return attn.o_proj(o.reshape(x.shape[0], -1))", "return o.reshape(x.shape[0], -1)",
        "the attention output is returned without o_proj", ("o_proj",)),
    bug(FCP, "state not reset", "ho-fcp-hashes-filled-once",
        "        self.update_hashes(request)\n        hashes = request.block_hashes\n",
        "        if not request.block_hashes:\n            self.update_hashes(request)\n        hashes = request.block_hashes\n",
        "block hashes are filled in only on the first lookup; a resumed request's newer blocks have none",
        ("update_hashes", "block_hashes")),
    bug(ST, "off-by-one", "ho-st-row-advances-by-one",
        "            row += k\n", "            row += 1\n",
        "the sample-row cursor advances by one per request, not by its sample count", ("sample",)),
    bug(SCH, "wrong field", "ho-sch-max-seqs-counts-the-plan",
        "and len(self.running) < cfg.max_num_seqs):", "and len(out.scheduled) < cfg.max_num_seqs):",
        "max_num_seqs is compared with this step's plan, not the running requests", ("max_num_seqs",)),
    bug(PRE, "counter", "ho-pre-request-count-set-not-added",
        "        request.num_preemptions += 1\n", "        request.num_preemptions = 1\n",
        "a request's num_preemptions is set to 1 instead of counted", ("num_preemptions",)),
    bug(HB, "wrong order", "ho-hb-parent-after-tokens",
        "    h.update(ROOT_HASH if parent is None else parent)\n    packed = array(\"q\", tokens)  # signed 64-bit on "
        "every platform torch supports\n    if sys.byteorder == \"big\":  # pragma: no cover - keep the digest identical "
        "across machines\n        packed.byteswap()\n    h.update(packed.tobytes())\n",
        "    packed = array(\"q\", tokens)\n    if sys.byteorder == \"big\":\n        packed.byteswap()\n"
        "    h.update(packed.tobytes())\n    h.update(ROOT_HASH if parent is None else parent)\n",
        "the tokens are hashed before the parent digest", ("parent", "order")),
    bug(AS, "state not reset", "ho-as-growth-replaces-the-table",
        "        table.extend(gained)\n", "        self.req_blocks[rid] = gained\n",
        "a growing request's table is replaced by its new blocks instead of extended", ("table", "block")),
    bug(CFB, "counter", "ho-cfb-partial-block-counted-published",
        "        self.num_published[rid] = max(full, self.num_published.get(rid, 0))\n",
        "        self.num_published[rid] = len(table)\n",
        "num_published counts the partly filled last block too, so it is never published once full",
        ("num_published", "publish")),
    bug(FR, "wrong formula", "ho-fr-ref-count-set-to-zero",
        "        self._release(reversed(table))\n",
        "        for b in reversed(table):\n            self.ref_count[b] = 0\n            self.free_queue[b] = None\n",
        "free sets each block's ref_count to 0, also for blocks other requests still hold", ("ref_count", "shared")),
    bug(WK, "wrong formula", "ho-wk-scatter-by-block-and-offset",
        "        flat.index_copy_(0, slots, rows.to(pool.dtype))\n",
        "        pool[slots // pool.shape[1], slots % pool.shape[1]] = rows.to(pool.dtype)\n",
        "the rows are written by (block, offset) indexing instead of index_copy_", (),
        equivalent="an indexed assignment writes the same slots of the same tensor in place"),
]

@dataclass
class BugResult:
    bug: Bug
    status: str  # "ok" | "stale" | "broken"
    by_hole: bool = False
    by_chapter: bool = False
    test: str = ""
    message: str = ""
    names_cause: bool = False
    seconds: float = 0.0

    @property
    def counted(self) -> bool:
        """Part of the rates: a real (non-equivalent) bug that ran."""
        return self.status == "ok" and not self.bug.equivalent


@functools.lru_cache(maxsize=1)
def _reference() -> dict[str, str]:
    return reference_files()


def _names_cause(bug: Bug, message: str) -> bool:
    words = bug.cause or (bug.holes[0].rsplit(".", 1)[-1].lstrip("_"),)
    low = message.lower()
    return any(w.lower() in low for w in words)


def in_a_hole_body(bug: Bug) -> bool:
    """The bug's text lies in a hole's reference body (solutions/), not in given code."""
    return bug.old in (ROOT / "solutions" / bug.file).read_text()


def run_bug(bug: Bug, timeout: float = 600) -> BugResult:
    """Apply one bug to the reference in a workspace; run its hole's tests, then (if they all pass)
    the whole chapter file, each stopping at the first failure."""
    files = _reference()
    stale = check_applies(bug, files) or (None if in_a_hole_body(bug) else "its text is not in a hole's body")
    if stale:
        return BugResult(bug, "stale", message=stale)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"bug-{bug.name}-") as tmp:
        bed = workspace(Path(tmp) / "repo", apply_mutant(bug, files))
        base = ["-x", "-q", "--tb=line", "--impl", "engine", CHAPTER_TESTS]
        stages = [("hole", [*base, *[f"--hole={h}" for h in bug.holes],
                            *(["-k", bug.keyword] if bug.keyword else [])]), ("chapter", base)]
        for stage, args in stages:
            run = run_pytest(args, cwd=bed, timeout=timeout, per_test_timeout=60)
            failed = run.first_failure()
            if failed is not None:
                res = BugResult(bug, "ok", by_hole=stage == "hole", by_chapter=True, test=failed.name,
                                message=failed.message.strip(), seconds=round(time.monotonic() - start, 1))
                res.names_cause = _names_cause(bug, res.message)
                return res
            if not (run.returncode == 0 and run.tests and all(t.passed for t in run.tests)):
                why = run.collect_errors[0]["message"][-300:] if run.collect_errors else run.output[-300:]
                return BugResult(bug, "broken", message=f"{stage} run: {why.strip()}",
                                 seconds=round(time.monotonic() - start, 1))
    return BugResult(bug, "ok", seconds=round(time.monotonic() - start, 1))


def run_all(bugs: list[Bug], workers: int = 2, progress=None) -> list[BugResult]:
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = []
        for f in [pool.submit(run_bug, b) for b in bugs]:
            results.append(f.result())
            if progress:
                progress(results[-1])
        return results


@dataclass
class Summary:
    total: int
    equivalent: int
    counted: int
    by_hole: int
    by_chapter: int
    names_cause: int
    stale: list[str]
    broken: list[str]
    equivalent_caught: list[str]

    @property
    def hole_rate(self) -> float:
        return self.by_hole / self.counted if self.counted else 0.0

    @property
    def chapter_rate(self) -> float:
        return self.by_chapter / self.counted if self.counted else 0.0

    @property
    def cause_rate(self) -> float:
        return self.names_cause / self.by_chapter if self.by_chapter else 0.0

    @property
    def holds(self) -> bool:
        return (not self.stale and not self.broken and not self.equivalent_caught
                and self.chapter_rate >= MIN_BY_CHAPTER and self.hole_rate >= MIN_BY_HOLE)


def summarize(results: list[BugResult]) -> Summary:
    counted = [r for r in results if r.counted]
    return Summary(
        total=len(results), equivalent=sum(1 for r in results if r.bug.equivalent), counted=len(counted),
        by_hole=sum(r.by_hole for r in counted), by_chapter=sum(r.by_chapter for r in counted),
        names_cause=sum(r.names_cause for r in counted if r.by_chapter),
        stale=[r.bug.name for r in results if r.status == "stale"],
        broken=[r.bug.name for r in results if r.status == "broken"],
        equivalent_caught=[r.bug.name for r in results if r.status == "ok" and r.bug.equivalent and r.by_chapter])


def summary_lines(s: Summary) -> list[str]:
    lines = [f"- bugs: {s.total}, of which {s.equivalent} equivalent (cannot change behaviour) and "
             f"{s.counted} real",
             f"- caught by the owning hole's own tests: {s.by_hole}/{s.counted} = {s.hole_rate:.1%} "
             f"(target {MIN_BY_HOLE:.0%})",
             f"- caught by the chapter file: {s.by_chapter}/{s.counted} = {s.chapter_rate:.1%} "
             f"(target {MIN_BY_CHAPTER:.0%})",
             f"- the first failure's message names the cause: {s.names_cause}/{s.by_chapter} = {s.cause_rate:.1%}"]
    if s.stale or s.broken or s.equivalent_caught:
        lines.append(f"- stale: {s.stale or 'none'}; broken: {s.broken or 'none'}; "
                     f"claimed equivalent but caught: {s.equivalent_caught or 'none'}")
    return lines


def _cell(text: str, width: int = 110) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"


def _rows(results: list[BugResult]) -> list[str]:
    out = ["| bug | hole | class | by hole | by chapter | names cause | first failure / why equivalent |",
           "|---|---|---|---|---|---|---|"]
    for r in results:
        b = r.bug
        mark = lambda v: "yes" if v else "**no**"  # noqa: E731
        if r.status != "ok":
            row = (r.status, "", "", r.message)
        elif b.equivalent:
            row = ("(equiv.)", "(equiv.)" if not r.by_chapter else "**CAUGHT**", "", "equivalent: " + b.equivalent)
        else:
            detail = f"`{r.test}`: {r.message}" if r.by_chapter else "ESCAPED: " + b.why
            row = (mark(r.by_hole), mark(r.by_chapter), mark(r.names_cause) if r.by_chapter else "", detail)
        out.append(f"| {b.name} | {b.holes[0]} | {b.kind} | {row[0]} | {row[1]} | {row[2]} | {_cell(row[3])} |")
    return out


def format_markdown(results: list[BugResult], held: list[BugResult], note: str) -> str:
    s = summarize(results)
    h = summarize(held)
    return "\n".join([
        "# The learner-bug corpus: what the chapter's tests catch", "",
        "Regenerate with `make bug-corpus` (= `python -m course.quality.bug_corpus --table docs/bug-corpus.md`; "
        "with bug names it reruns only those rows). The bugs, and how they were invented, are in "
        "`course/quality/bug_corpus.py`. Each bug is one exact replacement in the reference, run under `--impl engine` "
        "in a temporary workspace: first the owning hole's own tests (`--hole X`), then, if they all pass, the "
        "whole of `tests/test_ch31_engine_v2.py`, each stopping at the first failure. \"Names cause\": the first "
        "failure's message contains one of the bug's cause words (`cause=` in the module).", "",
        "## Summary", "", *summary_lines(s), f"- {note}", "",
        "Held out (`HELD_OUT`, a walk-through invented after the tests were strengthened; no test was written "
        "for them):", "", *summary_lines(h), "",
        "## The corpus, per bug", "", *_rows(results), "",
        "## Held out, per bug", "", *_rows(held), ""])


def _save(path: Path, results: list[BugResult], held: list[BugResult], note: str) -> None:
    data = {"note": note, "results": [{k: v for k, v in vars(r).items() if k != "bug"} | {"name": r.bug.name}
                                      for r in results + held]}
    path.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    path.write_text(format_markdown(results, held, note))


def _load(path: Path) -> tuple[dict[str, BugResult], str]:
    side = path.with_suffix(".json")
    if not side.exists():
        return {}, ""
    data = json.loads(side.read_text())
    known = {b.name: b for b in BUGS + HELD_OUT}
    rows = {}
    for rec in data["results"]:
        name = rec.pop("name")
        if name in known:
            rows[name] = BugResult(known[name], **rec)
    return rows, data.get("note", "")


def _verdict(r: BugResult) -> str:
    if r.status != "ok":
        return r.status
    if r.by_chapter:
        return ("EQUIV?!" if r.bug.equivalent else "") + ("hole" if r.by_hole else "chapter")
    return "equiv" if r.bug.equivalent else "ESCAPED"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run only these bugs (default: all, then the held-out ones)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--table", type=Path, help="write the markdown table here (and its .json beside it); with "
                                               "names, only their rows are rerun and replaced")
    ap.add_argument("--list", action="store_true", help="list the bugs and exit")
    ap.add_argument("--held-out", action="store_true", help="run only the held-out bugs (HELD_OUT)")
    args = ap.parse_args(argv)
    if args.list:
        for b in BUGS + HELD_OUT:
            print(f"{b.name:45s} {b.holes[0]:32s} {b.kind:16s} {'(equivalent) ' if b.equivalent else ''}{b.why}")
        return 0
    by_name = {b.name: b for b in BUGS + HELD_OUT}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"unknown bug(s) {unknown}; --list names them", file=sys.stderr)
        return 2
    if args.names:
        chosen = [by_name[n] for n in args.names]
    else:
        chosen = HELD_OUT if args.held_out else BUGS + ([] if args.table is None else HELD_OUT)
    start = time.monotonic()
    from tqdm import tqdm

    with tqdm(total=len(chosen), desc="bug corpus", unit="bug", dynamic_ncols=True) as bar:
        def progress(r: BugResult) -> None:  # one line per bug above the bar: done/total, elapsed, ETA
            bar.write(f"  {_verdict(r):8s} {r.bug.name:45s} {r.test} {r.message[:90]!r}")
            bar.update(1)

        results = run_all(chosen, args.workers, progress=progress)
    seconds = time.monotonic() - start
    corpus = [r for r in results if r.bug in BUGS]
    print("\n".join(summary_lines(summarize(corpus))) + f"\n- wall time: {seconds:.0f} s")
    if args.table:
        if args.names:
            rows, note = _load(args.table)
            rows.update({r.bug.name: r for r in results})
            missing = [b.name for b in BUGS + HELD_OUT if b.name not in rows]
            if missing:
                print(f"no earlier row for {missing}: run without names first", file=sys.stderr)
                return 2
            note += f"; then {len(results)} rows rerun ({seconds:.0f} s): " + ", ".join(args.names)
            merged = [rows[b.name] for b in BUGS]
            held = [rows[b.name] for b in HELD_OUT]
        else:
            merged, held = corpus, [r for r in results if r.bug in HELD_OUT]
            note = f"wall time of the full run: {seconds:.0f} s, 2 workers, {machine_line()}"
        _save(args.table, merged, held, note)
        print(f"wrote {args.table} and {args.table.with_suffix('.json')}")
        corpus = merged
    return 0 if summarize(corpus).holds else 1


if __name__ == "__main__":
    sys.exit(main())
