"""Verdicts decided outside the learner's process: the learner's scenario answers against the reference's.

``reference_results(specs)`` runs the scenarios on the reference in a separate, trusted process (no
learner code in it). ``verdicts(specs, reference, learner)`` compares, in the grader's own process,
the plain data each side returned, and gives every hole (and the milestone and the engine checks) one
of ``ok`` / ``fail`` / ``unverified`` with the fraction of its scenarios that matched and, for a
failure, a message the grader writes itself: the scenario, the field, the expected value and what came
back — a number or a short list of numbers, never a string from the learner's process.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OK, FAIL, UNVERIFIED = "ok", "fail", "unverified"
HINTS = {
    "build_batch": "compare slot_mapping, logits_indices and sample_counts with the docstring's rules",
    "write_kv": "each row goes to its slot; a -1 slot writes to the pool's last slot",
    "ReferenceBackend.forward": "request r's queries are the LAST q_len positions of its context; the window",
    "FlatModel.attention": "RoPE by each row's position, K/V written after RoPE, then the backend",
    "FlatModel.forward": "the residual adds and norms between layers (add_norm)",
    "hash_block": "BLAKE2b, 16 bytes, over the parent digest (or the root marker), int64 tokens, extra",
    "BlockManager.find_cached_prefix": "stop at the first miss; never the block of the prompt's last token",
    "BlockManager.allocate_slots": "all or nothing; adopted cached-free blocks leave the free queue",
    "BlockManager.cache_full_blocks": "only full blocks, first writer wins",
    "BlockManager.free": "blocks at 0 go to the BACK of the free queue, tail first",
    "Scheduler.schedule": "running requests first, then waiting ones within the budget and max_num_seqs",
    "Scheduler._preempt": "the victim's blocks, its computed count, its place at the front of the queue",
    "EngineCore.check_stop": "min_tokens first; stop tokens, EOS unless ignore_eos, max_tokens, the context limit",
    "EngineCore.step": "one batch per step; each request's sample from its own rows; finished requests freed",
    "milestone": "every request's greedy tokens must equal the reference's under each set-up",
    "engine checks": "an aborted request frees everything; salted requests share nothing; all blocks back at idle",
}


def reference_env() -> dict[str, str]:
    """COUPLING POINT (learner layer): the environment that makes a process in ROOT import the
    reference chapter-31 code: ``ENGINE_IMPL=solution``, engine/_impl.py's one switch (every hole of the
    instructor's engine/ takes its body from solutions/ at import)."""
    return {"ENGINE_IMPL": "solution", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def reference_results(specs: list[dict], timeout: float = 900) -> dict[str, dict]:
    """The reference's answer to every scenario, from a trusted child process."""
    from course.isolation.leftovers import run_folder

    with run_folder("ref") as tmp:  # if this grader dies, the next run removes it (course/isolation/leftovers.py)
        spec_file, out = tmp / "specs.json", tmp / "results.jsonl"
        spec_file.write_text(json.dumps(specs))
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **reference_env()}
        proc = subprocess.run([sys.executable, "-m", "course.grading.scenarios", str(spec_file), str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        got = read_results(out)
    if not any("result" in v for v in got.values()):
        raise RuntimeError(f"the reference answered no scenario: {proc.stderr[-2000:]}")
    return {k: v for k, v in got.items() if "result" in v}  # the grader drops any the reference can't answer


def read_results(path: Path) -> dict[str, dict]:
    """``{"start": id}`` / ``{"id", "result"|"error"}`` lines -> id -> the last line about it; a scenario
    that started but never finished gets ``{"error": "died"}``. Lines that do not parse are ignored."""
    got: dict[str, dict] = {}
    if not path.exists():
        return got
    for line in path.read_text(errors="replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("start"), str):
            got.setdefault(item["start"], {"error": "died"})
        elif isinstance(item.get("id"), str):
            got[item["id"]] = item
    return got


def first_difference(want, got, path: str = "") -> tuple[str, object, object] | None:
    """(where, expected, got) of the first difference; floats within 1e-6 relative (float64 runs)."""
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return None if got == want and type(got) is type(want) else (path, want, got)
    if isinstance(want, (int, float)):
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return path, want, got
        if isinstance(want, int) and isinstance(got, int):
            return None if want == got else (path, want, got)
        ok = math.isfinite(got) and math.isclose(want, got, rel_tol=1e-6, abs_tol=1e-9)
        return None if ok else (path, want, got)
    if isinstance(want, list):
        if not isinstance(got, list):
            return path, want, got
        for i, (w, g) in enumerate(zip(want, got)):
            d = first_difference(w, g, f"{path}[{i}]")
            if d:
                return d
        return None if len(want) == len(got) else (f"{path} length", len(want), len(got) if isinstance(got, list) else got)
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return path, want, got
        for k in want:
            if k not in got:
                return f"{path}.{k}", want[k], "(missing)"
            d = first_difference(want[k], got[k], f"{path}.{k}")
            if d:
                return d
        extra = sorted(set(got) - set(want))
        return (f"{path} keys", sorted(want), "(other keys)") if extra else None
    return path, want, got


def shown(value, like) -> str:
    """A learner's value as feedback may show it: numbers, bools, None and short lists of numbers;
    a string only where it equals an expected one. Anything else is described, not shown."""
    def plain(v) -> bool:
        return v is None or isinstance(v, (bool, int, float))
    if plain(value):
        return repr(value)
    if isinstance(value, list) and len(value) <= 12 and all(plain(v) for v in value):
        return repr(value)
    if isinstance(value, str) and isinstance(like, str) and re.fullmatch(r"[A-Z_]{1,20}", value):
        return value
    return "a value of another kind or size"


def expected(value) -> str:
    """The reference's value (trusted), shortened for a message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _where(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\[\] -]", "", path)[:80] or "the result"


def compare(spec: dict, want: dict, got: dict) -> tuple[bool, list[str], str]:
    """(matched, holes to blame, the grader's message) for one scenario."""
    holes = spec["holes"]
    if "error" in got:
        kind = got["error"] if isinstance(got["error"], str) and re.fullmatch(r"[A-Za-z_]{1,40}", got["error"]) else "an error"
        why = {"died": "the process ended during this scenario (a crash, os._exit, or a memory/CPU limit)",
               "hung": "stopped: it ran past the per-scenario time limit (an endless loop?)",
               "not_run": "never ran: an earlier scenario of the same group hung or ended the process"
               }.get(kind, f"your code raised {kind}")
        return False, holes, f"{spec['id']}: {why}"
    result = got.get("result")
    if spec["kind"] == "block_ops":
        recs_w = want["result"]["records"]
        recs_g = result.get("records") if isinstance(result, dict) else None
        if not isinstance(recs_g, list):
            return False, holes, f"{spec['id']}: no records came back"
        for i, w in enumerate(recs_w):
            g = recs_g[i] if i < len(recs_g) else None
            d = first_difference({"ret": w["ret"], "state": w["state"]},
                                 {"ret": g.get("ret"), "state": g.get("state")} if isinstance(g, dict) else None)
            if d:
                return False, [w["hole"]], (f"{spec['id']}, call {i + 1} ({w['hole']}): {_where(d[0])} expected "
                                            f"{expected(d[1])}, got {shown(d[2], d[1])}")
        return True, holes, ""
    d = first_difference(want["result"], result)
    if d:
        return False, holes, f"{spec['id']}: {_where(d[0])} expected {expected(d[1])}, got {shown(d[2], d[1])}"
    return True, holes, ""


def verdicts(specs: list[dict], reference: dict[str, dict], learner: dict[str, dict]) -> dict[str, dict]:
    """name -> {"verified": ok|fail|unverified, "matched", "total", "messages"} for every hole,
    the milestone and the engine checks that the scenarios cover."""
    rows: dict[str, dict] = {}
    blamed: dict[str, list[tuple[bool, str, list[str]]]] = {}
    for spec in specs:
        got = learner.get(spec["id"], {"error": "not_run"})
        ok, holes, msg = compare(spec, reference[spec["id"]], got)
        for h in spec["holes"]:
            hit = h in holes
            blamed.setdefault(h, []).append((ok or not hit, msg if hit else "", spec["deps"]))
    status = {h: all(ok for ok, _, _ in v) for h, v in blamed.items()}
    for h, v in blamed.items():
        failed = [(m, deps) for ok, m, deps in v if not ok]
        # a failure counts against h only where every hole it depends on verified on its own
        counted = [m for m, deps in failed if all(status.get(d, True) for d in deps)]
        matched = sum(ok for ok, _, _ in v)
        verdict = OK if not failed else (FAIL if counted else UNVERIFIED)
        rows[h] = {"verified": verdict, "matched": matched, "total": len(v),
                   "messages": [f"{m} (hint: {HINTS.get(h, '')})" for m in counted[:3]],
                   "unverified_because": sorted({d for _, deps in failed for d in deps if not status.get(d, True)})}
    return rows
