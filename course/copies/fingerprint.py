"""Fingerprints of hole bodies for copy detection by similarity (course/copies/copycheck.py uses them).

A hole's body becomes a stream of tokens, one per node of its normalised syntax tree:

- **no-ops are dropped** first, until none is left: the docstring, ``pass``, expressions that call
  nothing (``12345``, ``x``), ``assert <constant>``, ``if <constant>:`` (its taken branch is kept),
  loops over an empty literal or ``range(0)``, ``x = x``, and assignments to a local name that the
  body never reads whose value calls nothing but pure builtins (``_ = None``, ``junk = len(str(3))``);
  such an assignment whose value calls something else keeps the call as a statement;
- **the learner's own helpers are inlined**: a function or method the checkout adds to the chapter
  file (one the course's copy does not have) that the hole calls, directly or through other helpers,
  has its body appended to the hole's, so moving a body into helpers (in any order) changes little;
- **operands are put in one order**: ``a > b`` as ``b < a``, the sides of ``==``, ``+``, ``*`` (and the
  other symmetric operators) sorted, so swapping them changes nothing;
- **names are abstracted**: a local name, an argument and a helper's name are all ``N``; a name the
  body does not bind (``len``, ``torch``, ``Status``) and an attribute (``.block_size``) keep their
  spelling, since a learner cannot rename the course's API; constants keep only their type.

The fingerprint is the set of hashes of every ``K`` consecutive tokens (k-grams) within each
statement's unit (``units``: a statement at any depth, a compound one by its header alone), winnowed
with a window of ``WINDOW`` (1: every k-gram is kept; hole bodies are small). Grams never span two
statements, so junk put in between statements, even junk that runs something, and reordered
statements or functions leave every gram of the copied code in place. Two bodies' similarity is
``|A & B| / min(|A|, |B|)``: the share of the smaller one's fingerprint found in the other's, which
junk in one of them cannot lower. The hashes are blake2b, stable across processes: a store of
fingerprints (no code) can be kept for later sessions.
"""
from __future__ import annotations

import ast
import hashlib

K = 6  # tokens per k-gram (chosen by measurement: docs/grading.md, `python tests/copy_cases.py`)
WINDOW = 1  # winnowing window (1: keep every k-gram)
PURE = {"len", "int", "float", "str", "bool", "list", "tuple", "dict", "set", "frozenset", "range", "min", "max",
        "abs", "sum", "sorted", "reversed", "isinstance", "round", "repr", "hash", "id", "type", "any", "all",
        "enumerate", "zip", "divmod", "pow", "bytes", "chr", "ord"}


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _pure(node: ast.AST | None) -> bool:
    """An expression whose evaluation runs nothing but pure builtins (and cannot yield or await)."""
    if node is None:
        return True
    if any(isinstance(n, (ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr, ast.Lambda)) for n in ast.walk(node)):
        return False
    return all(isinstance(c.func, ast.Name) and c.func.id in PURE for c in _calls(node))


def _empty_iter(node: ast.AST) -> bool:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not node.elts:
        return True
    if isinstance(node, ast.Constant) and node.value in ("", b""):
        return True
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0)


def _receiver(s: ast.stmt) -> str | None:
    """``x`` for a statement ``x.method(...)`` whose arguments are pure: x is only written to there."""
    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Attribute) \
            and isinstance(s.value.func.value, ast.Name) \
            and all(_pure(a) for a in [*s.value.args, *(k.value for k in s.value.keywords)]):
        return s.value.func.value.id
    return None


def _read_names(stmts: list[ast.stmt]) -> set[str]:
    """Names read for something: not counting ``x.append(...)``-like statements on x itself."""
    read = set()
    for s in stmts:
        skip = set()
        for n in ast.walk(s):
            if isinstance(n, ast.stmt) and (r := _receiver(n)) is not None:
                skip |= {id(m) for m in ast.walk(n) if isinstance(m, ast.Name) and m.id == r}
        for n in ast.walk(s):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in skip:
                read.add(n.id)
            elif isinstance(n, (ast.Global, ast.Nonlocal)):
                read.update(n.names)
    return read


