"""Imported by the harness runner's forkserver before it forks ranks, when every megatron-core run of a case
imports the interpreter's own megatron: megatron-core's import (~1 s) is then paid once, not once per rank.
Not preloaded when a run names its megatron (``--megatron-base / --megatron-head``: each rank imports its own,
`source.activate`) or runs on CUDA
(importing megatron initialises CUDA, which a forked rank then cannot use)."""
from megatron_trainer import worker  # noqa: F401  the worker's own guard (forkserver: SIGINT ignored) first

try:                            # the optional extra: without it the harness says so before anything runs
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
except ImportError:
    pass
