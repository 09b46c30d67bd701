"""Shared helpers for chapter 31's tests: the test model, the oracle, and teaching assertions."""
from __future__ import annotations

import functools

import torch

from engine.generate import generate
from engine.models import tiny_model


@functools.lru_cache(maxsize=None)
def model64(moe: bool = False, seed: int = 0):
    """The 2-layer test model in float64: no batched-vs-alone rounding can flip a greedy choice."""
    return tiny_model(seed=seed, moe=moe, dtype=torch.float64)


@functools.lru_cache(maxsize=None)
def oracle(prompt: tuple[int, ...], max_tokens: int, moe: bool = False, eos: int | None = None) -> list[int]:
    """generate() on one prompt alone: the independent answer every engine must reproduce."""
    return generate(model64(moe), list(prompt), max_tokens, eos_token_id=eos)


def prompts(lengths, seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def first_difference(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def assert_same_tokens(got: list[int], want: list[int], request_id: str, prompt_len: int,
                       block_size: int = 16, context: str = "") -> None:
    """Equality with a message that points at the likely cause."""
    i = first_difference(got, want)
    if i is None:
        return
    pos = prompt_len + i - 1  # the position whose logits chose output token i
    hint = []
    if not got:
        hint.append("it produced no token at all: did its prompt's last chunk get a sample row (build_batch), "
                    "and does step() append each request's own sampled token (and report the request)?")
    elif i == len(got):
        hint.append("it stopped early: check_stop (min_tokens, the stop rules, max_tokens), or a step that "
                    "computed a token without appending its sample (step)")
    elif i >= len(want):
        hint.append("it ran past the end: check_stop (max_tokens reached, max_model_len)")
    elif i == 0:
        hint.append("the very first token is wrong: are the logits taken from the prompt's LAST row, not a "
                    "mid-prompt one (build_batch's sample rows), was at least one prompt token computed "
                    "(find_cached_prefix never matches the last token's block), and is the forward pass right "
                    "(the FlatModel, attention and write_kv hole tests)?")
    if got and i < len(got) and (pos % block_size == 0 or (pos + 1) % block_size == 0):
        hint.append(f"position {pos} is at a block boundary (block_size {block_size}): check the slot "
                    "mapping table[p // block_size] * block_size + p % block_size (build_batch), and that a "
                    "request gets a new block when its last one fills (allocate_slots)")
    raise AssertionError(
        f"{context}request {request_id!r}: output token {i} differs from generate() "
        f"(got {got[i] if i < len(got) else 'nothing'}, want {want[i] if i < len(want) else 'nothing'}; "
        f"got {len(got)} tokens, want {len(want)})." + (" Likely cause: " + "; ".join(hint) if hint else ""))


def batch_rows(batch) -> list[tuple[str, int]]:
    """(request id, position) of each row of ``batch``, for messages."""
    qsl = batch.meta.query_start_loc_cpu.tolist()
    positions = batch.positions.tolist()
    rows = []
    for r in range(len(qsl) - 1):
        rid = batch.request_ids[r] if r < len(batch.request_ids) else str(r)
        rows += [(rid, positions[i]) for i in range(qsl[r], qsl[r + 1])]
    return rows


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, what: str, *, atol: float = 1e-9,
                      rows: list[tuple[str, int]] | None = None, cause="") -> None:
    """``got`` equals ``want`` within ``atol`` (dim 0 = rows, one per token), else an AssertionError
    with the largest difference, where it is (row, and with ``rows`` its request and position), how
    many rows differ, and the likely cause (``cause``: a string, or a function of the differing row
    numbers that returns one)."""
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: got shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if got.numel() == 0:
        return
    diff = torch.nan_to_num((got.double() - want.double()).abs(), nan=float("inf"))
    per_row = diff.reshape(diff.shape[0], -1).amax(dim=1)
    bad = (per_row > atol).nonzero().flatten().tolist()
    if not bad:
        return
    worst = int(per_row.argmax())

    def at(i: int) -> str:
        return f"row {i}" + (f" (request {rows[i][0]!r}, position {rows[i][1]})" if rows and i < len(rows) else "")

    why = cause(bad) if callable(cause) else cause
    raise AssertionError(
        f"{what}: largest difference {float(per_row[worst]):.3g} at {at(worst)}; {len(bad)} of {len(per_row)} rows "
        f"differ by more than {atol:g}, the first at {at(bad[0])}." + (f" Likely cause: {why}" if why else ""))


def where_raised(exc: BaseException) -> tuple[str, str]:
    """Whose code raised ``exc``: ("engine", "serve/x.py:N in f"), ("reference", "solutions/x.py:N in f":
    a reference hole put in for a hole test, running on what the learner's hole left), ("tests",
    "tests/x.py:N in f: <line>") or ("other", ...), from the innermost frame that lies in this
    repository (a library frame, e.g. torch's, counts as its caller's)."""
    import os
    import traceback
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent) + os.sep
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename.startswith(root) and os.sep + ".venv" not in f.filename]
    if not frames:
        return "other", ""
    f = frames[-1]
    rel = f.filename[len(root):]
    if rel.startswith("engine" + os.sep):
        return "engine", f"{rel.split(os.sep, 1)[1]}:{f.lineno} in {f.name}"
    if rel.startswith("solutions" + os.sep):
        return "reference", f"{rel}:{f.lineno} in {f.name}"
    kind = "tests" if rel.startswith("tests" + os.sep) else "other"
    return kind, f"{rel}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def run_checked(core, after_step=None, max_steps: int = 5000) -> dict[str, list[int]]:
    """Step ``core`` until idle, checking every engine invariant after each step (and calling
    ``after_step(core)`` if given); returns the finished requests' output tokens by id."""
    from course.quality.invariants import check_engine_invariants

    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            return out
        for o in core.step():
            if o.finished:
                out[o.request_id] = o.output_token_ids
        check_engine_invariants(core)
        if after_step is not None:
            after_step(core)
    raise AssertionError(f"the engine is still busy after {max_steps} steps: a request stopped making progress. "
                         + describe_stuck(core))


