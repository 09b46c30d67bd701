"""``EngineLoop``: one thread owns an ``LLM`` (its core, tokenizer and front end); HTTP handlers
on the asyncio loop hand it work and receive each completion's text as the steps produce it.

Nothing outside the loop's thread touches the LLM: a handler calls ``await loop.call(fn)``, which
queues ``fn`` for the thread and waits for its result (tokenizing, validating and queueing a
request all run there, so a ValueError comes back to the handler with nothing queued). Between
calls the thread steps the core while it has work and pushes every tracked completion's new
text to that request's ``asyncio.Queue`` (``call_soon_threadsafe``). A handler that goes away
(a client that disconnected) calls ``abort``: the thread aborts its completions before its next
step, so their blocks are free in the same step.

Invariant: ``pending`` counts the completions accepted and not yet finished or aborted, and
``submit`` refuses (``Full``) once it would pass ``capacity``: the waiting queue is bounded.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.entrypoints.metrics import ServerMetrics
from engine.llm import LLM
from engine.output_processor import CompletionState

IDLE_WAIT_S = 0.05  # how long the idle thread blocks on its inbox before looking again


class Full(Exception):
    """The bounded queue has no room for the request (the server answers 503)."""


@dataclass
class Delta:
    """What one completion produced since the last delta; ``finish_reason`` set on its last."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None  # params.logprobs set: one entry per token_ids


@dataclass
class Tracked:
    """A request's completions as the loop feeds them to their handler."""

    states: list[tuple[int, CompletionState]]  # (choice index, state)
    sink: Callable[[Delta | BaseException], None]
    num_prompt_tokens: list[int] = field(default_factory=list)
    last_token_time: dict[int, float] = field(default_factory=dict)


class EngineLoop:
    """The engine's own thread and the handlers' way in (``call``, ``submit``, ``abort``).

    ``capacity``: the most completions accepted at once (running and waiting together).
    """

    def __init__(self, llm: LLM, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 completion, got {capacity}")
        self.llm = llm
        self.capacity = capacity
        self.metrics = ServerMetrics()
        self.pending = 0
        self._count_lock = threading.Lock()
        self._inbox: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._tracked: dict[int, Tracked] = {}
        self._next_key = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ----- the handlers' side (any thread, usually the asyncio loop) ------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request still running and end the thread."""
        self._stop.set()
        self._thread.join(timeout)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` in the engine thread; its result (or its exception) here."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set():
            raise RuntimeError("the engine loop has stopped")
        self._inbox.put((fn, fut))
        return await asyncio.wrap_future(fut)

    def reserve(self, count: int) -> None:
        """Take room for ``count`` completions, or raise ``Full``; ``release`` gives it back."""
        with self._count_lock:
            if self.pending + count > self.capacity:
                raise Full(f"the server is full ({self.pending} of {self.capacity} completions queued or "
                           f"running); retry shortly")
            self.pending += count

    def release(self, count: int) -> None:
        with self._count_lock:
            self.pending -= count

    async def submit(self, add: Callable[[LLM], list[tuple[list[int], list[CompletionState]]]],
                     count: int) -> tuple[int, asyncio.Queue, list[int]]:
        """Queue a request: ``add(llm)`` runs in the engine thread and returns, per prompt, its
        token ids and its completions' states (``count`` in all). Returns the request's key (for
        ``abort``), the queue its ``Delta``s arrive on, and each prompt's token count."""
        self.reserve(count)
        aio = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def sink(item: Delta | BaseException) -> None:
            aio.call_soon_threadsafe(out.put_nowait, item)

        def register() -> tuple[int, list[int]]:
            prompts = add(self.llm)
            states = [s for _, ss in prompts for s in ss]
            key = self._next_key
            self._next_key += 1
            self._tracked[key] = Tracked(list(enumerate(states)), sink, [len(ids) for ids, _ in prompts])
            self.metrics.requests_received += 1
            return key, [len(ids) for ids, _ in prompts]

        try:
            key, lengths = await self.call(register)
        except BaseException:
            self.release(count)
            raise
        return key, out, lengths

    def abort(self, key: int) -> None:
        """Abort what is unfinished of request ``key`` (safe to call from any thread, any time)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((lambda: self._abort(key), fut))

    # ----- the engine thread ------------------------------------------------------------------
    def _abort(self, key: int) -> None:
        tracked = self._tracked.pop(key, None)
        if tracked is None:
            return
        unfinished = [s for _, s in tracked.states if not s.finished]
        self.llm._release(unfinished)
        self.release(len(unfinished))

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.llm.engine.has_unfinished()
            try:
                fn, fut = self._inbox.get_nowait() if busy else self._inbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                fn = None
            if fn is not None:
                self._run_call(fn, fut)
                continue  # take every queued call before the next step
            if busy:
                self._step()
        for key in list(self._tracked):  # shutting down: nothing left in the core
            self._abort(key)
        while True:
            try:
                _, fut = self._inbox.get_nowait()
            except queue.Empty:
                break
            fut.set_exception(RuntimeError("the engine loop has stopped"))

    @staticmethod
    def _run_call(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - it belongs to the caller
            fut.set_exception(exc)

    def _step(self) -> None:
        try:
            self.llm._step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
            for key, tracked in list(self._tracked.items()):
                tracked.sink(exc)
                self._abort(key)
            return
        now = time.monotonic()
        for key, tracked in list(self._tracked.items()):
            done = 0
            for index, state in tracked.states:
                delta = state.take_delta()
                if delta is not None:
                    text, tokens = delta
                    if tokens:
                        self._time_tokens(tracked, index, state, now, len(tokens))
                    end = len(state.token_ids)  # take_delta's tokens are the last len(tokens) of them
                    lps = None if state.logprobs is None else list(state.logprobs[end - len(tokens):end])
                    tracked.sink(Delta(index, text, tokens, state.finish_reason, state.stop_reason, lps))
                done += state.finished
            if done == len(tracked.states):
                del self._tracked[key]
                self.release(done)
                self.metrics.requests_finished += 1

    def _time_tokens(self, tracked: Tracked, index: int, state: CompletionState, now: float, count: int) -> None:
        last = tracked.last_token_time.get(index)
        if last is None:
            self.metrics.ttft.observe(now - state.metrics.arrival_time)
        else:
            for _ in range(count):  # the step's tokens share its gap
                self.metrics.itl.observe((now - last) / count)
        tracked.last_token_time[index] = now
        self.metrics.generation_tokens += count
