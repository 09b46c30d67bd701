"""Fast attention backends against the reference, and the engine on the fast backend.

``TorchBackend`` ("torch") must give the reference backend's output on any ragged batch: decodes,
prefill chunks over a cached prefix, fresh prompts longer than one query tile, grouped-query
heads, sliding windows, padding requests, block sizes from 1 up. Then the whole engine on the
"torch" backend must reproduce ``generate()`` token for token on the milestone's workload.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.generate import generate
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams
from engine.serve.attention import ReferenceBackend
from engine.serve.registry import ATTENTION_BACKENDS as BACKENDS, get_backend
from engine.serve.batch import build_batch
from engine.serve.request import Request
from engine.fast.torch_attention import TorchBackend

pytestmark = pytest.mark.given  # the backends are complete code; the reference holes serve as oracle


def random_paged_batch(seed: int, block_size: int, hq: int, hkv: int, head_dim: int = 8,
                       num_reqs: int = 7, pad: int = 2, dtype: torch.dtype = torch.float32,
                       decode_only: bool = False):
    """A ragged batch over a random pool: returns (q [N, Hq, D], (k_pool, v_pool), meta).

    Request kinds, drawn at random: a decode (n = 1 after c computed tokens), a chunk over a
    cached prefix (c > 0, n > 1), a fresh prompt (c = 0), sometimes longer than a query tile.
    Tables are random distinct blocks, so a wrong block lookup reads someone else's K/V.
    """
    gen = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    scheduled, lens = [], []
    for r in range(num_reqs):
        kind = 0 if decode_only else randint(0, 3)
        if kind == 0:
            c, n = randint(1, 70), 1
        elif kind == 1:
            c, n = randint(1, 40), randint(2, 20)
        elif kind == 2:
            c, n = 0, randint(1, 12)
        else:
            c, n = randint(0, 10), randint(33, 75)  # more rows than one 32-row tile
        req = Request(f"r{r}", torch.randint(0, 100, (c + n + 1,), generator=gen).tolist())
        req.num_computed_tokens = c
        scheduled.append((req, n))
        lens.append(c + n)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(perm[at:at + k])
        at += k
    batch = build_batch(scheduled, tables, block_size, pad_to=num_reqs + pad)
    shape = (num_blocks + 1, block_size, hkv, head_dim)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(batch.input_ids.shape[0], hq, head_dim, generator=gen).to(dtype)
    return q, (k_pool, v_pool), batch.meta


CASES = [  # (seed, block_size, Hq, Hkv, window)
    (0, 16, 4, 2, 0), (1, 4, 4, 4, 0), (2, 1, 8, 2, 0), (3, 3, 6, 3, 5), (4, 16, 4, 1, 17),
    (5, 8, 4, 2, 1), (6, 5, 2, 2, 0), (7, 16, 8, 4, 40), (8, 4, 6, 2, 0),
]


@pytest.mark.parametrize("seed,block_size,hq,hkv,window", CASES)
def test_torch_backend_matches_reference(seed, block_size, hq, hkv, window):
    q, cache, meta = random_paged_batch(seed, block_size, hq, hkv)
    want = ReferenceBackend().forward(q, cache, meta, window=window)
    for backend in (TorchBackend(), TorchBackend(tile_rows=5, max_chunk_elems=1)):
        got = backend.forward(q, cache, meta, window=window)
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err < 1e-5, (f"TorchBackend(tile_rows={backend.tile_rows}) differs from the reference "
                            f"by {err:.2e} (block_size={block_size}, Hq={hq}, Hkv={hkv}, window={window})")
    num_real = int((meta.seq_lens_cpu > 0).sum())
    pad_rows = got[int(meta.query_start_loc_cpu[num_real]):]  # build_batch(pad_to=...) rows
    assert pad_rows.numel() > 0 and pad_rows.abs().max().item() == 0.0, \
        "padding rows (seq_len 0) must come back as zeros"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [0, 9])
def test_torch_backend_pure_decode(window, threads, monkeypatch):
    """A batch of decodes only (the common step) takes the no-gather path; padded, the general one.
    The cpu backend's kernel serves it in one call, or split over two threads."""
    from engine.fast.cpu_attention import CPUBackend

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the kernel splits rows by torch's setting
    for pad in (0, 3):
        q, cache, meta = random_paged_batch(30 + pad, 16, 4, 2, num_reqs=9, pad=pad, decode_only=True)
        want = ReferenceBackend().forward(q, cache, meta, window=window)
        for backend in (TorchBackend(), TorchBackend(max_chunk_elems=1), CPUBackend()):  # one chunk / per tile / kernel
            got = backend.forward(q, cache, meta, window=window)
            assert (got - want).abs().max().item() < 1e-5, \
                f"pure decode batch (pad={pad}, window={window}, max_chunk_elems={backend.max_chunk_elems})"


