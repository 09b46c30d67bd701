"""Copies a learner might hand in, built from the reference and tests/learner_fill.py, for the copy
checks' tests (tests/test_copycheck.py) and the measurement in docs/grading.md:

    .venv/bin/python tests/copy_cases.py      # the table of similarity scores

Every case is a dict rel -> chapter file text, like ``reference_files()``. A handout leaves this file out
with learner_fill.py (it is built from the answers).
"""
from __future__ import annotations

import ast
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from course.learner.holes import _defs, all_holes, fill, is_stub  # noqa: E402
from course.learner.testrun import reference_files, skeleton_files  # noqa: E402
from learner_fill import BODIES, indented  # noqa: E402


def _holes_of(rel: str) -> list[str]:
    return [h.qualname for h in all_holes() if h.file == f"engine/{rel}"]


def honest() -> dict[str, str]:
    """The reference, with every hole tests/learner_fill.py has written from its docstring alone."""
    files = reference_files()
    for rel in BODIES:
        files[rel] = fill(files[rel], indented(rel))
    return files


def learner(holes: set[str], base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: the skeleton, every hole a stub) with the named holes filled from
    tests/learner_fill.py: a learner who has written those and no others."""
    files = dict(base or skeleton_files())
    for rel in BODIES:
        mine = {q: b for q, b in indented(rel).items() if q in holes}
        if mine:
            files[rel] = fill(files[rel], mine)
    return files


def _insert_at_body_starts(files: dict[str, str], junk) -> dict[str, str]:
    """Each hole's body with the lines ``junk(qualname, pad, rng)`` put in at its top-level statements."""
    out = {}
    for rel, text in files.items():
        tree, lines = ast.parse(text), text.splitlines(keepends=True)
        at = []
        rng = random.Random(rel)  # seeded: the same junk every run
        for q in _holes_of(rel):
            fn = _defs(tree)[q]
            if is_stub(fn):
                continue  # a hole left as the stub stays one
            body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
            for stmt, extra in junk(q, body, rng):
                at.append((stmt.lineno - 1, "".join(" " * stmt.col_offset + x + "\n" for x in extra)))
        for i, block in sorted(at, reverse=True):
            lines[i:i] = [block]
        out[rel] = "".join(lines)
    return out


def no_op_per_hole(files: dict[str, str]) -> dict[str, str]:
    """One ``_ = None`` at the top of each hole's body."""
    return _insert_at_body_starts(files, lambda q, body, rng: [(body[0], ["_ = None"])])


JUNK = ["_ = None", "pass", "junk_a = 12345", "junk_b = len(str(junk_a)) * 2", "'''a note'''",
        "if False:\n    junk_c = 1", "for _unused in range(0):\n    pass", "junk_d = [i * i for i in range(4)]",
        "assert True", "trace = []", "trace.append(len(trace))", "junk_e = {'k': junk_a}"]


LIVE = ["print(end='')", "'x'.upper()", "getattr(len, '__name__', None)", "__import__('math').sqrt(4.0)"]


def live_junk(files: dict[str, str], per_hole: int = 10) -> dict[str, str]:
    """``per_hole`` lines per hole that run something (a call no normalisation may drop), spread over
    its top-level statements: what is left for the k-grams to see through."""
    def junk(q, body, rng):
        out: dict[int, list[str]] = {}
        for _ in range(per_hole):
            out.setdefault(rng.randrange(len(body)), []).append(rng.choice(LIVE))
        return [(body[i], extra) for i, extra in out.items()]
    return _insert_at_body_starts(files, junk)


def junk_lines(files: dict[str, str], per_hole: int = 10) -> dict[str, str]:
    """About ``per_hole`` junk lines spread over each hole's top-level statements: dead assignments,
    constant branches, and live ones (a list the body appends to and never uses)."""
    def junk(q, body, rng):
        picks = ["trace = []"] + [rng.choice([j for j in JUNK if j != "trace = []"]) for _ in range(per_hole - 1)]
        places = sorted(rng.randrange(len(body)) for _ in picks)
        out: dict[int, list[str]] = {}
        for line, place in zip(picks, [0, *places[1:]]):  # the live list first: the rest may use it
            out.setdefault(place, []).extend(line.split("\n"))
        return [(body[i], extra) for i, extra in out.items()]
    return _insert_at_body_starts(files, junk)


