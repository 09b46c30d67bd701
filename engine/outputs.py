"""What ``LLM`` hands back, in vLLM's shapes: ``RequestOutput`` with its ``CompletionOutput``s.

The names, field order and defaults follow vLLM's ``vllm.outputs`` (``tests/vllm_surface.json``
records them), so code that reads vLLM's outputs reads ours. Fields the course engine does not
compute are present and say so (``lora_request`` is None: chapter 43). ``cumulative_logprob``
and ``logprobs`` are None unless ``SamplingParams.logprobs`` asks for them, as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's log-probability, its rank in the distribution (1 = most likely; None when the
    engine did not rank it) and its text (None when not detokenized)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Times (``time.monotonic()`` seconds) as the front end saw them: the request was queued,
    its first output token arrived, it finished. vLLM reports the same moments as
    ``RequestStateStats`` (``arrival_time``, ``first_token_ts``, ``last_token_ts``)."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def first_token_latency(self) -> float | None:
        """Seconds from arrival to the first token (time to first token)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def first_token_ts(self) -> float | None:  # vLLM's name
        return self.first_token_time

    @property
    def last_token_ts(self) -> float | None:  # vLLM's name
        return self.finish_time


@dataclass
class CompletionOutput:
    """One completion of a prompt (a prompt has ``n`` of them).

    ``text`` is "" when the LLM has no tokenizer or ``detokenize=False``. ``finish_reason``:
    "stop" (EOS, a stop token or a stop string), "length" or "abort". ``stop_reason``: the stop
    token id or stop string that ended it; None for EOS, length or abort.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' raw logprobs (logprobs set)
    logprobs: list[dict[int, Logprob]] | None = None  # per output token: it and its top-k (logprobs set)
    routed_experts: Any = None  # MoE routing is not returned by the course engine
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None  # chapter 43
    sampling_mask: Any = None  # chapter 34
    spec_decode_metrics: Any = None  # chapter 37
    weight_versions: Any = None  # in-place weight updates are not part of the course

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything ``LLM.generate`` returns for one prompt.

    ``prompt`` is None for a prompt given as token ids; ``prompt_token_ids`` are the ids the
    engine ran (after ``truncate_prompt_tokens``). ``prompt_logprobs`` (when asked for): one entry
    per prompt token, None for the first (nothing predicts it), else {token id: Logprob} holding
    the prompt token and its top-k alternatives. ``num_cached_tokens``: prompt tokens served by
    the prefix cache. ``text``, ``token_ids`` and ``finish_reason`` are shortcuts to the first
    completion (not vLLM's; a convenience for the common n == 1).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None
    num_cache_creation_tokens: int | None = None  # not counted by the course engine
    prompt_token_id_logprobs: Any = None  # prompt_logprob_token_ids is not supported
    kv_transfer_params: Any = None  # disaggregated serving is not part of the course
    ec_transfer_params: Any = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


GenerationOutput = RequestOutput  # this module's earlier name


@dataclass
class StreamDelta:
    """One step of ``LLM.stream``: the tokens it produced and the text they complete."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # params.logprobs set: one entry per token_ids
