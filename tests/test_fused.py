"""FusedFlatModel (``EngineConfig(flat_model="fused")``): the same tokens as ``generate()``.

Merged q/k/v and gate/up projections, q and k normed and rotated together, SiLU fused in place:
the engine on it must reproduce ``generate()`` token for token (float64 model: exact arithmetic
up to summation order), on both fast backends, under chunking and swap preemption, and on
Qwen3-MoE. The 16-bit path's float32 linears are checked against the float32 FlatModel.
"""
from __future__ import annotations

import pytest
import torch

from engine.generate import generate
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, FlatModel, SamplingParams
from engine.fast.fused import FusedFlatModel, fast_16bit_matmul

pytestmark = pytest.mark.given  # complete code the chapter gives; the reference holes serve as oracle

PROMPT_LENS = (37, 5, 21, 50, 12)
MAX_TOKENS = (24, 30, 18, 10, 26)
CONFIGS = {
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8),
    "swap": dict(num_blocks=10, preemption_mode="swap"),
}


def prompts_for(model, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[4] = prompts[0][:32] + prompts[4]  # shares two blocks of 16 with the first
    return prompts


def assert_serves_generate(core: EngineCore, model, what: str) -> None:
    """The engine serves ``prompts_for(model)`` greedily with ``generate()``'s tokens."""
    prompts = prompts_for(model)
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
    out = core.run_until_done()
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
        assert out[f"r{i}"] == generate(model, p, m), f"{what}: request r{i} differs from generate()"


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_engine_matches_generate(name, backend, moe):
    model = tiny_model(seed=3, moe=moe, dtype=torch.float64)
    prompts = prompts_for(model)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend=backend, flat_model="fused", **CONFIGS[name]))
    assert isinstance(core.flat, FusedFlatModel) and core.flat.linear_dtype == torch.float64
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
    out = core.run_until_done()
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
        want = generate(model, p, m)
        assert out[f"r{i}"] == want, (f"fused model ({name}, {backend}, moe={moe}): request r{i} gave {out[f'r{i}']}, "
                                      f"generate() gave {want}")
    assert core.blocks.num_free == core.blocks.num_blocks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_kept_rows_match_every_row(backend):
    """keep_rows (the last layer past its K/V write on the logits rows only) changes nothing: under
    chunked prefill, with one request asking for prompt logprobs (so most of its rows are kept),
    the fused engine's tokens and prompt logprobs equal the plain FlatModel engine's (float64)."""
    model = tiny_model(seed=3, dtype=torch.float64)
    prompts = prompts_for(model)
    results = []
    for fuse in (True, False):
        core = EngineCore(model, EngineConfig(block_size=8, attention_backend=backend, flat_model="fused" if fuse else "flat",
                                              **CONFIGS["chunked"]))
        assert (type(core.flat).logits is not FlatModel.logits) == fuse, "the fused model selects its own rows"
        for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
            core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0,
                                                        prompt_logprobs=2 if i == 1 else None))
        tokens, logprobs = {}, None
        while core.has_unfinished():
            for out in core.step():
                if out.finished:
                    tokens[out.request_id] = out.output_token_ids
                    logprobs = out.prompt_logprobs if out.request_id == "r1" else logprobs
        results.append((tokens, logprobs))
    (tokens, logprobs), (want_tokens, want_logprobs) = results
    assert tokens == want_tokens, "keep_rows changed the greedy tokens"
    assert want_logprobs is not None and len(logprobs) == len(want_logprobs)
    for got, want in zip(logprobs, want_logprobs):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-9 for t in want), \
                "keep_rows changed a prompt logprob"


