"""A dependency-free progress bar for ``LLM.generate`` (what vLLM uses tqdm for)."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    """A one-line progress bar on stderr: prompts finished and output tokens per second.

    ``enabled=None`` shows it only when stderr is a terminal and there is more than one prompt,
    so logs and pipes never fill with carriage returns. The owner adds to ``tokens`` as they
    are produced and calls ``advance()`` per finished prompt and ``close()`` at the end.
    """

    WIDTH = 30

    def __init__(self, total: int, enabled: bool | None) -> None:
        if enabled is None:
            enabled = total > 1 and sys.stderr.isatty()
        self.enabled, self.total, self.done, self.tokens = enabled, total, 0, 0
        self.start = time.perf_counter()
        self._draw()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = self.WIDTH * self.done // max(1, self.total)
        rate = self.tokens / max(1e-9, time.perf_counter() - self.start)
        sys.stderr.write(f"\rgenerate [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                         f"{self.done}/{self.total} prompts, {rate:,.0f} output tok/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            sys.stderr.write("\n")
            sys.stderr.flush()
