"""Whole-engine consistency checks: what must hold between any two steps.

The block manager, the scheduler, the runner and the engine each keep part of a request's state
(its blocks, its queue, its swapped K/V, its generator). Each part is simple; a bug shows up as the
parts disagreeing — a block counted twice, a request in two queues, host memory kept for a request
that is gone. ``engine_violations`` lists every disagreement it finds; the reliability tests call
``check_engine_invariants`` after every step, and ``course/quality/soak.py`` counts violations over a long
random workload. Nothing here changes the engine.
"""
from __future__ import annotations

from typing import Any

from engine.serve.blocks import BlockManager, hash_block
from engine.serve.request import Request, Status


class InvariantError(AssertionError):
    """Raised by the ``check_*`` functions; its message lists every violation found."""


def block_violations(blocks: BlockManager) -> list[str]:
    """Every way ``blocks`` breaks its own invariants (empty list: consistent).

    Checked: each block's ref_count equals the number of request tables holding it; no table holds
    a block twice or a block outside ``[0, num_blocks)`` (block ``num_blocks`` is the runner's
    scratch block and is never handed out); the free queue holds exactly the ref-0 blocks, each
    once; free + in use == num_blocks; the hash map and the per-block hashes agree both ways; the
    published-count entries exist exactly for requests with a table and never exceed it.
    """
    bad: list[str] = []
    nb = blocks.num_blocks
    if len(blocks.ref_count) != nb or len(blocks.block_hash) != nb:
        return [f"ref_count/block_hash have {len(blocks.ref_count)}/{len(blocks.block_hash)} entries "
                f"for a pool of {nb} blocks"]
    holders = [0] * nb
    for rid, table in blocks.req_blocks.items():
        if len(set(table)) != len(table):
            bad.append(f"request {rid!r} holds a block twice: {table}")
        for b in table:
            if not (isinstance(b, int) and 0 <= b < nb):
                what = "the scratch block" if b == nb else "a block outside the pool"
                bad.append(f"request {rid!r} holds {what} ({b!r}); valid blocks are 0..{nb - 1}")
                continue
            holders[b] += 1
    for b, (held, ref) in enumerate(zip(holders, blocks.ref_count)):
        if held != ref:
            bad.append(f"block {b}: ref_count {ref} but {held} request table(s) hold it")
    queue = list(blocks.free_queue)
    if len(set(queue)) != len(queue):
        bad.append("the free queue holds a block twice")
    if any(not (isinstance(b, int) and 0 <= b < nb) for b in queue):
        bad.append(f"the free queue holds a block outside 0..{nb - 1}: {queue}")
    ref0 = {b for b in range(nb) if blocks.ref_count[b] == 0}
    if set(queue) != ref0:
        bad.append(f"free queue is not exactly the ref-0 blocks: missing {sorted(ref0 - set(queue))}, "
                   f"extra {sorted(set(queue) - ref0)}")
    in_use = sum(1 for c in blocks.ref_count if c > 0)
    if blocks.num_free + in_use != nb:
        bad.append(f"free ({blocks.num_free}) + in use ({in_use}) != num_blocks ({nb})")
    for h, b in blocks.cached.items():
        if not (isinstance(b, int) and 0 <= b < nb) or blocks.block_hash[b] != h:
            bad.append(f"hash map entry {h.hex()[:8]} points at block {b}, which does not carry that hash")
    for b, h in enumerate(blocks.block_hash):
        if h is not None and blocks.cached.get(h) != b:
            bad.append(f"block {b} carries hash {h.hex()[:8]} but the hash map does not point at it")
    if not blocks.enable_prefix_caching and blocks.cached:
        bad.append(f"prefix caching is off yet {len(blocks.cached)} blocks are published")
    if set(blocks.pending_lookups) & set(blocks.req_blocks):
        bad.append(f"requests {sorted(set(blocks.pending_lookups) & set(blocks.req_blocks))} hold blocks "
                   "but still have an uncounted-admission lookup pending")
    if set(blocks.num_published) != set(blocks.req_blocks):
        bad.append(f"published counts kept for {sorted(blocks.num_published)} but tables for "
                   f"{sorted(blocks.req_blocks)}")
    for rid, count in blocks.num_published.items():
        table = blocks.req_blocks.get(rid)
        if table is not None and count > len(table):
            bad.append(f"request {rid!r}: {count} blocks published but its table has {len(table)}")
    return bad


