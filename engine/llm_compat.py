"""The rest of vLLM's ``LLM`` surface: its stats, and the methods the course engine does not have.

``VllmExtras`` is mixed into ``engine.llm.LLM``. It holds what a vLLM script may call besides
generating: ``get_metrics()`` (the core's counters under vLLM's metric names), ``llm_engine``
(request counts and the core), a few one-liners (``apply_model``, ``get_world_size``,
``reset_mm_cache``), and one refusing method per vLLM method with no course counterpart, each
saying why by name (``tests/test_vllm_surface.py`` checks that every vLLM method is one or the
other).
"""
from __future__ import annotations

import dataclasses
from typing import Any


def _refused(name: str, why: str):
    """A method vLLM's LLM has and ours does not: calling it says so, by name."""
    def method(*args: Any, **kwargs: Any):
        raise ValueError(f"LLM.{name}: {why}")

    method.__name__ = name
    method.__doc__ = f"Not in the course engine: {why}."
    return method


@dataclasses.dataclass
class Metric:
    """One of ``LLM.get_metrics()``: a name (vLLM's where it has one), "gauge" or "counter", a value."""

    name: str
    kind: str
    value: float


class VllmExtras:
    """Mixin for ``LLM`` (which provides ``engine``, ``model``, ``_lock``, ``get_tokenizer`` and
    ``reset_prefix_cache``)."""

    def get_metrics(self) -> list[Metric]:
        """The core's counters under vLLM's metric names (a snapshot, like vLLM's ``get_metrics``)."""
        with self._lock:
            core, blocks = self.engine, self.engine.blocks
            sched = core.scheduler
            return [
                Metric("vllm:num_requests_running", "gauge", len(sched.running)),
                Metric("vllm:num_requests_waiting", "gauge", len(sched.waiting)),
                Metric("vllm:kv_cache_usage_perc", "gauge", blocks.usage),
                Metric("vllm:prefix_cache_queries", "counter", blocks.num_queries),
                Metric("vllm:prefix_cache_hits", "counter", blocks.num_hits),
                Metric("vllm:num_preemptions", "counter", core.preemptions),
                Metric("course:engine_steps", "counter", core.steps),
                Metric("course:num_gpu_blocks", "gauge", blocks.num_blocks),
            ]

    @property
    def llm_engine(self) -> "LLMEngineView":
        """vLLM's ``llm.llm_engine``: the request counts, the tokenizer and the core's stats."""
        return LLMEngineView(self)

    def apply_model(self, func):
        """Call ``func(model)`` on the model (vLLM runs it in every worker; here there is one)."""
        return [func(self.model)]

    def get_world_size(self, include_dp: bool = True) -> int:
        return 1  # one process, one device

    def reset_mm_cache(self) -> None:
        """Nothing to reset: no images, no multimodal cache (chapter 43)."""

    # vLLM methods the course engine does not have: each refuses by name, saying why.
    encode = _refused("encode", "pooling models are not part of the course engine; use generate()")
    embed = _refused("embed", "pooling models are not part of the course engine; use generate()")
    classify = _refused("classify", "pooling models are not part of the course engine; use generate()")
    score = _refused("score", "pooling models are not part of the course engine; use generate()")
    beam_search = _refused("beam_search", "no beam search in the course engine; sample n completions "
                                          "(SamplingParams(n=...)) instead")
    sleep = _refused("sleep", "the pool is allocated once, for the LLM's lifetime (no sleep mode)")
    wake_up = _refused("wake_up", "the pool is allocated once, for the LLM's lifetime (no sleep mode)")
    collective_rpc = _refused("collective_rpc", "there are no workers; the model is llm.model, in this process")
    start_profile = _refused("start_profile", "wrap the calls in torch.profiler.profile() instead")
    stop_profile = _refused("stop_profile", "wrap the calls in torch.profiler.profile() instead")
    release_kv_cache_memory = _refused("release_kv_cache_memory", "the pool lives as long as the LLM; "
                                                                  "delete the LLM to free it")
    from_engine_args = classmethod(_refused("from_engine_args", "the course has no EngineArgs; pass the "
                                                                "options to LLM(...)"))
    _WEIGHTS = "in-place weight updates (RL training loops) are not part of the course engine; build a new LLM"
    init_weight_transfer_engine = _refused("init_weight_transfer_engine", _WEIGHTS)
    shutdown_weight_transfer_engine = _refused("shutdown_weight_transfer_engine", _WEIGHTS)
    start_weight_update = _refused("start_weight_update", _WEIGHTS)
    start_draft_weight_update = _refused("start_draft_weight_update", _WEIGHTS)
    finish_weight_update = _refused("finish_weight_update", _WEIGHTS)
    update_weights = _refused("update_weights", _WEIGHTS)
    update_weight_version = _refused("update_weight_version", _WEIGHTS)
    get_weight_version = _refused("get_weight_version", _WEIGHTS)


class LLMEngineView:
    """What vLLM scripts reach through ``llm.llm_engine``; ``engine_core`` is the chapter's core."""

    def __init__(self, llm) -> None:
        self._llm = llm
        self.engine_core = llm.engine

    def get_num_unfinished_requests(self) -> int:
        with self._llm._lock:
            return len(self.engine_core.scheduler.requests)

    def has_unfinished_requests(self) -> bool:
        with self._llm._lock:
            return self.engine_core.has_unfinished()

    def get_tokenizer(self):
        return self._llm.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        return self._llm.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        return self._llm.get_metrics()
