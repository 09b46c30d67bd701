"""Run one offline script on the course engine and on vLLM, and diff what they return.

    .venv/bin/python scripts/vllm_same_script.py [--vllm-python PATH] [--script FILE] [--workdir DIR]
        [--model DIR [--record FILE]]

1. writes a tiny HF checkpoint (``scripts/tiny_hf_checkpoint.py``) that both engines load, or
   takes ``--model DIR`` as it is (e.g. ``models/qwen3-kjv-tiny``, the repository's real model);
2. runs ``--script`` (default ``scripts/offline_same_script.py``) with this Python on the course
   engine, and with vLLM's Python (``--vllm-python``, else ``$VLLM_PYTHON``, else
   ``.venv-peers/bin/python`` in the repository, which ``make bench-peers`` builds) with
   ``SAME_SCRIPT_ENGINE=vllm``, which switches the script's import line;
3. compares every greedy output field by field (token ids, text, finish and stop reasons,
   cached-token counts, prompt logprobs to 3 decimals) and, for sampled runs, only their shape.

Prints one line per run and exits 0 when everything compared is identical, 1 otherwise, 2 when
vLLM's environment is missing. ``--record FILE`` also writes vLLM's outputs with its version and
the model's path (``tests/vllm_kjv_tiny.json`` is one: ``tests/test_tiny_model.py`` checks the
course engine against it where vLLM is not installed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def diff_runs(ours: dict, theirs: dict) -> list[str]:
    """Differences between two runs of the script's JSON, as readable lines ([] = identical)."""
    problems = []
    for name in sorted(set(ours) | set(theirs)):
        if name not in ours or name not in theirs:
            problems.append(f"{name}: only in {'ours' if name in ours else 'vLLM'}")
            continue
        a, b = ours[name], theirs[name]
        if len(a) != len(b):
            problems.append(f"{name}: {len(a)} outputs vs {len(b)}")
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            keys = ["prompt", "prompt_token_ids", "finished"]
            if x["compare"]:
                keys += ["num_cached_tokens", "prompt_logprobs"]
            for k in keys:
                if x[k] != y[k]:
                    problems.append(f"{name}[{i}].{k}: ours {x[k]!r} vs vLLM {y[k]!r}")
            if len(x["outputs"]) != len(y["outputs"]):
                problems.append(f"{name}[{i}]: {len(x['outputs'])} completions vs {len(y['outputs'])}")
                continue
            for c, d in zip(x["outputs"], y["outputs"]):
                fields = (["index", "text", "token_ids", "finish_reason", "stop_reason", "cumulative_logprob"]
                          if x["compare"] else ["index", "finish_reason"])
                for k in fields:
                    if c[k] != d[k]:
                        problems.append(f"{name}[{i}].outputs[{c['index']}].{k}: ours {c[k]!r} vs vLLM {d[k]!r}")
                if not x["compare"] and len(c["token_ids"]) != len(d["token_ids"]):
                    problems.append(f"{name}[{i}].outputs[{c['index']}]: {len(c['token_ids'])} tokens vs "
                                    f"{len(d['token_ids'])}")
    return problems


def summary(ours: dict, theirs: dict) -> list[str]:
    lines = []
    for name in ours:
        rows = ours[name]
        n_tok = sum(len(c["token_ids"]) for r in rows for c in r["outputs"])
        what = "greedy" if all(r["compare"] for r in rows) else "sampled (shape only)"
        bad = diff_runs({name: rows}, {name: theirs.get(name, [])}) if name in theirs else ["missing"]
        lines.append(f"  {name:30s} {what:22s} {len(rows)} prompt(s) {n_tok:4d} tokens  "
                     f"{'identical' if not bad else f'{len(bad)} difference(s)'}")
    return lines


def run_script(python: str, script: Path, model: Path, out: Path, vllm: bool) -> dict:
    env = dict(os.environ)
    env.pop("SAME_SCRIPT_ENGINE", None)
    if vllm:
        env.update(SAME_SCRIPT_ENGINE="vllm", PYTHONDONTWRITEBYTECODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    else:
        env.setdefault("ENGINE_IMPL", "solution")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([python, str(script), "--model", str(model), "--out", str(out)], env=env,
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{'vLLM' if vllm else 'the course engine'} failed on {script.name} (exit {proc.returncode})")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", str(ROOT / ".venv-peers" / "bin" / "python")))
    ap.add_argument("--script", default=str(ROOT / "scripts" / "offline_same_script.py"))
    ap.add_argument("--workdir", default=None, help="keep the checkpoint and both JSON files here")
    ap.add_argument("--model", default=None, help="an existing HF checkpoint directory instead of the random tiny one")
    ap.add_argument("--record", default=None, metavar="FILE", help="also write vLLM's outputs (with its version) here")
    args = ap.parse_args(argv)
    if not Path(args.vllm_python).exists():
        print(f"no vLLM environment at {args.vllm_python}: build it with `make bench-peers` or pass --vllm-python",
              file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="same-script-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "scripts"))
    from tiny_hf_checkpoint import save_tiny_checkpoint

    model = Path(args.model).resolve() if args.model else save_tiny_checkpoint(work / "tiny-qwen3")
    script = Path(args.script).resolve()
    ours = run_script(sys.executable, script, model, work / "ours.json", vllm=False)
    theirs = run_script(args.vllm_python, script, model, work / "vllm.json", vllm=True)
    problems = diff_runs(ours, theirs)
    if args.record:
        version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True, check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout.split()[-1]
        where = str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model)
        Path(args.record).write_text(json.dumps({"vllm_version": version, "model": where, "runs": theirs}, indent=1) + "\n")
        print(f"recorded vLLM {version}'s outputs in {args.record}")
    print(f"{script.name} on the course engine and on vLLM ({args.vllm_python}), checkpoint {model}:")
    print("\n".join(summary(ours, theirs)))
    for p in problems:
        print("  DIFF", p)
    print(f"{'identical' if not problems else f'{len(problems)} difference(s)'}; outputs in {work}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
