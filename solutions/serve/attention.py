"""The reference bodies of engine/serve/attention.py's holes (the chapter's answers).

Each function runs in that module's namespace (engine/_impl.py puts it there), so it uses the
module's names as they are; its contract is the hole's docstring in engine/serve/attention.py.
"""
from __future__ import annotations

import torch

from engine.attention import causal_attention


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    scratch_slot = k_cache.shape[0] * k_cache.shape[1] - 1  # the scratch block's last slot
    slots = slot_mapping.masked_fill(slot_mapping < 0, scratch_slot)
    for pool, rows in ((k_cache, k), (v_cache, v)):
        flat = pool.view(-1, *pool.shape[2:])  # [slots, Hkv, D], sharing the pool's storage
        flat.index_copy_(0, slots, rows.to(pool.dtype))


class ReferenceBackend:
    def forward(self, q, cache, meta, scale=None, window=0):
        k_pool, v_pool = cache
        bs = meta.block_size
        k_flat = k_pool.view(-1, *k_pool.shape[2:])  # [slots, Hkv, D]
        v_flat = v_pool.view(-1, *v_pool.shape[2:])
        tables = meta.block_table.cpu()
        out = torch.zeros_like(q)
        for r in range(meta.num_reqs):
            start, end = int(meta.query_start_loc_cpu[r]), int(meta.query_start_loc_cpu[r + 1])
            seq_len = int(meta.seq_lens_cpu[r])
            if seq_len == 0 or end == start:
                continue
            pos = torch.arange(seq_len)
            slots = tables[r, pos // bs].long() * bs + pos % bs  # [L]
            slots = slots.to(q.device)
            k_pos = pos.to(q.device)
            q_pos = k_pos[seq_len - (end - start):]
            out[start:end] = causal_attention(q[start:end], k_flat[slots], v_flat[slots], q_pos, k_pos,
                                              scale=scale, window=window)
        return out
