"""The grader's outputs for the instructor, with grading itself replaced by a stub (fast): one folder per
checkout that never collides, grades.csv with numeric score / status / per-hole columns, re-grading one
checkout updates its row only, a -k trial never touches a real grade, a warning per skipped folder, and
no grading at all without a sandbox unless --unsafe."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import course.grading.grade as g


def fake_doc(checkout: Path, score: float, trial: str | None = None, unsafe: bool = False) -> dict:
    holes = [asdict_row(h.qualname, g.WEIGHTS[h.qualname], score) for h in g.all_holes()]
    return {"checkout": str(checkout), "commit": None, "graded_at": "", "seconds": 1.0, "seed": 1,
            "sandbox": "bwrap", "unsafe": unsafe, "trial": trial, "holes": holes,
            "milestone": asdict_row("milestone", 10, score), "engine_checks": asdict_row("engine checks", 10, score),
            "holes_passed": 0, "holes_total": len(holes), "score": round(score * 50, 2), "max_score": 50.0,
            "edits_outside_holes": [], "problems": [], "flags": [], "fingerprint": "", "raw_output": "raw"}


def asdict_row(name: str, weight: float, frac: float) -> dict:
    from dataclasses import asdict

    return asdict(g.Row(name, "f", 1, 1, "pass", weight, round(weight * frac, 2)))


@pytest.fixture
def stubbed(monkeypatch):
    scores: dict[str, float] = {}

    class FakeSession:
        def __init__(self, opts):
            self.opts, self.seed = opts, 1

    monkeypatch.setattr(g, "Session", FakeSession)
    monkeypatch.setattr(g, "grade", lambda checkout, session, jobs=1: fake_doc(
        checkout, scores.get(checkout.parent.name, 1.0), session.opts.keyword or None))
    return scores


def rows(out: Path) -> dict[str, dict]:
    with open(out / "grades.csv", newline="") as f:
        return {r["id"]: r for r in csv.DictReader(f)}


def test_outputs_never_collide_and_regrading_updates_one_row(tmp_path, stubbed, capsys):
    folder = tmp_path / "class"
    for who in ("alice", "bob"):
        (tmp_path / who / "ch31" / "engine").mkdir(parents=True)
    (folder / "not-a-checkout").mkdir(parents=True)
    out = tmp_path / "grades"
    a, b = tmp_path / "alice" / "ch31", tmp_path / "bob" / "ch31"
    stubbed.update(alice=1.0, bob=0.5)
    assert g.grade_main([str(a), str(b), "--folder", str(folder), "--out", str(out)]) == 0
    assert "warning: skipped" in capsys.readouterr().err
    got = rows(out)
    ids = {g.checkout_id(a), g.checkout_id(b)}
    assert set(got) == ids and len(ids) == 2, got.keys()
    assert {float(r["score"]) for r in got.values()} == {50.0, 25.0}
    assert all(r["status"] == "ok" and float(r["build_batch"]) in (3.0, 1.5) for r in got.values())
    for i in ids:
        assert json.loads((out / i / "grade.json").read_text())["checkout"] in (str(a), str(b))
    stubbed["bob"] = 0.2
    g.grade_main([str(b), "--out", str(out)])
    again = rows(out)
    assert float(again[g.checkout_id(b)]["score"]) == 10.0 and float(again[g.checkout_id(a)]["score"]) == 50.0
    stubbed["bob"] = 0.0
    g.grade_main([str(b), "--out", str(out), "-k", "hash_block"])
    assert float(rows(out)[g.checkout_id(b)]["score"]) == 10.0, "a -k trial changed the real grade"
    assert json.loads((out / g.checkout_id(b) / "grade.json").read_text())["score"] == 10.0
    assert (out / "trials" / g.checkout_id(b) / "grade.json").is_file()


def test_a_roster_names_the_folders(tmp_path, stubbed):
    (tmp_path / "x" / "engine").mkdir(parents=True)
    roster = tmp_path / "roster.csv"
    roster.write_text(f"id,path\ns123,{tmp_path / 'x'}\n")
    g.grade_main(["--roster", str(roster), "--out", str(tmp_path / "out")])
    assert (tmp_path / "out" / "s123" / "results.json").is_file() and "s123" in rows(tmp_path / "out")


def test_no_sandbox_means_no_grading_unless_unsafe(monkeypatch):
    monkeypatch.setattr("course.isolation.sandbox.find_bwrap", lambda: None)
    with pytest.raises(ValueError, match="--unsafe"):
        g.Session(g.Options())


def test_results_json_has_gradescopes_fields_and_hides_raw_output(tmp_path):
    from course.grading.gradescope import check_results

    doc = g.gradescope(fake_doc(tmp_path, 0.5))
    check_results(doc)
    assert "raw" not in json.dumps([t for t in doc["tests"] if t["visibility"] == "visible"])
    assert isinstance(doc["execution_time"], int) and doc["stdout_visibility"] == "hidden"
