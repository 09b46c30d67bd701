"""EngineConfig is composed of a CacheConfig and a SchedulerConfig, and the runner sizes its pool.

Every field is declared once, in the config that owns it; EngineConfig takes them by name and
holds the sub-configs, which are read through it (``config.cache.block_size``). The pool's size comes from ``ModelRunner.determine_num_blocks``: memory over bytes per
block on a CPU; on CUDA, a profiled maximum-size step (here with fake memory counters).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ch31_helpers import model64, oracle, run_checked
from engine.serve import (CacheConfig, EngineConfig, EngineCore, FlatModel, ModelRunner, SamplingParams,
                          SchedulerConfig, get_backend, kv_bytes_per_block)


def _names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_every_field_is_declared_once():
    cache, scheduler = _names(CacheConfig), _names(SchedulerConfig)
    own = [n for n in _names(EngineConfig) if n not in ("cache", "scheduler")]
    every = cache + scheduler + own
    assert len(every) == len(set(every)), f"a field is declared twice: {sorted(every)}"
    assert EngineConfig.field_names() == every


def test_keywords_go_to_the_config_that_declares_them():
    config = EngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=64, policy="priority", seed=7)
    assert config.cache == CacheConfig(block_size=4, num_blocks=12)
    assert config.scheduler == SchedulerConfig(max_num_batched_tokens=64, policy="priority")
    assert config.seed == 7
    assert not any(hasattr(config, f.name) for sub in (CacheConfig, SchedulerConfig) for f in dataclasses.fields(sub)), \
        "no pass-through: a sub-config's option is read through the sub-config"
    got = config.scheduler_config()
    assert got == config.scheduler and got is not config.scheduler, "scheduler_config() is a copy"


def test_replace_and_given_sub_configs_copy_nothing_shared():
    cache = CacheConfig(block_size=8)
    config = EngineConfig(cache=cache, num_blocks=5, max_num_seqs=3)
    assert (config.cache.block_size, config.cache.num_blocks, config.scheduler.max_num_seqs) == (8, 5, 3)
    assert cache.num_blocks is None, "the caller's CacheConfig is not modified"
    other = dataclasses.replace(config, num_blocks=9)
    assert (other.cache.block_size, other.cache.num_blocks, other.scheduler.max_num_seqs) == (8, 9, 3)
    assert config.cache.num_blocks == 5 and other.cache is not config.cache


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="block_sise"):
        EngineConfig(block_sise=4)


def test_full_sampler_is_refused_naming_its_chapter():
    with pytest.raises(ValueError, match="chapter 34"):
        EngineConfig(sampler="full")


# ----- pool sizing -----------------------------------------------------------------------------
def _runner(block_size: int = 4) -> ModelRunner:
    return ModelRunner(FlatModel(model64()), get_backend("reference"), num_blocks=None, block_size=block_size)


def test_cpu_pool_is_kv_cache_bytes_over_bytes_per_block():
    runner = _runner()
    layers, kv_heads, head_dim = runner.flat.kv_spec()
    per_block = kv_bytes_per_block(layers, kv_heads, head_dim, 4, torch.float64)
    cache = CacheConfig(block_size=4, kv_cache_bytes=10 * per_block + per_block // 2)
    assert runner.determine_num_blocks(cache, max_num_tokens=16) == 10
    core = EngineCore(model64(), EngineConfig(block_size=4, kv_cache_bytes=cache.kv_cache_bytes, max_model_len=100))
    assert core.runner.num_blocks == core.blocks.num_blocks == 10
    assert all(k.shape[0] == 11 for k, _ in core.runner.kv_caches), "the pool has its blocks plus the scratch block"


def test_profiled_pool_gets_what_the_peak_leaves_and_the_profile_pool_is_freed():
    runner = _runner()
    forwards = []
    original = runner.flat.forward
    runner.flat.forward = lambda ids, *a, **k: forwards.append((ids.shape[0], a[1][0][0].shape[0])) or original(ids, *a, **k)
    layers, kv_heads, head_dim = runner.flat.kv_spec()
    per_block = kv_bytes_per_block(layers, kv_heads, head_dim, 4, torch.float64)
    total, peak = 1000 * per_block, 300 * per_block
    cache = CacheConfig(block_size=4, gpu_memory_utilization=0.5)
    got = runner.determine_num_blocks(cache, max_num_tokens=10, mem_info=lambda: (0, total), peak_bytes=lambda: peak)
    assert got == 200, "the pool gets 50% of the total less the profiled peak"
    assert forwards == [(10, 4)], "one forward of the largest step, against 3 blocks plus the scratch block"
    assert runner.kv_caches == [] and runner.num_blocks is None, "the profiling pool is freed"
    with pytest.raises(ValueError, match="leaves no room"):
        runner.determine_num_blocks(cache, 10, mem_info=lambda: (0, total), peak_bytes=lambda: total)
    runner.initialize_kv_cache(got)
    with pytest.raises(RuntimeError, match="before initialize_kv_cache"):
        runner.profile_run(10)


def test_a_pool_given_in_bytes_is_not_profiled_and_with_pool_sizes_once():
    """``kv_cache_bytes`` (vLLM's ``kv_cache_memory_bytes``) decides the pool on the CUDA path too:
    no profiling step runs; ``ModelRunner.with_pool`` sizes and allocates in one call, and a given
    ``num_blocks`` wins over both."""
    runner = _runner()
    forwards = []
    runner.flat.forward = lambda *a, **k: forwards.append(a) or pytest.fail("a profiling step ran")
    per_block = kv_bytes_per_block(*runner.flat.kv_spec(), 4, torch.float64)
    cache = CacheConfig(block_size=4, kv_cache_bytes=7 * per_block, gpu_memory_utilization=0.5)
    assert runner.determine_num_blocks(cache, 10, mem_info=lambda: (0, 1000 * per_block), peak_bytes=lambda: 0) == 7
    assert forwards == [] and runner.kv_caches == []
    sized = ModelRunner.with_pool(FlatModel(model64()), get_backend("reference"), cache, max_num_tokens=10)
    assert sized.num_blocks == 7 and sized.kv_caches[0][0].shape[0] == 8, "7 blocks plus the scratch block"
    given = ModelRunner.with_pool(FlatModel(model64()), get_backend("reference"),
                                  dataclasses.replace(cache, num_blocks=3), max_num_tokens=10)
    assert given.num_blocks == 3


def test_a_runner_given_num_blocks_allocates_at_once_and_the_engine_serves_from_a_sized_pool():
    flat = FlatModel(model64())
    runner = ModelRunner(flat, get_backend("reference"), 16, 4)
    assert runner.num_blocks == 16 and len(runner.kv_caches) == flat.kv_spec()[0]
    assert runner.kv_caches[0][0].shape == (17, 4, *flat.kv_spec()[1:])
    core = EngineCore(model64(), EngineConfig(block_size=4, max_model_len=100, attention_backend="reference"))
    prompt = [5, 17, 99, 3, 250, 42, 7]
    core.add_request("a", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    assert run_checked(core)["a"] == oracle(tuple(prompt), 6)


def test_llms_kv_cache_memory_bytes_is_the_engines_kv_cache_bytes():
    """One sizing path: ``LLM(kv_cache_memory_bytes=...)`` hands vLLM's name to the engine's own
    ``kv_cache_bytes`` (the pool is sized once, by the runner); both at once is refused."""
    from engine.llm import LLM

    per_block = kv_bytes_per_block(*FlatModel(model64()).kv_spec(), 4, torch.float64)
    llm = LLM(model64(), block_size=4, kv_cache_memory_bytes=9 * per_block, attention_backend="reference",
              flat_model="flat")
    assert llm.engine.config.cache.kv_cache_bytes == 9 * per_block and llm.engine.blocks.num_blocks == 9
    assert llm.processor is llm.engine.processor, "the LLM checks requests with its core's processor"
    with pytest.raises(ValueError, match="same option; give one"):
        LLM(model64(), kv_cache_memory_bytes=9 * per_block, kv_cache_bytes=9 * per_block)