def shared_prefix_decode_batch(seed: int, block_size: int, hq: int, hkv: int, num_reqs: int, shared: int,
                               diverge_at: int | None = None, head_dim: int = 8):
    """Decodes whose tables all start with the same ``shared`` blocks (a cached system prompt),
    then private blocks; with ``diverge_at``, request 1 has its own block at that column instead.
    Returns (q, cache, meta)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = shared + num_reqs * 8 + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    common, free = perm[:shared], perm[shared:]
    scheduled, tables = [], []
    for r in range(num_reqs):
        seq_len = shared * block_size + 1 + int(torch.randint(0, 4 * block_size, (), generator=gen))
        req = Request(f"r{r}", torch.randint(0, 100, (seq_len,), generator=gen).tolist())
        req.num_computed_tokens = seq_len - 1  # a decode: its last token is this step's query
        own = -(-seq_len // block_size) - shared
        table = common + free[:own]
        free = free[own:]
        if r == 1 and diverge_at is not None:
            table[diverge_at] = free.pop()
        scheduled.append((req, 1))
        tables.append(table)
    batch = build_batch(scheduled, tables, block_size)
    shape = (num_blocks + 1, block_size, hkv, head_dim)
    cache = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return torch.randn(num_reqs, hq, head_dim, generator=gen), cache, batch.meta


@pytest.mark.parametrize("seed,block_size,hq,hkv,shared,diverge_at", [
    (40, 16, 4, 2, 3, None), (41, 4, 6, 3, 6, None), (42, 1, 8, 2, 9, None), (43, 8, 4, 4, 5, 2),
    (44, 4, 4, 1, 7, 0),
])
def test_torch_backend_cascade_matches_reference(seed, block_size, hq, hkv, shared, diverge_at):
    """Decodes sharing their first blocks meet the shared prefix in one matmul (cascade attention):
    same output as the reference, and the prefix is exactly the blocks every table has in common."""
    q, cache, meta = shared_prefix_decode_batch(seed, block_size, hq, hkv, num_reqs=9, shared=shared,
                                                diverge_at=diverge_at)
    want = ReferenceBackend().forward(q, cache, meta)
    common = shared if diverge_at is None else diverge_at
    for backend in (TorchBackend(cascade_min_reqs=2, cascade_min_blocks=1),
                    TorchBackend(cascade_min_reqs=2, cascade_min_blocks=1, max_chunk_elems=1)):
        got = backend.forward(q, cache, meta)
        group, = backend._plan
        assert group.key_offset == common * block_size, \
            f"cascade prefix should be the {common} blocks every table shares, got {group.key_offset} positions"
        assert (group.prefix_rows is not None) == (common > 0)
        err = (got - want).abs().max().item()
        assert err < 1e-5, f"cascade decode differs from the reference by {err:.2e} (shared={shared})"
    # Too few requests or too short a prefix for the thresholds: the plain decode path, same answer.
    for backend in (TorchBackend(cascade_min_reqs=10), TorchBackend(cascade_min_blocks=shared + 1),
                    TorchBackend(cascade_min_reqs=0)):
        assert (backend.forward(q, cache, meta) - want).abs().max().item() < 1e-5
        assert backend._plan[0].prefix_rows is None


def test_torch_backend_cascade_skipped_under_a_sliding_window():
    """A window could hide part of the prefix from some queries: no cascade, still exact."""
    q, cache, meta = shared_prefix_decode_batch(45, 4, 4, 2, num_reqs=8, shared=6)
    backend = TorchBackend(cascade_min_reqs=2, cascade_min_blocks=1)
    for window in (0, 7):
        want = ReferenceBackend().forward(q, cache, meta, window=window)
        got = backend.forward(q, cache, meta, window=window)
        assert (got - want).abs().max().item() < 1e-5, f"window={window}"
        assert (backend._plan[0].prefix_rows is not None) == (window == 0)


def test_torch_backend_bfloat16():
    q, cache, meta = random_paged_batch(12, 16, 4, 2, dtype=torch.bfloat16)
    want = ReferenceBackend().forward(q, cache, meta)
    got = TorchBackend().forward(q, cache, meta)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_torch_backend_float64_and_scale():
    q, cache, meta = random_paged_batch(11, 4, 4, 2, dtype=torch.float64)
    want = ReferenceBackend().forward(q, cache, meta, scale=0.3)
    got = TorchBackend().forward(q, cache, meta, scale=0.3)
    assert got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-12


def test_torch_backend_replans_each_step():
    """The tiling is cached per BatchMeta: a new step's metadata must not reuse the old plan."""
    backend = TorchBackend()
    for seed in (20, 21):
        q, cache, meta = random_paged_batch(seed, 16, 4, 2)
        want = ReferenceBackend().forward(q, cache, meta)
        assert (backend.forward(q, cache, meta) - want).abs().max().item() < 1e-5