def test_fused_float32_linears_for_a_16bit_model():
    """A bfloat16 model whose linears run in float32 (a CPU without bf16 units) computes what the
    float32 model with the same (bfloat16-valued) weights computes, except that its K/V pool
    rounds K and V to bfloat16: on the test model's well-separated logits, the same first token."""
    model16 = tiny_model(seed=3, dtype=torch.bfloat16)
    model32 = tiny_model(seed=3, dtype=torch.bfloat16).to(torch.float32)  # the same values, widened
    fused = FusedFlatModel(model16, linear_dtype=torch.float32)
    qkv = fused.layers[0]["qkv"]  # float32 arithmetic: a float32 copy, or the small kernel's bfloat16 panels
    assert fused.linear_dtype == torch.float32 and qkv.dtype == (torch.bfloat16 if qkv.layout == "small" else torch.float32)
    prompt = prompts_for(model16)[0]
    core16 = EngineCore(model16, EngineConfig(attention_backend="cpu", flat_model="fused"))
    core16.flat = core16.runner.flat = fused
    core16.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    core32 = EngineCore(model32, EngineConfig(attention_backend="cpu"))
    core32.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    (o16,), (o32,) = core16.step(), core32.step()
    assert o16.new_token_ids == o32.new_token_ids, \
        f"float32 linears on bfloat16 weights gave {o16.new_token_ids}, the float32 model {o32.new_token_ids}"
    assert fast_16bit_matmul(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("tied", [False, True])
def test_fused_bfloat16_matches_generate_in_bfloat16(tied):
    """A bfloat16 model on bf16 matmuls (oneDNN's bf16 GEMM where the CPU has bf16 units, else
    float32 linears on the same values): greedy tokens equal generate()'s in bfloat16 exactly,
    under chunked prefill, on the test model's well-separated logits."""
    model = tiny_model(seed=3, dtype=torch.bfloat16, tie_word_embeddings=tied)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused",
                                          max_num_batched_tokens=16, long_prefill_token_threshold=8))
    assert_serves_generate(core, model, f"bfloat16 (tied={tied})")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_engine_matches_generate_at_each_elementwise_width(dtype, isa, monkeypatch):
    """The fused CPU engine with its elementwise kernels forced to each vector width
    (``ENGINE_KERNEL_ISA``) serves generate()'s greedy tokens in float32 and in bfloat16 (16-bit
    matmuls where the CPU has bf16 units; without them the README's numerics exception applies,
    and the oracle is the same engine on PyTorch's elementwise ops)."""
    use_isa(isa, monkeypatch)
    model = tiny_model(seed=3, dtype=dtype)

    def engine(elementwise: bool) -> EngineCore:
        core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused",
                                              max_num_batched_tokens=16, long_prefill_token_threshold=8))
        assert core.flat.elementwise, "the fused CPU model must take the elementwise kernels here"
        core.flat.elementwise = core.flat.qk_elementwise = elementwise
        return core
    if engine(True).flat.numerics is None:
        assert_serves_generate(engine(True), model, f"{dtype} elementwise kernels at {isa}")
        return
    prompts, want, got = prompts_for(model), engine(False), engine(True)
    for core in (want, got):
        for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
            core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
    assert got.run_until_done() == want.run_until_done(), f"{dtype} (float32 linears): kernels at {isa} differ from torch's ops"


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_seam_calls_give_the_wrappers_bits(dtype, moe):
    """The layers' direct calls of the elementwise kernels (``_forward_kernels``, the default) give
    every step's logits bit for bit as the same kernels through ``cpu_elementwise``'s checked
    functions (``direct_seams=False``): under chunked prefill, with prompt logprobs (the last
    layer's kept rows), on the CPU backend (whose later layers reuse the first layer's checked
    call), on a dense model and on Qwen3-MoE (its MLP block between the seams)."""
    model = tiny_model(seed=3, dtype=dtype, moe=moe)
    prompts = prompts_for(model)
    results = []
    for direct in (True, False):
        core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused",
                                              **CONFIGS["chunked"]))
        assert core.flat.qk_elementwise, "the fused CPU model must take the elementwise kernels here"
        core.flat.direct_seams = direct
        calls, logits = [], []
        forward_kernels, execute = core.flat._forward_kernels, core.runner.execute
        core.flat._forward_kernels = lambda *a: calls.append(1) or forward_kernels(*a)
        core.runner.execute = lambda batch: logits.append(execute(batch)) or logits[-1]
        for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
            core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0,
                                                        prompt_logprobs=2 if i == 1 else None))
        results.append((core.run_until_done(), logits))
        assert bool(calls) == direct, "direct_seams picks the path"
    (tokens, logits), (want_tokens, want_logits) = results
    assert tokens == want_tokens and len(logits) == len(want_logits)
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        assert torch.equal(got, want), f"step {step}: the direct seam calls changed the logits"


def test_an_unknown_flat_model_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="unknown flat model 'fast'.*'compiled', 'flat', 'fused'"):
        EngineConfig(flat_model="fast")


def test_fused_float32_prepacked_matches_generate():
    """Float32 on a CPU: oneDNN-prepacked weights (a different summation order than generate()'s
    matmuls) still give generate()'s greedy tokens on the test model's well-separated logits."""
    model = tiny_model(seed=3)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused"))
    assert core.flat.pack == torch.backends.mkldnn.is_available()
    assert_serves_generate(core, model, "prepacked float32")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("layout", ["small", "packed"])
