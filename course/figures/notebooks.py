"""Execute the chapter notebooks, against the reference or against YOUR engine.

    python -m course.figures.notebooks                   # run every notebook in notebooks/ on your engine; save nothing
    python -m course.figures.notebooks --impl solution   # the same on the reference (make notebooks; IMPL=engine: yours)
    python -m course.figures.notebooks --save DIR        # also write the executed copies (with outputs) to DIR
    python -m course.figures.notebooks --clean           # strip outputs from the stored notebooks, in place (nbstripout)
    python -m course.figures.notebooks --check-clean     # exit 1 if a stored notebook carries outputs

The stored notebooks are kept without outputs, so a change to the code shows up in a diff as a
change to the code only. Each notebook runs in a fresh kernel started from this interpreter, in
the notebook's own directory, with ``ENGINE_IMPL`` set to ``--impl`` (default ``solution``,
the walkthrough of the finished engine), which the notebook reads; nothing in it is rewritten. Exit status 1 when a cell fails; the failing
cell's error is printed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from engine._impl import add_impl_argument

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


def notebook_paths(paths: list[str] | None = None) -> list[Path]:
    if paths:
        return [Path(p).resolve() for p in paths]
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def execute(path: Path, timeout: int = 600, save_to: Path | None = None, impl: str | None = None):
    """Run every cell of ``path`` in a fresh kernel; returns the executed notebook (the file on
    disk is not touched), with ``ENGINE_IMPL=impl`` (None: as this process has it). Raises
    ``nbclient.exceptions.CellExecutionError`` when a cell fails."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    previous = os.environ.get("ENGINE_IMPL")
    if impl is not None:
        os.environ["ENGINE_IMPL"] = impl  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if previous is None:
            os.environ.pop("ENGINE_IMPL", None)
        else:
            os.environ["ENGINE_IMPL"] = previous
    if save_to is not None:
        save_to.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save_to / path.name)
    return nb


def strip(paths: list[Path], verify: bool = False) -> int:
    """nbstripout on ``paths``, in place (outputs, execution counts, volatile metadata; cell ids
    are kept so that a diff shows code changes only). ``verify``: change nothing, and return 1 if
    any notebook would change."""
    cmd = [sys.executable, "-m", "nbstripout", "--keep-id", *(["--verify"] if verify else []), *map(str, paths)]
    return subprocess.run(cmd, check=False).returncode


def unfinished_message(exc) -> str:
    """What run.py says when a hole is still a stub, for a notebook cell that raised
    NotImplementedError: how many holes are left, the first to fill, how to check it."""
    from course.learner.holes import unfinished_message as message

    return message(" ".join(str(getattr(exc, "evalue", "")).split()),
                   "Or run the notebook on the reference: make notebooks (IMPL=solution).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.figures.notebooks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="notebooks to run (default: every notebooks/*.ipynb)")
    ap.add_argument("--save", type=Path, default=None, help="write executed copies to this directory")
    ap.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    ap.add_argument("--clean", action="store_true", help="strip outputs in place instead of running")
    ap.add_argument("--check-clean", action="store_true", help="exit 1 if a notebook carries outputs")
    add_impl_argument(ap)  # make notebooks passes IMPL (default solution)
    args = ap.parse_args(argv)
    paths = notebook_paths(args.paths)
    if not paths:
        print(f"no notebooks found under {NOTEBOOKS}", file=sys.stderr)
        return 1
    if args.clean:
        return strip(paths)
    if args.check_clean:
        dirty = strip(paths, verify=True)
        if dirty:
            print("strip them with `python -m course.figures.notebooks --clean`", file=sys.stderr)
        return dirty

    from nbclient.exceptions import CellExecutionError

    failed = 0
    for path in paths:
        start = time.perf_counter()
        try:
            execute(path, args.timeout, args.save, args.impl)
        except CellExecutionError as exc:
            failed += 1
            if getattr(exc, "ename", "") == "NotImplementedError":
                print(f"FAILED {os.path.relpath(path)} on {args.impl}:\n{unfinished_message(exc)}", file=sys.stderr)
            else:
                print(f"FAILED {os.path.relpath(path)}:\n{exc}", file=sys.stderr)
            continue
        print(f"ok {os.path.relpath(path)} on {args.impl} ({time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
