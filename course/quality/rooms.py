"""Rooms left and returned to: how often building an ``EngineCore`` goes back into a module it left.

A room is one module of the engine (a file under ``engine/``; an answer in ``solutions/`` counts as
the module it fills in). ``trace_rooms(fn)`` runs ``fn`` under ``sys.setprofile`` and follows the
room the work is in: the module of the innermost engine frame (library frames such as torch's or
dataclasses' are seen through). A call from one room into a function of another ENTERS that
room; entering a room that was entered before, and left since, is a RETURN: the reader following
the configuration through the code has to go back to a file already read. Returning from a call
to its caller is not an entry (the reader is only finishing the paragraph they left), nor is a
run of calls from one frame into the same room (``flat.device`` then ``flat.dtype``: one visit),
nor a loop's repeated call (``Trace`` names each kind).

``python -m course.quality.rooms`` builds the 2-layer test model, then traces
``EngineCore(model, EngineConfig())`` (the default configuration; modules already imported by
a first, untraced construction, so imports do not count) and prints the rooms in the order they
were entered, returns marked, and the two totals. ``tests/test_rooms.py`` holds it to at most
``MAX_RETURNS`` returns.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MAX_RETURNS = 4  # issue 38's bar for the default configuration


def room_of(filename: str) -> str | None:
    """``.../engine/serve/runner.py`` -> ``engine.serve.runner`` (``solutions/serve/x.py`` ->
    ``engine.serve.x``); None for a file outside the engine."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.suffix != ".py" or rel.parts[0] not in ("engine", "solutions"):
        return None
    parts = ["engine", *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


ENTER, RETURN, SAME_VISIT, REPEAT = "enter", "return", "same visit", "repeat"


@dataclass
class Trace:
    """Every crossing into another room, in order: (room, the function entered, its kind).

    The kinds: ENTER (a room not entered before), RETURN (a room entered before, and left since),
    SAME_VISIT (the same frame's previous crossing went into this same room, with no other room
    entered in between: ``flat.device`` then ``flat.dtype`` is one visit), REPEAT (a call from the
    same line of code to the same function as one already counted: a loop over layers calling
    ``backend.allocate`` is read once). Only RETURNs count against the plan.
    """

    entries: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def rooms(self) -> list[str]:
        return list(dict.fromkeys(room for room, _, _ in self.entries))

    @property
    def returns(self) -> int:
        return sum(kind == RETURN for _, _, kind in self.entries)

    @property
    def crossings_back(self) -> int:
        """Every crossing into a room entered before, whatever its kind (the plain count)."""
        return sum(kind != ENTER for _, _, kind in self.entries)

    def report(self) -> str:
        lines = [f"  {kind:>10} -> {room}  ({func})" for room, func, kind in self.entries]
        lines.append(f"rooms entered: {len(self.rooms)}; returns to a room left: {self.returns} "
                     f"(every crossing back, same visits and repeats included: {self.crossings_back})")
        return "\n".join(lines)


def trace_rooms(fn: Callable[[], Any], start: str) -> Trace:
    """Run ``fn()`` and record the rooms its calls enter, starting in room ``start`` (the caller's
    room: the first call into another room enters it)."""
    trace = Trace()
    seen = {start}
    edges: set[tuple[Any, int, Any]] = set()  # (caller's code, its line, callee's code) already followed
    stack: list[tuple[str | None, Any]] = []  # per live frame since the start: (its room or None, the frame)
    last: list[Any] = [None]  # (room, calling frame) of the latest crossing

    def caller() -> tuple[str, Any]:
        return next(((r, f) for r, f in reversed(stack) if r is not None), (start, None))

    def profile(frame, event: str, arg: Any) -> None:
        if event == "call":
            room = room_of(frame.f_code.co_filename)
            here, where = caller()
            if room is not None and room != here:
                edge = (where.f_code if where else None, where.f_lineno if where else 0, frame.f_code)
                if last[0] is not None and last[0][0] == room and last[0][1] is where:
                    kind = SAME_VISIT
                elif room not in seen:
                    kind = ENTER
                elif edge in edges:
                    kind = REPEAT
                else:
                    kind = RETURN
                edges.add(edge)
                trace.entries.append((room, frame.f_code.co_qualname, kind))
                seen.add(room)
                last[0] = (room, where)
            stack.append((room, frame))
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return trace


def trace_engine_core(config: Any = None) -> Trace:
    """The rooms ``EngineCore(tiny_model(), config)`` enters (default: ``EngineConfig()``)."""
    import contextlib
    import io

    from engine.models import tiny_model
    from engine.serve import EngineConfig, EngineCore

    model = tiny_model()
    config = config or EngineConfig()
    with contextlib.redirect_stderr(io.StringIO()):  # the pool's one-line announcement
        EngineCore(model, config)  # imports whatever it imports lazily, untraced
        return trace_rooms(lambda: EngineCore(model, config), start="engine.serve.engine")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    trace = trace_engine_core()
    print("EngineCore(tiny_model(), EngineConfig()):")
    print(trace.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
