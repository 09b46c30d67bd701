"""Processor: the engine's front door, turning a prompt and its SamplingParams into checked Requests.

Like vLLM V1's input processor, it checks a request against what the engine was built for (the
model's vocabulary, ``max_model_len``, the features its sampler serves) before anything is
queued, resolves ``max_tokens=None`` to what the context allows, and fans an ``n > 1`` request out
into its children (``engine.serve.parallel_sampling``). What depends on the engine's live state
(ids in use, the pool's size) is checked by ``EngineCore.add_request`` and the scheduler.
Every refusal is one ``ValueError`` naming the request and the fix.
"""
from __future__ import annotations

import math
from typing import Any

from engine.serve.blocks import encode_cache_key
from engine.serve.params import SEED_MAX, SEED_MIN, SamplingParams
from engine.serve.parallel_sampling import ParentRequest
from engine.serve.request import Request


class Processor:
    """Checks requests for one engine: tokens below ``vocab_size``, prompt + output within
    ``max_model_len``, params that ``sampler`` can serve. Holds no request: a refused request
    leaves nothing behind."""

    def __init__(self, vocab_size: int, max_model_len: int, sampler: Any, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.sampler = sampler
        self.eos_token_id = eos_token_id

    def process_inputs(self, request_id: str, prompt_token_ids: Any, params: SamplingParams | None = None,
                       priority: int = 0, cache_key: tuple = (),
                       arrival_time: float | None = None) -> tuple[ParentRequest, list[Request]]:
        """The request as its parent (ids and child params) and the ``n`` Requests to queue, one
        per completion; ValueError for an id that is no non-empty string, params that are no
        SamplingParams, a prompt that is no list of in-vocabulary token ids, a length past
        ``max_model_len``, a feature the sampler cannot serve, or queue keys the scheduler could
        not sort or hash."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = self.checked_prompt(request_id, prompt_token_ids)
        params = self.checked_params(request_id, params, len(prompt))
        check_queue_keys(request_id, priority, cache_key, arrival_time)
        parent = ParentRequest(request_id, params)
        when = {} if arrival_time is None else {"arrival_time": arrival_time}
        children = [Request(rid, prompt, parent.child_params(i), self.eos_token_id, priority, cache_key=cache_key, **when)
                    for i, rid in enumerate(parent.child_ids)]
        return parent, children

    def check_sampling(self, params: Any) -> None:
        """ValueError for params that are no SamplingParams or that ask for a feature this engine's
        sampler cannot serve (what can be checked before the prompt is known)."""
        self.sampler.check(params)

    def checked_prompt(self, request_id: str, prompt_token_ids: Any) -> list[int]:
        """The prompt as a list of token ids inside the vocabulary, or ValueError."""
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a list of token ids (ints), "
                             f"got {type(prompt_token_ids).__name__}; tokenize text first")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; give at least one token")
        vocab = self.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"request {request_id!r}: token ids must be ints, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"request {request_id!r}: token id {t} is outside the vocabulary [0, {vocab})")
        return prompt

    def checked_params(self, request_id: str, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """``params`` with ``max_tokens=None`` resolved to what the context allows; ValueError for a
        length past ``max_model_len`` or a feature this engine cannot serve."""
        if params.max_tokens is None:  # vLLM's "as many as the context allows"
            params = SamplingParams(**{**params.__dict__, "max_tokens": max(1, self.max_model_len - num_prompt_tokens)})
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt ({num_prompt_tokens}) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens")
        self.sampler.check(params)
        vocab = self.vocab_size
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"request {request_id!r}: prompt_logprobs={params.prompt_logprobs} asks for more "
                             f"alternatives than the vocabulary has ({vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"request {request_id!r}: logprobs={params.logprobs} asks for more alternatives "
                             f"than the vocabulary has ({vocab}); -1 means all of them")
        if params.seed is not None and not SEED_MIN <= params.seed <= SEED_MAX - (params.n - 1):
            # SamplingParams checked this when it was built; it may have been changed since
            raise ValueError(f"request {request_id!r}: seed {params.seed} is outside [0, 2**64 - n]; child i of an "
                             "n > 1 request uses seed + i, and generator seeds are 64-bit unsigned")
        return params


def check_queue_keys(request_id: str, priority: Any, cache_key: Any, arrival_time: Any) -> None:
    """ValueError unless the prefix cache can hash ``cache_key`` (it does at every block boundary)
    and ``priority`` and ``arrival_time`` can be compared in the queues' sort keys (a value that
    can't would fail mid-step)."""
    try:
        encode_cache_key(cache_key)
    except ValueError as e:
        raise ValueError(f"request {request_id!r}: {e}") from None
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"request {request_id!r}: priority must be an int (lower runs first), got {priority!r}")
    if arrival_time is not None and (not isinstance(arrival_time, (int, float)) or isinstance(arrival_time, bool)
                                     or not math.isfinite(arrival_time)):
        raise ValueError(f"request {request_id!r}: arrival_time must be a finite number of seconds "
                         f"(time.monotonic()) or None, got {arrival_time!r}")
