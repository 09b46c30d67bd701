"""``EngineCore.observe``: an observer sees every phase of each step, and an unobserved engine is untouched."""
from __future__ import annotations

import pytest

from ch31_helpers import model64, oracle, prompts
from engine.serve import Batch, EngineConfig, EngineCore, SamplingParams, Scheduler, SchedulerOutput, SimpleSampler
from engine.serve.observer import PHASES
from engine.serve.runner import ModelRunner

pytestmark = pytest.mark.given  # given code: the reference fills every hole under --impl engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def make_core(lengths=(20, 5, 33)) -> tuple[EngineCore, list[list[int]]]:
    core = EngineCore(model64(), EngineConfig(num_blocks=32, max_num_batched_tokens=24))
    ps = prompts(lengths, seed=4)
    for i, p in enumerate(ps):
        core.add_request(f"r{i}", p, GREEDY)
    return core, ps


def test_observer_sees_each_phase_with_its_result():
    core, ps = make_core()
    seen: list[tuple[str, object, float]] = []
    core.observe(lambda phase, result, seconds: seen.append((phase, result, seconds)))
    done = core.run_until_done()
    assert done == {f"r{i}": oracle(tuple(p), 6) for i, p in enumerate(ps)}, "observing changed the outputs"
    steps = [seen[i:i + 4] for i in range(0, len(seen), 4)]
    assert len(steps) == core.steps and len(seen) == 4 * core.steps
    for step in steps:
        assert tuple(phase for phase, _, _ in step) == PHASES
        assert all(seconds >= 0.0 for _, _, seconds in step)
        (_, plan, _), (_, batch, _), (_, logits, _), (_, tokens, _) = step
        assert isinstance(plan, SchedulerOutput) and isinstance(batch, Batch)
        assert batch.request_ids == [req.request_id for req, _ in plan.scheduled]
        assert len(batch.input_ids) == plan.num_scheduled_tokens
        assert logits.shape == (batch.logits_indices.numel(), core.model.cfg.vocab_size)
        assert len(tokens) == batch.num_sample_rows
    # the first plan: a 24-token budget splits the 20 + 5 + 33 prompt tokens into chunks
    assert [(req.request_id, n) for req, n in steps[0][0][1].scheduled] == [("r0", 20), ("r1", 4)]


def test_a_step_with_nothing_to_compute_reports_the_plan_only():
    core, _ = make_core()
    core.run_until_done()
    seen = []
    core.observe(lambda phase, result, seconds: seen.append((phase, result)))
    assert core.step() == []
    assert [phase for phase, _ in seen] == ["schedule"] and seen[0][1].empty


def test_every_observer_is_called_and_the_sampler_keeps_its_attributes():
    core, _ = make_core((9,))
    first, second = [], []
    core.observe(lambda phase, result, seconds: first.append(phase))
    core.observe(lambda phase, result, seconds: second.append(phase))
    core.step()
    assert first == second == list(PHASES)
    assert core.sampler.name == "simple" and core.sampler.generator is core.generator
    with pytest.raises(ValueError, match="full sampler"):  # add_request still checks through the sampler
        core.add_request("x", [1, 2], SamplingParams(max_tokens=2, logit_bias={1: 0.5}))


def test_an_engine_nobody_observes_is_not_touched():
    core, _ = make_core()
    assert "schedule" not in vars(core.scheduler) and core.scheduler.schedule.__func__ is Scheduler.schedule
    assert not {"prepare", "execute"} & set(vars(core.runner))
    assert core.runner.prepare.__func__ is ModelRunner.prepare and type(core.sampler) is SimpleSampler


def test_an_observer_must_be_callable():
    core, _ = make_core()
    schedule = core.scheduler.schedule
    with pytest.raises(ValueError, match="callable"):
        core.observe("print")
    assert core.scheduler.schedule == schedule and type(core.sampler) is SimpleSampler

