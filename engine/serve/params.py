"""SamplingParams: what one request asks of the sampler, the stop check and the detokenizer.

The fields, their names and their defaults are vLLM's (``tests/vllm_surface.json`` records vLLM
0.32's and ``tests/test_vllm_surface.py`` compares), so an offline script written for vLLM runs
here unchanged and means the same thing. A field falls in one of three groups:

* served here: ``n``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``, ``seed``, ``max_tokens``, ``min_tokens``,
  ``stop_token_ids``, ``ignore_eos``, ``logprobs``, ``prompt_logprobs`` (the engine core: the
  sampler and ``engine/serve/logits_processors.py``), and ``stop``, ``include_stop_str_in_output``,
  ``detokenize``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
  ``truncate_prompt_tokens``, ``output_kind`` (``LLM``, the front end, like vLLM's output processor);
* constraining the vocabulary or the output's form — chapter 34's full sampler: accepted
  here by name and refused at ``add_request`` while set to anything but their neutral value
  (``FULL_SAMPLER_FIELDS``), with one message naming the field and the chapter;
* not part of the course at all (``UNSUPPORTED_FIELDS``): refused right here, by name.
"""
from __future__ import annotations

import copy
import enum
import math
import warnings
from dataclasses import dataclass
from typing import Any

from engine.serve.config import SEED_MAX, SEED_MIN

# temperature: 0 is greedy. A positive temperature below MIN_TEMPERATURE divides the logits into
# values softmax cannot hold (1e-40 turns a logit of 30 into inf, and inf - inf is nan), so it is
# raised to MIN_TEMPERATURE with a warning, as vLLM does; at 0.01 a logit lead of 1 already makes the
# runner-up e^-100 times less likely, so nothing a user could mean by "tinier" is lost.
MIN_TEMPERATURE = 1e-2
# torch.Generator seeds are 64-bit unsigned (manual_seed maps a negative s to 2^64 + s, so two
# different seeds would share one stream): [0, 2^64 - 1]. Child i of an n > 1 request uses seed + i.
MAX_N = 4096  # completions per prompt: past this, one call would queue more requests than any pool serves

# field -> its neutral value: anything else needs chapter 34's full sampler.
FULL_SAMPLER_FIELDS: dict[str, Any] = {
    "logprob_token_ids": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "structured_outputs": None,
    "thinking_token_budget": None,
}
# field -> (neutral value, why the course engine does not take anything else).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "prompt_logprob_token_ids": (None, "the engine scores every prompt token; use prompt_logprobs=k"),
    "prompt_logprob_start": (None, "the engine scores every prompt token; use prompt_logprobs=k"),
    "stream_interval": (None, "LLM.stream reports every step's tokens"),
    "skip_reading_prefix_cache": (None, "set enable_prefix_caching=False on the LLM instead"),
    "repetition_detection": (None, "no repetition detector in the course engine"),
    "trace_decode_token_ids": (None, "a vLLM debugging aid the course engine does not have"),
    "routed_experts_prompt_start": (0, "the engine does not return MoE routing"),
    "watermarking": (None, "no output watermarking in the course engine"),
}


