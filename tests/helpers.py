"""Helpers the docs tests share: where the docs are, and running one of their examples."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"

PRINTED = re.compile(r"^\s*print\(.*\)\s*#\s*(.*)$")


def run_block(code: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Run one example (its /tmp/ paths moved below ``tmp_path``): (what it printed, what
    its ``print(...)  # comment`` lines say it prints)."""
    for name in set(re.findall(r'"/tmp/([\w-]+)"', code)):
        code = code.replace(f'"/tmp/{name}"', repr(str(tmp_path / name)))
    assert '"/tmp/' not in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/migrating-from-orbax.md", "exec"), {"__name__": "example"})
    lines = [line for line in code.splitlines() if line.lstrip().startswith("print(")]
    expected = [m[1] for line in lines if (m := PRINTED.match(line))]
    assert len(expected) == len(lines), "every print(...) says what it prints"
    return printed.getvalue().splitlines(), expected
