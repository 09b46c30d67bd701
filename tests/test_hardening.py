"""Every engine kind, built twice in one process on one model and stepped from two threads at once.

Each engine owns its pools, its backend's per-step plan and its requests; what the kinds share (the
model's weights, the fused model's packed linears, the kernels' libraries) must be read-only while
they run. So two engines stepping at the same time in two threads must each give exactly the tokens
of ``generate()`` (float64) or of the same engine run alone (float32, where the fused kinds' small-batch
linear kernel is in use and summation order may move a greedy choice away from ``generate()``'s). (The compiled kind, which also shares one graph, is tested in
test_compiled.py.) One ``LLM`` driven by two threads is test_llm_api.py's.
"""
from __future__ import annotations

import pytest
import torch

from engine.generate import generate
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams

from ch31_helpers import run_in_threads

pytestmark = pytest.mark.given  # complete code the chapter gives; the reference holes serve as oracle

KINDS = {
    "reference": {},
    "torch": {"attention_backend": "torch"},
    "cpu": {"attention_backend": "cpu"},
    "fused-torch": {"attention_backend": "torch", "flat_model": "fused"},
    "fused-cpu": {"attention_backend": "cpu", "flat_model": "fused"},
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_engines_of_one_kind_in_two_threads(kind, dtype):
    model = tiny_model(seed=3, dtype=dtype)
    gen = torch.Generator().manual_seed(17)
    prompts = [[torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in sizes]
               for sizes in ((23, 9, 14), (31, 6, 18))]
    cores = [EngineCore(model, EngineConfig(block_size=4, max_num_batched_tokens=12, **KINDS[kind]))
             for _ in prompts]
    results = run_in_threads(cores, prompts, 8)
    for i, core in enumerate(cores):
        if dtype == torch.float64:
            want = {f"r{j}": generate(model, p, 8) for j, p in enumerate(prompts[i])}
        else:
            alone = EngineCore(model, EngineConfig(block_size=4, max_num_batched_tokens=12, **KINDS[kind]))
            for j, p in enumerate(prompts[i]):
                alone.add_request(f"r{j}", p, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
            want = alone.run_until_done()
        assert results[i] == want, f"{kind} engine {i}: wrong tokens when another engine stepped at the same time"
        assert core.blocks.num_free == core.blocks.num_blocks