def request_hash_violations(blocks: BlockManager, request: Request) -> list[str]:
    """Hash-chain checks for one live request: its ``block_hashes`` are the chain of its own tokens
    and cache_key, and every block in its table that carries a hash carries the hash of that
    position of THIS request (otherwise it reads another prefix's — or another tenant's — K/V) and
    lies within its computed tokens (between steps a published block holds computed K/V; only a
    failed step that was not undone leaves one past them)."""
    bad: list[str] = []
    bs = blocks.block_size
    parent = None
    for i, h in enumerate(request.block_hashes):
        want = hash_block(parent, request.token_ids[i * bs:(i + 1) * bs], request.cache_key if i == 0 else ())
        if h != want:
            bad.append(f"request {request.request_id!r}: block_hashes[{i}] is not the hash of its tokens "
                       f"{i * bs}..{(i + 1) * bs - 1} (stale after a token changed?)")
            break
        parent = h
    for i, b in enumerate(blocks.req_blocks.get(request.request_id, [])):
        if not (isinstance(b, int) and 0 <= b < blocks.num_blocks):
            continue
        h = blocks.block_hash[b]
        if h is None:
            continue
        if i >= len(request.block_hashes) or request.block_hashes[i] != h:
            bad.append(f"request {request.request_id!r}: table position {i} is block {b}, whose hash "
                       "belongs to a different prefix (or cache_key)")
        if (i + 1) * bs > request.num_computed_tokens:
            bad.append(f"request {request.request_id!r}: block {b} (table position {i}) is published "
                       f"but only {request.num_computed_tokens} of its tokens are computed: a failed "
                       "step's publication was not taken back?")
    return bad


def engine_violations(core: Any) -> list[str]:
    """Every inconsistency between the parts of an ``EngineCore`` between two steps.

    Beyond ``block_violations``: waiting and running are disjoint, free of duplicates, and together
    are exactly ``scheduler.requests``; running requests are RUNNING, hold a table covering their
    computed tokens, and never have their newest token computed (num_computed_tokens <=
    num_tokens - 1); only running requests hold blocks; a waiting request has nothing computed
    unless it is swapped out; ``runner.swapped`` holds K/V exactly for swapped-out requests, one
    saved block per computed block; ``generators`` exist exactly for live seeded requests;
    every ``parents`` entry still has a live child and counts them; nobody runs past max_tokens or
    max_num_seqs.
    """
    sched, blocks, runner = core.scheduler, core.blocks, core.runner
    bad = block_violations(blocks)
    waiting, running = list(sched.waiting), list(sched.running)
    w_ids = [r.request_id for r in waiting]
    r_ids = [r.request_id for r in running]
    if len(set(w_ids)) != len(w_ids):
        bad.append(f"a request is queued twice in waiting: {w_ids}")
    if len(set(r_ids)) != len(r_ids):
        bad.append(f"a request appears twice in running: {r_ids}")
    both = set(w_ids) & set(r_ids)
    if both:
        bad.append(f"requests both waiting and running: {sorted(both)}")
    live = set(w_ids) | set(r_ids)
    if set(sched.requests) != live:
        bad.append(f"scheduler.requests {sorted(sched.requests)} != waiting + running {sorted(live)}")
    for rid, req in sched.requests.items():
        if req.request_id != rid:
            bad.append(f"scheduler.requests[{rid!r}] is request {req.request_id!r}")
    if len(running) > sched.config.max_num_seqs:
        bad.append(f"{len(running)} requests run, above max_num_seqs={sched.config.max_num_seqs}")
    keys = [sched.order_key(r) for r in running]  # both policies keep running sorted
    if keys != sorted(keys):
        bad.append(f"running is not in scheduling order: {r_ids}")
    if sched.config.policy == "priority":
        keys = [sched.order_key(r) for r in waiting]
        if keys != sorted(keys):
            bad.append(f"waiting is not in (priority, arrival) order: {w_ids}")

    bs = blocks.block_size
    for req in running:
        rid = req.request_id
        if req.status is not Status.RUNNING:
            bad.append(f"request {rid!r} is in running with status {req.status.name}")
        if req.swapped_out:
            bad.append(f"running request {rid!r} is still marked swapped_out")
        table = blocks.req_blocks.get(rid)
        if table is None:
            bad.append(f"running request {rid!r} holds no block table")
        elif len(table) * bs < req.num_computed_tokens:
            bad.append(f"running request {rid!r}: {len(table)} blocks cannot hold its "
                       f"{req.num_computed_tokens} computed tokens")
        if not 0 <= req.num_computed_tokens <= req.num_tokens - 1:
            bad.append(f"running request {rid!r}: num_computed_tokens={req.num_computed_tokens} but "
                       f"num_tokens={req.num_tokens} (the newest token is never computed)")
    for req in waiting:
        rid = req.request_id
        if req.status not in (Status.WAITING, Status.PREEMPTED):
            bad.append(f"request {rid!r} is waiting with status {req.status.name}")
        if rid in blocks.req_blocks:
            bad.append(f"waiting request {rid!r} still holds blocks {blocks.req_blocks[rid]}")
        if req.swapped_out:
            saved = runner.swapped.get(rid)
            want = blocks.blocks_for(req.num_computed_tokens)
            if saved is None:
                bad.append(f"swapped-out request {rid!r} has no saved K/V in runner.swapped")
            elif saved and saved[0][0].shape[0] != want:
                bad.append(f"swapped-out request {rid!r}: {saved[0][0].shape[0]} blocks saved for "
                           f"{req.num_computed_tokens} computed tokens ({want} blocks)")
            if not 0 < req.num_computed_tokens <= req.num_tokens - 1:
                bad.append(f"swapped-out request {rid!r}: num_computed_tokens={req.num_computed_tokens}, "
                           f"num_tokens={req.num_tokens}")
        elif req.num_computed_tokens != 0:
            bad.append(f"waiting request {rid!r} (not swapped) has num_computed_tokens="
                       f"{req.num_computed_tokens}; it holds no K/V")
    for req in waiting + running:
        if req.num_output_tokens >= req.params.max_tokens:
            bad.append(f"live request {req.request_id!r} already has {req.num_output_tokens} outputs "
                       f"(max_tokens={req.params.max_tokens}) but was not finished")
        if req.is_finished:
            bad.append(f"request {req.request_id!r} is queued but has status {req.status.name}")
        bad.extend(request_hash_violations(blocks, req))

    stray = set(blocks.req_blocks) - set(r_ids)
    if stray:
        bad.append(f"blocks held by requests that are not running: {sorted(stray)}")
    swapped_live = {r.request_id for r in waiting if r.swapped_out}
    if set(runner.swapped) != swapped_live:
        bad.append(f"runner.swapped holds {sorted(runner.swapped)} but the swapped-out requests are "
                   f"{sorted(swapped_live)}")
    seeded = {rid for rid, r in sched.requests.items() if r.params.seed is not None}
    if set(core.generators) != seeded:
        bad.append(f"generators kept for {sorted(core.generators)}; live seeded requests are {sorted(seeded)}")
    for pid, parent in core.parents.items():
        ids = parent.child_ids
        if not any(i in sched.requests for i in ids):
            bad.append(f"parents[{pid!r}] kept after all of {ids} finished")
        if pid in sched.requests:
            bad.append(f"parent id {pid!r} of an n > 1 request is also a live request id")
        live = sum(1 for i in ids if i in sched.requests and core.parent_of.get(i) is parent)
        if parent.num_live != live:
            bad.append(f"parents[{pid!r}].num_live is {parent.num_live} but {live} of its children are live")
    want_parent = {c: parent for parent in core.parents.values() for c in parent.child_ids}
    if core.parent_of != want_parent:
        bad.append("parent_of does not map exactly the children of live n > 1 requests to their parent")
    return bad


