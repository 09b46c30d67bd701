"""Chapter 32's paged-attention kernel in Triton. Importing this module imports triton.

One program computes one *query tile* (up to ``TILE_ROWS`` consecutive rows of one request) for
one kv head and every query head that reads it (grouped-query attention folds the group into the
tile's rows: ``TILE_ROWS * GROUP`` query vectors share each K/V load). It walks the request's
keys ``BLOCK_N`` positions at a time, finds each position's pool slot through the block table
(``table[p // block_size] * block_size + p % block_size``), loads K and V straight from the
pool, and keeps an online softmax (running max ``m``, running sum ``l``, unnormalised output
``acc``), so no score matrix is ever stored. Causality: a query at position q sees keys p <= q;
with a sliding window w also p > q - w. A decode tile is one row; a prefill tile is a run of rows
whose queries are the last positions of the request's context, so the cached prefix is read in
full and the chunk itself causally.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the same kernel runs on CPU
tensors, slowly, which is how the tests check it without a GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr,
    tile_req_ptr, tile_row_ptr, tile_rows_ptr, tile_pos_ptr,
    scale, window, block_size,
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)  # first flat row of the tile
    num_rows = tl.load(tile_rows_ptr + tile)  # real rows in the tile (<= TILE_ROWS)
    pos0 = tl.load(tile_pos_ptr + tile)  # position of the tile's first query

    # Query vector m of the tile is (row m // GROUP_PAD, head m % GROUP_PAD of this kv head's group).
    m = tl.arange(0, TILE_ROWS * GROUP_PAD)
    t = m // GROUP_PAD
    g = m % GROUP_PAD
    m_real = (t < num_rows) & (g < GROUP)
    q_pos = pos0 + t  # [M]
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_real = d < HEAD_DIM
    q_off = (row0 + t)[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_real[:, None] & d_real[None, :], other=0.0).to(tl.float32) * scale
    # Dots take the pool's dtype (bfloat16 / float16 run on tensor cores; float32 stays exact with
    # "ieee"), unless DOT_F32 asks for float32 throughout (the interpreter's 16-bit dot is wrong).
    if not DOT_F32:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([TILE_ROWS * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_ROWS * GROUP_PAD], tl.float32)
    acc = tl.zeros([TILE_ROWS * GROUP_PAD, BLOCK_D], tl.float32)

    last = pos0 + num_rows - 1  # the tile's last query position: no key beyond it is visible
    # With a window w the tile's first query sees keys from pos0 - w + 1 on: skip whole key
    # blocks before that (rounded down to BLOCK_N; the mask handles the rest).
    first = tl.where(window > 0, tl.maximum(pos0 - window + 1, 0), 0)
    first = (first // BLOCK_N) * BLOCK_N
    for start in range(first, last + 1, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        p_real = p <= last
        block = tl.load(table_ptr + req * stride_table + p // block_size, mask=p_real, other=0).to(tl.int64)
        within = p % block_size
        kv_real = p_real[:, None] & d_real[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + within[:, None] * stride_ks + kv_head * stride_kh
                    + d[None, :], mask=kv_real, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + block[:, None] * stride_vb + within[:, None] * stride_vs + kv_head * stride_vh
                    + d[None, :], mask=kv_real, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, BLOCK_N], float32
        visible = (p[None, :] <= q_pos[:, None]) & p_real[None, :]
        visible = visible & ((window <= 0) | (p[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A query that has seen no key yet keeps m = -inf; shift by 0 instead (exp(-inf) = 0).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        prob = tl.exp(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (row0 + t)[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=m_real[:, None] & d_real[None, :])
