"""``LLM(...)``'s keyword arguments: the course's ``EngineConfig`` fields and vLLM's names.

A script written for vLLM passes vLLM's engine arguments. Each one is, here:

* the same knob under vLLM's name (``VLLM_NAMES``: ``num_gpu_blocks_override`` is our
  ``num_blocks``, ``scheduling_policy`` our ``policy`` ...), or one ``EngineConfig`` already
  spells vLLM's way (``block_size``, ``max_num_seqs`` ...); ``None`` means "the engine's
  default", as in vLLM;
* accepted because it changes nothing here (``HARMLESS``: ``enforce_eager`` — there are no CUDA
  graphs before chapter 33 —, ``trust_remote_code`` — no checkpoint code is ever run ...);
* accepted only at its neutral value (``NEUTRAL_ONLY``: ``tensor_parallel_size=1`` ...), and
  refused otherwise with the reason and, where there is one, the chapter that brings it;
* anything else: refused by name.

``split_options`` does the sorting, before the model is loaded: a typo must not cost a load.
"""
from __future__ import annotations

from typing import Any

# vLLM's name -> EngineConfig's.
VLLM_NAMES = {"num_gpu_blocks_override": "num_blocks", "scheduling_policy": "policy"}

# vLLM names that change nothing in the course engine, with the reason (any value is accepted).
HARMLESS: dict[str, str] = {
    "enforce_eager": "the course engine is always eager: CUDA graphs come in chapter 33",
    "trust_remote_code": "the course engine never runs code shipped with a checkpoint",
    "disable_log_stats": "the engine keeps its counters and never logs them; see LLM.get_metrics()",
    "disable_custom_all_reduce": "one device: there is no all-reduce",
    "swap_space": "swap-mode preemption allocates its host copies on demand",
    "use_tqdm_on_load": "loading shows no progress bar",
    "hf_token": "checkpoints are local directories: nothing is downloaded",
    "download_dir": "checkpoints are local directories: nothing is downloaded",
    "served_model_name": "names matter only to a server",
    "compilation_config": "the course engine does not use torch.compile",
    "max_seq_len_to_capture": "no CUDA graphs (chapter 33)",
    "disable_async_output_proc": "outputs are processed in the caller's thread",
    "aggregate_engine_logging": "nothing is logged",
    "max_logprobs": "logprobs=k is bounded by the vocabulary only",
    "prefix_caching_hash_algo": "the prefix cache always hashes with BLAKE2b, a cryptographic hash",
}

