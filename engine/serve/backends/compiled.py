"""CompiledFlatModel: FusedFlatModel's decoder layer as one TorchInductor graph (``EngineConfig(compile=True)``).

Eager PyTorch pays a few microseconds of dispatch for each of the ~30 small operations of a layer
(norms, RoPE, SiLU-mul, residual adds, casts) and makes a pass over memory for each. Compiled, the
elementwise work fuses into a few generated C++ loops between the matmuls.

One graph serves every layer. Qwen3's decoder layers are identical but for their weights, so the
graph is ONE layer (residual add, norm, q/k/v, q/k norm + RoPE, attention, o, residual add, norm,
gate/up, SiLU-mul, down), called once per layer; a second graph is the last layer, which goes past
its K/V write only on the rows whose logits are needed (``keep_rows``, as FusedFlatModel) and ends
with the final norm. Compiling a layer instead of the whole stack keeps compile time and the
compiler's memory flat in the depth of the model (28 layers at Qwen3-0.6B's shape compile as fast
as 2), and the compiled code is cached on disk by TorchInductor's FX graph cache in
``compile_cache_dir()``: a second process with the same model shape skips code generation.

What the graph does not trace, custom ops do, reading the step from a per-thread context that
the engine sets around each call (``_context``; each engine's step is its own, so two engines in
two threads never see each other's pool):

- ``engine_serve::linear(x, slot, n)``: the layer's ``slot``-th linear (qkv, o, gate_up, down)
  through FusedFlatModel's own ``Linear`` (oneDNN-prepacked, or the small-batch kernel's panels):
  the graph holds no weight of its own, so the weights stay one copy, in one layout;
- ``engine_serve::paged_attention`` / ``_rows``: write the layer's K/V into the pool and run the
  engine's attention backend on the step's ``BatchMeta``.
The small norm weights are the graph's inputs. The layer being run is the context's ``layer``, so
nothing in the graph depends on which layer it is and nothing recompiles from one to the next.

Shapes: the row count N and the kept rows' M are dynamic (one graph serves every step size; a step
of one row would compile a second one, so M is padded to at least ``MIN_KEEP``). Compilation
happens when the first engine on a model shape is built (a dummy step of ``WARM_UP_ROWS`` rows),
is announced on stderr with its duration, and needs a C++ compiler. In float32, steps of at most
``EAGER_ROWS`` rows (decodes) take FusedFlatModel's eager path, whose elementwise C++ kernels are
faster there (docs/performance.md). Results equal FusedFlatModel's up to summation order. Dense
(non-MoE) Qwen3 models only.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.qwen3 import Qwen3MLP
from engine.rope import rope_cos_sin
from engine.serve.attention import AttentionBackend, KVCache
from engine.serve.backends.cpu_attention import cache_dir as kernel_cache_dir
from engine.serve.backends.fused import FusedFlatModel, Linear, attend_rows
from engine.serve.batch import BatchMeta

WARM_UP_ROWS = 256  # the start-up compile's step size
EAGER_ROWS = 256  # float32 steps of at most this many rows run FusedFlatModel's eager path
# Fewer kept rows than this are padded up to it: TorchInductor specialises sizes 0 and 1, and a
# step with one sample row (one prompt finishing) would compile a second graph in the middle of a run.
MIN_KEEP = 2
SLOTS = ("qkv", "o", "gate_up", "down")  # engine_serve::linear's slot numbers


def compile_cache_dir() -> str:
    """Where TorchInductor keeps compiled graphs across runs: ``$TORCHINDUCTOR_CACHE_DIR`` when
    set, else an ``inductor`` folder in the engine's kernel cache (``cpu_attention.cache_dir()``)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(kernel_cache_dir() / "inductor")


# Set before anything compiles: TorchInductor reads it on its first use and keeps it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())


