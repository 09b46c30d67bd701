"""``python -m course.figures.chapter``: the notebook's pictures, saved as the PNG files the
chapter README shows.

    python -m course.figures.chapter                      # writes chapters/31-engine-v2/figures/*.png
    python -m course.figures.chapter --out DIR --impl engine   # your engine's pictures, elsewhere

Two pictures, drawn by ``course.figures.viz`` exactly as the notebook draws them: ``worked-batch.png``
(the chapter's worked batch: every row and the pool slot its K/V go to) and ``pool-trace.png``
(the 16-request benchmark with an ample and a 24-block pool: tokens per step by kind, blocks held
per step). They are kept small (a low resolution, no metadata), so that the repository carries
tens of kilobytes. (``python -m course.figures.notebooks --save DIR`` keeps the whole executed notebook
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
    """The worked example's batch (same requests and tables as the chapter and the notebook)."""
    from engine.serve import Request, build_batch

    a = Request("a", list(range(100, 120)))
    a.num_computed_tokens = 6
    b = Request("b", list(range(200, 230)))
    for t in range(230, 242):
        b.append(t)
    b.num_computed_tokens = 41
    c = Request("c", list(range(300, 305)))
    for t in range(305, 310):
        c.append(t)
    c.num_computed_tokens = 9
    d = Request("d", list(range(400, 404)))
    tables = {"a": [5], "b": [7, 8, 9], "c": [1], "d": [4]}
    return build_batch([(a, 3), (b, 1), (c, 1), (d, 4)], tables, block_size=16)


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


def save(out: Path, dpi: int = 72) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from course.figures.viz import draw_batch, plot_trace, shared_limits

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    ax = draw_batch(worked_batch())
    fig = ax.figure
    written.append(out / "worked-batch.png")
    fig.savefig(written[-1], dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)

    runs = benchmark_traces()
    fig, axes = plt.subplots(2, 2, figsize=(12, 5.5), sharex="col")
    limits = shared_limits(*(records for _, records in runs))
    for col, (num_blocks, records) in enumerate(runs):
        plot_trace(records, axes[:, col], title=f"pool of {num_blocks} blocks", num_blocks=num_blocks, **limits)
    fig.tight_layout()
    written.append(out / "pool-trace.png")
    fig.savefig(written[-1], dpi=dpi, metadata={"Software": None})
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