def _simplify(stmts: list[ast.stmt], read: set[str]) -> tuple[list[ast.stmt], bool]:
    """One pass of no-op removal over a block and the blocks inside it."""
    out, changed = [], False
    for s in stmts:
        repl: list[ast.stmt] | None = None
        if isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and _pure(s.value):
            repl = []
        elif (r := _receiver(s)) is not None and r not in read and r not in ("self", "cls"):
            repl = []  # trace.append(1) on a local nothing reads: a write-only junk list
        elif isinstance(s, ast.Assert) and isinstance(s.test, ast.Constant) and s.test.value:
            repl = []
        elif isinstance(s, (ast.If, ast.While)) and isinstance(s.test, ast.Constant):
            repl = (s.body if s.test.value else s.orelse) if isinstance(s, ast.If) else (
                [] if not s.test.value else None)
        elif isinstance(s, ast.For) and _empty_iter(s.iter):
            repl = list(s.orelse)
        elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            names = [t for t in targets if isinstance(t, ast.Name)]
            if isinstance(s, ast.Assign) and len(targets) == 1 and names and isinstance(s.value, ast.Name) \
                    and s.value.id == names[0].id:
                repl = []  # x = x
            elif len(names) == len(targets) and not any(t.id in read for t in names):
                repl = [] if _pure(s.value) else [ast.Expr(s.value)]
        if repl is not None:
            out += repl
            changed = True
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(s, field, None)
            if isinstance(block, list) and block and isinstance(block[0], (ast.stmt, ast.excepthandler)):
                if field == "handlers":
                    for h in block:
                        h.body, c = _simplify(h.body, read)
                        h.body = h.body or [ast.Pass()]
                        changed |= c
                    continue
                new, c = _simplify(block, read)
                if field == "body" and not new:
                    new = [ast.Pass()]  # keep the statement well formed (the loop, the with, ...)
                setattr(s, field, new)
                changed |= c
        out.append(s)
    return out, changed


def strip_noops(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """``stmts`` without the no-op statements listed in the module's docstring (repeated to a fixpoint)."""
    stmts = list(stmts)
    if stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant) \
            and isinstance(stmts[0].value.value, str):
        stmts = stmts[1:]
    for _ in range(50):
        stmts, changed = _simplify(stmts, _read_names(stmts))
        if not changed:
            break
    return [s for s in stmts if not isinstance(s, ast.Pass)]


def _bound(fn: ast.AST) -> set[str]:
    """Names a function binds: its arguments, assignment targets, loop and with targets, nested defs."""
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn:
            out.add(n.name)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
    return out


def units(stmts: list[ast.stmt], local: set[str], own: set[str]) -> list[list[str]]:
    """One token list per statement at every depth, in pre-order: a compound statement's unit is its
    header (``For`` and its target and iterable, ``If`` and its test, ...), its blocks are units of
    their own. Junk put in between statements, or statements reordered, leave every unit as it was."""
    out: list[list[str]] = []

    def visit(stmt: ast.stmt) -> None:
        out.append(tokens([stmt], local, own, shallow=True))
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(stmt, field, None) or []:
                if isinstance(child, ast.ExceptHandler):
                    out.append(["except"] + (tokens([ast.Expr(child.type)], local, own) if child.type else []))
                    for s in child.body:
                        visit(s)
                elif isinstance(child, ast.stmt):
                    visit(child)

    for s in stmts:
        visit(s)
    return out


