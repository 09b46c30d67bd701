"""FusedFlatModel: the flat forward pass in fewer, larger operations (``EngineConfig(flat_model="fused")``).

``FlatModel`` drives the model's own modules one by one: three projections for q, k and v, two
for gate and up, a norm and a RoPE for q and another for k. Each is a separate pass over memory
and, on a CPU, a few microseconds of dispatch. This class serves the same computation with:

- one ``[D, (Hq + 2 Hkv) Dh]`` matmul for q, k and v, and one for gate and up (merged weights,
  built once at start-up);
- q and k normalised and rotated together, as one ``[N, Hq + Hkv, Dh]`` tensor, their cos and sin
  rows looked up in a table of ``rope_cos_sin``'s rows (``RopeTable``) rather than computed each step;
- SiLU and the gate product done in place on the merged output, or, with a gate/up linear in the amx
  layout (bfloat16) or the small layout's 16-float kernel (float32), as its outputs are written
  out: ``cpu_linear_amx.AmxLinear(gated=True)``, ``cpu_linear.SmallLinear(gated=True)``, the same
  bits as the separate steps, without the [N, 2I] intermediate;
- on a CPU, each weight shape in the layout measured fastest for it at load time
  (``linear_layout.choose``): prepacked for oneDNN's matmul (float32, or bfloat16 with bf16 units)
  or, in float32, in ``cpu_linear``'s small-batch kernel's panels, or, in bfloat16 on a CPU with
  AMX, in ``cpu_linear_amx``'s tiles;
- ONE resident copy of every weight: each linear keeps only the layout its kernel reads
  (``Linear``), built once here, and every row count goes through it. The merged q/k/v and
  gate/up tensors are temporaries on the way to that layout (or, where the layout is the plain
  tensor, the model's own parameters become views of them); the model's originals,
  memory-mapped from the checkpoint by ``load_model``, hand their resident pages back once read
  (``engine.models.mapped``) and stay valid for ``generate()``. A tied LM head keeps the
  embedding's own plain tensor or, measured faster, a layout of its own (``embed`` then reads the
  lookups from its panels or tiles, or from the embedding's pages of the tokens looked up);
- on a CPU in float32 or bfloat16, each seam's elementwise work (residual add + norm, q/k norm +
  RoPE, SiLU-mul) as one call of ``cpu_elementwise``'s kernels instead of ~25 PyTorch operations a
  layer (in bfloat16 rounding where those operations round; AVX-512 wide where the CPU has it),
  writing into buffers reused by every layer (``_scratch``: no fresh memory per call);
- on a CPU, greedy rows reduced by ``cpu_greedy``'s one-pass argmax (``greedy_tokens``, which the
  engine hands to its sampler: the same indices as ``sampler.greedy_tokens``);
- the last layer past its K/V write only on the rows whose logits are needed (``keep_rows``: the
  batch's ``logits_indices``). Nothing reads the other rows' last hidden state, so a prefill step
  skips a quarter of the attention and ~20% of the matmuls of a 4-layer model with the same results.

Float64 results are those of ``FlatModel`` up to summation order (tests check the engine against
``generate()`` token for token); float32 ones differ from it by summation order too (oneDNN's
blocking, or the small kernel's), which the bench's agreement column checks on every workload.
Its ``linear_dtype`` is the dtype the matmuls run in:
the model's own, except for a 16-bit model on a CPU without bfloat16/float16 matmul units (no
AVX512-BF16 / AMX), where PyTorch's 16-bit matmul is several times slower than float32's: there
the matmuls run in float32 and activations stay float32 between them, while the K/V pool keeps
the model's dtype. A bfloat16 model's weights then stay bfloat16 where the small kernel's panels
hold them (``linear_layout.held_dtype``: widened exactly in registers, so the products are those
of float32 copies, from half the bytes; at Qwen3-0.6B's shape a lone request's decode step
reads them at the memory roofline, ``docs/performance.md``); a layout of oneDNN's holds a
float32 copy. That path computes more precisely than a native 16-bit one (so its greedy tokens
drift less from float32).
MoE layers run their own block unchanged.
"""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import Qwen3MLP
from engine.models.mapped import drop_pages, releasable, release_pages, trim_heap
from engine.precision import work_dtype
from engine.rope import RopeTable
from engine.serve.attention import AttentionBackend, KVCache
from engine.fast import cpu_elementwise, cpu_greedy, cpu_linear, cpu_linear_amx, linear_layout
from engine.fast.linear_layout import Linear
from engine.serve.batch import Batch, BatchMeta
from engine.serve.flat import FlatModel
from engine.serve.sampler import greedy_tokens

EMBED_DROP_ROWS = 2048  # embedding rows looked up between two hand-backs of its pages (``embed``)