class RequestOutputKind(enum.Enum):
    """vLLM's choice of what a streaming engine reports; ``LLM.generate`` always returns finished
    requests (FINAL_ONLY), as vLLM's offline ``LLM`` does, whatever the field says."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling, stopping and detokenizing settings (vLLM's names and defaults).

    ``temperature`` 1.0 samples, as in vLLM; 0 is greedy (say ``temperature=0.0`` to get it).
    ``top_k`` 0 (or -1) = no limit; ``top_p`` 1.0 = no nucleus cut. ``n > 1``: n completions of one
    prompt. ``seed`` gives the request its own ``torch.Generator`` (-1 means None, as in vLLM), so
    its samples do not depend on its batch-mates. ``max_tokens=None``: as many as the context
    allows. ``min_tokens``: no stop (EOS, stop token, stop string) before that many outputs.
    ``stop``: strings that end the completion, matched on the detokenized text (across token
    boundaries too) and cut from it unless ``include_stop_str_in_output``; ``stop_reason`` is then
    the string. ``truncate_prompt_tokens=k`` keeps the prompt's last k tokens (-1: the last
    ``max_model_len``). ``prompt_logprobs=k``: for every prompt token after the first, its logprob
    and rank and the k most likely alternatives. ``logprobs=k`` (-1: the whole vocabulary): the
    same for every sampled token, from the raw logits, plus ``cumulative_logprob``. Penalties
    (``repetition_penalty`` > 0, 1 = none; ``presence_penalty`` and ``frequency_penalty`` in
    [-2, 2]), the ``min_tokens`` mask on EOS and stop ids, and ``min_p`` in [0, 1]:
    ``engine/serve/logits_processors.py``. See the module docstring for the fields that chapter
    34 brings.

    Invariant after construction: ``stop``, ``stop_token_ids`` and ``bad_words`` are lists, and
    re-constructing from ``self.__dict__`` gives an equal object (the engine copies params per
    child this way).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: Any = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None
    skip_clone: bool = False
    structured_outputs: Any = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # older vLLMs had it here; 0.32 takes generate(tokenization_kwargs=...)

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"SamplingParams: {msg}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer >= 1 (at most {MAX_N}), got {self.n!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0 or math.isinf(self.temperature):
            raise bad(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"SamplingParams: temperature {self.temperature!r} is below {MIN_TEMPERATURE} "
                          f"and would overflow softmax; using {MIN_TEMPERATURE}", stacklevel=3)
            self.temperature = MIN_TEMPERATURE
        if self.top_k == -1:  # vLLM's other spelling of "no limit"
            self.top_k = 0
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 or -1 = no limit), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed == -1:
            self.seed = None
        if self.seed is not None:
            if not _is_int(self.seed):
                raise bad(f"seed must be an integer or None, got {self.seed!r}")
            if not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
                raise bad(f"seed must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] (torch.Generator's "
                          f"range, less n - 1 for the children's seed + i), got {self.seed}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = _string_list(self.stop, "stop", bad)
        if self.stop and not self.detokenize:
            raise bad("stop strings are matched on the detokenized text: they need detokenize=True")
        self.bad_words = _string_list(self.bad_words, "bad_words", bad)
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "flat_logprobs", "skip_clone"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad(f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < -1):
            raise bad(f"logprobs must be None, -1 or an integer >= 0, got {self.logprobs!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise bad(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < -1
                                                        or self.truncate_prompt_tokens == 0):
            raise bad(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an integer >= 1, "
                      f"got {self.truncate_prompt_tokens!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        for name, (neutral, why) in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value != neutral and not (name == "skip_reading_prefix_cache" and value is False):
                raise bad(f"{name}={value!r} is not supported by the course engine ({why}); "
                          f"leave {name}={neutral!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def sampling_type(self) -> str:
        """"greedy", "random" or "random_seed" (vLLM's SamplingType, by name)."""
        if self.greedy:
            return "greedy"
        return "random" if self.seed is None else "random_seed"

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a stream holds back so it never shows the start of a stop string it will cut."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    @property
    def all_stop_token_ids(self) -> set[int]:
        """The stop token ids (the engine adds the EOS on its own)."""
        return set(self.stop_token_ids)

    @property
    def eos_token_id(self) -> int | None:
        """None: the EOS is the engine's (``EngineCore(eos_token_id=...)``), not the params'."""
        return None

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return None  # bad_words need chapter 34

    @property
    def num_logprobs(self) -> int:
        return 0 if self.logprobs is None else self.logprobs

    def full_sampler_fields(self) -> list[str]:
        """The fields set to something only chapter 34's full sampler can honour."""
        return [name for name, neutral in FULL_SAMPLER_FIELDS.items() if getattr(self, name) != neutral]

    def clone(self) -> "SamplingParams":
        """An independent copy (vLLM's method)."""
        return copy.deepcopy(self)


def _string_list(value: Any, name: str, bad) -> list[str]:
    """None, one string or a list of strings -> a list of non-empty strings without repeats."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise bad(f"{name} must be a string or a list of strings, got {value!r}")
    if any(not s for s in value):
        raise bad(f"{name} cannot contain an empty string")
    from engine.tokenizer import check_text  # text checks live with the tokenizer

    for s in value:
        check_text(s, f"{name} string")
    return list(dict.fromkeys(value))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
