"""Request: a token list plus how much of it already has K/V in the pool."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.serve.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """vLLM's short names: "stop", "length", "abort"; None while unfinished."""
        return _FINISH_REASONS.get(self._value_)


# Finished statuses by value -> vLLM's finish reason. Keyed by the value string because these run
# for every request on every step, and hashing an Enum member calls Python code.
_FINISH_REASONS = {"finished_stopped": "stop", "finished_length": "length", "finished_aborted": "abort"}


@dataclass(eq=False)
class Request:
    """One sequence the engine serves.

    ``token_ids`` is the prompt followed by every output token. ``num_computed_tokens`` counts the
    leading tokens whose K/V are in the pool. Invariant while RUNNING: the newest token is never
    computed, so ``num_computed_tokens <= num_tokens - 1``, with equality right after a sample is
    appended. A step asks a request for nothing but a count n of tokens to compute next: a whole
    prefill, one chunk of it, a decode and a resume differ only in that number.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    priority: int = 0  # priority policy: the smaller the number, the sooner it runs
    arrival_time: float = field(default_factory=time.monotonic)
    cache_key: tuple = ()  # anything besides tokens that changes activations (salt, adapter, images)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # tokens served by the prefix cache at first admission
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens (chapter 37)
    swapped_out: bool = False
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | None = None  # the stop token that ended the request, if any
    # params.prompt_logprobs set: entry i scores prompt token i + 1 ({token: logprob} + top-k), filled step by step
    prompt_logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    # params.logprobs set: entry i scores output token i (engine/serve/logprobs.py), written by the sampler
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)  # for later chapters' features

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty; give at least one token")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens: int = len(self.prompt_token_ids)
        self.block_hashes: list[bytes] = []  # one per full block of known tokens; BlockManager fills it
        self.num_placeholders: int = 0  # sampled-but-not-yet-known tokens (async scheduling, ch 33)
        self.admitted: bool = False  # set at first admission, when num_cached_tokens is recorded

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append(self, token: int) -> None:
        """Append one generated token (its K/V is computed by the next step that schedules it)."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(int(token))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
