"""Every engine kind, built twice in one process on one model and stepped from two threads at once.

Each engine owns its pools, its backend's per-step plan and its requests; what the kinds share (the
model's weights, the fused model's packed linears, the kernels' libraries) must be read-only while
they run. So two engines stepping at the same time in two threads must each give exactly the tokens
of ``generate()`` (float64) or of the same engine run alone (float32, where the fused kinds' small-batch
linear kernel is in use and summation order may move a greedy choice away from ``generate()``'s). (The compiled kind, which also shares one graph, is tested in
test_compiled.py.) One ``LLM`` driven by two threads is test_llm_api.py's.
"""
from __future__ import annotations

import os
import pathlib

import pytest
import torch

from engine.generate import generate
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams

from ch31_helpers import run_in_threads

pytestmark = pytest.mark.given  # complete code the chapter gives; the reference holes serve as oracle

KINDS = {
    "reference": {},
    "torch": {"attention_backend": "torch"},
    "cpu": {"attention_backend": "cpu"},
    "fused-torch": {"attention_backend": "torch", "flat_model": "fused"},
    "fused-cpu": {"attention_backend": "cpu", "flat_model": "fused"},
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_engines_of_one_kind_in_two_threads(kind, dtype):
    model = tiny_model(seed=3, dtype=dtype)
    gen = torch.Generator().manual_seed(17)
    prompts = [[torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in sizes]
               for sizes in ((23, 9, 14), (31, 6, 18))]
    cores = [EngineCore(model, EngineConfig(block_size=4, max_num_batched_tokens=12, **KINDS[kind]))
             for _ in prompts]
    results = run_in_threads(cores, prompts, 8)
    for i, core in enumerate(cores):
        if dtype == torch.float64:
            want = {f"r{j}": generate(model, p, 8) for j, p in enumerate(prompts[i])}
        else:
            alone = EngineCore(model, EngineConfig(block_size=4, max_num_batched_tokens=12, **KINDS[kind]))
            for j, p in enumerate(prompts[i]):
                alone.add_request(f"r{j}", p, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
            want = alone.run_until_done()
        assert results[i] == want, f"{kind} engine {i}: wrong tokens when another engine stepped at the same time"
        assert core.blocks.num_free == core.blocks.num_blocks


# --- Third round (issue 35): the kernels' build cache, the layout variable ---------------------------

def _script(path, body: str):
    import stat

    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_a_compiler_that_timed_out_is_not_started_again(tmp_path, monkeypatch):
    """Row 3: a $CXX that hangs is waited out once per process, not once per kernel and flag set
    (three kernels x two flag sets was half an hour before the default LLM() fell back)."""
    from engine.fast import cpu_attention, cpu_build, cpu_elementwise, cpu_linear

    log = tmp_path / "starts.log"
    slow = _script(tmp_path / "slow-c++", f"echo started >> {log}\nexec sleep 30\n")
    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(slow))
    monkeypatch.setattr(cpu_build, "COMPILE_TIMEOUT_S", 1)
    monkeypatch.setattr(cpu_build, "_hung_compilers", {}, raising=False)
    kernels = [cpu_build.OptionalKernels(k.SOURCE, lambda lib: None)
               for k in (cpu_attention, cpu_linear, cpu_elementwise)]
    for optional in kernels:
        assert optional.get() is None and "took longer than 1 s" in optional.why
    with pytest.raises(ValueError, match="not started again"):
        cpu_build.build_library(cpu_attention.SOURCE)
    assert log.read_text().split() == ["started"], "a compiler that timed out was started again"


def test_a_corrupt_cached_kernel_is_rebuilt(tmp_path, monkeypatch):
    """Row 6: a cached kernel that does not load (a torn or junk .so in the private cache) is built
    again, not an error every later process swallows; a compiler that "succeeds" with junk leaves
    no file in the cache and says so."""

    from engine.fast import cpu_attention, cpu_build

    monkeypatch.setattr(cpu_build, "_hung_compilers", {}, raising=False)
    monkeypatch.delenv("ENGINE_KERNEL_CACHE", raising=False)
    good = next(cpu_build.cache_dir().glob("cpu_paged_kernel-*.so"), None)
    if good is None:  # this process has not built it yet
        cpu_build.build_library(cpu_attention.SOURCE)
        good = next(cpu_build.cache_dir().glob("cpu_paged_kernel-*.so"))
    copier = _script(tmp_path / "copying-c++", f'while [ "$1" != -o ]; do shift; done\ncp {good} "$2"\n')
    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(copier))
    lib = cpu_build.kernel_path(str(copier), cpu_attention.SOURCE)
    lib.parent.mkdir(mode=0o700, parents=True)
    lib.write_bytes(b"not an ELF file")
    assert cpu_build.build_library(cpu_attention.SOURCE).paged_decode_float32 is not None
    assert lib.read_bytes()[:4] == b"\x7fELF", "the corrupt cache entry was not rebuilt"
    junk = _script(tmp_path / "junk-c++", 'while [ "$1" != -o ]; do shift; done\necho junk > "$2"\n')
    monkeypatch.setenv("CXX", str(junk))
    with pytest.raises(ValueError, match="not a loadable library.*CXX"):
        cpu_build.build_library(cpu_attention.SOURCE)
    assert not cpu_build.kernel_path(str(junk), cpu_attention.SOURCE).exists(), "junk was kept in the cache"


