"""Copy detection on the syntax tree: hole bodies equal or similar to the reference, similar between
checkouts of one run or to earlier submissions, holes that delegate to given code of the same job,
symlinks, and files changed outside the chapter files.

Two measures, per hole:
- **equal after normalisation** (``normalised``): docstring and no-op statements dropped, dumped as a
  syntax tree (formatting and comments vanish) with every local name renamed by first appearance;
- **similar** (``course/copies/fingerprint.py``): the share of winnowed k-grams of the normalised
  node stream (no-ops dropped, the learner's own helpers inlined, names and constants abstracted)
  that two bodies have in common. Robust to renaming, reordering and junk lines; only holes of at
  least ``MIN_TOKENS`` tokens are compared this way (a short body is the obvious code for everyone).

Thresholds (``REF_SIMILAR``, ``PAIR_SIMILAR``) were chosen by measurement (docs/grading.md): the
independent bodies of tests/learner_fill.py against the reference, every hole against every other
hole, and the copies (the reference padded, renamed, split into reordered helpers; a classmate's code
with ten junk lines per hole).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from course.learner.holes import _defs, is_stub
from engine._impl import all_holes

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
MIN_TOKENS = 50  # holes shorter than this (normalised tokens) are compared for equality only
REF_SIMILAR = 0.8  # a hole this similar to the reference's is flagged
PAIR_SIMILAR = 0.8  # a hole this similar between two checkouts (or an earlier submission) is flagged
# holes whose API leaves one way to write them: an independent body (tests/learner_fill.py) is this
# similar to the reference's, so for them only equality after normalisation is flagged
CONSTRAINED = {"FlatModel.attention": 0.86, "FlatModel.forward": 0.91}
DELEGATE_SHARE = 0.5  # a hole whose tokens are mostly calls to given code of its own job is flagged
# given code that does a hole's job under another name (besides any callable of the hole's own name)
SAME_JOB = {"ReferenceBackend.forward": {"TorchBackend", "CPUBackend", "TritonBackend", "get_backend",
                                         "paged_attention", "attend_rows", "_forward_group", "_forward_identity"},
            "FlatModel.forward": {"FusedFlatModel", "CompiledFlatModel", "get_flat_model"},
            "EngineCore.step": {"SlotEngine"}}


class _Rename(ast.NodeTransformer):
    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def _new(self, name: str) -> str:
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Name(self._new(node.id), node.ctx), node)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return ast.copy_location(ast.arg(self._new(node.arg), None), node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.name = self._new(node.name)  # a nested function's name is a local too
        return self.generic_visit(node)


def normalised(fn: ast.FunctionDef, helpers: dict[str, ast.FunctionDef] | None = None) -> str:
    """A hole body's comparable form: no docstring, no no-op statements (``fingerprint.strip_noops``:
    ``pass``, ``_ = None``, junk assignments never read, constant branches, ...), the learner's own
    ``helpers`` it calls inlined (``fingerprint.expanded``), names by first appearance."""
    from course.copies.fingerprint import expanded

    fn = ast.parse(ast.unparse(fn)).body[0]  # a copy: the no-op removal edits the tree
    helpers = {k: ast.parse(ast.unparse(v)).body[0] for k, v in (helpers or {}).items()}
    module = ast.Module(body=expanded(fn, helpers)[0], type_ignores=[])
    tree = _Rename().visit(module)
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def hole_bodies(text: str, rel: str) -> dict[str, str]:
    """COUPLING POINT (learner layer): hole name -> normalised body, for the filled holes of one
    chapter file's text. The holes are the chapter's (``engine._impl.all_holes``, read from the
    markers in the instructor's engine/), found in ``text`` by qualname; a stub is not a body."""
    return {q: a.body for q, a in _analysis(text, rel).items()}


@dataclass(frozen=True)
class Analysis:
    """What the copy checks need of one filled hole, computed once per file text (``_analysis``)."""
    body: str  # normalised (``normalised``): compared for equality
    prints: tuple[int, ...]  # winnowed k-gram hashes (``fingerprint.print_of``)
    size: int  # tokens of the normalised stream
    delegation: tuple[str, float] | None  # (callee, share) when it hands its job to given code


@functools.lru_cache(maxsize=64)
def _analysis(text: str, rel: str) -> dict[str, Analysis]:
    from course.copies.fingerprint import expanded, fingerprint_of

    try:
        filled, helpers = _parsed_holes(text, _course_texts().get(rel, ""), rel)
        out = {}
        for q, fn in filled.items():
            stmts, local = expanded(fn, helpers)  # edits this parse's tree: parsed for this call alone
            grams, size = fingerprint_of(stmts, local, set(helpers))
            deleg = _delegation(q, stmts, local, helpers)
            body = ast.dump(_Rename().visit(ast.Module(body=stmts, type_ignores=[])), annotate_fields=False,
                            include_attributes=False)
            out[q] = Analysis(body, tuple(sorted(grams)), size, deleg)
        return out
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {}  # a file too deep to read is graded as the course's copy (course/learner/holes.py)


def reference_bodies() -> dict[str, str]:
    """COUPLING POINT (learner layer): the reference's normalised hole bodies. ``solutions/<rel>``
    holds only the holes' bodies (module functions, and methods inside classes of the same name),
    found there by the same qualnames."""
    out = {}
    for rel in sorted(set(_holes().values())):
        path = SOLUTIONS / rel
        if path.is_file():
            out.update(hole_bodies(path.read_text(), rel))
    return out


def copied_holes(files: dict[str, str]) -> list[str]:
    """The holes of a checkout whose body is the reference's after normalisation."""
    ref = reference_bodies()
    mine = {}
    for rel, text in files.items():
        mine.update(hole_bodies(text, rel))
    return sorted(q for q, body in mine.items() if ref.get(q) == body)


SKIPPED_DIRS = (".git", ".venv", ".venv-peers", "__pycache__")
MAX_ENTRIES = 200_000  # a checkout's entries walked at most: a bound on the walk's time


def walk_entries(top: Path):
    """(path, entry) for everything under ``top``, never following a link, skipping
    ``SKIPPED_DIRS``, at most ``MAX_ENTRIES``: an explicit stack, not recursion (os.walk and rglob
    recurse in Python 3.11, and a 1,200-deep folder would end them in RecursionError); a folder
    that cannot be listed (too long a path, no permission) is passed over."""
    stack, seen = [top], 0
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_ENTRIES:
                return
            path = folder / entry.name
            yield path, entry
            if entry.is_dir(follow_symlinks=False) and entry.name not in SKIPPED_DIRS:
                stack.append(path)


def symlinks(checkout: Path) -> list[str]:
    """Every symlink in the checkout (not followed), with whether it leaves the checkout."""
    found = []
    for path, entry in walk_entries(checkout):
        if entry.is_symlink():
            target = Path(os.path.realpath(path))
            where = "inside" if target.is_relative_to(checkout.resolve()) else "OUTSIDE the checkout"
            found.append(f"{path.relative_to(checkout)} -> {os.readlink(path)} ({where})")
    return sorted(found)


def changed_outside(checkout: Path, chapter: list[str], limit: int = 20) -> list[str]:
    """Files of the instructor's engine/, course/ and tests/ that differ in the checkout (or are new
    .py files there). The grader never uses them; they are listed for the instructor."""
    out = []
    skip = {f"engine/{rel}" for rel in chapter}
    for top in ("engine", "course", "tests"):
        base = checkout / top
        if not base.is_dir() or base.is_symlink():
            continue
        for path in sorted(p for p, e in walk_entries(base) if e.name.endswith(".py") and e.is_file(follow_symlinks=False)):
            rel = path.relative_to(checkout).as_posix()
            if rel in skip or "__pycache__" in rel:
                continue
            mine = ROOT / rel
            if not mine.is_file():
                out.append(f"{rel} (a file the course does not have)")
            elif _digest(mine) != _digest(path):
                out.append(f"{rel} (differs from the course's)")
            if len(out) >= limit:
                return out
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----- similarity: fingerprints of the normalised syntax tree (course/copies/fingerprint.py) -----
@functools.lru_cache(maxsize=1)
def _course_texts() -> dict[str, str]:
    from course.learner.testrun import skeleton_files

    return skeleton_files()


@functools.lru_cache(maxsize=1)
def _holes() -> dict[str, str]:
    return dict(all_holes())


def _parsed_holes(text: str, course_text: str, rel: str):
    """(hole qualname -> its def, for the filled holes; the learner's own functions and methods,
    by bare name): the functions and methods ``text`` has that ``course_text`` does not."""
    defs = _defs(ast.parse(text))
    try:
        given = set(_defs(ast.parse(course_text)))
    except (SyntaxError, ValueError):
        given = set()
    holes = [q for q, file in _holes().items() if file == rel]
    filled = {q: defs[q] for q in holes if isinstance(defs.get(q), ast.FunctionDef) and not is_stub(defs[q])}
    helpers = {q.rsplit(".", 1)[-1]: d for q, d in defs.items()
               if isinstance(d, ast.FunctionDef) and q not in given and q not in holes}
    return filled, helpers


def hole_prints(files: dict[str, str]) -> dict[str, dict]:
    """COUPLING POINT (learner layer): hole -> {"prints": sorted k-gram hashes, "size": tokens} for
    each filled hole of a checkout's chapter files (rel -> text). Plain data: no code is kept."""
    out = {}
    for rel, text in sorted(files.items()):
        for q, a in _analysis(text, rel).items():
            out[q] = {"prints": list(a.prints), "size": a.size}
    return out


_REF: dict[str, dict] = {}


def reference_prints() -> dict[str, dict]:
    """The reference's hole fingerprints (the course's files filled from solutions/), computed once."""
    if not _REF:
        from course.learner.testrun import reference_files

        _REF.update(hole_prints(reference_files()))
    return _REF


def similar_to_reference(prints: dict[str, dict], ref: dict[str, dict] | None = None,
                         threshold: float = REF_SIMILAR) -> list[tuple[str, float]]:
    """(hole, similarity) for each hole of at least MIN_TOKENS whose fingerprint is ``threshold``
    similar to the reference's."""
    from course.copies.fingerprint import similarity

    ref = reference_prints() if ref is None else ref
    out = []
    for q, mine in sorted(prints.items()):
        theirs = ref.get(q)
        if theirs and min(mine["size"], theirs["size"]) >= MIN_TOKENS and q not in CONSTRAINED:
            s = similarity(mine["prints"], theirs["prints"])
            if s >= threshold:
                out.append((q, round(s, 3)))
    return out


def fingerprint(files: dict[str, str]) -> dict[str, dict]:
    """What is compared between checkouts and stored for later sessions: the fingerprints of the
    filled holes that are not the reference's (equal or similar to it: those are flagged already)."""
    prints = hole_prints(files)
    ref = set(copied_holes(files)) | {q for q, _ in similar_to_reference(prints)}
    return {q: p for q, p in prints.items() if q not in ref}


Pair = tuple[str, str, list[tuple[str, float]]]  # (id, id, [(hole, similarity), ...])


def similar_pairs(prints: dict[str, dict], threshold: float = PAIR_SIMILAR) -> list[Pair]:
    """(a, b, [(hole, similarity), ...]) for each pair of checkouts (id -> ``fingerprint``) with at
    least one hole of MIN_TOKENS or more that is ``threshold`` similar between them."""
    from course.copies.fingerprint import similarity

    ids = sorted(k for k, v in prints.items() if isinstance(v, dict) and v)
    pairs = []
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            holes = []
            for q in sorted(set(prints[a]) & set(prints[b])):
                x, y = prints[a][q], prints[b][q]
                if min(x["size"], y["size"]) >= MIN_TOKENS and q not in CONSTRAINED \
                        and (s := similarity(x["prints"], y["prints"])) >= threshold:
                    holes.append((q, round(s, 3)))
            if holes:
                pairs.append((a, b, holes))
    return pairs


def near_pairs(prints: dict, threshold: float = PAIR_SIMILAR) -> list[tuple[str, str, float]]:
    """Pairs of checkouts with a similar hole, and the highest similarity (``similar_pairs`` in short)."""
    return [(a, b, max(s for _, s in holes)) for a, b, holes in similar_pairs(prints, threshold)]


def pair_flag(other: str, holes: list[tuple[str, float]], where: str = "") -> str:
    """The flag text for holes similar to another checkout's: worded as similarity, never as a verdict."""
    listed = ", ".join(f"{q} {s:.0%}" for q, s in holes)
    return f"{len(holes)} hole(s) similar to {other}{where} (fingerprints of the normalised syntax tree): {listed}"


def save_prints(path: Path, entries: dict[str, dict]) -> None:
    """Write a store of earlier submissions' fingerprints: {"version": 1, "submissions": {id: prints}}.
    Only hashes and sizes: no code of anyone's."""
    path.write_text(json.dumps({"version": 1, "k": _k(), "submissions": entries}, sort_keys=True) + "\n")


def _k() -> list[int]:
    from course.copies.fingerprint import K, WINDOW

    return [K, WINDOW]


def load_prior(where: Path) -> dict[str, dict]:
    """Earlier submissions' fingerprints: ``where`` is a store (``save_prints``), or a folder of stores
    (``*.json``) and checkouts (folders with engine/, fingerprinted here). ``ValueError`` on anything else."""
    from course.learner.testrun import chapter_files

    if where.is_file():
        doc = json.loads(where.read_text())
        if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("submissions"), dict):
            raise ValueError(f"{where}: not a store of fingerprints (save_prints)")
        if doc.get("k") != _k():
            raise ValueError(f"{where}: fingerprints of k-grams {doc.get('k')}, this grader uses {_k()}: rebuild it")
        return dict(doc["submissions"])
    if not where.is_dir():
        raise ValueError(f"{where}: no such file or folder of earlier submissions")
    out: dict[str, dict] = {}
    for p in sorted(where.iterdir()):
        if p.suffix == ".json" and p.is_file():
            out.update(load_prior(p))
        elif (p / "engine").is_dir():
            files = {rel: (p / "engine" / rel).read_text(errors="replace") for rel in chapter_files()
                     if (p / "engine" / rel).is_file() and not (p / "engine" / rel).is_symlink()}
            out[p.name] = fingerprint(files)
    return out


