"""Mutants: named, realistic bugs applied to the reference one at a time; the tests must catch each.

A test suite that passes the reference says little until it FAILS on the mistakes learners
actually make. Each mutant below is one exact text replacement in a ``solutions/`` file. It is
applied to a temporary copy of ``solutions/`` (the working tree is never touched) and the
chapter's tests run against that copy in a subprocess (``ENGINE_IMPL=solution`` with
``ENGINE_SOLUTIONS_DIR`` pointing at the copy), restricted to the tests of the holes the bug lives
in plus the milestone, stopping at the first failure. A mutant is
- killed: some test failed (the table shows which, and its first line);
- SURVIVED: every selected test passed — the tests can't see this bug; strengthen them;
- stale: its text no longer matches the reference exactly once — update the mutant;
- broken: the run errored before any test failed (e.g. the mutated file doesn't import).

    python -m tools.mutants                 # all mutants, 2 workers; exit 1 unless all are killed
    python -m tools.mutants --list          # names and descriptions
    python -m tools.mutants slot-off-by-one-at-block-boundary eos-before-min-tokens
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tools.testrun import CHAPTER_TESTS, ROOT, run_pytest

SOLUTIONS = ROOT / "solutions"


@dataclass(frozen=True)
class Mutant:
    """One bug: replace ``old`` (which must occur exactly once) by ``new`` in ``solutions/<file>``.
    ``holes`` names the holes whose tests should catch it (the milestone always runs too);
    ``keyword``, when set, narrows those tests further (pytest ``-k``) to skip slow ones."""

    name: str
    file: str
    holes: tuple[str, ...]
    old: str
    new: str
    why: str
    keyword: str = ""


MUTANTS: list[Mutant] = [
    # ---- the six the chapter's milestone must catch -----------------------------------------------
    Mutant("slot-off-by-one-at-block-boundary", "serve/batch.py", ("build_batch",),
           "slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]",
           "slots += [table[(p - 1) // block_size] * block_size + p % block_size for p in range(c, c + n)]",
           "the first position of each block is written into the previous block's table entry"),
    Mutant("decode-slot-off-by-one-at-block-boundary", "serve/batch.py", ("build_batch",),
           "slots.append(table[c // block_size] * block_size + c % block_size)",
           "slots.append(table[(c - 1) // block_size] * block_size + c % block_size)",
           "a decode that starts a new block writes its K/V into the previous block (the decode fast path)"),
    Mutant("recompute-keeps-stale-num-computed", "serve/scheduler.py", ("Scheduler._preempt",),
           "        else:\n            request.num_computed_tokens = 0\n",
           "        else:\n            pass  # forgets to reset: resumes as if its K/V were still there\n",
           "a request preempted by recompute resumes with a stale num_computed_tokens"),
    Mutant("cached-prefix-includes-last-token-block", "serve/blocks.py", ("BlockManager.find_cached_prefix",),
           "request.block_hashes[:(request.num_tokens - 1) // self.block_size]",
           "request.block_hashes[:request.num_tokens // self.block_size]",
           "a cached block is adopted without leaving a token to compute (the last token's block matched)"),
    Mutant("swap-in-into-wrong-blocks", "serve/scheduler.py", ("Scheduler._preempt", "Scheduler.schedule"),
           "out.swap_in.append((req, table[:self.blocks.blocks_for(req.num_computed_tokens)]))",
           "out.swap_in.append((req, table[-self.blocks.blocks_for(req.num_computed_tokens):]))",
           "a swapped-out request's saved K/V is restored into the LAST blocks of its new table"),
    Mutant("logits-from-first-row-of-span", "serve/batch.py", ("build_batch",),
           "            sample_rows.append(start + n - 1)",
           "            sample_rows.append(start)",
           "logits are taken from the first (mid-prompt) row of a span instead of its last"),
    Mutant("mid-prompt-chunk-samples", "serve/batch.py", ("build_batch",),
           "k = 0 if k < 0 else (n if k > n else k)",
           "k = 1",
           "every span samples one row, even a chunk that stops mid-prompt"),
    Mutant("abort-leaks-blocks", "serve/scheduler.py", ("EngineCore.step",),
           "        self.finish(request, Status.FINISHED_ABORTED)\n        return request\n",
           "        (self.running if request in self.running else self.waiting).remove(request)\n"
           "        request.status = Status.FINISHED_ABORTED\n"
           "        self.requests.pop(request_id, None)\n        return request\n",
           "an aborted request leaves the queues but keeps its blocks", keyword="abort"),
    Mutant("preempt-leaks-blocks", "serve/scheduler.py", ("Scheduler._preempt",),
           "        self.blocks.free(request)\n        request.status = Status.PREEMPTED\n",
           "        request.status = Status.PREEMPTED\n",
           "a preempted request keeps holding its blocks"),
    # ---- block manager -----------------------------------------------------------------------
    Mutant("head-first-free", "serve/blocks.py", ("BlockManager.free",),
           "self._release(reversed(table))",
           "self._release(table)",
           "freed blocks join the queue head first, so shared prefix blocks are evicted first"),
    Mutant("reused-block-keeps-old-hash", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "            b, _ = self.free_queue.popitem(last=False)\n            self._evict(b)\n",
           "            b, _ = self.free_queue.popitem(last=False)\n",
           "a block handed out again keeps its old hash: a later request adopts someone else's K/V"),
    Mutant("running-request-never-grows", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "        if num_new == 0 and not cached_blocks and table:",
           "        if not cached_blocks and table:",
           "a request that already holds blocks gets no new one when its last block fills"),
    Mutant("cached-free-adoption-not-counted", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "if num_new + num_adopt_free > self.num_free:",
           "if num_new > self.num_free:",
           "adopting a cached-free block is not counted against the free blocks left"),
    Mutant("allocate-from-queue-back", "serve/blocks.py", ("BlockManager.allocate_slots",),
           "b, _ = self.free_queue.popitem(last=False)",
           "b, _ = self.free_queue.popitem(last=True)",
           "new blocks come from the BACK of the free queue: the most recently freed are reused first"),
    Mutant("publish-partial-block", "serve/blocks.py", ("BlockManager.cache_full_blocks",),
           "full = min(num_tokens // self.block_size, len(request.block_hashes), len(table))",
           "full = min(self.blocks_for(num_tokens), len(request.block_hashes) + 1, len(table))",
           "a block that isn't full yet is published under the next hash"),
    Mutant("last-writer-wins", "serve/blocks.py", ("BlockManager.cache_full_blocks",),
           "if h not in self.cached and self.block_hash[b] is None:",
           "if self.block_hash[b] is None:",
           "a duplicate block overwrites the cached entry of the block that published first"),
    Mutant("hash-ignores-parent", "serve/blocks.py", ("hash_block",),
           "h.update(ROOT_HASH if parent is None else parent)",
           "h.update(ROOT_HASH)",
           "a block's hash doesn't chain its parent: equal blocks after different prefixes collide"),
    Mutant("hash-ignores-cache-key", "serve/blocks.py", ("hash_block",),
           "    if extra:\n        h.update(b\"\\x00extra\\x00\")\n        h.update(encode_cache_key(extra))\n",
           "",
           "the cache key (tenant, adapter, image) is left out of the hash: tenants share K/V"),
    # ---- scheduler ----------------------------------------------------------------------------
    Mutant("admit-after-preemption", "serve/scheduler.py", ("Scheduler.schedule",),
           "while (not out.preempted and self.waiting and budget > 0",
           "while (self.waiting and budget > 0",
           "waiting requests are admitted in a step that just preempted (the pool is full)"),
    Mutant("chunk-cap-ignored-at-admission", "serve/scheduler.py", ("Scheduler.schedule",),
           "            if cfg.enable_chunked_prefill and cfg.long_prefill_token_threshold > 0:\n"
           "                n = min(n, cfg.long_prefill_token_threshold)\n",
           "",
           "a newly admitted prompt's chunk is not capped at long_prefill_token_threshold"),
    Mutant("chunk-cap-ignored-when-running", "serve/scheduler.py", ("Scheduler.schedule",),
           "        if self.config.enable_chunked_prefill and self.config.long_prefill_token_threshold > 0:\n"
           "            n = min(n, self.config.long_prefill_token_threshold)\n",
           "",
           "a running request's later prefill chunks are not capped at long_prefill_token_threshold"),
    Mutant("preempted-requeued-at-back", "serve/scheduler.py", ("Scheduler._preempt",),
           "            self.waiting.insert(0, request)",
           "            self.waiting.append(request)",
           "a preempted request goes to the BACK of the waiting queue and starves"),
    Mutant("preempt-first-running", "serve/scheduler.py", ("Scheduler.schedule", "Scheduler._preempt"),
           "victim = self.running[-1]",
           "victim = self.running[0]",
           "the oldest running request is preempted instead of the newest"),
    Mutant("no-publish-at-admission", "serve/scheduler.py", ("Scheduler.schedule",),
           "            self.blocks.cache_full_blocks(req, req.num_computed_tokens + n)\n"
           "            out.scheduled.append((req, n))\n            budget -= n\n        return out\n",
           "            out.scheduled.append((req, n))\n            budget -= n\n        return out\n",
           "blocks are published only after the step: a request admitted later in the same step can't share"),
    Mutant("swap-keeps-nothing", "serve/scheduler.py", ("Scheduler._preempt",),
           "        if self.config.preemption_mode == \"swap\" and request.num_computed_tokens > 0:",
           "        if False:",
           "swap mode silently recomputes (no swap_out, K/V forgotten)"),
    # ---- prompt logprobs, stop rules, step -----------------------------------------------------
    Mutant("prompt-logprob-rows-mixed-into-sample-rows", "serve/batch.py", ("build_batch",),
           "                prompt_rows.extend(range(start, start + end - c))",
           "                sample_rows.extend(range(start, start + end - c))",
           "prompt-logprob rows are interleaved with sample rows instead of coming after all of them"),
    Mutant("eos-before-min-tokens", "serve/engine.py", ("EngineCore.check_stop",),
           "        if num_output >= p.min_tokens:\n            if last in p.stop_token_ids:",
           "        if not p.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:\n"
           "            return Status.FINISHED_STOPPED\n"
           "        if num_output >= p.min_tokens:\n            if last in p.stop_token_ids:",
           "EOS ends a request before it has min_tokens outputs"),
    Mutant("context-limit-ignored", "serve/engine.py", ("EngineCore.check_stop",),
           "if num_output >= p.max_tokens or request.num_tokens >= self.max_model_len:",
           "if num_output >= p.max_tokens:",
           "a request runs past max_model_len"),
    Mutant("step-reports-mid-prompt-chunks", "serve/engine.py", ("EngineCore.step",),
           "            if new or status is not None:\n                outputs.append(self._output(req, new))",
           "            outputs.append(self._output(req, new))",
           "a chunk that produced no token is reported anyway"),
    # ---- attention and the flat model ---------------------------------------------------------
    Mutant("padding-written-to-slot-zero", "serve/attention.py", ("write_kv",),
           "slots = torch.where(slot_mapping < 0, num_slots - 1, slot_mapping)",
           "slots = torch.where(slot_mapping < 0, 0, slot_mapping)",
           "padding rows overwrite the first slot of block 0 instead of the scratch block"),
    Mutant("queries-at-first-positions", "serve/attention.py", ("ReferenceBackend.forward",),
           "q_pos = k_pos[seq_len - (end - start):]",
           "q_pos = k_pos[:end - start]",
           "a request's queries are placed at the first positions of its context, not the last"),
    Mutant("sliding-window-ignored", "serve/attention.py", ("ReferenceBackend.forward",),
           "scale=scale, window=window)",
           "scale=scale, window=0)",
           "the sliding window is dropped: every key is visible"),
    Mutant("k-cached-before-rope", "serve/flat.py", ("FlatModel.attention",),
           "        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)\n"
           "        backend.write(kv_cache, k, v, meta)\n",
           "        backend.write(kv_cache, k, v, meta)\n"
           "        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)\n",
           "K is written to the pool before RoPE, so cached keys carry no position"),
    Mutant("final-norm-skips-residual", "serve/flat.py", ("FlatModel.forward",),
           "        out, _ = add_norm(hidden, residual, m.norm)\n",
           "        out = m.norm(hidden)\n",
           "the last layer's residual is dropped before the final norm"),
]


@dataclass
class Result:
    mutant: Mutant
    status: str  # "killed" | "SURVIVED" | "stale" | "broken"
    killer: str = ""
    detail: str = ""
    seconds: float = 0.0


def check_applies(mutant: Mutant, solutions: Path = SOLUTIONS) -> str | None:
    """None if the mutant's text occurs exactly once in the reference, else why not."""
    path = solutions / mutant.file
    if not path.is_file():
        return f"solutions/{mutant.file} does not exist"
    count = path.read_text().count(mutant.old)
    return None if count == 1 else f"its text occurs {count} times in solutions/{mutant.file} (want exactly 1)"


