"""A CPU linear in ONE layout (``Linear``), and which one: measured for each weight shape at load time.

A float32 weight on a CPU can be served by two kernels, each reading its own layout of the weight:
oneDNN's matmul on its prepacked (blocked) copy, or ``cpu_linear``'s small-batch kernel on its
16-column panels. A bfloat16 weight on a CPU with AMX likewise: oneDNN's, or ``cpu_linear_amx``'s
tile products on its own packing (``amx``), which streams a decode step's weights ~1.8x faster. Which is faster depends on the shape, the row count, the CPU and its caches:
on one machine the small kernel won at 16 rows and lost at 64 and 256 (issue 27's Intel CPU); on
another (an AMD EPYC without AMX) oneDNN won almost everywhere on a weight in cache, and lost at
16 rows on weights streamed from memory. So it is measured, not assumed.

Holding both layouts would route each row count to its winner but doubles the weights' memory;
the engine keeps ONE resident copy of each weight (issue 28), so a shape keeps the layout that is
faster over the row counts a step sees (``PROBE_ROWS``: decode steps of 16 to 256 requests; longer
prefill steps behave like 256; an LM head, which runs on the sampling rows alone, ``HEAD_PROBE_ROWS``),
and every row count goes through it. Neither layout costs more
than the weight's own bytes (panels pad the out features to a multiple of 16).

The measurement (``choose``, a fraction of a second per shape): random weights of the shape (at
most ``PROBE_MAX_OUT`` of its out features: the time is linear in them), each candidate layout
timed at each of ``PROBE_ROWS`` rows in interleaved rounds, the fastest round of each (a busy
machine only ever adds time); at 16 rows through copies as large as the last-level cache together
(``PROBE_BYTES``: in the engine each layer's weights come from memory too). The layout with the smallest geometric mean of its times wins; one that is not the
reference (the first candidate: oneDNN's, or the plain tensor a tied head shares with the
embedding) must win by ``MARGIN``, so that a near-tie does not flip from one start to the next.
Results are cached per (shape, dtype, threads, candidates) for the process. The choice is
deterministic given the measurement; ``ENGINE_LINEAR_LAYOUT=small|packed|plain|amx`` (or the flat
model's ``layout=`` argument) forces one where it is available (elsewhere the reference), for
tests and A/B runs.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.fast import cpu_linear, cpu_linear_amx, probe

LAYOUTS = ("packed", "small", "plain", "amx")  # oneDNN-prepacked, cpu_linear panels, the plain tensor, AMX tiles
GATED_LAYOUTS = ("small", "amx")  # the layouts whose kernel can return a gate/up weight's SiLU(gate) * up

PROBE_ROWS = (16, 64, 256)  # the row counts each layout is timed at
# An LM head runs on the rows that sample (one per request in a step, never a prompt's other
# rows: ``logits_indices``), so it is timed at decode-sized counts.
HEAD_PROBE_ROWS = (1, 16, 64)
PROBE_BYTES = 32 << 20  # the probe's copies of a weight together (fewest rows): as much as the last-level cache
PROBE_MAX_COPIES = 8
PROBE_MAX_OUT = 2048  # wider weights (an LM head) are timed on this many of their rows: time is linear in them
PROBE_ROUNDS = 3  # timed rounds; the fastest counts (other processes only ever add time)
MARGIN = 0.03  # a layout other than the reference wins only when it is this much faster
ENV = "ENGINE_LINEAR_LAYOUT"
PACK_BATCH = 256  # the row count oneDNN lays packed weights out for (a hint; any row count works)


def takes_gated(layout: str, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a SwiGLU gate/up weight [n = 2 I, k] computing in ``dtype`` can be held gated in
    ``layout`` (its call returning SiLU(gate) * up [M, I]): the AMX tiles in bfloat16, the panels'
    16-float kernel in float32."""
    if layout == "amx":
        return dtype == torch.bfloat16 and cpu_linear_amx.takes(n, k, gated=True)
    return layout == "small" and dtype == torch.float32 and cpu_linear.takes_gated(n)


@dataclass(frozen=True)
class Choice:
    """The layout a shape keeps, and why: ``ms[layout]`` = its ms at each of ``PROBE_ROWS``
    rows (empty when not measured: one candidate, or ``forced``)."""

    layout: str
    ms: dict[str, tuple[float, ...]]
    forced: bool = False
    rows: tuple[int, ...] = PROBE_ROWS  # the row counts ``ms`` were timed at

    def describe(self, n: int, k: int) -> str:
        if not self.ms:
            return f"[{n}, {k}] {self.layout}" + (" (forced)" if self.forced else "")
        times = "; ".join(f"{name} " + "/".join(f"{t:.2f}" for t in ms) for name, ms in self.ms.items())
        return f"[{n}, {k}] {self.layout} (ms at {'/'.join(map(str, self.rows))} rows: {times})"


