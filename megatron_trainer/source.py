"""Which megatron-core a rank will import, read without importing it: an installed release, a Megatron-LM
checkout ahead of it on sys.path (PYTHONPATH), or the directory a run names (``RunConfig.megatron_path``,
`activate`), with its version and commit.  The harness records it in every manifest and the compatibility layer
decides by it whether its points were checked (`compat.version_checked`)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional


class SourceError(ValueError):
    """A directory that does not hold megatron-core, or a megatron already imported from elsewhere."""


def _core_dir(path: Optional[str]) -> Optional[Path]:
    if path is not None:
        core = Path(path) / "megatron" / "core"
        return core if (core / "__init__.py").is_file() else None
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def installed_root() -> Optional[str]:
    """The directory holding the ``megatron/`` of the installed megatron-core distribution (its site-packages;
    the checkout of an editable install), found through the distribution's metadata whatever is ahead of it on
    sys.path; None when megatron-core is not installed."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).replace("\\", "/") == "megatron/core/__init__.py":
            return str(Path(dist.locate_file(f)).resolve().parent.parent.parent)
    text = dist.read_text("direct_url.json") or ""      # editable: the checkout it points at
    url = re.search(r'"url"\s*:\s*"file://([^"]+)"', text)
    if url and (Path(url.group(1)) / "megatron" / "core" / "__init__.py").is_file():
        return str(Path(url.group(1)).resolve())
    return None


def activate(path: Optional[str]) -> None:
    """Make `path` (a directory holding ``megatron/``) the megatron-core this process imports: first on
    sys.path.  Call before anything imports megatron.  None: leave the interpreter's own.

    Raises:
        SourceError: `path` holds no ``megatron/core``, or megatron is (already) imported from elsewhere (a
            forkserver that preloaded another source).
    """
    if path is None:
        return
    root = Path(path).resolve()
    if _core_dir(str(root)) is None:
        raise SourceError(f"{path}: no megatron/core/ in it")
    loaded = sys.modules.get("megatron.core")
    if loaded is not None:
        # abspath, not resolve: a megatron/ that is a symlink inside `path` still comes from `path`
        where = Path(os.path.abspath(loaded.__file__)).parent.parent.parent
        if where != root:
            raise SourceError(f"megatron is already imported from {where}, not {root}")
        return
    if str(root) not in sys.path[:1]:
        sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    # ``megatron`` is a namespace package (no __init__.py): every sys.path entry holding a megatron/ adds to it,
    # and megatron.core comes from the first; find_spec locates it without running it
    where = _core_dir(None)
    if where is None or Path(os.path.abspath(where)).parent.parent != root:
        raise SourceError(f"megatron.core would be imported from {where}, not from {root}")


@lru_cache(maxsize=None)
def megatron_source(path: Optional[str] = None) -> Optional[dict]:
    """The megatron-core a rank will import, without importing it: the one in `path` (a directory holding
    ``megatron/``, `activate`), or with None the first ``megatron/core`` on sys.path (an installed release or a
    Megatron-LM checkout on PYTHONPATH).  {"path": the directory holding ``megatron/``, "version": from its
    ``megatron/core/package_info.py`` (MAJOR.MINOR.PATCH + PRE_RELEASE), "commit": the git commit when it is a
    checkout, else None, "modified": whether files of ``megatron/`` differ from that commit (None when no
    checkout)}; None when there is none."""
    core = _core_dir(path)
    if core is None:
        return None
    version = None
    try:
        info = (core / "package_info.py").read_text()
        parts = {k: re.search(rf"^{k}\s*=\s*['\"]?([^'\"\s]*)['\"]?", info, re.M) for k in
                 ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")}
        if all(parts[k] for k in ("MAJOR", "MINOR", "PATCH")):
            version = ".".join(parts[k].group(1) for k in ("MAJOR", "MINOR", "PATCH")) + (
                parts["PRE_RELEASE"].group(1) if parts["PRE_RELEASE"] else "")
    except OSError:
        pass
    if version is None and path is None and installed_root() == str(core.parent.parent.resolve()):
        try:        # the installed distribution's own files: its metadata speaks for them
            version = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            pass
    version = version or "unknown"
    commit, dirty = None, False
    try:    # a checkout's commit; not the commit of a repository that merely contains a venv with the release
        out = subprocess.run(["git", "-C", str(core), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and (Path(lines[0]) / "megatron" / "core").resolve() == core.resolve():
            commit = lines[1]
            # edits on top of the commit (a merge request's working tree, a planted change) are not the commit
            status = subprocess.run(["git", "-C", str(core.parent), "status", "--porcelain", "--untracked-files=no",
                                     "--", "."], capture_output=True, text=True, timeout=10)
            dirty = status.returncode != 0 or bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return {"path": str(core.parent.parent.resolve()), "version": version, "commit": commit,
            "modified": dirty if commit else None}