SCRATCH_VIEWS = 1024  # views of the scratch buffers kept for reuse (one per output name and step shape)


def _check_rows(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], layer: int, name: str) -> None:
    """ValueError unless ``t`` (layer ``layer``'s ``name``) is a contiguous ``dtype`` tensor of
    ``shape``: what a kernel is handed by its data pointer."""
    if not t.is_contiguous() or t.dtype != dtype or t.shape != shape:
        raise ValueError(f"layer {layer}: {name} {t.dtype} {tuple(t.shape)} is not a contiguous {dtype} "
                         f"[{', '.join(map(str, shape))}]")


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can prepack a linear weight of this dtype here (CPU float32, or bfloat16 on
    a CPU with bf16 units): the layout vLLM's CPU backend also uses."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and fast_16bit_matmul(dtype, device))


def merged(parts: list[torch.Tensor]) -> torch.Tensor:
    """The row-wise concatenation of ``parts`` (2-D, same width and dtype): a view when they
    already lie one after the other in one storage (a model merged before), else a new tensor."""
    first = parts[0]
    rows, width = sum(p.shape[0] for p in parts), first.shape[1]
    at = first.storage_offset()
    adjacent = all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   for p in parts)
    for p in parts:
        adjacent = adjacent and p.storage_offset() == at
        at += p.numel()
    if adjacent:
        return first.as_strided((rows, width), (width, 1))
    return torch.cat(parts)