def test_each_linear_layout_matches_generate(layout, tied, monkeypatch):
    """Both layouts a float32 linear can keep (forced through ``$ENGINE_LINEAR_LAYOUT``, as the
    load-time measurement would pick one): every linear in it, the engine gives generate()'s greedy
    tokens on the test model's well-separated logits. Tied: the head keeps that layout too, and the
    embedding's lookups read the panels (small) or the embedding beside the packed head."""
    from engine.fast.cpu_linear import library

    if layout == "packed" and not torch.backends.mkldnn.is_available():
        pytest.fail("this test needs oneDNN (torch.backends.mkldnn) for the packed layout")
    assert library() is not None, "the small-batch linear kernel did not build (is there a C++ compiler?)"
    monkeypatch.setenv("ENGINE_LINEAR_LAYOUT", layout)
    model = tiny_model(seed=3, tie_word_embeddings=tied)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused",
                                          max_num_batched_tokens=16, long_prefill_token_threshold=8))
    linears = [entry[k] for entry in core.flat.layers for k in ("qkv", "o", "gate_up", "down")]
    assert {lin.layout for lin in linears} == {layout}
    assert core.flat.lm_head.layout == layout and core.flat.tied == tied
    gated = layout == "small" and library().isas[-1] == "avx512"  # SiLU-mul in the 16-float kernel's gate/up pass
    assert all(entry["gate_up"].gated == gated for entry in core.flat.layers)
    if tied:
        ids = torch.tensor([0, 15, 16, 17, model.cfg.vocab_size - 1])
        assert torch.equal(core.flat.embed(ids), model.model.embed_tokens(ids)), "lookups from the head's layout"
    assert_serves_generate(core, model, f"{layout} layout (tied={tied})")


def test_layout_choice_is_measured_and_decided_by_rule(monkeypatch):
    """The load-time choice: the smallest geometric mean over the probed row counts, the reference
    (first) layout kept unless another beats it by MARGIN; measured once per shape (cached), and a
    forced layout that is not a name is refused."""
    from engine.fast import linear_layout as ll

    assert ll.decide({"packed": (1.0, 4.0, 16.0), "small": (0.5, 5.0, 18.0)}) == "small"  # geo 0.82x
    assert ll.decide({"packed": (1.0, 4.0, 16.0), "small": (0.9, 4.0, 17.0)}) == "packed"  # geo 0.98x: a tie
    assert ll.decide({"packed": (1.0, 4.0, 16.0), "small": (1.2, 4.4, 17.0)}) == "packed"
    assert ll.decide({"plain": (3.0, 9.0, 30.0), "small": (1.0, 5.0, 20.0)}) == "small"
    monkeypatch.delenv("ENGINE_LINEAR_LAYOUT", raising=False)
    monkeypatch.setattr(ll, "_chosen", {})
    calls = []
    monkeypatch.setattr(ll, "measure", lambda n, k, dtype, among, weight_dtype=None, rows=ll.PROBE_ROWS:
                        calls.append((n, k)) or {"packed": (2.0, 2.0, 2.0), "small": (1.0, 1.0, 1.0)})
    first = ll.choose(96, 40, torch.float32, ("packed", "small"))
    again = ll.choose(96, 40, torch.float32, ("packed", "small"))
    assert first.layout == again.layout == "small" and calls == [(96, 40)], "measured once per shape"
    assert ll.choose(96, 40, torch.float32, ("packed",)).layout == "packed" and len(calls) == 1
    assert ll.choose(96, 40, torch.float32, ("packed", "small"), layout="packed").forced
    monkeypatch.setattr(ll, "_made", {})
    ll.choose(96, 40, torch.float32, ("packed", "small"))
    ll.choose(96, 40, torch.float32, ("packed", "small"), weight_dtype=torch.bfloat16)  # a bf16 model's fp32 linears
    threads = torch.get_num_threads()
    assert ll.chosen_report(torch.float32, threads) == ["[96, 40] small (ms at 16/64/256 rows: packed 2.00/2.00/2.00; "
                                                        f"small 1.00/1.00/1.00) [measured; float32, {threads} thread(s)]"]
    assert [line.endswith(f"bfloat16 weights, {threads} thread(s)]") for line in ll.chosen_report(torch.bfloat16)] == [True]
    assert len(ll.chosen_report()) == 2 and ll.chosen_report(threads=threads + 1) == []
    with pytest.raises(ValueError, match="linear layout must be one of"):
        FusedFlatModel(tiny_model(seed=3), layout="fastest")


@pytest.mark.parametrize("threads", [1, 2])
def test_small_linear_matches_f_linear(threads, monkeypatch):
    """The small-batch float32 kernel (decode steps' linears): F.linear's result up to summation
    order, for row counts around its 6-row blocks and a column count that is not a multiple of 16."""
    from engine.fast.cpu_linear import SmallLinear, library

    assert library() is not None, "the small-batch linear kernel did not build (is there a C++ compiler?)"
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the kernel splits panels by torch's setting
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(296, 72, generator=gen)  # 19 panels, the last one 8 columns wide
    small = SmallLinear(weight)
    for rows in (1, 5, 6, 7, 13, 64):
        x = torch.randn(rows, 72, generator=gen)
        err = (small(x) - torch.nn.functional.linear(x, weight)).abs().max().item()
        assert err < 1e-4, f"SmallLinear differs from F.linear by {err:.2e} at {rows} rows ({threads} thread(s))"
    with pytest.raises(ValueError, match="float32"):
        SmallLinear(weight.double())


