"""Loading a Hugging Face checkpoint directory into our Qwen3 / Qwen3-MoE modules.

A checkpoint directory holds ``config.json`` and the weights, either one ``model.safetensors``
or several shards listed by ``model.safetensors.index.json``. ``load_model(path)`` reads the
config into a :class:`Qwen3Config` (``engine.models.hf_config``), builds the module on the ``meta`` device (shapes only, no
memory), checks every tensor name and shape in the files against the module BEFORE reading any
data, and then reads the tensors one at a time straight into the module's parameters. Peak
memory is therefore the model plus one tensor, never two copies of the model.

Name mapping: our modules use HF's parameter names, so most tensors load under their own name.
Two HF habits need care:

* a tied LM head (``tie_word_embeddings``) is normally absent from the files; the head then
  shares the embedding's tensor;
* Qwen3-MoE experts are written per expert (``mlp.experts.E.gate_proj.weight`` ...), but a file
  written straight from transformers 5's in-memory layout holds them fused per layer:
  ``mlp.experts.gate_up_proj`` [E, 2I, D] (gate rows first, then up rows) and
  ``mlp.experts.down_proj`` [E, D, I]. We accept both and slice the fused form per expert.

Everything this module rejects, it rejects with a ``ValueError`` that names the file, field or
tensor at fault and says what would fix it.
"""
from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.models.hf_config import checkpoint_dir, read_config, read_json_object, resolve_dtype
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[Qwen3ForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# Tensors some checkpoints carry that hold nothing we need (RoPE tables are recomputed).
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
# transformers 5 in-memory (fused) expert layout, one tensor per layer for all experts.
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)(\.weight)?$")
_SHOWN = 8  # how many names an error message lists before "... and N more"


def weight_files(path: str | os.PathLike) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file that holds it.

    Uses ``model.safetensors.index.json`` when present, else ``model.safetensors``, else every
    ``*.safetensors`` file in the directory.
    """
    root = checkpoint_dir(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"{index}: not a valid safetensors index (needs a 'weight_map' object "
                             "from tensor names to shard file names)")
        files = {name: _shard_path(root, index, fname) for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if f.exists() and not f.is_file():
                raise ValueError(f"{index} lists shard {f.name!r}, which is not a regular file ({_file_kind(f)})")
            if not f.is_file():
                raise ValueError(f"{index} lists shard {f.name!r}, which is missing from {root}; "
                                 "re-download the checkpoint")
        return files
    single = root / "model.safetensors"
    shards = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    for shard in shards:  # a named pipe, socket or device would block or stream forever when read
        if not shard.is_file():
            raise ValueError(f"{shard} is not a regular file ({_file_kind(shard)}); a weights file must be "
                             "one (or a symlink to one): remove it from the checkpoint")
    if not shards:
        bins = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt*"))
        hint = (f" (found {bins}: pickle files are never loaded, since unpickling runs code; "
                "convert them to safetensors first)" if bins
                else "; download the weights next to config.json")
        raise ValueError(f"{root}: no weights file (model.safetensors, or shards with "
                         f"model.safetensors.index.json){hint}")
    files: dict[str, Path] = {}
    for shard in shards:
        with _open(shard) as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"tensor {name!r} appears in both {files[name].name} and "
                                     f"{shard.name}; remove the stray file")
                files[name] = shard
    return files


def _file_kind(path: Path) -> str:
    """What ``path`` is, in a word, when it is not a regular file."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "a broken link"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((word for test, word in kinds if test(mode)), "not a plain file")


def _shard_path(root: Path, index: Path, name: str) -> Path:
    """``root / name`` for a shard name from the index, which must name a file inside ``root``.

    Checked on the name itself, not on the resolved path: in the HF cache every file of a snapshot
    is a symlink into ``../../blobs/``, and that must keep working, while an index entry such as
    ``../other/x.safetensors`` or ``/etc/x`` must not reach outside the checkpoint.
    """
    parts = PurePosixPath(name).parts
    if (not name or "\\" in name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive
            or any(p in ("..", ".") for p in parts) or "\0" in name):
        raise ValueError(f"{index}: shard name {name!r} must be a plain file name inside {root} "
                         "(no absolute path, no '..'); the index is corrupt or hostile")
    return root.joinpath(*parts)


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes we load


@contextmanager
def _open(file: Path, device: str = "cpu") -> Iterator[Any]:
    """``safe_open`` on one weights file; any failure to read it is a ValueError naming the file."""
    try:
        with safe_open(file, framework="pt", device=device) as f:
            yield f
    except ValueError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for bad files
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e}); "
                         "the download may be truncated or corrupt") from None


@dataclass(frozen=True)
class _Source:
    """Where one model parameter's data lives: ``file[key]``, or a slice of a fused tensor."""

    file: Path
    key: str
    expert: int | None = None  # fused expert tensor: take [expert]
    rows: tuple[int, int] | None = None  # ... and then rows [a, b) of that