def test_backend_registry():
    assert {"reference", "torch", "triton", "cpu"} <= set(BACKENDS)
    assert isinstance(get_backend("torch"), TorchBackend)
    with pytest.raises(ValueError, match="tile_rows"):
        TorchBackend(tile_rows=0)
    with pytest.raises(ValueError, match="cascade_min_reqs"):
        TorchBackend(cascade_min_blocks=0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("no-such-backend")


# ----- the engine on the fast backend ----------------------------------------------------------
PROMPT_LENS = (37, 5, 21, 50, 12)
MAX_TOKENS = (24, 30, 18, 10, 26)


@pytest.fixture(scope="module")
def milestone():
    """(model, prompts, generate()'s outputs): five prompts, the fifth sharing two blocks with the first."""
    model = tiny_model(seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[4] = prompts[0][:32] + prompts[4]
    expected = [generate(model, p, m) for p, m in zip(prompts, MAX_TOKENS)]
    return model, prompts, expected


# The milestone runs all four of its configurations on the default backend; these two pin the
# fast backends (torch, cpu) explicitly on the paths that stress them most: many small chunks, and preemption.
ENGINE_CONFIGS = {
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8),
    "swap": dict(num_blocks=10, preemption_mode="swap"),
}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_engine_on_torch_backend_matches_generate(milestone, name, backend):
    model, prompts, expected = milestone
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend=backend, **ENGINE_CONFIGS[name]))
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
    out = core.run_until_done()
    for i, want in enumerate(expected):
        got = out.get(f"r{i}")
        assert got == want, (f"config {name!r}: request r{i} on the {backend} backend gave {got}, "
                             f"generate() gave {want}")
    assert core.blocks.num_free == core.blocks.num_blocks, f"config {name!r}: blocks leaked at idle"
    if name == "swap":
        assert core.preemptions > 0, f"config {name!r} was meant to preempt"


def test_engine_with_cascade_attention_matches_generate():
    """Ten requests behind one system prompt: once they all decode, the torch backend serves the
    shared blocks as a cascade prefix; every output must still equal generate()'s."""
    model = tiny_model(seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(8)
    system = torch.randint(0, 512, (40,), generator=gen).tolist()  # 5 full blocks of 8
    prompts = [system + torch.randint(0, 512, (3 + i,), generator=gen).tolist() for i in range(10)]
    lens = [12 + 2 * i for i in range(10)]
    backend = TorchBackend(cascade_min_reqs=8, cascade_min_blocks=4)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="torch"))
    core.runner.backend = backend
    for i, (p, m) in enumerate(zip(prompts, lens)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
    prefixes, out = [], {}
    while core.has_unfinished():
        for o in core.step():
            if o.finished:
                out[o.request_id] = o.output_token_ids
        prefixes.append(backend._plan[0].key_offset if backend._plan else 0)
    assert max(prefixes) == 40, f"cascade never served the 5 shared blocks (prefix per step: {prefixes})"
    for i, (p, m) in enumerate(zip(prompts, lens)):
        assert out[f"r{i}"] == generate(model, p, m), f"request r{i} differs from generate() under cascade"


# ----- the CPU backend: decode rows read the pool in place (a C++ kernel) ----------------------
@pytest.mark.parametrize("seed,block_size,hq,hkv,window", CASES)
def test_cpu_backend_matches_reference(seed, block_size, hq, hkv, window):
    """Mixed batches: every row through the kernel (the default), or multi-row requests through the tile path."""
    from engine.fast.cpu_attention import CPUBackend

    q, cache, meta = random_paged_batch(seed, block_size, hq, hkv)
    want = ReferenceBackend().forward(q, cache, meta, window=window)
    for in_place in (True, False):  # every row through the kernel / prefill tiles through SDPA
        got = CPUBackend(prefill_in_place=in_place).forward(q, cache, meta, window=window)
        err = (got - want).abs().max().item()
        assert err < 1e-5, (f"CPUBackend(prefill_in_place={in_place}) differs from the reference by {err:.2e} "
                            f"(block_size={block_size}, Hq={hq}, Hkv={hkv}, window={window})")
        num_real = int((meta.seq_lens_cpu > 0).sum())
        assert got[int(meta.query_start_loc_cpu[num_real]):].abs().max().item() == 0.0, "padding rows must be zeros"


def test_cpu_backend_dtypes():
    """bfloat16 pools are read as bfloat16 (output bfloat16, close to the reference); float64 exact."""
    from engine.fast.cpu_attention import CPUBackend

    q, cache, meta = random_paged_batch(12, 16, 4, 2, dtype=torch.bfloat16, decode_only=True)
    got = CPUBackend().forward(q, cache, meta)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ReferenceBackend().forward(q, cache, meta).float()).abs().max().item() < 2e-2
    q, cache, meta = random_paged_batch(11, 4, 4, 2, dtype=torch.float64)
    got = CPUBackend().forward(q, cache, meta, scale=0.3)
    assert (got - ReferenceBackend().forward(q, cache, meta, scale=0.3)).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="'cpu' attention backend serves"):
        CPUBackend().allocate((2, 4, 2, 8), torch.float16, "cpu")


