"""``course.quality.overlap``, the own-words check: it finds a shared run, and only a real one."""
from __future__ import annotations

import pytest

from course.quality.overlap import main, python_prose, shared_runs, words

pytestmark = pytest.mark.given  # a tool of the course; no learner hole involved

SOURCE = ("The scheduler serves running requests first because they hold blocks and their users are "
          "watching the stream, then admits waiting ones while budget remains. Worked example: "
          "positions 6 7 8 41 9 0 1 2 3 for `build_batch(scheduled, block_tables, block_size)`.")


def test_a_copied_sentence_is_found_with_its_length_and_line():
    ours = "Intro line.\nHere: running requests first because they hold blocks and their users are watching the stream!"
    [run] = shared_runs(words(ours), words(SOURCE), 13, "ours.md", "src.md")
    assert run.length == 14 and run.ours == "ours.md:2" and run.text.startswith("running requests first")


def test_reworded_text_numbers_and_code_spans_do_not_count():
    ours = ("Requests already running go before the queue, since people watch their output. "
            "positions 6 7 8 41 9 0 1 2 3 for `build_batch(scheduled, block_tables, block_size)`.")
    assert shared_runs(words(ours), words(SOURCE), 5) == [], "digits and code spans break every run"


def test_python_files_contribute_comments_and_strings_only():
    code = 'def f(running, requests, first, because, they, hold, blocks):  # and their users\n    return "x"\n'
    got = [w for w, _ in python_prose(code) if w]
    assert got == ["and", "their", "users", "x"]


def test_command_exits_1_when_a_run_is_too_long(tmp_path, capsys):
    src, ours = tmp_path / "src.md", tmp_path / "ours.md"
    src.write_text(SOURCE)
    ours.write_text("so: running requests first because they hold blocks and their users are watching the stream")
    assert main([str(src), "--files", str(ours)]) == 1
    assert "14 words" in capsys.readouterr().out
    assert main([str(src), "--files", str(ours), "--words", "14"]) == 0
