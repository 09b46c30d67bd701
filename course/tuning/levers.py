"""A/B measurements behind docs/performance.md's "levers" list (interleaved rounds, medians).

    python -m course.tuning.levers attention [--requests 64] [--context 200]   decode attention, one layer
    python -m course.tuning.levers step [--requests 64] [--dtype float32]      one engine decode step
    python -m course.tuning.levers step --prefill [--requests 8]               one prefill step (a fresh engine's first)
    python -m course.tuning.levers prefill-attention --preset small --requests 32 --context 64 --dtype bfloat16
        [--prefix 200] [--before 6ddabc4]     one step's attention, every layer: kernel / sdpa / blocked / probe
    python -m course.tuning.levers parts [--requests 64] [--context 64]        the fast core's decode step: linears / attention / write / rest
    python -m course.tuning.levers linear [--threads 1]                          one step's linears: the kernel, prefetch on/off, oneDNN
    python -m course.tuning.levers elementwise                                  eager vs compiled norms/RoPE/SiLU
    python -m course.tuning.levers argmax --requests 16                         greedy rows: argmax vs max().indices per dtype
    python -m course.tuning.levers pages --requests 64 --dtype bfloat16          decode attention: K/V pools on 4 KiB vs huge pages
    python -m course.tuning.levers linear-pages --requests 1 --rounds 5         0.6B-shape weights streamed: torch's allocator on huge pages or not
    python -m course.tuning.levers ew-step [--preset qwen3-0.6b] [--rows 2048] [--before 6ddabc4]   one step's elementwise kernels: torch ops / avx2 / avx512 / a revision's
    python -m course.tuning.levers linear-amx [--preset qwen3-0.6b] [--rows 1,16,64,256]   bf16 linears: oneDNN packed vs the AMX kernel
    python -m course.tuning.levers linear-threads [--rows 16,64]   each weight shape's kernel (panels, AMX) at one thread and two
    python -m course.tuning.levers workload-parts --dtype bfloat16 [--rounds 3]   a workload's time per part, one thread and two, its prompt and decode steps apart
    python -m course.tuning.levers lm-head --rows 1,16,64   a bf16 LM head's logits (AMX): widened after it or as it writes them

``attention`` times one layer's decode attention on the bench's small-model shapes (8 query / 4
kv heads of 64, blocks of 16): TorchBackend (gather, then bmm), CPUBackend (the C++ kernel reading
the pool in place; over four layers' pools also without its prefetch, and without its AVX-512
blocked path of 16 keys at a time) and the same gather-free attention written as tensor indexing and compiled by
TorchInductor (the lever measured first and not kept). ``step`` times the core's decode step with
R requests of ~200-token contexts (``--prefill``: a fresh engine's first step over R prompts), for
the torch backend, the cpu backend, the cpu backend with the fused flat model, and with the compiled one and
``compile`` (``--variants`` picks). ``elementwise`` times one layer's residual adds, norms, RoPE and SiLU-mul, eager
against TorchInductor-compiled, at 16, 64 and 600 rows.
"""
from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import os  # noqa: E402

