"""CompiledFlatModel: FusedFlatModel's decoder layer as one TorchInductor graph (``EngineConfig(flat_model="compiled")``).

Eager PyTorch pays a few microseconds of dispatch for each of the ~30 small operations of a layer
(norms, RoPE, SiLU-mul, residual adds, casts) and makes a pass over memory for each. Compiled, the
elementwise work fuses into a few generated C++ loops between the matmuls.

One graph serves every layer. Qwen3's decoder layers are identical but for their weights, so the
graph is ONE layer (residual add, norm, q/k/v, q/k norm + RoPE, attention, o, residual add, norm,
gate/up, SiLU-mul, down), called once per layer; the final norm runs on the kept rows only
(``keep_rows``). Compiling a layer instead of the whole stack keeps compile time and the
compiler's memory flat in the depth of the model (28 layers at Qwen3-0.6B's shape compile as fast
as 2), and the compiled code is cached on disk by TorchInductor's FX graph cache in
``compile_cache_dir()``: a second process with the same model shape skips code generation.

What the graph does not trace, custom ops do, reading the step from a per-thread context that
the engine sets around each call (``_context``; each engine's step is its own, so two engines in
two threads never see each other's pool, and the background compile never sees a real step):

- ``engine_serve::linear(x, slot, n)``: the layer's ``slot``-th linear (qkv, o, gate_up, down)
  through FusedFlatModel's own ``Linear`` (oneDNN-prepacked, or the small-batch kernel's panels):
  the graph holds no weight of its own, so the weights stay one copy, in one layout;
- ``engine_serve::paged_attention``: write the layer's K/V into the pool and run the engine's
  attention backend on the step's ``BatchMeta``.
The small norm weights are the graph's inputs. The layer being run is the context's ``layer``, so
nothing in the graph depends on which layer it is and nothing recompiles from one to the next.

Start-up: the engine is ready as soon as FusedFlatModel's weights are laid out. The graph compiles
in a background thread (announced on stderr, with its duration when done; needs a C++ compiler),
on a dummy step of ``WARM_UP_ROWS`` rows; until then every step runs FusedFlatModel's eager path,
and afterwards steps of more than ``eager_rows`` rows run the graph (the row count N is dynamic:
one graph serves every size but 1, so nothing recompiles mid-run). Which path serves is measured
once compiled: the warm-up step is timed through the graph and eagerly (the same linears, in the
same layouts), and where the graph is not the faster every step stays eager (on a CPU with the
float32 / bfloat16 elementwise kernels it was slower even at 1,600 rows: ~2.0 s vs ~1.6 s,
``course/tuning/levers.py step --prefill``); where it is faster, steps of at most ``EAGER_ROWS`` rows
(decodes) still stay eager when the elementwise kernels serve them. One compiled graph serves
every engine and model of the same shape in the process. Results equal FusedFlatModel's up to summation order. Dense (non-MoE) Qwen3 models only.
"""
from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch._dynamo.exc
import torch.nn.functional as F
from torch import nn

from engine.models.mapped import trim_heap
from engine.models.qwen3 import Qwen3MLP
from engine.rope import rope_cos_sin
from engine.serve.attention import AttentionBackend, KVCache
from engine.fast.cpu_build import cache_dir as kernel_cache_dir
from engine.fast.fused import FusedFlatModel, Linear
from engine.serve.batch import BatchMeta

WARM_UP_ROWS = 256  # the start-up compile's step size
COMPILE_NICE = 10  # the background compile thread's niceness (0 = the serving thread's)
EAGER_ROWS = 256  # with the elementwise kernels, steps of at most this many rows run FusedFlatModel's eager path
SLOTS = ("qkv", "o", "gate_up", "down")  # engine_serve::linear's slot numbers
# What the compiler raises when it will not run a call (not errors of the engine's own ops, which
# pass through unchanged): torch's recompile limit under fullgraph=True, and dynamo's own failures.
COMPILER_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)


