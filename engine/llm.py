"""``LLM``: offline generation with vLLM's API, on top of chapter 31's ``EngineCore``.

    from engine.llm import LLM                 # vLLM: from vllm import LLM, SamplingParams
    from engine.serve import SamplingParams

    llm = LLM("~/models/Qwen3-0.6B")           # a checkpoint directory
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}])

The same script runs on vLLM with only the import line changed (``docs/from-the-course-to-vllm.md``;
``tests/test_vllm_surface.py`` checks every name and default against a record of vLLM 0.32).

``LLM`` owns one tokenizer and one ``EngineCore``. ``generate`` queues every prompt at once and
steps the core until they are done, so the prompts share batches and the prefix cache as
concurrent users of a server would; results come back in prompt order whatever order they
finished in. Around it: ``engine.prompts`` turns prompts into token ids, the core's
``engine.serve.processor`` checks each request before it is queued, ``engine.output_processor``
does the front end's work (detokenizing, stop strings, holding back stream text),
``engine.llm_options`` sorts the constructor's vLLM names, and ``engine.llm_compat`` holds the
rest of vLLM's methods (stats, and those refused by name).

Sharing one ``LLM``: every call routes the core's outputs to the completion they belong to and
steps the core only while one of ITS completions is unfinished, under one lock. Two threads
calling ``generate`` therefore share steps and each gets exactly its own tokens; interleaved
``stream()``s each get all of theirs; a ``generate()`` inside a ``stream()`` loop finishes its own
prompts and leaves the stream's request running.
"""
from __future__ import annotations

# greedy_rewrite: done (SamplingParams() here is vLLM's default on purpose)

import dataclasses
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from engine.llm_compat import LLMEngineView, Metric, VllmExtras  # noqa: F401  (re-exported)
from engine.llm_options import split_options
from engine.output_processor import CompletionState
from engine.outputs import (CompletionOutput, GenerationOutput, Logprob, RequestMetrics,  # noqa: F401
                            RequestOutput, StreamDelta)
from engine.prompts import PromptType, is_prompt_list, normalize_prompts, read_template, truncate_ids
from engine.tokenizer import Message, Tokenizer

DTYPES = {"auto": None, "half": "float16", "float": "float32"}  # vLLM's spellings -> ours
# apply_chat_template's own parameters and the names it sets: not for chat_template_kwargs.
CHAT_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tokenize",
                                "chat_template"})