@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_panels_compute_what_float32_panels_of_the_same_values_do(threads, monkeypatch):
    """A bfloat16 weight's panels keep its 16-bit values (half the bytes) and the kernel widens
    them exactly: the output equals, bit for bit, that of float32 panels of the same values (the
    same products in the same order), at one row, within one 6-row block, over several blocks
    and past ROW_CHUNK, with a ragged last panel; a tied head's lookups read the weight's rows."""
    from engine.fast.cpu_linear import ROW_CHUNK, SmallLinear

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(296, 72, generator=gen).to(torch.bfloat16)  # 19 panels, the last one 8 columns wide
    small16, small32 = SmallLinear(weight), SmallLinear(weight.float())
    assert small16.panels.dtype == torch.bfloat16 and small16.panels.numel() == small32.panels.numel()
    for rows in (1, 2, 5, 6, 13, 64, ROW_CHUNK + 3):
        x = torch.randn(rows, 72, generator=gen)
        got, want = small16(x), small32(x)
        assert torch.equal(got, want), (f"bfloat16 panels differ from float32 panels of the same values by "
                                        f"{(got - want).abs().max().item():.2e} at {rows} rows ({threads} thread(s)): "
                                        "a column order or widening bug in the kernel")
    ids = torch.tensor([0, 3, 4, 7, 8, 11, 12, 15, 16, 295])
    assert torch.equal(small16.rows(ids), weight[ids]), "rows() must undo the bfloat16 panels' column order"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_linear_widths_give_the_same_bits(dtype, threads, monkeypatch):
    """The panels' kernel at 8-float and at 16-float width (``ENGINE_KERNEL_ISA``; the 16-float one
    meets two panels per row block and packs each block k-major) computes the same products in the
    same order: equal outputs bit for bit, each within float32 rounding of float64, at one row,
    around its 14-row blocks, past ROW_CHUNK, on a ragged last panel and an odd panel count. Where
    AVX-512F does not compile, the 8-float kernel is the one built and is checked alone."""
    from engine.fast import cpu_linear

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(4)
    widths = [w for w in cpu_linear.ISAS if w in cpu_linear.library().isas]
    for n, k in [(296, 72), (48, 130), (512, 1536)]:  # 19 panels (8-column tail), 3 panels, deep K
        weight = torch.randn(n, k, generator=gen).to(dtype)
        linears = {}
        for width in widths:
            monkeypatch.setenv(cpu_linear.cpu_elementwise.ISA_ENV, width)
            linears[width] = cpu_linear.SmallLinear(weight)
            assert linears[width].width == width and f"{width} (forced by" in cpu_linear.describe()
        for rows in (1, 2, 7, 13, 14, 15, 16, 29, 64, cpu_linear.ROW_CHUNK + 3):
            x = torch.randn(rows, k, generator=gen)
            want = x.double() @ weight.double().T
            outs = {width: lin(x) for width, lin in linears.items()}
            for width, got in outs.items():
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                assert err < 1e-5, f"[{n}, {k}] {dtype} at {rows} rows, {width}: relative error {err:.2e}"
            assert len({tuple(o.flatten().tolist()) for o in outs.values()}) == 1, (
                f"[{n}, {k}] {dtype} at {rows} rows: the widths' outputs differ (summation order or a column order bug)")
    assert ("avx512" in widths) == ("avx512" in cpu_linear.cpu_elementwise.built_isas())
    monkeypatch.setenv(cpu_linear.cpu_elementwise.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="choose one of avx2, avx512"):
        cpu_linear.SmallLinear(weight)
    monkeypatch.delenv(cpu_linear.cpu_elementwise.ISA_ENV)
    assert cpu_linear.SmallLinear(weight).width == widths[-1] and "the widest of" in cpu_linear.describe()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_small_linear_is_the_linear_then_silu_mul(dtype, threads, monkeypatch):
    """A SwiGLU gate/up weight packed gated for the 16-float kernel: its call returns exactly what
    the same kernel's linear followed by the elementwise float32 SiLU-mul returns, at one row (the
    one-row path's summation order), around the row blocks and past ROW_CHUNK. The 8-float kernel
    has no gated mode: there (and on a CPU without AVX-512F) packing gated is refused, naming why."""
    from engine.fast import cpu_elementwise, cpu_linear

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(5)
    monkeypatch.setenv(cpu_elementwise.ISA_ENV, "avx2")
    assert not cpu_linear.takes_gated(64)
    with pytest.raises(ValueError, match="16-float kernel"):
        cpu_linear.SmallLinear(torch.zeros(64, 32), gated=True)
    if "avx512" not in cpu_linear.library().isas:
        return  # no AVX-512F here: the refusal above is the behaviour
    monkeypatch.delenv(cpu_elementwise.ISA_ENV)
    for inter, k in [(16, 40), (48, 96), (80, 1536), (256, 512)]:  # 1, 3 (odd groups of pairs), 5, 16 pairs
        w = torch.randn(2 * inter, k, generator=gen).to(dtype)
        plain, gated = cpu_linear.SmallLinear(w), cpu_linear.SmallLinear(w, gated=True)
        for m in (1, 3, 14, 16, 29, 64, cpu_linear.ROW_CHUNK + 5):
            x = torch.randn(m, k, generator=gen)
            got = gated(x)
            assert got.shape == (m, inter)
            assert torch.equal(got, cpu_elementwise.silu_mul(plain(x))), f"I={inter}, K={k}, {dtype}, {m} rows"
    with pytest.raises(ValueError, match="a multiple of 32"):
        cpu_linear.SmallLinear(torch.zeros(48, 32), gated=True)
    with pytest.raises(ValueError, match="cannot look up rows"):
        gated.rows(torch.tensor([0]))


