"""``LLM``: offline batch generation in vLLM's shape, on top of chapter 31's ``EngineCore``.

    llm = LLM("~/models/Qwen3-0.6B")                     # a checkpoint directory
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    print(outs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}])

``LLM`` owns one tokenizer and one ``EngineCore``. ``generate`` queues every prompt at once and
steps the core until all are done, so the prompts share batches and the prefix cache exactly
as concurrent users of a server would; results come back in prompt order whatever order they
finished in. Everything else the engine can do (chunked prefill, preemption, prefix caching)
is configured through ``EngineConfig`` fields passed as keyword arguments.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from engine.progress import ProgressBar
from engine.tokenizer import IncrementalDetokenizer, Message, Tokenizer

# A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict[str, Any]]


@dataclass
class CompletionOutput:
    """One completion of a prompt (a prompt has ``n`` of them)."""

    index: int
    text: str  # "" when the LLM has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop token) | "length" | "abort"
    stop_reason: int | None = None  # the stop token that ended it, when it was not the EOS


@dataclass
class GenerationOutput:
    """Everything ``LLM.generate`` returns for one prompt; ``text``, ``token_ids`` and
    ``finish_reason`` are those of the first (usually only) completion."""

    request_id: str
    prompt: str | None  # None for a prompt given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class StreamDelta:
    """One step of ``LLM.stream``: the tokens it produced and the text they complete."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta


