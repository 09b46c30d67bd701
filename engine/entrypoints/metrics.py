"""``/metrics``: the server's and the core's numbers in Prometheus' text format, vLLM's names.

The core's gauges and counters come from ``LLM.get_metrics`` (running and waiting requests,
KV-cache usage, prefix-cache queries and hits, preemptions); the server adds its own request
counters and two latency histograms, time to first token and inter-token latency, observed by
the engine loop as it hands out each step's tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# seconds: vLLM's buckets for both histograms span about 1 ms to tens of seconds
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


@dataclass
class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus keeps them (``counts[i]`` counts the
    observations <= ``buckets[i]``; the +Inf bucket is ``count``)."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str, labels: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, c in zip(self.buckets, self.counts):
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {c}')
        out += [f'{name}_bucket{{{labels},le="+Inf"}} {self.count}', f"{name}_sum{{{labels}}} {self.total!r}",
                f"{name}_count{{{labels}}} {self.count}"]
        return out


@dataclass
class ServerMetrics:
    """What the engine loop counts (only its thread writes these)."""

    requests_received: int = 0
    requests_finished: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)


def _number(value: float) -> str:
    return "NaN" if isinstance(value, float) and math.isnan(value) else repr(float(value))


def render(core_metrics: list, server: ServerMetrics, model_name: str) -> str:
    """The Prometheus text exposition of everything above (counters get vLLM's ``_total``)."""
    labels = f'model_name="{model_name}"'
    lines: list[str] = []
    rows = [(m.name, m.kind, m.value) for m in core_metrics] + [
        ("vllm:request_success", "counter", server.requests_finished),
        ("vllm:generation_tokens", "counter", server.generation_tokens),
        ("course:requests_received", "counter", server.requests_received)]
    for name, kind, value in rows:
        shown = name + "_total" if kind == "counter" else name
        lines += [f"# HELP {name} {name}", f"# TYPE {name} {kind}", f"{shown}{{{labels}}} {_number(value)}"]
    lines += server.ttft.lines("vllm:time_to_first_token_seconds", "Time to first token", labels)
    lines += server.itl.lines("vllm:inter_token_latency_seconds", "Inter-token latency", labels)
    return "\n".join(lines) + "\n"
