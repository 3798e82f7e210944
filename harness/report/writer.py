"""Writing a report directory: everything rendered first, then each file written atomically."""
from __future__ import annotations

import json
import os
import pathlib
import uuid

from harness.judging.results import CaseResult

from .cards import read_run_trace
from .chrome_trace import chrome_trace
from .html import render_html, render_run_page
from .junit import junit_xml
from .markdown import markdown_summary
from .summary_json import summary_dict
from .words import run_dir_of

#: Top-level output files, in the order they are written (the page last, once everything it links exists).
REPORT_FILES = ("summary.json", "junit.xml", "summary.md", "index.html")
#: Per-run outputs, written into each run's directory before the top-level files.
RUN_FILES = ("schedule.trace.json", "index.html")


def atomic_write(path: pathlib.Path, text: str) -> None:
    """Write `text` to `path` via a temp file in the same directory and `os.replace`.

    The temp file is created with mode 0o666 minus the umask (like a plain `open`), fsynced before
    the rename, and removed if anything fails.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    data = text.encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def run_contents(result: CaseResult, out_dir: pathlib.Path) -> dict[str, str]:
    """``{"<run_dir>/index.html": page, "<run_dir>/schedule.trace.json": trace}`` for every variant with a run
    directory inside `out_dir` (the trace only when it has a planned timeline)."""
    contents: dict[str, str] = {}
    for i, v in enumerate(result.variants):
        run_dir = run_dir_of(v)
        if run_dir is None:
            continue
        trace = chrome_trace(v, read_run_trace(v, out_dir))
        if trace is not None:
            # compact separators: a P=16 V=2 schedule has a thousand events
            contents[f"{run_dir}/schedule.trace.json"] = json.dumps(trace, separators=(",", ":")) + "\n"
        contents[f"{run_dir}/index.html"] = render_run_page(result, i, out_dir)
    return contents


def write_report(result: CaseResult, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Write index.html, summary.json, junit.xml, summary.md into `out_dir` (created if missing), and into each
    run's directory its detail page ``index.html`` and its schedule as a Chrome trace ``schedule.trace.json``.

    Returns the written paths keyed by their path relative to `out_dir`: ``{"summary.json": ...,
    "junit.xml": ..., "summary.md": ..., "index.html": ..., "runs/<variant>/index.html": ...,
    "runs/<variant>/schedule.trace.json": ...}``.  Everything is rendered before anything is written, so a
    rendering error leaves the directory untouched; each file is then written atomically (temp file +
    `os.replace`), the run files first and ``index.html`` last.
    """
    out_dir = pathlib.Path(out_dir)
    contents = run_contents(result, out_dir)
    contents.update({
        "summary.json": json.dumps(summary_dict(result), indent=2, ensure_ascii=False) + "\n",
        "junit.xml": junit_xml(result),
        "summary.md": markdown_summary(result, report_link="index.html"),
        "index.html": render_html(result, report_dir=out_dir),
    })
    out_dir.mkdir(parents=True, exist_ok=True)
    root = out_dir.resolve()
    order = [k for k in contents if k not in REPORT_FILES] + list(REPORT_FILES)
    paths: dict[str, pathlib.Path] = {}
    for rel in order:
        path = out_dir / rel
        if root not in path.resolve().parents:      # a run directory that is a link out of the report
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, contents[rel])
        paths[rel] = path
    for d in {p.parent for p in paths.values()}:
        _fsync_dir(d)
    return paths
