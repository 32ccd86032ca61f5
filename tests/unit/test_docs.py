"""The docs' promises point at tests that exist: each row of the model contract's table names the test that
proves it, and a renamed or removed test must not leave a row that cites nothing."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CITED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(\[[^\]]+\])?`((?:, `\[[^\]]+\]`)*)")


def cited_tests(doc: str) -> list[tuple[str, str, list[str]]]:
    """(file, test, [parameter ids]) for every test a doc cites as `file::test[id]`, `[id]`, ..."""
    found = []
    for m in CITED.finditer((ROOT / doc).read_text()):
        ids = re.findall(r"\[([^\]]+)\]", (m.group(3) or "") + m.group(4))
        found.append((m.group(1), m.group(2), ids))
    return found


def test_every_row_of_the_model_contract_cites_a_test_that_exists():
    doc = (ROOT / "docs/model-contract.md").read_text()
    table = doc[doc.index("## What `fit` accepts") : doc.index("## What trains as in `fit`")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| What")]
    assert len(rows) >= 20
    for row in rows:
        assert CITED.search(row), f"a row of the model contract cites no test: {row}"
    for path, name, ids in cited_tests("docs/model-contract.md"):
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"docs/model-contract.md cites {path}::{name}: no such test"
        for param in ids:
            # A parametrized test's id: each part is a value its parametrization names (a module, a strategy).
            for part in param.split("-"):
                assert f'"{part}"' in source, f"docs/model-contract.md cites {path}::{name}[{param}]: no {part!r}"