def use_isa(isa: str, monkeypatch) -> None:
    """Run the elementwise kernels at ``isa``'s width (``ENGINE_KERNEL_ISA``); the 16-float
    (AVX-512) kernels exist only where the compiler targets AVX-512F: elsewhere the test says so."""
    from engine.fast import cpu_elementwise as ew

    assert ew.library() is not None, f"the elementwise kernels did not build: {ew._kernels.why}"
    if isa not in ew.built_isas():
        pytest.skip(f"this CPU's build of the elementwise kernels has {ew.built_isas()}, not {isa} (no AVX-512F)")
    monkeypatch.setenv(ew.ISA_ENV, isa)
    assert ew.isa() == isa


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hq, hkv", [(3, 1), (6, 3)])
def test_elementwise_kernels_match_torch(threads, isa, hq, hkv, monkeypatch):
    """The float32 elementwise kernels equal the PyTorch expressions they replace (float32, up to
    summation order), at both vector widths, on widths that are not a multiple of the 8- or 16-float
    vector and with enough rows to be shared by two threads; the residual is updated in place and v
    is left alone. 9 q/k heads: the kernel's groups of heads (kHeadGroup) end in a partial one, and
    the q heads end inside a group."""
    import torch.nn.functional as F

    from engine.rope import rope_cos_sin
    from engine.fast import cpu_elementwise as ew

    use_isa(isa, monkeypatch)
    monkeypatch.setattr(ew, "MIN_ELEMENTS_PER_THREAD", dict.fromkeys(ew.MIN_ELEMENTS_PER_THREAD, 1))  # share even these small calls
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(1)
    n, d, dh, inter = 37, 100, 18, 75
    hidden, residual = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    weight = torch.rand(d, generator=gen) + 0.5
    want_res = hidden + residual
    want = F.rms_norm(want_res, (d,), weight, 1e-6)
    got, res = ew.add_rms_norm(hidden, residual, weight, 1e-6)
    assert res is residual and torch.allclose(residual, want_res, atol=1e-6), "residual += hidden, in place"
    assert torch.allclose(got, want, atol=1e-5), "add_rms_norm differs from F.rms_norm(hidden + residual)"
    got0, res0 = ew.add_rms_norm(hidden, None, weight, 1e-6)
    assert res0 is hidden and torch.allclose(got0, F.rms_norm(hidden, (d,), weight, 1e-6), atol=1e-5)

    qkv = torch.randn(n, (hq + 2 * hkv) * dh, generator=gen) * 3
    qk_weight = torch.rand(hq + hkv, dh, generator=gen) + 0.5
    cos, sin = rope_cos_sin(torch.randint(0, 500, (n,), generator=gen), dh, 10000.0)
    qk = F.rms_norm(qkv[:, :(hq + hkv) * dh].view(n, hq + hkv, dh), (dh,), None, 1e-6) * qk_weight
    rotated = torch.cat([-qk[..., dh // 2:], qk[..., :dh // 2]], dim=-1)
    want_qk = qk * cos[:, None] + rotated * sin[:, None]
    v_before = qkv[:, (hq + hkv) * dh:].clone()
    q = ew.qk_norm_rope(qkv, hq, hkv, dh, qk_weight, cos, sin, 1e-6)
    assert torch.allclose(q, want_qk[:, :hq], atol=1e-5), "q: the per-head norm and RoPE differ from torch's"
    k = qkv[:, hq * dh:(hq + hkv) * dh].view(n, hkv, dh)
    assert torch.allclose(k, want_qk[:, hq:], atol=1e-5), "k must be normed and rotated in place"
    assert torch.equal(qkv[:, (hq + hkv) * dh:], v_before), "v must not be touched"

    gate_up = torch.randn(n, 2 * inter, generator=gen) * 6  # exp's whole useful range, both signs
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-30])
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    got = ew.silu_mul(gate_up)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), \
        f"silu_mul differs from F.silu(gate) * up by {(got - want).abs().max().item():.2e}"
    with pytest.raises(ValueError, match="one dtype, float32 or bfloat16"):
        ew.silu_mul(gate_up.double())
    with pytest.raises(ValueError, match="one dtype, float32 or bfloat16"):
        ew.add_rms_norm(hidden, residual, weight.bfloat16(), 1e-6)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dh", [18, 64])
