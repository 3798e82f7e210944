"""Imported by the harness runner's forkserver before it forks ranks, when every megatron-core run of a case
imports the same megatron (the interpreter's own, or the one directory ``$BITPARITY_FORKSERVER_SOURCE`` names:
``--megatron-head`` / ``--megatron-base`` / ``megatron_path``, put first on the path by `source.activate`, as each
rank would): megatron-core's import (~4 s of CPU on 2 cores) is then paid once, not once per rank.  Not preloaded
when a case's runs name two megatrons (each rank imports its own) or run on CUDA (importing megatron initialises
CUDA, which a forked rank then cannot use).

A megatron that cannot be activated or imported here is left to the ranks: each activates and imports it again,
fails the same way and reports it as the run's error (`trainerkit.preload` swallows what is not an ImportError).
"""
import os

from megatron_trainer import worker  # noqa: F401  the worker's own guard (forkserver: SIGINT ignored) first
from megatron_trainer.source import SourceError, activate
from trainerkit.process import PRELOAD_SOURCE_ENV

try:                            # the optional extra: without it the harness says so before anything runs
    activate(os.environ.get(PRELOAD_SOURCE_ENV) or None)
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
except (ImportError, SourceError):
    pass
