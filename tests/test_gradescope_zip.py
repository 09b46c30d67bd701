"""``make gradescope``'s autograder.zip (course/grading/gradescope.py ``bundle``): setup.sh and
run_autograder at its root and executable, the course's files under their paths (the reference
included: the grader needs it; nothing ignored, no venv), earlier submissions' fingerprints as a store
of hashes; run_autograder passes that store to the grader. The bundle graded end to end from a fresh
clone is tests/test_gradescope.py (make test-course)."""
from __future__ import annotations

import json
import subprocess
import zipfile

import copy_cases as cases
from course.copies import copycheck
from course.grading import gradescope


def test_the_zip_has_the_scripts_at_its_root_and_the_course_under_its_paths(tmp_path):
    store = tmp_path / "earlier.json"
    copycheck.save_prints(store, {"2025-alice": copycheck.fingerprint(cases.learner({"EngineCore.step"}))})
    names = gradescope.bundle(tmp_path / "autograder.zip", prior=store)
    with zipfile.ZipFile(tmp_path / "autograder.zip") as z:
        listed = {i.filename: i for i in z.infolist()}
        assert set(listed) == set(names)
        for name in ("setup.sh", "run_autograder"):
            assert (listed[name].external_attr >> 16) & 0o777 == 0o755, name
            script = tmp_path / name
            script.write_bytes(z.read(name))
            subprocess.run(["bash", "-n", str(script)], check=True)  # it parses
        assert {"engine/serve/blocks.py", "solutions/serve/blocks.py", "course/grading/grade.py", "Makefile",
                "pyproject.toml", "tests/test_ch31_engine_v2.py"} <= set(listed)
        assert not [n for n in listed if n.startswith((".venv", "grades/", "gradescope/", ".git/", "notebooks/"))
                    or "__pycache__" in n]
        prior = json.loads(z.read("prior_fingerprints.json"))
        assert set(prior["submissions"]) == {"2025-alice"} and "EngineCore.step" in prior["submissions"]["2025-alice"]
        setup = z.read("setup.sh").decode()
    assert "download.pytorch.org/whl/cpu" in setup and '".[dev]"' in setup and "bubblewrap" in setup


def test_run_autograder_gives_the_bundled_store_to_the_grader(tmp_path, monkeypatch):
    import course.grading.grade as g

    seen = []

    def fake_grade_main(argv):
        seen.append(argv)
        raise RuntimeError("stop here")

    monkeypatch.setattr(g, "grade_main", fake_grade_main)
    monkeypatch.setattr(gradescope, "ROOT", tmp_path)
    monkeypatch.setenv("AUTOGRADER_ROOT", str(tmp_path / "ag"))
    copycheck.save_prints(tmp_path / gradescope.PRIOR, {})
    assert gradescope.run(["--seed", "3"]) == 0
    assert seen[0][-2:] == ["--prior", str(tmp_path / gradescope.PRIOR)] and "--seed" in seen[0]
    doc = json.loads((tmp_path / "ag/results/results.json").read_text())
    gradescope.check_results(doc)  # the grader failed: still a valid results.json, 0 points
    assert doc["score"] == 0
