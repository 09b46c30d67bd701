"""The cpu backend's prefill paths against plain float64 attention, and the engine on each path.

``CPUBackend`` serves a request of several rows through its C++ row kernel or as matrix products
(``engine/fast/cpu_prefill.py``: PyTorch's CPU flash attention over the request's gathered
context, requests of one shape together; or the blocked kernel, cpu_prefill_kernel.cpp). A probe
picks by row count per machine; here every path is forced (``prefill=`` and ``$ENGINE_ATTENTION_PREFILL``), so both are tested on any CPU:
float32, bfloat16 and float64 pools, cached prefixes (the log-sum-exp join), block boundaries,
sliding windows, grouped query heads, decodes and prefills mixed in one step, and requests of one
shape batched together whether or not their rows are consecutive.
"""
from __future__ import annotations

import pytest
import torch

from engine.generate import generate
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams
from engine.serve.attention import ReferenceBackend
from engine.serve.batch import build_batch
from engine.serve.request import Request

from test_backends import CASES, random_paged_batch

pytestmark = pytest.mark.given

PATHS = ("kernel", "sdpa", "blocked", "amx", "auto")
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 8e-3}  # max |got - float64 oracle|: bfloat16 rounds once, at the output


def oracle(q, cache, meta, window=0, scale=None):
    """The reference backend on float64 copies: plain attention, exact to float64."""
    return ReferenceBackend().forward(q.double(), tuple(c.double() for c in cache), meta, window=window, scale=scale)


def backend(path: str):
    from engine.fast.cpu_attention import CPUBackend

    return CPUBackend(prefill=path)


