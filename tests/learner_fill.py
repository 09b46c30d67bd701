"""Hole bodies written from their docstrings alone, the way a learner would — not the reference's.

tests/test_learner_contract.py fills these holes (the reference fills the rest) and runs the
chapter's tests and engine checks the learner's way: if a docstring leaves out something a test
checks, this fails. Keep them plain and different from solutions/ (they are a second opinion).
Each body is written without indentation; ``indented`` gives it the hole's. A handout leaves this
file out, with solutions/: it holds answers too.
"""
from __future__ import annotations

BODIES: dict[str, dict[str, str]] = {
    "serve/attention.py": {
        "write_kv": """
flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
last = flat_k.shape[0] - 1
where = slot_mapping.clone()
where[where == -1] = last
flat_k.index_copy_(0, where, k.to(flat_k.dtype))
flat_v.index_copy_(0, where, v.to(flat_v.dtype))
""",
    },
    "serve/flat.py": {
        "FlatModel.attention": """
q, k, v = attn.qkv(x, cos, sin)
backend.write(kv_cache, k, v, meta)
out = backend.forward(q, kv_cache, meta, scale=attn.scale, window=self.cfg.sliding_window)
return attn.o_proj(out.flatten(1))
""",
        "FlatModel.forward": """
layers = self.model.model
h = layers.embed_tokens(input_ids)
cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.dtype)
h, res = layers.run_layers(h, cos, sin, lambda i, attn, x, c, s: self.attention(
    attn, x, c, s, kv_caches[i], meta, backend))
normed, _ = add_norm(h, res, layers.norm)
return normed
""",
    },
    "serve/blocks.py": {
        "hash_block": """
import hashlib
import struct

digest = hashlib.blake2b(digest_size=16)
digest.update(parent if parent is not None else ROOT_HASH)
digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
if len(extra) > 0:
    digest.update(b"\\x00extra\\x00")
    digest.update(encode_cache_key(extra))
return digest.digest()
""",
        "BlockManager.find_cached_prefix": """
if request.params.prompt_logprobs is not None:
    return []  # its prompt rows must run to produce their logprobs
if not self.enable_prefix_caching:
    return []
self.update_hashes(request)
limit = (request.num_tokens - 1) // self.block_size
result = []
for i in range(min(limit, len(request.block_hashes))):
    if request.block_hashes[i] not in self.cached:
        break
    result.append(self.cached[request.block_hashes[i]])
self.record_lookup(request, self.block_size * len(result))
return result
""",
        "BlockManager.allocate_slots": """
rid = request.request_id
have = self.req_blocks.get(rid)
if cached_blocks and have:
    raise ValueError("cached blocks are only adopted by a request without blocks")
want_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + n
held = len(have or []) + len(cached_blocks)
new_blocks = max(0, self.blocks_for(want_tokens) - held)
from_queue = new_blocks + len([b for b in cached_blocks if self.ref_count[b] == 0])
if from_queue > len(self.free_queue):
    return False
table = have if have is not None else []
for b in cached_blocks:
    if self.ref_count[b] == 0:
        self.free_queue.pop(b)
    self.ref_count[b] += 1
    table.append(b)
for _ in range(new_blocks):
    b = next(iter(self.free_queue))
    del self.free_queue[b]
    self._evict(b)
    self.ref_count[b] += 1
    table.append(b)
if have is None:
    self.req_blocks[rid] = table
    self.num_published[rid] = len(cached_blocks)
self.pending_lookups.pop(rid, None)
return True
""",
        "BlockManager.cache_full_blocks": """
rid = request.request_id
table = self.req_blocks.get(rid)
if table is None or not self.enable_prefix_caching:
    return
upto = request.num_computed_tokens if num_tokens is None else num_tokens
self.update_hashes(request)
full = min(upto // self.block_size, len(request.block_hashes), len(table))
done = self.num_published[rid]
while done < full:
    h, b = request.block_hashes[done], table[done]
    if h not in self.cached and self.block_hash[b] is None:
        self.cached[h] = b
        self.block_hash[b] = h
    done += 1
self.num_published[rid] = max(done, self.num_published[rid])
""",
        "BlockManager.free": """
rid = request.request_id
self.num_published.pop(rid, None)
self.pending_lookups.pop(rid, None)
blocks = self.req_blocks.pop(rid, None)
if blocks:
    self._release(blocks[::-1])
""",
    },
    "serve/scheduler.py": {
        "Scheduler._preempt": """
rid = request.request_id
if self.config.preemption_mode == "swap" and request.num_computed_tokens:
    keep = self.blocks.blocks_for(request.num_computed_tokens)
    out.swap_out.append((request, list(self.blocks.req_blocks[rid][:keep])))
    request.swapped_out = True
else:
    request.num_computed_tokens = 0
self.running = [r for r in self.running if r is not request]
self.blocks.free(request)
request.status, request.num_preemptions = Status.PREEMPTED, request.num_preemptions + 1
self.num_preemptions += 1
out.preempted.append(request)
if self.config.policy == "fcfs":
    self.waiting.insert(0, request)
else:
    self._insert_sorted(self.waiting, request)
""",
    },
    "serve/engine.py": {
        "EngineCore.check_stop": """
params = request.params
produced = request.num_output_tokens
if produced == 0:
    return None
token = request.output_token_ids[-1]
if produced >= params.min_tokens:
    if token in params.stop_token_ids:
        request.stop_reason = token
        return Status.FINISHED_STOPPED
    if request.eos_token_id is not None and token == request.eos_token_id and not params.ignore_eos:
        return Status.FINISHED_STOPPED
if produced >= params.max_tokens:
    return Status.FINISHED_LENGTH
if request.num_tokens >= self.max_model_len:
    return Status.FINISHED_LENGTH
return None
""",
        "EngineCore.step": """
plan = self.scheduler.schedule()
try:
    copies = [(self.runner.swap_out, pair) for pair in plan.swap_out]
    copies += [(self.runner.swap_in, pair) for pair in plan.swap_in]  # outs before ins
    for copy, (request, blocks) in copies:
        copy(request, blocks)
    if len(plan.scheduled) == 0:
        return []
    tables = self.blocks.req_blocks
    batch = self.runner.prepare(plan.scheduled, tables)
    rows = batch.num_sample_rows
    logits = self.runner.execute(batch)
    owners = []
    for (request, _), count in zip(plan.scheduled, batch.sample_counts):
        owners += [request] * count
    sampled = self.sampler(logits[:rows], owners, self.generators)
    entries = self._prompt_logprobs(batch, logits[rows:])
except BaseException:
    self.recover_failed_step(plan)
    raise
self.steps += 1
results = []
next_row = 0
for (request, n), count in zip(plan.scheduled, batch.sample_counts):
    before = request.num_computed_tokens
    request.num_computed_tokens = before + n
    mine = list(sampled[next_row:next_row + count])
    next_row += count
    for token in mine:
        request.append(token)
    if request.params.prompt_logprobs is not None:
        kept = list(request.prompt_logprobs or [])[:before]
        request.prompt_logprobs = kept + entries.get(request.request_id, [])
    self.blocks.cache_full_blocks(request)
    stopped = self.check_stop(request) if mine else None
    if stopped is not None:
        self.scheduler.finish(request, stopped)
    if mine or stopped is not None:
        results.append(self._output(request, mine))
return results
""",
    },
}


def indented(rel: str) -> dict[str, str]:
    """``BODIES[rel]`` indented as the holes' bodies in engine/<rel> (a method 8 spaces, a function 4)."""
    return {q: "".join((" " * (8 if "." in q else 4) + line) if line.strip() else line
                       for line in body.strip("\n").splitlines(keepends=True)) + "\n"
            for q, body in BODIES[rel].items()}