@dataclass
class _Step:
    """What the custom ops need of the step being run: the engine's, never another's."""

    meta: BatchMeta | None
    backend: AttentionBackend
    kv_caches: list[KVCache | None]
    linears: list[list[Linear]]  # per layer, in SLOTS order
    layer: int = 0  # the layer the graph is running now


class _Context(threading.local):
    step: _Step | None = None


_context = _Context()


def _step() -> _Step:
    step = _context.step
    assert step is not None, "the compiled layer's ops run only inside CompiledFlatModel.forward"
    return step


def _write(k: torch.Tensor, v: torch.Tensor) -> tuple[_Step, KVCache]:
    """The attention ops' first half: k, v [N, Hkv, Dh] into the current layer's pool."""
    step = _step()
    cache = step.kv_caches[step.layer]
    step.backend.write(cache, k, v, step.meta)
    return step, cache


@torch.library.custom_op("engine_serve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Write k, v [N, Hkv, Dh] into the current layer's pool and attend: q [N, Hq, Dh] -> [N, Hq, Dh]."""
    step, cache = _write(k, v)
    return step.backend.forward(q, cache, step.meta, scale=scale, window=window)


@paged_attention.register_fake
def _(q, k, v, scale, window):
    return torch.empty_like(q)


@torch.library.custom_op("engine_serve::paged_attention_rows", mutates_args=())
def paged_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float,
                         window: int) -> torch.Tensor:
    """``paged_attention`` that writes every row's k, v but attends only ``rows``: -> [M, Hq, Dh]."""
    step, cache = _write(k, v)
    return attend_rows(step.backend, q, cache, step.meta, rows, scale, window)


@paged_attention_rows.register_fake
def _(q, k, v, rows, scale, window):
    return q.new_empty((rows.shape[0], q.shape[1], q.shape[2]))


@torch.library.custom_op("engine_serve::linear", mutates_args=())
def linear(x: torch.Tensor, slot: int, n: int) -> torch.Tensor:
    """x [N, K] -> [N, n] through the current layer's ``SLOTS[slot]`` linear."""
    step = _step()
    return step.linears[step.layer][slot](x.contiguous())


@linear.register_fake
def _(x, slot, n):
    return x.new_empty((x.shape[0], n))


class _ZeroAttention:
    """The warm-up step's attention backend: writes nothing, attends to nothing (zeros)."""

    def write(self, cache, k, v, meta) -> None:
        pass

    def forward(self, q, cache, meta, scale=None, window=0) -> torch.Tensor:
        return torch.zeros_like(q)

    def forward_rows(self, q, cache, meta, rows, scale=None, window=0) -> torch.Tensor:
        return q.new_zeros((rows.shape[0], *q.shape[1:]))


@dataclass(frozen=True)
class _Shape:
    """What the layer graph is specialised on (equal for every layer of a model)."""

    hq: int
    hkv: int
    dh: int
    dim: int
    widths: tuple[int, int, int, int]  # out features of qkv, o, gate_up, down
    eps: tuple[float, float, float, float]  # input norm, q/k norm, post-attention norm, final norm
    scale: float
    window: int


