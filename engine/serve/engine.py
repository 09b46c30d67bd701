"""EngineCore: one scheduler, one block pool, one flattened forward pass per step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.serve.blocks import BlockManager
from engine.serve.config import EngineConfig
from engine.serve.logprobs import token_logprobs
from engine.serve.observer import Observer, install as install_observer
from engine.serve.parallel_sampling import ParentRequest
from engine.serve.params import SamplingParams
from engine.serve.processor import Processor
from engine.serve.registry import get_backend, get_flat_model
from engine.serve.request import Request, Status
from engine.serve.runner import ModelRunner
from engine.serve.sampler import SimpleSampler
from engine.serve.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class RequestOutput:
    """What one step reports for one request: the tokens it just produced and where it stands."""

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    # params.logprobs set: one entry per new token (engine/serve/logprobs.py's TokenLogprobs)
    new_logprobs: list[dict[int, float]] | None = field(default=None, repr=False)


class EngineCore:
    """The chapter's engine: add requests, call ``step()`` until ``has_unfinished()`` is False.

    Owns ``runner`` (model + pools), ``blocks`` (BlockManager), ``scheduler``, ``sampler`` and
    ``processor`` (the front door: a request is checked, and n > 1 fanned out, before it is
    queued). ``steps`` counts steps that ran a forward pass; ``preemptions`` counts preemptions.
    Invariant: ``parent_of`` maps exactly the child ids of the ``parents`` still running.
    """

    def __init__(self, model: nn.Module, config: EngineConfig | None = None,
                 eos_token_id: int | None = None, sampler: SimpleSampler | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model = model
        self.eos_token_id = eos_token_id
        self.flat = get_flat_model(config.flat_model, model)  # "flat": the chapter's FlatModel
        backend = get_backend(config.attention_backend)
        cfg = model.cfg
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"{cfg.max_position_embeddings} positions")
        # The pool, sized once (the largest step the scheduler will run, against the memory left)
        # and allocated by the runner; the block manager keeps the bookkeeping of those same blocks.
        cache = config.cache
        max_num_tokens = min(config.scheduler.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner.with_pool(self.flat, backend, cache, max_num_tokens)
        self.blocks = BlockManager(num_blocks=self.runner.num_blocks, block_size=cache.block_size,
                                   enable_prefix_caching=cache.enable_prefix_caching)
        scheduler = Scheduler(config.scheduler_config(), block_manager=self.blocks)
        scheduler.on_finish = self._on_finish  # a finished request's swapped K/V and generator go too
        self.scheduler = scheduler
        self.generator = torch.Generator(device=self.runner.device).manual_seed(config.seed)
        # The flat model's own greedy reduction where it has one (the same indices, faster).
        self.sampler = sampler or SimpleSampler(self.generator, getattr(self.flat, "greedy_tokens", None))
        self.generators: dict[str, torch.Generator] = {}
        # The front door: every request is checked (and n > 1 fanned out) before it is queued.
        self.processor = Processor(cfg.vocab_size, self.max_model_len, self.sampler, eos_token_id)
        # n > 1: parent id -> its ParentRequest, kept (so the ids stay reserved) while any child
        # lives; child id -> its parent, for those children.
        self.parents: dict[str, ParentRequest] = {}
        self.parent_of: dict[str, ParentRequest] = {}
        self.steps = 0

    @property
    def preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def observe(self, observer: Observer) -> None:
        """From the next step on, call ``observer(phase, result, seconds)`` after each of the step's
        phases: "schedule" (the plan), "prepare" (the Batch), "execute" (the logits) and "sample"
        (the tokens). See ``engine/serve/observer.py``; an engine never observed is not touched."""
        install_observer(self, observer)

    # ----- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, cache_key: tuple = (), arrival_time: float | None = None) -> list[str]:
        """Queue a request; returns the ids the engine will report under (n > 1 -> "{id}:{i}").

        ValueError, with nothing queued, for: an empty or non-integer prompt, token ids outside the
        vocabulary, prompt + max_tokens beyond ``max_model_len`` or a sampling feature the sampler
        cannot serve (``self.processor``), a duplicate id, or a request the pool can never hold.
        """
        parent, children = self.processor.process_inputs(request_id, prompt_token_ids, params, priority,
                                                         cache_key, arrival_time)
        self._check_ids_free(parent)
        for req in children:  # all or nothing: check every child before queueing any
            self.scheduler.check(req)
        for req in children:
            self.scheduler.add(req)
            if req.params.seed is not None:
                self.generators[req.request_id] = torch.Generator(device=self.runner.device).manual_seed(req.params.seed)
        if len(children) > 1:
            self.parents[request_id] = parent
            self.parent_of.update((rid, parent) for rid in parent.child_ids)
        return parent.child_ids

    @property
    def children(self) -> dict[str, list[str]]:
        """Each live n > 1 request's child ids, by parent id."""
        return {rid: parent.child_ids for rid, parent in self.parents.items()}

    def _check_ids_free(self, parent: ParentRequest) -> None:
        """ValueError if one of the ids ``parent`` reports under (or, for n > 1, its own) is in use."""
        ids = parent.child_ids
        for rid in ids + ([parent.request_id] if len(ids) > 1 else []):
            if rid in self.scheduler.requests or rid in self.parents or rid in self.parent_of:
                owner = self.parent_of.get(rid)
                raise ValueError(f"request id {rid!r} is already in use"
                                 + (f" (by n > 1 request {owner.request_id!r}, which is still running)" if owner else "")
                                 + "; pick a new id")

    def abort_request(self, request_id: str) -> None:
        """Abort a request (or all children of an n > 1 request); unknown or finished ids are ignored.

        A parent's child ids stay reserved until its last child finishes, so aborting the parent
        reaches its own children only, never a later request that took a finished child's id.
        """
        parent = self.parents.get(request_id)
        for rid in parent.child_ids if parent is not None else [request_id]:
            self.scheduler.abort(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _on_finish(self, request: Request) -> None:
        rid = request.request_id
        self.runner.drop(rid)
        self.generators.pop(rid, None)
        parent = self.parent_of.get(rid)
        if parent is not None and parent.child_finished():  # the last child frees its parent's ids
            del self.parents[parent.request_id]
            for child in parent.child_ids:
                del self.parent_of[child]

    # ----- the step ------------------------------------------------------------------------
    def check_stop(self, request: Request) -> Status | None:
        """The finished status ``request`` has reached, or None. (Your engine: Chapter 31)

        A request with no output token yet is never finished here: with zero outputs return None
        (its last token is a prompt token, whatever it is). Otherwise, checked in this order, on the
        request's last token:
        1. Only once the output has at least ``min_tokens`` tokens (exactly ``min_tokens`` is
           enough): a last token in ``stop_token_ids`` -> FINISHED_STOPPED with ``stop_reason``
           set to it (``ignore_eos`` does not switch these off, and an EOS listed there is a stop
           token too); else the EOS token, unless ``ignore_eos`` -> FINISHED_STOPPED, with no
           ``stop_reason``. The EOS token is the request's own ``request.eos_token_id`` (None: no
           EOS rule), not the engine's default ``self.eos_token_id``, which only seeds new requests.
        2. Otherwise, ``max_tokens`` outputs or ``max_model_len`` tokens in all -> FINISHED_LENGTH.
        The stop rules come first, so a stop token or EOS that is also the last token allowed
        finishes STOPPED, not LENGTH, and a stop token's stop_reason is kept. (vLLM V1's check_stop
        today also puts the stop rules first: min_tokens, then EOS, then stop_token_ids, then the
        length limits; only its first V1 releases tested the length first. Here a stop id is
        looked at before EOS, so an EOS that is also listed in stop_token_ids records its
        stop_reason.)
        """
        raise NotImplementedError("EngineCore.check_stop is a hole: fill it in (Chapter 31, engine/serve/engine.py)")

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass over every scheduled token, sample, and update the requests.
        (Your engine: Chapter 31)

        The chapter's order:
        1. ``plan = self.scheduler.schedule()``.
        2. The runner's copies, before the forward pass: every ``plan.swap_out`` (request, blocks)
           first, then every ``plan.swap_in``. If ``plan.scheduled`` is empty, return [] now
           (no forward pass: the step is not counted).
        3. ``batch = self.runner.prepare(plan.scheduled, self.blocks.req_blocks)``.
        4. ``logits = self.runner.execute(batch)``: the sample rows first, then the prompt-logprob
           rows.
        5. Sample: ``self.sampler(logits[:batch.num_sample_rows], reqs, self.generators)``, where
           ``reqs`` names each sample row's request (request r has ``batch.sample_counts[r]`` rows,
           0 or 1 here); it returns one token per row, so request r's token is the next
           ``batch.sample_counts[r]`` of them. The sampler runs in every step that ran a forward
           pass, also when no row samples (then with 0 rows and no requests: it returns []). ``self._prompt_logprobs(batch, logits[num_sample_rows:])``
           gives each request's prompt-logprob entries of this step.
        6. Update each scheduled (request, n), in plan order: advance ``num_computed_tokens`` by n;
           append its sampled token, if it had a sample row; if ``params.prompt_logprobs`` is set,
           write its entries into the list ``request.prompt_logprobs`` (None before the first;
           entry i scores prompt token i + 1; a one-token prompt has nothing to score, so its list
           becomes [] at its first step, not None) from index c on, c being ``num_computed_tokens``
           before this step — replacing the entries a recompute preemption made stale; publish
           its newly full blocks (``self.blocks.cache_full_blocks``); check a request that got a
           token for stop (``check_stop``) and finish one that stopped in the scheduler at once
           (freeing its blocks). Report, with ``self._output(request, new_tokens)``, each request
           that produced a token or finished (a mid-prompt chunk reports nothing); return those
           outputs.

        If anything in steps 2-5 raises (any BaseException: the forward pass ran out of memory,
        Ctrl-C), call ``self.recover_failed_step(plan)`` before letting the exception propagate,
        and count no step; otherwise ``self.steps += 1`` before step 6. The engine must be left
        as if a failed step never ran.
        """
        raise NotImplementedError("EngineCore.step is a hole: fill it in (Chapter 31, engine/serve/engine.py)")

    def recover_failed_step(self, plan: SchedulerOutput) -> None:
        """Undo what a step that raised before its bookkeeping left behind, so that a retry, an
        abort or a later request with the same prompt sees only K/V that was really computed.

        The scheduler published the step's blocks before the forward pass, which may have written
        some layers of them, or none: they are unpublished, and requests that adopted them
        compute them again (``BlockManager.unpublish_uncomputed``). A swap-out that did not
        complete turns into a recompute preemption; a swap-in that did not complete recomputes
        the request from its first token. No request advanced, so nothing else needs undoing —
        except that a failure inside the sampler itself may already have drawn from seeded
        requests' generators, whose later samples then differ from an uninterrupted run.
        """
        for req, _ in plan.swap_out:
            if req.swapped_out and req.request_id not in self.runner.swapped:
                req.swapped_out = False
                req.num_computed_tokens = 0
        for req, _ in plan.swap_in:
            if req.request_id in self.runner.swapped:  # its K/V never reached the pool
                self.runner.drop(req.request_id)
                req.num_computed_tokens = 0
        self.blocks.unpublish_uncomputed(req for req, _ in plan.scheduled)

    def _prompt_logprobs(self, batch, logits: torch.Tensor) -> dict[str, list[dict[int, float]]]:
        """Per request: for each predicted prompt token, {token: logprob} plus the top-k
        alternatives, with ranks (``engine/serve/logprobs.py``'s TokenLogprobs)."""
        result: dict[str, list[dict[int, float]]] = {}
        if logits.shape[0] == 0:
            return result
        logprobs = torch.log_softmax(logits, dim=-1)  # float32, or float64 for a float64 model
        row = 0
        for req, _, targets in batch.prompt_spans:
            k = req.params.prompt_logprobs
            for t in targets:
                result.setdefault(req.request_id, []).append(token_logprobs(logprobs[row], int(t), k))
                row += 1
        return result

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        reason = req.status.finish_reason  # None while the request runs
        finished = reason is not None
        new_logprobs = None
        if req.params.logprobs is not None and req.logprobs is not None:
            n = req.num_output_tokens
            new_logprobs = req.logprobs[n - len(new):n]
        return RequestOutput(
            req.request_id, new, req.output_token_ids, finished, reason, req.stop_reason,
            req.num_cached_tokens, req.prompt_logprobs if finished else None, new_logprobs)

    def run_until_done(self, max_steps: int = 1_000_000) -> dict[str, list[int]]:
        """Step until idle; returns every finished request's output tokens by id."""
        done: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.has_unfinished():
                return done
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
        stuck = ", ".join(f"{r.request_id!r} ({r.status.name}, {r.num_computed_tokens}/{r.num_tokens} computed)"
                          for r in self.scheduler.requests.values())
        raise RuntimeError(f"engine still busy after {max_steps} steps; these requests never finish: {stuck}")