def idle_violations(core: Any) -> list[str]:
    """What is left over at idle: every block free, every per-request structure empty."""
    bad = engine_violations(core)
    sched, blocks = core.scheduler, core.blocks
    if sched.has_unfinished():
        bad.append(f"not idle: {len(sched.waiting)} waiting, {len(sched.running)} running")
    if blocks.num_free != blocks.num_blocks or any(blocks.ref_count):
        bad.append(f"idle but only {blocks.num_free} of {blocks.num_blocks} blocks are free")
    leftovers = {
        "scheduler.requests": sched.requests, "scheduler.waiting": sched.waiting,
        "scheduler.running": sched.running, "generators": core.generators,
        "runner.swapped": core.runner.swapped, "parents": core.parents,
        "parent_of": core.parent_of,
        "blocks.req_blocks": blocks.req_blocks, "blocks.num_published": blocks.num_published,
        "blocks.pending_lookups": blocks.pending_lookups,
    }
    for name, container in leftovers.items():
        if container:
            keys = list(container)[:5]
            bad.append(f"idle but {name} still holds {len(container)} entries, e.g. {keys}")
    return bad


def _raise(bad: list[str]) -> None:
    if bad:
        raise InvariantError(f"{len(bad)} invariant violation(s):\n  " + "\n  ".join(bad))


def check_block_invariants(blocks: BlockManager) -> None:
    """Raise InvariantError listing every ``block_violations``."""
    _raise(block_violations(blocks))


def check_engine_invariants(core: Any) -> None:
    """Raise InvariantError listing every ``engine_violations`` (call between steps)."""
    _raise(engine_violations(core))


def check_idle(core: Any) -> None:
    """Raise InvariantError unless the engine is idle with nothing left over."""
    _raise(idle_violations(core))
