"""`make soak`'s own judgement (course/quality/soak.py): a course tool, so it is tested here and not
among the engine checks the grader runs in its sandbox (which holds no soak)."""
from __future__ import annotations

from engine.serve import EngineConfig, EngineCore, SamplingParams


def test_the_soak_judges_a_min_tokens_request_by_the_masked_continuation():
    """`make soak`'s oracle follows the min_tokens rule as the engine does (issue 35's soak showed
    133 "mismatches" that were the old oracle's: it cut generate()'s tokens instead of masking the
    stop id while min_tokens held it back). A request whose stop id is its own first greedy
    token, with min_tokens=1, must continue past it -- and the soak must accept that answer."""
    from course.quality.soak import Soak, Tracked

    soak = Soak(seed=0)
    soak.eos, soak.aborted, soak.done = None, set(), set()  # what an episode sets up
    prompt = tuple(soak.prefixes[1] + soak.suffixes[0])
    first = soak.greedy(prompt)[0]
    p = SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=[first], temperature=0.0)
    core = EngineCore(soak.model, EngineConfig(block_size=4, num_blocks=32))
    soak.core = core
    core.add_request("q", list(prompt), p)
    tracked, final = Tracked(prompt, p, "q"), None
    while core.has_unfinished():
        for out in core.step():
            tracked.streamed.extend(out.new_token_ids)
            final = out if out.finished else final
    assert final.output_token_ids[0] != first, "min_tokens=1 must mask the stop id for the first token"
    soak.finished(final, tracked)
    assert soak.violations == [] and soak.counts["compared"] == 1, soak.violations
