"""The chapter's worked example is what ``python -m course.figures.example`` prints, and what it
prints is right: the tokens equal ``generate()`` on each prompt alone, and the step's slots, spans
and sampled rows are recomputed here from the plan and the tables by the chapter's formulas."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from course.figures import example
from engine.generate import generate
from engine.models import tiny_model

pytestmark = pytest.mark.given  # runs the reference core; no hole of its own

README = Path(__file__).resolve().parent.parent / "chapters" / "31-engine-v2" / "README.md"


@pytest.fixture(scope="module")
def result():
    torch.manual_seed(0)
    return example.run(tiny_model(seed=0))


def test_the_chapter_quotes_the_command_s_output_exactly(result):
    text = README.read_text()
    printed = example.report(result)
    assert "python -m course.figures.example" in text, "the chapter names the command next to its example"
    assert printed in text, \
        "the chapter's worked example is no longer what `.venv/bin/python -m course.figures.example` prints: " \
        "paste its output into the fenced block"


def test_the_example_serves_each_prompt_as_generate_does(result):
    model = tiny_model(seed=0)
    sc = result.scenario
    for rid, prompt in sc.prompts.items():
        assert result.outputs[rid] == generate(model, prompt, sc.max_tokens[rid]), rid
    assert result.cached == {"alice": 0, "bob": 8, "carol": 0}, "bob adopts the two blocks of alice's system prompt"


def test_every_plan_keeps_the_budget_and_the_shown_batch_follows_the_formulas(result):
    bs = example.BLOCK_SIZE
    for plan in result.plans:
        assert sum(n for _, _, n in plan) <= example.BUDGET
    plan = result.plans[example.SHOWN_STEP - 1]
    assert [(rid, c, n) for rid, c, n in plan] == [("alice", 11, 1), ("bob", 8, 6), ("carol", 0, 5)]
    batch = result.batches[example.SHOWN_STEP - 1]
    tables = batch.meta.block_table.tolist()
    positions, slots, spans = [], [], [0]
    for r, (rid, c, n) in enumerate(plan):
        positions += list(range(c, c + n))
        slots += [tables[r][p // bs] * bs + p % bs for p in range(c, c + n)]
        spans.append(spans[-1] + n)
    assert batch.positions.tolist() == positions and batch.meta.slot_mapping.tolist() == slots
    assert batch.meta.query_start_loc_cpu.tolist() == spans
    assert batch.meta.seq_lens_cpu.tolist() == [c + n for _, c, n in plan]
    # a row is sampled when it is its span's last and that span reaches the request's newest token
    totals = {"alice": len(result.scenario.prompts["alice"]) + 1, "bob": 14, "carol": 20}
    want = [spans[r + 1] - 1 for r, (rid, c, n) in enumerate(plan) if c + n == totals[rid]]
    assert batch.logits_indices.tolist() == want == [0, 6]
    assert tables[0][:2] == tables[1][:2], "alice and bob share the system prompt's two blocks"


def test_the_prose_around_the_example_quotes_the_same_run(result):
    """The figures the chapter's sentences repeat (not only its fenced output) come from the run."""
    text = " ".join(README.read_text().split())  # line breaks of the prose do not matter
    batch = result.batches[example.SHOWN_STEP - 1]
    [(_, _, alice_n), (_, bob_c, bob_n), (_, _, carol_n)] = result.plans[example.SHOWN_STEP - 1]
    bob_slot_12 = batch.meta.slot_mapping.tolist()[alice_n + 12 - bob_c]
    for quoted in (f"The token it produces, {result.outputs['alice'][0]},",
                   f"Bob starts at c = {bob_c}, not 0",
                   f"12 − {alice_n} − {bob_n} = {carol_n} of her 20 tokens",
                   f"at offset 0: slot {bob_slot_12}",
                   f"*query_start_loc* `{batch.meta.query_start_loc_cpu.tolist()}`",
                   f"`logits_indices` is `{batch.logits_indices.tolist()}`"):
        assert quoted in text, f"the chapter's prose no longer matches the run: {quoted!r}"
