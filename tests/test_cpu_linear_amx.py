"""The bfloat16 linear on the CPU's matrix units (engine/fast/cpu_linear_amx.py): float64 matmul
of the same values as the oracle, one rounding to bfloat16, the rows a tied head looks up, the
thread's tile setup left as found, and the engine with every linear in it = generate(). On a CPU
without AMX the layout is not offered: a forced one resolves to the reference, and the tests
check that instead."""
from __future__ import annotations

import pytest
import torch

from engine.fast import cpu_linear_amx, cpu_prefill, linear_layout
from engine.fast.fused import FusedFlatModel
from engine.models import tiny_model
from engine.serve import EngineConfig, EngineCore
from tests.test_fused import assert_serves_generate

# (out, in) features: one block; a group of four; groups with a tail of 1, 2 and 3 blocks; deep K;
# a K so deep that a chunk is 32 rows (rows read in place in chunks after the first, a partial last
# block); a K of 65 slices (two passes of the several-row-block path, partial sums carried between them)
SHAPES = [(16, 32), (64, 96), (80, 64), (96, 128), (112, 1536), (48, 12288), (32, 2080)]
ROWS = [1, 5, 16, 17, 31, 32, 33, 52, 64, 100, 257, 300]  # tile rows, pairs of row blocks (100: packed, columns
# split on two threads), the 256-row chunks


