"""The bug records' loader (course/quality/records.py): a bad record is refused with a message that
names its file and record, before any runner sees it. Self-contained (its own small files, its own
`where`), so it runs in the handout too, which has no records of its own."""
from __future__ import annotations

import pytest

from course.quality.records import REQUIRED, RecordError, load

FIELDS = {"name": (str, REQUIRED), "hole": (str, REQUIRED), "why": (str, REQUIRED), "find": (str, REQUIRED),
          "replace": (str, REQUIRED), "cause": (tuple, ())}
BODY = "    x = a + b\n    return x\n"
GOOD = """
[[bug]]
name = 'adds-one'
hole = 'build_batch'
why = 'one too many'
find = '''
    x = a + b
'''
replace = '''
    x = a + b + 1
'''
cause = ['sum']
"""


def _load(tmp_path, text: str) -> list[dict]:
    path = tmp_path / "bugs.toml"
    path.write_text(text)
    return load(path, "bug", FIELDS, lambda r: (BODY, f"the reference body of {r['hole']}"))


def test_a_good_record_reads_back_exactly(tmp_path):
    (rec,) = _load(tmp_path, GOOD)
    assert rec == {"name": "adds-one", "hole": "build_batch", "why": "one too many", "find": "    x = a + b\n",
                   "replace": "    x = a + b + 1\n", "cause": ("sum",)}
    (rec,) = _load(tmp_path, GOOD.replace("cause = ['sum']\n", ""))
    assert rec["cause"] == (), "an optional field left out takes its default"


@pytest.mark.parametrize("edit, says", [
    (("why = 'one too many'\n", ""), "'adds-one': missing field(s) why"),
    (("cause = ['sum']", "cause = ['sum']\nseverity = 3"), "'adds-one': unknown field(s) severity"),
    (("cause = ['sum']", "cause = 'sum'"), "'adds-one': wrongly typed field(s) cause"),
    (("name = 'adds-one'\n", ""), "#1 (no name): missing field(s) name"),
    (("hole = 'build_batch'", "hole = 'build_batches'"), "'adds-one': not a hole of the chapter"),
    (("    x = a + b\n'''\nreplace", "    x = a - b\n'''\nreplace"),
     "'adds-one': its find text does not occur in the reference body of build_batch"),
])
def test_a_bad_record_is_refused_by_name(tmp_path, edit, says):
    text = GOOD.replace(*edit)
    assert text != GOOD
    with pytest.raises(RecordError, match="bugs.toml: \\[\\[bug\\]\\] ") as err:
        _load(tmp_path, text)
    assert says in str(err.value), str(err.value)


def test_a_repeated_name_and_an_empty_file_are_refused(tmp_path):
    with pytest.raises(RecordError, match="#2 'adds-one': the name repeats"):
        _load(tmp_path, GOOD + GOOD)
    with pytest.raises(RecordError, match="no \\[\\[bug\\]\\] records"):
        _load(tmp_path, "# nothing here\n")
    with pytest.raises(RecordError, match="not valid TOML"):
        _load(tmp_path, GOOD + "[[bug]\n")