def describe_stuck(core) -> str:
    """Name each unfinished request of ``core`` with its state and the hole most likely holding it."""
    from engine.serve.request import Status

    lines = []
    for r in core.scheduler.requests.values():
        state = (f"{r.request_id!r} {r.status.name}, {r.num_computed_tokens}/{r.num_tokens} tokens computed, "
                 f"{r.num_output_tokens}/{r.params.max_tokens} outputs")
        if r.status is not Status.RUNNING:
            why = ("not admitted: Scheduler.schedule's admission (does it stop too early, or charge the "
                   "budget too much?) or BlockManager.allocate_slots (does it refuse blocks that are free?)")
        elif r.num_output_tokens >= r.params.max_tokens:
            why = "reached max_tokens but never finished: EngineCore.check_stop"
        else:
            why = "running but given no tokens: Scheduler.schedule's running pass (n = 0?)"
        lines.append(f"{state} -> {why}")
    return "Unfinished: " + ("; ".join(lines) if lines else "none in the scheduler (has_unfinished disagrees)")


def run_in_threads(cores, prompts_per_core, max_tokens: int, prepare=None) -> list[dict[str, list[int]]]:
    """Queue ``prompts_per_core[i]`` (greedy, ``max_tokens`` each, ids "r0", "r1", ...) on
    ``cores[i]``, then run every core to idle at the same time, one thread each; their outputs by id.
    ``prepare(core)`` runs first in the core's thread. Re-raises the first failure of any thread."""
    import threading

    from engine.serve import SamplingParams

    results, errors = [None] * len(cores), []
    start = threading.Barrier(len(cores))

    def drive(i: int) -> None:
        try:
            if prepare is not None:
                prepare(cores[i])
            for j, p in enumerate(prompts_per_core[i]):
                cores[i].add_request(f"r{j}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
            start.wait()
            results[i] = cores[i].run_until_done()
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(cores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise AssertionError(f"an engine failed while another stepped in another thread: {errors[0]!r}") from errors[0]
    return results
