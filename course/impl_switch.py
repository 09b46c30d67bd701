"""The ``--impl`` switch of the course's commands, applied before anything imports ``engine``.

``engine`` chooses its chapter files once, when it is first imported (``engine/_impl.py`` reads
``ENGINE_IMPL``), so a command must read ``--impl`` from its arguments before its first
``import engine`` and before its real parser runs:

    from course.impl_switch import apply_impl
    apply_impl(sys.argv[1:])     # sets ENGINE_IMPL; a bad value exits with argparse's usage error
    import engine                # now the chosen implementation

``add_impl_argument(parser)`` declares the same option on the command's own parser (for --help).
This module imports nothing from the engine.
"""
from __future__ import annotations

import argparse
import os

IMPLS = ("solution", "engine")
ENV_VAR = "ENGINE_IMPL"  # engine/_impl.py's switch, not imported from there: that would import engine
HELP = ("which chapter-31 code to run: 'solution' (the reference in solutions/, default) or "
        "'engine' (your engine/ with the holes you filled in)")


def add_impl_argument(parser: argparse.ArgumentParser, default: str = "solution") -> None:
    """``--impl {solution,engine}`` on ``parser``."""
    parser.add_argument("--impl", choices=IMPLS, default=default, help=HELP)


def apply_impl(argv: list[str], default: str = "solution", prog: str | None = None) -> str:
    """Read ``--impl`` from ``argv`` (other arguments are left to the command), set ``ENGINE_IMPL``
    to it and return it; an unknown value exits with status 2 and a usage line."""
    pre = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    add_impl_argument(pre, default)
    impl = pre.parse_known_args(argv)[0].impl
    os.environ[ENV_VAR] = impl
    return impl