class LLM:
    """A model, its tokenizer and one engine core, behind ``generate`` and ``chat``.

    ``model``: a checkpoint directory (model and tokenizer are loaded from it) or an already
    built ``nn.Module`` with a ``cfg`` (our Qwen3 / Qwen3-MoE). ``tokenizer``: a ``Tokenizer``
    or a directory holding ``tokenizer.json``; without one, prompts must be token ids and the
    outputs' ``text`` is empty. ``dtype``/``device`` apply when loading from a directory.
    ``**engine_options`` are ``EngineConfig`` fields (``num_blocks``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``seed`` ...).

    Invariant: between calls the core holds no unfinished request of ours.
    """

    def __init__(
        self,
        model: str | os.PathLike | nn.Module,
        tokenizer: str | os.PathLike | Tokenizer | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        skip_tokenizer_init: bool = False,
        **engine_options: Any,
    ) -> None:
        from engine.serve import EngineConfig, EngineCore

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:  # checked before loading: a typo should not cost a multi-GB load
            raise ValueError(f"unknown LLM option(s) {unknown}; engine options are the EngineConfig "
                             f"fields: {sorted(known)}")
        config = EngineConfig(**engine_options)
        if isinstance(model, nn.Module):
            if not hasattr(model, "cfg"):
                raise ValueError("LLM needs one of our models (an nn.Module with a .cfg, e.g. from "
                                 "engine.models.load_model) or a checkpoint directory")
            if dtype is not None or device is not None:
                raise ValueError("dtype/device apply only when loading from a directory; convert "
                                 "the module yourself (model.to(...)) before passing it")
            self.model = model.eval()
        elif isinstance(model, (str, os.PathLike)):
            from engine.models.loader import load_model

            self.model = load_model(model, dtype=dtype, device=device)
            if tokenizer is None and not skip_tokenizer_init:
                tokenizer = model
        else:
            raise ValueError(f"model must be a checkpoint directory or an nn.Module, got "
                             f"{type(model).__name__}")
        if skip_tokenizer_init:
            tokenizer = None
        if isinstance(tokenizer, (str, os.PathLike)):
            try:
                tokenizer = Tokenizer.from_pretrained(tokenizer)
            except ValueError as e:
                raise ValueError(f"{e}; or pass skip_tokenizer_init=True to work with token ids only") from None
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise ValueError(f"tokenizer must be a Tokenizer or a directory, got {type(tokenizer).__name__}")
        self.tokenizer: Tokenizer | None = tokenizer

        eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.engine = EngineCore(self.model, config, eos_token_id=eos)
        self._next_id = 0

    # ------------------------------------------------------------------ public API

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer; pass tokenizer= (a directory with "
                             "tokenizer.json, or a Tokenizer)")
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Any = None,
        use_tqdm: bool | None = None,
    ) -> list[GenerationOutput]:
        """Complete every prompt; one ``GenerationOutput`` per prompt, in prompt order.

        ``prompts``: a string, a list of token ids, a list of either, or vLLM's dicts.
        ``sampling_params``: one ``SamplingParams`` for all, one per prompt, or None (defaults).
        ``use_tqdm``: show a progress bar on stderr; None = only when stderr is a terminal and
        there is more than one prompt.
        """
        return self._run(self._normalize(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: Any = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them.

        Each conversation is rendered with the tokenizer's chat template (ending with the
        opening of an assistant turn) and generated from like any prompt.
        ``chat_template_kwargs`` reach the template, e.g. ``{"enable_thinking": False}`` for Qwen3.
        """
        tok = self.get_tokenizer()
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        else:
            conversations = list(messages)
        items = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            items.append((text, tok.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: Any = None) -> Iterator[StreamDelta]:
        """Generate for ONE prompt (n == 1), yielding a ``StreamDelta`` per step that produced
        tokens: the new tokens and the text they complete.

        Not part of vLLM's ``LLM`` (vLLM streams through its async engine); ``run.py generate``
        uses it. Multi-byte characters split across tokens come out whole, so a delta's text may
        be "" while a character is incomplete; the last delta has ``finish_reason`` set.
        """
        tok = self.get_tokenizer()
        if _is_prompt_list(prompt):
            raise ValueError("stream takes a single prompt, not a list; use generate() for many")
        [(_, ids)] = self._normalize(prompt)
        [params] = self._params_list(sampling_params, 1)
        if params.n != 1:
            raise ValueError(f"stream produces one completion; got SamplingParams(n={params.n})")
        rid, _ = self._add(ids, params)
        detok = IncrementalDetokenizer(tok, ids)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    piece = detok.add(out.new_token_ids)
                    if out.finished:
                        piece += detok.flush()
                    yield StreamDelta(piece, list(out.new_token_ids), out.finish_reason)
        finally:  # the caller stopped early (or failed): leave no request behind
            self.engine.abort_request(rid)

    # ------------------------------------------------------------------ internals

    def _normalize(self, prompts: PromptType | Sequence[PromptType]) -> list[tuple[str | None, list[int]]]:
        """Every prompt as (text or None, token ids)."""
        items = list(prompts) if _is_prompt_list(prompts) else [prompts]
        result = []
        for i, p in enumerate(items):
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = list(p["prompt_token_ids"])
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise ValueError(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            if isinstance(p, str):
                result.append((p, self.get_tokenizer().encode(p)))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                result.append((None, list(p)))
            else:
                raise ValueError(f"prompt {i}: expected a string or a list of token ids, got "
                                 f"{type(p).__name__}")
            if not result[-1][1]:
                raise ValueError(f"prompt {i} is empty; give at least one token or character")
        return result

    def _params_list(self, sampling_params: Any, n: int) -> list[Any]:
        from engine.serve import SamplingParams

        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per "
                             f"prompt), got {len(params)} item(s)")
        return params

    def _add(self, prompt_ids: list[int], params: Any) -> tuple[str, list[str]]:
        """Queue one prompt under a fresh id; returns that id and the ids its completions report
        under (the same id when n == 1, else "{id}:{i}").

        The tokenizer's other end-of-sequence ids (generation_config.json lists e.g. both
        <|im_end|> and <|endoftext|>) join ``stop_token_ids`` unless ``ignore_eos``, as in vLLM.
        """
        tok = self.tokenizer
        if tok is not None and not params.ignore_eos:
            extra = [t for t in tok.eos_token_ids
                     if t != tok.eos_token_id and t not in params.stop_token_ids]
            if extra:
                params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        rid = str(self._next_id)
        self._next_id += 1
        return rid, self.engine.add_request(rid, prompt_ids, params)

    def _run(self, items: list[tuple[str | None, list[int]]], sampling_params: Any,
             use_tqdm: bool | None) -> list[GenerationOutput]:
        params = self._params_list(sampling_params, len(items))
        results: list[GenerationOutput] = []
        where: dict[str, tuple[int, int]] = {}  # engine request id -> (prompt index, completion index)
        try:
            for i, ((text, ids), p) in enumerate(zip(items, params)):
                rid, child_ids = self._add(ids, p)
                # outputs are filled in as completions finish, in whatever order that happens
                results.append(GenerationOutput(rid, text, ids, [None] * len(child_ids)))  # type: ignore[list-item]
                for j, cid in enumerate(child_ids):
                    where[cid] = (i, j)
            bar = ProgressBar(len(items), use_tqdm)
            left = [len(r.outputs) for r in results]
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    bar.tokens += len(out.new_token_ids)
                    if not out.finished or out.request_id not in where:
                        continue
                    i, j = where[out.request_id]
                    results[i].outputs[j] = CompletionOutput(
                        j, self._detokenize(out.output_token_ids), list(out.output_token_ids),
                        out.finish_reason, getattr(out, "stop_reason", None))
                    left[i] -= 1
                    if left[i] == 0:
                        bar.advance()
            bar.close()
        except BaseException:
            for rid in where:  # an error or Ctrl-C mid-batch: leave the core idle
                self.engine.abort_request(rid)
            raise
        return results

    def _detokenize(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)


def _is_prompt_list(prompts: Any) -> bool:
    """A list of prompts, as opposed to one prompt (a string, a dict, or a flat list of ids)."""
    if isinstance(prompts, (str, dict)):
        return False
    if isinstance(prompts, (list, tuple)):
        return not prompts or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    return False