@pytest.mark.parametrize("hq, hkv", [(3, 1), (6, 3)])
def test_bfloat16_elementwise_kernels_round_as_torch_does(threads, isa, dh, hq, hkv, monkeypatch):
    """The bfloat16 kernels round where the PyTorch ops of a bfloat16 model (and so generate())
    round: RMSNorm (the model's module: normalised in float32, rounded, times the weight), the
    residual add, RoPE's products and sum, SiLU then the product with up. On these inputs every
    value is bit-equal to PyTorch's, at both vector widths, at widths that are not a multiple of
    the 8- or 16-float vector, and with heads whose halves fill whole vectors (64); with 4 q/k heads
    (one whole group of the kernel's kHeadGroup) and 9 (a partial last group, the q heads ending
    inside one)."""
    import torch.nn.functional as F

    from engine.models.layers import RMSNorm
    from engine.rope import apply_rope, rope_cos_sin
    from engine.fast import cpu_elementwise as ew

    use_isa(isa, monkeypatch)
    monkeypatch.setattr(ew, "MIN_ELEMENTS_PER_THREAD", dict.fromkeys(ew.MIN_ELEMENTS_PER_THREAD, 1))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen, bf = torch.Generator().manual_seed(1), torch.bfloat16
    n, d, inter = 37, 100, 75
    hidden, residual = torch.randn(n, d, generator=gen).to(bf), torch.randn(n, d, generator=gen).to(bf)
    norm = RMSNorm(d, 1e-6).requires_grad_(False)
    norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
    norm = norm.to(bf)
    want_res = hidden + residual
    got, res = ew.add_rms_norm(hidden, residual, norm.weight, 1e-6)
    assert res is residual and torch.equal(res, want_res), "residual = bf16(hidden + residual), in place"
    assert torch.equal(got, norm(want_res)), "add_rms_norm differs from the model's RMSNorm in bfloat16"
    qkv = (torch.randn(n, (hq + 2 * hkv) * dh, generator=gen) * 3).to(bf)
    qk_weight = (torch.rand(hq + hkv, dh, generator=gen) + 0.5).to(bf)
    cos, sin = rope_cos_sin(torch.randint(0, 500, (n,), generator=gen), dh, 10000.0, bf)
    qk = qkv[:, :(hq + hkv) * dh].view(n, hq + hkv, dh)
    want_qk = apply_rope(qk_weight * F.rms_norm(qk, (dh,), None, 1e-6), cos, sin)
    v_before = qkv[:, (hq + hkv) * dh:].clone()
    q = ew.qk_norm_rope(qkv, hq, hkv, dh, qk_weight, cos, sin, 1e-6)
    assert torch.equal(q, want_qk[:, :hq]) and torch.equal(qkv[:, hq * dh:(hq + hkv) * dh].view(n, hkv, dh),
                                                           want_qk[:, hq:]), "q/k norm + RoPE differ in bfloat16"
    assert torch.equal(qkv[:, (hq + hkv) * dh:], v_before), "v must not be touched"
    gate_up = (torch.randn(n, 2 * inter, generator=gen) * 3).to(bf)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ew.silu_mul(gate_up), F.silu(gate) * up), "silu_mul differs in bfloat16"


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_bfloat16_kernels_keep_subnormals_and_specials_as_torch_does(isa, monkeypatch):
    """Rounding to bfloat16 keeps subnormal results (AVX512-BF16's conversion instruction flushes
    them to zero: the kernels must not), and NaN / infinity pass through as PyTorch's ops pass them:
    residual sums and SiLU products far below 2^-126, bit-equal to PyTorch's."""
    import torch.nn.functional as F

    from engine.fast import cpu_elementwise as ew

    use_isa(isa, monkeypatch)
    gen, bf = torch.Generator().manual_seed(2), torch.bfloat16
    n, d, inter = 5, 48, 40
    tiny = 2.0 ** -130  # subnormal in float32 and in bfloat16
    hidden, residual = (torch.randn(n, d, generator=gen) * tiny).to(bf), (torch.randn(n, d, generator=gen) * tiny).to(bf)
    assert (residual.float().abs() < 2.0 ** -126).all() and residual.float().abs().max() > 0
    want_res = hidden + residual
    _, res = ew.add_rms_norm(hidden, residual, torch.ones(d, dtype=bf), 1e-6)
    assert torch.equal(res.view(torch.int16), want_res.view(torch.int16)), "subnormal residual sums must be kept"
    gate_up = torch.randn(n, 2 * inter, generator=gen).to(bf)
    gate_up[:, :inter] *= tiny  # SiLU(x) ~ x / 2: subnormal; times up: subnormal
    gate_up[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want, got = F.silu(gate) * up, ew.silu_mul(gate_up)
    assert (want[1:].float().abs() < 2.0 ** -126).all() and (want[1:] != 0).any()
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"silu_mul differs from PyTorch at {(~same).nonzero()[:4].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 151_936 + 5])
def test_greedy_kernel_is_float64_argmax_first_on_a_tie(dtype, vocab, monkeypatch):
    """``cpu_greedy.argmax_rows`` (the fused CPU model's greedy reduction, handed to the sampler)
    picks what argmax of the exact float64 values picks, the first index on a tie, on rows whose
    width is not a multiple of the vector; on bfloat16 rows, exactly the argmax of their float32
    widening; rows with NaN answer as torch's max does (the first NaN), an all -inf row index 0.
    Shared by two threads too."""
    from engine.fast import cpu_greedy

    assert cpu_greedy.library() is not None, f"the greedy kernel did not build: {cpu_greedy._kernels.why}"
    monkeypatch.setattr(cpu_greedy, "MIN_ELEMENTS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, vocab, generator=gen).to(dtype)
    logits[1, [7, 500, vocab - 1]] = 30.0  # a three-way tie: 7
    logits[2] = 0.0  # every entry tied: 0
    logits[3, vocab - 1] = 30.0  # the last entry alone (in the scalar tail)
    logits[4, [vocab - 3, vocab - 1]] = 31.0  # a tie inside the tail
    logits[5, [16, 33]] = 29.0  # a tie across vector lanes
    logits[6] = -float("inf")  # nothing above -inf: index 0
    got = cpu_greedy.argmax_rows(logits)
    rows = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert got.dtype == torch.int64 and got.tolist() == torch.argmax(logits.double(), dim=-1)[rows].tolist()
    assert got.tolist()[1:7] == [7, 0, vocab - 1, vocab - 3, 16, 0]
    if dtype == torch.bfloat16:
        assert torch.equal(got, cpu_greedy.argmax_rows(logits.float())), "bf16 rows vs their float32 widening"
    logits[7, [40, 9]] = float("nan")
    assert cpu_greedy.argmax_rows(logits)[7] == logits.max(dim=-1).indices[7] == 9, "a NaN row: its first NaN"
    with pytest.raises(ValueError, match="contiguous CPU"):
        cpu_greedy.argmax_rows(logits.double())


def test_fused_cpu_engine_samples_greedily_with_the_kernel():
    """The engine hands the fused CPU model's greedy reduction to its sampler, which returns
    generate()'s tokens with it (float32 and bfloat16 logits rows through the same call)."""
    from engine.fast import cpu_greedy

    model = tiny_model(seed=3)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused"))
    assert core.sampler.greedy == core.flat.greedy_tokens and cpu_greedy.library() is not None
    calls = []
    inner = core.sampler.greedy
    core.sampler.greedy = lambda logits: calls.append(logits.shape) or inner(logits)
    assert_serves_generate(core, model, "fused float32 with the greedy kernel")
    assert calls, "the sampler never called the model's greedy reduction"


def test_kernel_isa_switch_is_checked_and_reported(monkeypatch):
    """``ENGINE_KERNEL_ISA`` names one of the widths or is refused with the choices; unset, the
    widest width built here runs, and ``describe()`` says which and why."""
    from engine.fast import cpu_elementwise as ew

    assert ew.library() is not None, f"the elementwise kernels did not build: {ew._kernels.why}"
    monkeypatch.delenv(ew.ISA_ENV, raising=False)
    assert ew.isa() == ew.built_isas()[-1] and ew.isa() in ew.describe() and "widest" in ew.describe()
    monkeypatch.setenv(ew.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="choose one of avx2, avx512"):
        ew.silu_mul(torch.ones(2, 4))
    monkeypatch.setenv(ew.ISA_ENV, "avx2")
    assert ew.isa() == "avx2" and "forced by ENGINE_KERNEL_ISA" in ew.describe()
    monkeypatch.delenv(ew.ISA_ENV)  # unset again: the widest width again (what each value selects is remembered)
    assert ew.isa() == ew.built_isas()[-1]
    assert ew._kernel("silu_mul", torch.ones(2, 4)).__name__ == f"silu_mul_float32_{ew.built_isas()[-1]}"
    monkeypatch.setenv(ew.ISA_ENV, "avx2")
    assert ew._kernel("silu_mul", torch.ones(2, 4)).__name__ == "silu_mul_float32_avx2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_table_rows_are_rope_cos_sin(dtype, head_dim):
    """``RopeTable`` (the fused model's cos/sin lookup) returns exactly ``rope_cos_sin``'s rows for
    any batch of positions: rows in any order and repeated, a batch past the table's end (it grows),
    an empty batch, and negative positions (computed, not looked up)."""
    from engine.rope import RopeTable, rope_cos_sin

    table = RopeTable(head_dim, 1e6, dtype)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 300, (n,), generator=gen) for n in (1, 7, 16, 33, 200)]
    batches += [torch.tensor([5000, 3, 3, 0]), torch.arange(0, 40_000, 97), torch.zeros(0, dtype=torch.int64),
                torch.tensor([-3, 4])]
    for positions in batches:
        got, want = table(positions), rope_cos_sin(positions, head_dim, 1e6, dtype)
        for name, g, w in zip(("cos", "sin"), got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), f"{name} rows of {positions.tolist()[:8]}... differ"
    assert table.table[0].shape[0] > 40_000 - 97


