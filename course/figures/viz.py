"""Pictures and step traces for the chapter notebooks (matplotlib is imported only when drawing).

Nothing here changes how the engine behaves. ``StepTracer`` watches an ``EngineCore`` through its
observer hook (``core.observe``, which reports each step's plan); the drawing functions read the
public state of a ``Batch`` or a ``BlockManager``.

    tracer = StepTracer(core)
    tracer.run_until_done()
    plot_trace(tracer.records)           # tokens per step and pool usage per step
    draw_pool(core.blocks)               # one square per block, coloured by state
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.serve.batch import Batch
from engine.serve.blocks import BlockManager

if TYPE_CHECKING:  # only for type hints: EngineCore lives in a chapter file with holes
    from engine.serve.engine import EngineCore

# One colour per block state, and per kind of scheduled token.
STATE_COLOURS = {"in use": "#4c72b0", "cached-free": "#f2b134", "free": "#e8e8e8"}
KIND_COLOURS = {"prefill": "#55a868", "recompute": "#c44e52", "decode": "#4c72b0"}
REQUEST_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
                   "#8c8c8c", "#ccb974", "#64b5cd"]


# ----------------------------------------------------------------------------- block states
def block_state(blocks: BlockManager, b: int) -> str:
    """'in use' (ref > 0), 'cached-free' (ref 0 but still findable by hash) or 'free' (blank)."""
    if blocks.ref_count[b] > 0:
        return "in use"
    return "cached-free" if blocks.block_hash[b] is not None else "free"


def pool_counts(blocks: BlockManager) -> dict[str, int]:
    """How many blocks are in each state."""
    counts = dict.fromkeys(STATE_COLOURS, 0)
    for b in range(blocks.num_blocks):
        counts[block_state(blocks, b)] += 1
    return counts


# ----------------------------------------------------------------------------- step traces
@dataclass
class StepRecord:
    """One step as seen from outside the engine.

    Token counts split this step's scheduled tokens by kind: ``recompute`` (positions this request
    had computed before, lost to a recompute preemption and now computed again), ``decode`` (the
    one new token of a request that is generating) and ``prefill`` (everything else: prompts and
    prompt chunks). Pool counts are taken after the step.
    """

    step: int
    prefill: int
    recompute: int
    decode: int
    running: int
    waiting: int
    preempted: int
    in_use: int
    cached_free: int
    free: int

    @property
    def tokens(self) -> int:
        return self.prefill + self.recompute + self.decode


class StepTracer:
    """Records a ``StepRecord`` for every step of ``core`` that schedules work.

    It observes ``core`` (``core.observe``) to keep each step's plan, and reads the pool after each
    ``core.step()`` made through ``step()``. Subclasses add fields by overriding ``on_plan``
    (called right after scheduling) and ``on_step_done``.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.records: list[StepRecord] = []
        self._plan = None
        self._kinds: dict[str, int] = {}
        self._high: dict[str, int] = {}  # per request: most positions it ever had computed
        core.observe(self._observe)

    def _observe(self, phase: str, result: Any, seconds: float) -> None:
        if phase != "schedule":
            return
        self._plan = result
        self._kinds = dict.fromkeys(KIND_COLOURS, 0)
        for req, n in result.scheduled:
            self._classify(req, n)
        self.on_plan(result)

    def _classify(self, req: Any, n: int) -> None:
        # Read right after scheduling: num_computed_tokens already includes a cached prefix, so
        # tokens served by the prefix cache are never counted as recomputed.
        c = req.num_computed_tokens
        high = self._high.get(req.request_id, 0)
        redo = max(0, min(c + n, high) - c)
        rest = n - redo
        self._kinds["recompute"] += redo
        is_decode = rest == 1 and req.num_output_tokens > 0 and c + n == req.num_tokens
        self._kinds["decode" if is_decode else "prefill"] += rest
        self._high[req.request_id] = max(high, c + n)

    def on_plan(self, plan: Any) -> None:
        """Hook: called with each step's SchedulerOutput before the forward pass."""

    def on_step_done(self, record: StepRecord) -> None:
        """Hook: called after each recorded step."""

    def step(self) -> list:
        """``core.step()``, recording the step if it scheduled anything."""
        self._plan = None
        outputs = self.core.step()
        plan = self._plan
        if plan is not None and not plan.empty:
            counts = pool_counts(self.core.blocks)
            sched = self.core.scheduler
            record = StepRecord(
                step=len(self.records) + 1, prefill=self._kinds["prefill"],
                recompute=self._kinds["recompute"], decode=self._kinds["decode"],
                running=len(sched.running), waiting=len(sched.waiting), preempted=len(plan.preempted),
                in_use=counts["in use"], cached_free=counts["cached-free"], free=counts["free"])
            self.records.append(record)
            self.on_step_done(record)
        return outputs

    def run_until_done(self, max_steps: int = 100_000) -> dict[str, list[int]]:
        """Like ``EngineCore.run_until_done``, through ``step()`` so every step is recorded."""
        done: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.core.has_unfinished():
                return done
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
        raise RuntimeError(f"engine still busy after {max_steps} steps")


