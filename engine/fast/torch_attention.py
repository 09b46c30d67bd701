"""TorchBackend: paged attention for the whole flat batch in a few batched tensor ops.

The reference backend loops over requests in Python; at 256 running requests that loop, not the
model, is the step. This backend does the same arithmetic with no per-request Python work:

1. Cut the batch into *query tiles*. A decode row (a request with one query) is a tile of one
   row; a request with t > 1 rows (a prefill chunk, a resumed history, a verification span) is
   cut into tiles of ``tile_rows`` consecutive rows. Every tile belongs to one request, so one
   gather of that request's keys serves all of the tile's rows.
2. Gather each tile's K and V from the pool through its request's block table, in one
   ``index_select`` per pool, straight into heads-first order ``[tiles * Hkv, keys, D]``.
3. One batched attention per group of tiles, with a mask bias (0 where a key is visible, -inf
   where not): for decode tiles ``baddbmm`` (scale * q @ k^T + bias in one call), softmax and a
   second bmm; for prefill tiles PyTorch's fused ``scaled_dot_product_attention``.
   Key position p is visible to a query at position q when p <= q (causal) and, with a sliding
   window w, p > q - w. p <= q also hides everything past the request's seq_len, including the
   zero-padded tail of its block table.

Decode tiles and prefill tiles form two groups because they need different key lengths: a batch
of 255 decodes and one 2,000-token prefill would otherwise pad every decode to 2,000 keys. Each
group runs in chunks of tiles small enough that the gathered K/V stay under ``max_chunk_elems``
elements, which bounds memory for long prefills.

The tiling plan (indices and mask biases) depends only on the batch metadata, so it is built once
per step from the host copies ``query_start_loc_cpu`` / ``seq_lens_cpu`` (no device sync) and
reused by every layer. A pure-decode batch skips the row gather/scatter entirely.

Cascade attention: when many decodes start with the same blocks (a system prompt adopted from the
prefix cache), gathering those blocks once per request is the biggest cost of a decode step. The
plan then splits the keys: the shared prefix is gathered once and met by every query in one
matmul per kv head, each request's own tail as before; both parts' scores go through one softmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.precision import work_dtype
from engine.serve.attention import KVCache, write_kv, zero_pools
from engine.serve.batch import BatchMeta

DEFAULT_TILE_ROWS = 32  # query rows per prefill tile: one K/V gather serves this many queries
DEFAULT_MAX_CHUNK_ELEMS = 1 << 22  # gathered K (and V) elements per chunk: 16 MiB each in float32
# When a pure-decode step is served as a cascade (see TorchBackend): at least this many requests
# sharing at least this many leading blocks. In the spirit of vLLM's use_cascade_attention (which
# wants 8+ requests and a 256+ token prefix on a GPU); with fewer requests the extra operations
# cost about what the smaller gathers save. The shared workload's 12-block system prompt at 16
# requests: decode steps ~11% faster on the small preset, ~2% on the test model (where per-op
# cost, not the gathers, dominates).
DEFAULT_CASCADE_MIN_REQS = 8
DEFAULT_CASCADE_MIN_BLOCKS = 4


def _gather(pool: torch.Tensor, rows: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """Rows of ``pool`` [slots, bs, Hkv, D], viewed as ``[slots * Hkv, D]``, picked by ``rows``
    [..., keys] (from ``TorchBackend._kv_rows``) -> [prod(...), keys, D] in ``work`` dtype: one
    gather straight into heads-first order, each (tile, kv head) one contiguous [keys, D] matrix."""
    d = pool.shape[-1]
    return pool.view(-1, d).index_select(0, rows.flatten()).view(-1, rows.shape[-1], d).to(work)


@dataclass
class _TileGroup:
    """Tiles that share one padded key length. Every tensor is on the batch's device.

    q_rows: int64 [G, T] flat row each tile row reads its query from (a padding row, past the
    request's last row, repeats that last row); out_rows: int64 [G, T] the row each result goes to
    (N, a scratch row past the batch, for padding rows); q_pos: int64 [G, T] each query's
    position; kv_rows: int64 [G, Hkv, keys] the row of the pool, viewed as ``[slots * Hkv, D]``,
    holding kv head h of key position p of the tile's request — keys = W * block_size covers the
    group's longest seq_len (positions past a request's own seq_len read its table's zero padding
    and are masked). ``identity``: the group is every row of the batch, one per tile, in order.

    Cascade (decode tiles only): ``prefix_rows`` int64 [Hkv, P] are the pool rows of a prefix of
    P = ``key_offset`` positions that every tile's request shares (the same blocks) and every query
    sees; ``kv_rows`` then covers positions P .. P + keys - 1 only.
    """

    q_rows: torch.Tensor
    out_rows: torch.Tensor
    q_pos: torch.Tensor
    kv_rows: torch.Tensor
    identity: bool
    tables: torch.Tensor | None = None  # int32 [G, W]: each tile's request's block table (W covers the group)
    prefix_rows: torch.Tensor | None = None
    key_offset: int = 0
    _biases: dict = field(default_factory=dict)  # (first tile, window, dtype) -> bias; layers reuse it

    @property
    def num_tiles(self) -> int:
        return self.q_rows.shape[0]

    @property
    def num_keys(self) -> int:
        return self.kv_rows.shape[2]

    def bias(self, tiles: slice, group_size: int, window: int, dtype: torch.dtype) -> torch.Tensor:
        """[G' * Hkv, T * group_size, keys]: 0 where a query may see a key, -inf where not."""
        key = (tiles.start, window, dtype)
        if key not in self._biases:
            q_pos = self.q_pos[tiles][:, :, None]  # [G', T, 1]
            k_pos = torch.arange(self.key_offset, self.key_offset + self.num_keys, device=q_pos.device)
            hidden = k_pos > q_pos  # [G', T, keys]
            if window > 0:
                hidden |= k_pos <= q_pos - window
            g, t, keys = hidden.shape
            hkv = self.kv_rows.shape[1]
            bias = torch.zeros(hidden.shape, dtype=dtype, device=q_pos.device).masked_fill_(hidden, float("-inf"))
            # Every kv head and every query head of its group sees the same positions.
            self._biases[key] = bias[:, None, :, None, :].expand(g, hkv, t, group_size, keys).reshape(
                g * hkv, t * group_size, keys)
        return self._biases[key]


class TorchBackend:
    """Vectorized paged attention in plain PyTorch (name "torch"); same results as the reference.

    Cascade attention (vLLM's name; FlashInfer's "shared prefix"): when at least
    ``cascade_min_reqs`` decodes all start with the same ``cascade_min_blocks`` or more blocks (a
    system prompt served by the prefix cache), the shared prefix's K/V are gathered once and every
    query meets them in one matmul per kv head; only each request's own tail is gathered per
    request. Scores of both parts go through one softmax, so the result is the same attention.
    ``cascade_min_reqs=0`` turns it off.

    Invariant: ``_plan`` caches the tiling of exactly one (BatchMeta object, kv head count, window)
    key (``_plan_key``) — a new step brings a new BatchMeta, re-planned on the first layer's call.
    """

    name = "torch"

    def __init__(self, tile_rows: int = DEFAULT_TILE_ROWS, max_chunk_elems: int = DEFAULT_MAX_CHUNK_ELEMS,
                 cascade_min_reqs: int = DEFAULT_CASCADE_MIN_REQS,
                 cascade_min_blocks: int = DEFAULT_CASCADE_MIN_BLOCKS) -> None:
        if tile_rows < 1:
            raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
        if max_chunk_elems < 1:
            raise ValueError(f"max_chunk_elems must be >= 1, got {max_chunk_elems}")
        if cascade_min_reqs < 0 or cascade_min_blocks < 1:
            raise ValueError(f"cascade_min_reqs must be >= 0 and cascade_min_blocks >= 1, "
                             f"got {cascade_min_reqs} and {cascade_min_blocks}")
        self.tile_rows = tile_rows
        self.max_chunk_elems = max_chunk_elems
        self.cascade_min_reqs = cascade_min_reqs
        self.cascade_min_blocks = cascade_min_blocks
        self._plan_key: tuple[BatchMeta, int, int] | None = None
        self._plan: list[_TileGroup] = []
        self._offsets: dict[tuple, torch.Tensor] = {}  # _within_block's tables, built once

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return zero_pools(shape, dtype, device)

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        k_pool, v_pool = cache
        write_kv(k_pool, v_pool, k, v, meta.slot_mapping)  # the reference's scatter serves here too

    # ----- planning (once per step) ------------------------------------------------------
    def plan(self, meta: BatchMeta, num_kv_heads: int, window: int = 0) -> list[_TileGroup]:
        """The tile groups of ``meta`` (cached: every layer of a step shares one plan)."""
        key = self._plan_key
        if key is None or key[0] is not meta or key[1] != num_kv_heads or key[2] != window:
            self._plan = self._make_plan(meta, num_kv_heads, window)
            self._plan_key = (meta, num_kv_heads, window)
        return self._plan

    def _make_plan(self, meta: BatchMeta, num_kv_heads: int, window: int = 0) -> list[_TileGroup]:
        n = meta.query_start_loc_cpu.shape[0] - 1
        if meta.max_query_len == 1 and int(meta.query_start_loc_cpu[-1]) == n and bool(meta.seq_lens_cpu.min() > 0):
            # The common step: nothing to tile.
            return [self._decode_group(meta, num_kv_heads, self._common_prefix_blocks(meta, window))]
        # Host-side index arithmetic on R-sized arrays: numpy, because a torch op on a tiny CPU
        # tensor costs several microseconds and this runs every step.
        qsl = meta.query_start_loc_cpu.numpy().astype(np.int64)  # [R + 1]
        seq_lens = meta.seq_lens_cpu.numpy().astype(np.int64)  # [R]
        num_rows = np.diff(qsl)  # [R]
        real = (seq_lens > 0) & (num_rows > 0)  # seq_len 0: a padding request, left at zero
        groups = []
        for tile_rows, members in ((1, real & (num_rows == 1)), (self.tile_rows, real & (num_rows > 1))):
            reqs = np.flatnonzero(members)  # [Rg]
            if reqs.size:
                groups.append(self._make_group(meta, reqs, qsl, seq_lens, tile_rows, num_kv_heads))
        return groups

    def _make_group(self, meta: BatchMeta, reqs: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray,
                    tile_rows: int, num_kv_heads: int) -> _TileGroup:
        t = qsl[reqs + 1] - qsl[reqs]  # [Rg] rows per request
        tiles_per_req = -(-t // tile_rows)  # [Rg]
        tile_req = np.repeat(reqs, tiles_per_req)  # [G] request of each tile
        # Index of each tile within its request: 0, 1, ... restarting at every request.
        first_tile = np.cumsum(tiles_per_req) - tiles_per_req  # [Rg]
        tile_idx = np.arange(tile_req.size) - np.repeat(first_tile, tiles_per_req)  # [G]
        offset = tile_idx[:, None] * tile_rows + np.arange(tile_rows)  # [G, T] row within its request
        t_tile = np.repeat(t, tiles_per_req)[:, None]  # [G, 1]
        row_valid = offset < t_tile
        offset = np.minimum(offset, t_tile - 1)  # padding rows repeat the last real row
        rows = qsl[tile_req][:, None] + offset  # [G, T]
        out_rows = np.where(row_valid, rows, qsl[-1])  # padding rows land in scratch row N
        # A request's t rows end its context: row j is position seq_len - t + j.
        q_pos = seq_lens[tile_req][:, None] - t_tile + offset  # [G, T]
        identity = tile_rows == 1 and rows.size == qsl[-1] and bool((rows[:, 0] == np.arange(rows.size)).all())
        device = meta.block_table.device
        # One host -> device copy for the three [G, T] index arrays, one for the tiles' requests.
        q_rows, out_rows, q_pos = torch.from_numpy(np.stack([rows, out_rows, q_pos])).to(
            device, non_blocking=True).unbind(0)
        tile_req_dev = torch.from_numpy(tile_req).to(device, non_blocking=True)
        bs = meta.block_size
        width = -(-int(seq_lens[reqs].max()) // bs)  # W blocks cover the group's longest context
        tables = meta.block_table[:, :width].index_select(0, tile_req_dev)  # [G, W]
        return _TileGroup(q_rows=q_rows, out_rows=out_rows, q_pos=q_pos,
                          kv_rows=self._kv_rows(tables, bs, num_kv_heads), identity=identity, tables=tables)

    def _decode_group(self, meta: BatchMeta, num_kv_heads: int, prefix_blocks: int = 0) -> _TileGroup:
        """A pure-decode step without padding requests: row r is request r's only query, so
        every index comes straight from the metadata (no tiling, no host arithmetic). With
        ``prefix_blocks`` > 0, the table's first ``prefix_blocks`` columns (the same in every row)
        become the cascade prefix."""
        bs = meta.block_size
        width = -(-meta.max_seq_len // bs)
        rows = torch.arange(meta.seq_lens.shape[0], device=meta.seq_lens.device)[:, None]  # [R, 1]
        tables = meta.block_table[:, :width]  # [R, W]
        full_tables = tables
        prefix = None
        if prefix_blocks:
            prefix = self._kv_rows(tables[:1, :prefix_blocks], bs, num_kv_heads)[0]  # [Hkv, P]
            tables = tables[:, prefix_blocks:]  # [R, W - prefix_blocks]
        return _TileGroup(q_rows=rows, out_rows=rows, q_pos=(meta.seq_lens.long() - 1)[:, None],
                          kv_rows=self._kv_rows(tables, bs, num_kv_heads), identity=True, tables=full_tables,
                          prefix_rows=prefix, key_offset=prefix_blocks * bs)

    def _common_prefix_blocks(self, meta: BatchMeta, window: int) -> int:
        """How many leading blocks a pure-decode batch can treat as one shared prefix (0: none).

        Every request's table must start with the same blocks, every query must see all of the
        prefix (no sliding window that could hide part of it) and keep at least its own position
        outside it. Read from the host block table, so only when the batch lives on the CPU (on a
        GPU the Triton backend serves decodes, and this check would cost a device sync).
        """
        r = meta.num_reqs
        if (self.cascade_min_reqs == 0 or r < self.cascade_min_reqs or window > 0
                or meta.block_table.device.type != "cpu"):
            return 0
        # Blocks wholly before every request's own query position: [0, limit).
        limit = (int(meta.seq_lens_cpu.min()) - 1) // meta.block_size
        if limit < self.cascade_min_blocks:
            return 0
        tables = meta.block_table[:, :limit].numpy()  # [R, limit]
        same = (tables == tables[0]).all(axis=0)  # [limit] column j is one block for everyone
        shared = limit if same.all() else int(same.argmin())
        return shared if shared >= self.cascade_min_blocks else 0

    def _kv_rows(self, tables: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
        """tables [G, W] -> int64 [G, Hkv, W * block_size]: the row of the pool, viewed as
        ``[slots * Hkv, D]``, that holds kv head h of each key position of each tile's request.

        Block b, offset i, head h sits at row (b * bs + i) * Hkv + h; laid out [G, Hkv, W, bs] so
        each (tile, head) reads its keys in position order.
        """
        g, width = tables.shape
        rows = ((tables.long() * (block_size * num_kv_heads))[:, None, :, None]
                + self._within_block(block_size, num_kv_heads, tables.device))  # [G, Hkv, W, bs]
        return rows.reshape(g, num_kv_heads, width * block_size)

    def _within_block(self, block_size: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
        """int64 [Hkv, 1, block_size]: i * Hkv + h, the row offset of (offset i, head h) in a block."""
        key = (block_size, num_kv_heads, device)
        if key not in self._offsets:
            self._offsets[key] = (torch.arange(num_kv_heads, device=device)[:, None, None]
                                  + torch.arange(block_size, device=device)[None, None, :] * num_kv_heads)
        return self._offsets[key]

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
        groups = self.plan(meta, hkv, window)
        if len(groups) == 1 and groups[0].identity:
            # Pure decode: row i is tile i, so no gather of q rows and no scatter of results.
            o = self._forward_identity(q, cache, groups[0], scale, window)
            if o is not None:
                return o
        out = q.new_zeros((n + 1, hq, d))  # row N is scratch for the tiles' padding rows
        for group in groups:
            self._forward_group(q, cache, group, scale, window, out)
        return out[:n]

    def _forward_identity(self, q: torch.Tensor, cache: KVCache, group: _TileGroup, scale: float,
                          window: int) -> torch.Tensor | None:
        """A pure-decode batch in one chunk, when its K/V fit ``max_chunk_elems`` (else None)."""
        n, hq, d = q.shape
        if group.num_keys * cache[0].shape[2] * d * n > self.max_chunk_elems:
            return None
        return self._attend(q, cache[0], cache[1], group, slice(0, n), scale, window).view(n, hq, d)

    def _forward_group(self, q: torch.Tensor, cache: KVCache, group: _TileGroup, scale: float, window: int,
                       out: torch.Tensor) -> None:
        """One tile group, in chunks of tiles whose gathered K/V fit ``max_chunk_elems``, into ``out``."""
        d, hkv = q.shape[-1], cache[0].shape[2]
        chunk = max(1, self.max_chunk_elems // (group.num_keys * hkv * d))
        for start in range(0, group.num_tiles, chunk):
            tiles = slice(start, start + chunk)
            o = self._attend(q.index_select(0, group.q_rows[tiles].flatten()), cache[0], cache[1], group, tiles,
                             scale, window)
            # Real rows are distinct; only padding rows share the scratch row (dropped by the caller).
            out.index_copy_(0, group.out_rows[tiles].flatten(), o)

    def _attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: _TileGroup,
                tiles: slice, scale: float, window: int) -> torch.Tensor:
        """Attention for one chunk of a group's tiles: q [G' * T, Hq, D] (the tiles' rows in order)
        -> [G' * T, Hq, D]."""
        rows, hq, d = q.shape
        hkv = k_pool.shape[2]
        group_size = hq // hkv
        work = work_dtype(q.dtype)
        kv_rows = group.kv_rows[tiles]  # [G', Hkv, keys]
        g = kv_rows.shape[0]
        t = rows // g
        k, v = _gather(k_pool, kv_rows, work), _gather(v_pool, kv_rows, work)  # [G' * Hkv, keys, D]
        # Query head h reads kv head h // group_size: fold the group into the query axis
        # (a view when T == 1). [G' * T, Hq, D] -> [G' * Hkv, T * group, D]
        qt = q.to(work).view(g, t, hkv, group_size, d).transpose(1, 2).reshape(g * hkv, t * group_size, d)
        bias = group.bias(tiles, group_size, window, work)  # [G' * Hkv, T * group, keys]
        if group.prefix_rows is not None:
            o = self._attend_cascade(qt, k, v, bias, k_pool, v_pool, group.prefix_rows, g, scale, work)
        elif t == 1:
            # Decode tiles: scores are small, so plain batched matmuls are fastest.
            scores = torch.baddbmm(bias, qt, k.transpose(1, 2), alpha=scale)
            probs = torch.softmax(scores, dim=-1)  # every query sees at least its own key: no NaN
            o = torch.bmm(probs, v)  # [G' * Hkv, T * group, D]
        else:
            # Prefill tiles: the fused kernel never materialises the [T * group, keys] scores
            # (allocating those anew every layer costs more than the arithmetic on a CPU).
            o = F.scaled_dot_product_attention(qt[:, None], k[:, None], v[:, None], attn_mask=bias[:, None],
                                               scale=scale)[:, 0]
        return o.view(g, hkv, t, group_size, d).transpose(1, 2).reshape(rows, hq, d).to(q.dtype)

    @staticmethod
    def _attend_cascade(qt: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                        k_pool: torch.Tensor, v_pool: torch.Tensor, prefix_rows: torch.Tensor, g: int,
                        scale: float, work: torch.dtype) -> torch.Tensor:
        """Decode tiles over a shared prefix plus their own tails: qt [G' * Hkv, group, D], the
        tails' k, v [G' * Hkv, S, D] and bias [G' * Hkv, group, S] -> [G' * Hkv, group, D].

        The prefix's K/V [Hkv, P, D] are gathered once; its scores for all G' tiles are one matmul
        per kv head ([Hkv, G' * group, D] x [Hkv, D, P]). Prefix and tail scores are joined for
        one softmax, so each query's weights sum to one over all its keys, as without the split.
        """
        hkv, p = prefix_rows.shape
        d, group_size = qt.shape[-1], qt.shape[1]
        k_pre, v_pre = _gather(k_pool, prefix_rows, work), _gather(v_pool, prefix_rows, work)  # [Hkv, P, D]
        by_head = qt.view(g, hkv, group_size, d).transpose(0, 1).reshape(hkv, g * group_size, d)
        pre = torch.bmm(by_head, k_pre.transpose(1, 2)).mul_(scale)  # [Hkv, G' * group, P]
        pre = pre.view(hkv, g, group_size, p).transpose(0, 1).reshape(g * hkv, group_size, p)
        tail = torch.baddbmm(bias, qt, k.transpose(1, 2), alpha=scale)  # [G' * Hkv, group, S]
        probs = torch.softmax(torch.cat([pre, tail], dim=-1), dim=-1)  # [G' * Hkv, group, P + S]
        pre_probs = probs[:, :, :p].reshape(g, hkv, group_size, p).transpose(0, 1).reshape(hkv, g * group_size, p)
        o_pre = torch.bmm(pre_probs, v_pre)  # [Hkv, G' * group, D]
        o_pre = o_pre.view(hkv, g, group_size, d).transpose(0, 1).reshape(g * hkv, group_size, d)
        return torch.baddbmm(o_pre, probs[:, :, p:], v)  # + the tails' share
