"""The harness runner's forkserver preload: import the trainer modules named in ``$BITPARITY_FORKSERVER_PRELOAD``
(comma-separated, set by `harness.running.runner`) before any rank is forked, leaving any that fails to import to the
ranks.

Why not hand the names to multiprocessing's ``set_forkserver_preload`` directly: the forkserver swallows only an
``ImportError`` from its preload, and any other exception kills it before it serves a single fork.  Measured: a
syntax error in a copy's ``reference_impl/train.py`` (tests/planted.py) ended ``bitparity verify`` in
"internal error: EOFError" with no report, where a broken megatron trainer (imported in the rank) gave a
per-run error.  Here a module that cannot be imported, for whatever reason, is skipped; each rank imports it
again (`trainerkit.process.launch`), fails the same way and leaves the error's line in its log, so the run is an
``error`` whose reason names the import error, whatever the trainer.

The forkserver guard (`process.guard_forkserver`: die with the harness, SIGINT ignored) runs here first: a
worker module that cannot even be compiled never reaches its own call.
"""
from __future__ import annotations

import os

from . import process

process.guard_forkserver()
process.import_before_fork(filter(None, os.environ.get(process.PRELOAD_ENV, "").split(",")))