@pytest.mark.parametrize("pad", [0, 2])
def test_cpu_backend_decode_row_plan_is_the_general_plan(pad):
    """A pure decode step's row plan (CPUBackend._row_plan's shortcut: row r is request r, at
    position seq_len - 1, a padding request's row at -1) equals the general plan's tables and
    positions, and attention through it equals the reference's."""
    from engine.fast.cpu_attention import CPUBackend
    from engine.fast.torch_attention import TorchBackend

    q, cache, meta = random_paged_batch(40 + pad, 4, 4, 2, num_reqs=6, pad=pad, decode_only=True)
    n = q.shape[0]
    assert meta.max_query_len == 1 and n == meta.num_reqs
    tables, q_pos = CPUBackend()._row_plan(meta, n)
    # The same batch declared with a larger max_query_len takes the general plan.
    general_tables, general_pos = CPUBackend()._row_plan(dataclasses.replace(meta, max_query_len=2), n)
    assert torch.equal(tables, general_tables) and tables.dtype == torch.int32 and tables.is_contiguous()
    assert torch.equal(q_pos, general_pos) and q_pos.dtype == torch.int64
    assert torch.equal(q_pos, torch.where(meta.seq_lens_cpu > 0, meta.seq_lens_cpu.long() - 1, -1))
    got = CPUBackend().forward(q, cache, meta)
    assert (got - ReferenceBackend().forward(q, cache, meta)).abs().max().item() < 1e-5


@pytest.mark.parametrize("pool_dtype, source", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64)])
def test_cpu_backend_write_matches_write_kv(pool_dtype, source, monkeypatch):
    """CPUBackend.write (one kernel call) stores what the reference's write_kv stores: k and v read
    as strided views of a merged projection, padding rows (slot -1) into the last slot, float32 rows
    into bfloat16 pools rounded as torch rounds, bfloat16 rows copied (cpu_write_kernel.cpp); a slot
    outside the pool is a ValueError that writes nothing."""
    from engine.serve.attention import write_kv
    from engine.fast.cpu_attention import CPUBackend
    from engine.fast.torch_attention import TorchBackend

    def reference_write(*args):
        raise AssertionError("CPUBackend.write took the reference's path: these rows must take a kernel")
    monkeypatch.setattr(TorchBackend, "write", reference_write)
    _, cache, meta = random_paged_batch(13, 4, 4, 2, head_dim=8)
    n = meta.slot_mapping.shape[0]
    assert int((meta.slot_mapping < 0).sum()) > 0, "the batch must have padding rows"
    qkv = torch.randn(n, (4 + 2 + 2) * 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(source)
    if source == torch.bfloat16:  # odd bit patterns: a quiet NaN with a payload, a signalling one, subnormals, -0
        bits = qkv.view(torch.int16)
        bits[0, 32:38] = torch.tensor([0x7FC1, 0x7F81, 0x0001, -0x7FFF, -0x8000, 0x0080], dtype=torch.int16)
    k, v = qkv[:, 32:48].view(n, 2, 8), qkv[:, 48:].view(n, 2, 8)  # views, row stride 64
    want = tuple(p.to(pool_dtype).clone() for p in cache)
    write_kv(*want, k.to(pool_dtype), v.to(pool_dtype), meta.slot_mapping)
    got = tuple(p.to(pool_dtype).clone() for p in cache)
    monkeypatch.setattr(TorchBackend, "write", lambda *a: pytest.fail("the reference's write path was taken"))
    CPUBackend().write(got, k, v, meta)
    for name, g, w in zip("kv", got, want):
        same = torch.equal(g.view(torch.int16), w.view(torch.int16)) if pool_dtype == torch.bfloat16 else torch.equal(g, w)
        assert same, f"CPUBackend.write stored different {name} than write_kv ({source} rows, {pool_dtype} pool)"
    bad = meta.slot_mapping.clone()
    bad[0] = got[0].shape[0] * got[0].shape[1]  # one past the last slot
    before = tuple(p.clone() for p in got)
    with pytest.raises(ValueError, match="outside the pool"):
        CPUBackend().write(got, k, v, dataclasses.replace(meta, slot_mapping=bad))
    assert all(torch.equal(g.view(torch.int8), b.view(torch.int8)) for g, b in zip(got, before)), \
        "a refused write must store nothing"


def test_cpu_backend_write_of_odd_bfloat16_rows():
    """bfloat16 rows of an odd width (7) at an odd row stride: stored bit for bit as write_kv stores
    them (the copy kernel moves bytes, whatever the width)."""
    from engine.serve.attention import write_kv
    from engine.fast.cpu_attention import CPUBackend

    _, cache, meta = random_paged_batch(13, 4, 4, 1, head_dim=7)
    n = meta.slot_mapping.shape[0]
    qkv = torch.randn(n, 6 * 7 + 1, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # odd row stride
    k, v = qkv[:, 28:35].view(n, 1, 7), qkv[:, 35:42].view(n, 1, 7)
    want = tuple(p.to(torch.bfloat16).clone() for p in cache)
    write_kv(*want, k, v, meta.slot_mapping)
    got = tuple(p.to(torch.bfloat16).clone() for p in cache)
    CPUBackend().write(got, k, v, meta)
    assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))