os.environ.setdefault("ENGINE_IMPL", "solution")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def interleaved(fns: dict, rounds: int) -> dict[str, float]:
    """Median ms of each callable, called in turn ``rounds`` times (after one warm-up call each),
    in reverse order every other round: whichever runs right after another meets the caches that
    one left (the same weights in L2, or another variant's), so a fixed order favoured one."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for round_ in range(rounds):
        for k, f in (reversed(fns.items()) if round_ % 2 else fns.items()):
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return {k: round(statistics.median(v) * 1000, 3) for k, v in times.items()}


def inductor_decode(q, k_pool, v_pool, tables, q_pos, scale):
    """Gather-free decode attention as indexing + reductions, for TorchInductor to fuse."""
    g, hq, d = q.shape
    bs, hkv = k_pool.shape[1], k_pool.shape[2]
    pos = torch.arange(tables.shape[1] * bs)
    block, within = tables[:, pos // bs], pos % bs
    k, v = k_pool[block, within], v_pool[block, within]  # [G, L, Hkv, D], fused loads
    scores = (q.view(g, 1, hkv, hq // hkv, d) * k[:, :, :, None, :]).sum(-1) * scale
    scores = scores.masked_fill((pos[None, :] > q_pos[:, None])[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    return (probs[..., None] * v[:, :, :, None, :]).sum(1).reshape(g, hq, d)


def attention(args) -> None:
    from engine.serve.attention import ReferenceBackend
    from engine.serve.batch import build_batch
    from engine.fast.cpu_attention import CPUBackend
    from engine.serve.request import Request
    from engine.fast.torch_attention import TorchBackend

    r, bs, hq, hkv, d = args.requests, 16, 8, 4, 64
    width = -(-(args.context + 10) // bs)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(r * width + 2, generator=gen).tolist()
    scheduled, tables = [], []
    for i in range(r):
        n = args.context + i % 10
        req = Request(f"r{i}", [1] * (n + 1))
        req.num_computed_tokens = n - 1
        scheduled.append((req, 1))
        tables.append(perm[i * width:i * width + -(-n // bs)])
    meta = build_batch(scheduled, tables, bs).meta
    caches = [(torch.randn(r * width + 3, bs, hkv, d, generator=gen), torch.randn(r * width + 3, bs, hkv, d, generator=gen))
              for _ in range(4)]  # a step's four layers: together they do not stay in cache between calls
    cache = caches[0]
    with torch.inference_mode():
        q = torch.randn(r, hq, d, generator=gen)
        torch_b, cpu_b = TorchBackend(cascade_min_reqs=0), CPUBackend()
        compiled = torch.compile(inductor_decode, dynamic=True)
        w = -(-meta.max_seq_len // bs)
        tab, q_pos = meta.block_table[:, :w].long(), meta.seq_lens.long() - 1
        want = ReferenceBackend().forward(q, cache, meta)
        for name, got in (("cpu", cpu_b.forward(q, cache, meta)),
                          ("inductor", compiled(q, *cache, tab, q_pos, d ** -0.5))):
            assert (got - want).abs().max().item() < 1e-5, name
        lib = cpu_b._lib

        def cpu(prefetch: bool, blocked: bool = True):  # the kernel with / without its prefetch, its blocked path
            def run():
                lib.paged_set_prefetch(int(prefetch))
                lib.paged_set_blocked(int(blocked))
                for c in caches:
                    cpu_b.forward(q, c, meta)
                lib.paged_set_prefetch(1)
                lib.paged_set_blocked(1)
            return run
        res = interleaved({"torch (gather + bmm)": lambda: torch_b.forward(q, cache, meta),
                           "cpu (C++ kernel, in place)": lambda: cpu_b.forward(q, cache, meta),
                           f"cpu, {len(caches)} layers' pools": cpu(True),
                           f"cpu, {len(caches)} layers' pools, no prefetch": cpu(False),
                           f"cpu, {len(caches)} layers' pools, one score at a time": cpu(True, blocked=False),
                           "inductor (compiled, gather-free)": lambda: compiled(q, *cache, tab, q_pos, d ** -0.5)},
                          args.rounds)
    print(f"decode attention, one layer, R={r}, context ~{args.context}, {torch.get_num_threads()} thread(s): {res}")


def paged_step(preset: str, requests: int, rows: int, prefix: int, dtype: torch.dtype, bs: int = 16):
    """A step of ``requests`` requests of ``rows`` query rows each after ``prefix`` cached tokens
    (rows=1: decodes), at the preset's attention shape, with one pool per layer (a step's layers
    do not share a cache line): (q per layer [N, Hq, D], pools per layer, meta)."""
    from course.bench.compare import MODEL_PRESETS
    from engine.models.tiny import tiny_config
    from engine.serve.batch import build_batch
    from engine.serve.request import Request

    cfg = tiny_config(False, **MODEL_PRESETS[preset])
    hq, hkv, d, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    need = -(-(prefix + rows) // bs)
    num_blocks = requests * need + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    scheduled, tables = [], []
    for i in range(requests):
        req = Request(f"r{i}", [1] * (prefix + rows + 1))
        req.num_computed_tokens = prefix
        scheduled.append((req, rows))
        tables.append(perm[i * need:(i + 1) * need])
    meta = build_batch(scheduled, tables, bs).meta
    pools = [tuple(torch.randn(num_blocks + 1, bs, hkv, d, generator=gen).to(dtype) for _ in range(2))
             for _ in range(layers)]
    qs = [torch.randn(requests * rows, hq, d, generator=gen).to(dtype) for _ in range(layers)]
    return qs, pools, meta


def prefill_attention(args) -> None:
    """One step's attention over every layer of the preset (``--requests`` x ``--context`` rows
    after ``--prefix`` cached tokens; ``--context 1``: decodes): the cpu backend's paths side by
    side, interleaved (wall and CPU ms, median), checked against each other first."""
    from course.bench.machine import machine_line
    from engine.fast import cpu_decode_variant, cpu_prefill
    from engine.fast.cpu_attention import CPUBackend
    from engine.fast.torch_attention import TorchBackend

    dtype = getattr(torch, args.dtype)
    qs, pools, meta = paged_step(args.preset, args.requests, args.context, args.prefix, dtype)
    variants = {}
    if args.before:  # the row kernel as it was at a git revision: every row through that library
        variants[f"before ({args.before})"] = kernel_at(args.before)
    variants.update({path: CPUBackend(prefill=path) for path in ("kernel", "sdpa", "blocked")})
    hq, hkv, d = qs[0].shape[1], pools[0][0].shape[2], qs[0].shape[2]
    if cpu_prefill.amx_serves(dtype, hq, hkv, d):  # bfloat16 on a CPU with AMX
        variants["amx"] = CPUBackend(prefill="amx")
    if dtype == torch.bfloat16:  # its scores as vdpbf16ps dot products (cpu_decode_variant)
        variants["kernel, dpbf16 build"] = CPUBackend(prefill="kernel", decode="dpbf16")
    variants["kernel, avx2 build"] = CPUBackend(prefill="kernel", decode="avx2")
    if args.context > 1:
        variants["auto (probe)"] = CPUBackend(prefill="auto")
        variants["torch tiles"] = TorchBackend(cascade_min_reqs=0)
    with torch.inference_mode():
        outs = {k: b.forward(qs[0], pools[0], meta) for k, b in variants.items()}
        base = outs["kernel"].double()
        for k, o in outs.items():
            err = (o.double() - base).abs().max().item()
            assert err < (3e-2 if dtype == torch.bfloat16 else 1e-4), f"{k} differs from the kernel by {err}"

        def run(b):
            def f():
                for q, c in zip(qs, pools):
                    b.forward(q, c, meta)
            return f
        wall, cpu = timed_rounds({k: run(b) for k, b in variants.items()}, args.rounds)
    hq, d = qs[0].shape[1:]
    gflop = len(qs) * args.requests * cpu_prefill.flops(args.context, args.prefix, hq, d) / 1e9
    print(machine_line(torch.get_num_threads()))
    print(f"attention of one step, {args.preset} preset ({len(qs)} layers, {hq} heads of {d}), {args.dtype}, "
          f"{args.requests} x {args.context} rows after {args.prefix} cached, {torch.get_num_threads()} thread(s), "
          f"{gflop:.2f} GFLOP; median ms (wall / cpu, GFLOP/s):")
    first = next(iter(variants))
    for k in variants:
        vs = f", {cpu[first] / cpu[k]:.2f}x as fast as {first} in CPU time" if args.before else ""
        print(f"  {k:18s} {wall[k]:9.3f} / {cpu[k]:9.3f}  ({gflop / wall[k] * 1000:.0f} GFLOP/s{vs})")
    print("  prefill choice: " + "; ".join(cpu_prefill.chosen_report()))
    print("  kernel build: " + "; ".join(cpu_decode_variant.chosen_report()))


def library_at(rev: str, source: str):
    """engine/fast/``source`` as it was at git revision ``rev`` (with that revision's headers),
    built like today's kernels."""
    import subprocess
    import tempfile

    from engine.fast import cpu_build

    root = Path(__file__).resolve().parents[2]
    folder = Path(tempfile.mkdtemp(prefix="kernel-at-"))
    listing = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", rev, "engine/fast/"],
                             capture_output=True, text=True, check=True).stdout.split()
    for name in listing:
        if name.endswith((".h", source)):
            text = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{name}"], capture_output=True, text=True,
                                  check=True).stdout
            (folder / Path(name).name).write_text(text)
    return cpu_build.build_library(folder / source)


def kernel_at(rev: str):
    """A CPUBackend whose every row goes through ``cpu_paged_kernel.cpp`` as it was at git revision
    ``rev`` (with the headers of that revision), built like today's: the "before" of an A/B."""
    from engine.fast import cpu_attention

    lib = library_at(rev, "cpu_paged_kernel.cpp")
    cpu_attention._declare(lib)
    backend = cpu_attention.CPUBackend(prefill="kernel")
    run = backend._run
    backend._run = lambda *a, **k: run(*a, **{**k, "lib": lib})
    return backend


def timed_rounds(fns: dict, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """``interleaved`` with CPU time beside wall time: (median wall ms, median process CPU ms) per callable."""
    for f in fns.values():
        f()
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            w, c = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - w)
            cpu[k].append(time.process_time() - c)
    med = lambda v: round(statistics.median(v) * 1000, 3)  # noqa: E731
    return {k: med(v) for k, v in wall.items()}, {k: med(v) for k, v in cpu.items()}


