"""Chapter 24: continuous batching with one static KV-cache row per request.

``SlotEngine`` keeps, for every layer, a K and a V tensor of shape
``[num_slots, max_len, kv_heads, head_dim]``, allocated once. A request that gets admitted takes
a whole row (a *slot*) and keeps it until it finishes; the next waiting request moves in at the
following step. Every ``step()`` admits waiting requests into free slots (first come, first
served), runs one forward pass per request that is still prefilling, runs one batched forward
pass for all requests that are decoding, and samples the next token of every request that needs
one. Requests join and leave the batch at token granularity — that is what chapter 24 meant by
continuous batching, and it already beats batching whole requests together.

This is the "before" picture of chapter 31. Where the memory and the time go:

* Memory is reserved, not used. A slot holds ``max_len`` positions whatever the request needs:
  a 60-token exchange in a 320-token row leaves more than four fifths of its row empty, and no
  other request can borrow that space. The number of requests that can run at once is fixed by
  the longest request we are willing to accept, not by the tokens actually in flight.
* Nothing is shared. Sixteen requests with the same system prompt compute and store its K/V
  sixteen times, because each row belongs to exactly one request.
* Prefills run one request per forward pass. Each prompt (or prompt chunk) is its own call with
  its own small matmuls, on top of the decode call, so a step that admits four requests makes
  five passes through every weight instead of one.
* Decodes gather each row's whole history up to the longest row in the batch and mask the rest:
  short rows pay for the long ones.

Chapter 31 removes all of these: a block pool shared by every request, a prefix cache, and one
flattened batch per step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from engine.attention import causal_attention
from engine.models.layers import add_norm
from engine.precision import work_dtype
from engine.rope import rope_cos_sin
from engine.sampling import sample_token

# An entry of ``SlotEngine._slots`` when no request occupies that row.
FREE_SLOT = None


@dataclass
class SlotOutput:
    """What one request got out of one ``step()``.

    ``new_token_ids`` holds the token sampled this step (one per step in this engine; a list so
    it reads like the core's ``RequestOutput``); ``output_token_ids`` is everything the request
    has produced so far, this token included. ``finish_reason`` is "stop" (EOS), "length"
    (max_tokens) or "abort", and None while the request is still running.
    """

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


@dataclass(eq=False)
class _SlotRequest:
    """One request's state inside the engine.

    Invariant while it holds a slot: row ``slot`` of every layer's cache holds the K/V of
    ``token_ids[:num_computed_tokens]`` at positions 0..num_computed_tokens-1. Once the prompt is
    done, the newest token is never computed: ``num_computed_tokens == len(token_ids) - 1``.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    slot: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One new query per row against that row's own cached keys.

    q: [B, Hq, D]; k, v: [B, L, Hkv, D] (the rows' caches cut at the longest row); seq_lens [B]:
    row b's query sits at position seq_lens[b] - 1 and may see keys 0..seq_lens[b] - 1 (and only
    the last ``window`` of them when window > 0). Keys past a row's length are another request's
    leftovers or zeros and must be masked. Same arithmetic as chapter 5's ``causal_attention``:
    scores and softmax in float32 (float64 for float64 inputs), result in q's dtype.
    """
    b, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    work = work_dtype(q.dtype)
    # Query head h reads kv head h // group, so split the query heads as [Hkv, group].
    qg = q.to(work).view(b, hkv, group, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k.to(work)) * scale  # [B, Hkv, G, L]
    k_pos = torch.arange(k.shape[1], device=q.device)  # [L]
    q_pos = (seq_lens - 1).to(q.device)  # [B]
    visible = k_pos[None, :] <= q_pos[:, None]  # [B, L]
    if window > 0:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v.to(work))  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


class SlotEngine:
    """Continuous batching over a fixed set of static cache rows.

    Invariants: a slot holds at most one request and a running request holds exactly one slot;
    ``num_free_slots + len(running) == num_slots``; every admitted request fits its row
    (prompt + max_tokens <= max_len, checked in ``add_request``), so admission only ever waits
    for a free slot, never for memory. Waiting requests are admitted in arrival order.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int = 8,
        max_len: int = 320,
        prefill_chunk: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        cfg = model.cfg
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_len ({max_len}) exceeds the model's max_position_embeddings "
                f"({cfg.max_position_embeddings}): lower max_len")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be None (whole prompts) or >= 1, got {prefill_chunk}")
        self.model = model
        self.cfg = cfg
        self.num_slots = num_slots
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.eos_token_id = eos_token_id
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        # Reserved up front for the worst case: every slot at max_len, in every layer.
        shape = (num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim)  # [S, L, Hkv, Dh]
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                        for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                        for _ in range(cfg.num_hidden_layers)]
        self._slots: list[_SlotRequest | None] = [FREE_SLOT] * num_slots
        self.waiting: deque[_SlotRequest] = deque()
        self.running: list[_SlotRequest] = []  # in admission order
        self.steps = 0  # step() calls that did work
        self.forward_calls = 0  # passes through the model (prefills + batched decodes)

    # ------------------------------------------------------------------ requests
    @property
    def kv_slots(self) -> int:
        """Token positions reserved for K/V, used or not: num_slots * max_len."""
        return self.num_slots * self.max_len

    @property
    def num_free_slots(self) -> int:
        return sum(r is FREE_SLOT for r in self._slots)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        ignore_eos: bool = False,
        temperature: float = 0.0,
        seed: int | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> None:
        """Queue a request; it is admitted into a free slot by a later ``step()``.

        temperature 0 is greedy; otherwise chapter 8's sampling with top_k (0 = no limit) and
        top_p, from a private generator when ``seed`` is given.
        """
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; give at least one token")
        if request_id in self._unfinished_ids():
            raise ValueError(f"request id {request_id!r} is already waiting or running; use a new id")
        vocab = self.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        if len(prompt) + max_tokens > self.max_len:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                f"exceeds a slot's max_len ({self.max_len}); shorten it or build the engine with a "
                f"larger max_len")
        if temperature < 0:
            raise ValueError(f"request {request_id!r}: temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k < 0:
            raise ValueError(f"request {request_id!r}: top_k must be >= 0 (0 = no limit), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"request {request_id!r}: top_p must be in (0, 1], got {top_p}")
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting.append(_SlotRequest(
            request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens,
            ignore_eos=ignore_eos, temperature=float(temperature), top_k=top_k, top_p=top_p,
            generator=generator, token_ids=list(prompt)))

    def abort_request(self, request_id: str) -> None:
        """Drop a waiting or running request; its slot is free for the next step."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                return
        for req in self.running:
            if req.request_id == request_id:
                self._free(req)
                return
        raise ValueError(f"no waiting or running request with id {request_id!r}")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _unfinished_ids(self) -> set[str]:
        return {r.request_id for r in self.waiting} | {r.request_id for r in self.running}

    def _free(self, req: _SlotRequest) -> None:
        # The row is not cleared: the next owner overwrites positions before it reads them, and
        # decode attention masks everything past a row's length.
        assert req.slot is not None and self._slots[req.slot] is req
        self._slots[req.slot] = FREE_SLOT
        req.slot = None
        self.running.remove(req)

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self) -> list[SlotOutput]:
        """Admit, prefill (one pass per request), decode (one batched pass), sample, retire.

        Returns one output per request that produced a token this step; a prefill chunk that
        stops short of the prompt's end produces nothing.
        """
        self._admit()
        if not self.running:
            return []
        self.steps += 1
        # Decided before any prefill runs: a request whose prompt completes this step samples its
        # first token from the prefill pass and joins the decodes next step.
        decoding = [r for r in self.running if not r.prefilling]
        prefilling = [r for r in self.running if r.prefilling]
        outputs: list[SlotOutput] = []
        for req in prefilling:
            c = req.num_computed_tokens
            n = req.num_prompt_tokens - c
            if self.prefill_chunk is not None:
                n = min(n, self.prefill_chunk)
            logits = self._prefill(req, c, n)  # [V] or None mid-prompt
            req.num_computed_tokens = c + n
            if logits is not None:
                outputs.append(self._accept(req, self._sample(req, logits)))
        if decoding:
            logits = self._decode(decoding)  # [B, V]
            for req, row in zip(decoding, logits):
                req.num_computed_tokens += 1
                outputs.append(self._accept(req, self._sample(req, row)))
        assert self.num_free_slots + len(self.running) == self.num_slots, "a slot leaked"
        return outputs

    def run_to_completion(self) -> dict[str, list[int]]:
        """Step until nothing is left; each finished request's output token ids by request id."""
        results: dict[str, list[int]] = {}
        while self.has_unfinished():
            for out in self.step():
                results.setdefault(out.request_id, []).extend(out.new_token_ids)
        return results

    def _admit(self) -> None:
        for slot, occupant in enumerate(self._slots):
            if not self.waiting:
                break
            if occupant is FREE_SLOT:
                req = self.waiting.popleft()
                req.slot = slot
                self._slots[slot] = req
                self.running.append(req)

    def _sample(self, req: _SlotRequest, logits: torch.Tensor) -> int:
        if req.temperature == 0.0:
            # argmax in the logits' own precision, as generate() does (sample_token would cast
            # float64 logits to float32 first).
            return int(torch.argmax(logits))
        return sample_token(logits, req.temperature, req.top_k, req.top_p, req.generator)

    def _accept(self, req: _SlotRequest, token: int) -> SlotOutput:
        req.token_ids.append(token)
        reason = None
        if not req.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id:
            reason = "stop"
        elif req.num_output_tokens >= req.max_tokens:
            reason = "length"
        if reason is not None:
            self._free(req)
        return SlotOutput(req.request_id, [token], req.output_token_ids, reason is not None, reason)

    # ------------------------------------------------------------------ model passes
    def _run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The model's decoder loop (``Qwen3Model.run_layers``) on rows [N]; ``attend(layer_idx, q,
        k, v)`` stores this pass's K/V and returns the attention output [N, Hq, Dh]. Returns the
        final-normed hidden states [N, D]."""
        m = self.model.model
        h = m.embed_tokens(input_ids)  # [N, D]
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)  # [N, Dh] each

        def attention(i: int, attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
            o = attend(i, *attn.qkv(x, cos, sin))  # q [N, Hq, Dh], k and v [N, Hkv, Dh] -> [N, Hq, Dh]
            return attn.o_proj(o.reshape(o.shape[0], -1))

        h, residual = m.run_layers(h, cos, sin, attention)
        self.forward_calls += 1
        return add_norm(h, residual, m.norm)[0]

    def _prefill(self, req: _SlotRequest, c: int, n: int) -> torch.Tensor | None:
        """Compute prompt positions c..c+n-1 of one request in its own pass. Returns the logits
        [V] of the prompt's last token when this chunk reaches it, else None."""
        slot = req.slot
        ids = torch.tensor(req.token_ids[c:c + n], dtype=torch.long, device=self.device)  # [n]
        pos = torch.arange(c, c + n, device=self.device)  # [n]
        k_pos = torch.arange(c + n, device=self.device)  # [c+n]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k_cache[i][slot, c:c + n] = k
            self.v_cache[i][slot, c:c + n] = v
            keys = self.k_cache[i][slot, :c + n]  # [c+n, Hkv, Dh]: earlier chunks + this one
            values = self.v_cache[i][slot, :c + n]
            return causal_attention(q, keys, values, pos, k_pos,
                                    scale=self.model.model.layers[i].self_attn.scale,
                                    window=self.cfg.sliding_window)

        h = self._run_layers(ids, pos, attend)  # [n, D]
        if c + n < req.num_prompt_tokens:
            return None
        return self.model.compute_logits(h[-1:])[0]

    def _decode(self, reqs: list[_SlotRequest]) -> torch.Tensor:
        """One pass for every decoding request: each feeds its newest token. Returns [B, V]."""
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.long, device=self.device)  # [B]
        ids = torch.tensor([r.token_ids[-1] for r in reqs], dtype=torch.long, device=self.device)
        pos = torch.tensor([r.num_computed_tokens for r in reqs], dtype=torch.long, device=self.device)
        seq_lens = pos + 1  # [B]: each row's context after this token is written
        width = int(seq_lens.max())  # gather only up to the longest row, not max_len

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k_cache[i][slots, pos] = k  # one [Hkv, Dh] entry per row
            self.v_cache[i][slots, pos] = v
            keys = self.k_cache[i][slots, :width]  # [B, width, Hkv, Dh]
            values = self.v_cache[i][slots, :width]
            return _decode_attention(q, keys, values, seq_lens,
                                     self.model.model.layers[i].self_attn.scale,
                                     self.cfg.sliding_window)

        h = self._run_layers(ids, pos, attend)  # [B, D]
        return self.model.compute_logits(h)