def test_scratch_buffers_grow_and_their_views_follow():
    """``_scratch`` hands the same view back for a shape seen before and, once the buffer grows for
    a larger step, views of the new buffer only (never of a buffer it has let go)."""
    model = FusedFlatModel(tiny_model(seed=3))
    small = model._scratch("x", (2, 4), torch.float32)
    assert model._scratch("x", (2, 4), torch.float32) is small
    large = model._scratch("x", (8, 4), torch.float32)
    again = model._scratch("x", (2, 4), torch.float32)
    assert again is not small and again.data_ptr() == large.data_ptr() and again.shape == (2, 4)
    assert model._scratch("q", (2, 4), torch.float32).data_ptr() != large.data_ptr()


def test_the_embeddings_pages_are_handed_back_every_2048_rows_looked_up(monkeypatch):
    """A file-backed embedding read by lookups (no tied head holds its rows): its pages are dropped
    once EMBED_DROP_ROWS rows have been looked up since the last drop, not after every decode step,
    and the lookups return the embedding's rows either way."""
    from engine.fast import fused as fused_module

    model = tiny_model(seed=3, dtype=torch.float32, tie_word_embeddings=False)
    flat = FusedFlatModel(model)
    drops = []
    monkeypatch.setattr(fused_module, "drop_pages", lambda span: drops.append(span) or True)
    flat._embedding_pages = (4096, 4096)  # as if memory-mapped from a checkpoint
    ids = torch.arange(16) % model.cfg.vocab_size
    for step in range(1, 200):
        rows = flat.embed(ids[:1] if step > 1 else ids)  # a 16-row prefill, then one-row decodes
        assert len(drops) == (16 + step - 1) // fused_module.EMBED_DROP_ROWS
    assert torch.equal(rows, model.model.embed_tokens(ids[:1]).to(flat.linear_dtype))
    flat.embed(torch.zeros(fused_module.EMBED_DROP_ROWS, dtype=torch.int64))
    assert len(drops) == 1 and flat._rows_since_drop == 0, "a 2,048-row step hands the pages back at once"