def test_a_remembered_kernel_failure_is_keyed_by_its_cause(tmp_path, monkeypatch):
    """Row 7: following the error's advice in the same process (a private ENGINE_KERNEL_CACHE, or
    another CXX) tries the build again; the same cache and compiler do not."""
    import shutil

    from engine.fast import cpu_attention, cpu_build

    open_cache = tmp_path / "shared-cache"
    open_cache.mkdir()
    open_cache.chmod(0o777)
    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(open_cache))
    monkeypatch.setenv("CXX", shutil.which("c++") or shutil.which("g++"))
    builds = []
    optional = cpu_build.OptionalKernels(cpu_attention.SOURCE, builds.append)
    assert optional.get() is None and str(open_cache) in optional.why
    assert optional.get() is None and not builds
    monkeypatch.delenv("ENGINE_KERNEL_CACHE")  # the default, private cache (built there by earlier tests)
    assert optional.get() is not None and len(builds) == 1 and optional.why is None


def test_a_bad_layout_variable_is_named(monkeypatch):
    """Row 8: ENGINE_LINEAR_LAYOUT=bogus: the ValueError says the value came from that variable
    (an explicit layout= argument's does not mention it)."""
    from engine.fast import linear_layout

    monkeypatch.setenv("ENGINE_LINEAR_LAYOUT", "bogus")
    with pytest.raises(ValueError, match=r"\$ENGINE_LINEAR_LAYOUT.*'bogus'"):
        linear_layout.forced_layout(None)
    with pytest.raises(ValueError, match="linear layout must be one of") as err:
        linear_layout.forced_layout("fastest")
    assert "ENGINE_LINEAR_LAYOUT" not in str(err.value)