def step(args) -> None:
    from course.bench.compare import MODEL_PRESETS
    from engine.models import tiny_model
    from engine.serve import EngineConfig, EngineCore, FlatModel, SamplingParams
    from engine.fast.torch_attention import TorchBackend

    from engine.fast.linear_layout import LAYOUTS

    dtype = getattr(torch, args.dtype)
    shape = dict(MODEL_PRESETS[args.preset], **({"num_hidden_layers": args.layers} if args.layers else {}))
    model = tiny_model(seed=0, **shape).to(dtype)
    variants = args.variants.split(",")

    def engine(name: str, prefill: bool) -> EngineCore:
        rng = random.Random(0)
        backend, _, fuse = name.partition("+")
        variant = fuse.partition("/")[2]
        if variant in LAYOUTS:  # every linear in that layout (by default each shape's measured fastest)
            os.environ["ENGINE_LINEAR_LAYOUT"] = variant
        try:
            core = EngineCore(model, EngineConfig(attention_backend=backend.removesuffix("/tiles").removesuffix("/rows"),
                                                  flat_model=fuse.partition("/")[0] or "flat",
                                                  num_blocks=args.requests * 20 + 1, max_num_seqs=max(256, args.requests)))
        finally:
            os.environ.pop("ENGINE_LINEAR_LAYOUT", None)
        if backend == "cpu/tiles":  # the cpu backend's previous design: only decode rows in the kernel
            core.runner.backend.prefill_in_place = False
        if backend == "cpu/rows":  # every row through the row kernel, prefill rows too (no matrix path)
            core.runner.backend.prefill = "kernel"
        if fuse.startswith("compiled"):
            core.flat.wait_compiled()  # the graph compiles in the background; measure it, not the eager path
        if fuse == "compiled/all":  # every step through the graph (by default decodes take the eager path)
            core.flat.eager_rows = 1
        if fuse.endswith("/torch-ew"):  # the PyTorch elementwise ops and the reference's write_kv
            core.flat.elementwise = False
            core.runner.backend.write = functools.partial(TorchBackend.write, core.runner.backend)
        if fuse.endswith("/all-rows"):  # the last layer on every row, not only the logits rows
            core.flat.logits = functools.partial(FlatModel.logits, core.flat)
        if fuse.endswith("/no-prefetch"):  # the small-batch linear kernel without its software prefetch
            for entry in core.flat.layers:
                for linear in entry.values():
                    if getattr(linear, "small", None) is not None:
                        linear.small.prefetch = False
        for i in range(args.requests):
            core.add_request(f"s{i}", [rng.randrange(512) for _ in range(args.context)],
                             SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0))
        if not prefill:
            while any(r.num_computed_tokens < r.num_prompt_tokens - 1 for r in core.scheduler.requests.values()):
                core.step()
        return core

    if args.prefill:  # the first step of a fresh engine: every prompt's first chunk
        pending = {name: engine(name, True) for name in variants}

        def first_step(name):
            def run():
                core = pending.pop(name)
                start = time.perf_counter()
                core.step()
                took = time.perf_counter() - start
                pending[name] = engine(name, True)  # built outside the timed part
                return took
            return run
        fns = {name: first_step(name) for name in variants}
        times = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(args.rounds):
            for k, f in fns.items():
                times[k].append(f())
        res = {k: round(statistics.median(v) * 1000, 3) for k, v in times.items()}
        what = f"prefill step ({min(args.requests * args.context, 2048)} rows)"
    else:
        cores = {name: engine(name, False) for name in variants}
        res = interleaved({k: c.step for k, c in cores.items()}, args.rounds)
        what = "decode step"
    from course.bench.machine import machine_line

    layers = f", {args.layers} of its layers" if args.layers else ""
    print(machine_line(torch.get_num_threads()))
    print(f"{what}, {args.preset} preset{layers}, R={args.requests}, context ~{args.context}, {args.dtype}, "
          f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}, ms: {res}")


class PartTimer:
    """Wall time per named part of a step, from timers wrapped around the calls that make up each
    part (``wrap`` a function, ``patch`` a class's method in place); a call made inside another
    timed call counts once, in the outer one's part. ``spent``: part -> seconds so far."""

    def __init__(self, spent: dict[str, float] | None = None) -> None:
        self.spent = spent if spent is not None else {}
        self._depth = 0

    def wrap(self, inner, part: str):
        def call(*a, **k):
            self._depth += 1
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.spent[part] = self.spent.get(part, 0.0) + time.perf_counter() - start
        return call

    def patch(self, cls, name: str, part: str) -> None:
        setattr(cls, name, self.wrap(getattr(cls, name), part))

    def patch_linears(self, part: str = "linears") -> None:
        """Every linear layout's entry point as ``part``: ``Linear`` (oneDNN's and the plain
        tensor's), the panels' and the AMX tiles' direct ``run`` and the AMX layout's own call."""
        from engine.fast import cpu_linear, cpu_linear_amx, linear_layout
        for cls, name in ((linear_layout.Linear, "__call__"), (cpu_linear.SmallLinear, "run"),
                          (cpu_linear_amx.AmxLinear, "run"), (cpu_linear_amx.AmxLinear, "__call__")):
            self.patch(cls, name, part)