def share_rows(whole: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Point each parameter of ``params`` at its rows of ``whole`` (their concatenation), so the
    model and the fused path share one copy; values are unchanged, the Parameter objects too."""
    at = 0
    for p in params:
        rows = p.shape[0]
        if p.data_ptr() != whole[at:at + rows].data_ptr():
            p.data = whole[at:at + rows]
        at += rows


def attend_rows(backend: AttentionBackend, q: torch.Tensor, cache: KVCache, meta: BatchMeta, rows: torch.Tensor,
                scale: float, window: int) -> torch.Tensor:
    """Attention of the batch's rows ``rows`` only: q [N, Hq, Dh] -> [M, Hq, Dh]. Through the
    backend's ``forward_rows`` where it has one, else every row and then the selection."""
    forward_rows = getattr(backend, "forward_rows", None)
    if forward_rows is not None:
        return forward_rows(q, cache, meta, rows, scale=scale, window=window)
    return backend.forward(q, cache, meta, scale=scale, window=window).index_select(0, rows)


def fast_16bit_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether 16-bit matmuls in ``dtype`` run on native units here (any CUDA device; on a CPU,
    oneDNN's bfloat16 / float16 support, i.e. AVX512-BF16, AVX512-FP16 or AMX)."""
    if device.type != "cpu":
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def numerics_note(dtype: torch.dtype, linear_dtype: torch.dtype) -> str | None:
    """What a user must be told when a 16-bit model's matmuls run in ``linear_dtype`` = float32
    (a CPU without 16-bit matmul units, where that is faster): it is computed more precisely than
    generate() computes it, so its greedy tokens may differ from generate()'s, and from a CPU with
    those units. None when the matmuls run in the model's own dtype (the tokens are generate()'s)."""
    if linear_dtype == dtype or dtype not in (torch.bfloat16, torch.float16):
        return None
    return (f"{str(dtype).removeprefix('torch.')} model, matmuls in {str(linear_dtype).removeprefix('torch.')} "
            "(no 16-bit matmul units here): greedy tokens may differ from generate()'s")


def default_linear_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the fused model's matmuls run in by default: the model's own where its
    matmuls have native units here, else float32."""
    return dtype if fast_16bit_matmul(dtype, device) else torch.float32


class FusedFlatModel(FlatModel):
    """FlatModel with merged projections and fused elementwise work; same contract, plus
    ``forward(..., keep_rows=rows)``, which returns only those rows' final hidden states.

    Invariant: ``layers[i]`` holds layer i's merged weights, built from the model's modules at
    construction, each in one layout (weights changed later are not seen, except by a plain
    layout, which IS the model's storage). The model's values are not modified; where the layout
    is plain its q/k/v and gate/up parameters become views of the merged tensors (one copy), and
    file-backed originals hand their pages back (``release_pages``).
    """

    def __init__(self, model: nn.Module, linear_dtype: torch.dtype | None = None, pack: bool | None = None,
                 layout: str | None = None, elementwise: bool | None = None, fuse_silu: bool = True) -> None:
        super().__init__(model)
        dtype, device = self.dtype, self.device
        if linear_dtype is None:
            linear_dtype = default_linear_dtype(dtype, device)
        self.linear_dtype = linear_dtype
        self.numerics = numerics_note(dtype, linear_dtype)
        self.pack = packable(linear_dtype, device) if pack is None else pack
        linear_layout.forced_layout(layout)  # a bad name: ValueError before anything is built
        # The small-batch kernel's panels: float32 arithmetic on CPU, where the kernel builds (a
        # bfloat16 model's panels keep its 16-bit values: linear_layout.held_dtype).
        small = linear_dtype == torch.float32 and device.type == "cpu" and cpu_linear.library() is not None
        # The AMX kernel's tiles: bfloat16 arithmetic on a CPU with AMX-BF16 (cpu_linear_amx).
        amx = linear_dtype == torch.bfloat16 and device.type == "cpu" and cpu_linear_amx.available()
        # Each linear's candidate layouts, the reference (kept on a near-tie) first; a shape the
        # AMX kernel does not take (out features not a multiple of 16, in features of 32) goes without.
        candidates = ((("packed",) if self.pack else ()) + (("small",) if small else ()) + (("amx",) if amx else ())
                      or ("plain",))
        if elementwise is None:  # float32 or bfloat16 on a CPU where the elementwise kernels build
            elementwise = (linear_dtype in cpu_elementwise.DTYPES and device.type == "cpu"
                           and cpu_elementwise.library() is not None)
        self.elementwise = elementwise
        # The q/k norm and RoPE kernel takes heads up to cpu_elementwise.MAX_HEAD_DIM: larger ones
        # keep the PyTorch code (the other two seams still take their kernels).
        self.qk_elementwise = elementwise and cpu_elementwise.takes_head_dim(self.cfg.head_dim)
        # With all three seams' kernels: each layer calls them directly (``_forward_kernels``); False
        # sends the same calls through ``_add_norm`` & co. (tests check the two give the same bits).
        self.direct_seams = True
        cast = linear_dtype != dtype
        self.choices: dict[tuple[int, int], linear_layout.Choice] = {}  # per weight shape [out, in]

        def choose(n: int, k: int, among: tuple[str, ...], rows: tuple[int, ...]) -> linear_layout.Choice:
            choice = linear_layout.choose(n, k, linear_dtype, among, layout, weight_dtype=dtype, rows=rows)
            self.choices[(n, k)] = choice
            return choice

        def linear(params: list[nn.Parameter], among: tuple[str, ...] = candidates,
                   rows: tuple[int, ...] = linear_layout.PROBE_ROWS, gate_up: bool = False) -> Linear:
            """One Linear over ``params``' rows in the layout chosen for its shape, made without
            keeping a second copy: plain, the model's parameters become views of the merged
            tensor; otherwise the merged tensor is a temporary, and the model's file-backed
            originals hand their pages back. ``gate_up``: a SwiGLU gate/up pair, which the amx
            and small layouts compute gated (its call returns SiLU(gate) * up) where ``fuse_silu`` and the
            elementwise kernels are on, and the width allows it."""
            n, k = sum(p.shape[0] for p in params), params[0].shape[1]
            if not cpu_linear_amx.takes(n, k):
                among = tuple(c for c in among if c != "amx") or ("plain",)
            choice = choose(n, k, among, rows)
            with torch.no_grad():
                whole = merged([p.detach() for p in params]) if len(params) > 1 else params[0].detach()
                if choice.layout == "plain" and not cast:
                    share_rows(whole, params)
                    return Linear(whole, "plain", choice)
                gated = (gate_up and fuse_silu and self.elementwise
                         and linear_layout.takes_gated(choice.layout, n, k, linear_dtype))
                out = Linear(whole.to(linear_layout.held_dtype(choice.layout, linear_dtype, dtype)), choice.layout,
                             choice, gated=gated)
            release_pages([p.detach() for p in params])
            return out

        self.layers = []
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            entry = {
                "qkv": linear([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                "o": linear([a.o_proj.weight]),
                # One norm weight per head of the joint [Hq + Hkv] q/k tensor.
                "qk_norm": torch.cat([a.q_norm.weight.expand(a.num_heads, -1),
                                      a.k_norm.weight.expand(a.num_kv_heads, -1)]).detach().to(linear_dtype),
            }
            if isinstance(mlp, Qwen3MLP):
                entry["gate_up"] = linear([mlp.gate_proj.weight, mlp.up_proj.weight], gate_up=True)
                entry["down"] = linear([mlp.down_proj.weight])
            self.layers.append(entry)
        head = model.lm_head.weight
        # A head tied to the embedding: the embedding's own plain tensor (the reference) or, if
        # measured faster, its own layout, the embedding's originals then handing their pages
        # back like any linear's. Lookups (``embed``) read the panels, or the embedding's pages
        # beside a packed head (those of the tokens looked up come back: 2 KiB a token in bf16).
        self.tied = head is model.model.embed_tokens.weight
        # The head runs on the sampling rows alone (``logits``): its layout is timed at decode-sized counts.
        if self.tied:
            self.lm_head = linear([head], ("plain",) + tuple(c for c in candidates if c != "plain"),
                                  rows=linear_layout.HEAD_PROBE_ROWS)
        else:
            self.lm_head = linear([head], rows=linear_layout.HEAD_PROBE_ROWS)
        # Lookups through the embedding module (no tied head holds its rows): its file-backed
        # pages are handed back once EMBED_DROP_ROWS rows have been looked up since the last time
        # (``embed``), not left to accumulate: at most that many rows' pages stay resident (8 MiB at
        # Qwen3-0.6B's shape), as after one full prefill step, without a madvise per decode step.
        own_rows = self.tied and self.lm_head.layout != "packed"
        self._embedding_pages = None if own_rows else releasable(model.model.embed_tokens.weight.detach())
        self._rows_since_drop = 0
        self._norm_weights: dict[int, torch.Tensor] = {}
        self._kernel_plan: list[tuple] | None = None  # ``_kernel_layers``, made at the first step that takes it
        # With ``_kernel_plan``: each layer's four linears' kernels that take a caller's buffer
        # (``AmxLinear`` or ``SmallLinear``, else None), and whether any layer has one
        self._direct: list[tuple] = []
        self._any_direct = False
        # (torch's thread count, per layer the four kernels' ``threads()`` at it): ``_direct_threads_now``
        self._direct_threads: tuple[int, list[tuple[int, ...]]] = (0, [])
        self._final_norm: tuple[int, float] = (0, 0.0)  # with ``_kernel_plan``: its weight's data_ptr, its eps
        # With every linear in AMX tiles or the small kernel's panels: ``_forward_kernels`` runs
        # them into scratch buffers (their ``run``); False sends them through ``Linear`` (tests
        # check the same bits).
        self.direct_linears = True
        # What ``forward`` reads of each layer besides its weights, looked up once here instead of
        # through nn.Module attribute lookups in every layer of every step: (input norm, post-
        # attention norm, the q/k norm's eps, attention scale, MLP block).
        self._seams = [(layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm.eps,
                        layer.self_attn.scale, layer.mlp) for layer in model.model.layers]
        self.rope = RopeTable(self.cfg.head_dim, self.cfg.rope_theta, linear_dtype, device)  # rope_cos_sin's rows
        self._local = threading.local()  # per thread: the elementwise kernels' reused outputs (``_scratch``)
        trim_heap()  # the merged temporaries' heap memory back to the OS

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> their embeddings [N, D] in ``linear_dtype``: read from a tied head's
        plain tensor or panels (so the embedding's own pages are not needed), else the module."""
        if self.tied and self.lm_head.layout != "packed":
            return self.lm_head.rows(input_ids).to(self.linear_dtype)
        table = self.model.model.embed_tokens
        if type(table) is nn.Embedding and table.max_norm is None and input_ids.dim() == 1:
            # The module's lookup as the one op it is on these rows (measured in an engine step:
            # ~25 us against ~50 through nn.Module's call and F.embedding's checks)
            rows = table.weight.index_select(0, input_ids).to(self.linear_dtype)  # a new tensor
        else:
            rows = table(input_ids).to(self.linear_dtype)
        if self._embedding_pages is not None:
            self._rows_since_drop += input_ids.shape[0]
            if self._rows_since_drop >= EMBED_DROP_ROWS:
                drop_pages(self._embedding_pages)
                self._rows_since_drop = 0
        return rows

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` for the elementwise kernel output ``name``, the same memory in every
        layer and step of this thread (grown to the largest step seen): a fresh tensor per call costs
        an allocation and, at a 2,048-token step, the page faults of tens of MB of new memory per
        call. Only outputs consumed within the layer use it (a norm's output by the next matmul, q
        by attention, SiLU-mul's by the down projection); ``forward``'s result is a new tensor.
        The view of each (name, shape, dtype) asked for is kept too (until the buffer grows), so a
        step of a shape seen before makes no new tensor object at all."""
        local = self._local.__dict__
        if "views" not in local:  # this thread's first call
            local["views"], local["buffers"] = {}, {}
        views = local["views"]
        key = (name, shape, dtype)
        view = views.get(key)
        if view is None:
            if len(views) >= SCRATCH_VIEWS:  # many step sizes seen: start the collection again
                views.clear()
            buffers = local["buffers"]
            numel = math.prod(shape)
            buf = buffers.get(name)
            if buf is None or buf.numel() < numel or buf.dtype != dtype:
                buf = buffers[name] = torch.empty(numel, dtype=dtype, device=self.device)
                for old in [k for k in views if k[0] == name]:  # views of the old buffer: let it go
                    del views[old]
            view = views[key] = buf[:numel].view(shape)
        return view

    def layout_report(self) -> str:
        """One line per weight shape: the layout it keeps and the measured times behind it."""
        return "\n".join(choice.describe(n, k) for (n, k), choice in self.choices.items())

    def _norm_weight(self, norm: nn.Module) -> torch.Tensor:
        """``norm``'s weight in ``linear_dtype`` (a copy of a 16-bit one, made once)."""
        key = id(norm)
        if key not in self._norm_weights:
            self._norm_weights[key] = norm.weight.detach().to(self.linear_dtype).contiguous()
        return self._norm_weights[key]

    def _norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """RMSNorm of ``x`` (in ``linear_dtype``): the module itself when that is the model's dtype."""
        if x.dtype == self.dtype:
            return norm(x)
        return F.rms_norm(x, (x.shape[-1],), self._norm_weight(norm), norm.eps)

    def logits(self, batch: Batch, kv_caches: list[KVCache], backend: AttentionBackend) -> torch.Tensor:
        """FlatModel's ``logits``, with the last layer past its K/V write run on the batch's
        ``logits_indices`` rows alone when those are not all the rows."""
        rows = batch.logits_indices
        if rows.numel() == batch.input_ids.shape[0]:
            if not batch.prompt_spans:  # every row a sample row, in order (``Batch``): rows are 0..N-1
                return self.compute_logits(self.forward(batch.input_ids, batch.positions, kv_caches, batch.meta,
                                                        backend))  # [N, D] -> [N, V]
            return super().logits(batch, kv_caches, backend)
        hidden = self.forward(batch.input_ids, batch.positions, kv_caches, batch.meta, backend, keep_rows=rows)
        if rows.numel() == 0:
            return hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
        return self.compute_logits(hidden)  # [M, D] -> [M, V]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: BatchMeta, backend: AttentionBackend, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden [N, D] in ``linear_dtype``; with ``keep_rows``
        (int64 [M] row numbers) only those rows' [M, D]: every layer writes all N rows' K/V, the
        last one attends and runs its MLP on the M rows alone."""
        cfg, work = self.cfg, self.linear_dtype
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden = self.embed(input_ids)  # [N, D]
        n = hidden.shape[0]
        cos, sin = self.rope(positions)  # [N, Dh] each: rope_cos_sin(positions, dh, cfg.rope_theta, work)
        if (self.qk_elementwise and self.direct_seams and n > 0 and hidden.is_contiguous() and cos.is_contiguous()
                and sin.is_contiguous() and len(kv_caches) == len(self.layers)):
            return self._forward_kernels(hidden, cos, sin, kv_caches, meta, backend, keep_rows)
        residual = None
        last, window = len(self.layers) - 1, cfg.sliding_window
        for i, (weights, seam, kv_cache) in enumerate(zip(self.layers, self._seams, kv_caches)):
            input_norm, post_norm, qk_eps, scale, mlp = seam
            x, residual = self._add_norm(hidden, residual, input_norm, into="x")
            qkv = weights["qkv"](x)  # [N, (Hq + 2 Hkv) Dh]
            q, k = self._qk_norm_rope(qkv, weights["qk_norm"], cos, sin, qk_eps)
            q = q.to(kv_cache[0].dtype).contiguous()  # [N, Hq, Dh]
            v = qkv[:, (hq + hkv) * dh:].view(n, hkv, dh)
            backend.write(kv_cache, k, v, meta)
            if i == last and keep_rows is not None:  # from here on only the kept rows: [M, ...]
                o = attend_rows(backend, q, kv_cache, meta, keep_rows, scale, window)
                residual, n = residual.index_select(0, keep_rows), keep_rows.shape[0]
            else:
                o = backend.forward(q, kv_cache, meta, scale=scale, window=window)
            hidden = weights["o"](o.reshape(n, hq * dh).to(work))  # [N, D]
            x, residual = self._add_norm(hidden, residual, post_norm, into="x")
            if "gate_up" in weights:
                hidden = weights["down"](self._gate_up_silu(weights["gate_up"], x))  # [N, I] -> [N, D]
            else:
                hidden = mlp(x.to(self.dtype)).to(work)  # MoE: the block itself
        return self._add_norm(hidden, residual, self.model.model.norm)[0]

    def _kernel_layers(self) -> list[tuple]:
        """Per layer, what ``_forward_kernels`` reads besides the step's tensors, looked up once:
        (q/k/v, o, gate/up and down linears (the last two None for an MoE layer), the input
        norm's weight and eps, the post-attention norm's, the q/k norm's weight and eps, the
        attention scale, the MLP block). The norm weights are ``_norm_weight``'s tensors (kept
        alive by it, so their data_ptrs stay valid)."""
        plan = self._kernel_plan
        if plan is None:
            plan = []
            for weights, (input_norm, post_norm, qk_eps, scale, mlp) in zip(self.layers, self._seams):
                plan.append((weights["qkv"], weights["o"], weights.get("gate_up"), weights.get("down"),
                             self._norm_weight(input_norm).data_ptr(), input_norm.eps,
                             self._norm_weight(post_norm).data_ptr(), post_norm.eps,
                             weights["qk_norm"].data_ptr(), qk_eps, scale, mlp))
            # The linears in AMX tiles or panels: ``_forward_kernels`` calls their kernels' ``run``
            # directly (``_direct``: per layer, q/k/v, o, gate/up, down; None for another layout).
            direct = [tuple(weights[name].amx or weights[name].small if name in weights else None
                            for name in ("qkv", "o", "gate_up", "down")) for weights in self.layers]
            self._direct, self._direct_threads = direct, (0, [])
            self._any_direct = any(linear is not None for layer in direct for linear in layer)
            final = self.model.model.norm
            self._final_norm = (self._norm_weight(final).data_ptr(), final.eps)  # the model's last norm
            self._kernel_plan = plan
        return plan

    def _direct_threads_now(self) -> list[tuple[int, ...]]:
        """Per layer, the threads each of its four linears' kernel calls share (their ``threads``; 0
        for a linear without one), worked out again only when torch's thread count has changed."""
        num_threads = torch.get_num_threads()
        if self._direct_threads[0] != num_threads:
            self._direct_threads = (num_threads, [tuple(0 if linear is None else linear.threads(num_threads)
                                                        for linear in layer) for layer in self._direct])
        return self._direct_threads[1]

    def _forward_kernels(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[KVCache],
                         meta: BatchMeta, backend: AttentionBackend, keep_rows: torch.Tensor | None) -> torch.Tensor:
        """``forward``'s layers with the three elementwise seams as direct calls of
        ``cpu_elementwise.functions`` (contiguous [N, D] embeddings, cos and sin in ``linear_dtype``;
        the q/k kernel takes this head size): the same kernels with the same arguments as
        ``_add_norm``, ``_qk_norm_rope`` and ``_silu_mul`` (so the same values), their checks
        done once per step here, the scratch buffers and their pointers looked up once. Every
        tensor handed to a kernel is a fresh matmul output (contiguous [N, out] in
        ``linear_dtype``), a scratch buffer, or checked here. A linear in AMX tiles or the small
        kernel's panels (``direct_linears``; the pool in ``linear_dtype``) writes into a scratch
        buffer too (``AmxLinear.run``, ``SmallLinear.run``); the others go through their
        ``Linear``. The backend's attention writes into a scratch buffer where it offers
        ``forward_into``, and K and V go to the pool from the merged q/k/v rows where it offers
        ``write_merged``. The last layer with ``keep_rows`` runs its tail (from the kept rows'
        attention on) through ``_add_norm`` and ``_silu_mul``; without, the final norm is one
        more direct call (into a new tensor: the result)."""
        cfg, work = self.cfg, self.linear_dtype
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n, d = hidden.shape
        add_rms_norm, qk_norm_rope, silu_mul = cpu_elementwise.functions(work)
        width = (hq + 2 * hkv) * dh  # qkv's row
        add_threads = cpu_elementwise.threads_for("add_rms_norm", work, n * d)
        qk_threads = cpu_elementwise.threads_for("qk_norm_rope", work, n * (hq + hkv) * dh)
        x = self._scratch("x", (n, d), work)  # [N, D] each norm's output, read by the next matmul
        q = self._scratch("q", (n, hq, dh), work)  # [N, Hq, Dh]
        x_ptr, q_ptr, cos_ptr, sin_ptr = x.data_ptr(), q.data_ptr(), cos.data_ptr(), sin.data_ptr()
        cast_q = kv_caches[0][0].dtype != work  # float32 matmuls, a 16-bit pool: q converted per layer
        k_at, v_at = hq * dh, (hq + hkv) * dh
        residual, res_ptr, add = hidden, hidden.data_ptr(), 0  # layer 0: no add, the embeddings become the residual
        last, window = len(self.layers) - 1, cfg.sliding_window
        silu, silu_ptr, silu_threads = None, 0, 1
        layers = self._kernel_layers()
        # Each linear whose kernel takes a caller's buffer (``_direct``; the pool in
        # ``linear_dtype``) writes into a scratch buffer through its ``run``: no checks, no new
        # tensor per call. Another (a layout without one) is called through its ``Linear``.
        direct = self.direct_linears and not cast_q and self._any_direct
        if direct:
            direct_threads = self._direct_threads_now()
            qkv_buf = self._scratch("qkv", (n, width), work)  # [N, (Hq + 2 Hkv) Dh]
            out_buf = self._scratch("hidden", (n, d), work)  # [N, D] the o and down projections' output
            qkv_ptr, out_ptr = qkv_buf.data_ptr(), out_buf.data_ptr()
        # Attention into a scratch buffer where the backend offers it ([N, Hq, Dh], the pool's dtype)
        forward_into = getattr(backend, "forward_into", None)
        if forward_into is not None:
            attn_buf = self._scratch("attn", (n, hq, dh), kv_caches[0][0].dtype)
        # K and V rows straight from the merged qkv rows where the backend takes them so (no views)
        write_merged = getattr(backend, "write_merged", None)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
            qkv_linear, o_linear, gate_up, down, in_w, in_eps, post_w, post_eps, qk_w, qk_eps, scale, mlp = layer
            qkv_run, o_run, gate_up_run, down_run = self._direct[i] if direct else (None,) * 4
            if direct:
                qkv_t, o_t, gate_up_t, down_t = direct_threads[i]
            if not (direct and hidden is out_buf):  # out_buf: the previous layer's direct down wrote it
                _check_rows(hidden, work, (n, d), i, "hidden")
            add_rms_norm(hidden.data_ptr(), res_ptr, in_w, x_ptr, n, d, in_eps, add, add_threads)
            add = 1
            if qkv_run is not None:
                qkv_run.run(x_ptr, n, qkv_ptr, qkv_t)
                qkv = qkv_buf
            else:
                qkv = qkv_linear(x)  # [N, (Hq + 2 Hkv) Dh]
                _check_rows(qkv, work, (n, width), i, "qkv")
            qk_norm_rope(qkv.data_ptr(), width, n, hq, hkv, dh, qk_w, cos_ptr, sin_ptr, q_ptr, qk_eps, qk_threads)
            q_attn = q.to(kv_cache[0].dtype) if cast_q else q  # [N, Hq, Dh]
            if write_merged is not None:
                write_merged(kv_cache, qkv, k_at, v_at, meta)
            else:
                backend.write(kv_cache, qkv[:, k_at:v_at].view(n, hkv, dh), qkv[:, v_at:].view(n, hkv, dh), meta)
            if i == last and keep_rows is not None:  # from here on only the kept rows: [M, ...]
                o = attend_rows(backend, q_attn, kv_cache, meta, keep_rows, scale, window)
                residual, m = residual.index_select(0, keep_rows), keep_rows.shape[0]
                hidden = o_linear(o.reshape(m, hq * dh).to(work))  # [M, D]
                post_x, residual = self._add_norm(hidden, residual, self._seams[i][1], into="x")
                if gate_up is not None:
                    hidden = down(self._gate_up_silu(gate_up, post_x))
                else:
                    hidden = mlp(post_x.to(self.dtype)).to(work)
                break
            if forward_into is not None:
                o = forward_into(q_attn, kv_cache, meta, attn_buf, scale=scale, window=window)  # [N, Hq, Dh]
            else:
                o = backend.forward(q_attn, kv_cache, meta, scale=scale, window=window)  # [N, Hq, Dh]
            if o_run is not None:
                if forward_into is None or o is not attn_buf:
                    _check_rows(o, work, (n, hq, dh), i, "attention output")
                o_run.run(o.data_ptr(), n, out_ptr, o_t)
                hidden = out_buf  # [N, D]
            else:
                o = o.reshape(n, hq * dh)  # [N, Hq Dh]
                hidden = o_linear(o if o.dtype == work else o.to(work))  # [N, D]
                _check_rows(hidden, work, (n, d), i, "hidden")
            add_rms_norm(hidden.data_ptr(), res_ptr, post_w, x_ptr, n, d, post_eps, 1, add_threads)
            if gate_up is None:  # MoE: the block itself
                hidden = mlp(x.to(self.dtype)).to(work)
                continue
            inter = gate_up.n // 2
            if silu is None or silu.shape[1] != inter:
                silu = self._scratch("silu", (n, inter), work)  # [N, I]
                silu_ptr, silu_threads = silu.data_ptr(), cpu_elementwise.threads_for("silu_mul", work, n * inter)
            if gate_up.gated:  # SiLU(gate) * up as the gate/up linear's outputs are written: [N, I]
                if gate_up_run is not None:
                    gate_up_run.run(x_ptr, n, silu_ptr, gate_up_t)
                    act = silu
                else:
                    act = gate_up(x)
            else:
                if gate_up_run is not None:
                    gu = self._scratch("gate_up", (n, 2 * inter), work)  # [N, 2I]
                    gate_up_run.run(x_ptr, n, gu.data_ptr(), gate_up_t)
                else:
                    gu = gate_up(x)  # [N, 2I]
                    _check_rows(gu, work, (n, 2 * inter), i, "gate_up")
                silu_mul(gu.data_ptr(), silu_ptr, n, inter, silu_threads)
                act = silu
            if down_run is not None:
                if act is not silu:
                    _check_rows(act, work, (n, inter), i, "gate_up")
                down_run.run(act.data_ptr(), n, out_ptr, down_t)
                hidden = out_buf  # [N, D]
            else:
                hidden = down(act)  # [N, D]
        else:  # every layer on all N rows: the final residual add and norm by the same kernel, into a new tensor
            if not (direct and hidden is out_buf):
                _check_rows(hidden, work, (n, d), last, "hidden")
            norm_w, norm_eps = self._final_norm
            out = torch.empty((n, d), dtype=work, device=hidden.device)
            add_rms_norm(hidden.data_ptr(), res_ptr, norm_w, out.data_ptr(), n, d, norm_eps, 1, add_threads)
            return out
        return self._add_norm(hidden, residual, self.model.model.norm)[0]

    def _add_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                  into: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(hidden + residual), hidden + residual), [N, D] each; residual None: no add.
        ``into``: the kernel writes the norm into that ``_scratch`` buffer (a value used within the
        layer only), else into a new tensor."""
        if self.elementwise:
            out = self._scratch(into, hidden.shape, hidden.dtype) if into else None
            return cpu_elementwise.add_rms_norm(hidden, residual, self._norm_weight(norm), norm.eps, out=out)
        if residual is not None:
            hidden = hidden + residual
        return self._norm(hidden, norm), hidden

    def _qk_norm_rope(self, qkv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [N, (Hq + 2 Hkv) Dh], cos / sin [N, Dh] -> q [N, Hq, Dh], k [N, Hkv, Dh]: each head
        normed (its weight row of [Hq + Hkv, Dh]) and rotated."""
        cfg = self.cfg
        n, hq, hkv, dh = qkv.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if self.qk_elementwise:  # q to a buffer of its own, k in place in qkv
            q = cpu_elementwise.qk_norm_rope(qkv, hq, hkv, dh, weight, cos, sin, eps,
                                             out=self._scratch("q", (n, hq, dh), qkv.dtype))
            return q, qkv[:, hq * dh:(hq + hkv) * dh].view(n, hkv, dh)
        half = dh // 2
        qk = qkv[:, :(hq + hkv) * dh].view(n, hq + hkv, dh)
        qk = F.rms_norm(qk, (dh,), None, eps) * weight  # [N, Hq + Hkv, Dh]
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        qk = qk * cos[:, None, :] + rotated * sin[:, None, :]  # RoPE on q and k at once
        return qk[:, :hq], qk[:, hq:]

    def _gate_up_silu(self, gate_up: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> SiLU(gate) * up [N, I] through the gate/up linear: a gated one computes it in
        its own pass, another returns [N, 2I] for ``_silu_mul``."""
        return gate_up(x) if gate_up.gated else self._silu_mul(gate_up(x))

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2I] -> SiLU(gate) * up [N, I]."""
        if self.elementwise:
            return cpu_elementwise.silu_mul(gate_up, out=self._scratch("silu", (gate_up.shape[0], gate_up.shape[1] // 2),
                                                                        gate_up.dtype))
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [M, V] -> int64 [M]: ``sampler.greedy_tokens``' indices (argmax, first on a tie),
        on a CPU in one pass of ``cpu_greedy``'s kernel (~3x faster on float32 rows); elsewhere, or
        for a float64 model's logits, ``greedy_tokens`` itself. The engine hands it to its sampler."""
        if (logits.device.type == "cpu" and logits.dtype in cpu_greedy.DTYPES and logits.dim() == 2
                and logits.shape[1] > 0 and logits.is_contiguous() and cpu_greedy.library() is not None):
            return cpu_greedy.argmax_rows(logits)
        return greedy_tokens(logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, D] -> logits [M, V] in float32 (float64 for float64 models): the LM head in
        ``linear_dtype``, only the logits widened."""
        work = work_dtype(hidden.dtype)
        amx = getattr(self.lm_head, "amx", None)  # (a head replaced by a plain callable is called as one)
        if amx is not None and work == torch.float32:  # the head writes its bf16 logits as float32 itself
            return amx(hidden.to(self.linear_dtype), torch.float32, widened=True)
        return self.lm_head(hidden.to(self.linear_dtype)).to(work)
