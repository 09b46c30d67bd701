"""SimpleSampler: one token per sample row — argmax for greedy rows, chapter 8 for the rest."""
from __future__ import annotations

import dataclasses
import warnings

import torch

from engine.sampling import sample_token
from engine.serve.params import FULL_SAMPLER_FIELDS, SamplingParams
from engine.serve.request import Request


class SimpleSampler:
    """Greedy rows are answered by one batched argmax; sampled rows one at a time with chapter 8's
    ``sample_token``, drawing from the request's own generator when it has a seed (so its tokens
    don't depend on its batch-mates) and from the engine's shared generator otherwise."""

    name = "simple"

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

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
        tokens = torch.argmax(logits, dim=-1).tolist()
        sampled = [i for i, req in enumerate(requests) if req.params.temperature != 0.0]  # not greedy
        for i in sampled:
            req = requests[i]
            p = req.params
            gen = generators.get(req.request_id, self.generator)
            tokens[i] = sample_token(logits[i], p.temperature, p.top_k, p.top_p, gen)
        return tokens
