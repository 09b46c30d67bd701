"""EngineCore: one scheduler, one block pool, one flattened forward pass per step."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.serve.attention import get_backend
from engine.serve.blocks import BlockManager
from engine.serve.flat import FlatModel
from engine.serve.params import SamplingParams
from engine.serve.request import Request, Status
from engine.serve.runner import ModelRunner
from engine.serve.sampler import SimpleSampler
from engine.serve.scheduler import Scheduler, SchedulerConfig
from engine.serve.sizing import kv_bytes_per_block, num_blocks_for_memory, profile_num_blocks

SAMPLERS = ("simple", "full")


@dataclass
class EngineConfig:
    """Every knob of the engine core; ``scheduler_config()`` extracts the scheduler's part.

    ``num_blocks=None`` sizes the pool from memory: ``kv_cache_bytes`` on a CPU, profiling plus
    ``gpu_memory_utilization`` on CUDA. ``max_model_len=None`` means the model's
    ``max_position_embeddings``. ``attention_backend``: "torch" (vectorized, the default),
    "reference" (the chapter's Python loop, the oracle), "cpu" (decode attention read in place
    by a C++ kernel) or "triton" (chapter 32, GPU).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 128 * 2**20  # 16,384 tokens of the bench's small model in float32: no bench workload preempts
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    attention_backend: str = "torch"
    max_model_len: int | None = None
    seed: int = 0
    sampler: str = "simple"
    fuse_ops: bool = False  # run the model through FusedFlatModel (merged projections, fused elementwise ops)

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")

        positive("block_size")
        positive("kv_cache_bytes")
        positive("max_num_batched_tokens")
        positive("max_num_seqs")
        for flag in ("enable_chunked_prefill", "enable_prefix_caching", "fuse_ops"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"EngineConfig.{flag} must be True or False, got {getattr(self, flag)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"EngineConfig.seed must be an integer, got {self.seed!r}")
        if self.num_blocks is not None:
            positive("num_blocks")
        if self.max_model_len is not None:
            positive("max_model_len")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0.0 < util <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}: choose one of {SAMPLERS}")
        self.scheduler_config()  # validates budget, max_num_seqs, threshold, policy, preemption mode

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.policy, preemption_mode=self.preemption_mode)


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


