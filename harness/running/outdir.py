"""Report directories under ``--out``: ownership marker, one writer per case, atomic replacement.

``--out`` may point anywhere (a repository clone, a home directory), so bitparity deletes or replaces only
directories it made: each report and partial directory holds `MARKER`.  A case is written as
``OUT/.<case>.partial/`` under an exclusive lock ``OUT/.<case>.lock`` and then swapped with ``OUT/<case>/``
so that ``OUT/<case>`` always holds a complete report, the old one or the new one.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from ..errors import UsageError

MARKER = ".bitparity-report"
MARKER_TEXT = "bitparity-report/1\n"
_LOCK_TEXT = "bitparity verify pid {pid}\n"
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _paths(out_root: Path, case: str) -> tuple[Path, Path, Path, Path]:
    """(final, partial, aside, lock): the report, its work dir, the fallback's parking place, the lock file."""
    return (out_root / case, out_root / f".{case}.partial", out_root / f".{case}.old", out_root / f".{case}.lock")


def _ours(path: Path, legacy_ok: bool = False) -> bool:
    """Whether `path` is a directory bitparity wrote.  With `legacy_ok`, a report from before the marker
    (a summary.json naming this case) counts too, so upgrading does not lock users out of their --out."""
    if path.is_symlink() or not path.is_dir():
        return False
    if (path / MARKER).is_file():
        return True
    if not legacy_ok:
        return False
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("case") == path.name and "variants" in summary


def check(out_root: Path, case: str) -> None:
    """Raises UsageError, writing nothing, when a report of `case` could not be written under `out_root`: the
    nearest existing ancestor of `out_root` is not a directory or not writable, or `_check` refuses.  For
    commands that write a report only after a long search (`bitparity fuzz`)."""
    ancestor = Path(os.path.abspath(out_root))
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"--out {out_root}: not a directory" + ("" if ancestor == Path(os.path.abspath(out_root))
                                                                 else f" ({ancestor})"))
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out_root}: permission denied ({ancestor})")
    _check(out_root, case)


def _check(out_root: Path, case: str) -> None:
    """Raises UsageError if --out is not a directory or a path bitparity would replace is not its own."""
    if out_root.exists() and not out_root.is_dir():
        raise UsageError(f"--out {out_root}: not a directory")
    final, partial, aside, _ = _paths(out_root, case)
    for path in (final, partial, aside):
        if os.path.lexists(path) and not _ours(path, legacy_ok=path == final):
            raise UsageError(f"{path} exists and was not written by bitparity (no {MARKER} in it); not replacing "
                             "it: move it away or choose another --out")


def _mark(path: Path) -> None:
    (path / MARKER).write_text(MARKER_TEXT)


def _remove(path: Path) -> None:
    """Delete a marked directory, the marker last: an interrupted delete leaves a directory still marked,
    which the next run may delete, instead of an unmarked one it must refuse."""
    for entry in os.scandir(path):
        if entry.name != MARKER:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / MARKER)
    os.rmdir(path)


def _discard(path: Path) -> None:
    """Best-effort `_remove` of a marked leftover; what stays is removed by the next run."""
    if _ours(path):
        with contextlib.suppress(OSError):
            _remove(path)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where the kernel, libc or file
    system lacks it.  Raises OSError for any other failure (nothing was swapped)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)   # glibc >= 2.28
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(work: Path, final: Path) -> None:
    """Make the complete report `work` the report `final` (which must be ours, see `workspace`).

    With renameat2 `final` holds the complete old or the complete new report at every moment.  Without it
    the old report is parked at ``.<case>.old`` for the instant between two renames: put back if the second
    fails, and by the next `workspace` if the process is killed in between.  Failing to delete the old report
    afterwards is not an error (it stays marked; the next run deletes it).

    Raises OSError if the new report could not be moved in (the old one is then still in place)."""
    if not os.path.lexists(final):
        os.rename(work, final)
        _fsync_dir(final.parent)
        return
    if not (final / MARKER).is_file():
        _mark(final)                            # a legacy report (`_ours`): marked, so its leftovers may go
    if _exchange(work, final):
        _discard(work)                          # the old report, now at the partial path
    else:
        aside = final.with_name(f".{final.name}.old")
        os.rename(final, aside)
        try:
            os.rename(work, final)
        except BaseException:
            os.rename(aside, final)
            raise
        _discard(aside)
    _fsync_dir(final.parent)


@contextlib.contextmanager
def _lock(path: Path, final: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (the holder's pid inside).  Raises UsageError if another process
    holds it.  The file is unlinked before it is unlocked, so nothing stays behind."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 100, 0).decode(errors="replace").split()
            os.close(fd)
            pid = holder[-1] if holder[:3] == ["bitparity", "verify", "pid"] and len(holder) == 4 else "unknown"
            raise UsageError(f"another bitparity verify is writing {final} (pid {pid})") from None
        try:   # a holder that finished unlinked the file we opened: lock the new one instead
            st, now = os.fstat(fd), os.stat(path)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, _LOCK_TEXT.format(pid=os.getpid()).encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def workspace(out_root: Path, case: str) -> Iterator[tuple[Path, Path]]:
    """Lock the case and yield ``(work, final)``: a fresh marked ``OUT/.<case>.partial`` to fill and publish
    to ``final`` with `publish`.  On exit (a crash included) the partial directory is gone and the lock free.

    Raises UsageError, before anything is written, if --out is not a directory, a path it would replace was
    not written by bitparity, or another `bitparity verify` holds the case's lock."""
    out_root = Path(out_root)
    _check(out_root, case)
    final, work, aside, lock = _paths(out_root, case)
    out_root.mkdir(parents=True, exist_ok=True)
    with _lock(lock, final):
        _check(out_root, case)                  # again: things may have changed until we got the lock
        if os.path.lexists(aside):              # a fallback swap was killed half-way: finish or undo it
            if os.path.lexists(final):
                _remove(aside)
            else:
                os.rename(aside, final)
        if os.path.lexists(work):
            _remove(work)                       # a run killed without cleaning up
        try:
            work.mkdir()
            _mark(work)
            yield work, final
        finally:
            _discard(work)
            with contextlib.suppress(OSError):  # made, but marking it failed: empty, and ours
                work.rmdir()
