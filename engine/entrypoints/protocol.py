"""OpenAI request bodies -> prompts and ``SamplingParams``; refusals as ``APIError`` 400s.

A body's keys fall in three groups. OpenAI's own names are mapped to ``SamplingParams`` fields
(``max_tokens`` / chat's ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs`` ...); vLLM's
extra sampling parameters (``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids`` ...) are any
other ``SamplingParams`` field, passed through by name, so a field the engine gains is served
here with no change; anything else is refused by name. The message of a bad value is the one
``SamplingParams`` (or the engine's ``add_request``) gives.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from engine.entrypoints.errors import bad_request
from engine.serve.params import SamplingParams

# keys every endpoint reads itself (not sampling parameters)
COMMON_KEYS = frozenset({"model", "stream", "stream_options", "user"})
# OpenAI names with another name (or shape) here; None = read by the endpoint itself
COMPLETION_KEYS = {"prompt": None, "echo": None, "suffix": None, "best_of": None, "logprobs": "logprobs"}
CHAT_KEYS = {"messages": None, "max_completion_tokens": "max_tokens", "logprobs": None, "top_logprobs": None,
             "chat_template": None, "chat_template_kwargs": None, "add_generation_prompt": None,
             "continue_final_message": None, "n": "n", "response_format": None, "tools": None,
             "tool_choice": None, "parallel_tool_calls": None}
# SamplingParams fields a request may not set (the server decides them)
SERVER_FIELDS = frozenset({"output_kind", "detokenize", "skip_clone", "extra_args", "structured_outputs"})
REFUSED_WHY = {"structured_outputs": "structured outputs (guided decoding) need chapter 34's full sampler",
               "extra_args": "no custom logits processors run in the server"}
PASSED = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - SERVER_FIELDS
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default; chat's is "what the context allows" (None)


def _check_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def sampling_params(body: dict[str, Any], own: dict[str, str | None], max_tokens_default: int | None,
                    renamed: dict[str, Any] | None = None) -> SamplingParams:
    """The body's sampling fields as checked ``SamplingParams``; ``own`` names the endpoint's keys
    (mapped to a field, or None: read elsewhere); ``renamed``: fields the endpoint worked out."""
    fields: dict[str, Any] = {"max_tokens": max_tokens_default}
    for key, value in body.items():
        if key in COMMON_KEYS:
            continue
        if key in own:
            if own[key] is not None and value is not None:
                fields[own[key]] = value
            continue
        if key in REFUSED_WHY:
            raise bad_request(f"{key} is not supported: {REFUSED_WHY[key]}", param=key)
        if key in SERVER_FIELDS:
            raise bad_request(f"{key} is the server's to set, not a request's (the server streams or "
                              f"not, and always returns text)", param=key)
        if key not in PASSED:
            raise bad_request(f"unknown parameter {key!r}: this server takes OpenAI's parameters and "
                              f"SamplingParams' fields", param=key)
        if value is not None:
            fields[key] = value
    fields.update(renamed or {})
    if fields.get("stop") is not None and isinstance(fields["stop"], str):
        fields["stop"] = [fields["stop"]]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param=_named(str(exc), fields)) from None


def _named(message: str, fields: dict[str, Any]) -> str | None:
    """The field a message names first (for the error body's ``param``)."""
    hits = [(message.find(k), k) for k in fields if k in message]
    return min(hits)[1] if hits else None


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) from ``stream`` and ``stream_options``."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request(f"stream_options takes {{'include_usage': bool}}, got {options!r:.80}",
                          param="stream_options")
    if not stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    if options.get("continuous_usage_stats"):
        raise bad_request("stream_options.continuous_usage_stats is not supported: usage comes once, in the last "
                          "chunk (include_usage)", param="stream_options")
    return stream, bool(options.get("include_usage", False))


def completion_request(body: Any) -> tuple[list[Any], SamplingParams]:
    """/v1/completions: (prompts, params). A prompt is a string, a list of token ids, or a list
    of either (one completion set per prompt)."""
    body = _check_body(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required: a string, a list of token ids, or a list of either", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request(f"prompt must be a non-empty string, list of token ids, or list of either, got "
                          f"{prompt!r:.80}", param="prompt")
    if body.get("echo"):
        raise bad_request("echo is not supported: the response holds the completion only", param="echo")
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported: the course's models do not fill in the middle", param="suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise bad_request(f"best_of={best_of!r} is not supported: ask for n completions instead", param="best_of")
    return prompts, sampling_params(body, COMPLETION_KEYS, DEFAULT_MAX_TOKENS)


def chat_request(body: Any) -> tuple[list[dict[str, Any]], dict[str, Any], SamplingParams]:
    """/v1/chat/completions: (messages, template options, params). ``logprobs: true`` with
    ``top_logprobs: k`` is the engine's ``logprobs=k``."""
    body = _check_body(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: a non-empty list of {'role', 'content'} objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role' and its 'content', "
                              f"got {m!r:.80}", param="messages")
    for key in ("tools", "tool_choice", "response_format", "parallel_tool_calls"):
        if body.get(key) not in (None, [], "none", {"type": "text"}, False):
            raise bad_request(f"{key} is not supported: the server returns plain text", param=key)
    renamed: dict[str, Any] = {}
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs not in (None, False, True):
        raise bad_request(f"logprobs must be true or false for chat, got {logprobs!r}", param="logprobs")
    if top is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if logprobs:
        renamed["logprobs"] = 0 if top is None else top
    template = {"add_generation_prompt": body.get("add_generation_prompt", True),
                "continue_final_message": body.get("continue_final_message", False),
                "chat_template": body.get("chat_template"),
                "chat_template_kwargs": body.get("chat_template_kwargs")}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        renamed["max_tokens"] = max_tokens
    own = {**CHAT_KEYS, "max_tokens": None}
    return messages, template, sampling_params(body, own, None, renamed)