class EngineCore:
    """The chapter's engine: add requests, call ``step()`` until ``has_unfinished()`` is False.

    Owns ``runner`` (model + pools), ``blocks`` (BlockManager), ``scheduler`` and ``sampler``.
    ``steps`` counts steps that ran a forward pass; ``preemptions`` counts preemptions.
    """

    def __init__(self, model: nn.Module, config: EngineConfig | None = None,
                 eos_token_id: int | None = None, sampler: SimpleSampler | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model = model
        self.eos_token_id = eos_token_id
        if config.fuse_ops:
            from engine.serve.fused import FusedFlatModel

            self.flat = FusedFlatModel(model)
        else:
            self.flat = FlatModel(model)
        cfg = model.cfg
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"{cfg.max_position_embeddings} positions")
        if config.sampler == "full":
            raise ValueError("sampler='full' is chapter 34's sampler, not part of this chapter; use 'simple'")
        backend = get_backend(config.attention_backend)
        num_blocks = config.num_blocks or self._size_pool(backend)
        self.runner = ModelRunner(self.flat, backend, num_blocks, config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks)
        self.scheduler.on_finish = self._on_finish
        self.generator = torch.Generator(device=self.flat.device).manual_seed(config.seed)
        self.sampler = sampler or SimpleSampler(self.generator)
        self.generators: dict[str, torch.Generator] = {}
        self.children: dict[str, list[str]] = {}  # parent id -> child ids for n > 1
        self.steps = 0

    # ----- set-up --------------------------------------------------------------------------
    def _size_pool(self, backend) -> int:
        layers, kv_heads, head_dim = self.flat.kv_spec()
        bs = self.config.block_size
        per_block = kv_bytes_per_block(layers, kv_heads, head_dim, bs, self.flat.dtype)
        if self.flat.device.type != "cuda":
            return num_blocks_for_memory(self.config.kv_cache_bytes, layers, kv_heads, head_dim, bs, self.flat.dtype)

        def run_max_step() -> None:
            # One request filling the whole budget, against a pool just big enough for it.
            n = min(self.config.max_num_batched_tokens, self.max_model_len)
            dummy = ModelRunner(self.flat, backend, -(-n // bs), bs)
            req = Request("profile", [0] * n, SamplingParams(max_tokens=1))
            batch = dummy.prepare([(req, n)], [list(range(-(-n // bs)))])
            dummy.execute(batch)
            del dummy

        return profile_num_blocks(run_max_step, per_block, self.config.gpu_memory_utilization, self.flat.device)

    @property
    def preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ----- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, cache_key: tuple = (), arrival_time: float | None = None) -> list[str]:
        """Queue a request; returns the ids the engine will report under (n > 1 -> "{id}:{i}").

        ValueError, with nothing queued, for: an empty or non-integer prompt, token ids outside the
        vocabulary, a duplicate id, prompt + max_tokens beyond ``max_model_len`` or the pool, or a
        sampling feature the sampler cannot serve.
        """
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a list of token ids (ints), "
                             f"got {type(prompt_token_ids).__name__}; tokenize text first")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; give at least one token")
        vocab = self.model.cfg.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"request {request_id!r}: token ids must be ints, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"request {request_id!r}: token id {t} is outside the vocabulary [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens")
        if not isinstance(cache_key, tuple):
            raise ValueError(f"cache_key must be a tuple, got {type(cache_key).__name__}")
        # Both end up in the queues' sort keys: a value that can't be compared would fail mid-step.
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"request {request_id!r}: priority must be an int (lower runs first), got {priority!r}")
        if arrival_time is not None and (not isinstance(arrival_time, (int, float)) or isinstance(arrival_time, bool)
                                         or not math.isfinite(arrival_time)):
            raise ValueError(f"request {request_id!r}: arrival_time must be a finite number of seconds "
                             f"(time.monotonic()) or None, got {arrival_time!r}")
        self.sampler.check(params)
        ids = [request_id] if params.n == 1 else [f"{request_id}:{i}" for i in range(params.n)]
        for rid in ids + ([request_id] if params.n > 1 else []):
            if rid in self.scheduler.requests or rid in self.children:
                raise ValueError(f"request id {rid!r} is already in use; pick a new id")
        reqs = []
        for i, rid in enumerate(ids):
            child = SamplingParams(**{**params.__dict__, "n": 1,
                                      "seed": None if params.seed is None else params.seed + i})
            reqs.append(Request(rid, prompt, child, self.eos_token_id, priority, cache_key=cache_key,
                                **({} if arrival_time is None else {"arrival_time": arrival_time})))
        for req in reqs:  # all or nothing: check every child before queueing any
            self.scheduler.check(req)
        for req in reqs:
            self.scheduler.add(req)
            if req.params.seed is not None:
                self.generators[req.request_id] = torch.Generator(device=self.flat.device).manual_seed(req.params.seed)
        if params.n > 1:
            self.children[request_id] = ids
        return ids

    def abort_request(self, request_id: str) -> None:
        """Abort a request (or all children of an n > 1 request); unknown or finished ids are ignored."""
        for rid in self.children.get(request_id, [request_id]):
            self.scheduler.abort(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _on_finish(self, request: Request) -> None:
        self.runner.drop(request.request_id)
        self.generators.pop(request.request_id, None)
        for parent, ids in list(self.children.items()):
            if request.request_id in ids and all(i not in self.scheduler.requests for i in ids):
                del self.children[parent]

    # ----- the step ------------------------------------------------------------------------
    def check_stop(self, request: Request) -> Status | None:
        """The finished status ``request`` has reached, or None. (Your engine: Chapter 31)

        Only once the output has at least ``min_tokens`` tokens: a last token in
        ``stop_token_ids`` -> FINISHED_STOPPED with ``stop_reason`` set to it; the EOS token
        (unless ``ignore_eos``) -> FINISHED_STOPPED. Otherwise, ``max_tokens`` outputs or
        ``max_model_len`` tokens in all -> FINISHED_LENGTH.
        """
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

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass over every scheduled token, sample, and book-keep.
        (Your engine: Chapter 31)

        Order: ``scheduler.schedule()``; the runner's swap-outs, then swap-ins; one batch from
        every (request, n) with its block table; one forward; sample the rows that need it.
        Then each scheduled request advances ``num_computed_tokens`` by n, appends its sample (if
        it had a sample row), publishes its newly full blocks, and is checked for stop — a
        finished request is finished in the scheduler at once, freeing its blocks. Returns one
        RequestOutput per request that produced a token or finished (a mid-prompt chunk reports
        nothing).
        """
        plan = self.scheduler.schedule()
        for req, blocks in plan.swap_out:
            self.runner.swap_out(req, blocks)
        for req, blocks in plan.swap_in:
            self.runner.swap_in(req, blocks)
        if plan.empty:
            return []
        batch = self.runner.prepare(plan.scheduled, self.blocks.req_blocks)  # tables looked up by id
        logits = self.runner.execute(batch)  # [sample rows + prompt-logprob rows, V]
        self.steps += 1

        sample_reqs = [req for (req, _), k in zip(plan.scheduled, batch.sample_counts) for _ in range(k)]
        num_sample = batch.num_sample_rows
        tokens = self.sampler(logits[:num_sample], sample_reqs, self.generators)
        prompt_lp = self._prompt_logprobs(batch, logits[num_sample:])

        outputs: list[RequestOutput] = []
        row = 0
        for (req, n), k in zip(plan.scheduled, batch.sample_counts):
            start = req.num_computed_tokens
            req.num_computed_tokens += n
            new = tokens[row:row + k]
            row += k
            if k > 1:  # a verification span (drafts, chapter 37): keep drafts while they match
                drafts, accepted = req.spec_token_ids, [new[0]]
                for j, d in enumerate(drafts[:k - 1]):
                    if d != new[j]:
                        break
                    accepted.append(new[j + 1])
                new = accepted
            if req.spec_token_ids:
                req.spec_token_ids = []
            for t in new:
                req.append(t)
            if req.num_computed_tokens > req.num_tokens - 1:  # rejected drafts' K/V are not kept
                req.num_computed_tokens = req.num_tokens - 1
                self.blocks.trim(req, req.num_computed_tokens + 1)
            if req.params.prompt_logprobs is not None:
                # Entry i scores prompt token i + 1, so this span's entries start at its first
                # position; after a recompute preemption they replace the earlier ones.
                lps = req.extra.setdefault("prompt_logprobs", [])
                del lps[start:]
                lps.extend(prompt_lp.get(req.request_id, []))
            self.blocks.cache_full_blocks(req)
            status = self.check_stop(req) if new else None
            if status is not None:
                self.scheduler.finish(req, status)
            if new or status is not None:
                outputs.append(self._output(req, new))
        return outputs

    def _prompt_logprobs(self, batch, logits: torch.Tensor) -> dict[str, list[dict[int, float]]]:
        """Per request: for each predicted prompt token, {token: logprob} plus the top-k alternatives."""
        result: dict[str, list[dict[int, float]]] = {}
        if logits.shape[0] == 0:
            return result
        logprobs = torch.log_softmax(logits, dim=-1)  # float32, or float64 for a float64 model
        row = 0
        for req, _, targets in batch.prompt_spans:
            k = req.params.prompt_logprobs
            for t in targets:
                entry = {int(t): float(logprobs[row, t])}
                if k:
                    top = torch.topk(logprobs[row], k)
                    entry.update({int(i): float(v) for v, i in zip(top.values, top.indices)})
                result.setdefault(req.request_id, []).append(entry)
                row += 1
        return result

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        reason = req.status.finish_reason  # None while the request runs
        finished = reason is not None
        return RequestOutput(
            req.request_id, new, req.output_token_ids, finished, reason, req.stop_reason,
            req.num_cached_tokens, req.extra.get("prompt_logprobs") if finished else None)

    def run_until_done(self, max_steps: int = 1_000_000) -> dict[str, list[int]]:
        """Step until idle; returns every finished request's output tokens by id."""
        done: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.has_unfinished():
                return done
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
        raise RuntimeError(f"engine still busy after {max_steps} steps")