@pytest.mark.parametrize("head_dim", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("path", PATHS)
def test_every_prefill_path_matches_float64_attention(path, dtype, head_dim):
    """Ragged mixed batches (decodes, chunks over cached prefixes, fresh prompts longer than a tile,
    padding requests) on every CASES shape and window: each path within the dtype's rounding
    (heads of 8: the blocked kernel does not serve them, and a forced "blocked" takes sdpa; "amx"
    serves bfloat16 heads of 32 on a CPU with AMX, elsewhere it takes the next path)."""
    from engine.fast import cpu_prefill

    for seed, block_size, hq, hkv, window in CASES:
        q, cache, meta = random_paged_batch(seed, block_size, hq, hkv, head_dim=head_dim, dtype=dtype)
        b = backend(path)
        if path != "auto":
            want = path
            if want == "amx" and not cpu_prefill.amx_serves(dtype, hq, hkv, head_dim):
                want = "blocked"
            if want == "blocked" and not cpu_prefill.blocked_serves(dtype, head_dim):
                want = "sdpa"
            assert b.prefill_choice(dtype, hq, cache).path == want
        got = b.forward(q, cache, meta, window=window)
        assert got.dtype == dtype
        err = (got.double() - oracle(q, cache, meta, window)).abs().max().item()
        assert err < TOLERANCE[dtype], (f"prefill path {path!r} ({dtype}) differs from float64 attention by "
                                        f"{err:.2e} (seed {seed}, block_size={block_size}, Hq={hq}, Hkv={hkv}, "
                                        f"window={window}): check the cached-prefix join or the window mask")
        num_real = int((meta.seq_lens_cpu > 0).sum())
        assert got[int(meta.query_start_loc_cpu[num_real]):].abs().max().item() == 0.0, "padding rows must be zeros"


def same_shape_batch(dtype: torch.dtype, block_size: int = 4, hq: int = 4, hkv: int = 2, d: int = 16):
    """Requests that share (rows, cached prefix) so the matrix path batches them: three of 5 rows
    after 3 cached tokens separated by decodes (rows not consecutive), two fresh prompts of 7 rows
    side by side (consecutive), one of 9 rows after 8 cached (a block boundary), decodes."""
    gen = torch.Generator().manual_seed(21)
    shapes = [(3, 5), (6, 1), (3, 5), (0, 7), (0, 7), (11, 1), (3, 5), (8, 9), (4, 1)]  # (cached, rows)
    scheduled, tables, need = [], [], []
    for i, (c, n) in enumerate(shapes):
        req = Request(f"r{i}", [1] * (c + n + 1))
        req.num_computed_tokens = c
        scheduled.append((req, n))
        need.append(-(-(c + n) // block_size))
    perm = torch.randperm(sum(need) + 3, generator=gen).tolist()
    at = 0
    for k in need:
        tables.append(perm[at:at + k])
        at += k
    meta = build_batch(scheduled, tables, block_size, pad_to=len(shapes) + 1).meta
    shape = (sum(need) + 4, block_size, hkv, d)
    cache = tuple(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    q = torch.randn(int(meta.query_start_loc_cpu[-1]), hq, d, generator=gen, dtype=torch.float64).to(dtype)
    return q, cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("path", ["sdpa", "blocked", "mixed"])
def test_requests_of_one_shape_are_batched_exactly(dtype, window, path):
    """The sdpa path groups requests by (rows, cached prefix): consecutive groups are served as
    views, scattered ones gathered and put back; the blocked kernel takes all its requests in one
    call; "mixed": requests of 5 and 7 rows blocked, 9 sdpa, as a measured choice can split them.
    Either way each row gets its own request's keys."""
    from engine.fast import cpu_prefill

    q, cache, meta = same_shape_batch(dtype)
    b = backend(None if path == "mixed" else path)
    choice = b.prefill_choice(dtype, 4, cache)
    if path == "mixed":
        choice = cpu_prefill.PrefillChoice(((2, "blocked"), (8, "sdpa")), {})
        b.prefill_choice = lambda *args: choice
    got = b.forward(q, cache, meta, window=window, scale=0.3)
    groups, packed, kernel_pos = b._matrix_plan(meta, b._row_plan(meta, q.shape[0])[1], choice)
    want_groups = {"sdpa": {(5, 3): False, (7, 0): True, (9, 8): True}, "blocked": {}, "mixed": {(9, 8): True}}[path]
    assert {key: (start is not None) for key, (_, _, start) in groups.items()} == want_groups
    want_blocked = {"sdpa": [], "blocked": [5, 5, 7, 7, 5, 9], "mixed": [5, 5, 7, 7, 5]}[path]
    assert (packed["blocked"][2].tolist() if "blocked" in packed else []) == want_blocked
    assert int((kernel_pos >= 0).sum()) == 3, "the three decodes take the kernel"
    err = (got.double() - oracle(q, cache, meta, window, scale=0.3)).abs().max().item()
    assert err < TOLERANCE[dtype], f"{path} requests ({dtype}, window={window}) differ by {err:.2e}"


@pytest.mark.parametrize("path", ["sdpa", "blocked"])
def test_matrix_paths_refuse_block_tables_outside_the_pool(path):
    """A request served as matrices whose block table points outside the pool (past it,
    negative) or is too short for its context is a ValueError before anything is read."""
    import dataclasses

    q, cache, meta = same_shape_batch(torch.float32)
    b = backend(path)
    for entry in (1 << 30, cache[0].shape[0], -3):
        table = meta.block_table.clone()
        table[7, 2] = entry  # the 9-row request after 8 cached tokens: a matrix request
        with pytest.raises(ValueError, match="outside the K/V pool"):
            b.forward(q, cache, dataclasses.replace(meta, block_table=table))
    short = dataclasses.replace(meta, block_table=meta.block_table[:, :2].contiguous())
    with pytest.raises(ValueError, match="outside the K/V pool"):
        b.forward(q, cache, short)
    table = meta.block_table.clone()
    table[7, 0] = -3  # a block before the 4-key window of its first row (position 8): never read, so not refused
    got = b.forward(q, cache, dataclasses.replace(meta, block_table=table), window=4)
    assert (got.double() - oracle(q, cache, meta, 4)).abs().max().item() < 1e-5
    spare = sorted(set(range(cache[0].shape[0])) - set(meta.block_table.flatten().tolist()))[0]
    poisoned = tuple(c.clone() for c in cache)
    for pool in poisoned:
        pool[spare] = float("nan")
    table[7, 0] = spare  # NaN keys and values where the window hides them: none may reach the output
    got = b.forward(q, poisoned, dataclasses.replace(meta, block_table=table), window=4)
    assert (got.double() - oracle(q, cache, meta, 4)).abs().max().item() < 1e-5, "a hidden block was read"


@pytest.mark.parametrize("path", ["sdpa", "blocked"])
def test_matrix_paths_on_two_real_threads(path):
    """The blocked kernel shares its tiles over torch's OpenMP workers, flash attention its heads:
    on two real torch threads a mixed float64 batch still equals float64 attention."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for window in (0, 6):
            q, cache, meta = random_paged_batch(22, 4, 4, 2, head_dim=16, num_reqs=12, dtype=torch.float64)
            got = backend(path).forward(q, cache, meta, window=window)
            assert (got - oracle(q, cache, meta, window)).abs().max().item() < 1e-12, f"{path} on two threads"
    finally:
        torch.set_num_threads(before)


def test_forward_rows_and_the_path_agree():
    """forward_rows (the logits rows only) takes the kernel for its few rows: the same values as the
    matrix path's full forward at those rows."""
    q, cache, meta = same_shape_batch(torch.float64)
    rows = torch.tensor([4, 17, 30])
    full = backend("sdpa").forward(q, cache, meta)
    assert (backend("sdpa").forward_rows(q, cache, meta, rows) - full[rows]).abs().max().item() < 1e-12


def test_the_path_is_forced_by_option_or_environment(monkeypatch):
    from engine.fast import cpu_prefill

    q, cache, meta = same_shape_batch(torch.float32)
    shape = (torch.float32, 4, 2, 16, 4)
    monkeypatch.setenv(cpu_prefill.ENV, "sdpa")
    choice = backend(None).prefill_choice(torch.float32, 4, cache)
    assert choice.forced and choice.min_rows == cpu_prefill.FORCED_MIN_ROWS and choice.path_for(1) == "kernel"
    monkeypatch.setenv(cpu_prefill.ENV, "kernel")
    assert backend(None).prefill_choice(*shape[:2], cache).min_rows == 0
    assert backend("sdpa").prefill_choice(*shape[:2], cache).min_rows == 2, "the option outranks the environment"
    monkeypatch.setenv(cpu_prefill.ENV, "tiles")
    with pytest.raises(ValueError, match="ENGINE_ATTENTION_PREFILL"):
        backend(None)
    with pytest.raises(ValueError, match="must be one of kernel, sdpa, blocked, amx"):
        backend("tiles")
    assert any("forced" in line for line in cpu_prefill.chosen_report())


def test_the_probe_measures_both_paths_and_reports(monkeypatch):
    """The probe times both paths at every PROBE_ROWS count and keeps the smallest count from which
    sdpa wins at it and every larger one; its choice is listed as measured, with the times."""
    from engine.fast import cpu_prefill

    monkeypatch.delenv(cpu_prefill.ENV, raising=False)
    monkeypatch.setattr(cpu_prefill, "PROBE_ROWS", (4, 8))  # quick
    monkeypatch.setattr(cpu_prefill, "_chosen", {})
    _, cache, _ = same_shape_batch(torch.float32)
    choice = backend("auto").prefill_choice(torch.float32, 4, cache)
    assert not choice.forced and set(choice.ms) == {"kernel", "sdpa", "blocked"}
    assert all(len(t) == 2 for t in choice.ms.values())
    assert choice.min_rows in (0, 4, 8)
    assert any("measured" in line and "ms at 4/8 rows" in line for line in cpu_prefill.chosen_report())
    monkeypatch.setattr(cpu_prefill, "PROBE_ROWS", (8, 32, 128))
    k = (1.0, 2.0, 9.0)
    assert cpu_prefill.decide({"kernel": k, "sdpa": (2.0, 1.0, 3.0)}) == ((32, "sdpa"),)
    assert cpu_prefill.decide({"kernel": k, "sdpa": (0.5, 3.0, 3.0)}) == ((128, "sdpa"),), "a loss at 32 rows"
    assert cpu_prefill.decide({"kernel": (1.0, 2.0, 3.0), "sdpa": (2.0, 3.0, 2.99)}) == (), "within the margin"
    steps = cpu_prefill.decide({"kernel": k, "sdpa": (2.0, 1.5, 3.0), "blocked": (0.5, 1.0, 4.0)})
    assert steps == ((8, "blocked"), (128, "sdpa"))
    choice = cpu_prefill.PrefillChoice(steps, {})
    assert [choice.path_for(t) for t in (1, 7, 8, 127, 128, 4096)] == ["kernel"] * 2 + ["blocked"] * 2 + ["sdpa"] * 2


# ----- the AMX kernel (bfloat16 on the matrix units) ---------------------------------------------
def packed_oracle(q, k_pool, v_pool, tables, row0, rows, context, scale, window):
    """Float64 attention of each request's rows over its context (causal, windowed): [N, Hq, D]."""
    n, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    for r in range(rows.shape[0]):
        t, c, first = int(rows[r]), int(context[r]), int(row0[r])
        pos = torch.arange(c + t)
        slots = tables[r, pos // bs].long() * bs + pos % bs
        k, v = (pool.view(-1, hkv, d)[slots].double() for pool in (k_pool, v_pool))  # [keys, Hkv, D]
        qp, kp = torch.arange(c, c + t)[:, None], pos[None, :]
        seen = (kp <= qp) & ((kp > qp - window) if window > 0 else True)
        for j in range(hq):
            s = (q[first:first + t, j].double() @ k[:, j * hkv // hq].T * scale).masked_fill(~seen, float("-inf"))
            out[first:first + t, j] = torch.softmax(s, -1) @ v[:, j * hkv // hq]
    return out


AMX_SHAPES = [  # (Hq, Hkv, D, block size, window, [(rows, cached) per request])
    (8, 4, 64, 16, 0, [(40, 0), (7, 100), (64, 0), (1, 33)]),  # the small preset's heads; a 1-row request
    (16, 8, 128, 16, 0, [(128, 0), (33, 70)]),  # Qwen3-0.6B's heads
    (8, 4, 64, 16, 50, [(100, 30), (5, 200)]),  # a window starting mid-chunk
    (4, 1, 64, 8, 0, [(19, 13)]),  # one kv head, 4 query heads
    (32, 2, 32, 32, 0, [(3, 40), (50, 1)]),  # 16 query heads per kv head (one row per tile)
    (8, 8, 256, 1, 7, [(20, 5)]),  # the largest head, blocks of one key
]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_amx_kernel_matches_float64_attention_where_the_cpu_has_amx(threads):
    """On a CPU with AMX: every request's rows within bfloat16's output rounding of float64
    attention (scores as exact bf16 products summed in float, the weights' hi + lo parts), over
    cached prefixes, windows, several 32-key chunks and 16-row tiles, grouped heads up to 16 per kv
    head, on one and two threads. Without AMX (or without the OS's tile permission) the path is not
    offered: ``amx_serves`` is False and a forced "amx" resolves to the blocked kernel."""
    from engine.fast import cpu_prefill
    from engine.fast.cpu_attention import CPUBackend

    if cpu_prefill.amx_library() is None:
        assert not cpu_prefill.amx_serves(torch.bfloat16, 8, 4, 64)
        cache = (torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16),) * 2
        assert CPUBackend(prefill="amx").prefill_choice(torch.bfloat16, 8, cache).path == "blocked"
        return
    gen = torch.Generator().manual_seed(8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for hq, hkv, d, bs, window, specs in AMX_SHAPES:
            assert cpu_prefill.amx_serves(torch.bfloat16, hq, hkv, d)
            rows = torch.tensor([t for t, _ in specs])
            context = torch.tensor([c for _, c in specs])
            row0 = torch.cumsum(rows, 0) - rows
            width = max(-(-(t + c) // bs) for t, c in specs)
            num_blocks = len(specs) * width + 1
            k_pool, v_pool = (torch.randn(num_blocks, bs, hkv, d, generator=gen).bfloat16() for _ in range(2))
            tables = torch.randperm(num_blocks, generator=gen)[:len(specs) * width].view(len(specs), width).to(torch.int32)
            q = (2 * torch.randn(int(rows.sum()), hq, d, generator=gen)).bfloat16()
            out = torch.zeros_like(q)
            cpu_prefill.attend_packed("amx", q, k_pool, v_pool, tables, row0, rows, context, d ** -0.5, window, out)
            want = packed_oracle(q, k_pool, v_pool, tables, row0, rows, context, d ** -0.5, window)
            err = (out.double() - want).abs().max().item()
            where = f"amx kernel, {hq}/{hkv} heads of {d}, blocks of {bs}, window {window}, {threads} thread(s)"
            assert err < TOLERANCE[torch.bfloat16], f"{where}: {err:.2e} from float64 attention"
            # One rounding, at the output: nearly every value is float64 attention rounded to bf16
            # (measured <= 0.25% differ, by summation order); weights rounded to bf16 before the
            # value product (no lo part) make ~25% differ.
            differ = (out != want.bfloat16()).double().mean().item()
            assert differ < 0.01, (f"{where}: {differ:.1%} of outputs are not float64 attention rounded to bf16 "
                                   "(are the softmax weights rounded to bf16 before the value product? the lo part)")
    finally:
        torch.set_num_threads(before)


AMX_SHARED = [  # (Hq, Hkv, D, block size, window, [(rows, cached, shared blocks) per request])
    (8, 4, 64, 16, 0, [(30, 192, 12), (9, 192, 12), (20, 100, 6), (12, 192, 12), (5, 70, 4)]),  # a cached prefix
    (8, 4, 64, 8, 0, [(7, 61, 7), (18, 40, 5), (33, 64, 8)]),  # blocks of 8: a chunk over four blocks
    (16, 8, 128, 64, 0, [(10, 40, 1), (3, 50, 1), (40, 64, 1)]),  # one block shared, read to different lengths
    (8, 4, 64, 16, 90, [(6, 150, 10), (6, 150, 10), (30, 150, 9)]),  # a window: the same first key, then not
]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_amx_kernel_over_requests_that_share_cached_blocks(threads):
    """Requests whose block tables begin with the same pool blocks (a prefix the prefix cache
    shares) may reuse the keys packed for the request before them: every request's rows still
    match float64 attention over its own keys, where the shared blocks are read to different
    lengths (a block that one request reads only partly), by blocks smaller and larger than the
    kernel's 32-key chunk, and with a window. (No AMX here: it checks only that the path is not
    offered, as the test above does.)"""
    from engine.fast import cpu_prefill

    if cpu_prefill.amx_library() is None:  # nothing to run here: the path must not be offered
        assert not cpu_prefill.amx_serves(torch.bfloat16, 8, 4, 64)
        return
    gen = torch.Generator().manual_seed(10)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for hq, hkv, d, bs, window, specs in AMX_SHARED:
            rows = torch.tensor([t for t, _, _ in specs])
            context = torch.tensor([c for _, c, _ in specs])
            row0 = torch.cumsum(rows, 0) - rows
            width = max(-(-(t + c) // bs) for t, c, _ in specs)
            num_blocks = len(specs) * width + 1
            k_pool, v_pool = (torch.randn(num_blocks, bs, hkv, d, generator=gen).bfloat16() for _ in range(2))
            tables = torch.randperm(num_blocks, generator=gen)[:len(specs) * width].view(len(specs), width).to(torch.int32)
            for r, (_, _, shared) in enumerate(specs):
                tables[r, :shared] = tables[0, :shared]
            q = (2 * torch.randn(int(rows.sum()), hq, d, generator=gen)).bfloat16()
            out = torch.zeros_like(q)
            cpu_prefill.attend_packed("amx", q, k_pool, v_pool, tables, row0, rows, context, d ** -0.5, window, out)
            want = packed_oracle(q, k_pool, v_pool, tables, row0, rows, context, d ** -0.5, window)
            err = (out.double() - want).abs().max(-1).values.max(-1).values  # [N] per row
            where = f"amx kernel, shared blocks, {hq}/{hkv} heads of {d}, blocks of {bs}, window {window}, {threads} thread(s)"
            for r in range(len(specs)):
                worst = err[int(row0[r]):int(row0[r] + rows[r])].max().item()
                assert worst < TOLERANCE[torch.bfloat16], (
                    f"{where}: request {r} is {worst:.2e} from float64 attention (its keys packed by the request "
                    "before it where their blocks differ?)")
    finally:
        torch.set_num_threads(before)


def test_the_amx_kernel_leaves_the_matrix_units_as_it_found_them():
    """oneDNN's bf16 matmuls use the same tiles: the kernel puts the thread's tile setup back as it
    found it (none, or oneDNN's), and a bf16 linear after it gives what it gave before."""
    from engine.fast import cpu_prefill

    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(24, 96, generator=gen).bfloat16(), torch.randn(80, 96, generator=gen).bfloat16()
    before = torch.nn.functional.linear(x, w)
    lib = cpu_prefill.amx_library()
    if lib is None:  # no AMX here: nothing to leave as found, and the path is not offered
        assert not cpu_prefill.amx_serves(torch.bfloat16, 8, 4, 64)
        return
    q = torch.randn(20, 8, 64, generator=gen).bfloat16()
    pools = [torch.randn(3, 16, 4, 64, generator=gen).bfloat16() for _ in range(2)]
    table = torch.tensor([[0, 2]], dtype=torch.int32)
    config = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    for setup in ("none", "custom"):
        if setup == "custom":  # a thread whose tiles something else configured: that setup comes back
            torch.nn.functional.linear(x, w)
        assert lib.prefill_amx_tile_config(config[0].data_ptr()) == 0
        cpu_prefill.attend_packed("amx", q, *pools, table, torch.tensor([0]), torch.tensor([20]), torch.tensor([0]),
                                  0.125, 0, torch.empty_like(q))
        assert lib.prefill_amx_tile_config(config[1].data_ptr()) == 0
        assert torch.equal(config[0], config[1]), f"the AMX kernel changed the thread's tile setup ({setup} before it)"
    assert torch.equal(torch.nn.functional.linear(x, w), before)


# ----- the engine on each path: greedy tokens equal generate() ------------------------------------
def assert_serves_generate(core: EngineCore, model, what: str) -> None:
    """Prompts that share a cached prefix (two blocks of 8) served greedily: generate()'s tokens."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (37, 5, 21, 50, 12)]
    prompts[4] = prompts[0][:16] + prompts[4]
    lens = (12, 15, 9, 5, 13)
    for i, (p, m) in enumerate(zip(prompts, lens)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
    out = core.run_until_done()
    for i, (p, m) in enumerate(zip(prompts, lens)):
        assert out[f"r{i}"] == generate(model, p, m), f"request r{i} on {what} differs from generate()"


@pytest.mark.parametrize("path", ["amx", "blocked"])
def test_bfloat16_engine_on_the_matrix_kernels_matches_generate(path, monkeypatch):
    """A bfloat16 model (the fused flat model: bf16 matmuls where the CPU has bf16 units) with every
    prefill chunk through the C++ matrix kernel ``path`` (on a CPU without AMX "amx" is the blocked
    kernel), chunked over cached context beside decodes: generate()'s greedy tokens in bfloat16."""
    from engine.fast import cpu_prefill

    monkeypatch.setenv(cpu_prefill.ENV, path)
    model = tiny_model(seed=3, dtype=torch.bfloat16)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused",
                                          max_num_batched_tokens=16, long_prefill_token_threshold=8))
    cfg = model.cfg
    pool = (torch.zeros(1, 8, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16),) * 2
    want = path if path != "amx" or cpu_prefill.amx_serves(torch.bfloat16, cfg.num_attention_heads,
                                                           cfg.num_key_value_heads, cfg.head_dim) else "blocked"
    assert core.runner.backend.prefill_choice(torch.bfloat16, cfg.num_attention_heads, pool).path == want
    assert_serves_generate(core, model, f"prefill path {path!r} (bfloat16)")


@pytest.mark.parametrize("path", ["kernel", "sdpa", "blocked"])
@pytest.mark.parametrize("config", [dict(), dict(max_num_batched_tokens=16, long_prefill_token_threshold=8)])
def test_engine_on_each_prefill_path_matches_generate(path, config, monkeypatch):
    """Float64 model, prompts that share a cached prefix (two blocks) and, chunked, prefill chunks
    over cached context beside decodes in one step: the tokens of generate()."""
    from engine.fast import cpu_prefill

    monkeypatch.setenv(cpu_prefill.ENV, path)
    model = tiny_model(seed=3, dtype=torch.float64)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", **config))
    assert core.runner.backend.prefill_choice(torch.float64, 4, (torch.zeros(1, 8, 2, 32),) * 2).path == path
    assert_serves_generate(core, model, f"prefill path {path!r}")


# ----- the decode kernel's builds: AVX-512 (+ AVX512-BF16 dot products) where the CPU has them, AVX2 ----
@pytest.mark.parametrize("variant", ["native", "dpbf16", "avx2"])
@pytest.mark.parametrize("head_dim", [8, 32, 64, 128])
def test_every_decode_build_matches_float64_attention(variant, head_dim):
    """Each kernel build, every row through it (decodes and prefill rows), on head sizes that take
    its vector loops at every unroll (16 / 8 / 4 / 2 vectors) and the one-lane loop (8 at 16 lanes),
    float32 / bfloat16 (the bf16 dot products where built) / float64, against float64 attention."""
    from engine.fast.cpu_attention import CPUBackend

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for seed, block_size, hq, hkv, window in CASES[::2]:
            q, cache, meta = random_paged_batch(seed, block_size, hq, hkv, head_dim=head_dim, dtype=dtype)
            b = CPUBackend(prefill="kernel", decode=variant)
            got = b.forward(q, cache, meta, window=window)
            assert b.decode_choice(dtype, hq, cache).variant == variant
            err = (got.double() - oracle(q, cache, meta, window)).abs().max().item()
            assert err < TOLERANCE[dtype], (f"decode build {variant!r}, head_dim={head_dim}, {dtype}: {err:.2e} "
                                            f"from float64 attention (seed {seed}, window={window})")


def test_the_decode_build_is_forced_by_option_or_environment(monkeypatch):
    from engine.fast import cpu_attention

    from engine.fast import cpu_decode_variant

    cache = (torch.zeros(3, 4, 2, 16),) * 2
    monkeypatch.setenv(cpu_decode_variant.ENV, "avx2")
    choice = backend(None).decode_choice(torch.float32, 4, cache)
    assert choice.forced and choice.variant == "avx2"
    assert cpu_attention.CPUBackend(decode="native").decode_choice(torch.float32, 4, cache).variant == "native"
    monkeypatch.delenv(cpu_decode_variant.ENV)
    monkeypatch.setattr(cpu_decode_variant, "_chosen", {})
    choice = backend(None).decode_choice(torch.float32, 4, cache)
    assert not choice.forced and set(choice.ms) == {"native", "avx2"}, "without a forced build, both are measured"
    choice = backend(None).decode_choice(torch.bfloat16, 4, tuple(c.to(torch.bfloat16) for c in cache))
    assert not choice.forced and set(choice.ms) == {"native", "dpbf16", "avx2"}, \
        "bfloat16 rows: the build with bf16 dot products is measured too"
    assert choice.variant == "native" or choice.ms[choice.variant] < choice.ms["native"]
    assert any("measured" in line for line in cpu_decode_variant.chosen_report())
    monkeypatch.setenv(cpu_decode_variant.ENV, "dpbf16")
    assert backend(None).decode_choice(torch.bfloat16, 4, cache).variant == "dpbf16"
    monkeypatch.delenv(cpu_decode_variant.ENV)
    with pytest.raises(ValueError, match="decode variant must be one of native, dpbf16, avx2"):
        cpu_attention.CPUBackend(decode="avx1024")
    monkeypatch.setenv(cpu_decode_variant.ENV, "sse")
    with pytest.raises(ValueError, match="ENGINE_ATTENTION_DECODE"):
        cpu_attention.CPUBackend()
