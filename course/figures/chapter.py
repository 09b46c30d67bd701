"""``python -m course.figures.chapter``: the notebook's pictures, saved as the PNG files the
chapter README shows.

    python -m course.figures.chapter                      # writes chapters/31-engine-v2/figures/*.png
    python -m course.figures.chapter --out DIR --impl engine   # your engine's pictures, elsewhere

Two pictures, drawn by ``course.figures.viz`` exactly as the notebook draws them: ``worked-batch.png``
(the chapter's worked example, step 2's batch: every row and the pool slot its K/V go to) and ``pool-trace.png``
(the 16-request benchmark with an ample and a 24-block pool: tokens per step by kind, blocks held
per step). They are kept small (a low resolution, no metadata but one), so that the repository
carries tens of kilobytes. The one: each PNG carries, in a text chunk named ``ch31-content``, a
digest of what the figure shows (every text on it, every line's data, every patch's place and
colour, each axis's limits; see ``content_digest``), so that ``tests/test_notebook.py`` can tell a
committed picture that no longer matches what the code draws (a stale title, a changed trace) from
one that differs only in how a font rendered. (``python -m course.figures.notebooks --save DIR`` keeps the whole executed notebook
instead, with every picture in it.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine._impl import add_impl_argument, apply_impl

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "chapters" / "31-engine-v2" / "figures"


def worked_batch():
    """The chapter's worked example: the batch of the step ``course.figures.example`` shows (step 2
    of its three-request run on the test model), exactly as the engine built it."""
    from course.figures import example

    return example.run().batches[example.SHOWN_STEP - 1]


def benchmark_traces():
    """Step records of the benchmark workload with an ample pool and with 24 blocks."""
    from engine.models import tiny_model
    from engine.serve import EngineConfig, EngineCore, SamplingParams
    from course.figures.viz import StepTracer
    from course.bench.workloads import shared_prefix_workload

    model = tiny_model(seed=0)
    runs = []
    for num_blocks in (None, 24):
        core = EngineCore(model, EngineConfig(num_blocks=num_blocks))
        for item in shared_prefix_workload(16):
            core.add_request(item.request_id, item.prompt_token_ids,
                             SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True))
        tracer = StepTracer(core)
        tracer.run_until_done()
        runs.append((core.blocks.num_blocks, tracer.records))
    return runs


CONTENT_KEY = "ch31-content"


def _rounded(values) -> list:
    """Numbers rounded to 4 decimals (float noise is not content); nested lists kept."""
    import numpy as np

    return np.round(np.asarray(values, dtype=np.float64), 4).tolist()


def content_digest(fig) -> str:
    """SHA-256 (hex) of what ``fig`` shows, independent of fonts and rasterizing: per axes its
    limits, every visible text (titles, labels, tick labels, annotations: string and position),
    every line's data, every patch's outline in data coordinates with its face colour, and every
    collection's offsets. Two figures drawn from the same records have the same digest."""
    import hashlib
    import json

    from matplotlib.colors import to_rgba

    fig.canvas.draw()  # tick labels exist only after a draw
    parts = []
    for ax in fig.axes:
        item = {"xlim": _rounded(ax.get_xlim()), "ylim": _rounded(ax.get_ylim()), "texts": [], "lines": [],
                "patches": [], "collections": []}
        texts = [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts,
                 *ax.get_xticklabels(), *ax.get_yticklabels()]
        legend = ax.get_legend()
        if legend is not None:
            texts += legend.get_texts()
        for t in texts:
            if t.get_visible() and t.get_text():
                item["texts"].append([t.get_text(), _rounded(t.get_position())])
        for line in ax.get_lines():
            item["lines"].append(_rounded(line.get_xydata()))
        for patch in ax.patches:
            verts = patch.get_patch_transform().transform(patch.get_path().vertices) \
                if hasattr(patch, "get_patch_transform") else patch.get_path().vertices
            item["patches"].append([_rounded(verts), _rounded(to_rgba(patch.get_facecolor()))])
        for coll in ax.collections:
            item["collections"].append(_rounded(coll.get_offsets()))
        parts.append(item)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def stored_digest(path: Path) -> str | None:
    """The ``ch31-content`` text chunk of the PNG at ``path`` (None when it has none)."""
    import struct
    import zlib

    data = path.read_bytes()
    at = 8  # after the signature
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            key, _, value = body.partition(b"\0")
            if key.decode("latin-1") == CONTENT_KEY:
                if kind == b"zTXt":
                    value = zlib.decompress(value[1:])
                elif kind == b"iTXt":
                    value = value.split(b"\0", 3)[-1]
                return value.decode("latin-1")
        at += 12 + length
    return None


def _savefig(fig, path: Path, dpi: int, **kwargs) -> None:
    fig.savefig(path, dpi=dpi, metadata={"Software": None, CONTENT_KEY: content_digest(fig)}, **kwargs)


def save(out: Path, dpi: int = 72) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from course.figures.viz import draw_batch, plot_trace, shared_limits

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    from course.figures.example import NAMES

    ax = draw_batch(worked_batch(), names=NAMES)
    fig = ax.figure
    written.append(out / "worked-batch.png")
    _savefig(fig, written[-1], dpi, bbox_inches="tight")
    plt.close(fig)

    runs = benchmark_traces()
    fig, axes = plt.subplots(2, 2, figsize=(12, 5.5), sharex="col")
    limits = shared_limits(*(records for _, records in runs))
    for col, (num_blocks, records) in enumerate(runs):
        plot_trace(records, axes[:, col], title=f"pool of {num_blocks} blocks", num_blocks=num_blocks, **limits)
    fig.tight_layout()
    written.append(out / "pool-trace.png")
    _savefig(fig, written[-1], dpi)
    plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    apply_impl(argv, prog="python -m course.figures.chapter")
    ap = argparse.ArgumentParser(prog="python -m course.figures.chapter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"directory to write to (default {DEFAULT_OUT})")
    ap.add_argument("--dpi", type=int, default=72, help="resolution (default 72: tens of KB per picture)")
    add_impl_argument(ap)
    args = ap.parse_args(argv)
    for path in save(args.out, args.dpi):
        print(f"{path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
