"""The tests the docs cite as proof (`tests/FILE.py::test_name`) exist under those names."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `tests/a.py`, `tests/a.py::test_x`, and `::test_y` meaning the file cited last before it
CITED = re.compile(r"`(tests/[\w/]+\.py)?(::[\w\[\],.-]+)?`")


def citations(text: str):
    """(file, test name or None) for each citation in a doc's text."""
    last = None
    for match in CITED.finditer(text):
        path, test = match.group(1), match.group(2)
        if path:
            last = path
            yield path, None
        if test and last:
            yield last, test[2:].split("[")[0]


DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [
    os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "README.md")]


def test_citations_are_read_as_meant():
    text = "`tests/a.py::test_x`, `::test_y[1]`; `tests/b.py` and `::test_z`"
    assert list(citations(text)) == [("tests/a.py", None), ("tests/a.py", "test_x"),
                                     ("tests/a.py", "test_y"), ("tests/b.py", None),
                                     ("tests/b.py", "test_z")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: os.path.relpath(d, ROOT))
def test_every_cited_test_exists(doc):
    with open(doc, encoding="utf-8") as fh:
        text = fh.read()
    missing = []
    for path, test in citations(text):
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            missing.append(path)
        elif test is not None:
            with open(full, encoding="utf-8") as fh:
                if not re.search(rf"^\s*(def|class) {re.escape(test)}\b", fh.read(), re.M):
                    missing.append(f"{path}::{test}")
    assert not missing, f"{os.path.relpath(doc, ROOT)} cites tests that do not exist: {missing}"
