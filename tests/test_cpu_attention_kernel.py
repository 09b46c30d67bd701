"""The paged decode kernel's rows (``cpu_paged_kernel.cpp``) against plain float64 attention, row by row.

The kernel's AVX-512 build serves float32 and bfloat16 rows of head sizes 32 / 64 / 96 / 128 / 256
16 keys at a time (the "blocked" path: a chunk of 16 positions may span blocks, and the last one
of a row is short); every other row takes its older loops (one score at a time, or one lane at a
time). Here each path meets the cases that stress it: chunks with fewer than 16 visible keys,
windows that start mid-block, block sizes 1 / 8 / 16 / 32, query groups G = 1 / 2 / 3 / 4 / 8, the rows
of one prefill chunk (each with its own causal limit), padding rows, float64 pools, two threads,
and the builds a CPU without AVX-512 (``avx2``) or without AVX512-BF16 runs, forced here.
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.given

# max |got - float64 oracle|: float32 and float64 in their own precision; bfloat16 rounds once, at
# the output (half a bf16 ulp of the value, plus float arithmetic's share)
BF16_HALF_ULP = 2.0 ** -8


def oracle(q, k_pool, v_pool, tables, q_pos, scale, window):
    """Plain float64 attention of each row: [R, Hq, D] float64 (padding rows, q_pos < 0: zeros)."""
    rows, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    group = hq // hkv
    out = torch.zeros(rows, hq, d, dtype=torch.float64)
    k_flat, v_flat = k_pool.reshape(-1, hkv, d).double(), v_pool.reshape(-1, hkv, d).double()
    for r in range(rows):
        last = int(q_pos[r])
        if last < 0:
            continue
        first = max(0, last - window + 1) if window > 0 else 0
        p = torch.arange(first, last + 1)
        slots = tables[r, p // bs].long() * bs + p % bs
        keys, values = k_flat[slots], v_flat[slots]  # [n, Hkv, D]
        for j in range(hq):
            weights = torch.softmax(keys[:, j // group] @ q[r, j].double() * scale, dim=0)
            out[r, j] = weights @ values[:, j // group]
    return out


def random_rows(seed, dtype, bs, hq, hkv, d, positions, prefill_chunk=0):
    """Pools of random blocks and one row per position (-1: a padding row), each row its own random
    block table; with ``prefill_chunk`` > 0 that many more rows of ONE request (one table) at
    consecutive positions ending at its context. Returns (q, k_pool, v_pool, tables, q_pos)."""
    gen = torch.Generator().manual_seed(seed)
    positions = list(positions)
    if prefill_chunk:
        context = max(positions) + 1
        positions += list(range(context - prefill_chunk, context))
    width = max(positions) // bs + 1
    rows = len(positions)
    num_blocks = rows * width + 3
    k_pool = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:rows * width].view(rows, width).to(torch.int32)
    if prefill_chunk:
        tables[-prefill_chunk:] = tables[-1]  # one request: one table for its rows
    q = torch.randn(rows, hq, d, generator=gen).to(dtype)
    return q, k_pool, v_pool, tables, torch.tensor(positions, dtype=torch.int64)


def check(lib, dtype, bs, hq, hkv, d, positions, window=0, prefill_chunk=0, seed=0, what=""):
    from engine.fast.cpu_attention import CPUBackend

    q, k_pool, v_pool, tables, q_pos = random_rows(seed, dtype, bs, hq, hkv, d, positions, prefill_chunk)
    scale = 1 / math.sqrt(d)
    got = CPUBackend()._run(q, (k_pool, v_pool), tables, q_pos, scale, window, lib=lib)
    assert got.dtype == dtype and got.shape == q.shape
    want = oracle(q, k_pool, v_pool, tables, q_pos, scale, window)
    err = (got.double() - want).abs()
    if dtype == torch.bfloat16:
        bound = BF16_HALF_ULP * want.abs() + 1e-5
    else:
        bound = torch.full_like(want, 1e-12 if dtype == torch.float64 else 1e-5)
    where = f"{what} {dtype}, bs={bs}, Hq={hq}, Hkv={hkv}, D={d}, window={window}, positions={positions}"
    assert bool((err <= bound).all()), f"{where}: {err.max().item():.2e} from float64 attention"
    padding = q_pos < 0
    assert bool((got[padding] == 0).all()), f"{where}: padding rows must be zeros"


# Positions: 0 (one key), short chunks (3, 15 keys), exactly 16 and 17 keys, a long row (several
# chunks, the last one short), and a padding row.
POSITIONS = (0, 2, 14, 15, 16, 100, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_blocked_rows_every_head_size(dtype, head_dim):
    """Each head size the blocked path is built for, over short and long rows, G = 2."""
    from engine.fast.cpu_attention import load_kernel

    check(load_kernel("native"), dtype, 16, 4, 2, head_dim, POSITIONS, what="native")


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1)])
def test_blocked_rows_block_sizes_and_groups(block_size, hq, hkv):
    """Block sizes 1 / 8 / 16 / 32 (a chunk of 16 keys spans several blocks, or half of one) and
    G = 1 / 2 / 3 / 4 / 8 query heads per kv head (scores in pairs of heads and a last single one;
    whole tiles of the weighted sum, and remainders), with and without a window that starts mid-block."""
    from engine.fast.cpu_attention import load_kernel

    lib = load_kernel("native")
    for dtype in (torch.bfloat16, torch.float32):
        for window in (0, 7, 21):
            check(lib, dtype, block_size, hq, hkv, 64, POSITIONS, window=window, seed=block_size + hq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_prefill_chunk_rows_each_with_its_causal_limit(dtype):
    """The rows of one prefill chunk (one table, consecutive positions), beside decode rows; G = 4."""
    from engine.fast.cpu_attention import load_kernel

    lib = load_kernel("native")
    for d in (64, 128):
        check(lib, dtype, 16, 8, 2, d, (5, 40), prefill_chunk=19, seed=d)
        check(lib, dtype, 16, 8, 2, d, (5, 40), window=9, prefill_chunk=19, seed=d)


@pytest.mark.parametrize("head_dim", [8, 24, 72])
def test_other_head_sizes_take_the_older_loops(head_dim):
    """Head sizes outside the blocked path (8 and 24: one lane at a time; 72: a multiple of 8, not
    of 16 or 32), float32 / bfloat16 / float64."""
    from engine.fast.cpu_attention import load_kernel

    lib = load_kernel("native")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        check(lib, dtype, 16, 4, 2, head_dim, POSITIONS, window=11, what="native")


@pytest.mark.parametrize("variant", ["avx2", "dpbf16", "avx512 without bf16 dot products", "native, blocked path off",
                                     "native, prefetch off"])
def test_other_builds_and_the_older_loops(variant):
    """The builds other CPUs run, forced here: ``avx2`` (32-byte vectors, no bf16 dot products:
    the older loops), ``dpbf16`` (the blocked path's bf16 scores as vdpbf16ps dot products, where
    the CPU has AVX512-BF16; elsewhere the native code), the AVX-512 build without AVX512-BF16 (the
    older loops' bf16 keys widened, not dot products), the native build with its blocked path switched off (``paged_set_blocked(0)``), and
    with its prefetch off (``paged_set_prefetch(0)``: no row asks for the next one's keys)."""
    from engine.fast import cpu_attention, cpu_build

    if variant in ("avx2", "dpbf16"):
        lib = cpu_attention.load_kernel(variant)
    elif variant.startswith("avx512"):
        if "avx512f" not in cpu_build.cpu_signature().split():
            pytest.skip("this CPU has no AVX-512 F: the build cannot run here")
        lib = cpu_build.OptionalKernels(cpu_attention.SOURCE, cpu_attention._declare, extra=("-DATTN_NO_DPBF16",)).get()
        assert lib is not None, "the AVX-512 build without bf16 dot products did not build"
    else:
        lib = cpu_attention.load_kernel("native")
    if variant.endswith("blocked path off"):
        lib.paged_set_blocked(0)
    if variant.endswith("prefetch off"):
        lib.paged_set_prefetch(0)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            for d, bs, hq, hkv in ((64, 16, 8, 4), (128, 8, 8, 1), (96, 32, 4, 4)):
                check(lib, dtype, bs, hq, hkv, d, POSITIONS, window=0, what=variant)
                check(lib, dtype, bs, hq, hkv, d, POSITIONS, window=13, prefill_chunk=6, what=variant)
    finally:
        lib.paged_set_blocked(1)
        lib.paged_set_prefetch(1)


def test_blocked_rows_on_two_threads():
    """Rows shared by two real torch threads (``share``) give the same results as one thread."""
    from engine.fast.cpu_attention import CPUBackend, load_kernel

    lib = load_kernel("native")
    q, k_pool, v_pool, tables, q_pos = random_rows(7, torch.bfloat16, 16, 8, 2, 128, list(range(0, 160, 7)) + [-1] * 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = CPUBackend()._run(q, (k_pool, v_pool), tables, q_pos, 0.1, 0, lib=lib)
        torch.set_num_threads(2)
        two = CPUBackend()._run(q, (k_pool, v_pool), tables, q_pos, 0.1, 0, lib=lib)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two), "rows split over two threads changed a result"
