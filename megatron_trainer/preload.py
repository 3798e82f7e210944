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
from trainerkit.process import PRELOAD_SOURCE_ENV, import_before_fork

#: what a rank imports after the fork unless it is here: the rank's own module (`megatron_trainer.train`, which
#: imports the model, options, checkpoint and optimizer views) and what megatron imports lazily while building a
#: model and its optimizer (the layer specs, MLA, MTP, HybridModel, the optimizer's mimo import on 0.19).  Measured
#: (py-spy of tests/cases/megatron-small.yaml's ranks, megatron-core 0.19.2): 14 % of a rank's samples were these
#: imports when only the first four modules were preloaded.  A module a release does not have is skipped.
_MODULES = ("megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
            "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer.multi_latent_attention",
            "megatron.core.transformer.multi_token_prediction", "megatron.core.optimizer.distrib_optimizer",
            "megatron.core.models.mimo", "megatron.core.models.hybrid.hybrid_model",
            "megatron_trainer.train", "megatron_trainer.compat_tp", "megatron_trainer.compat_hybrid",
            "megatron_trainer.compat_overlap", "megatron_trainer.compat_distopt")

try:                            # the optional extra: without it the harness says so before anything runs
    activate(os.environ.get(PRELOAD_SOURCE_ENV) or None)
    import megatron.core  # noqa: F401
except (ImportError, SourceError):
    pass
else:
    import_before_fork(_MODULES)
