"""ctest's doctest discovery splits test-case names on ',' and ';': such a case becomes several ctest
entries that each match no test and pass without running anything (this can hide a failing
test). Every C++ test-case name must be free of both."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_cpp_test_case_names_have_no_list_separators():
    names = []
    for source in sorted((ROOT / "tests" / "cpp").rglob("*.cpp")):
        names += [(source.name, n) for n in re.findall(r'TEST_CASE\("([^"]*)"\)', source.read_text())]
    assert len(names) > 20, "no C++ test cases found: the pattern no longer matches the sources"
    bad = [f"{file}: {name}" for file, name in names if "," in name or ";" in name]
    assert not bad, "test-case names that ctest would split:\n" + "\n".join(bad)
