"""The front end's half of a request: tokens in, text out, and stop strings.

The engine core knows token ids only. Everything that needs the text happens here, per
completion, as the core's outputs arrive (vLLM splits its engine the same way: the output
processor detokenizes and checks stop strings outside the core, then aborts the request there):

* incremental detokenizing (``IncrementalDetokenizer``: a character split across tokens comes
  out whole);
* stop strings, matched on the detokenized text, so a stop string that spans two tokens, or a
  token that holds a stop string plus more, still stops. The search covers only the new text and
  the ``len(stop) - 1`` characters before it. Once the completion has more than ``min_tokens``
  tokens, the stop string that ends first (ties: ``stop`` order) ends it: the text is cut before it
  (or after it with ``include_stop_str_in_output``), ``finish_reason`` is "stop" and
  ``stop_reason`` the string. The token ids keep the token that completed the match.
* a completion ended by a stop token or EOS does not show that token's text unless
  ``include_stop_str_in_output`` (its id stays in ``token_ids``);
* streams hold back the last ``max(len(stop)) - 1`` characters until the end, so a reader never
  sees the beginning of a stop string that is then cut away.
"""
from __future__ import annotations

import time

from engine.outputs import RequestMetrics
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


def find_stop_string(text: str, new_chars: int, stop: list[str],
                     include_in_output: bool) -> tuple[str, int] | None:
    """The stop string that ends first among those inside the last ``new_chars`` characters of
    ``text`` or straddling their start (ties: ``stop`` order), and the length to cut ``text`` to;
    None if none."""
    if new_chars <= 0:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, string)
    for s in stop:
        at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if at != -1 and (best is None or at + len(s) < best[0]):
            best = (at + len(s), at, s)
    if best is None:
        return None
    end, start, s = best
    return s, end if include_in_output else start


class CompletionState:
    """One completion as the front end tracks it, fed the core's per-step outputs.

    Invariant: ``text`` is the detokenized ``token_ids`` minus a held-back incomplete character,
    cut at the stop string once one matched; ``finished`` exactly when ``finish_reason`` is set.
    """

    def __init__(self, engine_id: str, index: int, prompt_token_ids: list[int], params,
                 tokenizer: Tokenizer | None, arrival_time: float | None = None) -> None:
        self.engine_id = engine_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                      if tokenizer is not None and params.detokenize else None)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs = None
        # params.logprobs set: one entry per token of token_ids (the core's TokenLogprobs)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.metrics = RequestMetrics(time.monotonic() if arrival_time is None else arrival_time)
        self._taken_tokens = 0  # how much of token_ids / text a stream has been given
        self._taken_chars = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out) -> bool:
        """Take one step's ``RequestOutput`` from the core; True if a stop string ended the
        completion here while the core still runs it (the caller must then abort it there)."""
        new = list(out.new_token_ids)
        now = time.monotonic()
        self.num_cached_tokens = out.num_cached_tokens
        if new and self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        base = len(self.token_ids)
        self.token_ids.extend(new)
        if self.logprobs is not None:
            self.logprobs.extend(getattr(out, "new_logprobs", None) or [])
        p = self.params
        stop_terminated = out.finished and out.finish_reason == "stop"  # EOS or a stop token
        hit = None
        if self.detok is not None:
            shown = new[:-1] if stop_terminated and new and not p.include_stop_str_in_output else new
            check = bool(p.stop)
            for j, t in enumerate(shown):  # one token at a time: stop as soon as a string completes
                before = len(self.text)
                self.text += self.detok.add([t])
                if out.finished and j == len(shown) - 1:
                    self.text += self.detok.flush()
                if check and base + j + 1 > p.min_tokens:
                    hit = find_stop_string(self.text, len(self.text) - before, p.stop,
                                           p.include_stop_str_in_output)
                    if hit is not None:
                        break
            if out.finished and not shown:
                self.text += self.detok.flush()
        if hit is not None:
            self.stop_reason, cut = hit
            self.text = self.text[:cut]
            self.finish_reason = "stop"
            self._finish(now, out)
            return not out.finished
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self._finish(now, out)
        return False

    def _finish(self, now: float, out) -> None:
        self.metrics.finish_time = now
        self.metrics.num_generation_tokens = len(self.token_ids)
        self.prompt_logprobs = getattr(out, "prompt_logprobs", None)

    def take_delta(self) -> tuple[str, list[int]] | None:
        """What a stream has not been given yet: (text, token ids), or None if nothing new. While
        unfinished, the last ``output_text_buffer_length`` characters are held back."""
        hold = 0 if self.finished else self.params.output_text_buffer_length
        upto = max(self._taken_chars, len(self.text) - hold)
        tokens = self.token_ids[self._taken_tokens:]
        text = self.text[self._taken_chars:upto]
        if not tokens and not text and not self.finished:
            return None
        self._taken_tokens, self._taken_chars = len(self.token_ids), upto
        return text, tokens