_chosen: dict[tuple, Choice] = {}  # measured choices, reused for the process
_made: dict[tuple, Choice] = {}  # every choice this process made (measured, only, forced), for chosen_report


def forced_layout(layout: str | None) -> str | None:
    """The layout asked for (``layout``, else ``$ENGINE_LINEAR_LAYOUT``), None for "measure"."""
    return probe.forced_name(layout, ENV, LAYOUTS, "linear layout")


def held_dtype(layout: str, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype a linear computing in ``dtype`` holds its weight in, for a model whose weights
    are ``weight_dtype``: the compute dtype, except that the small kernel's panels keep a bfloat16
    model's own values when it computes in float32 (widened in registers: the same float32
    products, from half the bytes)."""
    if (layout == "small" and dtype == torch.float32 and weight_dtype is not None
            and weight_dtype in cpu_linear.PANEL_DTYPES):
        return weight_dtype
    return dtype


def measure(n: int, k: int, dtype: torch.dtype, candidates: tuple[str, ...],
            weight_dtype: torch.dtype | None = None, rows: tuple[int, ...] = PROBE_ROWS) -> dict[str, tuple[float, ...]]:
    """Ms of each candidate layout at each of ``rows`` row counts (its fastest round), on seeded
    random [n, k] weights (at most ``PROBE_MAX_OUT`` rows of them), each held as it would be
    (``held_dtype``), inputs in ``dtype``. At the fewest rows, where a
    step's time is the weight's trip from memory, the probe cycles through copies that do not fit
    in the caches together; at more rows the arithmetic decides and one copy is timed."""
    n = min(n, PROBE_MAX_OUT)
    gen = torch.Generator().manual_seed(0)
    size = n * k * torch.empty((), dtype=dtype).element_size()
    copies = max(2, min(PROBE_MAX_COPIES, PROBE_BYTES // max(size, 1)))
    weights = [torch.randn(n, k, generator=gen).to(weight_dtype or dtype) for _ in range(copies)]
    layouts = {name: [Linear(w.to(held_dtype(name, dtype, weight_dtype)), name) for w in weights]
               for name in candidates}
    out: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, k, generator=gen).to(dtype)
            used = copies if count == rows[0] else 1
            times: dict[str, list[float]] = {name: [] for name in candidates}
            for round_ in range(PROBE_ROUNDS + 1):  # round 0 warms up
                for name, fns in layouts.items():
                    start = time.perf_counter()
                    for f in fns[:used]:
                        f(x)
                    if round_:
                        times[name].append((time.perf_counter() - start) * 1000 / used)
            for name in candidates:
                out[name].append(min(times[name]))
    return {name: tuple(ms) for name, ms in out.items()}


def decide(ms: dict[str, tuple[float, ...]]) -> str:
    """The measured winner: the smallest geometric mean over the row counts; the reference (the
    first key) unless another is at least ``MARGIN`` faster."""
    geo = {name: math.exp(statistics.fmean(math.log(max(t, 1e-9)) for t in times)) for name, times in ms.items()}
    reference = next(iter(ms))
    best = min(geo, key=geo.get)
    return best if geo[best] < (1 - MARGIN) * geo[reference] else reference


def choose(n: int, k: int, dtype: torch.dtype, candidates: tuple[str, ...], layout: str | None = None,
           weight_dtype: torch.dtype | None = None, rows: tuple[int, ...] = PROBE_ROWS) -> Choice:
    """The layout an [n, k] weight computing in ``dtype`` keeps among ``candidates`` (available
    here, the reference first), for a model whose weights are ``weight_dtype`` (default ``dtype``):
    when one is forced, that one (the reference if it is not a candidate); else the only one,
    else measured at ``rows`` (the row counts its steps see, fewest first: ``PROBE_ROWS``, or an LM
    head's, ``HEAD_PROBE_ROWS``; cached per shape, dtypes, thread count, candidates and rows)."""
    forced = forced_layout(layout)
    key = (n, k, dtype, weight_dtype, torch.get_num_threads(), candidates, rows)
    if forced is not None:  # where it is not a candidate: the reference
        choice = Choice(forced if forced in candidates else candidates[0], {}, forced=True)
    elif len(candidates) == 1:
        choice = Choice(candidates[0], {})
    else:
        probe_key = (min(n, PROBE_MAX_OUT),) + key[1:]
        if probe_key not in _chosen:
            ms = measure(n, k, dtype, candidates, weight_dtype, rows)
            _chosen[probe_key] = Choice(decide(ms), ms, rows=rows)
        choice = _chosen[probe_key]
    _made[key] = choice
    return choice


def chosen_report(model_dtype: torch.dtype | None = None, threads: int | None = None) -> list[str]:
    """One line per (weight shape, compute dtype, thread count) this process chose a layout for:
    the layout and how it was decided (measured, with the times; the only candidate; forced).
    ``run.py bench`` prints it, so that a sitting says which kernels its figures came from: a
    measured choice can differ between thread counts or between starts on a busy machine (never
    the tokens, only the speed); ``ENGINE_LINEAR_LAYOUT`` makes it the same everywhere.
    ``model_dtype``, ``threads``: only the choices for a model of that dtype, at that thread count."""
    lines = []
    for (n, k, dtype, weight_dtype, count, _, _), choice in _made.items():
        if ((model_dtype is not None and (weight_dtype or dtype) != model_dtype)
                or (threads is not None and count != threads)):
            continue
        held = "" if weight_dtype in (None, dtype) else f", {str(weight_dtype).removeprefix('torch.')} weights"
        context = f"{str(dtype).removeprefix('torch.')}{held}, {count} thread(s)"
        how = "measured" if choice.ms else "forced" if choice.forced else "the only candidate"
        line = choice.describe(n, k).replace(" (forced)", "")
        lines.append(f"{line} [{how}; {context}]")
    return lines


class Linear:
    """A weight [out, in] held in ONE layout, the one its kernel reads, and applied through it:
    oneDNN's prepacked matmul (``packed``: the weight reordered once into the blocked layout the
    matmul kernel reads, instead of on every call), or ``cpu_linear.SmallLinear``'s panels
    (``small``), or ``cpu_linear_amx.AmxLinear``'s tiles (``amx``: bfloat16 on a CPU with AMX), or
    the plain tensor through ``F.linear`` (``weight``). Exactly one of the four is set; the others
    are None. ``layout`` names it; ``choice`` says how it was chosen
    (``linear_layout.choose``: measured per shape at load time, or forced).
    """

    def __init__(self, weight: torch.Tensor, layout: str, choice: Choice | None = None, gated: bool = False) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        if gated and layout not in GATED_LAYOUTS:
            raise ValueError(f"only the {' and '.join(GATED_LAYOUTS)} layouts compute a gated (SiLU-mul) linear, "
                             f"not {layout!r}")
        self.n, self.k = weight.shape
        self.gated = gated  # a merged gate/up weight whose call returns SiLU(gate) * up [M, n / 2]
        self.weight = self.packed = self.small = self.amx = None
        if layout == "small":
            self.small = cpu_linear.SmallLinear(weight, gated=gated)
        elif layout == "amx":
            self.amx = cpu_linear_amx.AmxLinear(weight, gated=gated)
        elif layout == "packed":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=PACK_BATCH)
        else:
            self.weight = weight
        self.layout = layout
        self.choice = choice

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None:
            return self.small(x)
        if self.amx is not None:
            return self.amx(x)
        if self.packed is not None:  # the op's one overload for a plain linear, named: no overload resolution per call
            return torch.ops.mkldnn._linear_pointwise.default(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [N] of the weight, [N, in] (an embedding lookup in a tied head's layout);
        plain, panels or AMX tiles (oneDNN's packed layout is opaque)."""
        if self.small is not None:
            return self.small.rows(ids)
        if self.amx is not None:
            return self.amx.rows(ids)
        if self.weight is None:
            raise ValueError("a packed linear cannot look up rows")
        return F.embedding(ids, self.weight)

    @property
    def held(self) -> torch.Tensor:
        """The one tensor this linear holds (panels, oneDNN's packed weight or the plain one)."""
        if self.small is not None:
            return self.small.panels
        if self.amx is not None:
            return self.amx.packed
        return self.packed if self.packed is not None else self.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.held.dtype

    def nbytes(self) -> int:
        """Bytes this linear holds of its own (0 for a plain weight shared with the model)."""
        if self.small is not None:
            return self.small.panels.numel() * self.small.panels.element_size()
        if self.amx is not None:
            return self.amx.packed.numel() * self.amx.packed.element_size()
        if self.packed is not None:  # an opaque oneDNN tensor: at least the weight's own size
            return self.n * self.k * self.packed.element_size()
        return 0
