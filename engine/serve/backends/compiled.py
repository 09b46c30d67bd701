"""CompiledFlatModel: FusedFlatModel's layers as one TorchInductor graph (``EngineConfig(flat_model="compiled")``).

Eager PyTorch pays a few microseconds of dispatch for each of the ~30 small operations of a layer
(norms, RoPE, SiLU-mul, residual adds, casts) and makes a pass over memory for each. Compiled as
small separate regions they cost more per call than they save at decode sizes (docs/performance.md);
compiled as ONE graph for all layers — vLLM's design — the elementwise work fuses into a few
generated C++ loops next to the matmuls, and the per-call cost is paid once per step.

Attention is the one thing the graph does not trace: it calls ``engine_serve::paged_attention``, a
custom op that writes the layer's K/V into the pool and runs the engine's attention backend on
the step's ``BatchMeta``, both taken from a per-step context this class sets before calling the
graph (the op's declared inputs are only q, k, v and the layer's constants, so nothing of the
pool is copied). With TorchInductor's ``freezing`` the weights are folded into the graph as
constants and the matmuls prepacked for oneDNN, as ``FusedFlatModel`` does by hand.

The graph computes the last layer past its K/V write only for the rows whose logits are needed
(``keep_rows``, as FusedFlatModel; custom op ``engine_serve::paged_attention_rows``).

Shapes: the row count N and the kept rows' M are dynamic (one graph serves every step size; a
step of one row would compile a second one, so M is padded to at least ``MIN_KEEP``). Compilation happens when the first engine on a model is built (a dummy
step of ``WARM_UP_ROWS`` rows), needs a C++ compiler (TorchInductor's CPU code is C++), and takes
10-60 s on a small CPU; one compiled graph is shared by every engine built on the same model
object (the bench builds a fresh engine per run). Where FusedFlatModel uses the small-batch
linear kernel (float32 linears on a CPU), the graph calls it too (custom op
``engine_serve::linear``), and steps of at most ``SMALL_ROWS`` rows (decodes) skip the graph for
FusedFlatModel's eager path, which is faster there (docs/performance.md). Results equal
FusedFlatModel's up to summation order. Dense (non-MoE) Qwen3 models only.
"""
from __future__ import annotations

import shutil
import weakref

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn

from engine.models.qwen3 import Qwen3MLP
from engine.rope import rope_cos_sin
from engine.serve.attention import AttentionBackend, KVCache
from engine.serve.batch import BatchMeta
from engine.serve.backends.fused import SMALL_ROWS, FusedFlatModel, attend_rows

WARM_UP_ROWS = 256  # the start-up compile's step size (also oneDNN's packing hint for the graph's linears)
# Fewer kept rows than this are padded up to it: TorchInductor specialises sizes 0 and 1, and a
# step with one sample row (one prompt finishing) would compile a second graph in the middle of a run.
MIN_KEEP = 2

# The step being run: (meta, backend, kv_caches). Set around each compiled call, read by the op.
_step: tuple[BatchMeta, AttentionBackend, list[KVCache]] | None = None