def test_cpu_kernel_cache_key_names_the_cpu(monkeypatch):
    """The kernel is built with -march=native: another CPU (model or feature flags) gets its own build."""
    from engine.fast import cpu_attention, cpu_build

    here = cpu_build.kernel_path("c++", cpu_attention.SOURCE)
    assert here == cpu_build.kernel_path("c++", cpu_attention.SOURCE), "the cache key must be stable on one machine"
    monkeypatch.setattr(cpu_build, "cpu_signature", lambda: "x86_64|model name=Other CPU|flags=sse2")
    assert cpu_build.kernel_path("c++", cpu_attention.SOURCE) != here, "a kernel built for one CPU was keyed for every CPU"


def test_cpu_kernels_on_two_real_threads():
    """Both CPU kernels split their work over torch's OpenMP workers (``cpu_kernel_share.h``): on
    two real torch threads a mixed float64 batch still equals the reference, and the small-batch
    linear kernel equals ``F.linear``."""
    from engine.fast import cpu_linear
    from engine.fast.cpu_attention import CPUBackend

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, cache, meta = random_paged_batch(21, 4, 4, 2, num_reqs=12, dtype=torch.float64)
        want = ReferenceBackend().forward(q, cache, meta, window=7)
        got = CPUBackend().forward(q, cache, meta, window=7)
        assert (got - want).abs().max().item() < 1e-12, "the kernel's rows split over two threads changed a result"
        if cpu_linear.library() is not None:
            gen = torch.Generator().manual_seed(3)
            w = torch.randn(300, 64, generator=gen, dtype=torch.float64)
            x = torch.randn(40, 64, generator=gen, dtype=torch.float64)
            got = cpu_linear.SmallLinear(w.float())(x.float()).double()
            assert (got - x @ w.T).abs().max().item() < 1e-4, "the small-batch linear kernel on two threads"
    finally:
        torch.set_num_threads(before)


def test_cpu_kernel_build_boundaries(tmp_path, monkeypatch):
    """The kernel cache must be private; a compiler without OpenMP still gets a (one-thread) kernel;
    a compiler that fails outright is a ValueError naming the source."""
    import shutil
    import stat

    from engine.fast import cpu_attention, cpu_build

    real = shutil.which("c++") or shutil.which("g++")
    open_cache = tmp_path / "shared-cache"
    open_cache.mkdir()
    open_cache.chmod(0o777)
    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(open_cache))
    with pytest.raises(ValueError, match="only you can write"):
        cpu_build.build_library(cpu_attention.SOURCE)
    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(tmp_path / "cache"))
    no_openmp = tmp_path / "no-openmp-c++"
    no_openmp.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real} "$@"\n')
    no_openmp.chmod(no_openmp.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(no_openmp))
    cpu_build.build_library(cpu_attention.SOURCE)
    assert cpu_build.kernel_path(str(no_openmp), cpu_attention.SOURCE, cpu_build.SERIAL_FLAGS).exists()
    assert not cpu_build.kernel_path(str(no_openmp), cpu_attention.SOURCE).exists()
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(ValueError, match="building cpu_paged_kernel.cpp failed"):
        cpu_build.build_library(cpu_attention.SOURCE)
    # An optional library (the linear and elementwise kernels): None and the reason, asked once.
    declared = []
    optional = cpu_build.OptionalKernels(cpu_attention.SOURCE, declared.append)
    assert optional.get() is None and "building cpu_paged_kernel.cpp failed" in optional.why
    assert optional.get() is None and not declared, "a failed optional build must not be retried on every call"
    monkeypatch.setenv("CXX", real)  # a failure is remembered per (cache, $CXX): another compiler is tried
    assert optional.get() is not None and len(declared) == 1


