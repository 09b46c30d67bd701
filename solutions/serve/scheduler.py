"""The reference bodies of engine/serve/scheduler.py's holes (the chapter's answers).

Each function runs in that module's namespace (engine/_impl.py puts it there), so it uses the
module's names as they are; its contract is the hole's docstring in engine/serve/scheduler.py.
"""
from __future__ import annotations

from engine.serve.request import Status


class Scheduler:
    def schedule(self):
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                i += 1
                continue
            # No room: preempt from the end of ``running`` (the newest, or the lowest priority),
            # which reaches ``req`` itself once everything ranked after it is gone.
            fits = self.blocks.allocate_slots(req, n)
            while not fits and req.status is Status.RUNNING:
                self._preempt(self.running[-1], out)
                fits = req.status is Status.RUNNING and self.blocks.allocate_slots(req, n)
            if not fits:
                break  # it preempted itself: nothing ranked after it can fit either
            self.blocks.cache_full_blocks(req, req.num_computed_tokens + n)
            out.scheduled.append((req, n))
            budget -= n
            i += 1

        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting[0]
            cached: list[int] = []
            if not req.swapped_out and req.num_computed_tokens == 0:
                cached = self.blocks.find_cached_prefix(req)
            num_cached = len(cached) * self.blocks.block_size
            need = req.num_tokens_with_spec - req.num_computed_tokens - num_cached
            if (not cfg.enable_chunked_prefill and need > budget
                    and need <= cfg.max_num_batched_tokens):
                break
            n = min(need, budget)
            if cfg.enable_chunked_prefill and cfg.long_prefill_token_threshold > 0:
                n = min(n, cfg.long_prefill_token_threshold)
            if not self.blocks.allocate_slots(req, n, cached):
                break
            del self.waiting[0]
            req.status = Status.RUNNING
            self._insert_sorted(self.running, req)
            if not req.admitted:  # the first admission records what the prefix cache saved it
                req.admitted, req.num_cached_tokens = True, num_cached
            req.num_computed_tokens += num_cached
            if req.swapped_out:  # its saved K/V goes back into the first blocks of its new table
                num_saved = self.blocks.blocks_for(req.num_computed_tokens)
                out.swap_in.append((req, self.blocks.req_blocks[req.request_id][:num_saved]))
                req.swapped_out = False
            self.blocks.cache_full_blocks(req, req.num_computed_tokens + n)
            out.scheduled.append((req, n))
            budget -= n
        return out

    def _preempt(self, request, out):
        self.running.remove(request)
        keep_kv = self.config.preemption_mode == "swap" and request.num_computed_tokens > 0
        if keep_kv:  # the runner copies these blocks out before anything reuses them
            held = self.blocks.req_blocks.get(request.request_id, [])
            out.swap_out.append((request, held[:self.blocks.blocks_for(request.num_computed_tokens)]))
        else:
            request.num_computed_tokens = 0
        request.swapped_out = keep_kv
        self.blocks.free(request)
        request.status = Status.PREEMPTED
        self.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted.append(request)
        if self.config.policy == "priority":
            self._insert_sorted(self.waiting, request)
        else:
            self.waiting.insert(0, request)