# generation_config.json keys vLLM takes as default sampling params -> SamplingParams field.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class LLM(VllmExtras):
    """A model, its tokenizer and one engine core, behind ``generate``, ``chat`` and ``stream``.

    ``model``: a checkpoint directory (model and tokenizer are loaded from it) or an already
    built ``nn.Module`` with a ``cfg`` (our Qwen3 / Qwen3-MoE). ``tokenizer``: a ``Tokenizer``
    or a directory holding ``tokenizer.json``; without one, prompts must be token ids and the
    outputs' ``text`` is empty. ``dtype``/``device`` apply when loading from a directory
    (``dtype="auto"`` keeps the checkpoint's). ``chat_template``: a Jinja template (or a file
    holding one) replacing the tokenizer's. Other keywords: ``EngineConfig`` fields
    (``num_blocks``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``seed`` ...) or
    vLLM's engine arguments, sorted by ``engine.llm_options``. An option not given (``seed``,
    ``gpu_memory_utilization`` ...) or given as None takes ``EngineConfig``'s default, its only one,
    except ``attention_backend`` and ``flat_model``: those default to the fastest configuration
    for the model's device and dtype (``engine.fast.choose.fastest_options``: on a CPU with a
    C++ compiler, the "cpu" backend and the "fused" flat model), as vLLM serves with its fastest.
    Name them to run the chapter's own pieces (``attention_backend="reference", flat_model="flat"``).

    Invariant: every live engine request of this LLM has a ``CompletionState`` in ``_live``, and
    the core is only touched with ``_lock`` held.
    """

    def __init__(
        self,
        model: str | os.PathLike | nn.Module,
        tokenizer: str | os.PathLike | Tokenizer | None = None,
        *,
        dtype: torch.dtype | str | None = "auto",
        device: torch.device | str | None = None,
        skip_tokenizer_init: bool = False,
        chat_template: str | os.PathLike | None = None,
        kv_cache_memory_bytes: int | None = None,
        **engine_options: Any,
    ) -> None:
        from engine.serve import EngineConfig, EngineCore
        from engine.fast.choose import fastest_options

        known = set(EngineConfig.field_names())
        options, front = split_options({**engine_options, "kv_cache_memory_bytes": kv_cache_memory_bytes}, known)
        if front.get("kv_cache_memory_bytes") is not None:  # vLLM's name for the pool's bytes: the engine sizes it
            if options.get("kv_cache_bytes") is not None:
                raise ValueError("LLM: 'kv_cache_memory_bytes' and 'kv_cache_bytes' are the same option; give one")
            options["kv_cache_bytes"] = front["kv_cache_memory_bytes"]
        config = EngineConfig(**options)  # checked before loading: a typo should not cost a multi-GB load
        self.chat_template = read_template(chat_template)
        if isinstance(dtype, str):
            dtype = DTYPES.get(dtype, dtype)
        self._model_dir: Path | None = None
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
            self._model_dir = Path(model).expanduser()
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
        self.generation_config = front.get("generation_config", "auto")
        weight = next(self.model.parameters(), None)
        if weight is None:
            raise ValueError("LLM needs one of our models (engine.models.load_model), not a module without weights")
        fastest = {k: v for k, v in fastest_options(weight.device, weight.dtype).items() if k not in options}
        if fastest:  # the configuration not named: this machine's fastest for the model's device and dtype
            config = dataclasses.replace(config, **fastest)

        eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.engine = EngineCore(self.model, config, eos_token_id=eos)
        self.processor = self.engine.processor  # checks every request before the core queues it
        self._next_id = 0
        self._lock = threading.RLock()
        self._live: dict[str, CompletionState] = {}  # engine request id -> its completion
        self._stepping: int | None = None  # thread id inside engine.step(), if any
        self._deferred_aborts: list[str] = []  # streams closed (by the GC) during a step
        self._default_params = None
        self._enqueued: list[tuple[RequestOutput, list[CompletionState]]] = []  # by enqueue()

    # ------------------------------------------------------------------ vLLM's methods

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer; pass tokenizer= (a directory with "
                             "tokenizer.json, or a Tokenizer)")
        return self.tokenizer

    def set_tokenizer(self, tokenizer: Tokenizer) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise ValueError(f"set_tokenizer takes a Tokenizer, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer

    def get_default_sampling_params(self):
        """What ``generate(prompts)`` uses without params, as vLLM does: the sampling fields of
        the checkpoint's ``generation_config.json`` (temperature, top_k, top_p, ...) over
        ``SamplingParams()``; just ``SamplingParams()`` with ``generation_config="vllm"``."""
        from engine.serve import SamplingParams

        if self._default_params is None:
            found: dict[str, Any] = {}
            path = self._model_dir / "generation_config.json" if self._model_dir is not None else None
            if self.generation_config == "auto" and path is not None and path.is_file():
                try:
                    cfg = json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"{path}: not valid JSON ({e})") from None
                if isinstance(cfg, dict):
                    found = {ours: cfg[k] for k, ours in GENERATION_DEFAULTS.items() if cfg.get(k) is not None}
            self._default_params = found
        return SamplingParams(**self._default_params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Any = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; one ``RequestOutput`` per prompt, in prompt order.

        ``prompts``: a string, a list of token ids, a list of either, or vLLM's dicts.
        ``sampling_params``: one ``SamplingParams`` for all, one per prompt, or None
        (``get_default_sampling_params()``). ``use_tqdm``: a progress bar on stderr.
        ``priority``: one int per prompt (lower runs first under ``scheduling_policy="priority"``).
        ``tokenization_kwargs``: ``truncate_prompt_tokens`` (keep k tokens; -1 = max_model_len),
        ``truncation_side`` ("right", the default, drops the end; "left" the start),
        ``add_special_tokens``.
        """
        _refuse_extras(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        items = self._normalize(prompts, tokenization_kwargs)
        return self._wait(self._enqueue(items, sampling_params, priority), use_tqdm)

    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Any = None,
        lora_request: Any = None,
        priority: list[int] | None = None,
        use_tqdm: bool = True,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """Queue prompts without running them (as ``generate`` takes them); their request ids.
        ``wait_for_completion()`` then runs everything queued so and returns it."""
        _refuse_extras(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        batch = self._enqueue(self._normalize(prompts, tokenization_kwargs), sampling_params, priority)
        with self._lock:
            self._enqueued.extend(batch)
        return [out.request_id for out, _ in batch]

    def wait_for_completion(self, output_type: Any = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Finish every request queued by ``enqueue``/``enqueue_chat``; outputs in queueing order."""
        if output_type not in (None, RequestOutput) and not (isinstance(output_type, tuple) and RequestOutput in output_type):
            raise ValueError(f"wait_for_completion: the course engine returns RequestOutput, not {output_type!r}")
        with self._lock:
            batch, self._enqueued = self._enqueued, []
        return self._wait(batch, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: Any = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them.

        Each conversation is rendered with ``chat_template`` (else the LLM's, else the
        tokenizer's) and generated from like any prompt. ``add_generation_prompt`` opens an
        assistant turn; ``continue_final_message`` instead leaves the last message open so the
        model carries on with it (the two exclude each other). ``tools`` and
        ``chat_template_kwargs`` reach the template (e.g. ``{"enable_thinking": False}`` for
        Qwen3); the latter may also override ``bos_token``/``eos_token``, as in HF.
        """
        batch = self._chat_batch(messages, sampling_params, lora_request, priority, chat_template,
                                 chat_template_content_format, add_generation_prompt, continue_final_message,
                                 tools, chat_template_kwargs, tokenization_kwargs, mm_processor_kwargs)
        return self._wait(batch, use_tqdm)

    def enqueue_chat(self, messages: Any, sampling_params: Any = None, use_tqdm: bool = True,
                     lora_request: Any = None, priority: list[int] | None = None, chat_template: str | None = None,
                     chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
                     continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                     chat_template_kwargs: dict[str, Any] | None = None,
                     tokenization_kwargs: dict[str, Any] | None = None,
                     mm_processor_kwargs: dict[str, Any] | None = None) -> list[str]:
        """``chat``'s rendering, ``enqueue``'s queueing: request ids; see ``wait_for_completion``."""
        batch = self._chat_batch(messages, sampling_params, lora_request, priority, chat_template,
                                 chat_template_content_format, add_generation_prompt, continue_final_message,
                                 tools, chat_template_kwargs, tokenization_kwargs, mm_processor_kwargs)
        with self._lock:
            self._enqueued.extend(batch)
        return [out.request_id for out, _ in batch]

    def _chat_batch(self, messages, sampling_params, lora_request, priority, chat_template,
                    chat_template_content_format, add_generation_prompt, continue_final_message, tools,
                    chat_template_kwargs, tokenization_kwargs, mm_processor_kwargs):
        """Render and queue conversations (``chat``'s arguments); the queued batch."""
        _refuse_extras(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: message "
                             "content is a string here ('auto' or 'string'); images are chapter 43")
        tok = self.get_tokenizer()
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)):
            conversations = list(messages)
        else:
            raise ValueError(f"messages must be a conversation (a list of message dicts) or a list of "
                             f"them, got {type(messages).__name__}")
        if not conversations:
            raise ValueError("chat() got no conversation; give a list of {'role', 'content'} dicts")
        if chat_template_kwargs is not None and (not isinstance(chat_template_kwargs, dict)
                                                 or not all(isinstance(k, str) for k in chat_template_kwargs)):
            raise ValueError(f"chat_template_kwargs must be a dict of names to values, got {chat_template_kwargs!r:.80}")
        kwargs = dict(chat_template_kwargs or {})
        taken = sorted(set(kwargs) & CHAT_TEMPLATE_ARGS)
        if taken:
            raise ValueError(f"chat_template_kwargs {taken} are chat()'s own arguments; pass them as such")
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
                raise ValueError(f"tools must be a list of tool schemas (dicts), got {tools!r:.80}")
            kwargs["tools"] = list(tools)
        texts = []
        for i, conv in enumerate(conversations):
            if not conv:
                raise ValueError(f"conversation {i} is empty; give at least one message")
            texts.append(tok.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template=chat_template or self.chat_template, **kwargs))
        kw = dict(tokenization_kwargs or {})
        kw.setdefault("add_special_tokens", False)  # the template wrote every special token itself
        return self._enqueue(self._normalize(texts, kw), sampling_params, priority)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block's hash, so no later prompt reuses them; as in vLLM, False
        (nothing changed) while requests still hold blocks."""
        if reset_running_requests or reset_connector:
            raise ValueError("reset_prefix_cache: reset_running_requests/reset_connector are not supported; "
                             "finish or abort the running requests first")
        with self._lock:
            if self.engine.has_unfinished():
                return False
            self.engine.blocks.reset_prefix_cache()
            return True

    # ------------------------------------------------------------------ the course's extras

    def stream(self, prompt: PromptType, sampling_params: Any = None) -> Iterator[StreamDelta]:
        """Generate for ONE prompt (n == 1), yielding a ``StreamDelta`` per step that produced
        tokens: the new tokens and the text they complete.

        Not part of vLLM's ``LLM`` (vLLM streams through ``AsyncLLM``); ``run.py generate`` uses
        it. A character split across tokens comes out whole, so a delta's text may be "" while it
        is incomplete; with stop strings the last few characters wait until it is sure they are
        not the start of one. The last delta has ``finish_reason`` set.
        """
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise ValueError("stream: the prompt is empty (no token ids); give at least one token")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("stream: the prompt is empty (\"\"); give at least one character")
        if is_prompt_list(prompt):
            raise ValueError("stream takes a single prompt, not a list; use generate() for many")
        [(_, ids, cache_key)] = self._normalize(prompt)
        [params] = self._params_list(sampling_params, 1)
        self.processor.check_sampling(params)  # invalid fields (set after construction) first
        if params.n != 1:
            raise ValueError(f"stream produces one completion; got SamplingParams(n={params.n})")
        with self._lock:
            _, [state] = self._add(ids, params, cache_key=cache_key)
        try:
            while True:
                with self._lock:
                    delta = state.take_delta()
                    if delta is None:
                        self._step()
                        delta = state.take_delta()
                if delta is not None:
                    text, tokens = delta
                    lp = None
                    if state.logprobs is not None:  # the entries of this delta's tokens
                        end = len(state.token_ids)
                        lp = self._sample_logprobs(state.logprobs[end - len(tokens):end], params.detokenize)
                    if state.finished:
                        yield StreamDelta(text, tokens, state.finish_reason, state.stop_reason, lp)
                        return
                    if text or tokens:
                        yield StreamDelta(text, tokens, logprobs=lp)
        finally:  # the caller stopped early (or failed): leave no request behind
            self._release([state])

    # ------------------------------------------------------------------ internals

    def _normalize(self, prompts: PromptType | Sequence[PromptType],
                   tokenization_kwargs: dict[str, Any] | None = None) -> list[tuple[str | None, list[int], tuple]]:
        return normalize_prompts(prompts, self.get_tokenizer, self.processor.max_model_len, tokenization_kwargs)


    def _params_list(self, sampling_params: Any, n: int) -> list[Any]:
        """One SamplingParams per prompt: checked copies (re-validated as at construction, so a
        field the caller changed after building it is checked too, and later changes to the
        caller's object do not reach requests already queued)."""
        from engine.serve import SamplingParams

        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [_checked_copy(sampling_params)] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per "
                             f"prompt), got {len(params)} item(s)")
        return [_checked_copy(p) for p in params]

    def _add(self, prompt_ids: list[int], params: Any, priority: int = 0,
             cache_key: tuple = ()) -> tuple[str, list[CompletionState]]:
        """Queue one prompt under a fresh id (lock held); returns the id and one ``CompletionState``
        per completion. ``cache_key`` (a dict prompt's ``cache_salt``) keys its prefix-cache blocks.

        The tokenizer's other end-of-sequence ids (generation_config.json lists e.g. both
        <|im_end|> and <|endoftext|>) join ``stop_token_ids`` unless ``ignore_eos``, as in vLLM.
        ``truncate_prompt_tokens`` in the params keeps the prompt's last k tokens.
        """
        if params.truncate_prompt_tokens is not None:
            prompt_ids = truncate_ids(prompt_ids, params.truncate_prompt_tokens, "left", self.processor.max_model_len)
        tok = self.tokenizer
        if tok is not None and not params.ignore_eos:
            extra = [t for t in tok.eos_token_ids
                     if t != tok.eos_token_id and t not in params.stop_token_ids]
            if extra:
                params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        if params.stop and tok is None:
            raise ValueError("stop strings are matched on the text: this LLM has no tokenizer; use stop_token_ids")
        rid = str(self._next_id)
        arrival = time.monotonic()
        child_ids = self.engine.add_request(rid, prompt_ids, params, priority=priority, cache_key=cache_key,
                                            arrival_time=arrival)
        self._next_id += 1
        states = [CompletionState(cid, j, prompt_ids, params, tok, arrival) for j, cid in enumerate(child_ids)]
        for s in states:
            self._live[s.engine_id] = s
        return rid, states

    def _step(self) -> None:
        """One core step (lock held), its outputs delivered to their completions."""
        self._stepping = threading.get_ident()
        try:
            outputs = self.engine.step()
        finally:
            self._stepping = None
        for out in outputs:
            state = self._live.get(out.request_id)
            if state is None:
                continue
            if state.update(out):  # a stop string: the core is still running it
                self._keep_prompt_logprobs(state)
                self.engine.abort_request(out.request_id)
            if state.finished:
                del self._live[out.request_id]
        while self._deferred_aborts:
            self.engine.abort_request(self._deferred_aborts.pop())
        if not self.engine.has_unfinished() and self._live:
            # aborted behind our back (llm.engine.abort_request): nothing will ever report them
            for state in self._live.values():
                state.finish_reason = "abort"
            self._live.clear()

    def _keep_prompt_logprobs(self, state: CompletionState) -> None:
        """A completion ended here by a stop string: the core attaches prompt logprobs only to a
        request's last output, which an aborted request never sends, so take them from the core's
        request before aborting it (complete: a stop string needs output text, so the prompt is done)."""
        if state.params.prompt_logprobs is None or state.prompt_logprobs is not None:
            return
        request = self.engine.scheduler.requests.get(state.engine_id)
        if request is not None and request.prompt_logprobs is not None:
            state.prompt_logprobs = list(request.prompt_logprobs)

    def _release(self, states: list[CompletionState]) -> None:
        """Abort what is unfinished of ``states`` (a caller that stopped early or failed)."""
        if self._stepping == threading.get_ident():  # called from inside a step (GC): do it after
            self._deferred_aborts.extend(s.engine_id for s in states if not s.finished)
            return
        with self._lock:
            for s in states:
                if not s.finished:
                    self.engine.abort_request(s.engine_id)
                    s.finish_reason = "abort"
                self._live.pop(s.engine_id, None)

    def _enqueue(self, items: list[tuple[str | None, list[int], tuple]], sampling_params: Any,
                 priority: list[int] | None = None) -> list[tuple[RequestOutput, list[CompletionState]]]:
        """Queue every prompt (all or nothing); its RequestOutput shell and completion states."""
        params = self._params_list(sampling_params, len(items))
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(items)):
            raise ValueError(f"priority must be a list of {len(items)} ints (one per prompt), got {priority!r}")
        for p in params:
            self.processor.check_sampling(p)  # before anything is queued
        batch: list[tuple[RequestOutput, list[CompletionState]]] = []
        try:
            with self._lock:
                for i, ((text, ids, cache_key), p) in enumerate(zip(items, params)):
                    rid, states = self._add(ids, p, 0 if priority is None else priority[i], cache_key)
                    batch.append((RequestOutput(rid, text, states[0].prompt_token_ids), states))
        except BaseException:
            self._release([s for _, states in batch for s in states])
            raise
        return batch

    def _wait(self, batch: list[tuple[RequestOutput, list[CompletionState]]], use_tqdm: bool | None) -> list[RequestOutput]:
        """Step the core until every completion of ``batch`` is finished; the filled outputs."""
        try:
            # vLLM's bar: prompts done, and the output tokens' rate after the count.
            bar = tqdm(total=len(batch), desc="Processed prompts", unit=" prompts", disable=not use_tqdm,
                       dynamic_ncols=True, postfix="output 0 tok/s")
            tokens = 0
            left = [len(states) for _, states in batch]
            pending = [(i, s) for i, (_, states) in enumerate(batch) for s in states]
            while pending:
                with self._lock:
                    if all(not s.finished for _, s in pending):  # else another thread stepped for us
                        before = sum(len(s.token_ids) for _, s in pending)
                        self._step()
                        tokens += sum(len(s.token_ids) for _, s in pending) - before
                still = []
                for i, s in pending:
                    if not s.finished:
                        still.append((i, s))
                        continue
                    left[i] -= 1
                    if left[i] == 0:
                        elapsed = bar.format_dict["elapsed"]
                        bar.set_postfix_str(f"output {tokens / max(elapsed, 1e-9):,.0f} tok/s", refresh=False)
                        bar.update(1)
                pending = still
            bar.close()
        except BaseException:  # an error or Ctrl-C mid-batch: leave none of ours in the core
            self._release([s for _, states in batch for s in states])
            raise
        for out, states in batch:
            self._fill(out, states)
        return [out for out, _ in batch]

    def _fill(self, out: RequestOutput, states: list[CompletionState]) -> None:
        """A finished prompt's RequestOutput from its completions' states."""
        first = states[0]
        out.outputs = [CompletionOutput(s.index, s.text, s.token_ids, finish_reason=s.finish_reason,
                                        stop_reason=s.stop_reason) for s in states]
        for c, s in zip(out.outputs, states):
            if s.logprobs is not None:  # vLLM: both stay None unless logprobs was asked for
                c.logprobs = self._sample_logprobs(s.logprobs, s.params.detokenize)
                c.cumulative_logprob = sum(e[t] for e, t in zip(s.logprobs, s.token_ids))
        out.finished = True
        out.num_cached_tokens = first.num_cached_tokens
        out.metrics = first.metrics
        if first.params.prompt_logprobs is not None and first.prompt_logprobs is not None:
            out.prompt_logprobs = self._prompt_logprobs(out.prompt_token_ids, first.prompt_logprobs,
                                                        first.params.prompt_logprobs, first.params.detokenize)

    def _prompt_logprobs(self, prompt: list[int], entries: list[dict[int, float]], k: int,
                         detokenize: bool) -> list[dict[int, Logprob] | None]:
        """The core's [{token: logprob}] (entry i scores prompt token i + 1) in vLLM's form: None
        for the first token, then {token: Logprob} with ranks (1 = most likely): the prompt
        token's among the whole vocabulary, 1 .. k for the top k."""
        return [None] + self._sample_logprobs(entries, detokenize)

    def _sample_logprobs(self, entries: list[dict[int, float]], detokenize: bool) -> list[dict[int, Logprob]]:
        """The core's entries (``engine/serve/logprobs.py``: the scored token first, then the top
        k, with ``ranks``) as vLLM's [{token: Logprob}]."""
        tok = self.tokenizer if detokenize else None
        result: list[dict[int, Logprob]] = []
        for entry in entries:
            ranks = getattr(entry, "ranks", {})
            result.append({t: Logprob(v, ranks.get(t), None if tok is None else tok.decode([t], skip_special_tokens=False))
                           for t, v in entry.items()})
        return result


def _checked_copy(params: Any) -> Any:
    """``params`` re-built from its fields (so checked again); warnings were given at construction."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dataclasses.replace(params)


def _refuse_extras(lora_request: Any = None, mm_processor_kwargs: Any = None) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are chapter 43; leave lora_request=None")
    if mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs: images are chapter 43; leave mm_processor_kwargs=None")


