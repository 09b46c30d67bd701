"""``python -m course.quality.overlap SOURCE...``: runs of words our files share with given source texts.

An editor's check that the course is written in its own words: every run of more than ``--words``
(default 12) consecutive words that appears both in one of the course's files and in a source text
is listed with its file, line and length, longest first. Exit status 1 when there is one.

What counts as a word, and what is left out on purpose:

- a word is a run of letters (apostrophes and inner hyphens allowed), compared case-insensitively;
  punctuation, markup and line breaks between words are ignored, so a sentence re-flowed or
  re-punctuated still matches;
- a token with a digit in it (``41``, ``a6``, ``2,048``) is not a word but a break: the worked
  example's data (positions, slots, lengths) and quoted figures are facts, and a run never spans
  them;
- code spans (```...``` in Markdown, ````...```` in docstrings) are removed before matching, in both
  texts: they hold the public names and signatures the spec fixes (declarations), which any
  implementation must repeat;
- in Python files only comments and string literals (docstrings, messages) are read; with
  ``--code`` the code itself is read too.

    python -m course.quality.overlap /path/to/spec.md                 # the default set of course files
    python -m course.quality.overlap spec.md --words 8 --files chapters/31-engine-v2/README.md
"""
from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The course's own writing: chapter, exercises, answers, docs, notebooks, and the comments and
# docstrings of its code and tests.
DEFAULT_GLOBS = ("README.md", "chapters/**/*.md", "docs/*.md", "solutions/*.md", "notebooks/*.ipynb",
                 "engine/**/*.py", "solutions/**/*.py", "course/**/*.py", "tests/**/*.py",
                 "experiments/*.py", "scripts/*.py", "run.py")

CODE_SPAN = re.compile(r"``.+?``|`[^`\n]+`", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9'’_\-]*")
BREAK = None  # a token that ends every run (a number, a word with a digit)


@dataclass(frozen=True)
class Run:
    """``length`` words at ``ours`` (path:line) that also stand in ``source`` (path:line)."""

    length: int
    ours: str
    source: str
    text: str


def words(text: str, line0: int = 1) -> list[tuple[str | None, int]]:
    """(word or BREAK, line) for every token of ``text`` after code spans are removed."""
    out: list[tuple[str | None, int]] = []
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = CODE_SPAN.sub(lambda m: " 0 " + "\n" * m.group(0).count("\n"), text)  # a span is a break
    for lineno, line in enumerate(text.split("\n"), start=line0):
        for m in TOKEN.finditer(line):
            tok = m.group(0).strip("'’-").lower()
            out.append((BREAK if any(c.isdigit() for c in tok) or not tok else tok, lineno))
    return out


def python_prose(source: str, with_code: bool = False) -> list[tuple[str | None, int]]:
    """Words of a Python file's comments and string literals (and its code, ``with_code``)."""
    out: list[tuple[str | None, int]] = []
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return words(source)
    for tok in toks:
        if tok.type == tokenize.COMMENT:
            out += words(tok.string.lstrip("#"), tok.start[0])
        elif tok.type == tokenize.STRING:
            out += words(tok.string, tok.start[0])
        elif with_code and tok.type == tokenize.NAME:
            out += words(tok.string, tok.start[0])
        else:
            continue
        out.append((BREAK, tok.end[0]))  # separate tokens never join into one run
    return out


def notebook_prose(source: str) -> list[tuple[str | None, int]]:
    """Words of a notebook's cells (line numbers count cells, not file lines)."""
    out: list[tuple[str | None, int]] = []
    for k, cell in enumerate(json.loads(source).get("cells", []), start=1):
        text = "".join(cell.get("source", []))
        ws = python_prose(text) if cell.get("cell_type") == "code" else words(text)
        out += [(w, k) for w, _ in ws] + [(BREAK, k)]
    return out


def read_words(path: Path, with_code: bool = False) -> list[tuple[str | None, int]]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".py":
        return python_prose(text, with_code)
    if path.suffix == ".ipynb":
        return notebook_prose(text)
    return words(text)


def shared_runs(ours: list[tuple[str | None, int]], source: list[tuple[str | None, int]], min_words: int,
                ours_name: str = "ours", source_name: str = "source") -> list[Run]:
    """Maximal runs of at least ``min_words`` words found in both sequences."""
    n = min_words
    index: dict[tuple[str, ...], list[int]] = {}
    src = [w for w, _ in source]
    for i in range(len(src) - n + 1):
        gram = tuple(src[i:i + n])
        if BREAK not in gram:
            index.setdefault(gram, []).append(i)
    ws = [w for w, _ in ours]
    runs: list[Run] = []
    i = 0
    while i <= len(ws) - n:
        gram = tuple(ws[i:i + n])
        starts = index.get(gram) if BREAK not in gram else None
        if not starts:
            i += 1
            continue
        best, best_j = 0, starts[0]
        for j in starts:
            k = n
            while i + k < len(ws) and j + k < len(src) and ws[i + k] is not BREAK and ws[i + k] == src[j + k]:
                k += 1
            if k > best:
                best, best_j = k, j
        runs.append(Run(best, f"{ours_name}:{ours[i][1]}", f"{source_name}:{source[best_j][1]}",
                        " ".join(ws[i:i + best])))
        i += best  # a maximal run is reported once, not once per word
    return runs


def course_files(globs: tuple[str, ...] = DEFAULT_GLOBS) -> list[Path]:
    found: set[Path] = set()
    for pattern in globs:
        found.update(p for p in ROOT.glob(pattern) if p.is_file() and ".venv" not in p.parts)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.quality.overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", type=Path, help="source texts to compare against")
    ap.add_argument("--words", type=int, default=12, help="report runs of MORE than this many words (default 12)")
    ap.add_argument("--files", nargs="*", type=Path, default=None,
                    help="our files to check (default: the course's chapters, docs, answers, notebooks, code)")
    ap.add_argument("--code", action="store_true", help="read Python code too, not only comments and strings")
    ap.add_argument("--top", type=int, default=0, help="also print the N longest runs (of 7 words or more)")
    args = ap.parse_args(argv)
    if args.words < 1:
        ap.error("--words must be >= 1")
    for src in args.sources:
        if not src.is_file():
            ap.error(f"no such source file: {src}")
    files = args.files if args.files is not None else course_files()
    threshold = min(args.words + 1, 7)  # shorter runs are collected too, to report the longest
    runs: list[Run] = []
    sources = [(s, read_words(s)) for s in args.sources]
    for path in files:
        ours = read_words(path, args.code)
        name = str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)
        for src, src_words in sources:
            runs += shared_runs(ours, src_words, threshold, name, src.name)
    runs.sort(key=lambda r: (-r.length, r.ours))
    over = [r for r in runs if r.length > args.words]
    for r in over:
        print(f"{r.length:3d} words  {r.ours}  ({r.source}): {r.text}")
    if args.top:
        print(f"the {args.top} longest runs of 7 words or more:")
        for r in runs[:args.top]:
            print(f"{r.length:3d} words  {r.ours}  ({r.source}): {r.text}")
    longest = f"{runs[0].length} words" if runs else f"under {threshold} words"
    print(f"{len(files)} files against {len(sources)} source(s): {len(over)} run(s) of more than {args.words} "
          f"words; longest shared run {longest}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
