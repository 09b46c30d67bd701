"""The chapter notebook runs from top to bottom against the reference, and is stored clean."""
from __future__ import annotations

from pathload import load_by_path

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "31-engine-v2.ipynb"

pytestmark = pytest.mark.given  # the notebook runs the reference in its own kernel


def notebooks_tool():
    """course/figures/notebooks.py, loaded by path (the repository root need not be on sys.path)."""
    return load_by_path("_ch31_notebooks_tool", "course/figures/notebooks.py")


def test_notebook_is_stored_without_outputs():
    assert notebooks_tool().strip([NOTEBOOK], verify=True) == 0, \
        "the stored notebook carries outputs (nbstripout would strip it): `python -m course.figures.notebooks --clean`"


def test_notebook_runs_top_to_bottom():
    nb = notebooks_tool().execute(NOTEBOOK, timeout=300)
    first = nb.cells[0]
    imports_engine = any(line.startswith(("import engine", "from engine")) for line in first.source.splitlines())
    assert first.cell_type == "code" and 'os.environ.setdefault("ENGINE_IMPL", "solution")' in first.source \
        and not imports_engine, "the first cell must choose the implementation before anything imports engine"
    text = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)
    assert "same greedy outputs with both pools: True" in text
    assert "idle: free blocks 16 of 16" in text
    # section 5: the shipped KJV model writes sentences that end by themselves, and a stop string cuts one
    assert text.count("finish_reason=stop]") >= 3 and "And God said" in text and "stop_reason=','" in text
    images = sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.outputs)
    assert images == 5, f"expected the notebook's 5 pictures, got {images}"


def test_chapter_figures_are_saved_small_and_match_what_the_code_draws(tmp_path):
    """The README's pictures come from `python -m course.figures.chapter`: two PNGs, tens of KB, and
    the committed ones show what the code draws today (their content digest, not their bytes or size:
    a stale title or trace fails, a different font rendering does not)."""
    tool = load_by_path("_ch31_chapter_figures", "course/figures/chapter.py")
    written = tool.save(tmp_path)
    assert sorted(p.name for p in written) == ["pool-trace.png", "worked-batch.png"]
    for path in written:
        head = path.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and 5_000 < path.stat().st_size < 100_000, path.name
    for path in written:
        committed = ROOT / "chapters" / "31-engine-v2" / "figures" / path.name
        assert committed.is_file(), \
            f"the README shows figures/{path.name}: regenerate it with `make figures`"
        fresh = tool.stored_digest(path)
        assert fresh is not None and len(fresh) == 64, path.name
        assert tool.stored_digest(committed) == fresh, \
            f"figures/{path.name} no longer shows what the code draws: regenerate it with `make figures`"


def test_content_digest_sees_a_changed_picture():
    """The digest the picture test compares changes with a title, a bar's height or a text, and not
    with the resolution a picture is saved at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tool = load_by_path("_ch31_chapter_figures", "course/figures/chapter.py")

    def drawn(title="pool of 1024 blocks", height=3.0, note="603 tokens"):
        fig, ax = plt.subplots(figsize=(3, 2))
        ax.bar([0, 1, 2], [1.0, 2.0, height])
        ax.set_title(title)
        ax.text(0.5, 0.5, note)
        digest = tool.content_digest(fig)
        plt.close(fig)
        return digest

    base = drawn()
    assert drawn() == base
    assert drawn(title="pool of 8192 blocks") != base
    assert drawn(height=3.5) != base
    assert drawn(note="333 tokens") != base
