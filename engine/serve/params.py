"""SamplingParams: what one request asks of the sampler and of the stop check."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings (vLLM's names).

    temperature 0 is greedy. ``top_k == 0`` means no top-k limit; ``top_p == 1.0`` no nucleus cut.
    ``n > 1`` asks for n independent completions of the same prompt. ``seed`` gives the request
    its own ``torch.Generator`` so its samples do not depend on what else is in the batch.
    ``prompt_logprobs``: None = off; k >= 0 = return, for every prompt token after the first, its
    log-probability plus the k most likely alternatives. ``logprobs`` (sampled-token logprobs) and
    ``repetition_penalty != 1`` need chapter 34's full sampler.
    """

    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    logprobs: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"SamplingParams: {msg}")

        if not _is_int(self.n) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad(f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
