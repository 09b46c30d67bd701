"""The reference bodies of engine/serve/engine.py's holes (the chapter's answers).

Each function runs in that module's namespace (engine/_impl.py puts it there), so it uses the
module's names as they are; its contract is the hole's docstring in engine/serve/engine.py.
"""
from __future__ import annotations

from engine.serve.request import Status


class EngineCore:
    def check_stop(self, request):
        p = request.params
        num_output = request.num_output_tokens
        if num_output == 0:
            return None
        last = request.token_ids[-1]
        if num_output >= p.min_tokens:
            if last in p.stop_token_ids:
                request.stop_reason = last
                return Status.FINISHED_STOPPED
            if not p.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:
                return Status.FINISHED_STOPPED
        if num_output >= p.max_tokens or request.num_tokens >= self.max_model_len:
            return Status.FINISHED_LENGTH
        return None

    def step(self):
        plan = self.scheduler.schedule()
        try:
            # Swap-outs save blocks this step's forward pass may overwrite; swap-ins restore
            # blocks it reads. Both come first, swap-outs before swap-ins.
            for req, blocks in plan.swap_out:
                self.runner.swap_out(req, blocks)
            for req, blocks in plan.swap_in:
                self.runner.swap_in(req, blocks)
            if not plan.scheduled:
                return []  # nothing to compute (every running request may have been preempted)
            batch = self.runner.prepare(plan.scheduled, self.blocks.req_blocks)  # tables looked up by id
            logits = self.runner.execute(batch)  # [sample rows + prompt-logprob rows, V]
            num_sample = batch.num_sample_rows
            sample_reqs = [req for (req, _), k in zip(plan.scheduled, batch.sample_counts) for _ in range(k)]
            tokens = self.sampler(logits[:num_sample], sample_reqs, self.generators)
            prompt_lp = self._prompt_logprobs(batch, logits[num_sample:])
        except BaseException:  # out of memory, Ctrl-C ...: nothing this step wrote can be trusted
            self.recover_failed_step(plan)
            raise
        self.steps += 1

        outputs: list[RequestOutput] = []
        row = 0
        for (req, n), k in zip(plan.scheduled, batch.sample_counts):
            start = req.num_computed_tokens
            req.num_computed_tokens += n
            new = tokens[row:row + k]
            row += k
            for t in new:
                req.append(t)
            if req.params.prompt_logprobs is not None:  # a recompute's entries replace the stale ones
                req.prompt_logprobs = (req.prompt_logprobs or [])[:start] + prompt_lp.get(req.request_id, [])
            self.blocks.cache_full_blocks(req)
            status = self.check_stop(req) if new else None
            if status is not None:
                self.scheduler.finish(req, status)
            if new or status is not None:
                outputs.append(self._output(req, new))
        return outputs