def parts(args) -> None:
    """Where the fast core's decode step goes (the fused flat model, the cpu backend): timers around
    the linears (every layout's kernel: the panels', the AMX tiles', oneDNN's through ``Linear``),
    the cpu backend's attention and its K/V write (the rest: the elementwise work, embedding, the
    Python of the layer loop, schedule, build, sample, bookkeeping). A call inside another timed
    call counts once. Median of ``--rounds`` steps after 5 settled."""
    from course.bench.compare import MODEL_PRESETS
    from engine.models import tiny_model
    from engine.serve import EngineConfig, EngineCore, SamplingParams
    from engine.fast import cpu_attention

    spent = {"linears": 0.0, "attention": 0.0, "write": 0.0}
    timer = PartTimer(spent)
    timer.patch_linears()
    timer.patch(cpu_attention.CPUBackend, "forward", "attention")
    timer.patch(cpu_attention.CPUBackend, "forward_into", "attention")
    timer.patch(cpu_attention.CPUBackend, "write", "write")
    timer.patch(cpu_attention.CPUBackend, "write_merged", "write")
    model = tiny_model(seed=0, **MODEL_PRESETS["small"]).to(getattr(torch, args.dtype))
    core = EngineCore(model, EngineConfig(attention_backend="cpu", flat_model="fused", max_num_seqs=256,
                                          num_blocks=args.requests * (-(-(args.context + 80) // 16) + 1) + 1))
    rng = random.Random(0)
    for i in range(args.requests):
        core.add_request(f"s{i}", [rng.randrange(512) for _ in range(args.context)],
                         SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0))
    while any(r.num_computed_tokens < r.num_prompt_tokens - 1 for r in core.scheduler.requests.values()):
        core.step()
    for _ in range(5):
        core.step()
    rows = []
    for _ in range(args.rounds):
        for k in spent:
            spent[k] = 0.0
        start = time.perf_counter()
        core.step()
        rows.append({"step": time.perf_counter() - start, **spent})
    med = {k: statistics.median(r[k] for r in rows) * 1000 for k in rows[0]}
    med["rest"] = med["step"] - med["linears"] - med["attention"] - med["write"]
    print(f"decode step, R={args.requests}, context ~{args.context}, {args.dtype}, {torch.get_num_threads()} "
          f"thread(s), ms: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))


def workload_parts(args) -> None:
    """Where a whole workload's time goes at one thread and at two, and so what caps a second
    thread: the fast core (``run.py bench``'s: cpu backend, fused model) serving ``--workload``
    (random by default) on ``--preset``, in one process, each round one run at one thread and one
    at two (the order alternating), timers around each part's calls (a call inside another timed
    call counts once), median ms per part over ``--rounds`` rounds after one to warm up. The parts:
    the linears (every layout's), attention, K/V writes, the elementwise kernels' calls, the LM head,
    the embedding; the scheduler, ``build_batch`` (the runner's ``prepare``), the sampler; "rest": the
    step's other Python (the forward's own and the bookkeeping), and outside the steps. Last, the cap
    Amdahl puts on two threads: one thread's time over (its unsplit parts + the others at 2x); and the
    forward passes alone (``runner.execute``, timed apart: its parts and the Python between them); and
    the steps whose batch holds prompt rows and the decode-only ones (one row per request) apart:
    their whole steps, forward passes and kernel parts, and for the decode steps the rate at which
    their attention read the pools (each row's context, every layer's K and V) beside the memory's
    (``roofline.machine_limits``) at one thread and two."""
    from course.bench.compare import MODEL_PRESETS, CoreRunner, fast_config, make_workload, run_workload
    from course.bench.machine import machine_line
    from course.bench.roofline import machine_limits
    from engine.fast import cpu_attention, cpu_elementwise, fused
    from engine.models import tiny_model

    print(machine_line(2))
    timer = PartTimer()
    spent = timer.spent
    timer.patch_linears()
    for name in ("forward", "forward_into", "forward_rows"):
        timer.patch(cpu_attention.CPUBackend, name, "attention")
    for name in ("write", "write_merged"):
        timer.patch(cpu_attention.CPUBackend, name, "K/V writes")
    timer.patch(fused.FusedFlatModel, "compute_logits", "LM head")
    timer.patch(fused.FusedFlatModel, "embed", "embedding")
    functions = cpu_elementwise.functions
    cpu_elementwise.functions = lambda work: tuple(timer.wrap(f, "elementwise") for f in functions(work))
    for name in ("add_rms_norm", "qk_norm_rope", "silu_mul"):
        timer.patch(cpu_elementwise, name, "elementwise")
    model = tiny_model(seed=0, **MODEL_PRESETS[args.preset]).to(getattr(torch, args.dtype))
    runner = CoreRunner(model, "cpu", max_num_seqs=256, **fast_config("cpu"))
    core = runner.core
    timer.patch(core.scheduler, "schedule", "scheduler")  # these three on the instances
    timer.patch(core.runner, "prepare", "build_batch")
    timer.patch(core, "sampler", "sampler")
    forward = PartTimer()  # the whole forward pass (its parts and the Python between them), timed apart
    forward.patch(core.runner, "execute", "forward")
    step, execute = core.step, core.runner.execute
    cfg = model.cfg
    kv_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers * core.runner.kv_caches[0][0].element_size()
    kind = [""]  # the step's kind, from the batch its forward pass got
    by_kind: dict[str, dict[str, float]] = {}  # kind -> part -> seconds (and "steps", "K/V bytes") of the current run

    def execute_noting(batch):
        kind[0] = "decode" if batch.meta.decode_only else "prompt"
        if batch.meta.decode_only:  # the keys and values its attention reads, every layer: K/V bytes a token x context
            tally = by_kind.setdefault("decode", {})
            tally["K/V bytes"] = tally.get("K/V bytes", 0.0) + kv_bytes * int(batch.meta.seq_lens_cpu.sum())
        return execute(batch)
    core.runner.execute = execute_noting

    def whole_step():
        kind[0] = ""
        before, before_fwd = dict(spent), forward.spent.get("forward", 0.0)
        start = time.perf_counter()
        try:
            return step()
        finally:
            took = time.perf_counter() - start
            spent["step"] = spent.get("step", 0.0) + took
            if kind[0]:
                tally = by_kind.setdefault(kind[0], {})
                for part, seconds in spent.items():
                    if part != "step":
                        tally[part] = tally.get(part, 0.0) + seconds - before.get(part, 0.0)
                tally["steps"] = tally.get("steps", 0) + 1
                tally["step"] = tally.get("step", 0.0) + took
                tally["forward"] = tally.get("forward", 0.0) + forward.spent.get("forward", 0.0) - before_fwd
    core.step = whole_step
    work = make_workload(args.workload, model.cfg.vocab_size, preset=args.preset)
    rows: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    passes: dict[int, list[float]] = {1: [], 2: []}  # the forward passes' time per run
    kinds: dict[int, list[dict[str, dict[str, float]]]] = {1: [], 2: []}  # per run, by_kind
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for threads in ((1, 2) if round_ % 2 else (2, 1)):
            torch.set_num_threads(threads)
            spent.clear()
            forward.spent.clear()
            by_kind.clear()
            start = time.perf_counter()
            run_workload(runner.fresh(), work)
            total = time.perf_counter() - start
            if round_:
                parts = {k: v for k, v in spent.items() if k != "step"}
                inside = spent.get("step", 0.0) - sum(parts.values())
                rows[threads].append({**parts, "rest of the step": inside, "outside the steps": total - spent.get("step", 0.0),
                                      "all": total})
                passes[threads].append(forward.spent.get("forward", 0.0))
                kinds[threads].append({k: dict(v) for k, v in by_kind.items()})
    torch.set_num_threads(args.threads)
    names = list(rows[1][0])
    med = {t: {k: statistics.median(r.get(k, 0.0) for r in rows[t]) * 1000 for k in names} for t in (1, 2)}
    print(f"{args.preset}, {args.dtype}, workload {args.workload!r}: median ms of {args.rounds} round(s)")
    print(f"{'part':20s} {'1 thread':>9s} {'2 threads':>9s} {'x':>6s}")
    for k in names:
        one, two = med[1][k], med[2][k]
        print(f"{k:20s} {one:9.1f} {two:9.1f} {one / two if two else float('nan'):5.2f}x")
    serial = sum(med[1][k] for k in ("scheduler", "build_batch", "sampler", "rest of the step", "outside the steps"))
    print(f"one thread's serial Python (scheduler, build_batch, sampler, rest, outside): {serial:.1f} ms "
          f"({serial / med[1]['all']:.0%}); with every other part at 2x, two threads would cap at "
          f"{med[1]['all'] / (serial + (med[1]['all'] - serial) / 2):.2f}x")
    whole = {t: statistics.median(passes[t]) * 1000 for t in (1, 2)}
    inner = ("embedding", "elementwise", "linears", "K/V writes", "attention", "LM head")
    between = {t: whole[t] - sum(med[t].get(k, 0.0) for k in inner) for t in (1, 2)}
    print(f"the forward passes alone (runner.execute): {whole[1]:.1f} -> {whole[2]:.1f} ms, {whole[1] / whole[2]:.2f}x; "
          f"of which the Python between their parts (in 'rest' above): {between[1]:.1f} -> {between[2]:.1f} ms")
    inner_parts = [k for k in names if k in inner]
    for k, label in (("prompt", "steps with prompt rows"), ("decode", "decode-only steps (one row per request)")):
        if not all(k in run for t in (1, 2) for run in kinds[t]):
            continue
        at = {t: {part: statistics.median(run[k].get(part, 0.0) for run in kinds[t]) * 1000
                  for part in ("step", "forward", *inner_parts)} for t in (1, 2)}
        print(f"{label}, {kinds[1][0][k]['steps']:.0f} of them: whole steps {at[1]['step']:.1f} -> {at[2]['step']:.1f} ms, "
              f"{at[1]['step'] / at[2]['step']:.2f}x; their forward passes {at[1]['forward']:.1f} -> "
              f"{at[2]['forward']:.1f} ms, {at[1]['forward'] / at[2]['forward']:.2f}x; "
              + ", ".join(f"{part} {at[1][part]:.1f} -> {at[2][part]:.1f}" for part in inner_parts))
        if k == "decode" and at[1].get("attention", 0.0) > 0 and at[2].get("attention", 0.0) > 0:
            gb = kinds[1][0][k]["K/V bytes"] / 1e9
            read = {}
            for t in (1, 2):
                torch.set_num_threads(t)
                read[t] = machine_limits()["read_bandwidth"] / 1e9
            torch.set_num_threads(args.threads)
            print(f"  their attention reads {gb:.2f} GB of K/V (the pools' bytes a token x each row's context, every "
                  f"layer): {gb / at[1]['attention'] * 1000:.1f} GB/s on one thread, "
                  f"{gb / at[2]['attention'] * 1000:.1f} on two; the memory (roofline.machine_limits, a sum over "
                  f"256 MiB): {read[1]:.1f} and {read[2]:.1f} GB/s")


def linear(args) -> None:
    """The small-batch kernel on one step's linears (every layer's weights: they do not fit in
    the caches together), with and without its software prefetch, oneDNN's prepacked matmul and
    the plain weight through F.linear; where the kernel is built at 16-float (AVX-512) width,
    "prefetch" is that width and "8-float" the same kernel at 8-float width (``ENGINE_KERNEL_ISA=avx2``);
    ``--preset`` the model's shapes (``--layers`` of them),
    ``--rows`` the row counts. Beside each time: GFLOP/s, and the GB of weights each variant
    holds read per second (at one row a linear streams its weight once: compare with the memory
    bandwidth that ``course.bench.roofline.machine_limits`` measures, the one the bench's roofline uses).
    ``--dtype bfloat16``: bfloat16 weights with float32 inputs, as a bfloat16 model runs on a CPU
    without bf16 units: the kernel on the weights' own bfloat16 panels, on float32 panels of the
    same values, oneDNN and F.linear on float32 copies (and oneDNN's bfloat16 matmul where the CPU
    has bf16 units)."""
    from course.bench.compare import MODEL_PRESETS
    from course.bench.roofline import describe, machine_limits
    from engine.fast import cpu_elementwise
    from engine.fast.cpu_linear import SmallLinear
    from engine.fast.fused import Linear, fast_16bit_matmul

    p = MODEL_PRESETS[args.preset]
    d, inter, hq, hkv, dh = p["hidden_size"], p["intermediate_size"], p["num_attention_heads"], \
        p["num_key_value_heads"], p["head_dim"]
    shapes = [((hq + 2 * hkv) * dh, d), (d, hq * dh), (2 * inter, d), (d, inter)] * (args.layers or p["num_hidden_layers"])
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if dtype not in (torch.float32, torch.bfloat16):
        raise SystemExit("levers.py linear: --dtype float32 or bfloat16")
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes]
    wide = [w.float() for w in weights]  # float32 values (the same ones for a bfloat16 model)
    layers: dict[str, list] = {}
    if dtype == torch.bfloat16:
        layers["bf16 panels"] = [SmallLinear(w) for w in weights]
    layers["prefetch"] = [SmallLinear(w) for w in wide]
    if layers["prefetch"][0].width != "avx2":  # the kernel at 8-float width too (the widest runs above)
        os.environ[cpu_elementwise.ISA_ENV] = "avx2"
        try:
            layers["8-float"] = [SmallLinear(w) for w in wide]
        finally:
            os.environ.pop(cpu_elementwise.ISA_ENV)
    layers["onednn"] = [Linear(w, "packed") for w in wide]
    if dtype == torch.bfloat16 and fast_16bit_matmul(dtype, torch.device("cpu")):
        layers["onednn bf16"] = [Linear(w, "packed") for w in weights]
    held = {name: (2 if name.startswith(("bf16", "onednn bf16")) else 4) * sum(w.numel() for w in weights)
            for name in (*layers, "no prefetch", "F.linear")}
    print(f"{args.preset}, {len(weights)} linears ({held['prefetch'] / 1e9:.2f} GB as float32, "
          f"{held['prefetch'] / 2e9:.2f} GB as bfloat16); the roofline's limits here: "
          f"{describe(machine_limits(dtype))}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1], generator=gen) for w in weights]
        flops = sum(2 * rows * w.numel() for w in weights)

        def run(fns, prefetch=True, inputs=xs):
            def f():
                for lin, x in zip(fns, inputs):
                    if isinstance(lin, SmallLinear):
                        lin.prefetch = prefetch
                    lin(x)
            return f

        def plain():
            for w, x in zip(wide, xs):
                F.linear(x, w)
        variants = {name: run(fns, inputs=[x.to(dtype) for x in xs] if name == "onednn bf16" else xs)
                    for name, fns in layers.items()}
        variants["no prefetch"] = run(layers["prefetch"], False)
        variants["F.linear"] = plain
        res = interleaved(variants, args.rounds)
        print(f"{rows} rows, {torch.get_num_threads()} thread(s): "
              + ", ".join(f"{k} {v} ms ({flops / v / 1e6:.0f} GFLOP/s, {held[k] / v / 1e6:.1f} GB/s)"
                          for k, v in res.items()))


def elementwise(args) -> None:
    from torch.fx.experimental import _config as fx_config

    dim, hq, hkv, dh, inter = 512, 8, 4, 64, 1536

    def add_norm(h, r, w):
        h = h + r
        return F.rms_norm(h, (dim,), w, 1e-6), h

    def qk_rope(qkv, w, cos, sin):
        n = qkv.shape[0]
        x = F.rms_norm(qkv[:, :(hq + hkv) * dh].view(n, hq + hkv, dh), (dh,), None, 1e-6) * w
        x = x * cos + torch.cat([-x[..., dh // 2:], x[..., :dh // 2]], -1) * sin
        return x[:, :hq].contiguous(), x[:, hq:]

    def silu_mul(gu):
        g, u = gu.chunk(2, -1)
        return F.silu(g) * u

    compiled = [torch.compile(f, dynamic=True) for f in (add_norm, qk_rope, silu_mul)]

    def layer(fns, a):
        with fx_config.patch(use_duck_shape=False):
            fns[0](a[0], a[1], a[2]), fns[1](a[3], a[4], a[5], a[6]), fns[2](a[7]), fns[0](a[0], a[1], a[2])

    with torch.inference_mode():
        start = time.perf_counter()
        for n in (16, 600):
            a = (torch.randn(n, dim), torch.randn(n, dim), torch.randn(dim), torch.randn(n, (hq + 2 * hkv) * dh),
                 torch.randn(hq + hkv, dh), torch.randn(n, 1, dh), torch.randn(n, 1, dh), torch.randn(n, 2 * inter))
            layer(compiled, a)
        print(f"compile: {time.perf_counter() - start:.1f} s")
        for n in (16, 64, 600):
            a = (torch.randn(n, dim), torch.randn(n, dim), torch.randn(dim), torch.randn(n, (hq + 2 * hkv) * dh),
                 torch.randn(hq + hkv, dh), torch.randn(n, 1, dh), torch.randn(n, 1, dh), torch.randn(n, 2 * inter))
            res = interleaved({"eager": lambda: layer((add_norm, qk_rope, silu_mul), a),
                               "compiled": lambda: layer(compiled, a)}, args.rounds)
            print(f"norms + RoPE + SiLU-mul of one layer, {n} rows (ms): {res}")


def ew_step(args) -> None:
    """One prefill step's elementwise work (every layer: two add + RMSNorm, the q/k norm + RoPE,
    SiLU-mul) at ``--preset``'s shapes for ``--rows`` tokens (one value of ``--rows``; default
    2,048), float32 and bfloat16: PyTorch's eager ops (the fused model without its kernels) against
    ``cpu_elementwise``'s kernels at each vector width built here (``ENGINE_KERNEL_ISA``), through
    the Python calls the model makes (into reused outputs, as the model passes them), and in float32
    with AVX-512 the step as the fused model runs it there: SiLU-mul inside the gate/up linear
    (``SmallLinear(gated=True)``), counted as what the gated call takes over the plain one, or 0
    where it takes less (it writes half the bytes); likewise in bfloat16 on a CPU with AMX, whose
    gate/up linear the fused model runs gated in the AMX layout (``AmxLinear(gated=True)``).
    Interleaved rounds; median wall and CPU ms per step. k is rotated in place, so every call gets a fresh copy of qkv (not timed)."""
    from course.bench.compare import MODEL_PRESETS
    from course.bench.machine import machine_line
    from engine.fast import cpu_elementwise as ew, cpu_linear, cpu_linear_amx
    from engine.models.config import Qwen3Config
    from engine.rope import rope_cos_sin

    if ew.library() is None:
        raise SystemExit(f"the elementwise kernels do not build here: {ew._kernels.why}")
    cfg = Qwen3Config(**MODEL_PRESETS[args.preset])
    d, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq, hkv, dh, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 1e-6
    n = int(args.rows.split(",")[0]) if args.rows != "16,64,256" else 2048
    print(machine_line(torch.get_num_threads()))

    def torch_ops(t):  # fused.py's PyTorch code for the three seams
        def add_norm(h, r, w):
            r = h + r
            return F.rms_norm(r, (d,), w, eps), r

        def qk(qkv):
            qk_ = F.rms_norm(qkv[:, :(hq + hkv) * dh].view(n, hq + hkv, dh), (dh,), None, eps) * t["qw"]
            rotated = torch.cat([-qk_[..., dh // 2:], qk_[..., :dh // 2]], dim=-1)
            return qk_ * t["cos"][:, None, :] + rotated * t["sin"][:, None, :]

        def silu(gu):
            gate, up = gu.chunk(2, dim=-1)
            return F.silu(gate) * up
        return add_norm, qk, silu

    old = None
    if args.before:
        import ctypes
        old = library_at(args.before, "cpu_elementwise_kernel.cpp")
        ptr, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
        for name in ("float32", "bfloat16"):
            getattr(old, f"add_rms_norm_{name}").argtypes = [ptr] * 4 + [i64] * 2 + [f64] + [i64] * 2
            getattr(old, f"qk_norm_rope_{name}").argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, f64, i64]
            getattr(old, f"silu_mul_{name}").argtypes = [ptr, ptr, i64, i64, i64]

    def kernels(t, before: bool = False):  # into reused outputs, as the fused model passes them (FusedFlatModel._scratch)
        x, q, o = t["h"].new_empty((n, d)), t["h"].new_empty((n, hq, dh)), t["h"].new_empty((n, inter))
        if before:  # the revision's C functions, called as its Python wrappers did (one thread)
            name = ew.DTYPES[t["h"].dtype]
            norm, rope, silu = (getattr(old, f"{k}_{name}") for k in ("add_rms_norm", "qk_norm_rope", "silu_mul"))
            p = lambda v: v.data_ptr()  # noqa: E731
            return (lambda h, r, w: norm(p(h), p(r), p(w), p(x), n, d, eps, 1, 1),
                    lambda qkv: rope(p(qkv), qkv.shape[1], n, hq, hkv, dh, p(t["qw"]), p(t["cos"]), p(t["sin"]), p(q),
                                     eps, 1),
                    lambda gu: silu(p(gu), p(o), n, inter, 1))
        return (lambda h, r, w: ew.add_rms_norm(h, r, w, eps, out=x),
                lambda qkv: ew.qk_norm_rope(qkv, hq, hkv, dh, t["qw"], t["cos"], t["sin"], eps, out=q),
                lambda gu: ew.silu_mul(gu, out=o))

    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        t = {"h": torch.randn(n, d, generator=gen).to(dtype), "r": torch.randn(n, d, generator=gen).to(dtype),
             "w": (torch.rand(d, generator=gen) + 0.5).to(dtype),
             "qkv": torch.randn(n, (hq + 2 * hkv) * dh, generator=gen).to(dtype),
             "qw": (torch.rand(hq + hkv, dh, generator=gen) + 0.5).to(dtype),
             "gu": torch.randn(n, 2 * inter, generator=gen).to(dtype)}
        t["cos"], t["sin"] = rope_cos_sin(torch.randint(0, 4096, (n,), generator=gen), dh, cfg.rope_theta, dtype)
        work = torch.empty_like(t["qkv"])

        def variant(isa: str | None, gated: tuple | None = None):
            add_norm, qk, silu = torch_ops(t) if isa is None else kernels(t, before=isa.startswith("at "))

            def step() -> tuple[float, float]:
                wall = cpu = 0.0
                for _ in range(layers):
                    work.copy_(t["qkv"])
                    w0, c0 = time.perf_counter(), time.process_time()
                    if isa is not None and not isa.startswith("at "):
                        os.environ[ew.ISA_ENV] = isa
                    add_norm(t["h"], t["r"], t["w"])
                    qk(work)
                    if gated is None:
                        silu(t["gu"])
                    add_norm(t["h"], t["r"], t["w"])
                    wall, cpu = wall + time.perf_counter() - w0, cpu + time.process_time() - c0
                    if gated is not None:  # the SiLU-mul's cost inside the linear: the gated call's time over the plain
                        plain, fused, x = gated  # one's, at least 0 (the gated call writes half the bytes: it can be less)
                        spent = []
                        for f in (plain, fused):
                            w0, c0 = time.perf_counter(), time.process_time()
                            f(x)
                            spent.append((time.perf_counter() - w0, time.process_time() - c0))
                        wall += max(0.0, spent[1][0] - spent[0][0])
                        cpu += max(0.0, spent[1][1] - spent[0][1])
                os.environ.pop(ew.ISA_ENV, None)
                return wall, cpu
            return step
        fns = {"torch ops": variant(None), **{isa: variant(isa) for isa in ew.built_isas()}}
        if args.before:  # the kernels as they were at that revision (the same C signatures, no width suffix)
            fns[args.before] = variant(f"at {args.before}")
        if dtype == torch.float32 and cpu_linear.library() is not None and "avx512" in cpu_linear.library().isas:
            # The float32 gate/up linear in the 16-float panels' gated mode returns SiLU(gate) * up itself
            # (what the fused model runs where the small layout wins): that seam's cost is what the gated
            # call adds to the plain one, measured beside it each layer.
            w_gu = torch.randn(2 * inter, d, generator=gen) * d ** -0.5
            gated_pair = (cpu_linear.SmallLinear(w_gu), cpu_linear.SmallLinear(w_gu, gated=True),
                          torch.randn(n, d, generator=gen))
            fns["avx512, SiLU-mul in the gate/up linear"] = variant("avx512", gated_pair)
        if dtype == torch.bfloat16 and cpu_linear_amx.available() and "avx512" in ew.built_isas():
            # The same seam in bfloat16 where the AMX layout runs the gate/up linear gated (what the
            # fused model runs on such a CPU: the probe keeps ``amx`` there), measured the same way.
            w_gu = (torch.randn(2 * inter, d, generator=gen) * d ** -0.5).bfloat16()
            gated_pair = (cpu_linear_amx.AmxLinear(w_gu), cpu_linear_amx.AmxLinear(w_gu, gated=True),
                          torch.randn(n, d, generator=gen).bfloat16())
            fns["avx512, SiLU-mul in the gate/up linear (AMX)"] = variant("avx512", gated_pair)
        with torch.inference_mode():
            for f in fns.values():
                f()
            times = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, f in fns.items():
                    times[k].append(f())
        med = {k: (statistics.median(w for w, _ in v) * 1000, statistics.median(c for _, c in v) * 1000)
               for k, v in times.items()}
        print(f"{args.preset}, {n} rows x {layers} layers, {str(dtype).removeprefix('torch.')}, "
              f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}, ms per step (wall / CPU): "
              + ", ".join(f"{k} {w:.1f} / {c:.1f}" for k, (w, c) in med.items()))


def argmax(args) -> None:
    """The greedy sampler's one batched reduction at the Qwen3 vocabulary (151,936): torch.argmax
    against max(dim=-1).indices (``sampler.greedy_tokens``; the same indices, first on a tie),
    against argmax of a float32 copy, and against ``cpu_greedy``'s one-pass kernel (the fused CPU
    model's ``greedy_tokens``, float32 and bfloat16 rows), per logits dtype."""
    from course.bench.machine import machine_line
    from engine.fast import cpu_greedy
    from engine.serve.sampler import greedy_tokens

    print(machine_line(torch.get_num_threads()))
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(args.requests, 151_936, generator=gen).to(dtype)
        assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))
        fns = {"argmax": lambda: torch.argmax(logits, dim=-1),
               "float32 copy + argmax": lambda: torch.argmax(logits.float(), dim=-1),
               "max().indices": lambda: greedy_tokens(logits),
               "float32 copy + max().indices": lambda: greedy_tokens(logits.float())}
        if dtype in cpu_greedy.DTYPES and cpu_greedy.library() is not None:
            assert torch.equal(cpu_greedy.argmax_rows(logits), torch.argmax(logits, dim=-1))
            fns["kernel"] = lambda: cpu_greedy.argmax_rows(logits)
        if dtype == torch.bfloat16 and cpu_greedy.library() is not None:  # the engine's path: widened, then the kernel
            fns["float32 copy + kernel"] = lambda: cpu_greedy.argmax_rows(logits.float())
        res = interleaved(fns, args.rounds)
        print(f"{str(dtype).removeprefix('torch.')} logits [{args.requests}, 151936], "
              f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f} (median ms): {res}")


def lm_head(args) -> None:
    """A bfloat16 model's logits where the CPU has AMX: the LM head at Qwen3-0.6B's shape ([151,936,
    1,024] in the AMX layout) on ``--rows`` sample rows, then the greedy kernel. The head's bfloat16
    outputs widened by ``.float()`` (the fused model's path before: a new bfloat16 output as the
    kernel wrote it then, its pages not touched first), widened as the kernel writes them
    (``widened=True``: the path now, the new output's pages touched first), and the same with the
    pages left to fault inside the kernel. The same logits each way (checked). Interleaved,
    median ms; the machine line says whether torch's allocator is on 2 MiB pages (run.py sets
    ``THP_MEM_ALLOC_ENABLE=1``): on 4 KiB pages the last is the slow one."""
    from course.bench.machine import machine_line
    from engine.fast import cpu_greedy, cpu_linear_amx

    if not cpu_linear_amx.available():
        raise SystemExit("no AMX linear here (cpu_linear_amx.available() is False)")
    print(machine_line(torch.get_num_threads()))
    gen = torch.Generator().manual_seed(0)
    head = cpu_linear_amx.AmxLinear((torch.randn(151_936, 1024, generator=gen) * 0.05).bfloat16())

    def untouched(x, widened):  # the output as torch.empty gives it, written by the kernel alone
        out = torch.empty(x.shape[0], head.n, dtype=torch.float32 if widened else torch.bfloat16)
        head.run(x.data_ptr(), x.shape[0], out.data_ptr(), head.threads(), out.dtype, widened)
        return out
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 1024, generator=gen).bfloat16()
        ways = {"bf16, then .float() (before)": lambda: untouched(x, False).float(),
                "widened in the kernel": lambda: head(x, torch.float32, widened=True),
                "widened, pages faulting inside": lambda: untouched(x, True)}
        logits = [f() for f in ways.values()]
        assert all(torch.equal(v.view(torch.int32), logits[0].view(torch.int32)) for v in logits), "not the same bits"
        res = interleaved({k: (lambda f=f: cpu_greedy.argmax_rows(f())) for k, f in ways.items()}, args.rounds)
        print(f"LM head + greedy, {rows} rows (median ms): {res}", flush=True)


def pages(args) -> None:
    """Decode attention over K/V pools of 1 GiB, rows out of cache (64 MiB touched before each call):
    the pools on ordinary 4 KiB pages (``torch.zeros``) against ``huge_pages.zeros`` (2 MiB pages
    where Linux grants them), same values, interleaved, median ms."""
    from course.bench.compare import MODEL_PRESETS
    from course.bench.machine import machine_line
    from engine.fast import huge_pages
    from engine.fast.cpu_attention import CPUBackend

    dtype = getattr(torch, args.dtype)
    cfg = MODEL_PRESETS[args.preset]
    hq, hkv, d, bs = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], 16
    num_blocks = 2**30 // (bs * hkv * d * torch.tensor([], dtype=dtype).element_size())
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    pools = {"4 KiB pages": tuple(torch.zeros(v.shape, dtype=dtype).copy_(v) for v in values),
             "huge pages": tuple(huge_pages.zeros(v.shape, dtype).copy_(v) for v in values)}
    del values
    width = -(-args.context // bs)
    tables = torch.randperm(num_blocks, generator=gen)[:args.requests * width].view(args.requests, width).to(torch.int32)
    q = torch.randn(args.requests, hq, d, generator=gen).to(dtype)
    pos = torch.full((args.requests,), args.context - 1, dtype=torch.int64)
    backend, junk = CPUBackend(), torch.empty(64 * 2**20, dtype=torch.uint8)
    times: dict[str, list[float]] = {k: [] for k in pools}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, cache in pools.items():
            junk.add_(1)  # the rows' K/V out of the caches
            start = time.perf_counter()
            backend._run(q, cache, tables, pos, d ** -0.5, 0)
            if round_:
                times[name].append((time.perf_counter() - start) * 1000)
    res = {k: round(statistics.median(v), 3) for k, v in times.items()}
    print(machine_line(torch.get_num_threads()))
    print(f"decode attention, {args.preset} ({hq}/{hkv} heads of {d}), {args.dtype}, R={args.requests}, context "
          f"{args.context}, 1 GiB pools, K/V out of cache, median ms of the call: {res} "
          f"(huge pages {res['4 KiB pages'] / res['huge pages']:.2f}x)")


_LINEAR_PAGES_CHILD = """
import statistics, sys, time, torch
from engine.fast.linear_layout import PACK_BATCH
torch.set_num_threads(1)
k_in, inter, layers, rows = (int(a) for a in sys.argv[1:5])
shapes = [(k_in, 4 * k_in), (2 * k_in, k_in), (k_in, 2 * inter), (inter, k_in)] * layers  # (in, out) per linear
gen = torch.Generator().manual_seed(0)
packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=gen).bfloat16(), batch_size=PACK_BATCH)
          for k, n in shapes]
xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k, _ in shapes}
times = []
for _ in range(6):
    start = time.perf_counter()
    for w, (k, _) in zip(packed, shapes):
        torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
    times.append(time.perf_counter() - start)
print(statistics.median(times[1:]) * 1000)
"""


def linear_pages(args) -> None:
    """The Qwen3-0.6B shape's layer weights (bfloat16, oneDNN-packed, 880 MB: out of every cache)
    streamed by one-row matmuls, in fresh processes with and without ``THP_MEM_ALLOC_ENABLE=1``
    (torch's allocator on huge pages: it must be set before torch loads), alternating, median ms."""
    import subprocess

    from course.bench.machine import machine_line

    root = Path(__file__).resolve().parents[2]
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    runs = {"4 KiB pages": base, "huge pages": {**base, "THP_MEM_ALLOC_ENABLE": "1"}}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, env in runs.items():
            out = subprocess.run([sys.executable, "-c", _LINEAR_PAGES_CHILD, "1024", "3072", "28", str(args.requests)],
                                 env=env, cwd=root, capture_output=True, text=True, check=True)
            times[name].append(float(out.stdout.split()[-1]))
    res = {k: round(statistics.median(v), 1) for k, v in times.items()}
    print(machine_line(1))
    print(f"0.6B shape, 112 packed bf16 linears (880 MB), {args.requests} row(s), one thread, median ms of a pass over "
          f"{args.rounds} fresh processes each: {res} (huge pages {res['4 KiB pages'] / res['huge pages']:.2f}x)")


def linear_amx(args) -> None:
    """A preset's layer weights in bfloat16 (the small preset's 4 layers, 25 MB; Qwen3-0.6B's 28,
    880 MB: out of every cache), a pass of one matmul per weight at each of ``--rows``: oneDNN's
    prepacked matmul and the AMX kernel's own packing (``cpu_linear_amx``), with and without its
    software prefetch of the weight (``linear_amx_set_prefetch``), interleaved rounds, median ms."""
    from course.bench.compare import MODEL_PRESETS
    from course.bench.machine import machine_line
    from engine.fast import cpu_linear_amx
    from engine.fast.linear_layout import PACK_BATCH
    from engine.models.tiny import tiny_config

    print(machine_line(torch.get_num_threads()))
    if not cpu_linear_amx.available():
        print("the AMX linear does not run here (no AMX-BF16, or the OS refused the tiles): nothing to compare")
        return
    cfg = tiny_config(False, **MODEL_PRESETS[args.preset])
    d, inter, heads, dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.head_dim
    qkv = (heads + 2 * cfg.num_key_value_heads) * dh
    layers = args.layers or cfg.num_hidden_layers
    shapes = [(d, qkv), (heads * dh, d), (d, 2 * inter), (inter, d)] * layers  # (in, out)
    gen = torch.Generator().manual_seed(0)
    packed, tiles = [], []
    for k, n in shapes:
        w = torch.randn(n, k, generator=gen).bfloat16()
        packed.append(torch.ops.mkldnn._reorder_linear_weight(w, batch_size=PACK_BATCH))
        tiles.append(cpu_linear_amx.AmxLinear(w))
    size = sum(k * n * 2 for k, n in shapes)
    lib = cpu_linear_amx.library()
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k, _ in shapes}
        def amx(prefetch: bool):  # the kernel with / without its software prefetch of the weight
            def run():
                lib.linear_amx_set_prefetch(int(prefetch))
                try:
                    return [t(xs[k]) for t, (k, _) in zip(tiles, shapes)]
                finally:
                    lib.linear_amx_set_prefetch(1)
            return run
        fns = {"oneDNN packed": lambda: [torch.ops.mkldnn._linear_pointwise.default(xs[k], w, None, "none", [], "")
                                         for w, (k, _) in zip(packed, shapes)],
               "amx": amx(True), "amx, no prefetch": amx(False)}
        res = interleaved(fns, args.rounds)
        print(f"{args.preset}, {layers} layers' bf16 linears ({size / 1e6:.0f} MB), {rows} row(s), "
              f"{torch.get_num_threads()} thread(s), median ms of a pass: {res} "
              f"(amx {res['oneDNN packed'] / res['amx']:.2f}x oneDNN, {res['amx, no prefetch'] / res['amx']:.2f}x "
              f"without the prefetch; {size / res['amx'] / 1e6:.1f} GB/s)")


def linear_threads(args) -> None:
    """Each weight shape of ``--preset`` (``--layers`` copies of it, so that they do not stay in
    cache), one pass of ``run`` calls at each of ``--rows``, at one thread and at two, interleaved
    rounds, median ms of a call: the float32 panels (``SmallLinear``, its gate/up gated where the
    16-float kernel runs) and, where the CPU has AMX, the bfloat16 tiles (``AmxLinear``). The ratio is
    what a second thread buys that call."""
    from course.bench.compare import MODEL_PRESETS
    from course.bench.machine import machine_line
    from engine.fast import cpu_linear, cpu_linear_amx
    from engine.models.tiny import tiny_config

    print(machine_line(2))
    cfg = tiny_config(False, **MODEL_PRESETS[args.preset])
    d, inter, heads, dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.head_dim
    shapes = [((heads + 2 * cfg.num_key_value_heads) * dh, d, False), (d, heads * dh, False),
              (2 * inter, d, True), (d, inter, False)]  # (out, in, gate/up)
    copies = args.layers or 8
    gen = torch.Generator().manual_seed(0)
    kinds = {"float32 panels": (torch.float32, lambda w, g: cpu_linear.SmallLinear(
        w, gated=g and cpu_linear.takes_gated(w.shape[0])))}
    if cpu_linear_amx.available():
        kinds["bfloat16 amx"] = (torch.bfloat16, lambda w, g: cpu_linear_amx.AmxLinear(
            w, gated=g and cpu_linear_amx.takes(*w.shape, gated=True)))
    for kind, (dtype, make) in kinds.items():
        for n, k, gate_up in shapes:
            lins = [make((torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype), gate_up) for _ in range(copies)]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen).to(dtype)
                out = torch.empty(rows, n, dtype=dtype)
                times: dict[int, list[float]] = {1: [], 2: []}
                for round_ in range(args.rounds + 1):  # round 0 warms up
                    for threads in (1, 2):
                        torch.set_num_threads(threads)
                        counts = [lin.threads(threads) for lin in lins]
                        start = time.perf_counter()
                        for lin, count in zip(lins, counts):
                            lin.run(x.data_ptr(), rows, out.data_ptr(), count)
                        if round_:
                            times[threads].append((time.perf_counter() - start) / copies * 1000)
                one, two = statistics.median(times[1]), statistics.median(times[2])
                print(f"{kind} [{n}, {k}]{' gated' if lins[0].gated else ''}, {rows} rows: 1 thread {one:.3f} ms, "
                      f"2 threads {two:.3f} ms ({one / two:.2f}x)", flush=True)
    torch.set_num_threads(args.threads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("attention", "prefill-attention", "step", "parts", "linear", "elementwise",
                                     "ew-step", "argmax", "pages", "linear-pages", "linear-amx",
                                     "linear-threads", "workload-parts", "lm-head"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="torch,cpu,cpu+fused,cpu+compiled",
                    help="step: engines to compare (backend, +fused: flat_model='fused', +compiled: flat_model='compiled'; "
                         "cpu/tiles: the cpu backend with prefill tiles gathered for SDPA; cpu/rows: every prefill row through the "
                         "row kernel (no matrix path); +fused/packed, "
                         "+fused/small (or +compiled/...): every linear in that layout (default: each shape's measured "
                         "fastest); +fused/torch-ew: PyTorch elementwise ops and write_kv; "
                         "+fused/no-prefetch: the linear kernel without software prefetch; +compiled/all-rows: the last "
                         "layer on every row)")
    ap.add_argument("--prefill", action="store_true", help="step: time a fresh engine's first (prefill) step")
    ap.add_argument("--preset", default="small", help="step, linear: the bench's model preset (small, qwen3-0.6b, test)")
    ap.add_argument("--layers", type=int, default=0, help="step, linear: this many of the preset's layers (0: all)")
    ap.add_argument("--workload", default="random", help="workload-parts: the bench workload (default random)")
    ap.add_argument("--prefix", type=int, default=0, help="prefill-attention: cached tokens before each request's rows")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="prefill-attention: also the row kernel as it was at this git revision (e.g. 6ddabc4)")
    ap.add_argument("--rows", default="16,64,256", help="linear, lm-head: the row counts, comma-separated; ew-step: one "
                    "row count (default there 2048)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    {"attention": attention, "prefill-attention": prefill_attention, "step": step, "parts": parts, "linear": linear,
     "elementwise": elementwise, "ew-step": ew_step, "argmax": argmax, "pages": pages,
     "linear-pages": linear_pages, "linear-amx": linear_amx, "linear-threads": linear_threads,
     "workload-parts": workload_parts, "lm-head": lm_head}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
