"""Fault injection for the reliability tests and ``course/quality/soak.py``: make one forward pass fail.

A step can fail half-way through its forward pass (CUDA out of memory, Ctrl-C inside
``LLM.generate``): the layers before the failure have written this step's K/V into the pool, the
later ones have not. ``forward_fault(model, layer, where)`` reproduces that on a CPU: the next time
the model reaches ``layer`` it raises ``InjectedFault``, either before that layer's attention
(``where="attention"``: the layer writes no K/V) or before its MLP (``where="mlp"``: the layer has
already written them). The engine must then behave as if the step never ran. Nothing in the engine
imports this module.

The fast flat models (``flat_model="fused"``, ``"compiled"``) run merged weights and
never call the model's own attention or MLP modules, so hooks on those never fire there.
``backend_fault(core, layer, where)`` fails the same two places through the engine's attention
backend instead, which every flat model calls: before layer ``layer`` writes its K/V
(``"attention"``), or when it attends, right after the write (``"mlp"``).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

PLACES = ("attention", "mlp")


class InjectedFault(RuntimeError):
    """The failure ``forward_fault`` raises inside the forward pass."""


@contextmanager
def forward_fault(model: nn.Module, layer: int, where: str = "attention") -> Iterator[None]:
    """Within the block, the forward pass raises ``InjectedFault`` on reaching ``layer`` (at its
    attention or its MLP, see ``PLACES``); the hook is removed on exit, even if it never fired."""
    layers = model.model.layers
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in 0..{len(layers) - 1}, got {layer}")
    if where not in PLACES:
        raise ValueError(f"where must be one of {PLACES}, got {where!r}")
    target = layers[layer].self_attn.q_proj if where == "attention" else layers[layer].mlp

    def fail(module, args):
        raise InjectedFault(f"injected fault at layer {layer} ({where})")

    handle = target.register_forward_pre_hook(fail)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def backend_fault(core, layer: int, where: str = "attention") -> Iterator[None]:
    """Within the block, the forward pass raises ``InjectedFault`` when it reaches ``layer``'s pool
    in ``core``'s attention backend: before the K/V write (``"attention"``) or at the attention
    that follows it (``"mlp"``). Any flat model, the fused and compiled ones included."""
    caches = core.runner.kv_caches
    if not 0 <= layer < len(caches):
        raise ValueError(f"layer must be in 0..{len(caches) - 1}, got {layer}")
    if where not in PLACES:
        raise ValueError(f"where must be one of {PLACES}, got {where!r}")
    backend, target = core.runner.backend, caches[layer]
    names = ("write",) if where == "attention" else ("forward", "forward_rows")
    wrapped = []
    for name in names:
        inner = getattr(backend, name, None)
        if inner is None:
            continue

        def call(q_or_cache, *args, _inner=inner, _name=name, **kwargs):
            cache = q_or_cache if _name == "write" else args[0]
            if cache is target:
                raise InjectedFault(f"injected fault at layer {layer} ({where}, in the backend's {_name})")
            return _inner(q_or_cache, *args, **kwargs)
        setattr(backend, name, call)  # an instance attribute: the class's method is untouched
        wrapped.append(name)
    try:
        yield
    finally:
        for name in wrapped:
            delattr(backend, name)
