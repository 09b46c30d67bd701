"""CompiledFlatModel (``EngineConfig(flat_model="compiled")``): the same tokens as ``generate()``.

Every layer runs through one TorchInductor layer graph with attention and the linears as custom
ops; on the test model the engine must reproduce ``generate()`` token for token under chunked
prefill (steps of many sizes through one dynamic graph; one-row steps run eagerly), in float64
and float32 (~15-40 s of compilation each on two cores). Refusals are checked without compiling.
"""
from __future__ import annotations

import pytest
import torch

from engine.generate import generate
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams

pytestmark = pytest.mark.given  # complete code the chapter gives; the reference holes serve as oracle


@pytest.mark.parametrize("dtype,layout", [(torch.float64, "auto"), (torch.float32, "packed"), (torch.float32, "small"),
                                          (torch.bfloat16, "auto")])
def test_compiled_engine_matches_generate(dtype, layout, monkeypatch):
    """float64: plain weights; float32: oneDNN's prepacked ones or the small kernel's panels (each
    forced, as the load-time measurement would pick one), through the graph's linear op (every
    step through the graph, though decode-sized steps would normally run eagerly). The layer graph
    holds no weights, so the second float32 layout reuses the first one's graph. bfloat16: the
    graph rounds where generate()'s eager ops round (emulate_precision_casts; without it a kept
    float32 intermediate flipped request r2's 19th token), so the tokens are generate()'s exactly."""
    from engine.fast.compiled import CompiledFlatModel

    monkeypatch.setenv("ENGINE_LINEAR_LAYOUT", layout)
    model = tiny_model(seed=3, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (37, 5, 21)]
    prompts.append(prompts[0][:16] + prompts[1])  # adopts two cached blocks of 8
    lens = (12, 16, 9, 11)
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="compiled",
                                          max_num_batched_tokens=16, long_prefill_token_threshold=8))
    assert isinstance(core.flat, CompiledFlatModel)
    if layout != "auto":
        assert {entry[k].layout for entry in core.flat.layers for k in ("qkv", "o", "gate_up", "down")} == {layout}
    assert core.flat.wait_compiled(), f"the background compile failed: {core.flat.graphs.error!r}"
    core.flat.eager_rows = 1  # every step through the graph but one-row ones (a size it specialises)
    for i, (p, m) in enumerate(zip(prompts, lens)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
    out = core.run_until_done()
    for i, (p, m) in enumerate(zip(prompts, lens)):
        want = generate(model, p, m)
        assert out[f"r{i}"] == want, f"compiled model: request r{i} gave {out[f'r{i}']}, generate() gave {want}"
    assert core.blocks.num_free == core.blocks.num_blocks


def test_compile_refusals(monkeypatch):
    from engine.fast import compiled

    with pytest.raises(ValueError, match="unknown flat model 'compile'"):
        EngineConfig(flat_model="compile")
    with pytest.raises(ValueError, match="dense models only"):
        EngineCore(tiny_model(seed=3, moe=True), EngineConfig(flat_model="compiled"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # TorchInductor compiles with $CXX: one it cannot run
    with pytest.raises(ValueError, match="flat_model='compiled' needs TorchInductor: CXX='/nonexistent/c\\+\\+'"):
        EngineCore(tiny_model(seed=3), EngineConfig(flat_model="compiled"))
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        EngineCore(tiny_model(seed=3), EngineConfig(flat_model="compiled"))


def test_two_compiled_engines_in_two_threads():
    """Two flat_model="compiled" engines on one model (one shared graph), stepped at once from two threads:
    each must get exactly generate()'s tokens, so neither may write K/V into the other's pool nor
    run its attention on the other's step (the step context is the calling thread's)."""
    from ch31_helpers import run_in_threads
    from engine.fast.compiled import CompiledFlatModel

    model = tiny_model(seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    prompts = [[torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in sizes]
               for sizes in ((29, 13), (17, 31))]
    cores = [EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="compiled",
                                            max_num_batched_tokens=16)) for _ in prompts]

    def prepare(core) -> None:
        assert isinstance(core.flat, CompiledFlatModel)
        assert core.flat.wait_compiled(), f"the background compile failed: {core.flat.graphs.error!r}"
        core.flat.eager_rows = 1  # every step through the graph but one-row ones (a size it specialises)

    results = run_in_threads(cores, prompts, 10, prepare)
    for i, core in enumerate(cores):
        for j, p in enumerate(prompts[i]):
            assert results[i][f"r{j}"] == generate(model, p, 10), f"engine {i}, request r{j}: wrong tokens"


def test_compiler_failure_mid_run_falls_back_to_eager(monkeypatch, capsys):
    """A layer graph that the compiler refuses mid-run (torch's recompile limit under fullgraph=True,
    as a new thread count or dtype can trigger) must not fail the step: that step and every later
    one run eagerly, with generate()'s tokens, and stderr says so. An error of the engine's own code
    inside the graph is not the compiler's and still propagates. No compilation: the graph is
    marked ready and its call replaced."""
    from engine.fast import compiled

    model = tiny_model(seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (23, 9)]
    monkeypatch.setattr(compiled, "_graphs", {})  # a graph of this test's own
    monkeypatch.setattr(compiled.CompiledFlatModel, "_compile_in_background", lambda self: None)  # no compile
    core = EngineCore(model, EngineConfig(block_size=8, attention_backend="cpu", flat_model="compiled",
                                          max_num_batched_tokens=16))
    graphs = core.flat.graphs
    graphs.thread.join()
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")

    monkeypatch.setattr(graphs, "layer", refuse)
    graphs.ready.set()
    core.flat.eager_rows = 1
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0))
    out = core.run_until_done()
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == generate(model, p, 7), f"request r{i}: wrong tokens after the eager fallback"
    assert calls == [1], f"the refusing graph was called {len(calls)} times: after a refusal every step must be eager"
    assert isinstance(graphs.error, torch._dynamo.exc.FailOnRecompileLimitHit)
    assert "running eagerly from now on" in capsys.readouterr().err

    def own_error(*args, **kwargs):  # an error of the engine's own code inside the graph: not swallowed
        raise ValueError("the backend's own error")

    graphs.error = None
    monkeypatch.setattr(graphs, "layer", own_error)
    core.add_request("r9", prompts[0], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
    with pytest.raises(ValueError, match="the backend's own error"):
        core.step()