def _plan(model: Qwen3ForCausalLM, files: dict[str, Path], root: Path) -> dict[str, _Source]:
    """Decide where every parameter comes from, and check names and shapes (no data is read)."""
    cfg = model.cfg
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    sources: dict[str, _Source] = {}
    unexpected: list[str] = []
    shapes = _shapes(files)
    for key, file in files.items():
        if _IGNORED.match(key) or (cfg.tie_word_embeddings and key == "lm_head.weight"):
            continue  # a tied head's copy is redundant: the head uses the embedding
        fused = _FUSED_EXPERTS.match(key)
        if fused and cfg.is_moe:
            shape = shapes[key]
            inter, hidden, e = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
            want = (e, 2 * inter, hidden) if fused["kind"] == "gate_up_proj" else (e, hidden, inter)
            if shape != want:
                raise ValueError(f"{file.name}: fused expert tensor {key!r} has shape {list(shape)}, "
                                 f"expected {list(want)} from config.json")
            p = fused["prefix"]
            for i in range(e):
                if fused["kind"] == "gate_up_proj":  # gate rows first, then up rows
                    sources[f"{p}.{i}.gate_proj.weight"] = _Source(file, key, i, (0, inter))
                    sources[f"{p}.{i}.up_proj.weight"] = _Source(file, key, i, (inter, 2 * inter))
                else:
                    sources[f"{p}.{i}.down_proj.weight"] = _Source(file, key, i)
            continue
        if key in expected:
            sources[key] = _Source(file, key)
        else:
            unexpected.append(key)
    missing = sorted(set(expected) - set(sources))
    problems = []
    if missing:
        hint = (" (an untied LM head is missing: set tie_word_embeddings=true in config.json if "
                "the model shares it with the embedding)" if missing == ["lm_head.weight"] else "")
        problems.append(f"missing tensors{hint}: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors (config.json does not describe them; wrong config or "
                        f"an unsupported variant?): {_names(sorted(unexpected))}")
    if problems:
        raise ValueError(f"{root}: checkpoint does not match config.json: " + "; ".join(problems))
    for name, src in sources.items():
        shape = shapes[src.key]
        if src.expert is None and shape != expected[name]:
            raise ValueError(f"{sources[name].file.name}: tensor {name!r} has shape {list(shape)} but "
                             f"config.json implies {list(expected[name])}")
    return sources


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the file headers (each file opened once, no data read)."""
    by_file: dict[Path, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    shapes = {}
    for file, keys in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise ValueError(f"the index lists tensor {key!r} in {file.name}, which does "
                                     "not hold it; re-download the checkpoint")
                sl = f.get_slice(key)
                if not _IGNORED.match(key) and sl.get_dtype() not in _FLOAT_DTYPES:
                    raise ValueError(f"{file.name}: tensor {key!r} has dtype {sl.get_dtype()}; this "
                                     f"engine loads floating-point weights only ({', '.join(_FLOAT_DTYPES)}), "
                                     "never casting integers (a quantized checkpoint?)")
                shapes[key] = tuple(sl.get_shape())
    return shapes


def _names(names: list[str]) -> str:
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Qwen3ForCausalLM:
    """Load an HF-format Qwen3 / Qwen3-MoE checkpoint directory; returns the model in eval mode.

    ``dtype``: None or "auto" keeps the checkpoint's (``torch_dtype`` / ``dtype`` in
    config.json, float32 when absent). ``device``: where the weights go (default CPU); on CUDA
    the tensors are read from the file straight onto the GPU.
    Invariant on return: every parameter is a real tensor of ``dtype`` on ``device`` (no meta
    tensor left), and a tied head IS the embedding tensor.
    """
    root = checkpoint_dir(path)
    arch, cfg, ckpt_dtype = read_config(root)
    dtype = resolve_dtype(dtype, default=ckpt_dtype)
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    files = weight_files(root)

    with torch.device("meta"):  # shapes only: the real tensors come from the files
        model = ARCHITECTURES[arch](cfg)
    sources = _plan(model, files, root)

    by_file: dict[Path, list[str]] = {}
    for name, src in sources.items():
        by_file.setdefault(src.file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with _open(file, device=str(device)) as f:
                for name in names:
                    src = sources[name]
                    if src.expert is None:
                        t = f.get_tensor(src.key)
                    else:  # read only this expert's slice of the fused tensor
                        sl = f.get_slice(src.key)
                        t = sl[src.expert] if src.rows is None else sl[src.expert, src.rows[0]:src.rows[1]]
                    _assign(model, name, t.to(dtype).contiguous())
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"parameters never loaded: {left}"
    return model.eval()


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the (meta) parameter ``name`` by ``tensor`` without copying it."""
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))