class _LayerGraph:
    """One decoder layer (``layer``) and the last one (``last``) as functions of the rows, the
    residual and the layer's norm weights; torch.compile'd once per ``_Shape``."""

    def __init__(self, shape: _Shape) -> None:
        self.s = shape
        self.layer = torch.compile(self._layer, dynamic=True, fullgraph=True)
        self.last = torch.compile(self._last, dynamic=True, fullgraph=True)

    def _attention_in(self, hidden, residual, cos, sin, w_in, w_qk):
        s = self.s
        hidden = hidden + residual
        x = F.rms_norm(hidden, (s.dim,), w_in, s.eps[0])
        qkv = torch.ops.engine_serve.linear(x, 0, s.widths[0])  # [N, (Hq + 2 Hkv) Dh]
        qk = qkv[:, :(s.hq + s.hkv) * s.dh].reshape(-1, s.hq + s.hkv, s.dh)
        qk = F.rms_norm(qk, (s.dh,), None, s.eps[1]) * w_qk
        half = s.dh // 2
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
        v = qkv[:, (s.hq + s.hkv) * s.dh:].reshape(-1, s.hkv, s.dh)
        return hidden, x, qk[:, :s.hq], qk[:, s.hq:], v

    def _mlp(self, o, hidden, x_dtype, w_post):
        s = self.s
        hidden = torch.ops.engine_serve.linear(o.reshape(-1, s.hq * s.dh).to(x_dtype), 1, s.widths[1]) + hidden
        x = F.rms_norm(hidden, (s.dim,), w_post, s.eps[2])
        gate, up = torch.ops.engine_serve.linear(x, 2, s.widths[2]).chunk(2, dim=-1)
        return torch.ops.engine_serve.linear(F.silu(gate) * up, 3, s.widths[3]), hidden

    def _layer(self, hidden, residual, cos, sin, w_in, w_qk, w_post, pool_dtype: torch.dtype):
        """(hidden, residual) [N, D] each -> the next layer's (hidden, residual)."""
        residual, x, q, k, v = self._attention_in(hidden, residual, cos, sin, w_in, w_qk)
        o = torch.ops.engine_serve.paged_attention(q.to(pool_dtype), k, v, self.s.scale, self.s.window)
        return self._mlp(o, residual, x.dtype, w_post)

    def _last(self, hidden, residual, cos, sin, w_in, w_qk, w_post, w_final, pool_dtype: torch.dtype, keep):
        """The last layer on the rows ``keep`` (int64 [M]) past its K/V write, and the final norm: [M, D]."""
        residual, x, q, k, v = self._attention_in(hidden, residual, cos, sin, w_in, w_qk)
        o = torch.ops.engine_serve.paged_attention_rows(q.to(pool_dtype), k, v, keep, self.s.scale, self.s.window)
        hidden, residual = self._mlp(o, residual.index_select(0, keep), x.dtype, w_post)
        return F.rms_norm(hidden + residual, (self.s.dim,), w_final, self.s.eps[3])


# (shape, linear dtype, model dtype) -> the compiled layer graphs: shared by every engine and model
# of that shape in the process (their weights are inputs or the context's, never the graph's).
_graphs: dict[tuple, _LayerGraph] = {}
_graphs_lock = threading.Lock()


def inductor_available() -> str | None:
    """None when TorchInductor can compile for the CPU here, else why not."""
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "no C++ compiler (TorchInductor's CPU code is C++; install g++)"
    return None


