"""Copy detection by similarity (course/copies/copycheck.py, course/copies/fingerprint.py): holes
written independently are not flagged; the reference padded with no-ops, renamed into reordered
helpers, or with junk lines is; so are classmates sharing code, a submission like an earlier one (a
store of fingerprints, no code), and a hole that hands its job to given code. The cases are built in
tests/copy_cases.py (``python tests/copy_cases.py`` prints the table of scores in docs/grading.md)."""
from __future__ import annotations

import json

import pytest

import copy_cases as cases
from course.copies import copycheck as cc
from course.grading.grade import flag_kind, status_of_doc
from course.learner.holes import all_holes, fill
from course.learner.testrun import reference_files

HOLES = {h.qualname for h in all_holes()}
MINE = {q for rel in cases.BODIES for q in cases.BODIES[rel]}  # the holes tests/learner_fill.py writes


@pytest.fixture(scope="module")
def ref():
    return reference_files()


@pytest.fixture(scope="module")
def honest():
    return cases.honest()


def _flagged(flags: list[str]) -> set[str]:
    """The holes named by a checkout's copy flags."""
    return {q for f in flags if flag_kind(f) == "copy" for q in HOLES if q in f}


def test_independent_bodies_are_not_flagged_against_the_reference(honest):
    flags = cc.reference_flags(honest)
    assert _flagged(flags) == HOLES - MINE, flags  # only the holes it took from the reference
    assert not [f for f in flags if "similar to the reference" in f or "hands its job" in f], flags


@pytest.mark.parametrize("build", [cases.no_op_per_hole, cases.renamed_into_helpers, cases.renamed_with_junk,
                                   cases.swapped])
def test_the_reference_padded_renamed_or_split_into_helpers_is_flagged_at_every_hole(ref, build):
    assert _flagged(cc.reference_flags(build(ref))) == HOLES


def test_the_reference_with_junk_that_runs_is_flagged_where_similarity_can_tell(ref):
    """Live junk (calls no normalisation may drop) breaks equality: the holes compared for equality
    only (short, or CONSTRAINED) go unflagged, every other one is flagged as similar."""
    sizes = {q: p["size"] for q, p in cc.hole_prints(ref).items()}
    told = {q for q in HOLES if q not in cc.CONSTRAINED and sizes[q] >= cc.MIN_TOKENS}
    assert len(told) == 11
    flags = cc.reference_flags(cases.live_junk(ref))
    assert _flagged(flags) == told and "similar to the reference" in flags[0], flags


def test_similarity_separates_the_independent_bodies_from_the_copies(ref, honest):
    from course.copies.fingerprint import similarity

    R, H = cc.hole_prints(ref), cc.hole_prints(honest)
    compared = [q for q in MINE if min(R[q]["size"], H[q]["size"]) >= cc.MIN_TOKENS and q not in cc.CONSTRAINED]
    assert len(compared) >= 7, compared
    best_honest = max(similarity(H[q]["prints"], R[q]["prints"]) for q in compared)
    assert best_honest < cc.REF_SIMILAR, best_honest
    for build in (cases.renamed_with_junk, cases.live_junk):  # junk that normalisation drops, and junk that runs
        J = cc.hole_prints(build(honest))
        worst_copy = min(similarity(H[q]["prints"], J[q]["prints"]) for q in compared)
        assert worst_copy > cc.PAIR_SIMILAR + 0.1, (build.__name__, worst_copy)
    for q, measured in cc.CONSTRAINED.items():  # the holes compared for equality only, and why
        assert similarity(H[q]["prints"], R[q]["prints"]) == pytest.approx(measured, abs=0.01)


def test_classmates_sharing_code_are_a_pair_and_independent_ones_are_not(ref, honest):
    a, b = cc.fingerprint(honest), cc.fingerprint(cases.renamed_with_junk(honest, per_hole=10))
    assert set(a) == MINE and set(b) == MINE  # the reference's holes are flagged on their own, not paired
    pairs = cc.similar_pairs({"alice": a, "bob": b, "carol": {q: p for q, p in cc.hole_prints(ref).items()
                                                              if q in MINE}})
    assert [(x, y) for x, y, _ in pairs] == [("alice", "bob")], pairs
    holes = dict(pairs[0][2])
    assert set(holes) == {q for q in MINE if q not in cc.CONSTRAINED and b[q]["size"] >= cc.MIN_TOKENS
                          and a[q]["size"] >= cc.MIN_TOKENS} and min(holes.values()) >= 0.9, holes


def test_a_pair_is_flagged_as_similarity_and_the_status_is_copy(honest):
    docs = {i: {"flags": [], "fingerprint": cc.fingerprint(files), "trial": None, "unsafe": False, "problems": []}
            for i, files in (("alice", honest), ("bob", cases.renamed_with_junk(honest)))}
    rewritten = []
    cc.cross_flags(docs, {}, rewritten.append)
    assert sorted(rewritten) == ["alice", "bob"]
    assert docs["alice"]["flags"][0].startswith("8 hole(s) similar to bob (fingerprints of the normalised syntax")
    assert status_of_doc(docs["alice"]) == status_of_doc(docs["bob"]) == "copy"


