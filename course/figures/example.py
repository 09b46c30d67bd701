"""``python -m course.figures.example``: the chapter's worked example, run rather than made up.

    python -m course.figures.example                 # what the chapter prints, on the reference
    python -m course.figures.example --impl engine   # the same scenario on your engine

A small chat service on the 2-layer test model (``tiny_model(seed=0)``), with blocks of 4 tokens, a
pool of 16 blocks and a budget of 12 tokens a step. Alice sends an 8-token system prompt and a
3-token question and is served alone for one step; then Bob (the same system prompt, a 6-token
question) and Carol (a 20-token prompt of her own) arrive. The command prints every step's plan
(the scheduler's ``(request, n)`` pairs, with each request's ``num_computed_tokens`` before the
step) and the flat batch of step 2, the step in which a decode, a prefix-cache hit and a chunk of
a long prompt share one forward pass. Every figure of the chapter's worked example is a line of
this output, and ``tests/test_chapter_example.py`` checks that the chapter quotes it exactly.

The engine is only observed (``EngineCore.observe``): the plans and batches are the ones its own
steps made.
"""
from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field

from engine._impl import add_impl_argument, apply_impl

BLOCK_SIZE = 4
NUM_BLOCKS = 16
BUDGET = 12  # max_num_batched_tokens
SHOWN_STEP = 2  # the step whose batch the chapter draws
NAMES = {"alice": "A", "bob": "B", "carol": "C"}  # row labels: "B8" = Bob's token at position 8


@dataclass
class Scenario:
    """The example's requests: id -> (prompt token ids, output tokens wanted, step it arrives after)."""

    prompts: dict[str, list[int]]
    max_tokens: dict[str, int]
    arrives_after: dict[str, int]


@dataclass
class ExampleRun:
    """What the run produced: per step the plan as ``(request id, c, n)`` triples, the batch of every
    step, each request's output tokens and the number of prompt tokens the prefix cache supplied."""

    scenario: Scenario
    plans: list[list[tuple[str, int, int]]] = field(default_factory=list)
    batches: list = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)


def scenario() -> Scenario:
    rng = random.Random(31)
    system = [rng.randrange(1, 512) for _ in range(8)]  # the test model's vocabulary is 512
    prompts = {"alice": system + [rng.randrange(1, 512) for _ in range(3)],
               "bob": system + [rng.randrange(1, 512) for _ in range(6)],
               "carol": [rng.randrange(1, 512) for _ in range(20)]}
    return Scenario(prompts, {"alice": 5, "bob": 3, "carol": 2}, {"alice": 0, "bob": 1, "carol": 1})


def run(model=None) -> ExampleRun:
    """Serve the scenario to the end, keeping every step's plan and batch."""
    from engine.models import tiny_model
    from engine.serve import EngineConfig, EngineCore, SamplingParams

    sc = scenario()
    core = EngineCore(model if model is not None else tiny_model(seed=0),
                      EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_batched_tokens=BUDGET))
    result = ExampleRun(sc)

    def observe(phase, value, seconds):
        if phase == "schedule" and value.scheduled:
            result.plans.append([(r.request_id, r.num_computed_tokens, n) for r, n in value.scheduled])
        elif phase == "prepare":
            result.batches.append(value)

    core.observe(observe)
    requests = {}
    step = 0
    while step == 0 or core.has_unfinished():
        for rid, after in sc.arrives_after.items():
            if after == step:
                core.add_request(rid, sc.prompts[rid], SamplingParams(temperature=0.0, max_tokens=sc.max_tokens[rid],
                                                                      ignore_eos=True))
                requests[rid] = core.scheduler.waiting[-1]
        core.step()
        step += 1
    result.outputs = {rid: list(r.output_token_ids) for rid, r in requests.items()}
    result.cached = {rid: r.num_cached_tokens for rid, r in requests.items()}
    return result


def _cells(values, spans) -> str:
    """Values laid out in columns of 4, a bar between requests."""
    return " |".join("".join(f"{v:>4}" for v in values[a:b]) for a, b in spans)


def report(result: ExampleRun) -> str:
    """The text the chapter quotes."""
    sc = result.scenario
    lines = [f"the 2-layer test model; blocks of {BLOCK_SIZE} tokens, a pool of {NUM_BLOCKS} blocks, "
             f"a budget of {BUDGET} tokens a step",
             f"alice  {len(sc.prompts['alice'])}-token prompt (system prompt 8 + question 3), "
             f"wants {sc.max_tokens['alice']} tokens, arrives first",
             f"bob    {len(sc.prompts['bob'])}-token prompt (the same system prompt + question 6), "
             f"wants {sc.max_tokens['bob']}, arrives after step 1",
             f"carol  {len(sc.prompts['carol'])}-token prompt of her own, "
             f"wants {sc.max_tokens['carol']}, arrives after step 1",
             "",
             "step  plan: (request, n) at c = num_computed_tokens"]
    for i, plan in enumerate(result.plans, 1):
        lines.append(f"{i:>4}  " + " | ".join(f"({rid}, {n}) at c={c}" for rid, c, n in plan))
    batch = result.batches[SHOWN_STEP - 1]
    m = batch.meta
    qsl = m.query_start_loc_cpu.tolist()
    spans = list(zip(qsl, qsl[1:]))
    rows = list(range(len(batch.positions)))
    sampled = set(batch.logits_indices.tolist())
    owners = [NAMES[rid] for rid, (a, b) in zip(batch.request_ids, spans) for _ in range(a, b)]
    lines += ["",
              f"step {SHOWN_STEP}'s batch",
              "row          " + _cells(rows, spans),
              "request      " + _cells(owners, spans),
              "input_ids    " + _cells(batch.input_ids.tolist(), spans),
              "positions    " + _cells(batch.positions.tolist(), spans),
              "slot_mapping " + _cells(m.slot_mapping.tolist(), spans),
              "sampled?     " + _cells(["yes" if i in sampled else "." for i in rows], spans),
              "",
              f"query_start_loc {qsl}",
              f"seq_lens        {m.seq_lens_cpu.tolist()}",
              f"block_table     {m.block_table.tolist()}",
              f"sample_counts   {batch.sample_counts}",
              f"logits_indices  {batch.logits_indices.tolist()}",
              "",
              "prompt tokens from the prefix cache: " + ", ".join(f"{rid} {n}" for rid, n in result.cached.items()),
              "outputs: " + "; ".join(f"{rid} {toks}" for rid, toks in result.outputs.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    apply_impl(argv, prog="python -m course.figures.example")
    ap = argparse.ArgumentParser(prog="python -m course.figures.example", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_impl_argument(ap)
    ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    print(report(run()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