def compile_cache_dir() -> str:
    """Where TorchInductor keeps compiled graphs across runs: ``$TORCHINDUCTOR_CACHE_DIR`` when
    set, else an ``inductor`` folder in the engine's kernel cache (``cpu_build.cache_dir()``)."""
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
    """One decoder layer as a function of the rows, the residual and the layer's norm weights
    (``layer``), torch.compile'd once per ``_Shape``; compiled in the background (``compile``),
    ``ready`` once that is done (``error`` set if it failed: the engine then stays eager)."""

    def __init__(self, shape: _Shape) -> None:
        self.s = shape
        # emulate_precision_casts: a 16-bit graph rounds where eager PyTorch (and generate()) rounds,
        # instead of keeping a fused kernel's intermediates in float32 (which flipped a bf16 greedy token).
        self.layer = torch.compile(self._layer, dynamic=True, fullgraph=True,
                                   options={"emulate_precision_casts": True})
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self.thread: threading.Thread | None = None  # the background compile, while there is one
        # Measured once compiled, on the warm-up step: (graph ms, eager ms); the graph serves
        # steps only where it was the faster.
        self.timings: tuple[float, float] | None = None

    def _layer(self, hidden, residual, cos, sin, w_in, w_qk, w_post, pool_dtype: torch.dtype):
        """(hidden, residual) [N, D] each -> the next layer's (hidden, residual)."""
        s = self.s
        # Norms as RMSNorm rounds them: normalised (one rounding in a 16-bit dtype), then times the weight.
        residual = hidden + residual
        x = F.rms_norm(residual, (s.dim,), None, s.eps[0]) * w_in
        qkv = torch.ops.engine_serve.linear(x, 0, s.widths[0])  # [N, (Hq + 2 Hkv) Dh]
        qk = qkv[:, :(s.hq + s.hkv) * s.dh].reshape(-1, s.hq + s.hkv, s.dh)
        qk = F.rms_norm(qk, (s.dh,), None, s.eps[1]) * w_qk
        half = s.dh // 2
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
        v = qkv[:, (s.hq + s.hkv) * s.dh:].reshape(-1, s.hkv, s.dh)
        o = torch.ops.engine_serve.paged_attention(qk[:, :s.hq].to(pool_dtype), qk[:, s.hq:], v, s.scale, s.window)
        residual = torch.ops.engine_serve.linear(o.reshape(-1, s.hq * s.dh).to(x.dtype), 1, s.widths[1]) + residual
        x = F.rms_norm(residual, (s.dim,), None, s.eps[2]) * w_post
        gate, up = torch.ops.engine_serve.linear(x, 2, s.widths[2]).chunk(2, dim=-1)
        return torch.ops.engine_serve.linear(F.silu(gate) * up, 3, s.widths[3]), residual


# (shape, linear dtype, model dtype) -> the compiled layer graphs: shared by every engine and model
# of that shape in the process (their weights are inputs or the context's, never the graph's).
_graphs: dict[tuple, _LayerGraph] = {}
_graphs_lock = threading.Lock()


@atexit.register
def _finish_compiles() -> None:
    """At exit, let a background compile end first: stopping the interpreter under a thread that
    is inside TorchInductor aborts the process. (It may delay the exit by the compile's rest.)"""
    for graphs in list(_graphs.values()):
        if graphs.thread is not None and graphs.thread.is_alive():
            print("flat_model='compiled': waiting for the background compile to end before exiting", file=sys.stderr, flush=True)
            graphs.thread.join()


def inductor_available() -> str | None:
    """None when TorchInductor can compile for the CPU here, else why not (it compiles with
    ``$CXX`` when set, which must then be an executable)."""
    if os.environ.get("CXX"):
        from engine.fast.cpu_build import find_compiler

        try:
            find_compiler()
        except ValueError as e:
            return str(e).split(";")[0]
    elif not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "no C++ compiler (TorchInductor's CPU code is C++; install g++)"
    return None


