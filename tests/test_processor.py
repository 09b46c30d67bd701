"""The engine's front door (``engine.serve.processor``): a request is checked and fanned out into
its children before anything is queued, and the ids come from ``engine.serve.parallel_sampling``."""
from __future__ import annotations

import pytest

from ch31_helpers import model64
from engine.serve import EngineConfig, EngineCore, SamplingParams
from engine.serve.parallel_sampling import ParentRequest


def _core() -> EngineCore:
    return EngineCore(model64(), EngineConfig(block_size=4, num_blocks=64, max_model_len=100,
                                              attention_backend="reference"))


def test_process_inputs_fans_out_children_and_queues_nothing():
    core = _core()
    parent, children = core.processor.process_inputs("p", (5, 6, 7), SamplingParams(n=3, seed=5, temperature=0.5))
    assert parent.child_ids == ["p:0", "p:1", "p:2"] == [r.request_id for r in children]
    assert [r.params.seed for r in children] == [5, 6, 7] and {r.params.n for r in children} == {1}
    assert all(r.prompt_token_ids == [5, 6, 7] for r in children)
    assert parent.params.max_tokens == 16, "SamplingParams' default max_tokens is kept"
    assert not core.scheduler.requests and not core.parents, "the processor queues nothing"
    _, [only] = core.processor.process_inputs("q", [1, 2], SamplingParams(max_tokens=None, temperature=0.0))
    assert only.request_id == "q" and only.params.max_tokens == 98, "max_tokens=None: what the context allows"


def test_the_processor_refuses_before_the_core_sees_anything():
    core = _core()
    for prompt, params, fragment in [([], None, "prompt_token_ids is empty"),
                                     ([512], None, "outside the vocabulary [0, 512)"),
                                     ([1] * 90, SamplingParams(max_tokens=11), "exceeds max_model_len=100")]:
        with pytest.raises(ValueError) as err:
            core.processor.process_inputs("a", prompt, params)
        assert fragment in str(err.value), str(err.value)


def test_a_parent_counts_its_children_down():
    parent = ParentRequest("x", SamplingParams(n=2))
    assert [parent.child_finished(), parent.child_finished()] == [False, True] and parent.num_live == 0
    assert ParentRequest("y", SamplingParams()).child_ids == ["y"], "n == 1 reports under its own id"
