"""An OpenAI-compatible HTTP server on one ``LLM``'s core (``run.py serve``), like ``vllm serve``.

    python run.py serve                                   # the shipped model, 127.0.0.1:8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "qwen3-kjv-tiny", "prompt": "And God said", "max_tokens": 16, "temperature": 0}'

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events with
``stream: true``, ``stream_options.include_usage`` for a last usage chunk), ``/v1/models``,
``/health``, ``/tokenize``, ``/detokenize`` and ``/metrics`` (Prometheus text, vLLM's names).

The handlers never touch the engine: each hands its work to the ``EngineLoop`` (one thread owns the
LLM) and reads its completions' deltas from a queue. Refusals are OpenAI's error bodies: 400 for a
bad parameter (the message ``SamplingParams`` or the engine gives), 404 for another model's name,
503 with ``Retry-After`` when the bounded queue is full; an unexpected failure is a 500 with one
line, never a traceback. A client that disconnects aborts its request, streamed or not: a stream's
generator stops being read, and a plain request's handler watches for the disconnect while it waits
(``_collect``); either way the engine thread aborts it before its next step, so its blocks are free
in the same step.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from engine.entrypoints import protocol
from engine.entrypoints.engine_loop import Delta, EngineLoop, Full
from engine.entrypoints.errors import APIError, bad_request
from engine.entrypoints.metrics import render
from engine.llm import LLM

RETRY_AFTER_S = 1
CLIENT_CLOSED = 499  # the status a request whose client went away "gets" (nobody reads it), as nginx logs it


def build_app(llm: LLM, model_name: str, capacity: int = 256) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name``; ``capacity``: the most completions
    queued or running at once (past it: 503). The engine thread runs while the app is served."""
    loop = EngineLoop(llm, capacity)
    tok = llm.tokenizer  # logprobs name their tokens by text, or "token_id:N" without a tokenizer (as vLLM)
    shapes = _Logprobs((lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None
                      else (lambda t: f"token_id:{t}"))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.stop()  # Ctrl-C: whatever still runs is aborted, the thread ends

    app = FastAPI(title="engine-course OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_loop = loop

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(), status_code=500)

    async def read_body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
        name = body.get("model")
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}", "model")
        return body

    async def submit(add: Callable[[LLM], list], count: int):
        try:
            return await loop.submit(add, count)
        except Full as e:
            raise APIError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "engine-course", "root": model_name,
                                            "max_model_len": llm.processor.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = await loop.call(lambda: render(llm.get_metrics(), loop.metrics, model_name))  # the loop's numbers, read there
        return PlainTextResponse(text,
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        if "messages" in body:
            messages, template, _ = protocol.chat_request({**body, "max_tokens": 1})
            ids = await _call(loop, lambda: _chat_items(llm, messages, template)[0][1])
        else:
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise bad_request("'prompt' must be a string (or give 'messages')", param="prompt")
            ids = await _call(loop, lambda: llm.get_tokenizer().encode(prompt, add_special_tokens=bool(special)))
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.processor.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        tokens = body.get("tokens")
        vocab = llm.model.cfg.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
            raise bad_request(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        text = await _call(loop, lambda: llm.get_tokenizer().decode(tokens, skip_special_tokens=False))
        return {"prompt": text}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompts, params = protocol.completion_request(body)
        shape = shapes.per(params)
        stream, usage = protocol.stream_flags(body)
        key, queue, lengths = await submit(
            lambda llm_: _add_all(llm_, llm_._normalize(prompts), params), len(prompts) * params.n)
        meta = _Meta("cmpl-" + uuid.uuid4().hex, int(time.time()), model_name, "text_completion")
        if stream:
            return _sse(loop, key, _completion_chunks(queue, meta, len(prompts) * params.n, lengths, usage, shape))
        collected = await _collect(request, loop, key, queue, len(prompts) * params.n)
        if collected is None:
            return Response(status_code=CLIENT_CLOSED)
        choices, finish, tokens, ids, lps = collected
        return {**meta.head(), "choices": [{"index": i, "text": t, "logprobs": shape.completion(ids[i], lps[i]),
                                            "finish_reason": finish[i],
                                            "stop_reason": None}
                                           for i, t in enumerate(choices)],
                "usage": _usage(lengths, tokens)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request)
        messages, template, params = protocol.chat_request(body)
        shape = shapes.per(params)
        stream, usage = protocol.stream_flags(body)
        key, queue, lengths = await submit(
            lambda llm_: _add_all(llm_, _chat_items(llm_, messages, template), params), params.n)
        meta = _Meta("chatcmpl-" + uuid.uuid4().hex, int(time.time()), model_name, "chat.completion")
        if stream:
            return _sse(loop, key, _chat_chunks(queue, meta, params.n, lengths, usage, shape))
        collected = await _collect(request, loop, key, queue, params.n)
        if collected is None:
            return Response(status_code=CLIENT_CLOSED)
        choices, finish, tokens, ids, lps = collected
        return {**meta.head(), "choices": [{"index": i, "message": {"role": "assistant", "content": t},
                                            "logprobs": shape.chat(ids[i], lps[i]), "finish_reason": finish[i]}
                                           for i, t in enumerate(choices)],
                "usage": _usage(lengths, tokens)}

    return app


# ----- the engine thread's side of a request (these run there, through EngineLoop) -------------

def _add_all(llm: LLM, items: list[tuple[str | None, list[int], tuple]], params) -> list:
    """Queue every prompt with ``params`` (all or nothing): per prompt (token ids, states)."""
    llm.processor.check_sampling(params)
    added: list = []
    try:
        for _, ids, cache_key in items:
            _, states = llm._add(ids, params, cache_key=cache_key)
            added.append((ids, states))
    except BaseException:
        llm._release([s for _, states in added for s in states])
        raise
    return added


def _chat_items(llm: LLM, messages: list[dict[str, Any]], template: dict[str, Any]) -> list:
    """One conversation rendered with the chat template, as ``normalize_prompts``' items."""
    kwargs = template.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object, got {kwargs!r:.80}")
    text = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=bool(template["add_generation_prompt"]),
        continue_final_message=bool(template["continue_final_message"]),
        chat_template=template["chat_template"] or llm.chat_template, **kwargs)
    return llm._normalize([text], {"add_special_tokens": False})


async def _call(loop: EngineLoop, fn: Callable[[], Any]) -> Any:
    try:
        return await loop.call(fn)
    except ValueError as e:
        raise bad_request(str(e)) from None


# ----- responses ---------------------------------------------------------------------------------

class _Meta:
    def __init__(self, rid: str, created: int, model: str, obj: str) -> None:
        self.rid, self.created, self.model, self.obj = rid, created, model, obj

    def head(self, obj: str | None = None) -> dict[str, Any]:
        return {"id": self.rid, "object": obj or self.obj, "created": self.created, "model": self.model}


def _usage(lengths: list[int], tokens: list[int]) -> dict[str, int]:
    prompt, completion = sum(lengths), sum(tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _next(queue) -> Delta:
    item = await queue.get()
    if isinstance(item, BaseException):
        raise APIError(500, f"the engine failed: {type(item).__name__}: {item}")
    return item


class _Logprobs:
    """The engine's per-token logprobs (``{token id: logprob}``, the sampled token among them) in
    OpenAI's two shapes: completions' parallel lists, chat's list of entries."""

    def __init__(self, decode: Callable[[int], str], top: int | None = None) -> None:
        self.decode, self.top = decode, top  # top: the request's logprobs=k (-1: every token)

    def per(self, params) -> "_Logprobs":
        return _Logprobs(self.decode, params.logprobs)

    def completion(self, ids: list[int], entries: list[dict[int, float]] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        return {"tokens": [self.decode(t) for t in ids],
                "token_logprobs": [e.get(t) for t, e in zip(ids, entries)],
                "top_logprobs": [{self.decode(k): v for k, v in e.items()} for e in entries],
                "text_offset": None}

    def chat(self, ids: list[int], entries: list[dict[int, float]] | None) -> dict[str, Any] | None:
        if entries is None:
            return None

        def one(t: int, lp: float | None) -> dict[str, Any]:
            text = self.decode(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        def top(e: dict[int, float]) -> list[dict[str, Any]]:  # the k most likely (the sampled one among them or not)
            best = sorted(e.items(), key=lambda kv: -kv[1])
            return [one(k, v) for k, v in (best if self.top is None or self.top < 0 else best[:self.top])]

        return {"content": [{**one(t, e.get(t)), "top_logprobs": top(e)} for t, e in zip(ids, entries)]}


Collected = tuple[list[str], list[str | None], list[int], list[list[int]], list[list | None]]


async def _collect(request: Request, loop: EngineLoop, key: int, queue, count: int) -> Collected | None:
    """Every completion's whole text, finish reason, token count, token ids and logprobs; None if the
    client disconnected first. Either way (or if this handler is cancelled) nothing of the request
    stays in the engine once this returns: ``loop.abort`` runs before the engine thread's next step."""
    gathering = asyncio.ensure_future(_gather(queue, count))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({gathering, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not gathering.done():
            gathering.cancel()
        loop.abort(key)  # a no-op once all are finished
    return gathering.result() if gathering.done() and not gathering.cancelled() else None


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away. The body is already read, so the next message the
    server has for this request is its disconnect (uvicorn answers any later ``receive`` with it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _gather(queue, count: int) -> Collected:
    texts, finish, tokens = [""] * count, [None] * count, [0] * count
    ids: list[list[int]] = [[] for _ in range(count)]
    lps: list[list | None] = [None] * count
    done = 0
    while done < count:
        d = await _next(queue)
        texts[d.index] += d.text
        tokens[d.index] += len(d.token_ids)
        ids[d.index] += d.token_ids
        if d.logprobs is not None:
            lps[d.index] = (lps[d.index] or []) + d.logprobs
        if d.finish_reason is not None:
            finish[d.index] = d.finish_reason
            done += 1
    return texts, finish, tokens, ids, lps


def _sse(loop: EngineLoop, key: int, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:  # finished, failed, or the client went away: nothing of it stays in the engine
            loop.abort(key)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _completion_chunks(queue, meta: _Meta, count: int, lengths: list[int], usage: bool, shape: _Logprobs):
    tokens, done = [0] * count, 0
    while done < count:
        d = await _next(queue)
        tokens[d.index] += len(d.token_ids)
        done += d.finish_reason is not None
        yield {**meta.head(), "choices": [{"index": d.index, "text": d.text,
                                           "logprobs": shape.completion(d.token_ids, d.logprobs),
                                           "finish_reason": d.finish_reason}]}
    if usage:
        yield {**meta.head(), "choices": [], "usage": _usage(lengths, tokens)}


async def _chat_chunks(queue, meta: _Meta, count: int, lengths: list[int], usage: bool, shape: _Logprobs):
    obj = "chat.completion.chunk"
    for i in range(count):  # OpenAI's first chunk of each choice names the role
        yield {**meta.head(obj), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
    tokens, done = [0] * count, 0
    while done < count:
        d = await _next(queue)
        tokens[d.index] += len(d.token_ids)
        done += d.finish_reason is not None
        yield {**meta.head(obj), "choices": [{"index": d.index, "delta": {"content": d.text} if d.text else {},
                                              "logprobs": shape.chat(d.token_ids, d.logprobs),
                                              "finish_reason": d.finish_reason}]}
    if usage:
        yield {**meta.head(obj), "choices": [], "usage": _usage(lengths, tokens)}