def _cache_counts() -> tuple[int, int]:
    """(hits, misses) of TorchInductor's FX graph cache so far in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


class CompiledFlatModel(FusedFlatModel):
    """FusedFlatModel whose decoder layers run through one compiled layer graph; same contract.

    Invariant: the graphs hold no weights; every call reads this model's ``layers`` (through the
    step context) and its norm weights, so nothing is copied per engine or per layer.
    """

    def __init__(self, model: nn.Module) -> None:
        why = inductor_available()
        if why:
            raise ValueError(f"compile=True needs TorchInductor: {why}; use compile=False")
        super().__init__(model)
        if any(not isinstance(layer.mlp, Qwen3MLP) for layer in model.model.layers):
            raise ValueError("compile=True serves dense models only (this one has MoE layers); use compile=False")
        m, cfg = model.model, self.cfg
        work = self.linear_dtype
        first = m.layers[0]
        self.shape = _Shape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                            tuple(self.layers[0][k].n for k in SLOTS),
                            (first.input_layernorm.eps, first.self_attn.q_norm.eps,
                             first.post_attention_layernorm.eps, m.norm.eps),
                            float(first.self_attn.scale), cfg.sliding_window or 0)
        as_work = lambda t: t.detach().to(work).contiguous()  # noqa: E731 - no copy when already so
        self.norms = [(as_work(layer.input_layernorm.weight), entry["qk_norm"],
                       as_work(layer.post_attention_layernorm.weight)) for layer, entry in zip(m.layers, self.layers)]
        self.final_norm = as_work(m.norm.weight)
        self.linears = [[entry[k] for k in SLOTS] for entry in self.layers]
        self.eager_rows = EAGER_ROWS if self.elementwise else 0
        key = (self.shape, work, self.dtype)
        with _graphs_lock:
            graphs = _graphs.get(key)
            if graphs is None:
                graphs = _graphs[key] = _LayerGraph(self.shape)
                self.graphs = graphs
                self._warm_up()
        self.graphs = graphs

    def _warm_up(self, rows: int = WARM_UP_ROWS) -> None:
        """Compile now (start-up), on a dummy step of ``rows`` rows whose attention returns zeros:
        the graphs are dynamic in N, so every later step size reuses them. Announced on stderr."""
        cfg, work = self.cfg, self.linear_dtype
        print(f"compile=True: compiling the decoder layer ({cfg.num_hidden_layers} layers, one graph) with "
              f"TorchInductor; cache {os.environ['TORCHINDUCTOR_CACHE_DIR']} ...", file=sys.stderr, flush=True)
        hits, misses = _cache_counts()
        start = time.perf_counter()
        with torch.inference_mode():
            hidden = torch.zeros((rows, cfg.hidden_size), dtype=work, device=self.device)
            cos, sin = rope_cos_sin(torch.arange(rows, device=self.device), cfg.head_dim, cfg.rope_theta, work)
            keep = torch.arange(MIN_KEEP + 6, device=self.device)  # M != N: traced as two sizes
            step = _Step(None, _ZeroAttention(), [None] * cfg.num_hidden_layers, self.linears)
            self._run(hidden, cos, sin, step, self.dtype, keep)
        hits2, misses2 = _cache_counts()
        print(f"compile=True: compiled in {time.perf_counter() - start:.1f} s (FX graph cache: {hits2 - hits} hit(s), "
              f"{misses2 - misses} miss(es))", file=sys.stderr, flush=True)

    def _run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: _Step,
             pool_dtype: torch.dtype, keep: torch.Tensor) -> torch.Tensor:
        """Every layer through the graphs: hidden [N, D] -> the kept rows' final normed hidden [M, D]."""
        cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, Dh]: broadcast over heads
        outer, _context.step = _context.step, step
        try:
            residual = torch.zeros_like(hidden)  # layer 0 adds nothing (x + 0 == x exactly)
            last = len(self.norms) - 1
            for i in range(last):
                step.layer = i
                hidden, residual = self.graphs.layer(hidden, residual, cos, sin, *self.norms[i], pool_dtype)
            step.layer = last
            return self.graphs.last(hidden, residual, cos, sin, *self.norms[last], self.final_norm, pool_dtype, keep)
        finally:
            _context.step = outer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: BatchMeta, backend: AttentionBackend, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden [N, D] in ``linear_dtype`` (with ``keep_rows``,
        int64 [M]: those rows' [M, D]). Steps of at most ``eager_rows`` rows take FusedFlatModel's
        eager path (float32, where its elementwise kernels beat the graph's per-call cost)."""
        if input_ids.shape[0] <= self.eager_rows:
            return super().forward(input_ids, positions, kv_caches, meta, backend, keep_rows=keep_rows)
        cfg, work = self.cfg, self.linear_dtype
        n = input_ids.shape[0]
        keep = torch.arange(n, device=input_ids.device) if keep_rows is None else keep_rows
        m = keep.shape[0]
        if m < MIN_KEEP:  # padded with row 0 (results dropped): the graph never sees a size of 0 or 1
            keep = torch.cat([keep, keep.new_zeros(MIN_KEEP - m)])
        hidden = self.model.model.embed_tokens(input_ids).to(work)  # [N, D]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, work)  # [N, Dh]
        step = _Step(meta, backend, kv_caches, self.linears)
        return self._run(hidden, cos, sin, step, kv_caches[0][0].dtype, keep)[:m]
