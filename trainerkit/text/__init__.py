"""The training text the repo ships (README.md beside this file: its source and license), read and checked.

Standard library only, so any Python can check the bytes (tests read them under every interpreter the machine
has); `trainerkit.data` turns the documents into token arrays.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

#: The shipped text: CPython 3.11.7's language-reference topics, one document per topic.
PATH = Path(__file__).resolve().parent / "python-3.11.7-topics.txt"
SHA256 = "a00e91188694bf3fde928dd4d764282d2c5a06c779993ba2e112fbb69a3df38b"
#: Documents are separated by a line holding only a form feed (no topic contains one).
SEPARATOR = b"\n\f\n"
#: How the default source is named in messages.
NAME = "the shipped training text"


class TextError(ValueError):
    """The shipped text is missing or not the pinned bytes (message: one line naming the file)."""


def documents(path: Path = PATH, sha256: str = SHA256) -> list[bytes]:
    """The text's documents as UTF-8 bytes, in file order, after checking the file's sha256.

    Raises:
        TextError: the file is unreadable, or its sha256 is not `sha256` (an edited, re-encoded or
            line-ending-converted checkout).
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TextError(f"{path}: {NAME} is unreadable ({e.strerror or e})") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != sha256:
        raise TextError(f"{path}: sha256 {digest[:16]}... is not the pinned {sha256[:16]}... ({NAME} was changed; "
                        "restore it with `git checkout -- trainerkit/text`)")
    return raw.split(SEPARATOR)
