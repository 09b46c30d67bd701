"""What a request's params do to its row of logits before a token is chosen (vLLM's semantics).

In the order the sampler applies them, on logits [V] of one row:

1. ``min_tokens``: while the request has fewer than ``min_tokens`` outputs, its EOS and every
   ``stop_token_ids`` entry get -inf, so it cannot stop early (vLLM masks the EOS even with
   ``ignore_eos``, and so does this).
2. penalties, on the raw logits: ``repetition_penalty`` r divides a positive logit by r and
   multiplies a negative one by r, for every token seen in the prompt or the output so far;
   ``frequency_penalty`` f subtracts f times the token's count in the output;
   ``presence_penalty`` p subtracts p from every token present in the output. Greedy rows take
   the argmax of the logits after steps 1-2.
3. (sampled rows only) temperature, then ``min_p`` m: every token whose probability is below
   m times the most likely token's becomes -inf; then chapter 8's top-k and top-p.

Invariant: a row whose params are neutral (``min_tokens`` reached, no penalty) is not touched,
so the default greedy path stays ``argmax(logits)`` exactly.
"""
from __future__ import annotations

import torch

from engine.serve.params import SamplingParams


def has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def needs_shaping(params: SamplingParams, num_output_tokens: int) -> bool:
    """True if steps 1-2 change this row (min_tokens not reached yet, or a penalty set)."""
    return num_output_tokens < params.min_tokens or has_penalties(params)


def mask_stop_tokens(logits: torch.Tensor, params: SamplingParams, eos_token_id: int | None,
                     num_output_tokens: int) -> torch.Tensor:
    """Step 1 on logits [V] (in place): EOS and stop token ids to -inf while below ``min_tokens``."""
    if num_output_tokens >= params.min_tokens:
        return logits
    vocab = logits.shape[-1]
    ids = [t for t in params.stop_token_ids if t < vocab]
    if eos_token_id is not None and 0 <= eos_token_id < vocab:
        ids.append(eos_token_id)
    if ids:
        logits[torch.tensor(ids, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> torch.Tensor:
    """Step 2 on logits [V] (in place): repetition, then frequency, then presence penalty."""
    if not has_penalties(params):
        return logits
    vocab = logits.shape[-1]
    device = logits.device
    out = torch.tensor(output_token_ids, dtype=torch.long, device=device)
    counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)  # [V] times in the output
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(prompt_token_ids, dtype=torch.long, device=device)] = True
        r = params.repetition_penalty
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / r, logits[seen] * r)
    if params.frequency_penalty != 0.0:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """Step 3's min_p on temperature-scaled logits [V] (in place): tokens whose probability is
    below ``min_p`` times the top probability become -inf (the top token always stays)."""
    if min_p <= 0.0:
        return scaled
    probs = torch.softmax(scaled, dim=-1)
    scaled[probs < min_p * probs.max()] = float("-inf")
    return scaled