def test_a_head_size_over_the_elementwise_kernels_limit_keeps_pytorch_for_that_seam():
    """Row 4: heads of 1040 (over cpu_elementwise.MAX_HEAD_DIM) on the fused CPU model: decided at
    construction, the q/k norm and RoPE keep the PyTorch code (the other seams their kernels), and
    the engine serves generate()'s greedy tokens instead of failing on its first step."""
    from engine.fast import cpu_elementwise
    from engine.fast.fused import FusedFlatModel

    if cpu_elementwise.library() is None:
        pytest.fail(f"the elementwise kernels did not build here: {cpu_elementwise._kernels.why}")
    model = tiny_model(seed=5, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=1040)
    prompt = [7, 3, 11, 2, 9]
    core = EngineCore(model, EngineConfig(block_size=4, attention_backend="torch", flat_model="fused"))
    core.add_request("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
    assert core.run_until_done()["r"] == generate(model, prompt, 6)
    fused = FusedFlatModel(model)
    assert fused.elementwise and not fused.qk_elementwise


@pytest.mark.parametrize("edit", ["data", "numpy"])
def test_weights_edited_in_place_keep_their_values_after_the_fused_model_is_built(tmp_path, monkeypatch, edit):
    """Row 1: a loaded (memory-mapped) model's weights edited in place through ``.data`` or a NumPy
    view (which do not move ``_version``), then a fused model built on it: release_pages must not
    drop those written pages (they would revert to the file's bytes). The model keeps its edited
    values, and the engine and generate() agree on them."""
    from engine.models import load_model
    from engine.models.mapped import mapped_file
    from engine.fast.fused import FusedFlatModel
    from course.bench.checkpoints import write_checkpoint

    source = tiny_model(seed=3, hidden_size=256, intermediate_size=768, head_dim=64)  # projections span whole pages
    model = load_model(write_checkpoint(source, tmp_path / "ckpt"))
    edited = [layer.mlp.down_proj.weight for layer in model.model.layers] + [model.model.layers[0].self_attn.o_proj.weight]
    for p in edited:
        assert mapped_file(p.detach()) is not None and p._version == 0
        if edit == "data":
            p.data.mul_(-1)
        else:
            view = p.detach().numpy()
            view *= -1
    assert all(p._version == 0 for p in edited), "the test needs edits that do not move _version"
    want = [p.detach().clone() for p in edited]
    fused = FusedFlatModel(model, layout="small")  # a copy per linear, so the originals' pages are offered back
    assert fused.layers[0]["down"].layout == "small"
    for p, w in zip(edited, want):
        assert torch.equal(p.detach(), w), "an edited weight reverted to the checkpoint's bytes"
    prompt = [7, 3, 11, 2, 9, 30]
    monkeypatch.setenv("ENGINE_LINEAR_LAYOUT", "small")  # the engine's fused model copies too (and skips the probe)
    core = EngineCore(model, EngineConfig(block_size=4, attention_backend="torch", flat_model="fused"))
    core.add_request("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
    assert core.run_until_done()["r"] == generate(model, prompt, 6)


def test_retraining_the_checkpoint_leaves_a_live_model_alone(tmp_path, monkeypatch):
    """Row 2: course/train/tiny.py's write_checkpoint over a checkpoint a live (memory-mapped) model
    was loaded from -- as `make train-tiny` does under `run.py generate`'s default model -- goes
    through a temporary file and a rename of its own, whatever ``save_file`` does: here one that
    rewrites its file in place (as some safetensors versions do; a shrunk file is then SIGBUS, a
    same-size one silently new weights under the live model). The live model keeps its weights,
    a model loaded afterwards gets the new ones, and no temporary file is left."""
    import safetensors.torch

    from course.train.tiny import write_checkpoint
    from engine.models import load_model
    from engine.models.mapped import mapped_file

    def in_place(tensors, path, metadata=None):
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:
            f.write(safetensors.torch.save(tensors, metadata=metadata))
            f.truncate()

    monkeypatch.setattr(safetensors.torch, "save_file", in_place)

    class Tok:  # what write_checkpoint asks of a tokenizer
        def token_to_id(self, token):
            return 0

        def save(self, path):
            pathlib.Path(path).write_text("{}")

    write_checkpoint(tiny_model(seed=3, tie_word_embeddings=True, dtype=torch.bfloat16), Tok(), tmp_path)
    live = load_model(tmp_path)
    assert all(mapped_file(p.detach()) is not None for p in live.parameters()), "the test needs a mapped model"
    before = {n: p.detach().clone() for n, p in live.named_parameters()}
    write_checkpoint(tiny_model(seed=4, tie_word_embeddings=True, dtype=torch.bfloat16), Tok(), tmp_path)
    for n, p in live.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} changed under the live model"
    fresh = dict(load_model(tmp_path).named_parameters())
    assert not all(torch.equal(fresh[n].detach(), before[n]) for n in before), "the new checkpoint was not written"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "a temporary file was left"


def test_a_template_of_few_heavy_lines_is_refused_early(monkeypatch):
    """Row 11: a template whose lines each do much bounded work (a replace() over a million
    characters, thousands of times) stays far under the line budget; the CPU budget refuses it
    (one ValueError naming it) instead of rendering for ~10 s. A real template is untouched."""
    from engine import chat_template

    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_CPU_S", 0.2, raising=False)
    heavy = chat_template.compile_template(
        "{% for i in range(3000) %}{% set x = ('a' * 1000000)|replace('a', 'b') %}{% endfor %}done")
    with pytest.raises(ValueError, match="chat template was stopped: it took more than 0.2 s of CPU time"):
        chat_template.render(heavy)
    plain = chat_template.compile_template("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert chat_template.render(plain, messages=[{"content": "hi"}] * 50) == "[hi]" * 50


def test_a_16bit_model_computed_in_float32_says_so():
    """Row 5 (the documented half): where a bfloat16 model's matmuls run in float32 (a CPU without
    bf16 units, or linear_dtype=float32), its greedy tokens may differ from generate()'s; the fused
    model says which ran (``numerics``, printed by `run.py generate`), and says nothing when the
    model's own dtype runs."""
    from engine.fast.fused import FusedFlatModel, fast_16bit_matmul

    bf16 = tiny_model(seed=3, dtype=torch.bfloat16)
    widened = FusedFlatModel(bf16, linear_dtype=torch.float32)
    assert widened.numerics and "bfloat16 model, matmuls in float32" in widened.numerics
    assert FusedFlatModel(bf16, linear_dtype=torch.bfloat16).numerics is None
    assert FusedFlatModel(tiny_model(seed=3)).numerics is None
    core = EngineCore(bf16, EngineConfig(block_size=4, attention_backend="torch", flat_model="fused"))
    assert (core.flat.numerics is None) == fast_16bit_matmul(torch.bfloat16, torch.device("cpu"))
