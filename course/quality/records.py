"""The one loader of the bug records in ``course/quality/data/`` (the mutants and the learner-bug
corpus): TOML files of ``[[table]]`` records, one a bug, checked as they are read.

A record whose fields are missing, unknown or of the wrong type, whose name repeats, whose hole is
not one of the chapter's, or whose ``find`` text does not occur where it must (``where``: the filled
chapter file for a mutant, the owning hole's reference body for a corpus bug) raises ``RecordError``
naming the file and the record; the data never reaches a runner half-read.
"""
from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Any, Callable

from course.learner.holes import answers
from course.learner.testrun import reference_files
from engine._impl import all_holes

DATA = Path(__file__).resolve().parent / "data"
FILE_OF: dict[str, str] = dict(all_holes())  # hole qualname -> its chapter file under engine/
REQUIRED = object()  # a field's default when the record must give it


@functools.lru_cache(maxsize=1)
def filled() -> dict[str, str]:
    """Every chapter file (path under engine/) with every hole filled from solutions/, read once."""
    return reference_files()


@functools.lru_cache(maxsize=None)
def hole_body(hole: str) -> str:
    """The reference body of ``hole`` (its source in solutions/)."""
    return answers(FILE_OF[hole])[0][hole]


class RecordError(ValueError):
    """A bug record that can't be used: the message names its file and record."""


def _typed(value: Any, kind: type) -> bool:
    if kind is tuple:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, kind)


def load(path: Path, table: str, fields: dict[str, tuple[type, Any]],
         where: Callable[[dict], tuple[str, str]]) -> list[dict]:
    """The ``[[table]]`` records of ``path``, each a dict of every field of ``fields`` (name -> (type,
    default or REQUIRED); ``tuple`` means a list of strings, returned as a tuple). ``where(record)``
    gives (the text its ``find`` must occur in, what to call that text in an error)."""
    rel = path.relative_to(DATA.parents[2]) if path.is_relative_to(DATA.parents[2]) else path
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RecordError(f"{rel}: not valid TOML: {exc}") from None
    records, seen = [], set()
    for i, rec in enumerate(raw.get(table, []), 1):
        name = rec.get("name")
        label = f"{rel}: [[{table}]] #{i}" + (f" {name!r}" if isinstance(name, str) else " (no name)")
        unknown = sorted(set(rec) - set(fields))
        missing = [k for k, (_, default) in fields.items() if default is REQUIRED and k not in rec]
        wrong = [k for k, (kind, _) in fields.items() if k in rec and not _typed(rec[k], kind)]
        if unknown or missing or wrong:
            raise RecordError(f"{label}: " + "; ".join(
                f"{what} field(s) {', '.join(ks)}" for what, ks in
                (("missing", missing), ("unknown", unknown), ("wrongly typed", wrong)) if ks))
        if name in seen:
            raise RecordError(f"{label}: the name repeats an earlier record's")
        seen.add(name)
        got = {k: rec.get(k, default) for k, (_, default) in fields.items()}
        got = {k: tuple(v) if fields[k][0] is tuple else v for k, v in got.items()}
        holes = got["holes"] if "holes" in got else (got["hole"],)
        bad = [h for h in holes if h not in FILE_OF]
        if bad or not holes:
            raise RecordError(f"{label}: not a hole of the chapter: {list(bad) or 'none given'}")
        text, called = where(got)
        if got["find"] not in text:
            raise RecordError(f"{label}: its find text does not occur in {called}: {got['find'][:80]!r}")
        records.append(got)
    if not records:
        raise RecordError(f"{rel}: no [[{table}]] records")
    return records
