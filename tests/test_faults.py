"""A failed step leaves the engine as if it never ran.

The scheduler publishes a step's full blocks in the prefix cache before the forward pass fills
them (so a request admitted later in the same plan can share them). If the forward pass raises
part-way (``course.quality.faults.forward_fault``: at a seeded random layer, before or after that
layer writes its K/V), those blocks hold nothing valid: the engine must take back their
publication, and a request that adopted them must compute them itself. Every later output is
compared with ``generate()``; the whole engine is checked after every step, the failed one included.
"""
from __future__ import annotations

import random

import pytest

from ch31_helpers import model64, oracle, prompts, run_checked
from engine.serve import EngineConfig, EngineCore, SamplingParams
from course.quality.faults import PLACES, InjectedFault, backend_fault, forward_fault
from course.quality.invariants import check_engine_invariants, check_idle, engine_violations

SHARED = prompts([16], seed=41)[0]  # four blocks of 4: the prefix two requests share
TAILS = prompts([3, 5, 2], seed=42)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
FAULTS = [(layer, where) for layer in range(2) for where in PLACES]  # the test model has 2 layers


FAST = dict(flat_model="fused", attention_backend="cpu")  # FusedFlatModel: faults through the backend


def _failed_step(core: EngineCore, layer: int, where: str) -> None:
    fault = backend_fault(core, layer, where) if core.config.flat_model != "flat" else forward_fault(core.model, layer, where)
    with fault, pytest.raises(InjectedFault):
        core.step()
    check_engine_invariants(core)


def _core(**overrides) -> EngineCore:
    return EngineCore(model64(), EngineConfig(**{**dict(block_size=4, num_blocks=40), **overrides}))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("layer, where", FAULTS)
@pytest.mark.parametrize("abort", [None, "a", "b"])
def test_failed_first_step_then_retry_or_abort(layer, where, abort, fast):
    """a and b share four blocks and are admitted in the same step, b adopting the blocks a is
    about to compute. The step fails; then nothing, a, or b is aborted; every request left, and a
    later request with a's prompt, must still equal generate(). ``fast``: the same on the fused
    model and the cpu backend (its last layer runs on the kept rows only)."""
    core = _core(**(FAST if fast else {}))
    pa, pb = SHARED + TAILS[0], SHARED + TAILS[1]
    core.add_request("a", pa, GREEDY)
    core.add_request("b", pb, GREEDY)
    _failed_step(core, layer, where)
    if abort:
        core.abort_request(abort)
        check_engine_invariants(core)
    out = run_checked(core)
    for rid, p in (("a", pa), ("b", pb)):
        if rid != abort:
            assert out[rid] == oracle(tuple(p), 6), f"{rid} differs from generate() after a failed step"
    core.add_request("again", pa, GREEDY)  # finds a's blocks in the prefix cache (when they are valid)
    assert run_checked(core)["again"] == oracle(tuple(pa), 6), \
        "a later request with the same prompt read K/V that the failed step never wrote"
    check_idle(core)


@pytest.mark.parametrize("layer, where", FAULTS)
@pytest.mark.parametrize("abort_a", [False, True])
def test_failed_decode_step_whose_block_was_adopted(layer, where, abort_a):
    """a's first generated token fills its fifth block in a decode step; b, whose prompt continues
    a's text, is admitted in that step and adopts all five blocks. The step fails (and a is perhaps
    aborted): b, and a later request with b's prompt, must equal generate()."""
    core = _core()
    pa = SHARED + TAILS[0]  # 19 tokens: the decode of position 19 fills block 4
    pb = pa + oracle(tuple(pa), 1) + TAILS[2]
    core.add_request("a", pa, SamplingParams(max_tokens=8, temperature=0.0))
    core.step()  # a's prompt, and its first token
    core.add_request("b", pb, GREEDY)
    _failed_step(core, layer, where)
    if abort_a:
        core.abort_request("a")
    out = run_checked(core)
    assert out["b"] == oracle(tuple(pb), 6)
    if not abort_a:
        assert out["a"] == oracle(tuple(pa), 8)
    core.add_request("c", pb, GREEDY)
    assert run_checked(core)["c"] == oracle(tuple(pb), 6)
    check_idle(core)


