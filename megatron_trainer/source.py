"""Which megatron-core a rank will import, read without importing it: an installed release or a Megatron-LM
checkout ahead of it on sys.path (PYTHONPATH), with its version and commit.  The harness records it in every
manifest and the compatibility layer decides by it whether its points were checked (`compat.version_checked`)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Optional


@lru_cache(maxsize=None)
def megatron_source() -> Optional[dict]:
    """The megatron-core the ranks will import (the first ``megatron/core`` on sys.path: an installed release or
    a Megatron-LM checkout on PYTHONPATH), without importing it: {"path": the directory holding ``megatron/``,
    "version": from its ``megatron/core/package_info.py`` (MAJOR.MINOR.PATCH + PRE_RELEASE), "commit": the git
    commit when it is a checkout, else None}; None when there is none."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    core = Path(list(spec.submodule_search_locations)[0])
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
    if version is None:
        try:
            version = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    commit = None
    try:    # a checkout's commit; not the commit of a repository that merely contains a venv with the release
        out = subprocess.run(["git", "-C", str(core), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and (Path(lines[0]) / "megatron" / "core").resolve() == core.resolve():
            commit = lines[1]
    except (OSError, subprocess.SubprocessError):
        pass
    return {"path": str(core.parent.parent), "version": version, "commit": commit}
