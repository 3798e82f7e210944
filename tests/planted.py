"""Planted code changes: a copy of the project's Python packages with real source edits, for tests that must
show a check catching a bug that no ``--inject`` flag models (a same-on-every-layout bug, a tie-break change).

`planted_tree` copies ``harness``, ``reference_impl``, ``trainerkit`` and ``megatron_trainer`` into a
temporary directory and applies exact text replacements; running ``python -m harness`` with that directory as
the working directory imports the edited copy first (the rank processes inherit ``sys.path``).  Each edit must
match exactly once, so a test fails loudly when the code it plants into has moved.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from conftest import ROOT, run_cli

PACKAGES = ("harness", "reference_impl", "trainerkit", "megatron_trainer")


def planted_tree(dest: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """Copy the packages under `dest` and apply `edits` ({relative file: [(old, new), ...]}); returns `dest`.

    Raises:
        AssertionError: an `old` text occurs zero or several times in its file.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    return _edit(dest, edits)


def planted_megatron(dest: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """Copy the installed megatron-core's ``megatron/`` package under `dest` and apply `edits` (paths relative to
    `dest`, e.g. ``megatron/core/transformer/multi_token_prediction.py``); returns `dest`, a directory for
    ``verify --megatron-base / --megatron-head``.

    Raises:
        AssertionError: megatron-core is not installed, or an `old` text occurs zero or several times."""
    from megatron_trainer.source import installed_root
    root = installed_root()
    assert root is not None, "megatron-core is not installed"
    shutil.copytree(Path(root) / "megatron", dest / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    return _edit(dest, edits)


def _edit(dest: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    for rel, pairs in edits.items():
        path = dest / rel
        text = path.read_text()
        for old, new in pairs:
            assert text.count(old) == 1, f"{rel}: the planted change's anchor {old!r} occurs {text.count(old)} times"
            text = text.replace(old, new)
        path.write_text(text)
    return dest


def run_planted(tree: Path, *args, timeout=600, env=None):
    """``python -m harness ARGS`` importing the planted copy in `tree` (see `planted_tree`); `env`: variables
    added to the environment."""
    return run_cli(*args, cwd=tree, timeout=timeout, env=env)