@pytest.mark.parametrize("in_place", [True, False])
def test_cpu_backend_refuses_block_tables_outside_the_pool(in_place):
    """A block-table entry outside the pool (far past it, just past it, negative) or a context longer
    than the table is a ValueError before any key is read — never a crash or heap memory in the
    output — as the reference and torch backends refuse such a table too (they raise)."""
    from engine.fast.cpu_attention import CPUBackend

    q, cache, meta = random_paged_batch(14, 4, 4, 2, decode_only=True)
    num_blocks = cache[0].shape[0]
    backend = CPUBackend(prefill_in_place=in_place)
    assert (backend.forward(q, cache, meta) - ReferenceBackend().forward(q, cache, meta)).abs().max().item() < 1e-5
    for entry in (1 << 30, num_blocks, -3):
        table = meta.block_table.clone()
        table[1, 0] = entry
        bad = dataclasses.replace(meta, block_table=table)
        for other in (ReferenceBackend(), TorchBackend()) if entry >= 0 else ():  # they refuse it as well
            with pytest.raises((IndexError, RuntimeError, ValueError)):
                other.forward(q, cache, bad)
        with pytest.raises(ValueError, match="outside the K/V pool"):
            backend.forward(q, cache, bad)
        with pytest.raises(ValueError, match="outside the K/V pool"):
            backend.forward_rows(q, cache, bad, torch.tensor([1]))
    short = dataclasses.replace(meta, block_table=meta.block_table[:, :1].contiguous())  # too few columns
    with pytest.raises(ValueError, match="outside the K/V pool"):
        backend.forward(q, cache, short)
    with pytest.raises(ValueError, match="do not fit pools"):
        backend.write(cache, torch.zeros(q.shape[0], 2, 16), torch.zeros(q.shape[0], 2, 16), meta)


def test_cpu_backend_later_layers_reuse_only_a_call_that_fits(monkeypatch):
    """One backend serving a step's layers reuses the first layer's checked kernel call (tables,
    positions, slot mapping) in the later ones: each layer's output and stored K/V equal a fresh
    backend's, and a later call that differs from the checked one (a smaller pool the tables
    overrun, pools of another dtype, another thread count, K/V rows of another layout) is checked
    and served as a first call would be."""
    from engine.fast.cpu_attention import CPUBackend

    q, cache, meta = random_paged_batch(15, 4, 4, 2, decode_only=True)
    backend, gen = CPUBackend(), torch.Generator().manual_seed(4)
    layers = [tuple(torch.randn(cache[0].shape, generator=gen) for _ in "kv") for _ in range(3)]
    n = q.shape[0]
    for layer in layers:  # three layers of one step: the last two reuse the first's call
        kv = torch.randn(n, 2 * 2 * 8, generator=gen)
        k, v = kv[:, :16].view(n, 2, 8), kv[:, 16:].view(n, 2, 8)
        want = tuple(p.clone() for p in layer)
        CPUBackend().write(want, k, v, meta)
        backend.write(layer, k, v, meta)
        assert all(torch.equal(g, w) for g, w in zip(layer, want)), "a later layer's write stored other K/V"
        assert torch.equal(backend.forward(q, layer, meta), CPUBackend().forward(q, layer, meta))
    assert backend._call is not None and backend._write_call is not None, "the step's calls are kept"
    small = tuple(p[:2].contiguous() for p in cache)  # the tables point past its 2 blocks
    with pytest.raises(ValueError, match="outside the K/V pool"):
        backend.forward(q, small, meta)
    wide = tuple(p.double() for p in cache)
    with pytest.raises(ValueError, match="must share a dtype"):
        backend.forward(q, wide, meta)
    assert torch.equal(backend.forward(q.double(), wide, meta), CPUBackend().forward(q.double(), wide, meta))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert torch.equal(backend.forward(q, cache, meta), CPUBackend().forward(q, cache, meta))
    assert backend._call[7] == 2, "another thread count: the call is made (and kept) again"
    # K/V rows with another row layout (heads strided apart): the reference's path, the same values.
    kv = torch.randn(n, 8, 2 * 2, generator=gen)
    k, v = kv[..., :2].transpose(1, 2), kv[..., 2:].transpose(1, 2)  # [N, 2, 8], element stride 4
    want, got = tuple(p.clone() for p in cache), tuple(p.clone() for p in cache)
    CPUBackend().write(want, k, v, meta)
    backend.write(got, k, v, meta)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "rows of another layout were stored wrongly"