def _cache_counts() -> tuple[int, int]:
    """(hits, misses) of TorchInductor's FX graph cache so far in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


class CompiledFlatModel(FusedFlatModel):
    """FusedFlatModel whose decoder layers run through one compiled layer graph; same contract.

    The engine is ready at once: the graph compiles in a background thread, and until it is done
    (``wait_compiled``) every step runs FusedFlatModel's eager path.

    Invariant: the graph holds no weights; every call reads this model's ``layers`` (through the
    step context) and its norm weights, so nothing is copied per engine or per layer.
    """

    def __init__(self, model: nn.Module, background: bool = True, layout: str | None = None) -> None:
        why = inductor_available()
        if why:
            raise ValueError(f"flat_model='compiled' needs TorchInductor: {why}; use flat_model='fused'")
        super().__init__(model, layout=layout, fuse_silu=False)  # the graph applies SiLU-mul to gate_up's [N, 2I]
        if any(not isinstance(layer.mlp, Qwen3MLP) for layer in model.model.layers):
            raise ValueError("flat_model='compiled' serves dense models only (this one has MoE layers); use 'fused'")
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
        self.linears = [[entry[k] for k in SLOTS] for entry in self.layers]
        self._eager_rows: int | None = None  # set: a fixed threshold (tests, levers.py); None: measured
        key = (self.shape, work, self.dtype)
        with _graphs_lock:
            graphs = _graphs.get(key)
            fresh = graphs is None
            if fresh:
                graphs = _graphs[key] = _LayerGraph(self.shape)
        self.graphs = graphs
        if fresh:
            if background:
                graphs.thread = threading.Thread(target=self._compile_in_background, name="engine-compile", daemon=True)
                graphs.thread.start()
            else:
                self._warm_up()

    @property
    def eager_rows(self) -> int:
        """Steps of at most this many rows run FusedFlatModel's eager path: every step where the
        compiled graph measured slower than eager on the warm-up step (``_LayerGraph.timings``);
        else, with the elementwise kernels, decode-sized steps (``EAGER_ROWS``), without them only
        one-row steps (a size the graph would specialise on)."""
        if self._eager_rows is not None:
            return self._eager_rows
        timings = self.graphs.timings
        if timings is not None and timings[0] >= timings[1]:
            return sys.maxsize
        return EAGER_ROWS if self.elementwise else 1

    @eager_rows.setter
    def eager_rows(self, rows: int) -> None:
        self._eager_rows = rows

    def _compile_in_background(self) -> None:
        """``_warm_up`` at a lower scheduling priority (Linux: nice is per thread, and the compiler
        processes it starts inherit it), so that serving, not compiling, gets the cores first."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
        except (AttributeError, OSError):
            pass
        self._warm_up()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the graph is compiled (or ``timeout`` s pass); whether it is in use now."""
        graphs = self.graphs
        if graphs.ready.wait(timeout) and graphs.thread is not None:
            graphs.thread.join()  # its last lines: an interpreter must not exit under a live compile thread
        return graphs.ready.is_set() and graphs.error is None

    def _warm_up(self, rows: int = WARM_UP_ROWS) -> None:
        """Compile (in the background at start-up) on a dummy step of ``rows`` rows whose attention
        returns zeros: the graph is dynamic in N, so every later step size reuses it. Announced on
        stderr with its duration; a failure is announced too and leaves the engine eager."""
        cfg, work, graphs = self.cfg, self.linear_dtype, self.graphs
        print(f"flat_model='compiled': compiling the decoder layer ({cfg.num_hidden_layers} layers, one graph) with "
              f"TorchInductor in the background (steps run eagerly until it is done); cache "
              f"{os.environ['TORCHINDUCTOR_CACHE_DIR']}", file=sys.stderr, flush=True)
        hits, misses = _cache_counts()
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                hidden = torch.zeros((rows, cfg.hidden_size), dtype=work, device=self.device)
                cos, sin = rope_cos_sin(torch.arange(rows, device=self.device), cfg.head_dim, cfg.rope_theta, work)
                step = _Step(None, _ZeroAttention(), [None] * cfg.num_hidden_layers, self.linears)
                self._run(hidden, cos, sin, step, self.dtype, compiled=True)
                graphs.seconds = time.perf_counter() - start
                graphs.timings = self._time_paths(rows)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: say so, stay eager
            graphs.error = exc
            print(f"flat_model='compiled': compiling failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                  "this engine keeps running eagerly", file=sys.stderr, flush=True)
        else:
            hits2, misses2 = _cache_counts()
            graph_ms, eager_ms = graphs.timings
            use = ("every step stays eager (the graph is not faster here)" if self.eager_rows == sys.maxsize else
                   f"steps of more than {self.eager_rows} rows now run the graph")
            print(f"flat_model='compiled': compiled in {graphs.seconds:.1f} s (FX graph cache: {hits2 - hits} hit(s), "
                  f"{misses2 - misses} miss(es)); a {rows}-row step: graph {graph_ms:.1f} ms, eager {eager_ms:.1f} ms; "
                  f"{use}", file=sys.stderr, flush=True)
        finally:
            gc.collect()  # the compiler's garbage, and its heap memory back to the OS (~50-100 MB)
            trim_heap()
            graphs.ready.set()

    def _time_paths(self, rows: int, rounds: int = 3) -> tuple[float, float]:
        """(graph ms, eager ms) of one dummy step of ``rows`` rows (attention returning zeros), the
        fastest of ``rounds`` interleaved rounds each."""
        cfg = self.cfg
        ids, positions = torch.zeros(rows, dtype=torch.long, device=self.device), torch.arange(rows, device=self.device)
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        caches, zero = [(empty, empty)] * cfg.num_hidden_layers, _ZeroAttention()
        paths = (lambda: self._graph_forward(ids, positions, caches, None, zero),
                 lambda: FusedFlatModel.forward(self, ids, positions, caches, None, zero))
        best = [float("inf"), float("inf")]
        for _ in range(rounds):
            for i, path in enumerate(paths):
                start = time.perf_counter()
                path()
                best[i] = min(best[i], (time.perf_counter() - start) * 1000)
        return best[0], best[1]

    def _run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: _Step,
             pool_dtype: torch.dtype, compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer through the graph: hidden [N, D] -> the last layer's (hidden, residual)."""
        cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, Dh]: broadcast over heads
        outer, _context.step = _context.step, step
        try:
            residual = torch.zeros_like(hidden)  # layer 0 adds nothing (x + 0 == x exactly)
            for i, norms in enumerate(self.norms):
                step.layer = i
                hidden, residual = self.graphs.layer(hidden, residual, cos, sin, *norms, pool_dtype)
            return hidden, residual
        finally:
            _context.step = outer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: BatchMeta, backend: AttentionBackend, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden [N, D] in ``linear_dtype`` (with ``keep_rows``,
        int64 [M]: those rows' [M, D]). FusedFlatModel's eager path for steps of at most
        ``eager_rows`` rows and while the graph is still compiling; else every layer through the
        graph, and the final norm on the kept rows."""
        graphs = self.graphs
        if not graphs.ready.is_set() or graphs.error is not None or input_ids.shape[0] <= self.eager_rows:
            return super().forward(input_ids, positions, kv_caches, meta, backend, keep_rows=keep_rows)
        try:
            return self._graph_forward(input_ids, positions, kv_caches, meta, backend, keep_rows)
        except COMPILER_ERRORS as exc:
            # The compiler refused this call (a recompile past torch's limit, a guard it cannot
            # build): this step and every later one run eagerly. Whatever layers the graph ran
            # before refusing wrote the same K/V slots the eager pass writes again.
            graphs.error = exc
            print(f"flat_model='compiled': the layer graph failed mid-run ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); running eagerly from now on",
                  file=sys.stderr, flush=True)
            return super().forward(input_ids, positions, kv_caches, meta, backend, keep_rows=keep_rows)

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                       meta: BatchMeta | None, backend: AttentionBackend, keep_rows: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """``forward`` through the layer graph (compiled, or compiling on this call)."""
        cfg, work = self.cfg, self.linear_dtype
        hidden = self.embed(input_ids)  # [N, D]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, work)  # [N, Dh]
        step = _Step(meta, backend, kv_caches, self.linears)
        hidden, residual = self._run(hidden, cos, sin, step, kv_caches[0][0].dtype)
        if keep_rows is not None:
            hidden, residual = hidden.index_select(0, keep_rows), residual.index_select(0, keep_rows)
        return self._add_norm(hidden, residual, self.model.model.norm)[0]