def test_earlier_submissions_are_kept_as_fingerprints_and_compared(tmp_path, honest):
    store = tmp_path / "prior.json"
    cc.save_prints(store, {"2025-alice": cc.fingerprint(honest)})
    text = store.read_text()
    assert "request_id" not in text and "self" not in text  # hashes and sizes: no code
    prior = cc.load_prior(store)
    flags = cc.similar_to_prior(cc.fingerprint(cases.renamed_with_junk(honest)), prior)
    assert len(flags) == 1 and "similar to 2025-alice (an earlier submission)" in flags[0], flags
    assert cc.similar_to_prior(cc.fingerprint(reference_files()), prior) == []
    folder = tmp_path / "earlier"
    folder.mkdir()
    store.rename(folder / "2025.json")
    assert set(cc.load_prior(folder)) == {"2025-alice"}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "k": [3, 1], "submissions": {}}))
    with pytest.raises(ValueError, match="rebuild it"):
        cc.load_prior(bad)
    with pytest.raises(ValueError, match="no such file"):
        cc.load_prior(tmp_path / "missing")


FORWARD = "engine/serve/attention.py"


@pytest.mark.parametrize("body", [
    "        from engine.fast.torch_attention import TorchBackend\n"
    "        return TorchBackend().forward(q, cache, meta, scale=scale, window=window)\n",
    "        from engine.serve.registry import get_backend\n"
    "        backend = get_backend('torch')\n"
    "        out = backend.forward(q, cache, meta, scale, window)\n"
    "        return out\n",
])
def test_a_hole_that_hands_its_job_to_given_code_is_flagged(ref, body):
    files = {**ref, "serve/attention.py": fill(ref["serve/attention.py"], {"ReferenceBackend.forward": body})}
    found = cc.delegations(files)
    assert [q for q, _, _ in found] == ["ReferenceBackend.forward"], found
    assert any("hands its job to given code" in f and flag_kind(f) == "copy" for f in cc.reference_flags(files))


def test_delegation_through_a_helper_is_flagged_and_honest_calls_are_not(ref, honest):
    assert [q for q, _, _ in cc.delegations(cases.delegating(ref))] == ["ReferenceBackend.forward"]
    assert cc.delegations(ref) == [] and cc.delegations(honest) == []  # FlatModel.attention calls backend.forward


def test_a_folder_run_flags_the_pair_and_a_later_run_compares_with_the_stored_fingerprints(tmp_path, monkeypatch):
    """grade_main with grading stubbed (the sandboxed run is tests/test_gradescope.py): the pair's rows say
    copy, the independent one ok; the run stores its fingerprints, and ``--prior`` on them flags a copy
    handed in later."""
    import csv

    import course.grading.grade as g
    from test_grade_outputs import fake_doc

    class FakeSession:
        def __init__(self, opts):
            self.opts, self.seed = opts, 1

    def fake_grade(checkout, session, jobs=1):
        files = g.read_checkout(checkout)[0]
        return {**fake_doc(checkout, 1.0), "flags": cc.reference_flags(files), "fingerprint": cc.fingerprint(files)}

    monkeypatch.setattr(g, "Session", FakeSession)
    monkeypatch.setattr(g, "grade", fake_grade)
    mine = cases.learner(MINE)
    folder = tmp_path / "class"
    for who, files in (("alice", mine), ("bob", cases.renamed_with_junk(mine)),
                       ("carol", cases.learner(set(), reference_files()))):
        root = folder / who
        for rel, text in files.items():
            (root / "engine" / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / "engine" / rel).write_text(text)
    out = tmp_path / "grades"
    assert g.grade_main(["--folder", str(folder), "--out", str(out)]) == 0

    def table(where):
        with open(where / "grades.csv", newline="") as f:
            return {r["checkout"].rsplit("/", 1)[-1]: r for r in csv.DictReader(f)}

    rows = table(out)
    assert {n: r["status"] for n, r in rows.items()} == {"alice": "copy", "bob": "copy", "carol": "copy"}
    assert "copy: 8 hole(s) similar to " in rows["alice"]["flags"] and "carol" not in rows["alice"]["flags"]
    assert rows["carol"]["flags"].startswith("copy: 14 hole(s) equal to the reference"), rows["carol"]["flags"]
    notes = json.loads((out / rows["bob"]["id"] / "results.json").read_text())["tests"][-1]["output"]
    assert "similar to " + rows["alice"]["id"] in notes  # results.json rewritten with the pair's flag
    store = out / "fingerprints.json"
    assert set(cc.load_prior(store)) == {rows["alice"]["id"], rows["bob"]["id"]}  # carol: all the reference's

    later = tmp_path / "later"
    (later / "dave").mkdir(parents=True)
    (folder / "alice" / "engine").rename(later / "dave" / "engine")
    out2 = tmp_path / "grades2"
    assert g.grade_main(["--folder", str(later), "--out", str(out2), "--prior", str(store)]) == 0
    dave = table(out2)["dave"]
    assert dave["status"] == "copy" and "(an earlier submission)" in dave["flags"], dave["flags"]
