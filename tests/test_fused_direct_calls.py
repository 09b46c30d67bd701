"""The fused CPU model's direct calls (issue 40: the step's Python): the same bits as the checked calls.

``FusedFlatModel._forward_kernels`` runs the linears into scratch buffers (``AmxLinear.run`` in
bfloat16, ``SmallLinear.run`` in float32), writes each layer's K and V rows straight from the
merged q/k/v rows (``CPUBackend.write_merged``) and its attention into a scratch buffer
(``CPUBackend.forward_into``), and, on a step whose every row samples, takes the LM head on the
final hidden rows without selecting them. Each is checked here against what it replaces: the
linears' calls, ``write_kv`` (the reference's store), ``forward``, ``FlatModel.logits``'
selection, and ``generate()``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.generate import generate
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, FlatModel, SamplingParams
from engine.fast import cpu_linear_amx, linear_layout
from engine.fast.fused import FusedFlatModel

from tests.test_backends import random_paged_batch
from tests.test_fused import CONFIGS, MAX_TOKENS, prompts_for

pytestmark = pytest.mark.given  # complete code the chapter gives; the reference holes serve as oracle


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gated", [False, True])
def test_amx_run_writes_the_calls_bits(gated, threads, monkeypatch):
    """``AmxLinear.run`` into a buffer gives ``AmxLinear(x)``'s bfloat16 bits (plain and gated), at
    the thread count ``threads()`` gives, and leaves the rest of the buffer alone."""
    if not cpu_linear_amx.available():
        assert cpu_linear_amx.takes(128, 64, gated=True), "the shape rule holds anyway"
        return
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(512, 96, generator=gen).bfloat16()
    lin = cpu_linear_amx.AmxLinear(w, gated=gated)
    width = 256 if gated else 512
    assert lin.threads() == lin.threads(threads) == max(1, min(threads, 8 // cpu_linear_amx.MIN_GROUPS_PER_THREAD))
    for m in (1, 7, 16, 33):
        x = torch.randn(m, 96, generator=gen).bfloat16()
        buf = torch.full((m + 1, width), 3.0, dtype=torch.bfloat16)  # one row past the output
        lin.run(x.data_ptr(), m, buf.data_ptr(), lin.threads())
        assert torch.equal(buf[:m].view(torch.int16), lin(x).view(torch.int16)), f"{m} rows, gated={gated}"
        assert bool((buf[m] == 3.0).all()), "run wrote past its m output rows"


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_write_merged_stores_what_write_kv_stores(source, monkeypatch):
    """``CPUBackend.write_merged`` of the K and V columns of merged q/k/v rows stores what
    ``write_kv`` stores for those columns: its first call of a step through ``write`` (views), the
    step's later calls (other pools, other rows) without it; a slot mapping of another step goes
    through ``write`` again."""
    from engine.serve.attention import write_kv
    from engine.fast.cpu_attention import CPUBackend

    _, cache, meta = random_paged_batch(13, 4, 4, 2, head_dim=8)
    n = meta.slot_mapping.shape[0]
    backend, calls = CPUBackend(), []
    write = backend.write
    backend.write = lambda *a: calls.append(1) or write(*a)
    pool_dtype = torch.bfloat16 if source == torch.bfloat16 else torch.float32
    for layer in range(3):
        qkv = torch.randn(n, (4 + 2 + 2) * 8, generator=torch.Generator().manual_seed(layer)).to(source)
        k, v = qkv[:, 32:48].view(n, 2, 8), qkv[:, 48:].view(n, 2, 8)
        want = tuple(p.to(pool_dtype).clone() for p in cache)
        write_kv(*want, k.to(pool_dtype), v.to(pool_dtype), meta.slot_mapping)
        got = tuple(p.to(pool_dtype).clone() for p in cache)
        backend.write_merged(got, qkv, 32, 48, meta)
        for name, g, w in zip("kv", got, want):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), \
                f"layer {layer}: write_merged stored different {name} than write_kv ({source} rows)"
    assert len(calls) == 1, "only the step's first write_merged goes through write"
    other = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.clone())
    backend.write_merged(tuple(p.to(pool_dtype).clone() for p in cache), qkv, 32, 48, other)
    assert len(calls) == 2, "another step's slot mapping must be checked again"


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("fuse_silu", [True, False])
@pytest.mark.parametrize("dtype, layout", [(torch.bfloat16, "amx"), (torch.float32, "small")])
def test_direct_linear_calls_give_the_linears_bits(dtype, layout, fuse_silu, backend, monkeypatch):
    """Every linear in AMX tiles (bfloat16) or the small kernel's panels (float32), forced: the
    layer loop's direct ``run`` calls into scratch buffers give every step's logits bit for bit as
    the same linears called through ``Linear`` (``direct_linears=False``), under chunked prefill
    with prompt logprobs (the last layer's kept rows), with the gate/up pass gated (SiLU-mul in
    the kernel) or not, on the CPU backend (attention into a scratch buffer, K/V from the merged
    rows) and on the torch one (neither); and generate()'s greedy tokens."""
    from engine.serve import engine as engine_module

    monkeypatch.setenv(linear_layout.ENV, layout)
    monkeypatch.setattr(engine_module, "get_flat_model", lambda name, model: FusedFlatModel(model, fuse_silu=fuse_silu))
    model = tiny_model(seed=3, dtype=dtype)
    prompts = prompts_for(model)
    runs = []
    for direct in (True, False):
        core = EngineCore(model, EngineConfig(block_size=8, attention_backend=backend, flat_model="fused",
                                              **CONFIGS["chunked"]))
        core.flat.direct_linears = direct
        held = {entry[name].layout for entry in core.flat.layers for name in ("qkv", "o", "gate_up", "down")}
        logits, steps = [], []
        execute, threads_now = core.runner.execute, core.flat._direct_threads_now
        core.runner.execute = lambda batch: logits.append(execute(batch)) or logits[-1]
        core.flat._direct_threads_now = lambda: steps.append(1) or threads_now()  # only the direct path asks
        for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
            core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0,
                                                        prompt_logprobs=2 if i == 1 else None))
        runs.append((core.run_until_done(), logits))
        # The layout runs here (AMX: a CPU with AMX-BF16; small: a C++ compiler): the path is the switch's
        assert bool(steps) == (direct and held == {layout}), f"direct_linears={direct} with {held} layouts"
        if not fuse_silu:  # fused: gated where the kernel's build takes it (its own tests check which)
            assert not any(entry["gate_up"].gated for entry in core.flat.layers)
    (tokens, logits), (want_tokens, want_logits) = runs
    assert tokens == want_tokens and len(logits) == len(want_logits)
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        assert torch.equal(got, want), f"step {step}: the direct linear calls changed the logits ({layout})"
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
        assert tokens[f"r{i}"] == generate(model, p, m), f"request r{i} differs from generate() ({layout})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_sample_rows_skip_the_selection_with_its_bits(dtype):
    """A step whose every row samples (decodes, and a prefill's one-row chunks): the fused model's
    ``logits`` (the head on the final hidden rows as they are) gives ``FlatModel.logits``' bits (the
    head on the rows ``logits_indices`` selects)."""
    model = tiny_model(seed=3, dtype=dtype)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused"))
    batches = []
    prepare = core.runner.prepare
    core.runner.prepare = lambda *a: batches.append(prepare(*a)) or batches[-1]
    for i, p in enumerate(prompts_for(model)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    core.run_until_done()
    decodes = [b for b in batches if b.logits_indices.numel() == b.input_ids.shape[0] and not b.prompt_spans]
    assert decodes, "the run must have steps whose every row samples"
    for batch in decodes[:3]:  # the two calls see one pool: each writes the batch's same K/V rows first
        got = core.flat.logits(batch, core.runner.kv_caches, core.runner.backend)
        want = FlatModel.logits(core.flat, batch, core.runner.kv_caches, core.runner.backend)
        assert got.dtype == want.dtype and torch.equal(got, want), "the skipped selection changed the logits"


@pytest.mark.parametrize("decode_only", [True, False])
def test_forward_into_writes_forwards_bits(decode_only):
    """``CPUBackend.forward_into``: ``forward``'s bits, written into the buffer given when every
    row takes the row kernel (decode rows, twice: the step's later layers reuse the checked call),
    else a new tensor (a prefill's requests on the matrix path); a buffer unlike q is refused."""
    from engine.fast.cpu_attention import CPUBackend

    for seed, window in ((0, 0), (3, 5)):
        q, cache, meta = random_paged_batch(seed, 4, 4, 2, head_dim=16, decode_only=decode_only)
        backend = CPUBackend(prefill="sdpa")
        want = CPUBackend(prefill="sdpa").forward(q, cache, meta, window=window)
        for _ in range(2):
            buf = torch.full_like(q, float("nan"))
            got = backend.forward_into(q, cache, meta, buf, window=window)
            assert (got is buf) == decode_only, "the buffer is the result exactly when every row takes the kernel"
            assert torch.equal(got, want), f"forward_into differs from forward (seed {seed}, window {window})"
        if decode_only:  # refused by the step's first call (checked) and by a later one (reused)
            for b in (CPUBackend(prefill="sdpa"), backend):
                with pytest.raises(ValueError, match="contiguous"):
                    b.forward_into(q, cache, meta, torch.empty(q.shape[0], q.shape[1] * q.shape[2]), window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_lookup_is_the_modules(dtype):
    """An untied model's embeddings (``FusedFlatModel.embed``: the weight's rows as one op) are the
    embedding module's bits, repeated ids included; an id outside the vocabulary is refused."""
    model = tiny_model(seed=3, dtype=dtype)
    flat = FusedFlatModel(model)
    assert not flat.tied
    ids = torch.tensor([0, 5, 5, model.cfg.vocab_size - 1, 17])
    got, want = flat.embed(ids), model.model.embed_tokens(ids).to(flat.linear_dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(IndexError):
        flat.embed(torch.tensor([model.cfg.vocab_size]))



@pytest.mark.parametrize("fuse_silu", [True, False])
@pytest.mark.parametrize("dtype, layout", [(torch.bfloat16, "amx"), (torch.float32, "small")])
def test_some_linears_direct_others_through_linear(dtype, layout, fuse_silu, monkeypatch):
    """A step whose linears mix the two ways (as when the layout probe keeps one shape in oneDNN's
    packed layout, which has no ``run``): each linear without a direct kernel is called through
    its ``Linear`` and its output checked, the others run into scratch buffers; every step's
    logits are the all-``Linear`` engine's bits, for either half of each layer's linears direct."""
    from engine.serve import engine as engine_module

    monkeypatch.setenv(linear_layout.ENV, layout)
    monkeypatch.setattr(engine_module, "get_flat_model", lambda name, model: FusedFlatModel(model, fuse_silu=fuse_silu))
    model = tiny_model(seed=3, dtype=dtype)
    prompts = prompts_for(model)
    results = []
    for keep in (None, (0, 2), (1, 3)):  # None: every linear through Linear (the oracle)
        core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="fused",
                                              **CONFIGS["chunked"]))
        flat = core.flat
        flat._kernel_layers()
        if keep is None:
            flat.direct_linears = False
        else:  # only the linears at ``keep`` (of q/k/v, o, gate/up, down) keep their direct kernel
            flat._direct = [tuple(k if j in keep else None for j, k in enumerate(layer)) for layer in flat._direct]
            flat._any_direct = any(k is not None for layer in flat._direct for k in layer)
        logits = []
        execute = core.runner.execute
        core.runner.execute = lambda batch: logits.append(execute(batch)) or logits[-1]
        for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
            core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
        results.append((keep, core.run_until_done(), logits))
    (_, want_tokens, want_logits), *rest = results
    for keep, tokens, logits in rest:
        assert tokens == want_tokens and len(logits) == len(want_logits), f"direct linears {keep}"
        for step, (got, want) in enumerate(zip(logits, want_logits)):
            assert torch.equal(got, want), f"step {step}: direct linears {keep} of 4 changed the logits ({layout})"
