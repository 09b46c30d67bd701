"""SimpleSampler: one token per sample row — argmax for greedy rows, chapter 8 for the rest,
with vLLM's per-request logits shaping (``logits_processors.py``) and sampled-token logprobs."""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch

from engine.sampling import sample_token
from engine.serve.logits_processors import apply_min_p, apply_penalties, mask_stop_tokens, needs_shaping
from engine.serve.logprobs import token_logprobs
from engine.serve.params import FULL_SAMPLER_FIELDS, SamplingParams
from engine.serve.request import Request


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [M, V] -> int64 [M]: each row's argmax, the first index on a tie, as
    ``torch.argmax`` gives it. Taken as ``max(dim=-1).indices``, the same indices by contract,
    because on a CPU torch's argmax over bfloat16 / float16 rows is 10-25x slower than ``max``
    (16 rows of the 0.6B vocabulary: ~55 ms vs ~2.4 ms on a Zen 2 core,
    ``python -m course.tuning.levers argmax``), and
    no float copy of the logits is made. A flat model may offer a faster reduction giving the same
    indices (its ``greedy_tokens``): the engine hands it to the sampler."""
    return logits.max(dim=-1).indices


class SimpleSampler:
    """Greedy rows are answered by one batched argmax; sampled rows one at a time with chapter 8's
    ``sample_token``, drawing from the request's own generator when it has a seed (so its tokens
    don't depend on its batch-mates) and from the engine's shared generator otherwise.

    A row whose request sets ``min_tokens`` (not yet reached), a penalty or ``min_p`` is shaped
    first (``logits_processors.py``: min_tokens mask, penalties, then for sampled rows temperature
    and min_p); a row with neutral params is never touched, so greedy defaults stay the argmax.
    A request with ``params.logprobs`` set gets, for each sampled token, its entry
    (``logprobs.token_logprobs``: raw logprobs, rank, top-k) written to ``request.logprobs`` at
    the index of that output token — overwriting what a failed step left there.
    """

    name = "simple"

    def __init__(self, generator: torch.Generator | None = None,
                 greedy: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.generator = generator
        self.greedy = greedy or greedy_tokens  # the batched reduction: greedy_tokens' indices, by contract

    def check(self, params) -> None:
        """ValueError for settings that are invalid or that this sampler cannot honour
        (``SamplingParams``' list). The params are checked again as at construction, on a copy:
        a field set after it (``params.n = 0``) must not slip through."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        with warnings.catch_warnings():  # the construction already warned about what it adjusts
            warnings.simplefilter("ignore")
            dataclasses.replace(params)  # __post_init__'s checks, leaving ``params`` as it is
        unsupported = params.full_sampler_fields()
        if unsupported:
            name = unsupported[0]
            raise ValueError(f"SamplingParams.{name}={getattr(params, name)!r} needs chapter 34's full "
                             f"sampler, not this chapter's SimpleSampler; leave {name}="
                             f"{FULL_SAMPLER_FIELDS[name]!r}")

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 generators: dict[str, torch.Generator]) -> list[int]:
        """logits [M, V] (row i belongs to requests[i]) -> M token ids."""
        if logits.shape[0] == 0:
            return []
        tokens = self.greedy(logits).tolist()
        for i, req in enumerate(requests):
            p = req.params
            greedy = p.temperature == 0.0
            shaped = needs_shaping(p, req.num_output_tokens)
            if greedy and not shaped:
                continue
            row = self.shaped_logits(logits[i], req) if shaped else logits[i]
            if greedy:
                tokens[i] = int(greedy_tokens(row[None])[0])
                continue
            gen = generators.get(req.request_id, self.generator)
            if p.min_p > 0.0:  # min_p comes after the temperature, before top-k / top-p
                scaled = apply_min_p(row.float() / p.temperature, p.min_p)
                tokens[i] = sample_token(scaled, 1.0, p.top_k, p.top_p, gen)
            else:
                tokens[i] = sample_token(row, p.temperature, p.top_k, p.top_p, gen)
        if any(req.params.logprobs is not None for req in requests):
            self._record_logprobs(logits, requests, tokens)
        return tokens

    @staticmethod
    def shaped_logits(logits: torch.Tensor, req: Request) -> torch.Tensor:
        """logits [V] of ``req``'s next token after the min_tokens mask and the penalties (a copy)."""
        row = logits.clone()
        mask_stop_tokens(row, req.params, req.eos_token_id, req.num_output_tokens)
        return apply_penalties(row, req.params, req.prompt_token_ids, req.output_token_ids)

    @staticmethod
    def _record_logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> None:
        rows = [i for i, req in enumerate(requests) if req.params.logprobs is not None]
        logprobs = torch.log_softmax(logits[rows], dim=-1)  # [R, V] raw, in the logits' precision
        for j, i in enumerate(rows):
            req = requests[i]
            entry = token_logprobs(logprobs[j], tokens[i], req.params.logprobs)
            kept = (req.logprobs or [])[:req.num_output_tokens]  # entry i scores output token i
            req.logprobs = kept + [entry]
