"""Step observers: what each phase of ``EngineCore.step()`` returned, and how long it took.

An observer is any callable ``observer(phase, result, seconds)``. ``EngineCore.observe(observer)``
installs it on that one engine; from then on every step calls it right after each phase returns:

    phase       fires after                          result
    "schedule"  ``scheduler.schedule()``             the step's plan (SchedulerOutput)
    "prepare"   ``runner.prepare(scheduled, ...)``   the Batch
    "execute"   ``runner.execute(batch)``            the logits, [sample rows + prompt-logprob rows, V]
    "sample"    ``sampler(logits, requests, ...)``   the sampled token ids, one per sample row

``seconds`` is that call's wall time; on CUDA the clock stops after a synchronize, so it includes
the kernels the phase launched. A step with nothing to compute reports "schedule" only; a phase
that raises reports nothing. Bookkeeping (advancing requests, publishing blocks, stop checks) is
the rest of the step: ``time of step() - the four phases``.

The phases are calls into the components the engine built, so ``step()`` — a hole — reports them
without calling anything: ``observe`` wraps those four callables on this engine instance (each
observer adds one wrapper). An engine nobody observes is not touched and runs exactly as written.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

Observer = Callable[[str, Any, float], None]
PHASES = ("schedule", "prepare", "execute", "sample")


class _ObservedSampler:
    """The engine's sampler with its calls reported; every other attribute is the sampler's own."""

    def __init__(self, sampler, call: Callable) -> None:
        self._sampler, self._call = sampler, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)


def install(core, observer: Observer) -> None:
    """Make ``core``'s scheduler, runner and sampler report each call to ``observer`` (see above)."""
    if not callable(observer):
        raise ValueError(f"an observer is a callable observer(phase, result, seconds), got {observer!r}")
    device = core.runner.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(phase: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            sync()
            observer(phase, result, time.perf_counter() - start)
            return result
        return call

    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    core.runner.prepare = timed("prepare", core.runner.prepare)
    core.runner.execute = timed("execute", core.runner.execute)
    core.sampler = _ObservedSampler(core.sampler, timed("sample", core.sampler))
