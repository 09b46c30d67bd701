"""The scheduler: which requests compute how many tokens this step.

The policy. Requests already running are served first, ranked by arrival (by priority, then
arrival, under the priority policy); each is given the tokens it still lacks, as far as the step's
token budget and the chunk cap allow. If the pool has no room for them, requests are preempted
from the bottom of that ranking — the newest, or the least important — until there is. Only then
are waiting requests admitted, front of the queue first, for as long as budget, sequence slots
and free blocks allow; a step that had to preempt admits nobody (the pool is plainly full), and
admission never preempts. What the step decides is a plan of pairs (request, n), each meaning:
this step computes n more tokens of that request.
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.serve.blocks import BlockManager
from engine.serve.config import SchedulerConfig
from engine.serve.request import Request, Status

@dataclass
class SchedulerOutput:
    """One step's plan. ``swap_out`` / ``swap_in`` list (request, blocks) copies the runner must
    make BEFORE the step's forward pass (swap-outs first)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[Request, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Request, list[int]]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Decides each step's (request, n) pairs; owns the waiting queue and the running list.

    Invariants: a request is in exactly one of ``waiting`` and ``running`` until it finishes;
    ``running`` is sorted by ``order_key`` and every running request holds blocks for its computed
    tokens; ``waiting`` is FIFO (fcfs, with preempted requests at the front) or sorted by
    ``order_key`` (priority).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.on_finish: Callable[[Request], None] | None = None  # e.g. drop swapped K/V, generators
        self._seq = itertools.count()
        self._order: dict[str, int] = {}

    # ----- queues --------------------------------------------------------------------------
    def order_key(self, request: Request) -> tuple:
        """Sort key: (arrival) for fcfs, (priority, arrival) for priority; ties by add order."""
        tie = self._order[request.request_id]
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time, tie)
        return (request.arrival_time, tie)

    def _insert_sorted(self, queue: list[Request], request: Request) -> None:
        # O(log n) keys per insert: rebuilding every key would make n additions quadratic.
        queue.insert(bisect.bisect_right(queue, self.order_key(request), key=self.order_key), request)

    def check(self, request: Request) -> None:
        """ValueError if ``request`` could never run under this configuration (nothing changes)."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler; use a new id")
        pool_tokens = self.blocks.num_blocks * self.blocks.block_size
        need = request.num_prompt_tokens + request.params.max_tokens
        if need > pool_tokens:
            raise ValueError(
                f"request {rid!r}: prompt ({request.num_prompt_tokens}) + max_tokens "
                f"({request.params.max_tokens}) = {need} tokens exceeds the whole KV pool of "
                f"{pool_tokens} tokens; lower max_tokens, or give the pool more room (kv_cache_bytes= or num_blocks=)")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > budget:
            raise ValueError(
                f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens exceeds "
                f"max_num_batched_tokens={budget} and chunked prefill is off; enable chunked "
                "prefill or raise the budget")

    def add(self, request: Request) -> None:
        """Queue a new request after ``check``; ValueError (nothing queued) if it could never run."""
        self.check(request)
        rid = request.request_id
        self._order[rid] = next(self._seq)
        self.requests[rid] = request
        request.status = Status.WAITING
        if self.config.policy == "priority":
            self._insert_sorted(self.waiting, request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- the step ------------------------------------------------------------------------
    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """What ``request`` asks for this step: everything it still needs, capped by budget and chunk."""
        if request.num_output_tokens >= request.params.max_tokens:
            return 0
        n = request.num_tokens_with_spec - request.num_computed_tokens
        if self.config.enable_chunked_prefill and self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return max(0, min(n, budget))

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then admissions. (Your engine: Chapter 31)

        1. Running requests in ``running`` order: each gets n = min(what it still needs, budget
           left, chunk cap); n == 0 is skipped. If ``allocate_slots`` fails, preempt the LAST
           running request and retry; if the victim is the request itself, stop scheduling
           running requests. After a successful allocation, publish the blocks the step will
           fill (``cache_full_blocks(request, num_computed_tokens + n)``). Each scheduled
           (request, n) takes exactly n from the budget, in both passes: a cached prefix is not
           computed, so it costs the budget nothing.
        2. Waiting requests from the queue's front, only if nothing was preempted this step, while
           any budget remains (even one token: a chunk of 1 is still a chunk) and fewer than
           ``max_num_seqs`` run. A request with nothing computed
           (a new one, or one preempted by recompute) starts after its longest cached prefix
           (``find_cached_prefix``); a swapped-out one keeps its computed tokens and is listed in
           ``swap_in`` with the first blocks of its new table.
           With chunked prefill off, a request that needs more than the budget left waits, and
           admission stops there — unless what it needs (its tokens not yet computed, after its
           cached prefix; not its whole history) exceeds the whole budget, which only a resumed
           request's can: then it runs in pieces of at most the budget left, as chunked prefill would.
           If its blocks don't fit, admission stops; never preempt to admit. Either way the queue
           is first come, first served: a request behind a waiting head is not admitted ahead of
           it, even one that would fit. On admission: pop it
           from ``waiting``; ``num_computed_tokens += cached tokens``; on its first admission
           (``admitted`` still False) set ``admitted`` and record them in ``num_cached_tokens``;
           clear ``swapped_out``; set status RUNNING; insert it into ``running`` at its
           ``order_key`` place (``_insert_sorted``: ``running`` stays sorted, so a late
           high-priority arrival runs, and is preempted, in its rank); then publish its blocks
           and schedule it like a running request.
        """
        raise NotImplementedError("Scheduler.schedule is a hole: fill it in (Chapter 31, engine/serve/scheduler.py)")

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take a running request off the device. (Your engine: Chapter 31)

        It leaves ``running``, and what happens to its K/V depends on the mode. Under swap, and
        only if it has computed tokens, the K/V is kept: append (request, the blocks that hold its
        computed tokens) to ``out.swap_out``, set ``swapped_out``, and leave
        ``num_computed_tokens`` alone. Otherwise (recompute) the K/V is given up:
        ``num_computed_tokens = 0``, and when it is readmitted it prefills its prompt and outputs
        anew, often straight from its own blocks, still in the prefix cache. In both modes: free
        its blocks, set status PREEMPTED, add one to the request's ``num_preemptions`` and to the
        scheduler's, append it to ``out.preempted``, and requeue it at the FRONT of ``waiting``
        (under the priority policy, at its ``order_key`` place instead — ``_insert_sorted`` —
        which puts it ahead of every waiting request of the same priority that arrived after it,
        not behind all of its priority). Leave ``admitted`` and ``num_cached_tokens`` as they are,
        in both modes: they describe the request's first admission, so a readmission records no
        new hit and its output still reports the first admission's cached tokens.
        """
        raise NotImplementedError("Scheduler._preempt is a hole: fill it in (Chapter 31, engine/serve/scheduler.py)")

    # ----- endings -------------------------------------------------------------------------
    def finish(self, request: Request, status: Status) -> None:
        """End ``request`` with a FINISHED_* status and free its blocks at once. The engine calls
        it after the step's forward pass, so the blocks serve the NEXT plan, not this one."""
        if not status.finished:
            raise ValueError(f"finish() needs a FINISHED_* status, got {status}")
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request)
        request.status = status
        request.finish_time = time.monotonic()
        self.requests.pop(request.request_id, None)
        self._order.pop(request.request_id, None)
        if self.on_finish is not None:
            self.on_finish(request)

    def abort(self, request_id: str) -> Request | None:
        """Abort a queued or running request; unknown or finished ids are ignored (returns None)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, Status.FINISHED_ABORTED)
        return request