def _write(k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[BatchMeta, AttentionBackend, KVCache]:
    """The attention ops' first half: k, v [N, Hkv, Dh] into layer ``layer``'s pool of the step."""
    assert _step is not None, "the paged attention ops run only inside CompiledFlatModel.forward"
    meta, backend, kv_caches = _step
    backend.write(kv_caches[layer], k, v, meta)
    return meta, backend, kv_caches[layer]


@torch.library.custom_op("engine_serve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                    window: int) -> torch.Tensor:
    """Write k, v [N, Hkv, Dh] into layer ``layer``'s pool and attend: q [N, Hq, Dh] -> [N, Hq, Dh]."""
    meta, backend, cache = _write(k, v, layer)
    return backend.forward(q, cache, meta, scale=scale, window=window)


@paged_attention.register_fake
def _(q, k, v, layer, scale, window):
    return torch.empty_like(q)


@torch.library.custom_op("engine_serve::paged_attention_rows", mutates_args=())
def paged_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, layer: int,
                         scale: float, window: int) -> torch.Tensor:
    """``paged_attention`` that writes every row's k, v but attends only ``rows``: -> [M, Hq, Dh]."""
    meta, backend, cache = _write(k, v, layer)
    return attend_rows(backend, q, cache, meta, rows, scale, window)


@paged_attention_rows.register_fake
def _(q, k, v, rows, layer, scale, window):
    return q.new_empty((rows.shape[0], q.shape[1], q.shape[2]))


# The graphs' small-batch linears, by id: held by their _Layers (weakly here), called by the op.
_linears: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@torch.library.custom_op("engine_serve::linear", mutates_args=())
def linear(x: torch.Tensor, index: int) -> torch.Tensor:
    """x [N, K] -> [N, out] through the packed ``cpu_linear.SmallLinear`` registered as ``index``."""
    return _linears[index](x)


@linear.register_fake
def _(x, index):
    return x.new_empty((x.shape[0], _linears[index].n))


class _ZeroAttention:
    """The warm-up step's attention backend: writes nothing, attends to nothing (zeros)."""

    def write(self, cache, k, v, meta) -> None:
        pass

    def forward(self, q, cache, meta, scale=None, window=0) -> torch.Tensor:
        return torch.zeros_like(q)

    def forward_rows(self, q, cache, meta, rows, scale=None, window=0) -> torch.Tensor:
        return q.new_zeros((rows.shape[0], *q.shape[1:]))


class _Layers(nn.Module):
    """Every decoder layer of the model, hidden [N, D] -> final normed hidden [N, D]; the weights
    are this module's (frozen) parameters, in ``work`` dtype."""

    def __init__(self, fused: FusedFlatModel) -> None:
        super().__init__()
        m, cfg = fused.model.model, fused.cfg
        work = fused.linear_dtype
        p = lambda t: nn.Parameter(t.detach().to(work).contiguous(), requires_grad=False)  # noqa: E731
        self.w = nn.ParameterList()
        self.small = []  # the SmallLinear of each linear, in order, when FusedFlatModel uses them
        for layer, weights in zip(m.layers, fused.layers):
            self.w.extend([p(layer.input_layernorm.weight), p(weights["qkv"].weight), p(weights["qk_norm"]),
                           p(weights["o"].weight), p(layer.post_attention_layernorm.weight),
                           p(weights["gate_up"].weight), p(weights["down"].weight)])
            if fused.small:
                self.small.extend(weights[k].small for k in ("qkv", "o", "gate_up", "down"))
        for small in self.small:
            _linears[id(small)] = small
        self.small_ids = [id(small) for small in self.small]
        self.final_norm = p(m.norm.weight)
        self.eps = [(layer.input_layernorm.eps, layer.self_attn.q_norm.eps, layer.post_attention_layernorm.eps)
                    for layer in m.layers]
        self.scales = [float(layer.self_attn.scale) for layer in m.layers]
        self.final_eps = m.norm.eps
        self.shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size)
        self.window = cfg.sliding_window or 0

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, i: int) -> torch.Tensor:
        """The i-th linear: the small-batch kernel (a custom op) where in use, else a frozen matmul."""
        if self.small_ids:
            return torch.ops.engine_serve.linear(x, self.small_ids[i])
        return F.linear(x, weight)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool_dtype: torch.dtype,
                keep: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> the final normed hidden of the rows ``keep`` (int64 [M]), [M, D]."""
        hq, hkv, dh, dim = self.shape
        half = dh // 2
        residual = None
        last = len(self.eps) - 1
        for i, (in_eps, qk_eps, post_eps) in enumerate(self.eps):
            w_in, w_qkv, w_qk, w_o, w_post, w_gu, w_down = self.w[7 * i:7 * i + 7]
            if residual is not None:
                hidden = hidden + residual
            residual = hidden
            x = F.rms_norm(hidden, (dim,), w_in, in_eps)
            qkv = self._linear(x, w_qkv, 4 * i)  # [N, (Hq + 2 Hkv) Dh]
            qk = qkv[:, :(hq + hkv) * dh].reshape(-1, hq + hkv, dh)
            qk = F.rms_norm(qk, (dh,), None, qk_eps) * w_qk
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
            v = qkv[:, (hq + hkv) * dh:].reshape(-1, hkv, dh)
            if i == last:  # the last layer past its K/V write: the kept rows only
                o = torch.ops.engine_serve.paged_attention_rows(qk[:, :hq].to(pool_dtype), qk[:, hq:], v, keep, i,
                                                                self.scales[i], self.window)
                residual = residual.index_select(0, keep)
            else:
                o = torch.ops.engine_serve.paged_attention(qk[:, :hq].to(pool_dtype), qk[:, hq:], v, i,
                                                           self.scales[i], self.window)
            hidden = self._linear(o.reshape(-1, hq * dh).to(x.dtype), w_o, 4 * i + 1) + residual
            residual = hidden
            x = F.rms_norm(hidden, (dim,), w_post, post_eps)
            gate, up = self._linear(x, w_gu, 4 * i + 2).chunk(2, dim=-1)
            hidden = self._linear(F.silu(gate) * up, w_down, 4 * i + 3)
        return F.rms_norm(hidden + residual, (dim,), self.final_norm, self.final_eps)


# model -> ((linear dtype, model dtype), compiled fn)
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def inductor_available() -> str | None:
    """None when TorchInductor can compile for the CPU here, else why not."""
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "no C++ compiler (TorchInductor's CPU code is C++; install g++)"
    return None


class CompiledFlatModel(FusedFlatModel):
    """FusedFlatModel whose decoder layers run as one compiled graph; same contract.

    Invariant: the compiled graph holds the weights the model had when the first engine on it
    was built (shared through ``_compiled``); weights changed later are not seen.
    """

    def __init__(self, model: nn.Module) -> None:
        why = inductor_available()
        if why:
            raise ValueError(f"flat_model='compiled' needs TorchInductor: {why}; use flat_model='fused'")
        super().__init__(model)
        if any(not isinstance(layer.mlp, Qwen3MLP) for layer in model.model.layers):
            raise ValueError("flat_model='compiled' serves dense models only (this one has MoE layers); use 'fused'")
        entry = _compiled.get(model)
        if entry is None or entry[0] != (self.linear_dtype, self.dtype):
            entry = ((self.linear_dtype, self.dtype), torch.compile(_Layers(self).eval(), dynamic=True, fullgraph=True))
            _compiled[model] = entry
            self._run = entry[1]
            self._warm_up()
        self._run = entry[1]
        self.eager_rows = SMALL_ROWS

    def _warm_up(self, rows: int = WARM_UP_ROWS) -> None:
        """Compile now (start-up), on a dummy step of ``rows`` rows whose attention returns zeros:
        the graph is dynamic in N, so every later step size above ``SMALL_ROWS`` reuses it."""
        cfg, work = self.cfg, self.linear_dtype
        with torch.inference_mode():
            hidden = torch.zeros((rows, cfg.hidden_size), dtype=work, device=self.device)
            cos, sin = rope_cos_sin(torch.arange(rows, device=self.device), cfg.head_dim, cfg.rope_theta, work)
            keep = torch.arange(MIN_KEEP + 6, device=self.device)  # M != N: traced as two sizes
            self._call(hidden, cos, sin, (None, _ZeroAttention(), [None] * cfg.num_hidden_layers), self.dtype, keep)

    def _call(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: tuple,
              pool_dtype: torch.dtype, keep: torch.Tensor) -> torch.Tensor:
        global _step
        _step = step
        try:
            # freezing (read whenever a shape compiles): the weights become constants of the graph,
            # the linears prepacked for oneDNN, residual adds fused into them.
            with inductor_config.patch(freezing=True):
                return self._run(hidden, cos[:, None, :], sin[:, None, :], pool_dtype, keep)
        finally:
            _step = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: BatchMeta, backend: AttentionBackend, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden [N, D] in ``linear_dtype`` (with ``keep_rows``,
        int64 [M]: those rows' [M, D]). Steps of at most ``SMALL_ROWS`` rows take FusedFlatModel's
        eager path when its small-batch linear kernel is in use (there the graph's per-call cost
        outweighs what its fusion saves)."""
        if self.small and input_ids.shape[0] <= self.eager_rows:
            return super().forward(input_ids, positions, kv_caches, meta, backend, keep_rows=keep_rows)
        cfg, work = self.cfg, self.linear_dtype
        n = input_ids.shape[0]
        keep = torch.arange(n, device=input_ids.device) if keep_rows is None else keep_rows
        m = keep.shape[0]
        if m < MIN_KEEP:  # padded with row 0 (results dropped): the graph never sees a size of 0 or 1
            keep = torch.cat([keep, keep.new_zeros(MIN_KEEP - m)])
        hidden = self.model.model.embed_tokens(input_ids).to(work)  # [N, D]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, work)  # [N, Dh]
        return self._call(hidden, cos, sin, (meta, backend, kv_caches), kv_caches[0][0].dtype, keep)[:m]
