"""The block pool's bookkeeping: reference counts, hash-chain prefix cache, LRU free queue.

Every layer's K/V lives in fixed-size blocks of ``block_size`` token slots shared by all requests.
A full block is named by a hash chain: its digest covers its parent block's digest and its own
tokens, so equal digests mean equal whole prefixes. A block is always in exactly one state:
- in use: ``ref_count > 0`` (held by that many request tables);
- cached-free: ``ref_count == 0`` but still carrying its hash and K/V — findable by the prefix
  cache, yet in the free queue and next in line for reuse;
- free-and-blank: ``ref_count == 0`` and no hash.
It leaves the cache (loses its hash) only when the allocator actually hands it out again.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from engine.serve.request import Request

ROOT_HASH = b"engine-ch31-root"  # the "parent" of a request's first block
MAX_KEY_DEPTH = 16  # how deeply cache_key tuples may nest


def encode_cache_key(key: tuple) -> bytes:
    """The canonical bytes of a ``cache_key``: equal bytes exactly when the keys are equal.

    Accepts only values with one obvious encoding: str, int, bytes, bool, None and tuples of those
    (nested at most ``MAX_KEY_DEPTH`` deep). Each value is written as a type tag, then its length,
    then its content, so True and 1, ("ab",) and ("a", "b"), or (("a",),) and ("a",) all differ.
    Anything else — a float, a list, a numpy array or tensor (whose repr() is truncated, so two
    different arrays would look equal) — is a ValueError: pass a digest of it instead.
    """
    if not isinstance(key, tuple):
        raise ValueError(f"cache_key must be a tuple, got {type(key).__name__}")
    out = bytearray()

    def put(tag: bytes, data: bytes) -> None:
        out.extend(tag + len(data).to_bytes(8, "little") + data)

    def walk(value: object, depth: int) -> None:
        if value is None:
            put(b"N", b"")
        elif isinstance(value, bool):  # before int: True must not equal 1
            put(b"B", b"\x01" if value else b"\x00")
        # The base classes' own methods: a subclass can't change what gets hashed.
        elif isinstance(value, int):
            number = int.__int__(value)
            put(b"I", number.to_bytes(number.bit_length() // 8 + 1, "little", signed=True))
        elif isinstance(value, str):
            put(b"S", str.encode(value, "utf-8", "surrogatepass"))
        elif isinstance(value, bytes):
            put(b"Y", b"".join((value,)))
        elif isinstance(value, tuple):
            if depth >= MAX_KEY_DEPTH:
                raise ValueError(f"cache_key nests tuples more than {MAX_KEY_DEPTH} deep")
            items = list(tuple.__iter__(value))
            put(b"T", len(items).to_bytes(8, "little"))
            for item in items:
                walk(item, depth + 1)
        else:
            raise ValueError(
                f"cache_key items must be str, int, bytes, bool, None or tuples of those, got "
                f"{type(value).__module__}.{type(value).__qualname__}; pass a digest instead "
                "(e.g. hashlib.sha256(array.tobytes()).digest())")

    walk(key, 0)
    return bytes(out)


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: tuple = ()) -> bytes:
    """The 16-byte BLAKE2b digest that names one full block. (Your engine: Chapter 31)

    Hashes, in order: the parent block's digest (``ROOT_HASH`` for the first block, whose
    ``parent`` is None), the block's token ids packed as little-endian signed 64-bit integers, and
    — only when ``extra`` is non-empty — the separator ``b"\\x00extra\\x00"`` followed by
    ``encode_cache_key(extra)`` (given above: one unambiguous byte string per key, never a repr).
    So the first block of tokens [1, 2] without extra is ``blake2b(ROOT_HASH + pack("<2q", 1, 2),
    digest_size=16)``.
    It must be a cryptographic hash that is the same in every process: never Python's ``hash()``,
    whose value changes with PYTHONHASHSEED and whose collisions can be crafted — a collision
    here would hand one user another user's cached K/V.
    """
    raise NotImplementedError("hash_block is a hole: fill it in (Chapter 31, engine/serve/blocks.py)")


class BlockManager:
    """Hands out pool blocks to requests and keeps the prefix cache.

    Invariants (``check_invariants`` verifies them):
    - ``ref_count[b]`` equals the number of request tables that hold block b;
    - the free queue holds exactly the blocks with ``ref_count == 0``, each once, front = evicted
      first; ``num_free + blocks in use == num_blocks``;
    - ``cached[h] == b`` implies ``block_hash[b] == h``;
    - block ``num_blocks`` (the scratch block) is never handed out.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # LRU free queue: insertion order is eviction order (front = next to be handed out).
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self.num_published: dict[str, int] = {}  # per request: leading blocks already offered to the cache
        self.num_queries = 0  # tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens found
        self.num_evicted = 0  # cached blocks whose hash was dropped: reused by the allocator, or reset_prefix_cache
        self.pending_lookups: dict[str, tuple[int, int]] = {}  # request id -> (queries, hits) not yet admitted

    # ----- sizes -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests (cached-free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    # ----- hashing -----------------------------------------------------------------------
    def update_hashes(self, request: Request) -> None:
        """Give a digest to each full block of ``request`` that lacks one yet.

        Only known tokens count (speculative placeholders are not), and digests are appended to
        ``request.block_hashes``, which therefore grows by whole blocks and is never recomputed.
        """
        bs = self.block_size
        num_full = (request.num_tokens - request.num_placeholders) // bs
        hashes = request.block_hashes
        while len(hashes) < num_full:  # on most decode steps this runs zero times
            i = len(hashes)
            tokens = request.token_ids[i * bs:(i + 1) * bs]
            if i == 0:  # the cache key enters the first digest; the chain passes it on from there
                hashes.append(hash_block(None, tokens, request.cache_key))
            else:
                hashes.append(hash_block(hashes[-1], tokens))

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup: ``request.num_tokens`` queried, ``num_hit_tokens`` found.

        A request that waits at the head of the queue is looked up again every step until its
        blocks fit; its newest lookup replaces the earlier one, so each admission counts once
        (otherwise a full pool would inflate the hit rate with repeats).
        """
        queried, hit = self.pending_lookups.pop(request.request_id, (0, 0))
        self.num_queries += request.num_tokens - queried
        self.num_hits += num_hit_tokens - hit
        self.pending_lookups[request.request_id] = (request.num_tokens, num_hit_tokens)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Which cached blocks ``request`` may adopt, from its first block on. (Your engine: Chapter 31)

        First brings ``request.block_hashes`` up to date (``self.update_hashes(request)``: nothing
        else fills it in), then walks it from the first block and stops at the first miss. Never
        matches the block holding the request's LAST token — at most ``(num_tokens - 1) //
        block_size`` blocks, where num_tokens counts prompt AND outputs (a request readmitted after
        a recompute adopts the cached blocks of its own outputs too) — because that token's logits
        pick the next token, so at least one token must be computed. Returns [] at once — counting
        nothing, and before updating any hashes (``block_hashes`` is left as it was) — when prefix
        caching is off or the request asks for prompt logprobs (cached rows would never produce
        them). Otherwise it counts the request's tokens as queries and the matched tokens as hits, through
        ``record_lookup`` — a lookup that matches nothing counts too (its tokens, no hits), and so
        does the lookup of a request readmitted after a recompute preemption.
        """
        raise NotImplementedError("BlockManager.find_cached_prefix is a hole: fill it in (Chapter 31, engine/serve/blocks.py)")

    # ----- allocation --------------------------------------------------------------------
    def allocate_slots(self, request: Request, n: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Make room for ``n`` more tokens of ``request``. (Your engine: Chapter 31)

        The request's table must cover ``num_computed_tokens + len(cached_blocks) * block_size + n``
        tokens: first the adopted ``cached_blocks`` (only for a request that holds no blocks yet —
        no ``req_blocks`` entry, or an entry that is empty: ``cached_blocks`` for one whose table
        holds a block is a ValueError, and nothing changes),
        then new blocks from the FRONT of the free queue. All or nothing: if the free queue can't
        supply what is needed, return False and change nothing. Adopting a cached-FREE block
        (ref 0) takes it out of the free queue, so it counts against what is left. A new block
        loses its old hash (and the ``cached`` entry, if that entry pointed at it: ``_evict``);
        an adopted block keeps its hash and its ``cached`` entry — it is a hit, not an eviction —
        so a later request with the same prefix finds it again. Every block the request gains, adopted or new, has its ``ref_count`` raised by one — an
        adopted block another request still holds goes from 1 to 2 (shared), a cached-free one
        from 0 to 1.
        Returns True on success, and then also: a request's first allocation creates its
        ``req_blocks`` entry and sets ``num_published[rid]`` to the number of adopted blocks
        (they are published already); and its ``pending_lookups`` entry is dropped (admitted: its
        lookup stays counted, see ``record_lookup``).
        """
        raise NotImplementedError("BlockManager.allocate_slots is a hole: fill it in (Chapter 31, engine/serve/blocks.py)")

    def _evict(self, block: int) -> None:
        """``block`` is being reused: it no longer names its old content (counted in ``num_evicted``)."""
        had_hash = self._forget_hash(block)
        self.num_evicted += int(had_hash)

    def _forget_hash(self, block: int) -> bool:
        """Drop ``block``'s hash, and its ``cached`` entry if that entry names this block; True if it
        had one."""
        digest, self.block_hash[block] = self.block_hash[block], None
        if digest is None:
            return False
        owner = self.cached.pop(digest, None)
        if owner is not None and owner != block:  # the entry names another block: it stays
            self.cached[digest] = owner
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Publish ``request``'s full blocks among its first ``num_tokens`` tokens.
        (Your engine: Chapter 31)

        ``num_tokens`` defaults to ``num_computed_tokens``. The hashes come from
        ``request.block_hashes``, brought up to date first with ``self.update_hashes(request)``.
        Each newly full block is entered in ``cached`` under its hash — unless that hash is already cached (first writer wins; the
        duplicate stays private, with no hash). The scheduler publishes a step's blocks as soon as it
        has allocated them, while their K/V is still unwritten, so that a request it admits further
        down the same plan can share them. Sharing that early is sound because the forward pass
        goes layer by layer over the whole flattened batch, and in each layer every row's K/V is
        stored before any row's attention runs. Should the forward pass raise, the engine withdraws
        these entries (``unpublish_uncomputed``). After each step the engine calls this once more,
        for the generated tokens. ``num_published[rid]`` counts the request's leading blocks already
        offered to the cache: start there, and raise it to the number of full blocks. Nothing to do
        when prefix caching is off or the request holds no blocks.
        """
        raise NotImplementedError("BlockManager.cache_full_blocks is a hole: fill it in (Chapter 31, engine/serve/blocks.py)")

    def unpublish_uncomputed(self, requests: Iterable[Request]) -> None:
        """Take back what a failed step published, for the requests that step scheduled.

        The scheduler publishes a step's blocks before the forward pass writes them; if that pass
        raises, every published block past a request's ``num_computed_tokens`` holds nothing
        valid. Those blocks lose their hash (they stay in their tables, to be computed again). A
        request that adopted one of them at admission falls back to the blocks before the first
        such block: its ``num_computed_tokens`` (and its hit count) shrink to them and the rest of
        its table is released, so it computes those tokens itself. Callers first set
        ``num_computed_tokens`` of any request whose earlier K/V is also lost (a failed swap-in).
        """
        requests = list(requests)
        bs = self.block_size
        uncomputed: set[int] = set()
        for req in requests:
            table = self.req_blocks.get(req.request_id, [])
            uncomputed.update(b for b in table[req.num_computed_tokens // bs:] if self.block_hash[b] is not None)
        for b in uncomputed:
            self._forget_hash(b)
        for req in requests:
            rid = req.request_id
            table = self.req_blocks.get(rid)
            if table is None:
                continue
            adopted = req.num_computed_tokens // bs
            first_bad = next((i for i, b in enumerate(table[:adopted]) if b in uncomputed), None)
            if first_bad is not None:
                lost = req.num_computed_tokens - first_bad * bs
                self.num_hits -= lost
                req.num_computed_tokens = first_bad * bs
                req.num_cached_tokens = min(req.num_cached_tokens, req.num_computed_tokens)
                self.trim(req, req.num_computed_tokens)
            self.num_published[rid] = min(self.num_published.get(rid, 0), req.num_computed_tokens // bs)

    # ----- release -----------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Drop ``request``'s references to its blocks. (Your engine: Chapter 31)

        Blocks whose count reaches 0 join the BACK of the free queue in reverse table order (tail
        first): a finished request's private last blocks are then evicted before its first blocks,
        which are the ones most likely shared (a system prompt). Freeing a block whose count is
        already 0 raises RuntimeError (``_release`` does both). Always — also for a request that
        holds no blocks, e.g. one that was looked up but never admitted — drop the request's
        ``req_blocks``, ``num_published`` and ``pending_lookups`` entries.
        """
        raise NotImplementedError("BlockManager.free is a hole: fill it in (Chapter 31, engine/serve/blocks.py)")

    def _release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was allocated")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_queue[b] = None

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release ``request``'s blocks past the first ``num_tokens`` tokens (tail first)."""
        table = self.req_blocks.get(request.request_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        dropped = table[keep:]
        del table[keep:]
        self.num_published[request.request_id] = min(self.num_published.get(request.request_id, 0), keep)
        self._release(reversed(dropped))

    def reset_prefix_cache(self) -> int:
        """Forget the hash of every cached-free block; returns how many were forgotten."""
        forgotten = 0
        for b in self.free_queue:
            if self.block_hash[b] is not None:
                self._evict(b)
                forgotten += 1
        return forgotten

    # ----- checking ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the tests after each step)."""
        holders = [0] * self.num_blocks
        for rid, table in self.req_blocks.items():
            assert len(set(table)) == len(table), f"request {rid!r} holds a block twice: {table}"
            for b in table:
                assert 0 <= b < self.num_blocks, f"request {rid!r} holds block {b} outside the pool"
                holders[b] += 1
        assert holders == self.ref_count, "ref_count differs from the number of tables holding each block"
        free = [b for b in range(self.num_blocks) if self.ref_count[b] == 0]
        assert sorted(self.free_queue) == free, "free queue is not exactly the ref-0 blocks"
        assert self.num_free + sum(1 for c in self.ref_count if c > 0) == self.num_blocks
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cached entry for block {b} does not match its hash"
