"""The bench scripts' refusals: one line naming the script and what is wrong, on stderr, exit 2, before anything is
measured or written (the project's rule for bad input, README "Bad input")."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn, Optional


def fail(line: str) -> NoReturn:
    """Print ``<script>: <line>`` to stderr and exit 2."""
    print(f"{Path(sys.argv[0]).stem}: {line}", file=sys.stderr)
    raise SystemExit(2)


def out_file(arg: Optional[str]) -> Optional[Path]:
    """`--out` checked before any work: a file path (not a directory) in an existing directory; None stays None."""
    if arg is None:
        return None
    out = Path(arg)
    if not arg.strip() or out.is_dir() or not out.parent.is_dir():
        fail(f"--out {arg!r}: expected a file in an existing directory")
    return out