def similar_to_prior(prints: dict[str, dict], prior: dict[str, dict],
                     threshold: float = PAIR_SIMILAR) -> list[str]:
    """Flags for the holes of one submission similar to an earlier submission's."""
    flags = []
    for other, theirs in sorted(prior.items()):
        pairs = similar_pairs({"\0me": prints, "\1" + other: theirs}, threshold)
        for _, _, holes in pairs:
            flags.append(pair_flag(other, holes, " (an earlier submission)"))
    return flags


# ----- delegation: a hole that hands its job to given code -----
def delegations(files: dict[str, str]) -> list[tuple[str, str, float]]:
    """(hole, callee, share) for each filled hole whose body (no-ops dropped, the learner's helpers
    inlined) is mostly (``DELEGATE_SHARE`` of its tokens or more) calls to given code doing the
    hole's own job: a callable of the hole's own name that is not the learner's (``TorchBackend().forward``
    from ``ReferenceBackend.forward``), or one of ``SAME_JOB``'s. Calling the hole recursively on
    ``self`` is not delegation, and nor is calling another hole (the learner's own work)."""
    return [(q, *a.delegation) for rel, text in sorted(files.items()) for q, a in _analysis(text, rel).items()
            if a.delegation is not None]


def _delegation(q: str, stmts: list[ast.stmt], local: set[str], helpers: dict) -> tuple[str, float] | None:
    from course.copies.fingerprint import tokens

    job = q.rsplit(".", 1)[-1]
    hole_names = {h.rsplit(".", 1)[-1] for h in _holes()}
    own = set(helpers)
    total = sum(len(tokens([s], local, own)) for s in stmts if not _plumbing(s, own))
    calls, covered = [], 0
    for node in [n for s in stmts for n in ast.walk(s)]:
        if not isinstance(node, ast.Call):
            continue
        name = _callee(node.func)
        on_self = isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id in ("self", "cls")
        same = name == job and not (on_self and "." in q) and name not in own
        other = name in SAME_JOB.get(q, set()) and name not in own
        if (same or other) and not (name in hole_names and name != job):
            calls.append(_dotted_name(node.func))
            covered = max(covered, len(tokens([ast.Expr(node)], local, own)))
    if calls and total and covered / total >= DELEGATE_SHARE:
        return calls[0], round(covered / total, 3)
    return None