class _RenameLocals(ast.NodeTransformer):
    def __init__(self, names: set[str], fn: ast.AST | None = None) -> None:
        imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(fn)
                    if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names} if fn is not None else set()
        self.names = names - imported  # an import keeps its name (the renamer does not rewrite aliases)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.names:
            node.id = "my_" + node.id
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        if node.name in self.names:
            node.name = "my_" + node.name
        return self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        if node.arg in self.names:
            node.arg = "my_" + node.arg
        return node


def renamed_into_helpers(files: dict[str, str]) -> dict[str, str]:
    """Each hole's body with its locals renamed, moved into a helper of the learner's own (a method of
    the hole's class, or a module function) that the hole calls; the helpers in reverse order at the
    end of their class or file. Comments are lost (the file is rewritten from its syntax tree)."""
    from course.copies.fingerprint import _bound

    out = {}
    for rel, text in files.items():
        tree = ast.parse(text)
        defs = _defs(tree)
        added: dict[str, list[ast.stmt]] = {}
        for q in _holes_of(rel):
            fn = defs[q]
            doc = fn.body[:1] if ast.get_docstring(fn) is not None else []
            body = fn.body[len(doc):]
            args = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
            helper = ast.parse(f"def _mine_{fn.name.strip('_')}({', '.join(args)}):\n    pass\n").body[0]
            helper.body = body
            _RenameLocals(_bound(helper) - {"self"}, helper).visit(helper)
            owner = q.rsplit(".", 1)[0] if "." in q else ""
            call_args = ", ".join(a for a in args if a != "self")
            target = f"self._mine_{fn.name.strip('_')}" if owner else f"_mine_{fn.name.strip('_')}"
            fn.body = doc + ast.parse(f"return {target}({call_args})").body
            added.setdefault(owner, []).insert(0, helper)  # reverse order
        for owner, helpers in added.items():
            (defs[owner].body if owner else tree.body).extend(helpers)
        out[rel] = ast.unparse(tree) + "\n"
    return out


def renamed_with_junk(files: dict[str, str], per_hole: int = 10) -> dict[str, str]:
    """``files`` with its holes' locals renamed and ``per_hole`` junk lines in each: a classmate's copy."""
    from course.copies.fingerprint import _bound

    out = {}
    for rel, text in junk_lines(files, per_hole).items():
        tree = ast.parse(text)
        defs = _defs(tree)
        for q in _holes_of(rel):
            fn = defs[q]
            _RenameLocals(_bound(fn) - {a.arg for a in fn.args.args + fn.args.kwonlyargs}, fn).visit(fn)
        out[rel] = ast.unparse(tree) + "\n"
    return out


class _Swap(ast.NodeTransformer):
    """Every one-operator comparison written the other way round (``a < b`` as ``b > a``), and the
    operands of every ``+`` and ``*`` swapped."""
    FLIP = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE, ast.Eq: ast.Eq, ast.NotEq: ast.NotEq}

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) == 1 and type(node.ops[0]) in self.FLIP:
            return ast.Compare(node.comparators[0], [self.FLIP[type(node.ops[0])]()], [node.left])
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        return ast.BinOp(node.right, node.op, node.left) if isinstance(node.op, (ast.Add, ast.Mult)) else node


def swapped(files: dict[str, str]) -> dict[str, str]:
    """Each hole's comparisons mirrored and its sums and products swapped (``_Swap``)."""
    out = {}
    for rel, text in files.items():
        tree = ast.parse(text)
        for q in _holes_of(rel):
            _Swap().visit(_defs(tree)[q])
        out[rel] = ast.unparse(tree) + "\n"
    return out


def delegating(files: dict[str, str]) -> dict[str, str]:
    """ReferenceBackend.forward handed to the given TorchBackend, through a helper of the learner's."""
    rel = "serve/attention.py"
    body = ("        return self._fast(q, cache, meta, scale, window)\n\n"
            "    def _fast(self, q, cache, meta, scale, window):\n"
            "        from engine.fast.torch_attention import TorchBackend\n"
            "        _ = None\n"
            "        return TorchBackend().forward(q, cache, meta, scale=scale, window=window)\n")
    return {**files, rel: fill(files[rel], {"ReferenceBackend.forward": body})}


