"""Attention over the block pool: the write, and the chapter's reference paged attention.

Per layer the pool is two tensors, K and V, of shape ``[num_blocks + 1, block_size, Hkv, D]``:
slot-major, so flat slot s is block ``s // block_size``, offset ``s % block_size``, and a write is
one ``index_copy_`` over flat slot numbers. The extra last block is scratch: padding rows write
there and the block manager never hands it out.
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.attention import causal_attention
from engine.serve.batch import BatchMeta

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_pool, v_pool), each [num_blocks + 1, block_size, Hkv, D]


def zero_pools(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache:
    """One layer's K pool and V pool, both of ``shape`` and filled with zeros."""
    k_pool = torch.zeros(shape, dtype=dtype, device=device)
    return k_pool, torch.zeros_like(k_pool)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K and V rows into their pool slots. (Your engine: Chapter 31)

    k, v: [N, Hkv, D]; slot_mapping: int64 [N] flat slot numbers. Padding rows carry slot -1
    (``PAD_SLOT``) and are written too, into the pool's very last slot (it lies in the scratch
    block). Dropping them instead would give a result whose size depends on the data: the host
    would have to wait for the device to learn how many rows are real, and a captured CUDA graph
    cannot include such a wait. Writes in place, one ``index_copy_`` per pool. The rows are cast
    to the pool's dtype first (float32 rows into a bfloat16 pool are stored rounded to bfloat16),
    since ``index_copy_`` itself refuses a source of another dtype.
    """
    raise NotImplementedError("write_kv is a hole: fill it in (Chapter 31, engine/serve/attention.py)")


class AttentionBackend(Protocol):
    """What FlatModel needs from a backend: a pool per layer, a write, and paged attention."""

    name: str

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache: ...

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None: ...

    def forward(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor: ...


class ReferenceBackend:
    """Paged attention as a Python loop over requests: slow, and obviously right.

    Every faster backend (``engine.serve.registry``) is tested against this one.
    """

    name = "reference"

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return zero_pools(shape, dtype, device)

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        k_pool, v_pool = cache
        write_kv(k_pool, v_pool, k, v, meta.slot_mapping)

    def forward(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor:
        """Attention for every row of the flat batch. (Your engine: Chapter 31)

        q: [N, Hq, D] -> [N, Hq, D]. For request r with t = its number of rows and L = seq_lens[r]:
        look up the slots of its positions 0 .. L-1 through ``block_table[r]`` (position p lives
        in slot ``table[p // block_size] * block_size + p % block_size``), read K and V there,
        and run chapter 5's causal attention. Its t queries close the context: query i is at
        position L-t+i and sees keys 0 .. L-t+i (with ``window > 0``, only keys with
        k_pos > q_pos - window), with ``scale`` as the softmax scale (None: causal_attention's
        default, 1/sqrt(D)). Requests with L == 0 are padding: their rows are left as zeros.
        """
        raise NotImplementedError("ReferenceBackend.forward is a hole: fill it in (Chapter 31, engine/serve/attention.py)")