def test_cpu_kernel_build_with_a_bad_compiler(tmp_path, monkeypatch):
    """A $CXX that is missing, a directory or not a command line is a ValueError (and an optional
    kernel is then None with the reason), never FileNotFoundError/PermissionError; a launcher
    ("ccache g++") is split as a shell would; a compiler that hangs fails after COMPILE_TIMEOUT_S."""
    import shutil
    import stat

    from engine.fast import cpu_attention, cpu_build

    real = shutil.which("c++") or shutil.which("g++")
    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a-directory").mkdir()
    for cxx, match in [(str(tmp_path / "no-such-c++"), "is not an executable file"),
                       (str(tmp_path / "a-directory"), "is not an executable file"),
                       ("'unbalanced", "is not a command line"), ("   ", "found no C\\+\\+ compiler|not an executable")]:
        monkeypatch.setenv("CXX", cxx)
        with pytest.raises(ValueError, match=match):
            cpu_build.build_library(cpu_attention.SOURCE)
        optional = cpu_build.OptionalKernels(cpu_attention.SOURCE, lambda lib: None)
        assert optional.get() is None and optional.why
    monkeypatch.setenv("CXX", f"env {real}")  # a launcher and its compiler, as "ccache g++"
    assert cpu_build.build_library(cpu_attention.SOURCE) is not None
    slow = tmp_path / "slow-c++"
    slow.write_text("#!/bin/sh\nexec sleep 60\n")
    slow.chmod(slow.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(slow))
    monkeypatch.setattr(cpu_build, "COMPILE_TIMEOUT_S", 1)
    with pytest.raises(ValueError, match="took longer than 1 s"):
        cpu_build.build_library(cpu_attention.SOURCE)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".tmp"], "a failed build left its temp file"


def test_an_attention_kernel_that_cannot_be_built_is_tried_once(tmp_path, monkeypatch):
    """Where the attention kernel does not build, load_kernel says why in a ValueError, the same
    one each time without running the compiler again (every LLM asks, through fastest_options),
    and fastest_options falls back to the "torch" backend."""
    from engine.fast import choose
    from engine.fast import cpu_attention, cpu_build

    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setattr(cpu_attention, "_kernel", cpu_build.OptionalKernels(cpu_attention.SOURCE, cpu_attention._declare))
    builds = []
    build = cpu_build.build_library
    monkeypatch.setattr(cpu_build, "build_library", lambda source: builds.append(source) or build(source))
    for _ in range(3):
        with pytest.raises(ValueError, match="is not an executable file"):
            cpu_attention.load_kernel()
    assert choose.fastest_options("cpu", torch.float32)["attention_backend"] == "torch"
    assert len(builds) == 1, f"the failed build ran {len(builds)} times"


def test_cpu_kernel_builds_use_their_own_temporary_files(tmp_path):
    """Two builds of one library at once (two processes, or two threads of one) must never write
    the same temporary file: each compiler run gets a fresh name, renamed onto the library at the end."""
    import stat

    from engine.fast import cpu_attention, cpu_build

    log = tmp_path / "outputs.log"
    fake = tmp_path / "fake-c++"
    fake.write_text(f'#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\necho "$2" >> {log}\n: > "$2"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    lib = tmp_path / "kernel.so"
    for _ in range(2):
        assert cpu_build._compile([str(fake)], cpu_attention.SOURCE, cpu_build.FLAGS, lib) is None
    first, second = log.read_text().split()
    assert first != second, "two builds of one library wrote the same temporary file"
    assert lib.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["fake-c++", "kernel.so", "outputs.log"]


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "x86-64-v4"])
def test_every_cpu_kernel_builds_for_other_x86_cpus(march, tmp_path):
    """``-march=native`` builds each kernel for the CPU at hand, so a source that only compiles
    where AVX-512 (or AMX) is present would fail on another machine unnoticed here (the kernels are
    optional: the engine falls back to slower code). Every source of engine/fast builds with the
    host's compiler for a baseline x86-64, AVX2 (v3) and AVX-512 (v4) target as well."""
    import platform
    import subprocess

    from engine.fast import cpu_build

    # another architecture: its compiler's default target instead of these x86 levels
    target = [f"-march={march}"] if platform.machine() in ("x86_64", "AMD64") else []
    compiler = cpu_build.find_compiler()
    sources = sorted(Path(cpu_build.__file__).parent.glob("*.cpp"))
    assert len(sources) >= 8, [s.name for s in sources]
    for source in sources:
        flags = [f for f in cpu_build.FLAGS if f != "-march=native"] + target
        done = subprocess.run([*compiler, *flags, str(source), "-o", str(tmp_path / f"{source.stem}.so")],
                              capture_output=True, text=True, timeout=cpu_build.COMPILE_TIMEOUT_S)
        assert done.returncode == 0, f"{source.name} does not build for -march={march}:\n{done.stderr[-2000:]}"


def test_cpu_kernel_cache_parents_must_be_private_too(tmp_path):
    """A private cache inside a folder others can write to (and not sticky) is refused: another user
    could rename the cache away and put their own in its place before the library is loaded. A
    sticky world-writable parent (as /tmp) is fine."""
    from engine.fast import cpu_build

    for mode, refused in ((0o777, True), (0o1777, False), (0o755, False)):
        parent = tmp_path / f"parent-{mode:o}"
        cache = parent / "cache"
        cache.mkdir(parents=True)
        cache.chmod(0o700)
        parent.chmod(mode)
        if refused:
            with pytest.raises(ValueError, match="can be written by others and is not sticky"):
                cpu_build.check_private(cache)
        else:
            cpu_build.check_private(cache)


