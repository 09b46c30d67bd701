"""TorchBackend: paged attention for the whole flat batch in a few batched tensor ops.

The reference backend loops over requests in Python; at 256 running requests that loop, not the
model, is the step. This backend does the same arithmetic with no per-request Python work:

1. Cut the batch into *query tiles*. A decode row (a request with one query) is a tile of one
   row; a request with t > 1 rows (a prefill chunk, a resumed history, a verification span) is
   cut into tiles of ``tile_rows`` consecutive rows. Every tile belongs to one request, so one
   gather of that request's blocks serves all of the tile's rows.
2. Gather each tile's K and V straight from the pool, whole blocks at a time, through its
   request's block table: ``k_pool[table[:W]]`` -> ``[tiles, W * block_size, Hkv, D]``. Copying
   whole blocks is a few large copies instead of one small copy per token.
3. One masked attention per group of tiles: key position p is visible to a query at position q
   when p <= q (causal) and, with a sliding window w, p > q - w. p <= q also hides everything past
   the request's seq_len, including the zero-padded tail of its block table.

Decode tiles and prefill tiles are handled as two groups because they need different key
lengths: a batch of 255 decodes and one 2,000-token prefill would otherwise pad every decode to
2,000 keys. Each group is processed in chunks of tiles sized so that the gathered K/V stay under
``max_chunk_elems`` elements, which bounds memory for long prefills.

The tiling plan depends only on the batch metadata, so it is built once per step (from the host
copies ``query_start_loc_cpu`` / ``seq_lens_cpu``: no device sync) and reused by every layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.serve.attention import KVCache, write_kv
from engine.serve.batch import BatchMeta

DEFAULT_TILE_ROWS = 32  # query rows per prefill tile: one K/V gather serves this many queries
DEFAULT_MAX_CHUNK_ELEMS = 1 << 24  # gathered K (and V) elements per chunk: 64 MiB each in float32


@dataclass
class _TileGroup:
    """Tiles that share one padded key length. Every tensor is on the batch's device.

    q_rows: int64 [G, T] flat row each tile row reads its query from (a padding row, past the
    request's last row, repeats that last row); out_rows: int64 [G, T] the row each result goes to
    (N, a scratch row past the batch, for padding rows); q_pos: int64 [G, T] each query's
    position; tables: int64 [G, W] the tile's request's first W blocks, where W * block_size
    covers the group's longest seq_len.
    """

    q_rows: torch.Tensor
    out_rows: torch.Tensor
    q_pos: torch.Tensor
    tables: torch.Tensor
    num_key_blocks: int  # W

    @property
    def num_tiles(self) -> int:
        return self.q_rows.shape[0]


class TorchBackend:
    """Vectorized paged attention in plain PyTorch (name "torch"); same results as the reference.

    Invariant: ``_plan`` caches the tiling of exactly one BatchMeta object (``_plan_meta``) — a
    new step brings a new BatchMeta, which is re-planned on the first layer's call.
    """

    name = "torch"

    def __init__(self, tile_rows: int = DEFAULT_TILE_ROWS, max_chunk_elems: int = DEFAULT_MAX_CHUNK_ELEMS) -> None:
        if tile_rows < 1:
            raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
        if max_chunk_elems < 1:
            raise ValueError(f"max_chunk_elems must be >= 1, got {max_chunk_elems}")
        self.tile_rows = tile_rows
        self.max_chunk_elems = max_chunk_elems
        self._plan_meta: BatchMeta | None = None
        self._plan: list[_TileGroup] = []

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        write_kv(cache[0], cache[1], k, v, meta.slot_mapping)

    # ----- planning (once per step) ------------------------------------------------------
    def plan(self, meta: BatchMeta) -> list[_TileGroup]:
        """The tile groups of ``meta`` (cached: every layer of a step shares one plan)."""
        if meta is not self._plan_meta:
            self._plan = self._make_plan(meta)
            self._plan_meta = meta
        return self._plan

    def _make_plan(self, meta: BatchMeta) -> list[_TileGroup]:
        qsl = meta.query_start_loc_cpu.long()  # [R + 1]
        seq_lens = meta.seq_lens_cpu.long()  # [R]
        num_rows = qsl[1:] - qsl[:-1]  # [R]
        real = (seq_lens > 0) & (num_rows > 0)  # seq_len 0: a padding request, left at zero
        groups = []
        for tile_rows, members in ((1, real & (num_rows == 1)), (self.tile_rows, real & (num_rows > 1))):
            reqs = members.nonzero().flatten()  # [Rg]
            if reqs.numel() == 0:
                continue
            groups.append(self._make_group(meta, reqs, qsl, seq_lens, num_rows, tile_rows))
        return groups

    def _make_group(self, meta: BatchMeta, reqs: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor,
                    num_rows: torch.Tensor, tile_rows: int) -> _TileGroup:
        t = num_rows[reqs]  # [Rg] rows per request
        tiles_per_req = (t + tile_rows - 1) // tile_rows  # [Rg]
        tile_req = torch.repeat_interleave(reqs, tiles_per_req)  # [G] request of each tile
        # Index of each tile within its request: 0, 1, ... restarting at every request.
        first_tile = torch.cumsum(tiles_per_req, 0) - tiles_per_req  # [Rg]
        tile_idx = torch.arange(tile_req.numel()) - torch.repeat_interleave(first_tile, tiles_per_req)
        offset = tile_idx[:, None] * tile_rows + torch.arange(tile_rows)[None, :]  # [G, T] row within request
        t_tile = num_rows[tile_req][:, None]  # [G, 1]
        row_valid = offset < t_tile
        offset = torch.minimum(offset, t_tile - 1)  # padding rows repeat the last real row
        rows = qsl[tile_req][:, None] + offset  # [G, T]
        out_rows = torch.where(row_valid, rows, int(qsl[-1]))  # padding rows land in scratch row N
        # The request's t rows are its LAST t positions: row j sits at seq_len - t + j.
        q_pos = seq_lens[tile_req][:, None] - t_tile + offset  # [G, T]
        bs = meta.block_size
        width = -(-int(seq_lens[reqs].max()) // bs)  # W blocks cover the group's longest context
        device = meta.block_table.device
        tile_req_dev = tile_req.to(device, non_blocking=True)
        tables = meta.block_table[:, :width].index_select(0, tile_req_dev).long()  # [G, W]
        return _TileGroup(q_rows=rows.to(device, non_blocking=True),
                          out_rows=out_rows.to(device, non_blocking=True),
                          q_pos=q_pos.to(device, non_blocking=True), tables=tables, num_key_blocks=width)

    # ----- attention ---------------------------------------------------------------------
    def forward(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor:
        """q: [N, Hq, D] -> [N, Hq, D]; the same contract as ``ReferenceBackend.forward``."""
        k_pool, v_pool = cache  # [blocks + 1, bs, Hkv, D]
        n, hq, d = q.shape
        hkv = k_pool.shape[2]
        if hq % hkv != 0:
            raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        out = q.new_zeros((n + 1, hq, d))  # row N is scratch for the tiles' padding rows
        for group in self.plan(meta):
            keys_per_tile = group.num_key_blocks * meta.block_size * hkv * d
            chunk = max(1, self.max_chunk_elems // keys_per_tile)
            for start in range(0, group.num_tiles, chunk):
                self._attend(q, k_pool, v_pool, group, slice(start, start + chunk), scale, window, out)
        return out[:n]

    def _attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: _TileGroup,
                tiles: slice, scale: float, window: int, out: torch.Tensor) -> None:
        """Attention for one chunk of a group's tiles, written into ``out`` [N, Hq, D]."""
        hq, d = q.shape[1:]
        bs, hkv = k_pool.shape[1], k_pool.shape[2]
        group_size = hq // hkv
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        q_rows, out_rows = group.q_rows[tiles], group.out_rows[tiles]  # [G, T]
        q_pos, tables = group.q_pos[tiles], group.tables[tiles]  # [G, T], [G, W]
        g, t = q_rows.shape
        num_keys = tables.shape[1] * bs
        # Whole blocks through the block table: [G, W] -> [G, W * bs, Hkv, D].
        k = k_pool.index_select(0, tables.flatten()).view(g, num_keys, hkv, d).to(work)
        v = v_pool.index_select(0, tables.flatten()).view(g, num_keys, hkv, d).to(work)
        qt = q.index_select(0, q_rows.flatten()).to(work)  # [G * T, Hq, D]
        # Query head h reads kv head h // group_size: fold the group into the query axis.
        qt = qt.view(g, t, hkv, group_size, d).permute(0, 2, 1, 3, 4).reshape(g, hkv, t * group_size, d)
        scores = torch.matmul(qt, k.permute(0, 2, 3, 1)) * scale  # [G, Hkv, T * group, W * bs]
        k_pos = torch.arange(num_keys, device=q.device)
        visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [G, T, keys]; also hides p >= seq_len
        if window > 0:
            visible &= k_pos[None, None, :] > q_pos[:, :, None] - window
        visible = visible[:, None, :, None, :].expand(g, 1, t, group_size, num_keys).reshape(g, 1, t * group_size, num_keys)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # every query sees at least its own key: no NaN
        o = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [G, Hkv, T * group, D]
        o = o.view(g, hkv, t, group_size, d).permute(0, 2, 1, 3, 4).reshape(g * t, hq, d)
        # Real rows are distinct; only padding rows share the scratch row, whose value is dropped.
        out.index_copy_(0, out_rows.flatten(), o.to(out.dtype))
