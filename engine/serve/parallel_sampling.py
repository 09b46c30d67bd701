"""ParentRequest: an ``n > 1`` request fanned out into n child requests, and gathered back as they finish.

vLLM serves ``SamplingParams(n=k)`` as k independent requests that share the prompt (so the prefix
cache shares its blocks); the parent exists only in the front end, which maps the children back
to it. Here child i is called ``"{parent}:{i}"`` and samples with ``seed + i`` when the parent is
seeded, so the k completions differ from one another and each is reproducible on its own.
"""
from __future__ import annotations

from engine.serve.params import SamplingParams


class ParentRequest:
    """One ``n > 1`` request: its children's ids and params, and how many children still run.

    Invariant: ``0 <= num_live <= n``; the parent's id and its children's ids stay reserved (no
    new request may take them) while ``num_live > 0``, so aborting the parent reaches its own
    children only, never a later request that took a finished child's id.
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.child_ids = child_ids(request_id, params.n)
        self.num_live = params.n

    def child_params(self, index: int) -> SamplingParams:
        """Child ``index``'s params: the parent's with ``n=1`` and, if seeded, ``seed + index``."""
        p = self.params
        return SamplingParams(**{**p.__dict__, "n": 1, "seed": None if p.seed is None else p.seed + index})

    def child_finished(self) -> bool:
        """Count one child finished; True when it was the last (the ids are free again)."""
        self.num_live -= 1
        return self.num_live == 0


def child_ids(request_id: str, n: int) -> list[str]:
    """The ids a request of ``n`` completions reports under: its own for n == 1, else ``"{id}:{i}"``."""
    return [request_id] if n == 1 else [f"{request_id}:{i}" for i in range(n)]
