"""Helpers the docs tests share: where the docs are, and running one of their examples."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"

PRINTED = re.compile(r"^\s*print\(.*\)\s*#\s*(.*)$")
OUTPUT = re.compile(r"^\s*#\s?(.*)$")  # a print's output on the line below it


def run_block(
    code: str, tmp_path: Path, name: str = "docs/migrating-from-orbax.md"
) -> tuple[list[str], list[str]]:
    """Run one example (its /tmp/ paths moved below ``tmp_path``) in a fresh namespace:
    (what it printed, what its ``print(...)  # output`` lines say it prints; a print with
    no comment of its own says it on the comment line below it)."""
    for path in set(re.findall(r'"/tmp/([\w-]+)"', code)):
        code = code.replace(f'"/tmp/{path}"', repr(str(tmp_path / path)))
    assert '"/tmp/' not in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # dont_inherit: not our __future__ imports
        exec(compile(code, name, "exec", dont_inherit=True), {"__name__": "example"})
    lines = code.splitlines()
    expected: list[str] = []
    for n, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        inline = PRINTED.match(line)
        below = OUTPUT.match(lines[n + 1]) if n + 1 < len(lines) else None
        said = inline or below
        assert said, f"every print(...) says what it prints: {line}"
        expected.append(said[1])
    return printed.getvalue().splitlines(), expected