# ----------------------------------------------------------------------------- text
def describe_batch(batch: Batch, names: dict[str, str] | None = None) -> str:
    """A table of a Batch: one line per row (token, position, slot, sampled?) and the metadata."""
    names = names or {}
    meta = batch.meta
    qsl = meta.query_start_loc_cpu.tolist()
    sampled = set(batch.logits_indices.tolist())
    owner = {}
    for r, rid in enumerate(batch.request_ids):
        for i in range(qsl[r], qsl[r + 1]):
            owner[i] = names.get(rid, rid or "pad")
    lines = ["row  request  token  position  slot  sampled"]
    for i, (tok, pos, slot) in enumerate(zip(batch.input_ids.tolist(), batch.positions.tolist(),
                                             meta.slot_mapping.tolist())):
        lines.append(f"{i:>3}  {owner[i]:>7}  {tok:>5}  {pos:>8}  {slot:>4}  {'yes' if i in sampled else ''}")
    lines += [
        "",
        f"query_start_loc {qsl}",
        f"seq_lens        {meta.seq_lens_cpu.tolist()}",
        f"block_table     {meta.block_table.tolist()}",
        f"sample_counts   {batch.sample_counts}",
        f"logits_indices  {batch.logits_indices.tolist()}",
        f"max_query_len {meta.max_query_len}, max_seq_len {meta.max_seq_len}, decode_only {meta.decode_only}",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- pictures
def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def draw_batch(batch: Batch, names: dict[str, str] | None = None, ax=None):
    """The flat batch above the pool blocks it writes: each row is labelled with its request and
    position ("a6" = request a, position 6) and an arrow runs from it to the block and offset its
    K/V go to (``slot_mapping``). A thick outline marks the rows sent to the LM head; padding rows
    (slot -1) get no arrow."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    names = names or {}
    meta = batch.meta
    bs = meta.block_size
    n = batch.input_ids.shape[0]
    qsl = meta.query_start_loc_cpu.tolist()
    sampled = set(batch.logits_indices.tolist())
    pos, slots = batch.positions.tolist(), meta.slot_mapping.tolist()
    owner = [0] * n
    for r in range(len(batch.request_ids)):
        for i in range(qsl[r], qsl[r + 1]):
            owner[i] = r
    # The blocks this step writes, in order of first use; each drawn as bs cells side by side.
    written = list(dict.fromkeys(s // bs for s in slots if s >= 0))
    gap = 2
    width = max(1, len(written) * bs + (len(written) - 1) * gap)
    block_x = {b: k * (bs + gap) for k, b in enumerate(written)}
    ax = _axes(ax, (min(16, max(7, 0.2 * width)), 3.4))
    row_w = width / max(n, 1)
    row_y, row_h, cell_y, cell_h = 2.2, 0.8, 0.0, 0.8
    for b, x0 in block_x.items():
        for o in range(bs):
            ax.add_patch(Rectangle((x0 + o, cell_y), 1, cell_h, facecolor="white", edgecolor="#999999",
                                   linewidth=0.5))
        ax.text(x0 + bs / 2, cell_y - 0.35, f"block {b}", ha="center", va="center", fontsize=9)
        for o in (0, bs - 1):
            ax.text(x0 + o + 0.5, cell_y + cell_h + 0.15, str(o), ha="center", va="bottom", fontsize=6,
                    color="#777777")
    for i in range(n):
        r = owner[i]
        rid = batch.request_ids[r]
        colour = REQUEST_COLOURS[r % len(REQUEST_COLOURS)]
        x = i * row_w
        ax.add_patch(Rectangle((x + 0.05 * row_w, row_y), 0.9 * row_w, row_h, facecolor=colour, alpha=0.35))
        ax.add_patch(Rectangle((x + 0.05 * row_w, row_y), 0.9 * row_w, row_h, fill=False,
                               edgecolor="black", linewidth=2.5 if i in sampled else 0.5))
        label = names.get(rid, rid or "pad")
        ax.text(x + row_w / 2, row_y + row_h / 2, f"{label}{pos[i]}", ha="center", va="center", fontsize=9)
        if slots[i] < 0:
            continue
        b, o = divmod(slots[i], bs)
        cx = block_x[b] + o + 0.5
        ax.add_patch(Rectangle((block_x[b] + o, cell_y), 1, cell_h, facecolor=colour, alpha=0.6,
                               edgecolor="black", linewidth=0.5))
        ax.text(cx, cell_y + cell_h / 2, str(o), ha="center", va="center", fontsize=6)
        ax.add_patch(FancyArrowPatch((x + row_w / 2, row_y), (cx, cell_y + cell_h), arrowstyle="-|>",
                                     mutation_scale=8, color=colour, linewidth=1))
    ax.text(0, row_y + row_h + 0.25, "the step's rows (thick outline: sent to the LM head)", fontsize=9,
            va="bottom")
    ax.text(0, cell_y - 0.9, f"the pool blocks they write (offsets 0..{bs - 1}; slot = block x {bs} + offset)",
            fontsize=9, va="top")
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(cell_y - 1.5, row_y + row_h + 0.8)
    ax.set_axis_off()
    return ax


def draw_pool(blocks: BlockManager, ax=None, title: str | None = None, columns: int = 8,
              names: dict[str, str] | None = None):
    """One square per block, coloured by state.

    Each square shows the block number, the first 4 hex digits of its hash ('-' when it has none),
    and either who holds it (in-use blocks: request ids, several when shared) or its place in the
    free queue (free blocks: '#1' is handed out next). ``names`` shortens request ids.
    """
    from matplotlib.patches import Patch, Rectangle

    names = names or {}
    rows = -(-blocks.num_blocks // columns)
    ax = _axes(ax, (1.35 * columns, 1.3 * rows + 0.9))
    holders: dict[int, list[str]] = {}
    for rid, table in blocks.req_blocks.items():
        for b in table:
            holders.setdefault(b, []).append(names.get(rid, rid))
    queue_pos = {b: i + 1 for i, b in enumerate(blocks.free_queue)}
    for b in range(blocks.num_blocks):
        x, y = b % columns, rows - 1 - b // columns
        state = block_state(blocks, b)
        ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, facecolor=STATE_COLOURS[state],
                               edgecolor="black", linewidth=0.6))
        h = blocks.block_hash[b]
        ink = "white" if state == "in use" else "black"
        ax.text(x + 0.5, y + 0.76, f"block {b}", ha="center", va="center", fontsize=8, color=ink,
                fontweight="bold")
        ax.text(x + 0.5, y + 0.5, h.hex()[:4] if h is not None else "-", ha="center", va="center",
                fontsize=9, family="monospace", color=ink)
        below = ",".join(holders[b]) if state == "in use" else f"#{queue_pos[b]}"
        ax.text(x + 0.5, y + 0.24, below, ha="center", va="center", fontsize=8, color=ink)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.set_axis_off()
    counts = pool_counts(blocks)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="black", label=f"{s} ({counts[s]})")
                       for s, c in STATE_COLOURS.items()],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def _token_cap(heights: list[int]) -> float | None:
    """Where to clip the tokens panel: when the tallest step dwarfs the rest (typically the first,
    which admits every prompt at once), just above the second tallest; otherwise no clipping."""
    heights = sorted(heights)
    if len(heights) > 1 and heights[-1] > 2 * heights[-2] > 0:
        return 1.4 * heights[-2]
    return None


def shared_limits(*traces: list[StepRecord]) -> dict:
    """``plot_trace`` keyword arguments that give several traces the same y-scales, so panels side
    by side can be compared by eye."""
    caps = []
    for records in traces:  # each trace's own range (its outlier step clipped), then the widest
        heights = [r.tokens for r in records]
        cap = _token_cap(heights)
        caps.append(cap if cap is not None else 1.05 * max(heights, default=1))
    blocks = [r.in_use + r.cached_free for records in traces for r in records]
    return {"token_ylim": max(caps, default=1), "block_ylim": 1.05 * max(blocks, default=1)}


def plot_trace(records: list[StepRecord], axes=None, title: str = "", num_blocks: int | None = None,
               token_ylim: float | None = None, block_ylim: float | None = None):
    """Two panels: tokens per step (stacked by kind) and blocks held per step (in use, cached-free).

    A step far taller than the rest (typically the first, which admits every prompt at once) is
    clipped so the decode steps stay visible; its height is written above it. ``token_ylim`` and
    ``block_ylim`` fix the panels' y-ranges (``shared_limits`` computes them for several traces);
    a token step above ``token_ylim`` is clipped the same way. ``num_blocks`` draws the pool size
    as a line when it is within reach of the plotted values. Steps that preempted are marked with
    dotted lines, and the x label says so only when there are any.
    """
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    steps = [r.step for r in records]
    bottom = [0] * len(records)
    for kind, colour in KIND_COLOURS.items():
        values = [getattr(r, kind) for r in records]
        axes[0].bar(steps, values, bottom=bottom, color=colour, width=1.0, label=kind)
        bottom = [a + b for a, b in zip(bottom, values)]
    cap = token_ylim if token_ylim is not None else _token_cap(bottom)
    if cap is not None:
        axes[0].set_ylim(0, cap)
        for step, h in zip(steps, bottom):
            if h > cap:
                axes[0].text(step + 0.8, cap * 0.97, f"{h} tokens", ha="left", va="top", fontsize=8)
    axes[0].set_ylabel("tokens in the step")
    axes[0].legend(fontsize=8, loc="upper right")
    preempting = [r.step for r in records if r.preempted]
    for step in preempting:
        axes[0].axvline(step, color="black", linestyle=":", linewidth=0.8)
    held = [[r.in_use for r in records], [r.cached_free for r in records]]
    axes[1].stackplot(steps, *held, colors=[STATE_COLOURS["in use"], STATE_COLOURS["cached-free"]],
                      labels=["in use", "cached-free"], step="mid")
    top = max((a + b for a, b in zip(*held)), default=0)
    if block_ylim is not None:
        axes[1].set_ylim(0, block_ylim)
    reach = block_ylim if block_ylim is not None else 1.5 * max(top, 1)
    if num_blocks is not None and num_blocks <= reach:
        axes[1].axhline(num_blocks, color="black", linewidth=1, linestyle="--", label="pool size")
    axes[1].set_ylabel("blocks")
    axes[1].set_xlabel("step (dotted lines: a preemption)" if preempting else "step")
    axes[1].legend(fontsize=8, loc="lower left")
    if title:
        axes[0].set_title(title, fontsize=10)
    return axes
