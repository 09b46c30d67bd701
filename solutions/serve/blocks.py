"""The reference bodies of engine/serve/blocks.py's holes (the chapter's answers).

Each function runs in that module's namespace (engine/_impl.py puts it there), so it uses the
module's names as they are; its contract is the hole's docstring in engine/serve/blocks.py.
"""
from __future__ import annotations

import hashlib
import itertools
import sys
from array import array


def hash_block(parent, tokens, extra=()):
    h = hashlib.blake2b(digest_size=16)
    h.update(ROOT_HASH if parent is None else parent)
    packed = array("q", tokens)  # signed 64-bit on every platform torch supports
    if sys.byteorder == "big":  # pragma: no cover - keep the digest identical across machines
        packed.byteswap()
    h.update(packed.tobytes())
    if extra:
        h.update(b"\x00extra\x00")
        h.update(encode_cache_key(extra))
    return h.digest()


class BlockManager:
    def find_cached_prefix(self, request):
        wants_prompt_logprobs = request.params.prompt_logprobs is not None
        if wants_prompt_logprobs or not self.enable_prefix_caching:
            return []
        self.update_hashes(request)
        hashes = request.block_hashes
        # The block of the last token is never a candidate: that token must be computed.
        limit = min((request.num_tokens - 1) // self.block_size, len(hashes))
        matched = 0
        while matched < limit and hashes[matched] in self.cached:
            matched += 1
        self.record_lookup(request, matched * self.block_size)
        return [self.cached[h] for h in hashes[:matched]]

    def allocate_slots(self, request, n, cached_blocks=()):
        rid = request.request_id
        table = self.req_blocks.get(rid, [])
        if cached_blocks and table:
            raise ValueError(f"request {rid!r} already holds blocks; cached blocks are adopted at admission only")
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + n
        num_new = max(0, self.blocks_for(total) - len(table) - len(cached_blocks))
        if num_new == 0 and not cached_blocks and table:
            return True  # most decode steps: the last block still has room
        # Cached-free blocks (ref 0) sit in the free queue: adopting one uses up a free block too.
        reclaimed = [b for b in cached_blocks if self.ref_count[b] == 0]
        if num_new + len(reclaimed) > self.num_free:
            return False
        self.pending_lookups.pop(rid, None)  # admitted: its lookup stays counted
        self.req_blocks.setdefault(rid, table)
        if cached_blocks or rid not in self.num_published:
            self.num_published[rid] = len(cached_blocks)  # adopted blocks are published already
        for b in reclaimed:
            del self.free_queue[b]
        fresh = list(itertools.islice(self.free_queue, num_new))  # the front: freed longest ago
        for b in fresh:
            del self.free_queue[b]
            self._evict(b)  # its old content is about to be overwritten
        gained = [*cached_blocks, *fresh]
        for b in gained:
            self.ref_count[b] += 1
        table.extend(gained)
        return True

    def cache_full_blocks(self, request, num_tokens=None):
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.req_blocks.get(rid)
        if table is None:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        if num_tokens // self.block_size <= self.num_published.get(rid, 0):
            return  # no block has filled up since the last call (most decode steps)
        self.update_hashes(request)
        full = min(num_tokens // self.block_size, len(request.block_hashes), len(table))
        for i in range(self.num_published.get(rid, 0), full):
            h, b = request.block_hashes[i], table[i]
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h
        self.num_published[rid] = max(full, self.num_published.get(rid, 0))

    def free(self, request):
        table = self.req_blocks.pop(request.request_id, [])
        self.num_published.pop(request.request_id, None)
        self.pending_lookups.pop(request.request_id, None)
        self._release(reversed(table))