# vLLM names accepted only at the value that changes nothing -> (that value, why, chapter or "").
NEUTRAL_ONLY: dict[str, tuple[Any, str]] = {
    "tensor_parallel_size": (1, "one device per engine; pipeline stages are chapter 41"),
    "pipeline_parallel_size": (1, "pipeline stages are chapter 41"),
    "data_parallel_size": (1, "run one LLM per device instead"),
    "quantization": (None, "weights are used in the dtype they are loaded in"),
    "quantization_config": (None, "weights are used in the dtype they are loaded in"),
    "kv_cache_dtype": ("auto", "the K/V pool has the model's dtype"),
    "cpu_offload_gb": (0, "weights stay on one device"),
    "offload_group_size": (0, "weights stay on one device"),
    "offload_num_in_group": (1, "weights stay on one device"),
    "offload_prefetch_step": (1, "weights stay on one device"),
    "offload_params": (None, "weights stay on one device"),
    "hf_overrides": (None, "edit the checkpoint's config.json instead"),
    "revision": (None, "checkpoints are local directories"),
    "tokenizer_revision": (None, "checkpoints are local directories"),
    "code_revision": (None, "checkpoints are local directories"),
    "tokenizer_mode": ("auto", "the course reads tokenizer.json with the tokenizers library"),
    "runner": ("auto", "the course engine generates text; pooling models are not part of it"),
    "convert": ("auto", "the course engine generates text; pooling models are not part of it"),
    "load_format": ("auto", "the loader reads safetensors"),
    "config_format": ("auto", "the loader reads HF's config.json"),
    "mm_processor_kwargs": (None, "images are chapter 43"),
    "limit_mm_per_prompt": (None, "images are chapter 43"),
    "allowed_local_media_path": ("", "images are chapter 43"),
    "allowed_media_domains": (None, "images are chapter 43"),
    "enable_lora": (False, "LoRA adapters are chapter 43"),
    "spec_method": (None, "speculative decoding is chapter 37"),
    "spec_model": (None, "speculative decoding is chapter 37"),
    "spec_tokens": (None, "speculative decoding is chapter 37"),
    "speculative_config": (None, "speculative decoding is chapter 37"),
    "async_scheduling": (None, "async scheduling is chapter 33"),
    "logits_processors": (None, "logits processors come with chapter 34's sampler"),
    "structured_outputs_config": (None, "structured outputs come with chapter 34's sampler"),
    "pooler_config": (None, "pooling models are not part of the course engine"),
    "profiler_config": (None, "profile with torch.profiler around LLM.generate"),
    "attention_config": (None, "choose attention with attention_backend= (our names: engine.serve.registry.ATTENTION_BACKENDS)"),
    "enable_return_routed_experts": (False, "the engine does not return MoE routing"),
    "return_sampling_mask": (False, "sampling masks come with chapter 34's sampler"),
    "enable_prompt_embeds": (False, "prompts are token ids"),
    "enable_sleep_mode": (False, "the pool is allocated once, for the LLM's lifetime"),
    "distributed_executor_backend": (None, "one process, one device"),
    "kv_transfer_config": (None, "disaggregated prefill is not part of the course"),
    "generation_config": ("auto", "'auto' (the checkpoint's generation_config.json) or 'vllm' (SamplingParams())"),
}


def split_options(options: dict[str, Any], engine_fields: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sort ``LLM(**options)`` into (``EngineConfig`` keyword arguments, front-end options).

    Front-end options are the ones ``LLM`` itself interprets: ``kv_cache_memory_bytes`` and
    ``generation_config``. ValueError names the first option that cannot be honoured.
    """
    engine: dict[str, Any] = {}
    front: dict[str, Any] = {}
    for name, value in options.items():
        target = VLLM_NAMES.get(name, name)
        if target in engine_fields:
            if target in engine and name != target:
                raise ValueError(f"LLM: {name!r} and {target!r} are the same option; give one")
            if value is not None or target in ("num_blocks", "max_model_len"):
                engine[target] = value
        elif name == "kv_cache_memory_bytes":
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"LLM: kv_cache_memory_bytes must be a positive integer or None, got {value!r}")
            front[name] = value
        elif name in HARMLESS:
            continue
        elif name in NEUTRAL_ONLY:
            neutral, why = NEUTRAL_ONLY[name]
            if name == "generation_config":
                if value not in ("auto", "vllm"):
                    raise ValueError(f"LLM: generation_config={value!r} is not supported: {why}")
                front[name] = value
            elif not _neutral(value, neutral):
                raise ValueError(f"LLM: {name}={value!r} is not supported by the course engine ({why}); "
                                 f"leave it at {neutral!r}")
        else:
            raise ValueError(
                f"unknown LLM option {name!r}: not an EngineConfig field ({sorted(engine_fields)}) nor a vLLM "
                "option the course engine accepts (see engine/llm_options.py)")
    if engine.get("num_blocks") is not None and front.get("kv_cache_memory_bytes") is not None:
        raise ValueError("LLM: give num_blocks (num_gpu_blocks_override) or kv_cache_memory_bytes, not both")
    return engine, front


def _neutral(value: Any, neutral: Any) -> bool:
    """Equal to the neutral value, counting an empty container as None (vLLM's {} and set())."""
    if value == neutral:
        return True
    return neutral is None and value is not None and hasattr(value, "__len__") and len(value) == 0
