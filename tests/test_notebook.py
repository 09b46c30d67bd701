"""The chapter notebook runs from top to bottom against the reference, and is stored clean."""
from __future__ import annotations

from pathload import load_by_path

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "31-engine-v2.ipynb"
EXECUTED = ROOT / "notebooks" / "executed" / "31-engine-v2.ipynb"  # what a reader sees on the repository's page

pytestmark = pytest.mark.given  # the notebook runs the reference in its own kernel


def notebooks_tool():
    """course/figures/notebooks.py, loaded by path (the repository root need not be on sys.path)."""
    return load_by_path("_ch31_notebooks_tool", "course/figures/notebooks.py")


def test_notebook_is_stored_without_outputs():
    assert notebooks_tool().strip([NOTEBOOK], verify=True) == 0, \
        "the stored notebook carries outputs (nbstripout would strip it): `python -m course.figures.notebooks --clean`"


def _pictures(nb) -> list[bytes]:
    import base64

    return [base64.b64decode(out["data"]["image/png"]) for cell in nb.cells if cell.cell_type == "code"
            for out in cell.outputs if "image/png" in out.get("data", {})]


def test_executed_copy_is_current_and_shows_its_pictures():
    """notebooks/executed/ holds the walkthrough as `make notebooks` ran it: the same cells as the
    stored notebook (so it cannot lag behind an edit), no error or warning in its outputs, and its
    five pictures with something drawn in them (thousands of pixels off the background, many colours)."""
    import io

    import matplotlib.image as mimage
    import nbformat
    import numpy as np

    assert EXECUTED.is_file(), "the executed copy is missing: `make notebooks` writes it"
    clean, executed = nbformat.read(NOTEBOOK, as_version=4), nbformat.read(EXECUTED, as_version=4)
    assert [(c.cell_type, c.source) for c in executed.cells] == [(c.cell_type, c.source) for c in clean.cells], \
        "notebooks/executed/ lags behind the notebook: rerun `make notebooks`"
    outputs = [out for cell in executed.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"], "a cell of the executed copy failed"
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr and "Traceback" not in stderr, stderr[:300]
    pictures = _pictures(executed)
    assert len(pictures) == 5, f"expected the walkthrough's 5 pictures, got {len(pictures)}"
    for i, png in enumerate(pictures):
        pixels = mimage.imread(io.BytesIO(png))[..., :3]  # [H, W, 3] floats in [0, 1]
        background = pixels[0, 0]
        drawn = int((np.abs(pixels - background).sum(axis=-1) > 0.1).sum())
        colours = len(np.unique(pixels.reshape(-1, 3), axis=0))
        assert drawn > 5_000 and colours > 50, f"picture {i + 1} is close to empty ({drawn} px, {colours} colours)"


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


def test_lab_serves_the_walkthrough_and_runs_it(tmp_path):
    """What `make lab` starts: JupyterLab's server, here on a free loopback port with a token. It
    serves /lab, hands out the walkthrough through its contents API, starts a kernel for it through
    its sessions API, and every code cell, sent through that kernel's websocket, runs without an
    error, drawing the walkthrough's five pictures. (The notebooks extra, which `make setup`
    installs, brings JupyterLab.)"""
    import asyncio
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    import uuid

    import nbformat
    from tornado.websocket import websocket_connect

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = uuid.uuid4().hex
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "ENGINE_IMPL": "solution", "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    server = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
                               f"--port={port}", f"--ServerApp.token={token}", f"--ServerApp.root_dir={ROOT}",
                               "--ServerApp.port_retries=0", *(["--allow-root"] if os.geteuid() == 0 else [])],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def call(method, path, body=None):
        req = urllib.request.Request(base + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()

    try:
        for _ in range(240):  # the server's start-up, bounded: 2 minutes
            if server.poll() is not None:
                raise AssertionError(f"the Jupyter server exited: {server.stderr.read()[-2000:]}")
            try:
                call("GET", "/api/status")
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise AssertionError("the Jupyter server did not answer on its port within 2 minutes")
        status, page = call("GET", "/lab")
        assert status == 200 and b"JupyterLab" in page
        status, body = call("GET", "/api/contents/notebooks/31-engine-v2.ipynb?content=1")
        served = nbformat.from_dict(json.loads(body)["content"])
        assert [c.source for c in served.cells] == [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells]
        status, body = call("POST", "/api/sessions", {"path": "notebooks/31-engine-v2.ipynb", "type": "notebook",
                                                      "kernel": {"name": "python3"}})
        kernel_id = json.loads(body)["kernel"]["id"]

        async def run_cells():
            ws = await websocket_connect(f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels?token={token}")
            errors, pictures = [], 0
            for cell in served.cells:
                if cell.cell_type != "code":
                    continue
                msg_id = uuid.uuid4().hex
                await ws.write_message(json.dumps({
                    "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                               "session": kernel_id, "version": "5.3"},
                    "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                    "content": {"code": cell.source, "silent": False, "store_history": True,
                                "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
                while True:
                    raw = await asyncio.wait_for(ws.read_message(), timeout=300)
                    assert raw is not None, "the kernel's websocket closed"
                    msg = json.loads(raw)
                    if msg.get("parent_header", {}).get("msg_id") != msg_id:
                        continue
                    kind = msg["msg_type"]
                    if kind == "error":
                        errors.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")
                    elif kind in ("display_data", "execute_result") and "image/png" in msg["content"]["data"]:
                        pictures += 1
                    elif kind == "status" and msg["content"]["execution_state"] == "idle":
                        break
            ws.close()
            return errors, pictures

        errors, pictures = asyncio.run(run_cells())
        assert errors == [], errors
        assert pictures == 5, f"expected the walkthrough's 5 pictures, got {pictures}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
