"""What a request's output must be, computed without the engine: the soak's and the reliability
tests' oracle.

A request's answer is the plain model's continuation of its prompt alone, token by token, cut
where its stop rules end it. Two rules shape the continuation itself, so they are applied while
it is produced, not by cutting afterwards:

- ``min_tokens``: while fewer than ``min_tokens`` tokens are out, the EOS and every stop token id
  get -inf (vLLM's rule, the engine's ``logits_processors.mask_stop_tokens``), so the request
  cannot pick them: the continuation differs from ``generate()``'s, not just its length;
- sampling: drawn with a generator seeded like the request's (``engine.sampling.sample_token``).

With neither (greedy, ``min_tokens`` 0) the continuation is ``generate()``'s, which callers
cache per prompt.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sampling import sample_token


def masked_ids(params, eos: int | None) -> tuple[int, ...]:
    """The token ids the ``min_tokens`` rule masks (none when it is 0): the stop ids and the EOS."""
    if not params.min_tokens:
        return ()
    return tuple(sorted({*params.stop_token_ids, *([eos] if eos is not None else [])}))


def stepwise(model, prompt: tuple[int, ...], max_new: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, masked: tuple[int, ...] = (),
             min_tokens: int = 0) -> list[int]:
    """``max_new`` tokens continuing ``prompt`` on ``model`` alone (full recompute each token):
    ``masked`` get -inf while fewer than ``min_tokens`` are out; the argmax at temperature 0,
    else drawn by ``sample_token`` with a generator seeded by ``seed``."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_new):
            logits = model(torch.tensor(tokens))[-1].clone()  # [V]
            if len(out) < min_tokens and masked:
                logits[list(masked)] = float("-inf")
            t = int(torch.argmax(logits)) if temperature == 0.0 else sample_token(logits, temperature, top_k, top_p, gen)
            out.append(t)
            tokens.append(t)
    return out


def cut_at_stop(tokens: list[int], params, eos: int | None) -> tuple[list[int], str]:
    """Where the stop rules end an unbounded continuation: (output, finish reason)."""
    for i, t in enumerate(tokens[:params.max_tokens]):
        if i + 1 >= params.min_tokens and (t in params.stop_token_ids or (t == eos and not params.ignore_eos)):
            return tokens[:i + 1], "stop"
    return tokens[:params.max_tokens], "length"


def expected_output(prompt: tuple[int, ...], params, eos: int | None, greedy: Callable[[tuple[int, ...]], list[int]],
                    continuation: Callable[..., list[int]]) -> tuple[list[int], str] | None:
    """The oracle's (output, finish reason) for ``params`` on ``prompt``, or None for unseeded
    sampling (nothing can predict it). The caller supplies its own (cached) continuations:
    ``greedy(prompt)``, generate()'s, for requests no rule reshapes, else
    ``continuation(prompt, temperature, top_k, top_p, seed, masked, min_tokens)``, ``stepwise``'s."""
    if not params.greedy and params.seed is None:
        return None
    masked = masked_ids(params, eos)
    if params.greedy and not masked:
        return cut_at_stop(greedy(prompt), params, eos)
    temperature = 0.0 if params.greedy else params.temperature
    return cut_at_stop(continuation(prompt, temperature, params.top_k, params.top_p, params.seed, masked,
                                    params.min_tokens), params, eos)