def test_the_layout_is_offered_exactly_where_the_kernel_runs(monkeypatch):
    """Where the kernel runs, a bfloat16 model's load-time probe times ``amx`` beside oneDNN's layout
    for every weight shape. Where it does not (no AMX-BF16 in this build, or the OS refuses the
    tiles) the layout is never a candidate and a forced ``amx`` gives the reference layout."""
    monkeypatch.delenv(linear_layout.ENV, raising=False)
    if cpu_linear_amx.available():
        flat = FusedFlatModel(tiny_model(seed=3, dtype=torch.bfloat16))
        timed = [set(choice.ms) for choice in flat.choices.values()]
        assert timed and all("amx" in names for names in timed), timed
        return
    with pytest.raises(ValueError, match="needs a CPU with AMX-BF16"):
        cpu_linear_amx.AmxLinear(torch.zeros(16, 32, dtype=torch.bfloat16))
    monkeypatch.setenv(linear_layout.ENV, "amx")
    core = EngineCore(tiny_model(seed=3, dtype=torch.bfloat16), EngineConfig(attention_backend="cpu", flat_model="fused"))
    assert all(entry[k].layout != "amx" for entry in core.flat.layers for k in ("qkv", "o", "gate_up", "down"))


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_linear_matches_float64_matmul(threads, monkeypatch):
    """x @ W^T for bf16 values: the float64 product up to float summation (~1e-6 relative), the
    bf16 output exactly the float32 output rounded to nearest even, and ``rows`` the weight's rows."""
    if not cpu_linear_amx.available():
        assert not cpu_linear_amx.takes(8, 32) and not cpu_linear_amx.takes(16, 40)  # the shape rule holds anyway
        return
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).bfloat16()
        lin = cpu_linear_amx.AmxLinear(w)
        assert lin.packed.numel() == n * k, "the packing holds the weight's own bytes, no more"
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).bfloat16()
            want = x.double() @ w.double().T  # [m, n]
            got32 = lin(x, out_dtype=torch.float32)
            err = ((got32.double() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, f"[{n}, {k}] at {m} rows, {threads} thread(s): relative error {err:.2e}"
            assert torch.equal(lin(x), got32.bfloat16()), f"[{n}, {k}] at {m} rows: not one rounding of the float result"
            assert torch.equal(lin(x, torch.float32, widened=True), got32.bfloat16().float()), \
                f"[{n}, {k}] at {m} rows: widened outputs are not the bf16 outputs as float32"
        ids = torch.tensor([0, n - 1, n // 2, 17 % n])
        assert torch.equal(lin.rows(ids), w[ids]), f"[{n}, {k}]: rows() differ from the weight's rows"
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_linear_amx.AmxLinear(torch.zeros(24, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 CPU input"):
        lin(torch.zeros(2, 2080))
    with pytest.raises(ValueError, match="widened outputs are float32"):
        lin(torch.zeros(2, lin.k, dtype=torch.bfloat16), widened=True)
    with pytest.raises(ValueError, match=r"row ids must lie in \[0, 32\)"):
        lin.rows(torch.tensor([32]))


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_linear_large_output_written_past_the_cache(threads, monkeypatch):
    """An output of 1 MiB or more goes out in whole 64-byte lines past the cache where a row's
    columns are line-aligned (N = 1024: every row; N = 1040: every other row, and a one-block tail
    group): the same values as ever, one rounding of the float result, float64 up to summation."""
    if not cpu_linear_amx.available():
        return  # test_the_layout_is_offered_exactly_where_the_kernel_runs covers this CPU
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(4)
    for n, k, m in [(1024, 64, 520), (1040, 96, 600)]:
        w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(m, k, generator=gen).bfloat16()
        lin = cpu_linear_amx.AmxLinear(w)
        want = x.double() @ w.double().T
        got32, got = lin(x, out_dtype=torch.float32), lin(x)
        assert got.numel() * got.element_size() >= 1 << 20, "large enough to be streamed"
        err = ((got32.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, f"[{n}, {k}] at {m} rows: relative error {err:.2e}"
        assert torch.equal(got, got32.bfloat16()), f"[{n}, {k}] at {m} rows: not one rounding of the float result"
        assert torch.equal(lin(x, torch.float32, widened=True), got.float()), f"[{n}, {k}] at {m} rows: widened"


def test_widened_outputs_carry_the_bfloat16_bits_of_nan_and_infinity():
    """Rows whose sums are NaN (a NaN input), infinite (inputs near bfloat16's largest value) or
    finite: the widened float32 outputs hold exactly the bfloat16 outputs' bits (a NaN quieted as
    the bfloat16 rounding quiets it, infinities kept), on the few-row and the many-row paths."""
    if not cpu_linear_amx.available():
        return  # test_the_layout_is_offered_exactly_where_the_kernel_runs covers this CPU
    gen = torch.Generator().manual_seed(9)
    lin = cpu_linear_amx.AmxLinear(torch.rand(64, 64, generator=gen).bfloat16() + 0.5)  # positive weights
    for m in (3, 70):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        x[0, 5] = float("nan")
        x[1] = 3e38  # every product overflows float32 sums to +inf
        x[2, :] = -3e38
        bf16 = lin(x)
        assert bf16[0].isnan().all() and bf16[1].isposinf().all() and bf16[2].isneginf().all()
        got = lin(x, torch.float32, widened=True).view(torch.int32)
        assert torch.equal(got, bf16.float().view(torch.int32)), f"{m} rows: widened bits differ from the bfloat16 outputs' bits"


def test_two_threads_compute_every_value_as_one_does():
    """``run`` on two threads (each chunk's column groups shared out for few rows, each thread
    reading a partial last row block from its own copy at 1, 5, 17 and 40; one run of row pairs per
    thread for many: from 256 rows on two threads for a weight of at most 2 MiB, from 512 for a
    larger one; a thread's run ending in a partial row block at 257, 300 and 700) writes exactly
    what one thread writes, in each output mode: bfloat16, float32, widened and gated."""
    if not cpu_linear_amx.available():
        return  # test_the_layout_is_offered_exactly_where_the_kernel_runs covers this CPU
    gen = torch.Generator().manual_seed(5)
    for n, k, gated in [(512, 96, False), (640, 1536, False), (1024, 1536, False), (512, 64, True)]:
        lin = cpu_linear_amx.AmxLinear(torch.randn(n, k, generator=gen).bfloat16(), gated=gated)
        assert lin.threads(2) == 2, f"[{n}, {k}]: enough column groups for two threads"
        width = n // 2 if gated else n
        for m in [1, 5, 16, 17, 40, 64, 255, 256, 257, 300, 512, 700]:
            x = torch.randn(m, k, generator=gen).bfloat16()
            modes = [(torch.bfloat16, False)] if gated else [(torch.bfloat16, False), (torch.float32, False),
                                                              (torch.float32, True)]
            for out_dtype, widened in modes:
                outs = [torch.full((m, width), float("nan"), dtype=out_dtype) for _ in range(2)]
                for threads, out in zip((2, 1), outs):  # two first: no buffer of the call before holds x already
                    lin.run(x.data_ptr(), m, out.data_ptr(), threads, out_dtype, widened)
                assert torch.equal(outs[0], outs[1]), \
                    f"[{n}, {k}]{' gated' if gated else ''} at {m} rows, {out_dtype}{' widened' if widened else ''}"


@pytest.mark.parametrize("threads", [1, 2])
def test_the_weight_prefetch_changes_no_value(threads):
    """``linear_amx_set_prefetch`` (the software prefetch of the weight: pages ahead for a decode or
    few-row call, the next panel during a panel's later row pairs, the first again before the next
    chunk of rows) off and on: the same bits, at row counts that take each path on a weight of
    several panels (K = 1024: 128 columns a panel, 12 of them) and 2 chunks at 300 rows; each within
    float summation of the float64 product, and the switch left on."""
    if not cpu_linear_amx.available():
        return  # test_the_layout_is_offered_exactly_where_the_kernel_runs covers this CPU
    lib = cpu_linear_amx.library()
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(1536, 1024, generator=gen).bfloat16()
    lin = cpu_linear_amx.AmxLinear(w)
    for m in [1, 16, 40, 64, 100, 300]:
        x = torch.randn(m, 1024, generator=gen).bfloat16()
        outs = [torch.full((m, 1536), float("nan"), dtype=torch.float32) for _ in range(2)]
        try:
            for on, out in zip((0, 1), outs):
                lib.linear_amx_set_prefetch(on)
                lin.run(x.data_ptr(), m, out.data_ptr(), threads, torch.float32)
        finally:
            lib.linear_amx_set_prefetch(1)
        assert torch.equal(outs[0], outs[1]), f"{m} rows, {threads} thread(s): the prefetch changed a value"
        want = x.double() @ w.double().T
        err = ((outs[1].double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, f"{m} rows, {threads} thread(s): relative error {err:.2e}"


def test_gated_amx_linear_is_the_linear_then_silu_mul():
    """A SwiGLU gate/up weight packed gated: its call returns exactly what the bf16 linear followed
    by the elementwise SiLU-mul kernel returns (the same roundings, bit for bit), at every row count."""
    from engine.fast import cpu_elementwise

    if not cpu_linear_amx.available():
        return  # test_the_layout_is_offered_exactly_where_the_kernel_runs covers this CPU
    gen = torch.Generator().manual_seed(2)
    for inter, k in [(32, 64), (96, 128), (160, 1536)]:
        w = torch.randn(2 * inter, k, generator=gen).bfloat16()
        plain, gated = cpu_linear_amx.AmxLinear(w), cpu_linear_amx.AmxLinear(w, gated=True)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).bfloat16()
            got = gated(x)
            assert got.shape == (m, inter)
            assert torch.equal(got, cpu_elementwise.silu_mul(plain(x))), f"I={inter}, K={k}, {m} rows"
    with pytest.raises(ValueError, match="I a multiple of 32"):
        cpu_linear_amx.AmxLinear(torch.zeros(48, 32, dtype=torch.bfloat16), gated=True)
    with pytest.raises(ValueError, match="no rows to look up"):
        gated.rows(torch.tensor([0]))


def test_amx_linear_leaves_the_matrix_units_as_it_found_them():
    """The tile configuration is the thread's: after a call it is what it was before (none, or one
    that oneDNN's bf16 matmul set up), and oneDNN's next matmul is unchanged."""
    if not cpu_linear_amx.available():
        assert linear_layout.forced_layout("amx") == "amx", "the name is valid everywhere"
        return
    lib = cpu_prefill.amx_library()
    assert lib is not None, "the prefill kernel's AMX build reports the thread's tile setup"
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(24, 96, generator=gen).bfloat16(), torch.randn(80, 96, generator=gen).bfloat16()
    before = torch.nn.functional.linear(x, w)
    lin = cpu_linear_amx.AmxLinear(w)
    config = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    for setup in ("none", "custom"):
        if setup == "custom":
            torch.nn.functional.linear(x, w)
        assert lib.prefill_amx_tile_config(config[0].data_ptr()) == 0
        lin(x)
        assert lib.prefill_amx_tile_config(config[1].data_ptr()) == 0
        assert torch.equal(config[0], config[1]), f"the AMX linear changed the thread's tile setup ({setup} before it)"
    assert torch.equal(torch.nn.functional.linear(x, w), before)


@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_engine_with_amx_linears_matches_generate(tied, monkeypatch):
    """Every linear of a bfloat16 model in the AMX layout (forced; on a CPU without AMX the
    reference layout), chunked prefill beside decodes: generate()'s greedy tokens in bfloat16.
    Tied: the embedding's lookups read the head's tiles."""
    monkeypatch.setenv(linear_layout.ENV, "amx")
    model = tiny_model(seed=3, dtype=torch.bfloat16, tie_word_embeddings=tied)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused",
                                          max_num_batched_tokens=16, long_prefill_token_threshold=8))
    want = "amx" if cpu_linear_amx.available() else core.flat.layers[0]["o"].choice.layout
    layouts = {entry[k].layout for entry in core.flat.layers for k in ("qkv", "o", "gate_up", "down")}
    assert layouts == {want} and (core.flat.lm_head.layout == want or tied)
    assert all(entry["gate_up"].gated == (want == "amx") for entry in core.flat.layers), "SiLU-mul in the gate/up pass"
    if tied and want == "amx":
        assert core.flat.lm_head.layout == "amx"
        ids = torch.tensor([0, 15, 16, 17, model.cfg.vocab_size - 1])
        assert torch.equal(core.flat.embed(ids), model.model.embed_tokens(ids)), "lookups from the head's tiles"
    if core.flat.lm_head.layout == "amx":  # logits widened as the head writes them: its bf16 outputs, as float32
        hidden = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
        logits = core.flat.compute_logits(hidden)
        assert logits.dtype == torch.float32 and torch.equal(logits, core.flat.lm_head(hidden).float())
    assert_serves_generate(core, model, f"amx linears (tied={tied})")
