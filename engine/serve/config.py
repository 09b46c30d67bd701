"""The engine's configuration: CacheConfig, SchedulerConfig and EngineConfig, which holds one of each.

As in vLLM V1's ``VllmConfig``, the engine's config is composed by reference: the pool's knobs are
read as ``config.cache.block_size``, the scheduler's as ``config.scheduler.max_num_seqs``. Every
option is declared once, with its one default, in the config that owns it; ``LLM(...)`` passes
only the options it was given, so the defaults below are the defaults everywhere.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SEED_MIN, SEED_MAX = 0, 2**64 - 1  # what torch.Generator.manual_seed takes

# Names the engine's options choose from, mapped to "module:Class"; ``engine.serve.registry`` imports
# them only when one is chosen, so the chapter's files never import a fast path.
ATTENTION_BACKENDS: dict[str, str] = {
    "reference": "engine.serve.attention:ReferenceBackend",  # the chapter's loop: the oracle
    "torch": "engine.fast.torch_attention:TorchBackend",  # vectorized, the default
    "cpu": "engine.fast.cpu_attention:CPUBackend",  # a C++ kernel reads the pool in place
    "triton": "engine.fast.triton_attention:TritonBackend",  # chapter 32, GPU
}
FLAT_MODELS: dict[str, str] = {
    "flat": "engine.serve.flat:FlatModel",  # the chapter's: the model's own modules, one by one
    "fused": "engine.fast.fused:FusedFlatModel",  # merged projections, fused elementwise ops
    "compiled": "engine.fast.compiled:CompiledFlatModel",  # fused layers as one Inductor graph
}

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
SAMPLERS = ("simple",)  # chapter 34 adds "full"


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block: the one default every command and experiment takes


@dataclass
class CacheConfig:
    """How the block pool is laid out and sized.

    ``num_blocks=None`` sizes the pool from memory (``ModelRunner.determine_num_blocks``):
    ``kv_cache_bytes`` when given (any device; vLLM's ``kv_cache_memory_bytes``), else sized for
    the model on a CPU (``sizing.default_kv_cache_bytes``) and by profiling plus
    ``gpu_memory_utilization`` on CUDA.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None  # None: the model's K/V for sizing.DEFAULT_KV_CACHE_TOKENS tokens (capped)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.kv_cache_bytes is not None:
            _positive_int("kv_cache_bytes", self.kv_cache_bytes)
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        _flag("enable_prefix_caching", self.enable_prefix_caching)


@dataclass
class SchedulerConfig:
    """``max_num_batched_tokens`` is the step's token budget; ``long_prefill_token_threshold``
    caps one request's chunk (0 = no cap beyond the budget)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _flag("enable_chunked_prefill", self.enable_chunked_prefill)
        cap = self.long_prefill_token_threshold
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0 = no cap), got {cap!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: choose one of {POLICIES}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}: choose one of {PREEMPTION_MODES}")


@dataclass(init=False)
class EngineConfig:
    """Every knob of the engine core: ``cache`` (a CacheConfig), ``scheduler`` (a SchedulerConfig)
    and the engine-level options declared here. Read a sub-config's option through it
    (``config.cache.block_size``, ``config.scheduler.max_num_seqs``).

    The constructor also takes any sub-config option by name and hands it to the config that
    declares it (``EngineConfig(block_size=4, policy="priority")`` builds ``CacheConfig(block_size=4)``
    and ``SchedulerConfig(policy="priority")``, each validating its own fields); a given
    ``cache``/``scheduler`` is copied, never shared. ``field_names()`` lists every keyword.

    ``attention_backend`` and ``flat_model`` are names in ``engine.serve.registry``: the attention
    backend ("torch", the default; "reference", the chapter's loop; "cpu"; "triton") and the flat
    model ("flat", the chapter's FlatModel; "fused"; "compiled"). ``max_model_len=None`` means the
    model's ``max_position_embeddings``.
    """

    cache: CacheConfig
    scheduler: SchedulerConfig
    attention_backend: str = "torch"
    flat_model: str = "flat"
    max_model_len: int | None = None
    seed: int = 0
    sampler: str = "simple"

    def __init__(self, cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                 **options: Any) -> None:
        def take(sub: type) -> dict[str, Any]:  # the keywords that ``sub`` declares
            return {f.name: options.pop(f.name) for f in dataclasses.fields(sub) if f.name in options}

        self.cache = dataclasses.replace(cache or CacheConfig(), **take(CacheConfig))
        self.scheduler = dataclasses.replace(scheduler or SchedulerConfig(), **take(SchedulerConfig))
        for f in dataclasses.fields(self)[2:]:  # after cache and scheduler: the engine-level options
            setattr(self, f.name, options.pop(f.name, f.default))
        if options:
            raise TypeError(f"EngineConfig() got an unexpected keyword argument {next(iter(options))!r}")
        self._check()

    def _check(self) -> None:
        if self.max_model_len is not None:
            _positive_int("EngineConfig.max_model_len", self.max_model_len)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"EngineConfig.seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.sampler == "full":
            raise ValueError("sampler='full' is chapter 34's sampler, not part of this chapter; use 'simple'")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}: choose one of {SAMPLERS}")
        for kind, name, registry in (("attention backend", self.attention_backend, ATTENTION_BACKENDS),
                                     ("flat model", self.flat_model, FLAT_MODELS)):
            if name not in registry:
                raise ValueError(f"unknown {kind} {name!r}: choose one of {sorted(registry)}")

    @classmethod
    def field_names(cls) -> list[str]:
        """Every keyword the constructor takes besides ``cache``/``scheduler``: theirs, then its own."""
        return [f.name for sub in (CacheConfig, SchedulerConfig) for f in dataclasses.fields(sub)] + \
            [f.name for f in dataclasses.fields(cls)[2:]]

    def scheduler_config(self) -> SchedulerConfig:
        """A copy of ``scheduler`` (a Scheduler owns its config)."""
        return dataclasses.replace(self.scheduler)
