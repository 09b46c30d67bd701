"""Reading a learner's source, in a limited child: never unbounded in the grader's own process.

Everything the grader learns from a checkout's chapter files by parsing them (``ast.parse``,
``ast.unparse``) happens here, in one child process per checkout: the graded module
(``course/learner/holes.py`` ``assemble_files``) and its edits, the holes still left as the stub
(``stub_holes``), and the copy check's reading of the hole bodies (``course/copies/copycheck.py``
``copied_holes`` and ``fingerprint``), and, given the checkout, its walk for symlinks and for files
changed outside the chapter files (``symlinks``, ``changed_outside``: they read the checkout's other
files, of any size). The child is the grader's own code (no learner code runs in
it; parsing executes nothing) under limits set before it starts: ``PARSE_LIMITS`` (address space,
CPU seconds, no file written) and a wall-clock limit enforced from here. It reads the texts as JSON
on stdin and answers plain JSON on stdout, read up to a cap. Whatever goes wrong in it (a
RecursionError on a 600-term expression, a MemoryError or a kill on a huge literal, a limit, a
crash) reaches the grader as ``CheckoutError`` with a one-line reason: that checkout's row says
``error``, and the run goes on with the others.

    analyse(files, course, checkout) -> {"graded": {rel: text}, "edits": [...], "stubs": [...],
                                         "copied": [...], "fingerprint": "...", "symlinks": [...], "changed": [...]}
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class CheckoutError(Exception):
    """A checkout the grader cannot grade, said in one line (its row's reason); nothing else fails."""


@dataclass(frozen=True)
class ParseLimits:
    """The parsing child's caps (honest chapter files: well under a second and 100 MiB)."""

    seconds: float = 30.0  # wall clock, enforced by the grader
    cpu_seconds: int = 20
    memory_bytes: int = 1536 << 20  # address space
    answer_bytes: int = 64 << 20  # what the grader reads of the child's answer


PARSE_LIMITS = ParseLimits()

_CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); "
          "from course.isolation.parsing import child_main; sys.exit(child_main())")


def analyse(files: dict[str, str], course: dict[str, str], checkout: Path | None = None,
            limits: ParseLimits = PARSE_LIMITS) -> dict:
    """The grader's reading of one checkout's chapter files (``files``) against the course's own
    (``course``), and of the ``checkout`` folder itself when given, computed in a limited child;
    ``CheckoutError`` (one line) when it fails."""
    def setup() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    request = json.dumps({"files": files, "course": course, "checkout": str(checkout) if checkout else None}).encode()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _CHILD, str(ROOT)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd="/",
                                preexec_fn=setup)
    except OSError as exc:
        raise CheckoutError(f"the grader could not start its parser ({type(exc).__name__})") from None
    try:
        out, _ = proc.communicate(request, timeout=limits.seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise CheckoutError(f"reading the chapter files passed the parser's {limits.seconds:g} s limit") from None
    except OSError:  # the child died before taking all of its input
        proc.kill()
        proc.wait()
        out = b""
    if proc.returncode != 0 or len(out) > limits.answer_bytes:
        why = {-9: "killed: the CPU or memory limit", -24: "its CPU limit"}.get(proc.returncode,
                                                                           f"exit {proc.returncode}")
        raise CheckoutError(f"the parser could not read the chapter files ({why}; limits "
                            f"{limits.memory_bytes >> 20} MiB, {limits.cpu_seconds} CPU-s)")
    try:
        answer = json.loads(out)
    except ValueError:
        raise CheckoutError("the parser's answer did not read as JSON") from None
    if "error" in answer:
        raise CheckoutError(f"the grader's reading of the checkout failed: {str(answer['error'])[:120]}")
    return answer


def _analysis(files: dict[str, str], course: dict[str, str], checkout: str | None = None) -> dict:
    """What the grader needs from the chapter files' text (runs in the child only)."""
    import ast

    from course.copies import copycheck
    from course.learner.holes import assemble_files, stub_holes

    for rel, text in sorted(files.items()):  # too deep for the syntax tree: an error, not the course's copy
        try:
            ast.unparse(ast.parse(text))
        except SyntaxError:
            continue  # an honest slip: graded as the course's copy (holes.assemble says so)
        except (RecursionError, MemoryError) as exc:
            raise ValueError(f"engine/{rel} is too deep or too large for the syntax tree "
                             f"({type(exc).__name__})") from None
    graded, edits = assemble_files(files, course)
    out = {"graded": graded, "edits": edits, "stubs": sorted(stub_holes(files)),  # copies: of the graded module
           "reference_flags": copycheck.reference_flags(graded), "fingerprint": copycheck.fingerprint(graded)}
    if checkout is not None:
        from course.learner.testrun import chapter_files

        out["symlinks"] = list(copycheck.symlinks(Path(checkout)))
        out["changed"] = list(copycheck.changed_outside(Path(checkout), chapter_files()))
    return out


def child_main() -> int:
    """The child: a request on stdin, the answer (or ``{"error": kind and message}``) on stdout."""
    try:
        request = json.loads(sys.stdin.buffer.read())
        answer = _analysis(request["files"], request["course"], request.get("checkout"))
        text = json.dumps(answer)
    except (Exception, RecursionError, MemoryError) as exc:  # noqa: BLE001 - the grader reads it as a reason
        first = str(exc).splitlines()[0] if str(exc) else ""
        text = json.dumps({"error": (first if isinstance(exc, ValueError) else f"{type(exc).__name__}: {first}")[:200]})
    sys.stdout.write(text)
    sys.stdout.flush()
    os._exit(0)  # no teardown of a huge tree