def _copy_solutions(dst: Path) -> Path:
    shutil.copytree(SOLUTIONS, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def run_mutant(mutant: Mutant, timeout: float = 600) -> Result:
    """Apply one mutant to a temporary copy of solutions/ and run its selected tests (``-x``)."""
    stale = check_applies(mutant)
    if stale:
        return Result(mutant, "stale", detail=stale)
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy = _copy_solutions(Path(tmp) / "solutions")
        target = copy / mutant.file
        target.write_text(target.read_text().replace(mutant.old, mutant.new))
        select = ",".join([*mutant.holes, "milestone"])
        keyword = ["-k", f"({mutant.keyword}) or milestone"] if mutant.keyword else []
        run = run_pytest(["-x", "-q", "--tb=line", "--impl", "solution", CHAPTER_TESTS, "--select-holes", select,
                          *keyword],
                         env={"ENGINE_IMPL": "solution", "ENGINE_SOLUTIONS_DIR": str(copy)}, timeout=timeout)
    failed = run.first_failure()
    if failed is not None and failed.outcome == "failed":
        return Result(mutant, "killed", failed.name, failed.message.splitlines()[0] if failed.message else "",
                      run.seconds)
    if run.returncode == 0 and run.tests and all(t.passed for t in run.tests):
        return Result(mutant, "SURVIVED", detail=f"{len(run.tests)} selected tests passed", seconds=run.seconds)
    why = (failed.message if failed else "") or (run.collect_errors[0]["message"][-300:] if run.collect_errors
                                                 else run.output[-300:])
    if run.timed_out:
        why = f"timed out after {timeout:.0f} s"
    return Result(mutant, "broken", failed.name if failed else "", why.strip().splitlines()[-1] if why.strip() else "",
                  run.seconds)


def run_all(mutants: list[Mutant], workers: int = 2, progress=None) -> list[Result]:
    """Every mutant, ``workers`` subprocesses at a time; results in the order given."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(run_mutant, m) for m in mutants]
        results = []
        for f in futures:
            results.append(f.result())
            if progress:
                progress(results[-1])
        return results


def baseline() -> str | None:
    """None if the unmutated copy passes every chapter test through the same machinery, else why."""
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        copy = _copy_solutions(Path(tmp) / "solutions")
        run = run_pytest(["-x", "-q", "--tb=line", "--impl", "solution", CHAPTER_TESTS],
                         env={"ENGINE_IMPL": "solution", "ENGINE_SOLUTIONS_DIR": str(copy)})
    if run.returncode == 0 and run.tests and all(t.passed for t in run.tests):
        return None
    failed = run.first_failure()
    return f"{failed.name}: {failed.message}" if failed else run.output[-500:]


def format_table(results: list[Result]) -> str:
    rows = [("mutant", "file", "status", "killed by", "s")]
    for r in results:
        killer = r.killer + (f"  ({r.detail[:70]})" if r.detail else "")
        rows.append((r.mutant.name, r.mutant.file, r.status, killer, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run only these mutants (default: all)")
    ap.add_argument("--workers", type=int, default=2, help="test subprocesses at a time (default 2)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip checking that the unmutated copy passes")
    args = ap.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:45s} {m.file:20s} {m.why}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"unknown mutant(s) {unknown}; `python -m tools.mutants --list` names them", file=sys.stderr)
        return 2
    chosen = [by_name[n] for n in args.names] if args.names else MUTANTS
    start = time.monotonic()
    if not args.no_baseline:
        why = baseline()
        if why:
            print(f"the unmutated reference fails its own tests, so no mutant result means anything:\n  {why}")
            return 1
        print(f"baseline: the unmutated copy passes ({time.monotonic() - start:.0f} s)")
    results = run_all(chosen, args.workers,
                      progress=lambda r: print(f"  {r.status:8s} {r.mutant.name}", flush=True))
    print()
    print(format_table(results))
    bad = [r for r in results if r.status != "killed"]
    print(f"\n{len(results) - len(bad)}/{len(results)} mutants killed in {time.monotonic() - start:.0f} s"
          + (f"; not killed: {', '.join(r.mutant.name + ' (' + r.status + ')' for r in bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