def _plumbing(stmt: ast.stmt, own: set[str]) -> bool:
    """An import, or a statement that only passes the work to one of the learner's helpers."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return True
    value = stmt.value if isinstance(stmt, (ast.Return, ast.Expr)) else None
    return isinstance(value, ast.Call) and _callee(value.func) in own


def _callee(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _dotted_name(func: ast.AST) -> str:
    try:
        return ast.unparse(func)[:80]
    except (ValueError, RecursionError):
        return _callee(func) or "?"


# ----- the flags the grader writes (course/grading/grade.py): worded as similarity, never as a verdict -----
def reference_flags(files: dict[str, str]) -> list[str]:
    """One checkout's flags against the course: holes equal to the reference after normalisation,
    holes similar to it, holes that hand their job to given code."""
    flags = []
    copied = copied_holes(files)
    if copied:
        flags.append(f"{len(copied)} hole(s) equal to the reference after normalisation: {', '.join(copied)}")
    similar = [(q, s) for q, s in similar_to_reference(hole_prints(files)) if q not in copied]
    if similar:
        flags.append(f"{len(similar)} hole(s) similar to the reference (fingerprints of the normalised syntax "
                     f"tree): {', '.join(f'{q} {s:.0%}' for q, s in similar)}")
    for q, callee, share in delegations(files):
        flags.append(f"{q} hands its job to given code of the same job: {callee} ({share:.0%} of its body)")
    return flags


def cross_flags(docs: dict[str, dict], prior: dict[str, dict], rewrite, store: Path | None = None) -> None:
    """The run's flags between checkouts (id -> grade document, its ``fingerprint``): each pair with a
    similar hole, and each checkout with a hole similar to an earlier submission's (``prior``).
    ``rewrite(id)`` is called for each document that gained a flag; the run's fingerprints are added
    to ``store`` (a store for later sessions' ``--prior``). A failure here is a warning: the grades stay."""
    import sys

    try:
        prints = {i: d["fingerprint"] for i, d in docs.items() if isinstance(d.get("fingerprint"), dict)}
        changed = set()
        for a, b, holes in similar_pairs(prints):
            docs[a]["flags"].append(pair_flag(b, holes))
            docs[b]["flags"].append(pair_flag(a, holes))
            changed |= {a, b}
        for i, mine in prints.items():
            found = similar_to_prior(mine, {k: v for k, v in prior.items() if k != i})
            docs[i]["flags"] += found
            changed |= {i} if found else set()
        for i in sorted(changed):
            rewrite(i)
        kept = {i: p for i, p in prints.items() if p}  # a checkout with no hole of its own adds nothing
        if store is not None and kept:
            old = load_prior(store) if store.is_file() else {}
            save_prints(store, {**old, **kept})
    except Exception as exc:  # noqa: BLE001 - the similarity checks failing must not lose the grades
        print(f"warning: the similarity checks between checkouts failed ({type(exc).__name__}: {str(exc)[:200]}); "
              "no pairs flagged", file=sys.stderr)