@pytest.mark.parametrize("shared", ["every call", "as shipped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_engine_on_two_real_threads(dtype, shared, monkeypatch):
    """On two real torch threads (one OpenMP team: oneDNN's matmuls and every C++ kernel) the fused
    CPU engine serves generate()'s greedy tokens in float32 and bfloat16, under chunked prefill:
    with every kernel call shared over both threads (each per-call threshold at 1: elementwise,
    attention rows, K/V writes, greedy rows) and with the thresholds as shipped. Where a 16-bit
    model's matmuls run in float32 (no bf16 units) the oracle is the same engine on one thread."""
    from engine.fast import cpu_attention, cpu_elementwise as ew, cpu_greedy

    if shared == "every call":
        monkeypatch.setattr(ew, "MIN_ELEMENTS_PER_THREAD", dict.fromkeys(ew.MIN_ELEMENTS_PER_THREAD, 1))
        monkeypatch.setattr(cpu_greedy, "MIN_ELEMENTS_PER_THREAD", 1)
        monkeypatch.setattr(cpu_attention, "MIN_ROWS_PER_THREAD", 1)
        monkeypatch.setattr(cpu_attention, "MIN_WRITE_ROWS_PER_THREAD", 1)
    model = tiny_model(seed=3, dtype=dtype)

    def engine() -> EngineCore:
        return EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused",
                                              max_num_batched_tokens=16, long_prefill_token_threshold=8))
    before = torch.get_num_threads()
    want = None
    try:
        if engine().flat.numerics is not None:
            want = engine()
            for i, (p, m) in enumerate(zip(prompts_for(model), MAX_TOKENS)):
                want.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
            want = want.run_until_done()
        torch.set_num_threads(2)
        core = engine()
        if want is None:
            assert_serves_generate(core, model, f"{dtype} on two threads ({shared})")
            return
        for i, (p, m) in enumerate(zip(prompts_for(model), MAX_TOKENS)):
            core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
        assert core.run_until_done() == want, f"{dtype} on two threads ({shared}) differs from one thread"
    finally:
        torch.set_num_threads(before)