def test_fused_torch_engine_needs_no_compiler(tmp_path):
    """flat_model="fused" on the torch backend runs without a C++ compiler (its kernels are optional):
    with $CXX missing, in a fresh process and kernel cache, it serves generate()'s tokens."""
    import os
    import subprocess
    import sys

    script = ("import torch\n"
              "from engine.generate import generate\n"
              "from engine.models.tiny import tiny_model\n"
              "from engine.serve import EngineConfig, EngineCore, SamplingParams\n"
              "m = tiny_model(seed=3)\n"
              "core = EngineCore(m, EngineConfig(block_size=8, attention_backend='torch', flat_model='fused'))\n"
              "core.add_request('r', [5, 9, 2, 7], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))\n"
              "assert core.run_until_done()['r'] == generate(m, [5, 9, 2, 7], 6)\n"
              "print('served')\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "ENGINE_KERNEL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "served" in done.stdout, done.stderr[-2000:]


def test_cpu_kernels_refuse_shapes_that_would_read_past_their_buffers():
    """The small-batch linear and the elementwise kernels read raw pointers: rows of the wrong width,
    or weights / tables of the wrong shape, are a ValueError, never a read past a buffer."""
    from engine.fast import cpu_elementwise, cpu_linear

    if cpu_linear.library() is None or cpu_elementwise.library() is None:
        pytest.fail(f"the CPU kernels did not build here: {cpu_linear._kernels.why or cpu_elementwise._kernels.why}")
    lin = cpu_linear.SmallLinear(torch.ones(24, 16))
    assert torch.equal(lin(torch.ones(3, 16)), torch.full((3, 24), 16.0))
    with pytest.raises(ValueError, match="SmallLinear of K=16"):
        lin(torch.ones(3, 1 << 12))
    with pytest.raises(ValueError, match="add_rms_norm takes"):
        cpu_elementwise.add_rms_norm(torch.ones(4, 8), torch.ones(4, 8), torch.ones(1 << 12), 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm takes"):
        cpu_elementwise.add_rms_norm(torch.ones(4, 8), torch.ones(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="qk_norm_rope"):
        cpu_elementwise.qk_norm_rope(torch.ones(2, 8), 4, 2, 8, torch.ones(6, 8), torch.ones(2, 8), torch.ones(2, 8), 1e-6)
    with pytest.raises(ValueError, match="silu_mul takes"):
        cpu_elementwise.silu_mul(torch.ones(3, 5))


def test_the_cpu_backends_pools_are_zeros_on_huge_pages_where_linux_grants_them():
    """CPUBackend.allocate: two zero pools of the shape and dtype, each advised for 2 MiB pages
    before it is first touched; on Linux with transparent huge pages on ("always" or "madvise")
    the advice is accepted (whether the pages come is the kernel's call, not asserted)."""
    from pathlib import Path

    from engine.fast import huge_pages
    from engine.fast.cpu_attention import CPUBackend

    k, v = CPUBackend().allocate((1024, 16, 4, 64), torch.bfloat16, "cpu")  # 8 MiB each
    assert k.shape == v.shape == (1024, 16, 4, 64) and k.dtype == torch.bfloat16
    assert k.data_ptr() != v.data_ptr() and not k.any() and not v.any()
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = setting.read_text() if setting.exists() else ""
    on = "[always]" in mode or "[madvise]" in mode
    assert huge_pages.advise(k) == on, f"madvise(MADV_HUGEPAGE) on an 8 MiB pool; THP setting: {mode.strip() or 'none'}"
    assert not huge_pages.advise(torch.zeros(4)), "a tensor under 2 MiB holds no aligned huge page"


def test_torchs_allocator_is_asked_for_huge_pages_before_torch_loads_and_only_then():
    """prefer_huge_pages sets THP_MEM_ALLOC_ENABLE=1 where nothing is set, keeps a value the user
    set, and in this process (torch loaded) changes nothing and says why; run.py calls it first."""
    from engine.fast import huge_pages

    env: dict = {}
    assert huge_pages.prefer_huge_pages(env) == "THP_MEM_ALLOC_ENABLE=1 (run.py's choice)" and env == {huge_pages.TORCH_VAR: "1"}
    env = {huge_pages.TORCH_VAR: "0"}
    assert "set in the environment" in huge_pages.prefer_huge_pages(env) and env[huge_pages.TORCH_VAR] == "0"
    import os

    before = os.environ.pop(huge_pages.TORCH_VAR, None)
    try:
        assert "torch was loaded first" in huge_pages.prefer_huge_pages()
        assert huge_pages.TORCH_VAR not in os.environ
    finally:
        if before is not None:
            os.environ[huge_pages.TORCH_VAR] = before
    import subprocess
    import sys

    code = "import run, os, sys; run.prefer_huge_pages(); import torch; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    env = {k: v for k, v in os.environ.items() if k != huge_pages.TORCH_VAR}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.stdout.split()[-1] == "1"