def table() -> list[tuple[str, str, str, float]]:
    """(case, hole, against, similarity) for the cases above: the honest ones and the copies."""
    from course.copies import copycheck as cc
    from course.copies.fingerprint import similarity

    ref = cc.reference_prints()
    base = cc.hole_prints(honest())
    rows = []

    def against(name, prints, other, other_name, holes=None):
        for q in sorted(prints):
            if (holes is None or q in holes) and q in other:
                rows.append((name, q, other_name, round(similarity(prints[q]["prints"], other[q]["prints"]), 3),
                             min(prints[q]["size"], other[q]["size"])))

    mine = {q for rel in BODIES for q in BODIES[rel]}
    against("honest (learner_fill)", base, ref, "reference", mine)
    against("reference + `_ = None`", cc.hole_prints(no_op_per_hole(reference_files())), ref, "reference")
    against("reference renamed, in reordered helpers", cc.hole_prints(renamed_into_helpers(reference_files())), ref,
            "reference")
    against("reference renamed + 10 junk lines", cc.hole_prints(renamed_with_junk(reference_files())), ref, "reference")
    against("classmate: honest renamed + 10 junk lines", cc.hole_prints(renamed_with_junk(honest())), base,
            "honest", mine)
    against("reference + 10 live junk lines", cc.hole_prints(live_junk(reference_files())), ref, "reference")
    against("reference, operands swapped", cc.hole_prints(swapped(reference_files())), ref, "reference")
    against("classmate: honest + 10 live junk lines", cc.hole_prints(live_junk(honest())), base, "honest", mine)
    return rows


CASES = {"honest (learner_fill) vs ref": "honest", "ref + `_ = None` vs ref": "noop",
         "ref renamed, reordered helpers vs ref": "helpers", "ref renamed + 10 junk vs ref": "junk",
         "classmate: honest renamed + 10 junk vs honest": "pair", "ref + 10 live junk vs ref": "live",
         "classmate: honest + 10 live junk vs honest": "live pair", "ref, operands swapped vs ref": "swapped"}


def main() -> None:
    """The table of docs/grading.md: one row per hole, one column per case (similarity; ``=`` where
    the bodies are also equal after normalisation; ``-`` where the case has no such hole)."""
    from course.copies import copycheck as cc

    got: dict[tuple[str, str], float] = {}
    sizes: dict[str, int] = {}
    for case, q, _other, s, size in table():
        got[(case, q)] = s
        sizes[q] = min(size, sizes.get(q, size))
    names = ["honest (learner_fill)", "reference + `_ = None`", "reference renamed, in reordered helpers",
             "reference renamed + 10 junk lines", "classmate: honest renamed + 10 junk lines",
             "reference + 10 live junk lines", "classmate: honest + 10 live junk lines",
             "reference, operands swapped"]
    equal = {names[1]: set(cc.copied_holes(no_op_per_hole(reference_files()))),
             names[2]: set(cc.copied_holes(renamed_into_helpers(reference_files()))),
             names[3]: set(cc.copied_holes(renamed_with_junk(reference_files()))),
             names[7]: set(cc.copied_holes(swapped(reference_files()))),
             names[0]: set(cc.copied_holes(honest())) & {q for rel in BODIES for q in BODIES[rel]}}
    print("| hole | tokens | " + " | ".join(CASES) + " |")
    print("|---|---:|" + "---:|" * len(CASES))
    for h in all_holes():
        q = h.qualname
        cells = []
        for n in names:
            s = got.get((n, q))
            cells.append("-" if s is None else f"{s:.2f}" + (" =" if q in equal.get(n, ()) else ""))
        note = " (equality only)" if q in cc.CONSTRAINED or sizes.get(q, 0) < cc.MIN_TOKENS else ""
        print(f"| {q}{note} | {sizes.get(q, '')} | " + " | ".join(cells) + " |")
    print("\ndelegation (ReferenceBackend.forward through a helper to TorchBackend):",
          cc.delegations(delegating(reference_files())))


if __name__ == "__main__":
    main()
