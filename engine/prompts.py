"""Prompt inputs for ``LLM``: text, token ids or vLLM's dict forms, to token ids.

vLLM's offline API takes a prompt as a string, a list of token ids, ``{"prompt": str}`` or
``{"prompt_token_ids": [...]}``, alone or in a list; a dict may add ``cache_salt`` (a string: the
prompt's prefix-cache blocks are keyed by it too, so prompts of different salts never share a
block, and one tenant cannot learn from ``num_cached_tokens`` what another sent). Any other dict
key (``multi_modal_data``, ``mm_processor_kwargs``, a typo) is refused by name. ``normalize_prompts``
turns any of those into (text or None, token ids, cache_key) triples, refusing with a one-line
ValueError what cannot be a prompt: nothing at all, an empty string or id list, bytes, text that
is not valid Unicode (the tokenizer's ``encode`` checks), text that encodes to no tokens. ``tokenization_kwargs`` are
vLLM 0.32's: ``truncate_prompt_tokens`` (keep k tokens; -1 = ``max_model_len``),
``truncation_side`` ("right", HF's default, drops the end; "left" the start) and
``add_special_tokens``.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Union

PromptType = Union[str, list[int], dict[str, Any]]
TOKENIZATION_KWARGS = ("truncate_prompt_tokens", "truncation_side", "add_special_tokens")
DICT_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
# vLLM's dict-prompt keys this engine does not serve, and why.
REFUSED_PROMPT_KEYS = {"multi_modal_data": "images and audio are chapter 43",
                       "mm_processor_kwargs": "images and audio are chapter 43",
                       "multi_modal_uuids": "images and audio are chapter 43",
                       "token_type_ids": "the course's models take no token type ids"}


def normalize_prompts(prompts: PromptType | Sequence[PromptType], get_tokenizer: Callable[[], Any],
                      max_model_len: int, tokenization_kwargs: dict[str, Any] | None = None
                      ) -> list[tuple[str | None, list[int], tuple]]:
    """Every prompt as (text or None, token ids, cache_key), truncated as ``tokenization_kwargs``
    say; ``get_tokenizer()`` is called only for text. cache_key is ``()``, or ``("cache_salt", salt)``
    for a dict prompt with a ``cache_salt``."""
    kw = dict(tokenization_kwargs or {})
    unknown = sorted(set(kw) - set(TOKENIZATION_KWARGS))
    if unknown:
        raise ValueError(f"tokenization_kwargs {unknown} are not supported; the course takes {list(TOKENIZATION_KWARGS)}")
    items = list(prompts) if is_prompt_list(prompts) else [prompts]
    if not items:
        raise ValueError("no prompts given: pass a prompt, or a non-empty list of them")
    result = []
    for i, p in enumerate(items):
        cache_key: tuple = ()
        if isinstance(p, dict):
            cache_key = _dict_cache_key(i, p)
            if "prompt_token_ids" in p:
                p = p["prompt_token_ids"]
                if not isinstance(p, (list, tuple)):
                    raise ValueError(f"prompt {i}: prompt_token_ids must be a list of token ids, got "
                                     f"{type(p).__name__}")
                p = list(p)
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is empty (\"\"); give at least one character")
            ids = get_tokenizer().encode(p, add_special_tokens=kw.get("add_special_tokens", True))
            if not ids:
                raise ValueError(f"prompt {i} ({p[:20]!r}) encodes to no tokens")
            result.append((p, ids, cache_key))
        elif isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not p:
                raise ValueError(f"prompt {i} is empty (no token ids); give at least one token")
            result.append((None, list(p), cache_key))
        elif isinstance(p, (bytes, bytearray)):
            raise ValueError(f"prompt {i} is bytes; decode it to a str (UTF-8) first")
        else:
            raise ValueError(f"prompt {i}: expected a string or a list of token ids, got "
                             f"{type(p).__name__}")
    k = kw.get("truncate_prompt_tokens")
    if k is not None:
        result = [(text, truncate_ids(ids, k, kw.get("truncation_side") or "right", max_model_len), key)
                  for text, ids, key in result]
    return result


def _dict_cache_key(i: int, p: dict) -> tuple:
    """A dict prompt's cache_key (from ``cache_salt``); ValueError naming any key it cannot take."""
    for key in p:
        if key in REFUSED_PROMPT_KEYS:
            raise ValueError(f"prompt {i}: {key!r} is not supported ({REFUSED_PROMPT_KEYS[key]}); leave it out")
        if key not in DICT_PROMPT_KEYS:
            raise ValueError(f"prompt {i}: unknown dict-prompt key {key!r}; a dict prompt takes "
                             f"{list(DICT_PROMPT_KEYS)}")
    if "cache_salt" not in p or p["cache_salt"] is None:
        return ()
    salt = p["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"prompt {i}: cache_salt must be a non-empty string, got {salt!r}")
    from engine.tokenizer import check_text

    check_text(salt, f"prompt {i}'s cache_salt")
    return ("cache_salt", salt)


def truncate_ids(ids: list[int], k: Any, side: str, limit: int) -> list[int]:
    """Keep k of ``ids`` (-1: ``limit``), dropping from the end ("right") or the start ("left")."""
    if k == -1:
        k = limit
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or k > limit:
        raise ValueError(f"truncate_prompt_tokens must be -1 or an integer in [1, max_model_len={limit}], got {k!r}")
    if side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
    return ids[-k:] if side == "left" else ids[:k]


def read_template(template: str | os.PathLike | None) -> str | None:
    """A chat template given as text, or as the path of a file holding it (vLLM takes both)."""
    if template is None:
        return None
    if isinstance(template, os.PathLike) or ("{" not in str(template) and Path(str(template)).expanduser().is_file()):
        path = Path(template).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template file {str(path)!r} does not exist")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"chat_template file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(template, str):
        raise ValueError(f"chat_template must be a Jinja string or a file path, got {type(template).__name__}")
    return template


def is_prompt_list(prompts: Any) -> bool:
    """A list of prompts, as opposed to one prompt (a string, a dict, or a flat list of ids)."""
    if isinstance(prompts, (str, dict)):
        return False
    if isinstance(prompts, (list, tuple)):
        return not prompts or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    return False