def test_checker_sees_a_published_block_that_was_never_computed():
    """Without the engine's recovery, the failed step's publications stay: the checker must say so."""
    core = _core()
    core.add_request("a", SHARED + TAILS[0], GREEDY)
    core.scheduler.schedule()  # publishes a's four prompt blocks; no forward pass follows
    bad = engine_violations(core)
    assert any("published" in v for v in bad), f"the checker missed uncomputed published blocks: {bad}"


@pytest.mark.parametrize("seed", range(12))
def test_random_faults_with_preemption_and_swap(seed):
    """A seeded random workload (shared prefixes, repeated prompts arriving while others run, a
    tight pool, both preemption modes) whose steps fail at random layers, often followed by an
    abort of a running request; every request that finishes normally equals generate(). Every
    third seed runs the fused model on the cpu backend."""
    rng = random.Random(seed)
    core = _core(num_blocks=rng.choice((12, 16, 40)), max_num_batched_tokens=rng.choice((8, 16, 64)),
                 preemption_mode=rng.choice(("recompute", "swap")), block_size=rng.choice((2, 4)),
                 **(FAST if seed % 3 == 2 else {}))
    family = [SHARED[:k] + TAILS[j] for k in (8, 16) for j in range(3)]
    todo: dict[str, tuple[list[int], int]] = {}

    def add() -> None:
        rid = f"r{len(todo)}"
        todo[rid] = (rng.choice(family), rng.randint(1, 6))
        core.add_request(rid, todo[rid][0], SamplingParams(max_tokens=todo[rid][1], temperature=0.0))

    for _ in range(4):
        add()
    done, aborted, faults = {}, set(), 0
    for i in range(500):
        if not core.has_unfinished():
            break
        if len(todo) < 16 and rng.random() < 0.3:
            add()
        if i == 1 or rng.random() < 0.3:
            faults += 1
            _failed_step(core, rng.randrange(2), rng.choice(PLACES))
            running = sorted(r.request_id for r in core.scheduler.running)
            if running and rng.random() < 0.6:
                victim = rng.choice(running)
                aborted.add(victim)
                core.abort_request(victim)
                check_engine_invariants(core)
            continue
        for o in core.step():
            if o.finished:
                done[o.request_id] = o
        check_engine_invariants(core)
    assert faults > 0
    check_idle(core)
    for rid, (p, max_tokens) in todo.items():
        if rid not in aborted:
            assert done[rid].output_token_ids == oracle(tuple(p), max_tokens), \
                f"{rid} differs from generate() after failed steps"


@pytest.mark.parametrize("which", ["swap_out", "swap_in"])
def test_failed_swap_copy(which):
    """The copy of a swap-out or swap-in raises (host memory exhausted): the request it concerned
    falls back to recomputing, and every output still equals generate()."""
    core = _core(num_blocks=9, preemption_mode="swap", max_num_batched_tokens=8)
    todo = {f"r{i}": SHARED[:8] + TAILS[i % 3] + [i] for i in range(4)}
    for rid, p in todo.items():
        core.add_request(rid, p, SamplingParams(max_tokens=8, temperature=0.0))
    original = getattr(core.runner, which)
    fired = []

    def fail_once(req, blocks):
        if not fired:
            fired.append(req.request_id)
            raise InjectedFault(f"injected fault in {which}")
        return original(req, blocks)

    setattr(core.runner, which, fail_once)
    done = {}
    while core.has_unfinished():
        try:
            outs = core.step()
        except InjectedFault:
            outs = []
        for o in outs:
            if o.finished:
                done[o.request_id] = o.output_token_ids
        check_engine_invariants(core)
    assert fired, f"the workload never reached a {which}: adjust the test"
    check_idle(core)
    for rid, p in todo.items():
        assert done[rid] == oracle(tuple(p), 8), f"{rid} differs from generate() after a failed {which}"