def tokens(stmts: list[ast.stmt], local: set[str], own: set[str], shallow: bool = False) -> list[str]:
    """The token stream of ``stmts``: node types in pre-order; local and ``own`` names as ``N``
    (``shallow``: not into the statements inside them)."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        if shallow and isinstance(node, (ast.stmt, ast.excepthandler)) and node not in stmts:
            return
        if isinstance(node, ast.expr_context):
            return
        kind = type(node).__name__
        if isinstance(node, ast.Name):
            out.append("N" if node.id in local or node.id in own else f"Name:{node.id}")
        elif isinstance(node, ast.Attribute):
            out.append("A" if node.attr in own else f"A:{node.attr}")
        elif isinstance(node, ast.Constant):
            out.append(f"C:{type(node.value).__name__}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append("def")
        elif isinstance(node, ast.keyword):
            out.append(f"kw:{node.arg}")
        elif isinstance(node, ast.arg):
            out.append("arg")
        else:
            out.append(kind)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.expr, ast.stmt)) or not isinstance(child, ast.expr_context):
                visit(child)

    for s in stmts:
        visit(s)
    return out


def _hash(gram: list[str]) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(gram).encode(), digest_size=8).digest(), "big")


def winnow(toks: list[str], k: int = K, window: int = WINDOW) -> set[int]:
    """The winnowed k-gram hashes of ``toks`` (a stream shorter than ``k`` is one gram)."""
    grams = [_hash(toks[i:i + k]) for i in range(max(1, len(toks) - k + 1))] if toks else []
    if window <= 1 or len(grams) <= window:
        return set(grams)
    kept = set()
    for i in range(len(grams) - window + 1):
        part = grams[i:i + window]
        kept.add(min(part))
    return kept


def similarity(a: set[int] | list[int], b: set[int] | list[int]) -> float:
    """The share of the smaller fingerprint found in the other (0 when either is empty)."""
    a, b = set(a), set(b)
    if not a or not b:
        return 0.0
    return len(a & b) / min(len(a), len(b))


def expanded(fn: ast.FunctionDef, helpers: dict[str, ast.FunctionDef]) -> tuple[list[ast.stmt], set[str]]:
    """``fn``'s body, no-ops dropped, followed by the bodies of the learner's ``helpers`` (name ->
    def; methods by their bare name) it calls, directly or through each other, in order of first
    call; and the names local to any of them."""
    order, seen, todo = [], {fn.name}, [fn]
    while todo:
        f = todo.pop(0)
        order.append(f)
        for n in ast.walk(f):
            name = n.func.id if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) else (
                n.func.attr if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Name) and n.func.value.id in ("self", "cls") else None)
            if name in helpers and name not in seen:
                seen.add(name)
                todo.append(helpers[name])
    stmts, local = [], set()
    for f in order:
        stmts += [s for s in strip_noops(f.body) if not _forwards(s, helpers)]
        local |= _bound(f)
    canon = _Canonical(local, set(helpers))
    return [canon.visit(s) for s in stmts], local


_MIRROR = {ast.Gt: ast.Lt, ast.GtE: ast.LtE}  # a > b is b < a
_SYMMETRIC_CMP = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)
_COMMUTATIVE = (ast.Add, ast.Mult, ast.BitAnd, ast.BitOr, ast.BitXor)


class _Canonical(ast.NodeTransformer):
    """Operands in one order: ``a > b`` as ``b < a``; the two sides of ``==``, ``!=``, ``is``,
    ``+``, ``*``, ``&``, ``|``, ``^`` sorted by their abstracted tokens (so renaming cannot reorder
    them). Swapping them is an edit that changes nothing a copy needs."""

    def __init__(self, local: set[str], own: set[str]) -> None:
        self.local, self.own = local, own

    def _key(self, node: ast.AST) -> str:
        return " ".join(tokens([ast.Expr(node)], self.local, self.own))

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) == 1:
            op, left, right = node.ops[0], node.left, node.comparators[0]
            if type(op) in _MIRROR:
                return ast.Compare(right, [_MIRROR[type(op)]()], [left])
            if isinstance(op, _SYMMETRIC_CMP) and self._key(right) < self._key(left):
                return ast.Compare(right, [op], [left])
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, _COMMUTATIVE) and self._key(node.right) < self._key(node.left):
            return ast.BinOp(node.right, node.op, node.left)
        return node


def _forwards(stmt: ast.stmt, helpers: dict[str, ast.FunctionDef]) -> bool:
    """``return helper(...)`` or ``helper(...)``: the call whose body is inlined after it."""
    value = stmt.value if isinstance(stmt, (ast.Return, ast.Expr)) else None
    if not isinstance(value, ast.Call):
        return False
    f = value.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
        and isinstance(f.value, ast.Name) and f.value.id in ("self", "cls") else None
    return name in helpers


def fingerprint_of(stmts: list[ast.stmt], local: set[str], own: set[str]) -> tuple[set[int], int]:
    """The k-gram hashes of each statement's unit (``units``; a unit shorter than ``K`` is one gram),
    winnowed, and the size in tokens."""
    grams: set[int] = set()
    size = 0
    for unit in units(stmts, local, own):
        grams |= winnow(unit)
        size += len(unit)
    return grams, size


def print_of(fn: ast.FunctionDef, helpers: dict[str, ast.FunctionDef]) -> tuple[list[int], int]:
    """A hole's fingerprint (sorted hashes) and its size in tokens."""
    stmts, local = expanded(fn, helpers)
    grams, size = fingerprint_of(stmts, local, set(helpers))
    return sorted(grams), size
