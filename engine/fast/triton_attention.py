"""TritonBackend: chapter 32's paged attention — one kernel reads K/V straight from pool blocks.

The torch backend copies every request's keys out of the pool before attending; this backend's
kernel (``triton_paged_kernel.py``) looks each key position up in the block table and loads K/V
from the pool where they are, one query tile and one kv head per program. Decode rows and prefill
chunks go through the same kernel, launched twice per layer with different tile heights: one-row
tiles for decodes, ``prefill_tile_rows``-row tiles for requests with several rows.

Triton is optional (``pip install -e .[triton]``) and imported only when this backend is built.
On CUDA tensors the kernel is compiled; on CPU tensors it runs only under ``TRITON_INTERPRET=1``,
which must be set before the kernel module is imported (the tests do this in a subprocess).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from engine.serve.attention import KVCache, write_kv, zero_pools
from engine.serve.batch import BatchMeta

INSTALL_HINT = "pip install -e .[triton]"
MIN_DOT = 16  # tl.dot needs every side of its operands to be at least 16


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonBackend:
    """Paged attention in one Triton kernel (name "triton"); same contract as the reference.

    Invariant: ``_plan`` holds the tiles of exactly the (BatchMeta, padded group) ``_plan_key``
    (rebuilt on the first layer of every step, reused by the others). Compute is float32 (online softmax), inputs
    may be float32, float16 or bfloat16.
    """

    name = "triton"

    def __init__(self, prefill_tile_rows: int = 16, block_n: int = 32) -> None:
        if prefill_tile_rows < 1 or block_n < MIN_DOT or block_n & (block_n - 1):
            raise ValueError(f"need prefill_tile_rows >= 1 and block_n a power of two >= {MIN_DOT}, "
                             f"got {prefill_tile_rows} and {block_n}")
        try:
            from engine.fast import triton_paged_kernel
        except ImportError as exc:
            raise ImportError(f"the 'triton' attention backend needs Triton, which is not installed: "
                              f"{INSTALL_HINT} (or use attention_backend='torch')") from exc
        self._kernel = triton_paged_kernel.paged_attention_kernel
        self.interpreted = type(self._kernel).__name__ == "InterpretedFunction"
        self.prefill_tile_rows = prefill_tile_rows
        self.block_n = block_n
        self._plan_key: tuple[BatchMeta, int] | None = None
        self._plan: list[tuple[int, torch.Tensor]] = []

    def _check(self, device: torch.device | str, dtype: torch.dtype) -> None:
        device = torch.device(device)
        if device.type == "cpu" and not self.interpreted:
            raise ValueError("the 'triton' backend runs on CPU tensors only under Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before anything imports triton (or use attention_backend='torch')"
                             + ("" if os.environ.get("TRITON_INTERPRET") == "1" else
                                "; TRITON_INTERPRET is not set"))
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"the 'triton' backend supports float32, float16 and bfloat16 pools, not {dtype}; "
                             "use attention_backend='torch' for float64")

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache:
        self._check(device, dtype)
        return zero_pools(shape, dtype, device)

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        k_pool, v_pool = cache
        write_kv(k_pool, v_pool, k, v, meta.slot_mapping)  # the reference's scatter serves here too

    # ----- planning (once per step, on the host copies: no device sync) ----------------------
    def plan(self, meta: BatchMeta, group_pad: int) -> list[tuple[int, torch.Tensor]]:
        """[(tile_rows, int32 [4, G] = request, first row, real rows, first position per tile)]."""
        if self._plan_key is None or self._plan_key[0] is not meta or self._plan_key[1] != group_pad:
            qsl = meta.query_start_loc_cpu.numpy().astype(np.int64)  # [R + 1]
            seq_lens = meta.seq_lens_cpu.numpy().astype(np.int64)  # [R]
            num_rows = np.diff(qsl)
            real = (seq_lens > 0) & (num_rows > 0)  # seq_len 0: padding, left at zero
            decode_rows = max(1, MIN_DOT // group_pad)  # only row 0 is real; the rest pads tl.dot's M
            prefill_rows = max(_pow2(self.prefill_tile_rows), decode_rows)
            self._plan = []
            for tile_rows, step, members in ((decode_rows, 1, real & (num_rows == 1)),
                                             (prefill_rows, prefill_rows, real & (num_rows > 1))):
                reqs = np.flatnonzero(members)
                if reqs.size == 0:
                    continue
                t = num_rows[reqs]
                per_req = -(-t // step)  # tiles per request
                tile_req = np.repeat(reqs, per_req)
                first = np.cumsum(per_req) - per_req
                offset = (np.arange(tile_req.size) - np.repeat(first, per_req)) * step  # row within request
                t_tile = np.repeat(t, per_req)
                tiles = np.stack([tile_req, qsl[tile_req] + offset, np.minimum(t_tile - offset, step),
                                  seq_lens[tile_req] - t_tile + offset])  # [4, G]
                dev = torch.from_numpy(tiles.astype(np.int32)).to(meta.block_table.device, non_blocking=True)
                self._plan.append((tile_rows, dev))
            self._plan_key = (meta, group_pad)
        return self._plan

    # ----- attention -----------------------------------------------------------------------
    def forward(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor:
        """q: [N, Hq, D] -> [N, Hq, D]; the same contract as ``ReferenceBackend.forward``."""
        k_pool, v_pool = cache  # [blocks + 1, bs, Hkv, D]
        self._check(q.device, k_pool.dtype)
        n, hq, d = q.shape
        hkv = k_pool.shape[2]
        if hq % hkv != 0:
            raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
        group = hq // hkv
        group_pad = _pow2(group)
        if scale is None:
            scale = d ** -0.5
        q = q.contiguous()
        out = torch.zeros_like(q)
        table = meta.block_table
        if table.shape[1] == 0:  # every request is padding: nothing to read
            return out
        for tile_rows, tiles in self.plan(meta, group_pad):
            self._kernel[(tiles.shape[1], hkv)](
                q, k_pool, v_pool, out, table, tiles[0], tiles[1], tiles[2], tiles[3],
                float(scale), int(window), meta.block_size,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
                v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), table.stride(0),
                GROUP=group, GROUP_PAD=group_pad, TILE_ROWS=tile_rows,
                HEAD_DIM=d, BLOCK_D=max(MIN_DOT, _pow2(d)), BLOCK_N=self.block_n,
                DOT_F32=self.interpreted or k_pool.dtype == torch.float32,
            )
        return out
